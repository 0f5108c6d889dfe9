"""Constrained decoding: OpenAI's `response_format` (JSON mode, a JSON schema) as a mask on the
logits, computed by llguidance (a grammar engine kept by Microsoft's guidance project: a Rust
parser that gives the set of tokens allowed after any prefix).

The mask is applied inside `sampling.penalize`, so `warp` applies it to the draft's rows and the
target's alike, each with the tokens generated before its position (a verify call's row i sees
the draft tokens before it). Target-only decoding then samples from p' = the target's
distribution restricted to the allowed tokens, renormalised; speculative decoding verifies
against the same p' (Leviathan et al. 2023, Algorithm 1, with p' for p), so its output is
distributed exactly as p', and a draft that proposes from the masked q' is accepted as often as
q' agrees with p'. A row that follows a draft token the grammar refuses is never read: the
target gives that token probability 0, so it is rejected before the row matters.
"""

from __future__ import annotations

import json

import numpy as np

from .errors import InputError, install_extra

FORMATS = ("text", "json_object", "json_schema")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InputError(f"response_format needs the grammar engine llguidance: "
                         f"{install_extra('grammar')}") from None
    return llguidance


def grammar_of(response_format) -> str | None:
    """llguidance's grammar for OpenAI's `response_format` ({"type": "text"} or None: none;
    {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema":
    {"schema": {...}}}: JSON that the schema accepts), or InputError naming the fix."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in FORMATS:
        raise InputError(f"response_format {json.dumps(response_format)[:80]} is invalid: use "
                         f"{{\"type\": \"json_object\"}}, {{\"type\": \"json_schema\", "
                         f"\"json_schema\": {{\"schema\": {{...}}}}}}, or {{\"type\": \"text\"}}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InputError("response_format json_schema needs its schema: {\"type\": "
                             "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": "
                             "{...}}}")
    # compact JSON: a model left free to add whitespace may add it until the length limit
    return _llguidance().LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})


class Grammar:
    """A compiled tokenizer for llguidance, for one loaded bundle (about a second on a large
    vocabulary: made once per Generator)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos = sorted(int(t) for t in eos_token_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                         eos_token=self.eos or None)

    def constraint(self, grammar: str) -> "Constraint":
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"response_format cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.eos)


class Constraint:
    """One request's grammar state: `allowed(generated)` is the mask of the tokens the grammar
    allows after the tokens generated so far. The matcher follows the prefixes it is asked about
    by rolling back to the common prefix and consuming the rest, so a round's draft and verify
    rows, and the next round after a rejection, are all answered from one matcher."""

    def __init__(self, matcher, vocab_size: int, eos: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos
        self.consumed: list[int] = []

    def allowed(self, generated) -> np.ndarray | None:
        """bool [vocab_size]; None after a token the grammar refuses (a rejected draft's
        position, whose row is never read)."""
        generated = [int(t) for t in generated]
        same = 0
        for a, b in zip(self.consumed, generated):
            if a != b:
                break
            same += 1
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
            del self.consumed[same:]
        rest = generated[same:]
        if rest:
            if self.matcher.validate_tokens(rest) < len(rest):
                return None
            self.matcher.consume_tokens(rest)
            self.consumed += rest
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not mask.any():  # nothing can follow: only the end is left
            mask[self.eos] = True
        return mask
