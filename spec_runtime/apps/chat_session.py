"""A multi-turn conversation on one loaded Generator (what `specrun chat` drives).

The history is a list of (user, assistant) turns rendered through the bundle's chat template
on every answer; the KV cache is refilled from the whole conversation each time (the prefill of
a chat turn is a few hundred tokens, tens of milliseconds). When the conversation no longer fits
the cache beside the answer's max_new_tokens, the oldest turns are dropped first.
"""

from __future__ import annotations

from typing import Iterator

from ..decode.stats import GenerationStats
from ..errors import InputError
from ..request import GenerationOptions


class ChatSession:
    def __init__(self, gen, system: str | None = None,
                 options: GenerationOptions | None = None, **values):
        """`options` (or GenerationOptions(**values): max_new_tokens, the sampling controls,
        gamma, use_draft) serve every answer: each turn is a request of its own, made from the
        conversation and them."""
        if gen.audio is not None:  # before the template: a speech bundle has none either
            raise InputError("this bundle is a speech model (Whisper): it transcribes audio, it "
                             "does not chat; use `specrun transcribe AUDIO`")
        if not gen.chat_template:
            raise InputError("this bundle has no chat template, so it cannot hold a "
                             "conversation: use `specrun generate`")
        self.gen = gen
        self.system = system
        self.options = GenerationOptions.given(options, values)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and its totals."""
        self.turns: list[tuple[str, str]] = []
        self.last_stats: GenerationStats | None = None
        self.totals = {"answers": 0, "tokens": 0, "seconds": 0.0, "proposed": 0, "accepted": 0,
                       "target_calls": 0}

    def messages(self, user: str) -> list[dict]:
        """The conversation so far followed by `user`, as chat template messages."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return out + [{"role": "user", "content": user}]

    def _capacity(self) -> int:
        # a prompt of n tokens and m new ones write n + m - 1 cache positions
        return self.gen.capacity(self.options.use_draft) - self.options.max_new_tokens + 1

    def fit(self, user: str) -> list[str]:
        """Drop the oldest turns until the conversation and `user` fit the cache beside the
        answer; returns what was done, for the user to see."""
        dropped = 0
        while self.turns and len(self.gen.prompt_ids(self.messages(user))) > self._capacity():
            self.turns.pop(0)
            dropped += 1
        return [f"dropped the oldest {dropped} turn(s) to fit the {self._capacity()}-token "
                f"context"] if dropped else []

    def answer(self, user: str) -> Iterator[str]:
        """Stream the answer to `user`; it joins the conversation when it ends, also when the
        caller stops it early (close()), as far as it got."""
        pieces: list[str] = []
        stream = self.gen.stream(self.gen.request(self.messages(user), self.options))
        completed = False
        try:
            for piece in stream:
                pieces.append(piece)
                yield piece
            completed = True
        finally:
            stream.close()  # releases the engines at once when stopped early
            # a turn that did not run (a message too long for the cache) is not history; one
            # stopped early is, and counts as an answer with what it did so far
            if completed or pieces:
                self.turns.append((user, "".join(pieces)))
                if stream.result is not None:  # it started: its result says what it did
                    self._count(stream.result.stats)

    def _count(self, stats: GenerationStats) -> None:
        self.last_stats = stats
        t = self.totals
        t["answers"] += 1
        t["tokens"] += stats.new_tokens
        t["seconds"] += stats.wall_time_s
        t["proposed"] += stats.proposed
        t["accepted"] += stats.accepted
        t["target_calls"] += stats.target_calls

    def totals_line(self) -> str:
        t = self.totals
        if not t["answers"]:
            return f"no answers yet · {len(self.turns)} turn(s) in the conversation"
        rate = t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0
        s = (f"{t['answers']} answer(s) · {t['tokens']} tokens · {rate:.1f} tok/s · "
             f"{t['tokens'] / max(1, t['target_calls']):.2f} tokens/target call")
        if t["proposed"]:
            s += f" · accepted {t['accepted']}/{t['proposed']} draft tokens"
        return s + f" · {len(self.turns)} turn(s) in the conversation"
