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

The engine never raises on a grammar it cannot follow: it enters an error state (a schema
whose `anyOf` outgrows a parser row, `{"$ref": "#"}`, which matches no JSON at all, ...), where
its mask allows only the end of text. So a schema is checked before decoding (`Grammar.
constraint`: the engine's own validation, then its masks along a short walk of the grammar,
where those errors show up), and a matcher that fails later, or leaves no token to follow, ends
the request with a GrammarError, never with an end of text that looks like a finished answer.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import FieldError, install_extra

FORMATS = ("text", "json_object", "json_schema")
PROBE_TOKENS = 16  # tokens of the walk that checks a grammar before decoding
FIX = ("simplify the schema (at most 2000 alternatives in one anyOf, oneOf or enum; no $ref "
       "that can only refer to itself)")


class GrammarError(FieldError):
    """The grammar engine cannot follow a response_format's schema (or the tools' parameter
    schemas: `field`): before decoding (the request is refused) or during it (the request
    ends with this error, not with an end of text that looks like a finished answer)."""

    def __init__(self, message: str, field: str = "response_format"):
        super().__init__(field, message)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise FieldError("response_format", f"response_format needs the grammar engine "
                                            f"llguidance: {install_extra('grammar')}") from None
    return llguidance


def schema_of(response_format) -> dict | None:
    """The JSON schema OpenAI's `response_format` asks for ({"type": "text"} or None: none;
    {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema":
    {"schema": {...}}}: its schema), or FieldError naming the fix."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in FORMATS:
        raise FieldError("response_format",
                         f"response_format {json.dumps(response_format)[:80]} is invalid: use "
                         f"{{\"type\": \"json_object\"}}, {{\"type\": \"json_schema\", "
                         f"\"json_schema\": {{\"schema\": {{...}}}}}}, or {{\"type\": \"text\"}}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise FieldError("response_format",
                         "response_format json_schema needs its schema: {\"type\": "
                         "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": "
                         "{...}}}")
    return schema


def grammar_of(response_format) -> str | None:
    """llguidance's grammar for OpenAI's `response_format` (schema_of), or None for none."""
    schema = schema_of(response_format)
    if schema is None:
        return None
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
        self.token_id = tokenizer.token_to_id  # a token's id by its text (None: none)

    def constraint(self, grammar: str, field: str = "response_format") -> "Constraint":
        """One request's Constraint; FieldError naming `field` (the request field the grammar
        was made of) if the engine cannot compile `grammar`, GrammarError if it fails along
        the probe's walk."""
        llg = _llguidance()
        limits = llg.LLParserLimits(verbose_errors=False)  # errors without the parser's state
        # the matcher validates the grammar as it compiles it (what validate_grammar does, so
        # calling that too would compile it twice)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise FieldError(field, f"{field} cannot be compiled: "
                                    f"{_one_line(matcher.get_error())}")
        constraint = Constraint(matcher, self.vocab_size, self.eos, field)
        constraint.probe()
        return constraint


class Constraint:
    """One request's grammar state: `allowed(generated)` is the mask of the tokens the grammar
    allows after the tokens generated so far. The matcher follows the prefixes it is asked about
    by rolling back to the common prefix and consuming the rest, so a round's draft and verify
    rows, and the next round after a rejection, are all answered from one matcher."""

    def __init__(self, matcher, vocab_size: int, eos: list[int], field: str = "response_format"):
        self.matcher = matcher
        self.field = field  # the request field the grammar was made of, for its errors
        self.vocab_size = vocab_size
        self.eos = eos
        self.consumed: list[int] = []

    def allowed(self, generated) -> np.ndarray | None:
        """bool [vocab_size]; None after a token the grammar refuses (a rejected draft's
        position, whose row is never read). GrammarError where the engine fails or no token
        can follow."""
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
        return self._mask()

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():  # its mask would allow only the end: not an answer
            raise GrammarError(f"{self.field} cannot be followed: the grammar engine "
                               f"failed {self._where()} "
                               f"({_one_line(self.matcher.get_error())}); {FIX}", self.field)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not mask.any():
            if not self.matcher.is_accepting():
                raise GrammarError(f"{self.field} cannot be followed: no token of this "
                                   f"vocabulary can continue the JSON {self._where()}; {FIX}",
                                   self.field)
            mask[self.eos] = True  # complete, and nothing can follow: only the end is left
        return mask

    def _where(self) -> str:
        n = len(self.consumed)
        return f"after {n} token{'s' * (n != 1)}" if n else "at the start"

    def probe(self) -> None:
        """Walk the grammar for up to PROBE_TOKENS tokens (each step the lowest allowed token
        but the end) on a copy of the matcher: the errors a schema itself causes (a row past
        the engine's limit, a language with no JSON in it) show up in the first masks, so they
        are refused before decoding. Errors deeper in are caught as the request decodes."""
        walk = Constraint(self.matcher.deep_copy(), self.vocab_size, self.eos, self.field)
        for step in range(PROBE_TOKENS + 1):
            mask = walk._mask()  # GrammarError where the engine fails or nothing can follow
            mask[walk.eos] = False
            if step == PROBE_TOKENS or walk.matcher.is_stopped() or not mask.any():
                return  # far enough, or a whole JSON value with only the end left
            token = int(np.flatnonzero(mask)[0])
            walk.matcher.consume_token(token)
            walk.consumed.append(token)


# what the engine's terse messages mean for a schema
MEANINGS = {"NoExtensionBias": "NoExtensionBias: the schema matches no JSON value"}


def _one_line(message: str) -> str:
    """The engine's message on one line, without its `<state>` block."""
    lines = [line.strip() for line in message.strip().splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith("<"))
    return MEANINGS.get(text, text[:300])
