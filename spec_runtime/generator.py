"""The public generator: prompt in, tokens, text and statistics out.

`Generator` owns a target engine, an optional draft and an optional `tokenizers.Tokenizer`. It
validates requests, runs `decode`, handles text (stop strings, streaming) and nothing else; the
exported bundle is wired to it by `spec_runtime.load`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .decode import GammaPolicy, decode
from .errors import InputError
from .sampling import SamplingParams
from .stats import DecodeStats


@dataclass
class GenerationResult:
    tokens: list[int]  # the new token ids (an EOS that ended generation included)
    text: str | None  # decoded new text, special tokens skipped; None without a tokenizer
    stats: dict
    finish_reason: str  # "eos", "length" or "stop"


def check_text(text: str, what: str) -> None:
    """Text must be encodable: a lone surrogate (from bytes decoded with errors="surrogateescape",
    as Python does for command-line arguments) is not a character any tokenizer knows."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid Unicode: {text[e.start]!r} at character "
                         f"{e.start} is a lone surrogate; decode the bytes it came from as "
                         f"UTF-8 (errors='replace' to drop what is not)") from None


BYTES_PROMPT = ("the prompt is bytes: decode it to text first (prompt.decode('utf-8')), or pass "
                "token ids as a list of integers")


def token_list(prompt) -> list:
    """Token ids from a list, tuple, range or 1-D integer array; anything else is refused."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InputError(BYTES_PROMPT)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise InputError(f"the prompt is a {prompt.dtype} array of shape {prompt.shape}: "
                             f"give token ids as a 1-D integer array or a list of integers")
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise InputError(f"the prompt is a {type(prompt).__name__}: give text (str) or token ids "
                         f"(a list of integers)")
    return list(prompt)


def stop_strings(stop) -> tuple[str, ...]:
    """`stop` as a tuple of strings: None for none, one string for one (as the OpenAI API
    takes it), or a list or tuple of non-empty strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise InputError(f"stop={stop!r} is invalid: give a string or a list of strings")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InputError(f"stop string {s!r} is invalid: each stop string must be non-empty "
                             f"text")
    return tuple(stop)


class Generator:
    def __init__(
        self,
        target,
        draft=None,
        *,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        default_gamma: int = 4,
        max_gamma: int = 8,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
        encoder_decoder: bool = False,
        decoder_start_token_id: int | None = None,
    ):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.default_gamma = default_gamma
        self.max_gamma = max_gamma
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.encoder_decoder = encoder_decoder
        self.decoder_start_token_id = decoder_start_token_id
        vocabs = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
        self.vocab_size = min(vocabs)  # ids past a smaller vocabulary are padding, never input
        self._lock = threading.Lock()  # engines hold one request's cache: one request at a time
        self._owner: int | None = None  # thread id of the request holding the lock
        self.last_stats: dict | None = None  # stats of the latest finished generate/stream

    # -- text -------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this generator has no tokenizer: pass the prompt as token ids")
            check_text(prompt, "the prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
        else:
            ids = token_list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InputError(
                    f"prompt token id {bad[0]!r} is out of the vocabulary [0, {self.vocab_size})"
                )
        if not ids:
            raise InputError("the prompt is empty: give at least one token of text")
        return np.asarray(ids, dtype=np.int64)

    def decode_text(self, tokens: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def apply_chat_template(self, messages: str | list[dict]) -> str:
        """Render the bundle's chat template (jinja2, as Hugging Face tokenizers do) for a user
        message or a list of {"role", "content"} messages, ready for generation."""
        if not self.chat_template:
            raise InputError("this bundle has no chat template: pass the prompt as plain text")
        from .chat import render_chat

        if isinstance(messages, str):
            check_text(messages, "the prompt")
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, (list, tuple)):
            raise InputError(f"messages is a {type(messages).__name__}: give a string or a list "
                             f"of {{'role', 'content'}} dicts")
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                check_text(m["content"], f"message {i}")
        return render_chat(self.chat_template, list(messages), self.special_tokens)

    # -- generation -------------------------------------------------------------------------

    def _run(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, gamma, use_draft,
             chat) -> Iterator[tuple[np.ndarray, DecodeStats]]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r} is invalid: use an integer >= 1")
        policy = self._gamma_policy(gamma)
        if isinstance(prompt, (bytes, bytearray, memoryview)):  # before the chat template too
            raise InputError(BYTES_PROMPT)
        if isinstance(prompt, str) and not prompt:
            # refused before the chat template, which would wrap "" into a non-empty prompt
            raise InputError("the prompt is empty: give at least one token of text")
        if chat:
            prompt = self.apply_chat_template(prompt)
        ids = self.encode(prompt, add_special_tokens=not chat)
        draft = self.draft if use_draft else None
        rng = np.random.default_rng(params.seed)
        stats = DecodeStats()
        if self._owner == threading.get_ident():
            # waiting for the lock would wait for this very thread: a deadlock
            raise RuntimeError("this generator is still streaming an earlier request in this "
                               "thread: finish or close() that stream first, or load() a second "
                               "generator")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                t0 = time.perf_counter()
                if self.encoder_decoder:
                    self.target.encode(ids)
                    if hasattr(draft, "engine"):
                        draft.engine.encode(ids)
                    ids = np.asarray([self.decoder_start_token_id], dtype=np.int64)
                for new in decode(self.target, draft, ids, params, int(max_new_tokens), policy,
                                  self.eos_token_ids, rng, stats):
                    stats.wall_time_s = time.perf_counter() - t0
                    yield new, stats
            finally:
                self._owner = None

    def _gamma_policy(self, gamma) -> GammaPolicy:
        if gamma is None:
            gamma = self.default_gamma
        if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer))
                                or not 1 <= gamma <= self.max_gamma):
            raise InputError(
                f"gamma={gamma!r} is invalid: use an integer in [1, {self.max_gamma}] (the bundle's "
                f"max_gamma), 'auto', or None for the bundle's default ({self.default_gamma})"
            )
        return GammaPolicy(gamma, start=self.default_gamma, max_gamma=self.max_gamma)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        gamma: int | str | None = None,
        use_draft: bool = True,
        stop: str | Sequence[str] | None = (),
        chat: bool = False,
    ) -> GenerationResult:
        """Decode up to max_new_tokens new tokens. use_draft=False is target-only decoding on the
        same engines. `stop` (a string or a list of them) ends generation; the text is cut before
        the stop string."""
        stop = stop_strings(stop)
        tokens: list[int] = []
        stats = None
        finish = None
        for new, stats in self._run(prompt, max_new_tokens, temperature, top_k, top_p, seed,
                                    gamma, use_draft, chat):
            n_before = len(tokens)
            tokens.extend(int(t) for t in new)
            if stop and self._stop_index(tokens, stop) is not None:
                tokens = self._trim_to_stop(tokens, n_before, stop)
                finish = "stop"
                break
        text = self.decode_text(tokens)
        if finish == "stop":
            text = text[: self._stop_index(tokens, stop)]
        stats.new_tokens = len(tokens)
        stats.finish_reason = finish or stats.finish_reason
        self.last_stats = stats.to_dict()
        return GenerationResult(tokens, text, self.last_stats, stats.finish_reason)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, gamma=None, use_draft: bool = True,
               stop: str | Sequence[str] | None = (), chat: bool = False) -> Iterator[str]:
        """Yield the new text piece by piece, as rounds complete. Holds back an incomplete UTF-8
        character and any tail that could still become a stop string."""
        if self.tokenizer is None:
            raise InputError("stream() needs a tokenizer: use generate() for token ids")
        stop = stop_strings(stop)
        tokens: list[int] = []
        sent = 0
        hold = max((len(s) for s in stop), default=1) - 1
        for new, stats in self._run(prompt, max_new_tokens, temperature, top_k, top_p, seed,
                                    gamma, use_draft, chat):
            tokens.extend(int(t) for t in new)
            text = self.decode_text(tokens)
            cut = self._stop_index(tokens, stop) if stop else None
            if cut is not None:
                stats.finish_reason = "stop"
                self.last_stats = stats.to_dict()
                yield text[sent:cut]
                return
            ready = len(text) - hold
            while ready > sent and text[ready - 1] == "\ufffd":
                ready -= 1
            if ready > sent:
                yield text[sent:ready]
                sent = ready
        self.last_stats = stats.to_dict()
        text = self.decode_text(tokens)
        if len(text) > sent:
            yield text[sent:]

    def _stop_index(self, tokens: list[int], stop: Sequence[str]) -> int | None:
        text = self.decode_text(tokens) or ""
        hits = [text.find(s) for s in stop if s and s in text]
        return min(hits) if hits else None

    def _trim_to_stop(self, tokens: list[int], n_before: int, stop: Sequence[str]) -> list[int]:
        # keep the fewest tokens whose text contains a stop string
        for n in range(n_before + 1, len(tokens) + 1):
            if self._stop_index(tokens[:n], stop) is not None:
                return tokens[:n]
        return tokens
