"""Text in and out: checking prompts and stop strings, and turning tokens into text as they come.

`IncrementalText` decodes each new token with a few tokens of context instead of the whole
sequence (the way Hugging Face's TextStreamer and vLLM do): the text of tokens[a:] minus the
text of tokens[a:b] is what token b added, with the same treatment of the window's first token
on both sides, so the pieces add up to the text of the whole sequence. A piece that ends in an
incomplete UTF-8 character ("\ufffd") waits for the next token (a run of invalid bytes widens
the window until it ends; valid text keeps it at a few tokens). Stop strings are looked for in
the new text only (plus the tail that could begin one), once per token, so the first token
that completes a stop string is known exactly.
"""

from __future__ import annotations

import numpy as np

from .errors import FieldError, InputError

EMPTY_PROMPT = "the prompt is empty: give at least one token of text"
BYTES_PROMPT = ("the prompt is bytes: decode it to text first (prompt.decode('utf-8')), or pass "
                "token ids as a list of integers")


def check_text(text: str, what: str) -> None:
    """Text must be encodable: a lone surrogate (from bytes decoded with errors="surrogateescape",
    as Python does for command-line arguments) is not a character any tokenizer knows."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid Unicode: {text[e.start]!r} at character "
                         f"{e.start} is a lone surrogate; decode the bytes it came from as "
                         f"UTF-8 (errors='replace' to drop what is not)") from None


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
        raise FieldError("stop", f"stop={stop!r} is invalid: give a string or a list of strings")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise FieldError("stop", f"stop string {s!r} is invalid: each stop string must be "
                                     f"non-empty text")
        try:
            check_text(s, "stop string")  # a lone surrogate would silently never match
        except InputError as e:
            raise FieldError("stop", str(e)) from None
    return tuple(stop)


class IncrementalText:
    """The text of a growing token sequence, and where the first stop string starts in it."""

    def __init__(self, detokenize, stops: tuple[str, ...] = ()):
        self.detokenize = detokenize  # list[int] -> str, special tokens skipped
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # whole characters only
        self.stop_at: int | None = None  # where the first stop string starts in self.text
        self._window = 0  # first token of the decoding window
        self._read = 0  # tokens[:_read] are in self.text

    def extend(self, tokens) -> bool:
        """Append a round's tokens; True once a stop string is complete, which is then found at
        the token that completes it (the tokens after it are not appended). Without stop
        strings the round is decoded at once."""
        if self.stops:
            return any(self.add(t) for t in tokens)
        self.tokens.extend(int(t) for t in tokens)
        return self._read_new()

    def add(self, token: int) -> bool:
        """Append one token; True once a stop string is complete (then nothing more is added)."""
        self.tokens.append(int(token))
        return self._read_new()

    def _read_new(self) -> bool:
        seen = self.detokenize(self.tokens[self._window : self._read])
        grown = self.detokenize(self.tokens[self._window :])
        if grown.endswith("\ufffd"):  # a character still incomplete: wait for its next bytes
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += grown[len(seen):]
        self._window, self._read = self._read, len(self.tokens)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stop_at = min(hits)
        return self.stop_at is not None

    def finish(self) -> str:
        """The whole text, a trailing incomplete character included, cut before a stop."""
        if self._read < len(self.tokens):
            seen = self.detokenize(self.tokens[self._window : self._read])
            self.text += self.detokenize(self.tokens[self._window :])[len(seen):]
            self._read = len(self.tokens)
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def ready(self) -> int:
        """How much of the text can be shown: all but a tail that could begin a stop string."""
        if self.stop_at is not None:
            return self.stop_at
        return max(0, len(self.text) - self.hold)


def texts(rounds, detokenize, stop: tuple[str, ...], live: bool = True,
          token_logprobs: list | None = None):
    """The one implementation of text and stop strings behind Generator.generate and stream,
    over `rounds` (each round's new tokens and the request's DecodeStats, while the engines are
    held): yields (new text safe to show, the IncrementalText so far, stats) per round. A stop
    string ends the request at the token that completes it; tokens, stats and
    `token_logprobs` then count up to it. Without `live` (generate) and without stop strings
    the text is decoded once, at the end."""
    state = TextState(detokenize, stop, live, token_logprobs)
    try:
        for new, stats in rounds:
            piece = state.add(new, stats)
            if piece is not None:
                yield piece, state.text, stats
            if stats.finish_reason == "stop":
                return
    finally:
        rounds.close()  # releases the engines now, not when the generator is collected
    yield state.end(), state.text, state.stats


class TextState:
    """One request's text as its rounds come (`texts` pulls them from a loop; a batch pushes
    each sequence's: batch.py)."""

    def __init__(self, detokenize, stop: tuple[str, ...], live: bool = True,
                 token_logprobs: list | None = None):
        self.text = IncrementalText(detokenize, stop)
        self.stop, self.live, self.token_logprobs = stop, live, token_logprobs
        self.shown, self.stats = 0, None

    def add(self, new, stats) -> str | None:
        """A round's new tokens: the text now safe to show (None where it is decoded only at
        the end); a stop string sets stats.finish_reason "stop"."""
        self.stats = stats
        text = self.text
        if not self.live and not self.stop:
            text.tokens.extend(int(t) for t in new)
            return None
        if text.extend(new):
            stats.new_tokens = len(text.tokens)
            stats.finish_reason = "stop"
            if self.token_logprobs is not None:  # none past the stop string's token
                del self.token_logprobs[len(text.tokens):]
        ready = text.ready()
        piece = text.text[self.shown:ready]
        self.shown = max(self.shown, ready)
        return piece

    def end(self) -> str:
        """The rest of the text, once the request has ended."""
        final = self.text.finish()
        return final[self.shown:]
