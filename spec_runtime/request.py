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

from .errors import CacheCapacityError, FieldError
from .decode.gamma import AUTO, Gamma, parse_gamma
from .decode.sampling import SAMPLING_FIELDS, SAMPLING_NAMES, SamplingParams, check_sampling
from .decode.stats import Costs, GenerationStats
from .text import stop_strings
from .tools import Toolset

MAX_TOP_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows
MAX_NEW_TOKENS = 128  # the one default, for every command and for generate/stream


def _with_sampling_fields(cls):
    """Add SamplingParams' sampling controls (SAMPLING_FIELDS) to `cls` as fields `name: type |
    None = None`, after its own: the controls are declared once, in SamplingParams."""
    for f in SAMPLING_FIELDS:
        if f.name not in cls.__dict__.get("__annotations__", {}):
            cls.__annotations__[f.name] = f"{f.type} | None"
            setattr(cls, f.name, None)
    return cls


@dataclass(frozen=True)
@_with_sampling_fields
class GenerationOptions:
    """What a caller asks of one generation, besides the prompt: made once where a request
    enters (the CLI, Generator.generate/stream's keywords, the OpenAI server, Ray Serve) and
    carried as it is. Checked when made, each value once, a FieldError naming the field; what
    only the bundle can say (γ's range, logit_bias ids, response_format's grammar) is checked
    when Generator.request binds them.

    max_new_tokens: new tokens at most (an EOS or a stop string ends sooner).
    gamma: the draft length (gamma.Gamma: 1..the bundle's max_gamma, or AUTO / "auto"); None:
      the bundle's default.
    use_draft: False is target-only decoding on the same engines (the baseline).
    stop: a string or a list of them that end generation; the text is cut before it.
    chat: None applies the bundle's chat template to text when it has one; True requires it;
      False feeds the text as it is.
    logprobs: N (0..20) reports each token's log-probability under the target's own
      distribution at its position (the warped one that sampling draws from; greedy: the
      log-softmax of the logits, penalties applied) and the N most likely tokens there; the
      tokens themselves do not change. None: no logprobs.
    response_format: {"type": "json_object"}, or {"type": "json_schema", "json_schema":
      {"schema": {...}}}, as OpenAI's API takes it: draft and target alike are masked to what
      the grammar allows, so the output is the target's distribution restricted to it, exactly,
      in both modes (constraint.py).
    tools, tool_choice, parallel_tool_calls: OpenAI's tool calling (tools.py): a list of
      {"type": "function", "function": {"name", "description", "parameters"}}, given to the
      model through the chat template; tool_choice "auto" (the default), "required" or
      {"type": "function", "function": {"name": ...}} (the reply is then constrained to calls
      whose arguments the parameters' schema accepts, in both modes, exactly), or "none".
      Checked into `tools`: a tools.Toolset, or None where no tool can be called.
    The sampling controls (SamplingParams' SAMPLING_FIELDS: temperature, top_k, top_p, seed,
      min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias): None takes
      the bundle's generation default (the model's generation_config), else SamplingParams'
      own (greedy, no truncation, no penalty). A seed reproduces a sample within a mode;
      speculative and target-only draws differ for the same seed (the same distribution, other
      random numbers).
    """

    max_new_tokens: int = MAX_NEW_TOKENS
    gamma: Gamma | None = None
    use_draft: bool = True
    stop: str | Sequence[str] | None = ()
    chat: bool | None = None
    logprobs: int | None = None
    response_format: dict | None = None
    tools: Sequence[dict] | Toolset | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise FieldError("max_new_tokens", f"max_new_tokens={n!r} is invalid: use an "
                                               f"integer >= 1")
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        if not isinstance(self.use_draft, (bool, np.bool_)):
            raise FieldError("use_draft", f"use_draft={self.use_draft!r} is invalid: use True "
                                          f"or False")
        check_logprobs(self.logprobs)
        given = {k: v for k, v in self.sampling().items() if v is not None}
        for name, value in check_sampling(given).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "stop", stop_strings(self.stop))
        if self.tools is None and self.tool_choice is None and self.parallel_tool_calls is None:
            return  # no tools: most requests
        toolset = Toolset.of(self.tools, self.tool_choice, self.parallel_tool_calls)
        object.__setattr__(self, "tools", toolset)
        if toolset is not None:  # the Toolset carries them: made again from it, it is the same
            object.__setattr__(self, "tool_choice", None)
            object.__setattr__(self, "parallel_tool_calls", None)

    @classmethod
    def given(cls, options: "GenerationOptions | None", values: dict) -> "GenerationOptions":
        """`options`, or GenerationOptions(**values): what an entry point that takes either
        (generate, stream, request, bench, check, a chat session) was given; TypeError for
        both, or for options that are not GenerationOptions."""
        if options is None:
            return cls(**values)
        if not isinstance(options, cls):
            raise TypeError(f"options is a {type(options).__name__}: give a GenerationOptions "
                            f"(or its fields as keywords)")
        if values:
            raise TypeError(f"give GenerationOptions or their values, not both "
                            f"({sorted(values)})")
        return options

    def sampling(self) -> dict:
        """The sampling controls as given (None: the bundle's default)."""
        return {name: getattr(self, name) for name in SAMPLING_NAMES}


# GenerationOptions' fields, by name: what generate/stream/request take as keywords
OPTION_NAMES = frozenset(f.name for f in fields(GenerationOptions))


def check_logprobs(logprobs) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
            logprobs, (int, np.integer)) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise FieldError("logprobs", f"logprobs={logprobs!r} is invalid: use an integer in "
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
    gamma: Gamma  # γ, or AUTO (re-chosen each round, from `gamma_start`)
    gamma_start: int
    max_gamma: int
    eos_token_ids: frozenset[int]
    # auto γ's prices when fixed (a seeded sample: loop.GammaPolicy); None: this run's timings
    costs: Costs | None = None
    # a transcription whose language is detected as it runs, on the engines that decode it:
    # the index in `prefix` of the language token to put there (None: nothing to detect)
    detect_at: int | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def gamma_fixed(self) -> bool:
        """The caller chose a γ (not auto): a batch does not choose whether it drafts."""
        return self.options.gamma is not None and self.gamma != AUTO

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
    stats: GenerationStats  # what the generation did (decode.stats)
    finish_reason: str  # "eos", "length", "stop", or "cancelled"
    # with logprobs=N: one per token, the target's own log-probability of it and its N most
    # likely alternatives, exactly as target-only decoding computes them (loop.TokenLogprob)
    logprobs: list | None = None
    # a transcription's language: the one given, or the one detected, also where the request
    # left it to the run (detect_later); None for text and for an English-only model
    language: str | None = None


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

