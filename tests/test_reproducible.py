"""A seed reproduces a sample under auto γ: a seeded sample's rounds are priced at costs fixed
before it starts (the bundle's, measured at build), never at its own timings, which differ from
run to run; its distribution stays the target's (joint chi-square against exact enumeration)."""

from dataclasses import replace

import numpy as np
import pytest
from toy_models import FakeClock, ToyEngine, exact_joint, joint_p_value

import spec_runtime
from spec_runtime import Generator, ModelDraft, NgramDraft, SamplingParams
from spec_runtime.decode.drafts import HybridDraft
from spec_runtime.bundle.checks import COSTS
from spec_runtime.decode.stats import Costs

PROMPT = [1, 2, 3, 1, 2]
VOCAB = 6


def timed(draft_s: float, row_s: float, **kw) -> Generator:
    """A toy pair whose calls cost known seconds on a fake clock (a draft agreeing at α ≈ 0.7)."""
    clock = FakeClock()
    target = ToyEngine(vocab=VOCAB, seed=0, clock=clock, delay=0.004)
    target.row_delay = row_s
    draft = ModelDraft(ToyEngine(vocab=VOCAB, seed=1, like=target, mix=0.35, clock=clock,
                                 delay=draft_s), clock=clock)
    return Generator(target, draft, max_gamma=6, clock=clock, **kw)


SAMPLE = dict(max_new_tokens=60, temperature=1.0, seed=2, gamma="auto")


def test_a_seeded_sample_does_not_follow_the_machines_timings():
    """Two machines: on one a verified row is free, on the other it costs 60% of a step and a
    draft step 5x more. Priced at their own timings the two draft different lengths and so
    draw other tokens from the same seed; priced at the generator's fixed costs they give the
    same sample, round for round."""
    fast, slow = timed(0.0002, 0.0), timed(0.001, 0.0024)
    live = [g.generate(replace(g.request(PROMPT, **SAMPLE), costs=None)) for g in (fast, slow)]
    assert live[0].stats.gammas_used != live[1].stats.gammas_used  # timings do decide
    assert live[0].tokens != live[1].tokens
    fixed = [g.generate(PROMPT, **SAMPLE) for g in (fast, slow)]
    assert fixed[0].stats.gammas_used == fixed[1].stats.gammas_used
    assert fixed[0].tokens == fixed[1].tokens
    assert len(set(fixed[0].stats.gammas_used[:-2])) >= 2  # still chosen round by round


def test_only_a_seeded_sample_takes_the_fixed_costs():
    """Without a seed nothing is promised, and the live prices fit the machine; greedy output
    does not depend on γ, so its rounds keep the live prices (and the confidence floor's)."""
    gen = timed(0.0002, 0.0, costs=Costs(0.2, 0.1))
    request = gen.request  # (the toy cache holds 64 positions)
    assert request(PROMPT, max_new_tokens=8, temperature=0.7, seed=1).costs == Costs(0.2, 0.1)
    assert request(PROMPT, max_new_tokens=8, temperature=0.7).costs is None
    assert request(PROMPT, max_new_tokens=8, seed=1).costs is None  # greedy


def test_a_hand_made_generator_prices_what_it_knows_without_measuring():
    gen = Generator(ToyEngine(vocab=VOCAB), NgramDraft(VOCAB))
    assert gen.costs == Costs(0.0, 0.0)  # a lookup runs no graph
    gen = Generator(ToyEngine(vocab=VOCAB), HybridDraft(
        ModelDraft(ToyEngine(vocab=VOCAB, seed=1)), NgramDraft(VOCAB), 0.3))
    assert gen.costs == Costs(0.3, 0.0)  # the hybrid's draft_cost


def test_a_bundle_records_its_costs_and_its_seeded_samples_repeat(llama_pair):
    """The build measures the prices on the building machine and the manifest carries them;
    `specrun generate --temperature 0.9 --top-p 0.9 --seed 11 --gamma auto` then gives the same
    text however long each call takes (here: clocks that tick at random)."""
    gen = spec_runtime.load(llama_pair[2])
    costs = gen.manifest.costs
    assert set(costs) == set(COSTS) and all(0 <= costs[k] <= COSTS[k] for k in COSTS)
    assert gen.costs == Costs(**costs)
    runs = []
    for clock_seed in (0, 1, 2):
        ticks = np.random.default_rng(clock_seed)
        now = [0.0]

        def clock():
            now[0] += float(ticks.exponential(0.01))
            return now[0]

        gen.clock = clock
        r = gen.generate("hello", max_new_tokens=48, temperature=0.9, top_p=0.9, seed=11,
                         gamma="auto", chat=False)
        runs.append((r.tokens, r.stats.gammas_used))
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("costs", [Costs(0.05, 0.0), Costs(0.0, 0.2)])
def test_fixed_cost_rounds_keep_the_targets_joint(monkeypatch, costs):
    """Sampling at temperature 0.9 from γ 1, re-priced from the first round: the first three
    tokens span rounds whose lengths the earlier rounds' acceptances chose, and their joint is
    still the target's, enumerated."""
    monkeypatch.setattr(spec_runtime.decode.loop, "AUTO_WARMUP_POSITIONS", 1)
    target = ToyEngine(vocab=VOCAB, seed=0)
    draft = ModelDraft(ToyEngine(vocab=VOCAB, seed=1, like=target, mix=0.6))
    gen = Generator(target, draft, max_gamma=5, default_gamma=1, costs=costs)
    exact = exact_joint(ToyEngine(vocab=VOCAB, seed=0), PROMPT, SamplingParams(temperature=0.9))
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    second = set()
    for seed in range(8000):
        r = gen.generate(PROMPT, max_new_tokens=8, temperature=0.9, seed=seed, gamma="auto")
        counts[tuple(r.tokens[:3])] += 1
        second.update(r.stats.gammas_used[1:2])
    p = joint_p_value(counts, exact)
    print(f"{costs}: p-value {p:.4f}, second rounds' γ {sorted(second)}")
    assert p > 1e-4
    assert len(second) >= 2  # the first round's outcome chose the second's length


class LoadedEngine:
    """An engine whose call takes `cost` seconds per row times the machine's load at that
    moment, on a shared fake clock; the load changes every `period` calls of all engines."""

    max_len, vocab_size = 64, 50

    def __init__(self, machine, cost):
        self.machine, self.cost = machine, cost

    def reset(self):
        pass

    def forward(self, tokens, pos, rows):
        m = self.machine
        m["now"] += self.cost * len(tokens) * m["loads"][(m["calls"] // m["period"]) % 2]
        m["calls"] += 1


def test_costs_are_priced_under_the_same_load_call_for_call(monkeypatch):
    """A load that triples every 3 calls (3 engines' calls a round): timed one engine after the
    other, the target's step is priced under one load and the draft's under another; timed in
    rounds, each ratio is the engines' own (draft 0.3 of a step, 5 rows 5 steps here)."""
    from spec_export.bundle import costs

    machine = {"now": 0.0, "calls": 0, "period": 3, "loads": (1.0, 3.0)}
    monkeypatch.setattr(costs.time, "perf_counter", lambda: machine["now"])
    target, draft = LoadedEngine(machine, 1.0), LoadedEngine(machine, 0.3)
    # after 2 × 3 untimed setup calls, the rounds of 3 see one load each, alternately
    step, verify, draft_step = costs.median_ratios([(target, 1), (target, 5), (draft, 1)])
    assert step == 1.0
    assert verify == pytest.approx(5.0) and draft_step == pytest.approx(0.3)
