"""Many requests decoded together (Generator.generate_batch, spec_runtime/batch.py): every result
is the one its request gets alone, token for token, greedy and seeded, whatever shares its calls
and whenever it joins; sampled draws from a batch follow the target's enumerated distribution.

The orchestration is tested here on the toy numpy engines, with a lanes stand-in that scores each
lane by its own engine (a lanes graph's rows are its members' single-call rows: what the real
graph's check proves, tests/test_batch_bundle.py); the real lanes graph is tested there."""

import numpy as np
import pytest
from test_decode import PROMPT, SETTINGS, VOCAB, chi_square_p, make
from toy_models import FakeClock, ToyEngine, exact_joint

from spec_runtime import GenerationOptions, SamplingParams
from spec_runtime.decode.drafts import draft_engines
from spec_runtime.engines.lanes import LaneCheck
from spec_runtime.errors import InputError, NonFiniteLogitsError

P_MIN = 1e-4


class ToyLanes:
    """The lanes interface over toy engines: each call's rows from its own engine; counts the
    calls and how many lanes each carried."""

    def __init__(self, lanes: int, max_len: int):
        self.lanes, self.max_len = lanes, max_len
        self.carried: list[int] = []

    def forward(self, calls):
        assert 0 < len(calls) <= self.lanes
        self.carried.append(len(calls))
        return [np.array(c.engine.forward(c.tokens, c.pos, c.rows)) for c in calls]


def batched(draft_kind, lanes=3, max_len=128, **kw):
    gen = make(draft_kind, max_len=max_len, **kw)
    toy = ToyLanes(lanes, max_len)
    gen.lanes = (toy, LaneCheck(True, 0.0), [gen.target.fork() for _ in range(lanes)])
    if draft_engines(gen.draft):  # the draft's model steps in lanes calls of its own
        model = draft_engines(gen.draft)[0]
        gen.draft_lanes = (ToyLanes(lanes, max_len), LaneCheck(True, 0.0),
                           [model.fork() for _ in range(lanes)])
    return gen, toy


PROMPTS = [[0], [1, 2, 3, 1, 2], [5, 4, 3, 2, 1, 0, 5, 4], [2, 2], [3, 1, 4, 1, 5, 1],
           [0, 0, 0, 1], [4]]


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid", None])
def test_a_batch_gives_each_request_what_it_gets_alone(draft_kind):
    """Seven requests over three lanes (four join as others end), each with options of its
    own: greedy at several γ, seeded samples, target-only, different lengths."""
    gen, toy = batched(draft_kind)
    options = [dict(max_new_tokens=40), dict(max_new_tokens=17, temperature=1.0, seed=3),
               dict(max_new_tokens=33, gamma=1), dict(max_new_tokens=9, use_draft=False),
               dict(max_new_tokens=40, temperature=0.8, top_k=3, seed=11, gamma=5),
               dict(max_new_tokens=25, temperature=1.2, top_p=0.75, seed=5), dict(max_new_tokens=1)]
    requests = [gen.request(p, GenerationOptions(**o)) for p, o in zip(PROMPTS, options)]
    alone = [gen.generate(r) for r in requests]
    together = gen.generate_batch(requests)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    for a, b, o in zip(alone, together, options):
        assert b.stats.new_tokens == a.stats.new_tokens
        if "gamma" in o or "seed" in o:  # else the batch may stop drafting (BatchRounds)
            assert (b.stats.rounds, b.stats.accepted) == \
                (a.stats.rounds, a.stats.accepted)
    assert max(toy.carried) >= 2, toy.carried  # calls carried several requests at once
    if draft_kind == "model":  # and the model drafts stepped together (a hybrid's steps
        # are too, when two of its requests are drafting with the model at once)
        assert max(gen.draft_lanes[0].carried) >= 2, gen.draft_lanes[0].carried


def test_one_options_object_for_every_prompt_and_order_of_results():
    gen, _ = batched("model", lanes=2)
    options = GenerationOptions(max_new_tokens=12, temperature=0.9, seed=7)
    together = gen.generate_batch(PROMPTS, options)
    assert [r.tokens for r in together] == [gen.generate(p, options).tokens for p in PROMPTS]
    assert gen.generate_batch([]) == []


def test_logprobs_in_a_batch_are_those_of_the_request_alone():
    gen, _ = batched("model")
    options = GenerationOptions(max_new_tokens=15, logprobs=2)
    alone = [gen.generate(p, options) for p in PROMPTS[:4]]
    together = gen.generate_batch(PROMPTS[:4], options)
    for a, b in zip(alone, together):
        assert [(t.token, t.logprob, t.top) for t in b.logprobs] == \
            [(t.token, t.logprob, t.top) for t in a.logprobs]


def test_a_request_near_the_cache_end_is_scored_alone_within_the_batch():
    """Right padding writes filler slots past a lane's own tokens: a member whose call would
    reach past the cache is scored by a single call that round (the same rows)."""
    gen, toy = batched("model", lanes=2, max_len=24)
    prompts = [[1, 2, 3, 1, 2] * 3, [0]]
    options = GenerationOptions(max_new_tokens=8, gamma=4)
    assert [r.tokens for r in gen.generate_batch(prompts, options)] == \
        [gen.generate(p, options).tokens for p in prompts]


def test_without_checked_lanes_a_batch_decodes_one_request_at_a_time():
    gen, toy = batched("model")
    gen.lanes = (toy, LaneCheck(False, 1e-6), gen.lanes[2])
    assert gen.max_batch == 1
    options = GenerationOptions(max_new_tokens=10)
    assert [r.tokens for r in gen.generate_batch(PROMPTS[:3], options)] == \
        [gen.generate(p, options).tokens for p in PROMPTS[:3]]
    assert toy.carried == []


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_joint_of_batched_samples_equals_the_target(setting):
    """2000 seeded requests of one prompt, three at a time in a γ = 1 model draft's rounds:
    the first three tokens' joint against enumeration of the target. A request's first round
    (its prefill) is scored alone and emits two tokens at most: the third comes from a round
    scored in lanes."""
    gen, toy = batched("model", lanes=3)
    options = [GenerationOptions(max_new_tokens=4, gamma=1, seed=s, **SETTINGS[setting])
               for s in range(2000)]
    results = gen.generate_batch([gen.request(PROMPT, o) for o in options])
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    for r in results:
        counts[tuple(r.tokens[:3])] += 1
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, SamplingParams(**SETTINGS[setting]))
    p = chi_square_p(counts, exact)
    print(f"{setting}: p-value {p:.4f}; lanes carried {np.bincount(toy.carried)}")
    assert p > P_MIN


POISON = 5  # a prompt that starts with it turns the toy target's rows to NaN after position 6


class PoisonedEngine(ToyEngine):
    def forward(self, tokens, pos, num_logits=1):
        logits = super().forward(tokens, pos, num_logits)
        if self.state[0] == POISON and pos + len(tokens) > 6:
            return np.full_like(logits, np.nan)
        return logits


def test_a_request_that_fails_mid_way_ends_alone_and_the_others_go_on():
    """Its own error in its place (or raised, naming the prompt, once the others ended); the
    others' results are what they get alone. A request that cannot be made (here a γ out of
    range) fails the same way, before anything is decoded."""
    gen = make("model", max_len=128)
    gen.target = PoisonedEngine(vocab=VOCAB, max_len=128, seed=0)
    toy = ToyLanes(3, 128)
    gen.lanes = (toy, LaneCheck(True, 0.0), [gen.target.fork() for _ in range(3)])
    prompts = [[0, 1], [POISON, 1, 2], [3, 4, 3], [2]]
    options = GenerationOptions(max_new_tokens=30)
    out = gen.generate_batch(prompts, options, return_exceptions=True)
    assert isinstance(out[1], NonFiniteLogitsError)
    for i in (0, 2, 3):
        assert out[i].tokens == gen.generate(prompts[i], options).tokens
    with pytest.raises(NonFiniteLogitsError, match="prompt 1: "):
        gen.generate_batch(prompts, options)
    bad = gen.generate_batch([[0], gen.request([1], max_new_tokens=5), [2]],
                             GenerationOptions(max_new_tokens=5, gamma=99),
                             return_exceptions=True)
    assert isinstance(bad[0], InputError) and "gamma" in str(bad[0])
    assert bad[1].tokens == gen.generate([1], max_new_tokens=5).tokens


def test_more_requests_in_flight_than_lanes_share_calls_of_at_most_the_lanes():
    """concurrency 5 over 2 lanes: every call carries at most 2, every result is its alone."""
    gen, toy = batched("hybrid", lanes=2)
    options = GenerationOptions(max_new_tokens=20, temperature=0.9, seed=4)
    got = gen.generate_batch(PROMPTS, options, concurrency=5)
    assert [r.tokens for r in got] == [gen.generate(p, options).tokens for p in PROMPTS]
    assert toy.carried and max(toy.carried) == 2
    with pytest.raises(InputError, match="concurrency 0 is invalid"):
        gen.generate_batch(PROMPTS, options, concurrency=0)


def test_a_streamed_batch_ends_each_request_once_with_its_result():
    gen, _ = batched("model")
    pieces = list(gen.batch(PROMPTS[:4], GenerationOptions(max_new_tokens=9), stream=True))
    ends = [p for p in pieces if p.done]
    assert sorted(p.index for p in ends) == [0, 1, 2, 3]
    for p in ends:
        assert p.result.tokens == gen.generate(PROMPTS[p.index], max_new_tokens=9).tokens


@pytest.mark.parametrize("row_delay, falls", [(1.0, True), (0.0, False)])
def test_auto_gamma_falls_to_zero_where_a_batchs_rows_cost_as_much_as_steps(row_delay, falls):
    """Toy costs on a fake clock, the lanes' call the sum of its lanes' (no gain from sharing):
    where every verified row costs as much as a step, drafting cannot pay and greedy auto γ
    falls to 0 (rounds without drafts); where rows are free it never does. The tokens are the
    requests' alone either way (the oracle: each request decoded alone)."""
    clock = FakeClock()
    gen, toy = batched("model", lanes=3, clock=clock)
    for engine in [gen.target, *gen.lanes[2]]:
        engine.clock, engine.delay, engine.row_delay = clock, 1.0, row_delay
    # what the load's check would have timed: 3 lanes of n tokens
    timed = {n: 3 * (1.0 + (n - 1) * row_delay) for n in (1, gen.max_gamma + 1)}
    gen.lanes = (toy, LaneCheck(True, 0.0, 0.0, timed), gen.lanes[2])
    options = GenerationOptions(max_new_tokens=60, gamma="auto")
    alone = [gen.generate(p, options).tokens for p in PROMPTS[:3]]
    got = gen.generate_batch(PROMPTS[:3], options)
    assert [r.tokens for r in got] == alone
    # a request's last round may draft nothing anyway: one token was left to emit
    zeros = [r.stats.gammas_used[:-1].count(0) for r in got]
    print(f"row_delay {row_delay}: rounds without drafts {zeros}")
    assert all(z >= 10 for z in zeros) if falls else not any(zeros)
    # the next batch starts from what this one found: no draft from its first round on
    again = gen.generate_batch(PROMPTS[3:6], options)
    assert [r.tokens for r in again] == [gen.generate(p, options).tokens for p in PROMPTS[3:6]]
    firsts = [r.stats.gammas_used[0] for r in again]
    assert all(g == 0 for g in firsts) if falls else all(g > 0 for g in firsts)
    # the bundle's fixed γ falls with the batch too; a γ the request sets is kept
    for own, stays in ((None, not falls), (3, True)):
        kept = gen.generate_batch(PROMPTS[:3], GenerationOptions(max_new_tokens=30, gamma=own))
        assert all((0 not in r.stats.gammas_used[:-1]) == stays for r in kept), own
    # alone (no batch prices), auto γ always drafts: its lowest γ is 1 there
    assert 0 not in gen.generate(PROMPTS[0], options).stats.gammas_used[:-1]


def test_a_batch_forks_engine_called_outside_a_request_runs_alone():
    """A call from outside a held request's loop (here `target_logits`) does not wait at the
    gate for requests that will never come: it is the engine's own call."""
    gen, toy = batched("model")
    fork = gen.together(2)[0]
    assert np.array_equal(fork.target_logits([1, 2, 3], [4]), gen.target_logits([1, 2, 3], [4]))
    assert toy.carried == []


def test_no_call_runs_beside_another_in_a_batch(monkeypatch):
    """A request's prompt (and any call made alone) waits at the gate like a lanes call and
    runs first, with nothing beside it: two calls at once would share the cores. Every engine
    call and lanes call here takes 2 ms (a window in which another call starting would show);
    at most one is ever in progress, and every result is still its request's alone."""
    import threading
    import time

    gen, toy = batched("model", lanes=3)
    options = GenerationOptions(max_new_tokens=12, gamma=2)
    want = [gen.generate(p, options).tokens for p in PROMPTS]
    state = {"active": 0, "most": 0}
    lock, inside = threading.Lock(), threading.local()

    def counted(call):
        def wrapped(*args, **kwargs):
            if getattr(inside, "depth", 0):  # a lanes call's own engine calls
                return call(*args, **kwargs)
            with lock:
                state["active"] += 1
                state["most"] = max(state["most"], state["active"])
            inside.depth = 1
            try:
                time.sleep(0.002)
                return call(*args, **kwargs)
            finally:
                inside.depth = 0
                with lock:
                    state["active"] -= 1
        return wrapped

    monkeypatch.setattr(ToyEngine, "forward", counted(ToyEngine.forward))
    monkeypatch.setattr(ToyLanes, "forward", counted(ToyLanes.forward))
    got = gen.generate_batch(PROMPTS, options)
    assert [r.tokens for r in got] == want
    assert max(toy.carried) >= 2 and state["most"] == 1, (toy.carried, state)
