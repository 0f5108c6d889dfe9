"""`specrun check`: the statistics it relies on (against scipy), its verdict on correct runtimes
(exit 0), on deliberately broken ones (exit 1), on near-tied greedy divergences (a warning), and
on bad input (exit 2)."""

import itertools
import json
import time

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats as sps
from toy_models import ToyEngine

import spec_runtime
import spec_runtime.decode.loop
from spec_runtime import GenerationOptions, Generator, ModelDraft
from spec_runtime.apps import check, twosample
from spec_runtime.decode.sampling import sample
from draftproof.cli.specrun import main as specrun


def run_cli(bundle, *args):
    return CliRunner().invoke(specrun, ["check", "--bundle", str(bundle), *map(str, args)])


def no_residual(draft_tokens, p_draft, p_target, rng):
    """A classic bug: after a rejection, sample p_target instead of norm(max(0, p - q))."""
    for i, x in enumerate(draft_tokens):
        if not rng.random() * p_draft[i, x] < p_target[i, x]:
            return [int(t) for t in draft_tokens[:i]] + [sample(p_target[i], rng)]
    return [int(t) for t in draft_tokens] + [sample(p_target[len(draft_tokens)], rng)]


def toy_generator(mix=0.6, cls=Generator):
    target = ToyEngine(vocab=6, max_len=64, seed=0)
    return cls(target, ModelDraft(ToyEngine(vocab=6, max_len=64, seed=1, like=target, mix=mix)))


TOY_PROMPTS = ([1, 2, 3, 1, 2], [0, 5, 4])

# -- the statistics -----------------------------------------------------------------------------


@pytest.mark.parametrize("x, df", [(0.5, 1), (3.0, 2), (10.0, 4), (60.0, 30), (200.0, 150),
                                   (1e-3, 7), (400.0, 10), (25.0, 9)])
def test_chi2_tail_matches_scipy(x, df):
    assert twosample.chi2_sf(x, df) == pytest.approx(sps.chi2.sf(x, df), rel=1e-8, abs=1e-300)


def test_noncentral_tail_and_inverses_match_scipy():
    for df, nc in [(1, 0.5), (5, 10.0), (30, 80.0), (100, 300.0)]:
        for x in (df * 0.5, float(df), 2.0 * df + nc):
            assert twosample.ncx2_sf(x, df, nc) == pytest.approx(sps.ncx2.sf(x, df, nc),
                                                                 rel=1e-6, abs=1e-12)
    assert twosample.chi2_isf(1e-3, 9) == pytest.approx(sps.chi2.isf(1e-3, 9), rel=1e-8)
    nc = twosample.noncentrality_for_power(9, 1e-3, 0.9)
    assert sps.ncx2.sf(sps.chi2.isf(1e-3, 9), 9, nc) == pytest.approx(0.9, abs=1e-6)


def test_pooled_cells_do_not_depend_on_the_order_of_the_samples():
    rng = np.random.default_rng(0)
    seqs = [tuple(int(t) for t in rng.integers(0, 4, size=3)) for _ in range(300)]
    cells = twosample.pool_cells(seqs)
    perm = rng.permutation(len(seqs))
    assert np.array_equal(cells[perm], twosample.pool_cells([seqs[i] for i in perm]))
    assert np.bincount(cells).min() >= twosample.MIN_CELL


def test_the_reported_detectable_tv_is_detected_with_the_reported_power():
    """The least favourable alternative at TV δ (|p - q| proportional to the pooled mass):
    simulated rejection rate at δ = min_detectable_tv is about POWER."""
    rng = np.random.default_rng(1)
    n, cells, reps = 300, 8, 400
    nc = twosample.noncentrality_for_power(cells - 1, check.LEVEL, check.POWER)
    delta = np.sqrt(nc / (4 * n / 2))
    sign = np.tile([1.0, -1.0], cells // 2)
    p, q = (1 + sign * delta) / cells, (1 - sign * delta) / cells
    assert 0.5 * np.abs(p - q).sum() == pytest.approx(delta)
    crit = twosample.chi2_isf(check.LEVEL, cells - 1)
    rejected = sum(twosample.chi2_table(rng.multinomial(n, p), rng.multinomial(n, q))[0] > crit
                   for _ in range(reps))
    print(f"δ={delta:.3f}: rejected {rejected}/{reps}")
    assert 0.8 <= rejected / reps <= 0.97


# -- verdicts on toy engines (small vocabulary: a sharp test in a second) -----------------------


def test_toy_runtime_passes_and_a_verifier_without_residual_fails(monkeypatch):
    gen = toy_generator()
    ok = check.run_check(gen, samples=1500, prompts=TOY_PROMPTS, greedy_tokens=10)
    assert ok["exit_code"] == 0 and ok["consistent"], ok
    assert ok["sampling"]["draft_accepted"] > 0

    monkeypatch.setattr(spec_runtime.decode.loop, "accept_drafts", no_residual)
    bad = check.run_check(gen, samples=1500, prompts=TOY_PROMPTS, greedy_tokens=10)
    print(check.format_report(bad))
    assert bad["exit_code"] == 1 and bad["sampling"]["p_value"] < check.LEVEL
    assert bad["greedy"]["passed"]  # greedy cannot see this bug: one-hot residuals agree
    assert bad["sampling"]["tv"] > bad["sampling"]["tv_noise_p95"]


class FlipsGreedyToken(Generator):
    """Speculative greedy output with its third token changed: a greedy divergence."""

    def generate(self, prompt, options=None, **kw):
        r = super().generate(prompt, options, **kw)
        options = options or getattr(prompt, "options", None) or GenerationOptions(**kw)
        if options.use_draft and options.temperature in (None, 0.0) and len(r.tokens) > 2:
            r.tokens[2] = (r.tokens[2] + 1) % 6
        return r


@pytest.mark.parametrize("gap, exit_code", [(5e-4, 0), (0.5, 1)])
def test_greedy_divergence_is_a_warning_at_a_near_tie_and_a_failure_otherwise(monkeypatch, gap,
                                                                               exit_code):
    gen = toy_generator(cls=FlipsGreedyToken)

    def logits(g, prompt_ids, prefix, start=None):
        # the target's token and the flipped one, `gap` apart at magnitude 12
        base = g.generate(prompt_ids, max_new_tokens=3, use_draft=False).tokens
        row = np.zeros(6)
        row[base[2]], row[(base[2] + 1) % 6] = 12.0, 12.0 - gap
        return row

    monkeypatch.setattr(FlipsGreedyToken, "target_logits", logits)
    r = check.run_check(gen, samples=200, prompts=TOY_PROMPTS, greedy_tokens=6)
    d = r["greedy"]["prompts"][0]["divergence"]
    assert d["index"] == 2 and d["relative_gap"] == pytest.approx(gap / 12)
    assert d["near_tie"] == (exit_code == 0) and r["exit_code"] == exit_code
    text = check.format_report(r)
    assert ("near-tie" in text) == (exit_code == 0) and ("FAILURE" in text) == (exit_code == 1)


def test_a_near_tie_is_a_failure_where_the_rows_are_bit_identical(monkeypatch):
    """Where the load found steps and verify calls bit for bit alike, nothing may flip."""
    from spec_runtime.engines.rows import RowCheck

    gen = toy_generator(cls=FlipsGreedyToken)
    gen.row_check = RowCheck("as-is", "probe", True, 0.0, None, 0.0)

    def logits(g, prompt_ids, prefix, start=None):
        base = g.generate(prompt_ids, max_new_tokens=3, use_draft=False).tokens
        row = np.zeros(6)
        row[base[2]], row[(base[2] + 1) % 6] = 12.0, 12.0 - 5e-4
        return row

    monkeypatch.setattr(FlipsGreedyToken, "target_logits", logits)
    r = check.run_check(gen, samples=200, prompts=TOY_PROMPTS, greedy_tokens=6)
    assert r["exit_code"] == 1 and not r["greedy"]["prompts"][0]["divergence"]["near_tie"]
    assert "FAILURE" in check.format_report(r) and r["rows"]["identical"] is True


# -- the command on tiny exported bundles -------------------------------------------------------


@pytest.mark.parametrize("pair", ["llama_pair", "gpt2_pair"])
def test_check_passes_on_a_correct_runtime(pair, request):
    bundle = request.getfixturevalue(pair)[2]
    t0 = time.perf_counter()
    r = run_cli(bundle, "--samples", 600, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    s = rep["sampling"]
    print(f"{pair}: p={s['p_value']:.3g} TV={s['tv']:.3f} floor={s['tv_noise_floor']:.3f} "
          f"min TV={s['min_detectable_tv']:.3f} accepted {s['draft_accepted']}/"
          f"{s['draft_proposed']} in {time.perf_counter() - t0:.1f} s")
    assert s["drawn"] == 600 and s["p_value"] >= check.LEVEL and s["draft_proposed"] > 0
    assert rep["greedy"]["passed"] and rep["consistent"]


def test_check_fails_when_the_draft_misreports_q(llama_pair, monkeypatch):
    """The draft samples from its own q but reports a flat q (transformers#47932's family of
    bugs): acceptance then passes the draft's tokens through, and the output drifts to q.
    At temperature 0.5 the tiny model's distributions are sharp enough for 600 samples (at
    temperature 1 they are too flat: the report's detectable TV says so)."""
    propose = ModelDraft.propose

    def lying(self, seq, gamma, params, rng, most=None, floor=None):
        tokens, p_draft = propose(self, seq, gamma, params, rng, most, floor)
        if p_draft is None:  # greedy: q is not part of the decision, nothing to misreport
            return tokens, p_draft
        return tokens, np.full_like(p_draft, 1.0 / p_draft.shape[-1])

    monkeypatch.setattr(ModelDraft, "propose", lying)
    r = run_cli(llama_pair[2], "--samples", 600, "--temperature", 0.5)
    print(r.stdout)
    assert r.exit_code == 1, r.output
    assert "INCONSISTENT" in r.stdout


def test_check_text_report(llama_pair):
    r = run_cli(llama_pair[2], "--samples", 300)
    assert r.exit_code == 0, r.output
    for words in ("chi2", "TV", "power", "greedy", "rows", "bit for bit", "verdict"):
        assert words in r.stdout, r.stdout
    report = json.loads(run_cli(llama_pair[2], "--samples", 30, "--json").stdout)
    assert report["rows"]["chosen_by"] == "probe" and report["rows"]["identical"] is True


def test_check_time_limit(llama_pair):
    """--seconds bounds the run on the check's clock. This one advances a second each time it
    is read (at the start, when sampling starts, and before each sample), so what is drawn
    does not depend on the machine's speed: 11 samples fit in 12 seconds."""
    gen = spec_runtime.load(llama_pair[2])
    ticks = itertools.count()
    report = check.run_check(gen, samples=10**6, seconds=12, clock=lambda: float(next(ticks)))
    s = report["sampling"]
    assert s["drawn"] == 11
    assert any(w.startswith(f"--seconds 12 ran out after 11 of {10**6} samples")
               for w in report["warnings"]), report["warnings"]
    if s["min_detectable_tv"] is not None:
        # what the fewer samples mean: the detectable TV reported, and what all would detect
        # (about 1/sqrt(N): README)
        want = f"where all {10**6} would detect about " \
               f"{s['min_detectable_tv'] * (s['drawn'] / 10**6) ** 0.5:.2f}"
        assert any(want in w for w in report["warnings"]), report["warnings"]
    assert "--seconds 12 ran out" in check.format_report(report)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tokens", "0"], ["--tokens 0"]),
        (["--samples", "-1"], ["--samples -1"]),
        (["--seconds", "0"], ["--seconds 0 "]),
        (["--seconds", "nan"], ["--seconds nan"]),
        (["--temperature", "-1"], ["--temperature -1.0"]),
        (["--temperature", "0"], ["greedy"]),
        (["--top-p", "2"], ["--top-p 2.0"]),
        (["--gamma", "99"], ["--gamma 99"]),
        (["--tokens", "500"], ["max_len is 96"]),
    ],
)
def test_check_bad_input_exits_2(llama_pair, args, words):
    r = run_cli(llama_pair[2], *args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output


def test_check_on_a_missing_bundle_exits_2(tmp_path):
    r = run_cli(tmp_path / "none")
    assert r.exit_code == 2 and "specexport build" in r.output


def test_a_tv_above_its_noise_floor_is_said_beside_the_verdict():
    """The report says why a TV above its noise floor's 95th percentile can stand beside
    "consistent": the TV exceeds it in 1 run of 20 by chance, and the chi-square decides."""
    from spec_runtime.apps.check import _tv_words

    row = {"tv": 0.178, "tv_noise_p95": 0.160, "passed": True}
    assert "1 run of 20" in _tv_words(row) and "chi-square" in _tv_words(row)
    assert "as the chi-square found" in _tv_words({**row, "passed": False})
    assert _tv_words({**row, "tv": 0.150}) == ""


def test_progress_off_a_terminal_says_the_time_spent_and_left(capsys):
    """On a clock that moves 3 s a step: after 2 of 20 steps, 6 s spent and 54 s left by hand."""
    from draftproof.cli.common import Progress

    steps = [0]
    with Progress(20, "check", clock=lambda: 3.0 * steps[0]) as p:
        for _ in range(20):
            steps[0] += 1
            p.update()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[0] == "check: 2/20 (6 s, about 54 s left)"
    assert lines[-1] == "check: 20/20 (1 min 00 s)"
