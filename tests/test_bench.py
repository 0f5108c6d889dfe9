"""`specrun bench`: on toy engines whose calls cost known time on a fake clock, the report equals
the hand-computed speedup, α, c and verify cost; on a tiny bundle, the command's report and its
counting identities (no speed is asserted there: timings on a shared CI machine prove
nothing)."""

import json

import pytest
from click.testing import CliRunner

from spec_runtime.apps.bench import load_prompts, run_bench
from draftproof.cli.specrun import main as specrun


def test_bench_report_is_consistent(llama_pair, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one two three, one two three, one\nabc abc abc abc\n")
    png = tmp_path / "speedup.png"
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), "--prompts",
                                     str(prompts), "--gamma", "1,3,auto", "--max-new-tokens", "12",
                                     "--json", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [row["gamma"] for row in report["rows"]] == [1, 3, "auto"]
    for row in report["rows"]:
        assert row["runs"] == 2
        # every generated token counted: 2 prompts x 12 tokens (no EOS in a 12-token run of
        # this model is not guaranteed, so bound it)
        assert 2 <= row["new_tokens"] <= 24
        assert row["speedup"]["min"] <= row["speedup"]["median"] <= row["speedup"]["max"]
        assert row["verify_cost_ratio"] > 0 and row["c"] > 0  # both measured, from real calls
    assert report["best_gamma"]["custom"]["gamma"] in (1, 3, "auto")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_table_output(llama_pair, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello hello hello\n")
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), "--prompts",
                                     str(prompts), "--gamma", "2", "--max-new-tokens", "6"])
    assert r.exit_code == 0, r.output
    assert "speedup" in r.stdout and "best γ" in r.stdout


def test_builtin_prompts_have_both_kinds():
    prompts = load_prompts()
    kinds = {p["kind"] for p in prompts}
    assert kinds == {"grounded", "chat"}
    assert all(p["text"].strip() for p in prompts)
    assert {p["kind"] for p in load_prompts(kind="chat")} == {"chat"}


def test_a_prompt_files_own_kinds_are_chosen_by_name(llama_pair, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps({"about": "not a prompt list", "code": ["def f(", "class A:"],
                                   "chat": ["hello"]}))
    assert [p["text"] for p in load_prompts(prompts, kind="code")] == ["def f(", "class A:"]
    assert {p["kind"] for p in load_prompts(prompts)} == {"code", "chat"}
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), "--prompts",
                                     str(prompts), "--kind", "code", "--gamma", "2",
                                     "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert {row["kind"] for row in json.loads(r.stdout)["rows"]} == {"code"}
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), "--prompts",
                                     str(prompts), "--kind", "grounded"])
    assert r.exit_code == 2 and "'grounded'" in r.output and "['chat', 'code']" in r.output


@pytest.mark.parametrize("args, words", [(["--gamma", "0"], "--gamma 0"),
                                         (["--repeats", "0"], "'--repeats': 0 is not in the range"),
                                         (["--prompts", "/nonexistent.txt"], "cannot be read")])
def test_bench_bad_values_exit_2(llama_pair, args, words):
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), *args])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output


def test_bench_reports_the_speedup_the_call_costs_imply():
    """Target calls cost 4 ms whatever their length, draft calls 1 ms, the draft is the target
    itself (α = 1), γ 4, 40 tokens. Target-only: 40 calls, 160 ms. Speculative: 8 rounds of 5
    tokens, 8 target calls and 32 draft calls, 64 ms. So 2.5×, c = 1/4, verify cost = 1 step,
    and the paper's prediction 5 / (4 · 1/4 + 1) = 2.5, all by hand."""
    from test_runtime_text import word_tokenizer
    from toy_models import FakeClock, ToyEngine

    from spec_runtime import Generator, ModelDraft

    clock = FakeClock()
    target = ToyEngine(vocab=6, seed=0, clock=clock, delay=0.004)
    draft = ModelDraft(ToyEngine(vocab=6, seed=0, clock=clock, delay=0.001), clock=clock)
    gen = Generator(target, draft, tokenizer=word_tokenizer(), clock=clock)
    report = run_bench(gen, [{"kind": "grounded", "text": "red green blue"}], [4],
                       max_new_tokens=40, repeats=2)
    (row,) = report["rows"]
    assert row["runs"] == 2 and row["new_tokens"] == 80 and row["target_calls"] == 16
    assert row["target_only_tokens_per_s"]["median"] == pytest.approx(40 / 0.160)
    assert row["speculative_tokens_per_s"]["median"] == pytest.approx(40 / 0.064)
    assert row["speedup"]["min"] == pytest.approx(2.5) == row["speedup"]["max"]
    assert row["alpha"] == row["acceptance_rate"] == 1.0
    assert row["c"] == pytest.approx(0.25) and row["verify_cost_ratio"] == pytest.approx(1.0)
    assert row["predicted_speedup"] == pytest.approx(2.5)
    assert row["target_step_ms"] == pytest.approx(4) and row["draft_step_ms"] == pytest.approx(1)
    assert row["loop_overhead"] == 0.0 and row["tokens_per_target_call"] == 5.0


def test_greedy_runs_count_speculative_output_equal_to_target_only(monkeypatch):
    """Greedy bench runs compare the two modes' tokens: all equal on an exact generator; a
    verifier that accepts every draft token (not the target's argmax) is counted out."""
    from test_runtime_text import word_tokenizer
    from toy_models import ToyEngine

    from spec_runtime import Generator, ModelDraft
    from spec_runtime.decode import loop

    prompts = [{"kind": "grounded", "text": "red green blue"}, {"kind": "chat", "text": "red"}]
    gen = Generator(ToyEngine(vocab=6, seed=0), ModelDraft(ToyEngine(vocab=6, seed=1)),
                    tokenizer=word_tokenizer())
    rows = run_bench(gen, prompts, [3], max_new_tokens=20)["rows"]
    assert [(r["kind"], r["identical"], r["runs"]) for r in rows] == \
        [("grounded", 1, 1), ("chat", 1, 1), ("all", 2, 2)]
    assert run_bench(gen, prompts, [3], max_new_tokens=8, temperature=1.0)["rows"][0][
        "identical"] is None  # sampled: the two modes draw other random numbers

    def accept_all(draft_tokens, logits):  # every draft, then the target's last row
        return [int(t) for t in draft_tokens] + [int(logits[-1].argmax())]

    monkeypatch.setattr(loop, "accept_drafts_greedy", accept_all)
    rows = run_bench(gen, prompts, [3], max_new_tokens=20)["rows"]
    assert rows[-1]["identical"] < 2
