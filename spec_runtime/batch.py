"""Many requests decoded together: each round, every sequence drafts, one call of the target's
lanes graph (engines/lanes.py) verifies all of them, and each accepts with the same exact test
as alone (decode/loop.py: propose, then settle).

    requests ─► members: a batch-1 engine each (its cache), a draft, a RequestState, its text
      round:  propose (each member's draft, on its own engines)
              prefill (a member's first call: alone, chunked, as a single request's)
              verify  (the rest: one lanes call of up to L members)
              settle  (each member: accept, roll back, emit, stop strings)
      a member that finishes leaves; the next request takes its place at the next round

A member's rows are its own whatever shares the call (lanes.check_lanes proved it on this
machine before any batch ran), so each output, greedy or sampled with a seed, is the one the
request gets alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .decode.loop import Proposal, RequestState, begin, propose, settle
from .decode.stats import DecodeStats, Recorder
from .engines.lanes import LaneCall
from .text import TextState


@dataclass
class Member:
    """A request in a batch, on the engines of one of the generator's forks."""

    index: int  # the request's place in the batch's input
    gen: object  # a Generator fork: its target engine (and cache) and its draft
    state: RequestState
    text: TextState | None
    token_logprobs: list | None
    tokens: list = field(default_factory=list)  # without a tokenizer: the ids emitted

    @property
    def draft(self):
        return self.gen.draft if self.state.request.use_draft else None


def decode_batch(gen, lanes, forks: list, requests: list, clock=time.perf_counter):
    """Decode `requests` (Requests of `gen`) with up to len(forks) at once; yields (index,
    GenerationResult) as each ends."""
    from .generator import _result

    pending = list(enumerate(requests))[::-1]
    free = list(forks)
    members: list[Member] = []
    while members or pending:
        while free and pending:
            index, request = pending.pop()
            members.append(_join(gen, free.pop(), index, request, clock))
        proposals = [propose(m.draft, m.state) for m in members]
        _score(lanes, members, proposals, clock)
        for m in list(members):
            if m.state.stats.finish_reason:
                members.remove(m)
                free.append(m.gen)
                yield m.index, _finish(m, _result)


def _join(gen, fork, index: int, request, clock) -> Member:
    stats = DecodeStats(target_one_row=getattr(fork.target, "one_row", None))
    logprobs = [] if request.logprobs is not None else None
    state = RequestState(request, Recorder(stats, clock), logprobs)
    member = Member(index, fork, state, None, logprobs)
    if gen.tokenizer is not None:
        member.text = TextState(gen.detokenize, request.stop, live=False,
                                token_logprobs=logprobs)
    begin(fork.target, member.draft, state)
    return member


def _score(lanes, members: list[Member], proposals: list[Proposal], clock) -> None:
    """Steps 2 to 5 of every member's round: the prefills alone, the rest in lanes calls."""
    batched = []
    for m, p in zip(members, proposals):
        tokens, pos, rows = p.feed
        if m.state.target_valid == 0 or pos + max(len(tokens), rows) > lanes.max_len:
            logits = m.state.recorder.target(m.gen.target.forward, tokens, pos, rows)
            _settle(m, p, logits)
        else:
            batched.append((m, p))
    for start in range(0, len(batched), lanes.lanes):
        group = batched[start : start + lanes.lanes]
        calls = [LaneCall(m.gen.target, *p.feed) for m, p in group]
        t0 = clock()
        rows = lanes.forward(calls)
        elapsed = clock() - t0
        for (m, p), logits, call in zip(group, rows, calls):
            m.state.recorder.target_call(len(call.tokens), elapsed)
            _settle(m, p, logits)


def _settle(m: Member, p: Proposal, logits) -> None:
    emitted = settle(m.draft, m.state, p, logits)
    if m.text is not None:
        m.text.add(emitted, m.state.stats)
    else:
        m.tokens.extend(int(t) for t in emitted)


def _finish(m: Member, result):
    stats = m.state.stats
    if m.text is None:
        return result(m.tokens, None, stats, m.token_logprobs)
    return result(m.text.text.tokens, m.text.text.finish(), stats, m.token_logprobs)
