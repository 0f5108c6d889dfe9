"""The public generator: prompt in, tokens, text and statistics out.

`Generator` holds the loaded model: a target engine, an optional draft, an optional
`tokenizers.Tokenizer`, and what the bundle says about them. A request is made and checked
once (`request`: request.py's GenerationOptions bound to this bundle and a prompt), then run:
`generate` returns its GenerationResult, `stream` a TextStream of its text that carries its own
result. Text (chat template, incremental detokenization, stop strings) is handled here, once,
for both. One generator runs one request at a time (its engines hold one request's cache);
`fork` gives another over the same sessions. `spec_runtime.load` wires a bundle to one.

    generate / stream(prompt, options)      options: GenerationOptions, made once where
      │                                         the request enters (or from the keywords),
      ▼                                         each value checked once, without the bundle
    request(prompt, options) ─► Request         prompt_ids, sampling_params, constrained,
      │                                         check_gamma, check_capacity: once
      ▼
    text.texts (stop strings) over _rounds: the engines held,
    loop.RequestState(request) ─► loop.generate_tokens
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from .decode.drafts import draft_engines, fork_engine
from .errors import FieldError, InputError
from .decode.gamma import AUTO, Gamma, check_gamma_range
from .decode.loop import AUTO_START, RequestState, generate_tokens
from .request import (GenerationOptions, GenerationResult, Request, TextStream,
                      check_capacity)
from .decode.sampling import SamplingParams
from .decode.stats import Costs, DecodeStats, Recorder
from .text import BYTES_PROMPT, EMPTY_PROMPT, check_text, texts, token_list
from .settings import SETTINGS, ModelSettings, unmeasured_costs
from .speech_requests import SpeechRequests


class Generator(SpeechRequests):
    def __init__(
        self,
        target,
        draft=None,
        *,
        tokenizer=None,
        settings: ModelSettings | None = None,
        manifest=None,
        bundle_dir=None,
        row_check=None,
        lanes=None,
        draft_lanes=None,
        clock=time.perf_counter,
        **values,
    ):
        """`target`, `draft` (decode.drafts), a `tokenizers.Tokenizer`, and the models'
        settings: `settings` (settings.ModelSettings), else ModelSettings(**values) (its fields
        as keywords: max_gamma=8, eos_token_ids=[2], ...), else the manifest's. What a bundle's
        load adds: its `manifest` and `bundle_dir`, `row_check` (rows.RowCheck: how the
        target's 1-token calls are made, and what the load measured), and `lanes` and
        `draft_lanes` ((lanes.LaneEngine, lanes.LaneCheck, the batch-1 engines it was checked
        on): the target's and the draft model's lanes graphs where the bundle has them and
        their lanes score as single calls do on this machine; generate_batch decodes together
        only then)."""
        if settings is not None and values:
            raise TypeError(f"give settings or their values, not both ({sorted(values)})")
        if settings is None:
            settings = ModelSettings.of(manifest) if manifest is not None and not values \
                else ModelSettings(**values)
        # each setting a plain attribute of its name (read on every request: no property)
        for name in SETTINGS:
            setattr(self, "_costs" if name == "costs" else name, getattr(settings, name))
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.manifest = manifest  # manifest.Manifest of the bundle, when loaded from one
        self.bundle_dir = bundle_dir
        self.clock = clock
        self.row_check = row_check
        # ids past the target's vocabulary are padding, never input (a draft with a smaller
        # vocabulary reads such ids as 0: drafts.ModelDraft)
        self.vocab_size = target.vocab_size
        self._grammar = None  # constraint.Grammar, made at the first response_format
        self.lanes = lanes
        self.draft_lanes = draft_lanes
        self._hold_nothing()

    @property
    def settings(self) -> ModelSettings:
        """The models' settings this generator decodes by, as one record."""
        return ModelSettings(**{name: getattr(self, "_costs" if name == "costs" else name)
                                for name in SETTINGS})

    @property
    def costs(self) -> Costs:
        """Auto γ's prices for seeded sampling (loop.GammaPolicy): the bundle's, measured at
        build; else what is known without measuring (a lookup costs nothing, a hybrid's model
        its draft_cost)."""
        return self._costs or unmeasured_costs(self.draft)

    @costs.setter
    def costs(self, costs: Costs | None) -> None:
        self._costs = costs

    def _hold_nothing(self) -> None:
        """A generator's own state, apart from the bundle's: who holds its engines."""
        self._lock = threading.Lock()  # engines hold one request's cache: one request at a time
        self._forks: list = []  # batch()'s generators, their calls made together
        self._gate = None  # engines.gate.Gate its engines' calls go through, if any
        self._batch_rounds = None  # loop.BatchRounds of the requests in flight at that gate
        self._owner: int | None = None  # thread id of the request holding the lock

    def fork(self, target=None, draft_engine=None) -> "Generator":
        """Another generator over the same loaded bundle: the same ONNX Runtime sessions (one
        copy of the weights), tokenizer and settings, a KV cache and request state of its own,
        so that a second request decodes beside this one's (`specrun serve --slots N`).
        `target`, `draft_engine`: forks of this generator's target engine and of its draft's
        model engine, made already, to use."""
        forked = copy.copy(self)  # the bundle's settings, tokenizer and compiled grammar
        forked.target = target if target is not None else fork_engine(self.target)
        forked.draft = self.draft.fork(draft_engine) if self.draft is not None else None
        forked._hold_nothing()
        return forked

    def together(self, n: int) -> list["Generator"]:
        """`n` forks whose requests, each run on a thread of its own, share their calls: a
        round verifies them all in one call of the target's lanes graph and steps their model
        drafts in one of the draft's (engines/gate.py), up to the lanes at a time. Plain forks
        (a call each) where the bundle has no lanes that score as single calls here. A call
        waits for the other requests in flight: drive each fork's request on a thread that
        does not pause between its rounds (consume a stream as it comes, as `batch` and the
        server do), or the others wait for it."""
        from .batch import together

        return together(self, n)

    @property
    def gate(self):
        """The engines.gate.Gate this generator's calls go through (a fork of `together`), or
        None."""
        return self._gate

    @property
    def max_batch(self) -> int:
        """Requests generate_batch decodes in one call of the target: the bundle's lanes, or 1
        (one request at a time) without them or where they do not score exactly here."""
        if self.lanes is None or not self.lanes[1].identical:
            return 1
        return self.lanes[0].lanes

    def generate_batch(self, prompts: Sequence, options: GenerationOptions | None = None, *,
                       concurrency: int | None = None, return_exceptions: bool = False,
                       **values) -> list:
        """Decode many prompts, `concurrency` at a time (default `max_batch`: a bundle built
        with `specexport build --max-batch N` scores N in one call of the target each round),
        the next starting as one ends; returns their results in order. Each prompt is what
        `generate` takes (a Request too, with options of its own), and each result is exactly
        what `generate` returns for it alone, greedy or seeded. A request that fails does not
        stop the others: its InputError is raised once they end, or put in its place with
        `return_exceptions`."""
        out: list = [None] * len(prompts)
        for piece in self.batch(prompts, options, concurrency=concurrency, **values):
            out[piece.index] = piece.result if piece.error is None else piece.error
        if not return_exceptions:
            for index, r in enumerate(out):
                if isinstance(r, BaseException):
                    raise type(r)(f"prompt {index}: {r}") from r
        return out

    def batch(self, prompts: Sequence, options: GenerationOptions | None = None, *,
              concurrency: int | None = None, stream: bool = False,
              **values) -> Iterator:
        """generate_batch's outcomes as each request ends, a batch.BatchPiece each (its index
        in `prompts`, its result or error); with `stream`, also each request's new text as it
        comes, as `stream` gives it. A Request among `prompts` runs with its own options.
        Closing the iterator cancels what is in flight."""
        from .batch import run_batch

        n = self.max_batch if concurrency is None else concurrency
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FieldError("concurrency", f"concurrency {n!r} is invalid: use an integer >= 1")
        requests = []
        for p in prompts:
            try:
                requests.append(p if isinstance(p, Request) else
                                self.request(p, options, **values))
            except InputError as e:  # that request's outcome; the others go on
                requests.append(e)
        self._not_streaming_here()
        with self._lock:
            if len(self._forks) != n:
                self._forks = self.together(n)
            yield from run_batch(self._forks, requests, stream)

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> np.ndarray:
        """Text (through the tokenizer) or token ids (checked) -> int64 ids [n]."""
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
            raise InputError(EMPTY_PROMPT)
        return np.asarray(ids, dtype=np.int64)

    def detokenize(self, tokens: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def apply_chat_template(self, messages: str | list[dict], tools=None) -> str:
        """Render the bundle's chat template (jinja2, as Hugging Face tokenizers do) for a user
        message or a list of {"role", "content"} messages, ready for generation; with the
        `tools` of a tools.Toolset shown to the model."""
        if not self.chat_template:
            raise InputError("this bundle has no chat template: pass the prompt as plain text"
                             + (" (tools are given to the model through it)" if tools else ""))
        from .chat import chat_prompt

        return chat_prompt(self.chat_template, messages, self.special_tokens, tools)

    # -- requests: made and checked once ----------------------------------------------------

    def request(self, prompt, options: GenerationOptions | None = None, **values) -> Request:
        """`prompt` and `options` (or GenerationOptions(**values)) bound to this bundle: the
        one place a request is checked against it, in this order: the sampling values with the
        bundle's defaults, response_format, γ's range, the prompt's ids, the cache's capacity.
        The Request runs as it is on this generator or any of its forks."""
        options, params, gamma = self._checked(options, values, speech=False)
        ids = self.prompt_ids(prompt, options.chat, options.tools)
        prefix = ids if not self.encoder_decoder else \
            np.asarray([self.decoder_start_token_id], dtype=np.int64)
        if params.reads_context:  # presence and frequency penalties count generated tokens
            params = replace(params, penalty_start=len(prefix))
        check_capacity(self._engines(options.use_draft), len(prefix), options.max_new_tokens,
                       len(ids) if self.encoder_decoder else None)
        return self._bound(options, ids, prefix, params, gamma)

    def _checked(self, options: GenerationOptions | None, values: dict, *, speech: bool):
        """What binding a text request (`request`) and a speech one (`transcription`) check
        first, alike, in this order: the options made, the bundle's modality, stop strings
        against the tokenizer, the sampling values under the bundle's defaults, a text's
        response_format, γ's range. Returns the options, the SamplingParams and the γ."""
        options = GenerationOptions.given(options, values)
        self.speech_only(options) if speech else self.text_only()
        if options.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer: this generator has none")
        params = self.sampling_params(options)
        if not speech:
            params = self.constrained(params, options.response_format, options.tools)
        return options, params, self.check_gamma(options.gamma)

    def _bound(self, options, prompt, prefix, params, gamma) -> Request:
        """The Request of checked values, with how its γ starts and its rounds are priced."""
        # AUTO starts from the bundle's γ, or from AUTO_START where AUTO is its default
        start = self.default_gamma if self.default_gamma is not AUTO else \
            min(AUTO_START, self.max_gamma)
        # a seeded sample is reproducible: its rounds' lengths must not follow its timings
        costs = self.costs if params.seed is not None and not params.greedy else None
        return Request(options, prompt, prefix, params, gamma, start, self.max_gamma,
                       self.eos_token_ids, costs)

    def _request_of(self, prompt, options: GenerationOptions | None, values: dict) -> Request:
        """generate/stream's request: `prompt` itself when it is one (then with no options of
        the call's own), else `prompt` bound with `options` or `values`."""
        if not isinstance(prompt, Request):
            return self.request(prompt, options, **values)
        if options is not None or values:
            raise TypeError("a Request carries its own options: pass it alone (cancel aside)")
        return prompt

    def prompt_ids(self, prompt, chat: bool | None = None, tools=None) -> np.ndarray:
        """The ids a request feeds. `prompt` is text, a list of {"role", "content"} messages (a
        conversation, always through the chat template) or token ids (never through it). `chat`
        None (the default) applies the bundle's chat template to text when the bundle has one;
        True requires it, False feeds the text as it is. `tools` (a tools.Toolset) are shown
        to the model where the chat template applies."""
        if isinstance(prompt, (bytes, bytearray, memoryview)):  # before the chat template too
            raise InputError(BYTES_PROMPT)
        if isinstance(prompt, str) and not prompt:
            # refused before the chat template, which would wrap "" into a non-empty prompt
            raise InputError(EMPTY_PROMPT)
        messages = isinstance(prompt, (list, tuple)) and bool(prompt) \
            and all(isinstance(m, dict) for m in prompt)
        if messages and chat is False:
            raise InputError("a list of messages needs the chat template: leave chat on, or "
                             "give the prompt as text")
        if chat and isinstance(prompt, (list, tuple, np.ndarray)) and not messages:
            raise InputError("chat=True applies the chat template to text or messages, not to "
                             "token ids: pass text, or leave chat unset for token ids")
        if chat is None:
            chat = messages or (isinstance(prompt, str) and bool(self.chat_template))
        if chat:
            prompt = self.apply_chat_template(prompt, tools)
        return self.tokenize(prompt, add_special_tokens=not chat)

    def sampling_params(self, options: GenerationOptions | None = None, **values
                        ) -> SamplingParams:
        """A request's SamplingParams: each control its options give (not None), else the
        bundle's generation default, else SamplingParams' own (greedy, no truncation, no
        penalty). Both were checked where they were made (GenerationOptions, the manifest);
        what only the bundle knows, the vocabulary, is checked here."""
        options = GenerationOptions.given(options, values)
        given = {k: v for k, v in options.sampling().items() if v is not None}
        params = SamplingParams.checked(**{**self.generation_defaults, **given})
        for tok, _ in params.logit_bias or ():
            if tok >= self.vocab_size:
                raise FieldError("logit_bias", f"logit_bias token id {tok} is out of the "
                                               f"vocabulary [0, {self.vocab_size})")
        return params

    def constrained(self, params: SamplingParams, response_format, tools=None
                    ) -> SamplingParams:
        """`params` with the constraint of OpenAI's `response_format` and of the tool_choice
        of `tools` (a tools.Toolset) (constraint.py, tools.grammar; unchanged where neither
        constrains the reply); FieldError for a format or schema the grammar engine cannot
        compile."""
        from .decode.constraint import Grammar
        from .tools import grammar

        if response_format is None and tools is None:
            return params  # before any tokenizer is asked about: most requests
        tokenizer = self.tokenizer
        made = grammar(response_format, tools,
                       lambda text: tokenizer is not None and tokenizer.token_to_id(text)
                       is not None)
        if made is None:
            return params
        text, field = made
        if tokenizer is None:
            raise InputError(f"{field} needs a tokenizer: this generator has none")
        if self._grammar is None:
            self._grammar = Grammar(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return replace(params, constraint=self._grammar.constraint(text, field))

    def check_gamma(self, gamma: Gamma | None) -> Gamma:
        """The γ a request runs with: `gamma` (parsed: GenerationOptions) in this bundle's
        range, or the bundle's default for None."""
        if gamma is None:
            return self.default_gamma
        return check_gamma_range(gamma, self.max_gamma, default=self.default_gamma)

    def _engines(self, use_draft: bool = True) -> list:
        draft = self.draft if use_draft else None
        return [self.target] + draft_engines(draft)

    def capacity(self, use_draft: bool = True) -> int:
        """Cache positions a request may use: prompt + new tokens - 1 (decoder-only; an
        encoder-decoder's decoder starts from one token)."""
        return min(e.max_len for e in self._engines(use_draft))

    # -- running a request ----------------------------------------------------------------

    def encode(self, source, use_draft: bool = True) -> None:
        """Run the encoders on `source` (an encoder-decoder's ids, or a speech window's
        features), as a request starts: what measurements of the decoders need first."""
        with self._lock:
            self._encode(source, self.draft if use_draft else None)

    def _not_streaming_here(self) -> None:
        if self._owner == threading.get_ident():
            # waiting for the lock would wait for this very thread: a deadlock
            raise RuntimeError("this generator is still streaming an earlier request in this "
                               "thread: finish or close() that stream first, or load() a second "
                               "generator")

    def _encode(self, ids: np.ndarray, draft) -> float:
        """An encoder-decoder's request starts by running the encoders on its source (ids, or a
        speech window's features), unless the target holds its encoding already (the language
        detection of this very request, or the decode of the same window before a fallback's):
        then it returns the seconds that encoding took, which the request counts as its own."""
        if not self.encoder_decoder:
            return 0.0
        before = 0.0
        if self.target.holds(ids):  # encoded already (language detection, a fallback's retry)
            before = self.target.encode_seconds
        else:
            self.target.encode_source(ids)
        from .engines.ort_encdec import encode_drafts

        encode_drafts(self.target, draft_engines(draft), ids)
        return before

    def _rounds(self, request: Request, cancel=None, token_logprobs: list | None = None,
                ran: list | None = None) -> Iterator[tuple[np.ndarray, DecodeStats]]:
        """Hold the engines and yield each round's tokens; stop after the round in which
        `cancel` (a threading.Event) is set, with finish_reason "cancelled". `ran` gets the
        request as it runs: a transcription's with the language it detected."""
        draft = self.draft if request.use_draft else None
        self._not_streaming_here()
        with self._lock:
            self._owner = threading.get_ident()
            stats = DecodeStats(target_one_row=getattr(self.target, "one_row", None))
            if self._gate is not None:
                self._gate.join()
            try:
                recorder = Recorder(stats, self.clock)
                if self.encoder_decoder:
                    t0 = self.clock()
                    before = self._encode(request.prompt, draft)
                    if request.detect_at is not None:
                        request = self._detected_in(request)
                    stats.encode_time_s = self.clock() - t0 + before
                    recorder.t0 -= before  # the request's time includes language detection
                if ran is not None:
                    ran.append(request)
                state = RequestState(request, recorder, token_logprobs, self._batch_rounds)
                if self._batch_rounds is not None:
                    self._batch_rounds.add(stats)
                for new in generate_tokens(self.target, draft, state):
                    yield new, stats
                    if cancel is not None and cancel.is_set() and not stats.finish_reason:
                        stats.finish_reason = "cancelled"
                        return
            finally:
                self._owner = None
                if self._gate is not None:
                    self._batch_rounds.remove(stats)
                    self._gate.leave()

    def generate(self, prompt: str | Sequence[int] | list[dict] | Request,
                 options: GenerationOptions | None = None, *, cancel=None,
                 **values) -> GenerationResult:
        """Decode up to max_new_tokens new tokens from `prompt`: text, a list of
        {"role", "content"} messages, token ids, or a Request made by `request` (then alone).
        `options` is a GenerationOptions, or give its fields as keywords (`max_new_tokens=64,
        temperature=0.7, gamma="auto"`: GenerationOptions says what each does). `cancel`, a
        threading.Event another thread may set, ends the request after the round in flight
        (finish_reason "cancelled")."""
        request = self._request_of(prompt, options, values)
        token_logprobs = [] if request.logprobs is not None else None
        ran: list = []
        if self.tokenizer is None:  # token ids in, token ids out: no text, no stop strings
            tokens, stats = [], DecodeStats()
            for new, stats in self._rounds(request, cancel, token_logprobs, ran):
                tokens.extend(int(t) for t in new)
            return _result(tokens, None, stats, token_logprobs, self._language(ran))
        text = stats = None
        rounds = self._rounds(request, cancel, token_logprobs, ran)
        for _, text, stats in texts(rounds, self.detokenize, request.stop, live=False,
                                    token_logprobs=token_logprobs):
            pass
        return _result(text.tokens, text.finish(), stats, token_logprobs, self._language(ran))


    def stream(self, prompt, options: GenerationOptions | None = None, *, cancel=None,
               **values) -> TextStream:
        """A TextStream of the new text, piece by piece as rounds complete: the same tokens,
        text and stats as generate() with the same arguments, in its `result` once it ends.
        Holds back an incomplete UTF-8 character and any tail that could still become a stop
        string. A stream closed early (close(), Ctrl-C) has a result with what it did so far,
        finish_reason "cancelled"."""
        if self.tokenizer is None:
            raise InputError("stream() needs a tokenizer: use generate() for token ids")
        request = self._request_of(prompt, options, values)
        return TextStream(request, lambda out: self._pieces(request, cancel, out))

    def _pieces(self, request: Request, cancel, out: TextStream) -> Iterator[str]:
        """The stream's pieces; sets out.result when they end, however they end."""
        text = stats = None
        pieces, ran = [], []
        per_round = texts(self._rounds(request, cancel, out.logprobs, ran), self.detokenize,
                          request.stop, token_logprobs=out.logprobs)
        try:
            for piece, text, stats in per_round:
                if piece:
                    pieces.append(piece)
                    yield piece
        except (GeneratorExit, KeyboardInterrupt):  # stopped by its caller (close(), Ctrl-C):
            # the result is what it did so far
            per_round.close()
            if stats is not None:
                stats.finish_reason = stats.finish_reason or "cancelled"
                out.result = _result(text.tokens, "".join(pieces), stats, out.logprobs,
                                     self._language(ran))
            raise
        out.result = _result(text.tokens, "".join(pieces), stats, out.logprobs,
                             self._language(ran))

    def target_logits(self, prompt_ids, prefix: Sequence[int], start=None) -> np.ndarray:
        """The target's logits float64 [V] for the next token after prompt + prefix (the prefix
        being generated tokens), from one fresh call: what `specrun check` compares with. An
        encoder-decoder's decoder starts from `start` (a Request's prefix), else from its
        start token; a speech bundle's prompt is its features."""
        with self._lock:
            self.target.reset()
            ids = prompt_ids if self.audio is not None else np.asarray(prompt_ids, np.int64)
            self._encode(ids, None)
            if start is None:
                start = [self.decoder_start_token_id] if self.encoder_decoder else ids
            seq = np.concatenate([np.asarray(start, np.int64), np.asarray(prefix, np.int64)])
            return np.asarray(self.target.forward(seq, 0, 1)[-1], np.float64)


def _result(tokens: list[int], text: str | None, stats: DecodeStats,
            token_logprobs: list | None, language: str | None = None) -> GenerationResult:
    logprobs = token_logprobs[: len(tokens)] if token_logprobs is not None else None
    return GenerationResult(list(tokens), text, stats.summary(), stats.finish_reason, logprobs,
                            language)
