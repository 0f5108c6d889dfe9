"""One generation request: made and checked once where it enters (the CLI, the Python API, the
server), then carried to the decode loop as it is; and what comes back.

    the caller's values ─ GenerationOptions ─► checked without a bundle: max_new_tokens, the
                          sampling values, stop strings, logprobs (the CLI makes them before
                          the bundle loads, so a bad value costs no load)
    prompt + options ──── Generator.request ─► Request, bound to the loaded bundle: the prompt's
                          ids (chat template, tokenizer), the bundle's sampling defaults
                          applied, γ and logit_bias ids checked against it, response_format
                          compiled, and the one capacity check (check_capacity)
    Request ───────────── Generator.generate ─► GenerationResult
                          Generator.stream ───► TextStream: the pieces, then its own result

The split is vLLM's (SamplingParams checked when made, a Request made by the engine that holds
the model). The loop's per-request state (loop.RequestState) holds the Request it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Iterator, Sequence

import numpy as np

from .errors import CacheCapacityError, InputError
from .sampling import SamplingParams, check_sampling
from .stats import Costs
from .text import stop_strings

MAX_TOP_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows
MAX_NEW_TOKENS = 128  # the one default, for every command and for generate/stream

# the sampling values a request may set: SamplingParams' fields but the seed and the ones the
# request itself sets (penalty_start, constraint)
SAMPLING_ARGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias")


@dataclass(frozen=True)
class GenerationOptions:
    """What a caller asks of one generation, besides the prompt (Generator.generate's
    arguments). A sampling value left None takes the bundle's generation default, else
    SamplingParams' own (greedy, no truncation, no penalty); `gamma` None the bundle's default
    γ. Checked when made, InputError naming the value; what only the bundle can say (γ's range,
    logit_bias ids, response_format's grammar) is checked when Generator.request binds them."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | tuple | None = None
    seed: int | None = None
    gamma: int | str | None = None  # 1..the bundle's max_gamma, or "auto"
    use_draft: bool = True  # False: target-only decoding on the same engines
    stop: str | Sequence[str] | None = ()
    chat: bool | None = None  # None: the chat template for text, when the bundle has one
    logprobs: int | None = None  # alternatives reported per token (0..20); None: no logprobs
    response_format: dict | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InputError(f"max_new_tokens={n!r} is invalid: use an integer >= 1")
        object.__setattr__(self, "max_new_tokens", int(n))
        check_logprobs(self.logprobs)
        given = {k: v for k, v in self.sampling().items() if v is not None}
        for name, value in check_sampling({**given, "seed": self.seed}).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "stop", stop_strings(self.stop))

    @classmethod
    def of(cls, arguments: dict) -> "GenerationOptions":
        """The options among a call's `arguments` (Generator.generate and stream name theirs
        as the fields are named)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def sampling(self) -> dict:
        """The sampling values as given (None: the bundle's default), the seed apart."""
        return {name: getattr(self, name) for name in SAMPLING_ARGS}


def check_logprobs(logprobs) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
            logprobs, (int, np.integer)) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InputError(f"logprobs={logprobs!r} is invalid: use an integer in "
                         f"[0, {MAX_TOP_LOGPROBS}] (the alternatives reported per token), or "
                         f"None")


@dataclass(frozen=True, eq=False)
class Request:
    """One generation bound to a loaded bundle, as Generator.request made and checked it: what
    the loop runs. Read-only; a request may run again (the same seed, the same sample) and on
    any fork of the generator that made it, one run at a time where it has a response_format
    (its grammar's matcher follows the run)."""

    options: GenerationOptions  # as the caller gave them
    prompt: np.ndarray  # int64 [n]: the ids fed (chat template applied); an encoder's source
    prefix: np.ndarray  # int64: what the decoder continues (the prompt, or the start token)
    params: SamplingParams  # the bundle's defaults applied; penalties count from the prefix's
    # end; a response_format's grammar attached as its constraint
    gamma: int | str  # γ, or "auto" (re-chosen each round, from `gamma_start`)
    gamma_start: int
    max_gamma: int
    eos_token_ids: frozenset[int]
    # auto γ's prices when fixed (a seeded sample: loop.GammaPolicy); None: this run's timings
    costs: Costs | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def use_draft(self) -> bool:
        return self.options.use_draft

    @property
    def stop(self) -> tuple[str, ...]:
        return self.options.stop

    @property
    def logprobs(self) -> int | None:
        return self.options.logprobs


def check_capacity(engines, prefix_len: int, max_new_tokens: int,
                   source_len: int | None = None) -> None:
    """The one capacity check of a request: CacheCapacityError unless every engine it runs on
    holds the source (an encoder-decoder's: `check_source`), then the prefix and the new tokens.
    The last generated token is never fed back, so N + M - 1 positions are written."""
    for engine in engines:
        if source_len is not None and hasattr(engine, "check_source"):
            engine.check_source(source_len)
    needed = prefix_len + max_new_tokens - 1
    for engine in engines:
        if needed > engine.max_len:
            raise CacheCapacityError(
                f"prompt ({prefix_len} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} "
                f"cache positions but the bundle's max_len is {engine.max_len}: lower "
                f"max_new_tokens or the prompt, or re-export with `specexport build --max-len`"
            )


@dataclass
class GenerationResult:
    tokens: list[int]  # the new token ids (an EOS that ended generation included)
    text: str | None  # decoded new text, special tokens skipped; None without a tokenizer
    stats: dict
    finish_reason: str  # "eos", "length", "stop", or "cancelled"
    # with logprobs=N: one per token, the target's own log-probability of it and its N most
    # likely alternatives, exactly as target-only decoding computes them (loop.TokenLogprob)
    logprobs: list | None = None


class TextStream:
    """What Generator.stream returns: iterate it for the new text, piece by piece, as rounds
    complete. `result` is the request's GenerationResult once the stream has ended, also when
    it was closed early (close(), Ctrl-C: finish_reason "cancelled", with what it did so far);
    None before. `logprobs`, when the request asked for them, holds the TokenLogprobs of the
    tokens decoded so far (a reader takes the new ones after each piece)."""

    def __init__(self, request: Request, run: Callable[["TextStream"], Iterator[str]]):
        """`run(stream)`: the generator of the pieces, which sets the stream's result."""
        self.request = request
        self.logprobs: list | None = [] if request.logprobs is not None else None
        self.result: GenerationResult | None = None
        self._pieces = run(self)

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop now: the engines are released, and `result` holds what was done."""
        self._pieces.close()

