"""The public generator: prompt in, tokens, text and statistics out.

`Generator` holds the loaded model: a target engine, an optional draft, an optional
`tokenizers.Tokenizer`, and what the bundle says about them. It validates a request, builds its
per-request state (loop.Request) and runs the loop on it; text (chat template, incremental
detokenization, stop strings, streaming) is handled here, once, for both `generate` and
`stream`. One generator runs one request at a time (its engines hold one request's cache);
`spec_runtime.load` wires a bundle to one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np

from .drafts import draft_engines, fork_engine
from .errors import InputError
from .loop import GammaPolicy, Request, TokenLogprob, check_capacity, generate_tokens
from .sampling import SamplingParams
from .stats import DecodeStats, Recorder
from .text import BYTES_PROMPT, IncrementalText, check_text, stop_strings, token_list

MAX_TOP_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows

# the sampling arguments of generate() and stream(), SamplingParams' fields but the seed
SAMPLING_ARGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias")


@dataclass
class GenerationResult:
    tokens: list[int]  # the new token ids (an EOS that ended generation included)
    text: str | None  # decoded new text, special tokens skipped; None without a tokenizer
    stats: dict
    finish_reason: str  # "eos", "length" or "stop"
    # with logprobs=N: one per token, the target's own log-probability of it and its N most
    # likely alternatives, exactly as target-only decoding computes them
    logprobs: list[TokenLogprob] | None = None


def check_logprobs(logprobs) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
            logprobs, (int, np.integer)) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InputError(f"logprobs={logprobs!r} is invalid: use an integer in "
                         f"[0, {MAX_TOP_LOGPROBS}] (the alternatives reported per token), or "
                         f"None")


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
        manifest=None,
        bundle_dir=None,
        generation_defaults: dict | None = None,
        row_check=None,
        clock=time.perf_counter,
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
        self.manifest = manifest  # manifest.Manifest of the bundle, when loaded from one
        self.bundle_dir = bundle_dir
        # the model's own sampling defaults (the manifest's `generation`): what a request that
        # leaves a sampling argument unset (None) gets, before SamplingParams' own defaults
        self.generation_defaults = dict(generation_defaults or {})
        self.clock = clock
        # rows.RowCheck: how the target's 1-token calls are made, and what the load measured
        self.row_check = row_check
        # ids past the target's vocabulary are padding, never input (a draft with a smaller
        # vocabulary reads such ids as 0: drafts.ModelDraft)
        self.vocab_size = target.vocab_size
        self._lock = threading.Lock()  # engines hold one request's cache: one request at a time
        self._owner: int | None = None  # thread id of the request holding the lock
        self.last_stats: dict | None = None  # stats of the latest finished generate/stream
        self.last_result: GenerationResult | None = None  # and its whole result
        # the running request's TokenLogprobs so far, when it asked for them (a stream's reader
        # takes the new ones after each piece); None otherwise
        self.live_logprobs: list[TokenLogprob] | None = None
        self._grammar = None  # constraint.Grammar, made at the first response_format

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
            raise InputError("the prompt is empty: give at least one token of text")
        return np.asarray(ids, dtype=np.int64)

    def detokenize(self, tokens: Sequence[int]) -> str | None:
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

    # -- requests ---------------------------------------------------------------------------

    # -- requests side by side ----------------------------------------------------------------

    def fork(self) -> "Generator":
        """Another generator over the same loaded bundle: the same ONNX Runtime sessions (one
        copy of the weights) and tokenizer, a KV cache and request state of its own, so that a
        second request decodes beside this one's (`specrun serve --slots N`)."""
        target = fork_engine(self.target)
        draft = self.draft.fork() if self.draft is not None else None
        forked = Generator(target, draft, tokenizer=self.tokenizer,
                         eos_token_ids=self.eos_token_ids, default_gamma=self.default_gamma,
                         max_gamma=self.max_gamma, chat_template=self.chat_template,
                         special_tokens=self.special_tokens, encoder_decoder=self.encoder_decoder,
                         decoder_start_token_id=self.decoder_start_token_id,
                         manifest=self.manifest, bundle_dir=self.bundle_dir,
                         generation_defaults=self.generation_defaults,
                         row_check=self.row_check, clock=self.clock)
        forked._grammar = self._grammar  # the compiled tokenizer, when there is one already
        return forked

    def _engines(self, use_draft: bool = True) -> list:
        draft = self.draft if use_draft else None
        return [self.target] + draft_engines(draft)

    def capacity(self, use_draft: bool = True) -> int:
        """Cache positions a request may use: prompt + new tokens - 1 (decoder-only; an
        encoder-decoder's decoder starts from one token)."""
        return min(e.max_len for e in self._engines(use_draft))

    def check_capacity(self, prompt_len: int, max_new_tokens: int,
                       use_draft: bool = True) -> None:
        """CacheCapacityError unless `prompt_len` prompt ids (as prompt_ids gives them) and
        `max_new_tokens` fit the caches."""
        check_capacity(self._engines(use_draft), 1 if self.encoder_decoder else prompt_len,
                       max_new_tokens)

    def gamma_policy(self, gamma) -> GammaPolicy:
        """The policy for `gamma` (an integer in [1, max_gamma], "auto", or None for the
        bundle's default); InputError for anything else."""
        if gamma is None:
            gamma = self.default_gamma
        if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer))
                                or not 1 <= gamma <= self.max_gamma):
            raise InputError(
                f"gamma={gamma!r} is invalid: use an integer in [1, {self.max_gamma}] (the bundle's "
                f"max_gamma), 'auto', or leave it out for the bundle's default ({self.default_gamma})"
            )
        return GammaPolicy(gamma, start=self.default_gamma, max_gamma=self.max_gamma)

    def prompt_ids(self, prompt, chat: bool | None = None) -> np.ndarray:
        """The ids a request feeds. `prompt` is text, a list of {"role", "content"} messages (a
        conversation, always through the chat template) or token ids (never through it). `chat`
        None (the default) applies the bundle's chat template to text when the bundle has one;
        True requires it, False feeds the text as it is."""
        if isinstance(prompt, (bytes, bytearray, memoryview)):  # before the chat template too
            raise InputError(BYTES_PROMPT)
        if isinstance(prompt, str) and not prompt:
            # refused before the chat template, which would wrap "" into a non-empty prompt
            raise InputError("the prompt is empty: give at least one token of text")
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
            prompt = self.apply_chat_template(prompt)
        return self.tokenize(prompt, add_special_tokens=not chat)

    def sampling_params(self, seed: int | None = None, **given) -> SamplingParams:
        """A request's SamplingParams: each argument it gives (not None), else the bundle's
        generation default, else SamplingParams' own (greedy, no truncation, no penalty)."""
        unknown = sorted(set(given) - set(SAMPLING_ARGS))
        if unknown:
            raise TypeError(f"unknown sampling argument(s) {unknown}")
        values = {**self.generation_defaults,
                  **{k: v for k, v in given.items() if v is not None}}
        params = SamplingParams(seed=seed, **values)
        for tok, _ in params.logit_bias or ():
            if tok >= self.vocab_size:
                raise InputError(f"logit_bias token id {tok} is out of the vocabulary "
                                 f"[0, {self.vocab_size})")
        return params

    def _begin(self, ids: np.ndarray, draft) -> np.ndarray:
        """Start a request on the engines: an encoder-decoder runs its encoders on `ids` and
        decodes from the start token; a decoder-only model continues `ids`."""
        if not self.encoder_decoder:
            return ids
        self.target.encode_source(ids)
        for engine in draft_engines(draft):
            engine.encode_source(ids)
        return np.asarray([self.decoder_start_token_id], dtype=np.int64)

    def constrained(self, params: SamplingParams, response_format) -> SamplingParams:
        """`params` with the constraint of OpenAI's `response_format` (constraint.py; None or
        {"type": "text"}: unchanged); InputError for a format or schema it cannot compile."""
        from .constraint import Grammar, grammar_of

        grammar = grammar_of(response_format)
        if grammar is None:
            return params
        if self.tokenizer is None:
            raise InputError("response_format needs a tokenizer: this generator has none")
        if self._grammar is None:
            self._grammar = Grammar(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return replace(params, constraint=self._grammar.constraint(grammar))

    def _rounds(self, prompt, max_new_tokens, params: SamplingParams, gamma, use_draft,
                chat, cancel=None, logprobs=None) -> Iterator[tuple[np.ndarray, DecodeStats]]:
        """Validate a request, then hold the engines and yield each round's tokens; stop after
        the round in which `cancel` (a threading.Event) is set, with finish_reason
        "cancelled"."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r} is invalid: use an integer >= 1")
        check_logprobs(logprobs)
        policy = self.gamma_policy(gamma)
        ids = self.prompt_ids(prompt, chat)
        draft = self.draft if use_draft else None
        if self._owner == threading.get_ident():
            # waiting for the lock would wait for this very thread: a deadlock
            raise RuntimeError("this generator is still streaming an earlier request in this "
                               "thread: finish or close() that stream first, or load() a second "
                               "generator")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                stats = DecodeStats(target_one_row=getattr(self.target, "one_row", None))
                recorder = Recorder(stats, self.clock)
                prefix = self._begin(ids, draft)
                check_capacity(self._engines(use_draft), len(prefix), int(max_new_tokens))
                self.live_logprobs = [] if logprobs is not None else None
                request = Request(prefix, params, int(max_new_tokens),
                                  policy if draft is not None else None, self.eos_token_ids,
                                  np.random.default_rng(params.seed), recorder,
                                  logprobs=logprobs, token_logprobs=self.live_logprobs)
                if self.encoder_decoder:  # the prompt is the source the encoders read, not
                    stats.prompt_tokens = len(ids)  # the decoder's one start token
                for new in generate_tokens(self.target, draft, request):
                    yield new, stats
                    if cancel is not None and cancel.is_set() and not stats.finish_reason:
                        stats.finish_reason = "cancelled"
                        return
            finally:
                self._owner = None

    def _texts(self, prompt, max_new_tokens, params: SamplingParams, gamma, use_draft,
               stop, chat, live: bool = True, cancel=None,
               logprobs=None) -> Iterator[tuple[str, IncrementalText, DecodeStats]]:
        """The one implementation of text and stop strings behind generate() and stream():
        yields (new text safe to show, the text so far, stats) per round. A stop string ends
        the request at the token that completes it; tokens and stats then count up to it.
        Without `live` (generate) and without stop strings the text is decoded once, at the
        end."""
        stop = stop_strings(stop)
        text = IncrementalText(self.detokenize, stop)
        shown = 0
        rounds = self._rounds(prompt, max_new_tokens, params, gamma, use_draft, chat, cancel,
                              logprobs)
        try:
            for new, stats in rounds:
                if not live and not stop:
                    text.tokens.extend(int(t) for t in new)
                    continue
                if text.extend(new):
                    stats.new_tokens = len(text.tokens)
                    stats.finish_reason = "stop"
                    if self.live_logprobs is not None:  # none past the stop string's token
                        del self.live_logprobs[len(text.tokens):]
                ready = text.ready()
                yield text.text[shown:ready], text, stats
                shown = max(shown, ready)
                if stats.finish_reason == "stop":
                    return
        finally:
            rounds.close()  # releases the engines now, not when the generator is collected
        final = text.finish()
        yield final[shown:], text, stats

    def generate(
        self,
        prompt: str | Sequence[int] | list[dict],
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | str | None = None,
        use_draft: bool = True,
        stop: str | Sequence[str] | None = (),
        chat: bool | None = None,
        *,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        cancel=None,
        logprobs: int | None = None,
        response_format: dict | None = None,
    ) -> GenerationResult:
        """Decode up to max_new_tokens new tokens from `prompt`: text, a list of
        {"role", "content"} messages, or token ids. A sampling argument left None takes the
        bundle's generation default (the model's generation_config), else greedy / off (see
        SamplingParams for what each does). `chat` None applies the bundle's chat template to
        text when it has one. use_draft=False is target-only decoding on the same engines.
        `stop` (a string or a list of them) ends generation; the text is cut before it. A seed
        reproduces a sample within a mode; speculative and target-only draws differ for the
        same seed (the same distribution, other random numbers). `cancel`, a threading.Event
        another thread may set, ends the request after the round in flight (finish_reason
        "cancelled"). `logprobs` N (0..20) fills the result's `logprobs`: each token's
        log-probability under the target's own distribution at its position (the warped one
        that sampling draws from; greedy: the log-softmax of the logits, penalties applied),
        with the N most likely tokens there; the tokens themselves do not change.
        `response_format` ({"type": "json_object"}, or {"type": "json_schema", "json_schema":
        {"schema": {...}}}, as OpenAI's API takes it) masks the logits of draft and target alike
        to what the grammar allows: the output is the target's distribution restricted to it,
        exactly, in both modes (constraint.py)."""
        params = self.constrained(self.sampling_params(
            seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias), response_format)
        if self.tokenizer is None:  # token ids in, token ids out: no text, no stop strings
            if stop_strings(stop):
                raise InputError("stop strings need a tokenizer: this generator has none")
            tokens, stats = [], DecodeStats()
            for new, stats in self._rounds(prompt, max_new_tokens, params, gamma, use_draft,
                                           chat, cancel, logprobs):
                tokens.extend(int(t) for t in new)
            return self._result(tokens, None, stats)
        text = stats = None
        for _, text, stats in self._texts(prompt, max_new_tokens, params, gamma, use_draft,
                                          stop, chat, live=False, cancel=cancel,
                                          logprobs=logprobs):
            pass
        return self._result(text.tokens, text.finish(), stats)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               gamma=None, use_draft: bool = True, stop: str | Sequence[str] | None = (),
               chat: bool | None = None, *, min_p: float | None = None,
               repetition_penalty: float | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None,
               logit_bias: dict[int, float] | None = None, cancel=None,
               logprobs: int | None = None, response_format: dict | None = None
               ) -> Iterator[str]:
        """Yield the new text piece by piece, as rounds complete: the same tokens, text and
        stats as generate() with the same arguments. Holds back an incomplete UTF-8 character
        and any tail that could still become a stop string. A stream closed early (close(), Ctrl-C)
        leaves last_result with what it did so far, finish_reason "cancelled"."""
        if self.tokenizer is None:
            raise InputError("stream() needs a tokenizer: use generate() for token ids")
        params = self.constrained(self.sampling_params(
            seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias), response_format)
        check_logprobs(logprobs)
        return self._stream(prompt, max_new_tokens, params, gamma, use_draft, stop, chat, cancel,
                            logprobs)

    def _stream(self, prompt, max_new_tokens, params, gamma, use_draft, stop, chat, cancel,
                logprobs):
        text = stats = None
        pieces = []
        texts = self._texts(prompt, max_new_tokens, params, gamma, use_draft, stop, chat,
                            cancel=cancel, logprobs=logprobs)
        try:
            for piece, text, stats in texts:
                if piece:
                    pieces.append(piece)
                    yield piece
        except (GeneratorExit, KeyboardInterrupt):  # stopped by its caller (close(), Ctrl-C):
            # the result is what it did so far
            texts.close()
            if stats is not None:
                stats.finish_reason = stats.finish_reason or "cancelled"
                self._result(text.tokens, "".join(pieces), stats)
            raise
        self._result(text.tokens, "".join(pieces), stats)

    def _result(self, tokens: list[int], text: str | None, stats: DecodeStats) -> GenerationResult:
        self.last_stats = stats.to_dict()
        logprobs = self.live_logprobs[: len(tokens)] if self.live_logprobs is not None else None
        self.last_result = GenerationResult(list(tokens), text, self.last_stats,
                                            stats.finish_reason, logprobs)
        return self.last_result

    def target_logits(self, prompt_ids, prefix: Sequence[int]) -> np.ndarray:
        """The target's logits float64 [V] for the next token after prompt + prefix (the prefix
        being generated tokens), from one fresh call: what `specrun check` compares with."""
        with self._lock:
            self.target.reset()
            seq = np.concatenate([self._begin(np.asarray(prompt_ids, np.int64), None),
                                  np.asarray(prefix, np.int64)])
            return np.asarray(self.target.forward(seq, 0, 1)[-1], np.float64)
