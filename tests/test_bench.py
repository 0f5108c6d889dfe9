"""`specrun bench` on a tiny bundle: the report's fields and their consistency (no speed is
asserted: timings on a shared CI machine prove nothing)."""

import json

import pytest
from click.testing import CliRunner

from spec_runtime.bench import load_prompts
from spec_runtime.stats import expected_speedup
from specedge.cli.specrun import main as specrun


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
        assert row["tokens_per_target_call"] == pytest.approx(row["new_tokens"] / row["target_calls"])
        g = max(1, round(row["mean_gamma"]))
        assert row["predicted_speedup"] == pytest.approx(expected_speedup(row["alpha"], g, row["c"]))
        assert 0 <= row["alpha"] <= 1 and 0 <= row["loop_overhead"] <= 1
        assert row["speedup"]["min"] <= row["speedup"]["median"] <= row["speedup"]["max"]
        assert row["verify_cost_ratio"] > 0 and row["c"] > 0
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


@pytest.mark.parametrize("args, words", [(["--gamma", "0"], "gamma=0"),
                                         (["--repeats", "0"], "--repeats 0"),
                                         (["--prompts", "/nonexistent.txt"], "cannot be read")])
def test_bench_bad_values_exit_2(llama_pair, args, words):
    r = CliRunner().invoke(specrun, ["bench", "--bundle", str(llama_pair[2]), *args])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output
