"""The benchmarks' dated reports (benchmarks/reports.py): the name, date, machine line, exact
command and embedded plot of a report, that no report is overwritten, and reports rebuilt from
small hand-made JSON files carry those files' numbers. Fast: nothing is measured."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import machine  # noqa: E402
import reports  # noqa: E402

pytest.importorskip("matplotlib")

INFO = {"cpu": "Test CPU 9000", "logical_cpus": 4, "physical_cores": 2, "usable_cpus": 4,
        "threads": 2, "python": "3.11.7", "platform": "Linux-test",
        "versions": {"numpy": "2.0.0", "torch": None}}


def a_figure():
    fig, axes = reports.figure()
    axes[0, 0].plot([1, 2, 3], [1, 4, 9])
    return fig


def test_write_report_writes_the_dated_name_machine_command_and_embeds_its_plot(tmp_path):
    argv = ["benchmarks/pair.py", "--precision", "fp32", "--draftproof", "a b=/tmp/my bundle"]
    command = reports.command_line(argv)
    assert command == ("python benchmarks/pair.py --precision fp32 --draftproof "
                       "'a b=/tmp/my bundle'")  # shlex quoting: the shell gets the same words
    assert shlex.split(command)[1:] == argv
    md = reports.write_report(tmp_path / "out", "pair-fp32", title="Pair race", command=command,
                              machine=machine.describe(INFO), date="2026-12-04",
                              sections=["| a | b |\n|---|---|\n| 1 | 2 |", "a note"],
                              figure=a_figure())
    assert md == tmp_path / "out" / "pair-fp32-2026-12-04.md"
    text = md.read_text()
    assert text.startswith("# Pair race\n")
    assert "Date: 2026-12-04" in text
    assert ("Machine: Test CPU 9000, 2 physical cores / 4 logical / 4 usable, 2 threads, "
            "Python 3.11.7 on Linux-test; numpy 2.0.0") in text  # torch not installed: left out
    assert "    " + command + "\n" in text  # an indented code block: copied, it runs as it ran
    png = tmp_path / "out" / "pair-fp32-2026-12-04.png"
    assert "![Pair race](pair-fp32-2026-12-04.png)" in text  # relative: beside the markdown
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert text.index("| 1 | 2 |") < text.index("a note")


def test_write_report_is_dated_today_without_a_date_and_has_no_image_without_a_figure(tmp_path):
    md = reports.write_report(tmp_path, "step-time", title="t", command="python x.py",
                              machine="m", sections="body")
    assert md.name == f"step-time-{reports.today()}.md"
    assert "![" not in md.read_text() and not md.with_suffix(".png").exists()


def test_write_report_never_overwrites_a_report_of_the_same_name_and_date(tmp_path):
    kw = dict(title="t", command="python x.py", machine="m", date="2026-12-04")
    first = reports.write_report(tmp_path, "r", sections="first", figure=a_figure(), **kw)
    second = reports.write_report(tmp_path, "r", sections="second", figure=a_figure(), **kw)
    third = reports.write_report(tmp_path, "r", sections="third", **kw)
    assert [p.name for p in (first, second, third)] == [
        "r-2026-12-04.md", "r-2026-12-04-2.md", "r-2026-12-04-3.md"]
    assert "first" in first.read_text() and "second" in second.read_text()
    assert "(r-2026-12-04-2.png)" in second.read_text()
    # a plot left without its markdown still keeps its name
    (tmp_path / "r-2026-12-05.png").write_bytes(b"x")
    assert reports.write_report(tmp_path, "r", sections="x", date="2026-12-05",
                                title="t", command="c", machine="m").name == "r-2026-12-05-2.md"
    assert (tmp_path / "r-2026-12-05.png").read_bytes() == b"x"


def test_write_report_refuses_a_bad_date_or_a_name_with_a_directory(tmp_path):
    kw = dict(title="t", command="c", machine="m", sections="x")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        reports.write_report(tmp_path, "r", date="4 Dec 2026", **kw)
    with pytest.raises(ValueError, match="file name"):
        reports.write_report(tmp_path, "a/r", **kw)
    assert list(tmp_path.iterdir()) == []


def test_the_run_date_is_given_else_the_jsons_else_today():
    assert reports.run_date({"date": "2026-12-02T00:11:28"}) == "2026-12-02"
    assert reports.run_date({"date": "2026-12-02T00:11:28"}, "2026-12-04") == "2026-12-04"
    assert reports.run_date({}) == reports.today()
    with pytest.raises(SystemExit, match="YYYY-MM-DD"):
        reports.run_date({}, "yesterday")


def test_the_machine_line_of_a_run_without_one():
    assert "not recorded" in reports.machine_line(None)
    assert reports.machine_line(None, "Intel Xeon, 2 cores") == "Intel Xeon, 2 cores"
    assert reports.machine_line(INFO).startswith("Test CPU 9000, 2 physical cores")


# -- reports rebuilt from a stored run ----------------------------------------------------------

def pair_run(prompt, kind, system, tokens, wall, calls):
    return {"prompt": prompt, "kind": kind, "repeat": 0, "system": system, "new_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "info": {"target_calls": calls},
            "tokens": list(range(tokens))}


def a_pair_race() -> dict:
    """A race as pair.py stores it, by hand, without the summary (rebuilt from the runs):
    code: target-only 10 tokens in 2 s (5 tok/s), auto 10 in 0.5 s (20); chat: target-only
    8 in 2 s (4), auto 8 in 1 s (8)."""
    ours = {"family": "ours", "draft": "-", "options": {}, "weight_bytes": 2 * 10**9,
            "peak_rss": 2**30}
    return {
        "date": "2026-11-30T10:00:00", "command": "python benchmarks/pair.py --limit 1",
        "config": {"precision": "fp32", "max_new_tokens": 16, "eos": "stop", "repeats": 1,
                   "threads": 2, "ours_default": "auto", "float_reference": None},
        "target_gguf": "/m/t.gguf", "draft_gguf": "/m/d.gguf", "machine": INFO,
        "uptime_before": "up", "uptime_after": "up", "wall_minutes": 1.0, "resident": True,
        "bandwidth": {"before": {"GBps": 20.0}, "after": {"GBps": 20.0}, "GBps": 20.0},
        "systems": {"target-only": {**ours, "plain": None, "what": "bundle B, use_draft=False"},
                    "auto": {**ours, "plain": "target-only", "what": "bundle B"}},
        "skipped": {}, "sweep": [],
        "runs": [pair_run(0, "code", "target-only", 10, 2.0, 10),
                 pair_run(0, "code", "auto", 10, 0.5, 4),
                 pair_run(1, "chat", "target-only", 8, 2.0, 8),
                 pair_run(1, "chat", "auto", 8, 1.0, 4)],
        "prompts": [{"kind": "code", "text": "a", "ids": [1]},
                    {"kind": "chat", "text": "b", "ids": [2]}],
    }


def test_a_pair_report_rebuilt_from_its_json_has_its_numbers_and_a_plot(tmp_path, monkeypatch):
    import pair

    race = tmp_path / "race.json"
    race.write_text(json.dumps(a_pair_race()))
    argv = ["benchmarks/pair.py", "--from-json", str(race), "--report", str(tmp_path / "r")]
    monkeypatch.setattr(sys, "argv", argv)
    pair.main(argv[1:])
    md = tmp_path / "r" / "pair-fp32-2026-11-30.md"  # the run's date, not today
    text = md.read_text()
    # tok/s code, chat, all (the medians of 5 and 4, of 20 and 8), tok/call (18/18, 18/8)
    assert "| target-only | bundle B, use_draft=False | 5.00 | 4.00 | 4.50 | 1.00 |" in text
    assert "| auto | bundle B | 20.00 | 8.00 | 14.00 | 2.25 |" in text
    assert "    python benchmarks/pair.py --limit 1\n" in text  # the command that measured
    assert "    " + reports.command_line(argv) + "\n" in text  # and the one that rebuilt
    assert "Machine: Test CPU 9000" in text
    assert md.with_suffix(".png").stat().st_size > 0
    assert "(pair-fp32-2026-11-30.png)" in text
    # again: a second report, the first one kept
    pair.main(argv[1:])
    assert md.read_text() == text and (tmp_path / "r" / "pair-fp32-2026-11-30-2.md").exists()


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("stored, module", [("qwen-pair/race6-fp32", "pair_report"),
                                            ("compare-int4", "compare_report")])
def test_a_stored_run_with_its_summary_is_rendered_as_it_was(tmp_path, stored, module):
    """A committed run's JSON keeps its summary: the report's table is the one committed."""
    import importlib

    render = importlib.import_module(module)
    run = json.loads((RESULTS / f"{stored}.json").read_text())
    if module == "pair_report":
        run = render.complete(run)
    md = render.dated(run, tmp_path, command="python x.py", date="2026-12-04")
    committed = (RESULTS / f"{stored}.md").read_text()
    if module == "compare_report":  # recorded before the rename: our rows carried the old name
        for old, new in render.OLD_NAMES.items():
            committed = re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w-])", new, committed)
    assert committed.split("\n", 2)[2] in md.read_text()  # the table, without its title
    assert md.with_suffix(".png").stat().st_size > 0


def a_checkout_run() -> dict:
    """checkout_speed.py's JSON, by hand: old step 20.0 and 22.0 ms (median 21.0), new 21.0
    and 21.0 (21.0): 1.000; requests 100 / 90 µs: 0.900."""
    def r(step, request):
        return {"step_ms": step, "request_us": request, "speedup": 1.5, "loop_overhead": 0.02}
    return {"old": "/c/old", "new": "/c/new", "bundle": "/b",
            "runs": {"old": [r(20.0, 100.0), r(22.0, 100.0)],
                     "new": [r(21.0, 90.0), r(21.0, 90.0)]},
            "median": {"old": r(21.0, 100.0), "new": r(21.0, 90.0)}}


def test_a_checkout_speed_report_rebuilt_from_its_json_has_its_numbers(tmp_path):
    import checkout_speed

    stored = tmp_path / "speed.json"
    stored.write_text(json.dumps(a_checkout_run()))
    checkout_speed.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                         "2026-12-01", "--machine", "Intel Xeon, 2 cores", "--command",
                         "python benchmarks/checkout_speed.py /c/old /c/new --bundle /b"])
    md = tmp_path / "checkout-speed-2026-12-01.md"
    text = md.read_text()
    assert "| target 1-token call at position 64, ms | 21 | 21 | 1.000 | 0.955–1.050 |" in text
    assert "µs | 100 | 90 | 0.900 | 0.900–0.900 |" in text
    assert "Machine: Intel Xeon, 2 cores" in text
    assert "    python benchmarks/checkout_speed.py /c/old /c/new --bundle /b\n" in text
    assert md.with_suffix(".png").stat().st_size > 0


def test_checkout_speed_writes_its_report_beside_its_json_and_none_without(tmp_path, monkeypatch):
    import checkout_speed

    steps = iter([20.0, 21.0, 22.0, 22.0])  # old, new, then new, old (the order alternates)
    monkeypatch.setattr(checkout_speed, "run_worker", lambda checkout, bundle, tokens: {
        "step_ms": next(steps), "request_us": 100.0, "speedup": 1.5, "loop_overhead": 0.02})
    out = tmp_path / "out"
    out.mkdir()
    checkout_speed.main([str(tmp_path / "old"), str(tmp_path / "new"), "--bundle", "B",
                         "--passes", "2", "--json", str(out / "speed.json")])
    run = json.loads((out / "speed.json").read_text())
    assert run["median"]["old"]["step_ms"] == 21.0 and run["median"]["new"]["step_ms"] == 21.5
    assert run["machine"]["cpu"] and run["date"][:10] == reports.today()
    [md] = out.glob("checkout-speed-*.md")
    assert md.name == f"checkout-speed-{reports.today()}.md"
    assert ("| target 1-token call at position 64, ms | 21 | 21.5 | 1.024 | 1.000–1.050 |"
            in md.read_text())
    assert md.with_suffix(".png").stat().st_size > 0
    steps = iter([20.0] * 4)
    monkeypatch.chdir(tmp_path / "out")
    checkout_speed.main([str(tmp_path / "old"), str(tmp_path / "new"), "--bundle", "B",
                         "--passes", "2"])  # no --json: prints, writes nothing
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["speed.json", md.name, md.with_suffix(".png").name])


def test_a_step_time_report_rebuilt_from_its_json_has_its_numbers(tmp_path):
    import step_time

    stored = tmp_path / "step.json"
    stored.write_text(json.dumps({"threads": 2, "runs": 8, "median_ms": {
        "b (fp32, fused, as-is)": {"1@100": 10.0, "2@100": 12.5, "5@100": 20.0},
        "c (int4, fused, as-is)": {"1@100": 4.0, "2@100": 5.0, "5@100": 9.0}}}))
    step_time.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                    "2026-12-02"])
    md = tmp_path / "step-time-2026-12-02.md"
    text = md.read_text()
    assert "| b (fp32, fused, as-is) | 10.00 | 12.50 | 20.00 | 1.25× | 2.00× |" in text
    assert "| c (int4, fused, as-is) | 4.00 | 5.00 | 9.00 | 1.25× | 2.25× |" in text
    assert "not recorded" in text  # neither machine nor command: this JSON predates them
    assert md.with_suffix(".png").stat().st_size > 0


def test_a_verify_cost_report_rebuilt_from_its_json_has_its_numbers(tmp_path):
    import verify_cost

    stored = tmp_path / "verify.json"
    stored.write_text(json.dumps({"bundle": "/b", "rows": [
        {"variant": "as built", "ms": {"1": 8.0, "5": 12.0, "9": 16.0}},
        {"variant": "1 thread", "ms": {"1": 10.0, "5": 25.0, "9": 40.0}}],
        "kernel_share": {"1": {"MatMulNBits": 0.75, "Concat": 0.25}}}))
    verify_cost.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                      "2026-12-03"])
    text = (tmp_path / "verify-cost-2026-12-03.md").read_text()
    assert "| as built | 8.00 | 12.00 | 16.00 | 1.50 | 2.00 |" in text
    assert "| 1 thread | 10.00 | 25.00 | 40.00 | 2.50 | 4.00 |" in text
    assert "- 1-token call: MatMulNBits 75%, Concat 25%" in text
    assert (tmp_path / "verify-cost-2026-12-03.png").stat().st_size > 0


def test_a_slot_memory_report_rebuilt_from_its_json_has_its_numbers(tmp_path):
    import slot_memory

    stored = tmp_path / "slots.json"
    stored.write_text(json.dumps({
        "bundle": "/b", "max_len": 512, "bundle_files_mb": 100.0, "rss_before_load_mb": 30.0,
        "rss_after_load_mb": 200.0, "rows": [{"slots": 1, "rss_mb": 250.0},
                                             {"slots": 2, "rss_mb": 275.5}],
        "per_extra_slot_mb": [25.5], "kv_cache_per_slot_mb": 24.0,
        "second_independent_load_mb": 180.0, "sessions_shared": True}))
    slot_memory.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                      "2026-12-03"])
    text = (tmp_path / "slot-memory-2026-12-03.md").read_text()
    assert "| 2 | 275.5 | 25.5 |" in text and "| 1 | 250.0 |" in text
    assert "added 180.0 MB" in text
    assert (tmp_path / "slot-memory-2026-12-03.png").stat().st_size > 0


def test_a_serve_load_report_rebuilt_from_its_json_has_its_numbers(tmp_path):
    import serve_load

    def mode(tps, ms):
        return {"requests": 4, "errors": 0, "tokens": 256, "throughput_tok_s": tps,
                "ttft_p50_s": 0.5, "ttft_p95_s": 0.9, "per_token_p50_ms": ms,
                "per_token_p95_ms": ms + 1, "alpha_mean": 0.8, "acceptance_rate": 0.7,
                "tokens_per_target_call": 3.0}

    stored = tmp_path / "load.json"
    stored.write_text(json.dumps({
        "date": "2026-12-02T00:11:28", "machine": INFO, "load_before": {"load_1m": 0.25},
        "seconds": 70, "notes": ["a note"],
        "config": {"clients": 2, "requests_per_client": 2, "max_tokens": 64, "bundle": "/b",
                   "ray": False},
        "configs": [{"name": "1 slot", "slots": 1, "replicas": None, "result": {
            "modes": {"base": mode(40.0, 20.0), "spec": mode(60.0, 12.5)}, "speedup": 1.5}}]}))
    serve_load.main(["--from-json", str(stored), "--report", str(tmp_path)])
    text = (tmp_path / "serve-load-2026-12-02.md").read_text()
    assert "| uvicorn | 1 | target-only | 4 | 0 | 256 | 40.0 |  | 0.50 |" in text
    assert "| uvicorn | 1 | speculative | 4 | 0 | 256 | 60.0 | 1.50× | 0.50 | 0.90 | 12.5 |" in text
    assert "2 clients × 2 streaming chat requests" in text and "- a note" in text
    assert (tmp_path / "serve-load-2026-12-02.png").stat().st_size > 0


def test_gguf_block_error_writes_its_tables_into_the_report_when_asked(tmp_path, monkeypatch,
                                                                        capsys):
    """On a tiny GGUF (Q4_1 layers, a Q8_0 embedding) standing in for a real file: the report
    holds the tables the script printed, and a plot."""
    pytest.importorskip("gguf")
    import gguf_block_error
    import real_models
    from tiny_models import byte_tokenizer, llama, write_gguf

    path = write_gguf(llama(3, layers=1, hidden=64), byte_tokenizer(), tmp_path / "t.gguf")
    monkeypatch.setattr(real_models, "fetch", lambda name: path)
    gguf_block_error.main(["qwen-0.5b", "--tensors", "1", "--report", str(tmp_path / "r")])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| Q")]
    assert any(line.startswith("| Q4_1 | blk.0.") for line in rows)  # the error table's row
    [md] = (tmp_path / "r").glob("gguf-blocks-*.md")
    assert all(line in md.read_text() for line in rows)
    assert md.with_suffix(".png").stat().st_size > 0


def test_without_matplotlib_a_report_is_written_without_its_plot(tmp_path, monkeypatch, capsys):
    import checkout_speed

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    stored = tmp_path / "speed.json"
    stored.write_text(json.dumps(a_checkout_run()))
    checkout_speed.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                         "2026-12-01"])
    md = tmp_path / "checkout-speed-2026-12-01.md"
    assert "| 21 | 21 | 1.000 |" in md.read_text() and "![" not in md.read_text()
    assert not md.with_suffix(".png").exists()
    assert "no plot: matplotlib is not installed" in capsys.readouterr().err


def test_no_report_writes_none_and_report_dir_goes_where_it_says(tmp_path, monkeypatch):
    import checkout_speed

    monkeypatch.setattr(checkout_speed, "run_worker", lambda checkout, bundle, tokens: {
        "step_ms": 20.0, "request_us": 100.0, "speedup": 1.5, "loop_overhead": 0.02})
    argv = ["old", "new", "--bundle", "B", "--passes", "1", "--json", str(tmp_path / "s.json")]
    checkout_speed.main(argv + ["--no-report"])
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    checkout_speed.main(argv + ["--report", str(tmp_path / "elsewhere")])
    assert [p.suffix for p in sorted((tmp_path / "elsewhere").iterdir())] == [".md", ".png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "s.json"]


def test_the_whisper_base_report_rebuilt_from_its_stored_run_has_its_numbers(tmp_path):
    """The first run (a self draft with its own encoder), kept as its record."""
    import whisper_bench

    stored = reports.RESULTS / "whisper-base" / "own-encoder.json"
    whisper_bench.main(["--from-json", str(stored), "--report", str(tmp_path)])
    md = tmp_path / "whisper-base-2026-12-04.md"
    text = md.read_text()
    assert "self all equal, ngram all equal" in text
    assert "| self | 4 | 16.7 | 26.6 | 0.62× (0.60–0.64) | 0.99 |" in text
    assert "| self (γ 4) | target-only | 22.0 | 767 | 510 |" in text
    assert "of which 487 ms is the draft's own encoder" in text
    assert md.with_suffix(".png").stat().st_size > 0


def test_a_batch_report_rebuilt_from_its_json_has_its_ratios(tmp_path):
    """batch_bench.py's JSON, by hand: speculative 60 then 80 tok/s single, 90 and 100 batched
    (ratios 1.5 and 1.25, median 1.375); target-only 40/100 and 50/150 (2.5, 3.0: 2.75)."""
    import batch_bench

    def mode(single, batched):
        return {"single": {"tok_s": single}, "batched": {"tok_s": batched}}
    run = {"bundle": "/b", "made": "llama fp32 target from m.gguf, hybrid draft, max_batch 4",
           "lanes": 4, "check": {"identical": True, "largest_diff": 0.0}, "prompts": 32,
           "tokens": 64, "equal": True,
           "passes": [{"speculative": mode(60.0, 90.0), "target-only": mode(40.0, 100.0)},
                      {"speculative": mode(80.0, 100.0), "target-only": mode(50.0, 150.0)}]}
    stored = tmp_path / "batch.json"
    stored.write_text(json.dumps(run))
    batch_bench.main(["--from-json", str(stored), "--report", str(tmp_path), "--date",
                      "2026-12-05", "--machine", "Intel Xeon, 2 cores", "--command",
                      "python benchmarks/batch_bench.py --bundle /b"])
    text = (tmp_path / "batch-2026-12-05.md").read_text()
    assert "| speculative | 70.0 | 95.0 | 1.38× | 1.25–1.50 |" in text
    assert "| target-only | 45.0 | 125.0 | 2.75× | 2.50–3.00 |" in text
    assert "lanes score as single calls, bit for bit" in text


def a_serve_batch_run() -> dict:
    """serve_batch.py's JSON, by hand. 1 client: per-slot (first) speculative 20 tok/s,
    target-only 25; batched 22 and 25 (1.10×, 1.00×). 2 clients: batched (first) 40 and 60,
    per-slot 25 and 30 (1.60×, 2.00×); the batched server's calls carried 1 request 10 times
    and 2 requests 30 times (1.75 a call), its speculative requests at 2 clients drafted
    nothing (1 token per target call)."""
    def mode(tps, ms, per_call=1.0, proposed=0):
        return {"requests": 2, "errors": 0, "tokens": 128, "throughput_tok_s": tps,
                "ttft_p50_s": 0.25, "per_token_p50_ms": ms, "per_token_p95_ms": ms + 5,
                "tokens_per_target_call": per_call, "proposed": proposed}

    def run(server, k, order, spec, base, calls=None, per_call=3.0):
        return {"server": server, "clients": k, "slots": k, "order": order,
                "batch_calls": calls, "exit_code": 0, "result": {
                    "modes": {"spec": mode(spec, 1000 / spec, per_call, 8),
                              "base": mode(base, 1000 / base)},
                    "speedup": spec / base}}

    return {"date": "2026-12-05T04:00:00", "command": "python benchmarks/serve_batch.py -b /b",
            "machine": INFO, "load_before": {"load_1m": 0.2}, "seconds": 600,
            "git": {"commit": "a0daaac0", "changed": [], "diff_sha1": None},
            "baseline": {"tree": "/tmp/old", "commit": "1105ac70", "subject": "the old one"},
            "config": {"bundle": "/b", "max_batch": 4, "clients": [1, 2], "queue": 16,
                       "requests_per_client": 2, "max_tokens": 64, "launch": "module"},
            "runs": [run("per-slot", 1, "first", 20.0, 25.0),
                     run("batched", 1, "second", 22.0, 25.0, {"1": 40}),
                     run("batched", 2, "first", 40.0, 60.0, {"1": 10, "2": 30}, 1.0),
                     run("per-slot", 2, "second", 25.0, 30.0)],
            "notes": ["a note"]}


def test_a_serve_batch_report_rebuilt_from_its_json_has_its_ratios(tmp_path):
    import serve_batch

    stored = tmp_path / "serve-batch.json"
    stored.write_text(json.dumps(a_serve_batch_run()))
    serve_batch.main(["--from-json", str(stored), "--report", str(tmp_path)])
    md = tmp_path / "serve-batch-2026-12-05.md"  # the run's date
    text = md.read_text()
    # batched / per-slot, speculative and target-only; each server's speculative / target-only
    assert "| 1 | 1.10× | 1.00× | 0.88× | 0.80× |" in text
    assert "| 2 | 1.60× | 2.00× | 0.67× | 0.83× |" in text
    assert ("| 2 | batched | first | speculative | 2 | 0 | 40.0 | 1.60× | 0.25 | 25.0 | 30.0 | "
            "1.00 | 1.75 |") in text
    assert ("| 2 | per-slot | second | target-only | 2 | 0 | 30.0 |  | 0.25 | 33.3 | 38.3 | 1.00 "
            "|  |") in text
    assert ("- batched, 2 clients: the speculative requests proposed 8 draft tokens in all, 1.00 "
            "tokens per target call: the server decoded them as target-only") in text
    assert "(4 lanes: beyond 4 slots a call carries 4 at most)" in text
    assert "per-slot: `/tmp/old` at 1105ac7 (the old one)" in text and "- a note" in text
    assert "    python benchmarks/serve_batch.py -b /b\n" in text  # the command that measured
    assert "Machine: Test CPU 9000" in text
    assert md.with_suffix(".png").stat().st_size > 0


def a_serve_race_run() -> dict:
    """serve_race.py's JSON, by hand. 1 client: ours speculative 30 tok/s, target-only 20;
    llama-server 24, -md 20 (best: plain, 1.25× and 0.83×). 2 clients: ours 40 and 50,
    llama-server 30, -md 40 (best: -md, 1.00× and 1.25×); -md failed to start at 4."""
    def summary(tps, per_call=None):
        return {"requests": 2, "errors": 0, "tokens": 128, "throughput_tok_s": tps,
                "ttft_p50_s": 0.25, "per_token_p50_ms": 1000 / tps,
                "per_token_p95_ms": 1000 / tps + 5, "tokens_per_target_call": per_call,
                "proposed": 8 if per_call else 0}

    def ours(k, order, spec, base):
        return {"server": "ours", "clients": k, "order": order, "exit_code": 0,
                "result": {"modes": {"spec": summary(spec, 2.5), "base": summary(base, 1.0)}}}

    def llama(name, k, order, tps):
        return {"server": name, "clients": k, "order": order, "exit_code": 0,
                "result": {"all": summary(tps)}}

    return {"date": "2026-12-05T05:00:00", "command": "python benchmarks/serve_race.py -b /b",
            "machine": INFO, "load_before": {"load_1m": 0.2}, "seconds": 900,
            "git": {"commit": "b0daaac0", "changed": []},
            "config": {"bundle": "/b", "max_batch": 4, "clients": [1, 2, 4],
                       "requests_per_client": 2, "max_tokens": 64, "queue": 16,
                       "llama_server": "/l/llama-server", "llama_build": "version: 1 (abc)",
                       "threads": 2, "target_gguf": "/m/t.gguf", "draft_gguf": "/m/d.gguf",
                       "n_max": 12, "p_min": 0.75},
            "runs": [ours(1, 1, 30.0, 20.0), llama("llama-server", 1, 2, 24.0),
                     llama("llama-server -md", 1, 3, 20.0),
                     llama("llama-server", 2, 1, 30.0), llama("llama-server -md", 2, 2, 40.0),
                     ours(2, 3, 40.0, 50.0),
                     {"server": "llama-server -md", "clients": 4, "order": 1,
                      "failed": "the server exited with code 1 before answering /health"}],
            "notes": ["a note"]}


def test_a_serve_race_report_rebuilt_from_its_json_has_its_ratios(tmp_path):
    import serve_race

    stored = tmp_path / "serve-race.json"
    stored.write_text(json.dumps(a_serve_race_run()))
    serve_race.main(["--from-json", str(stored), "--report", str(tmp_path)])
    md = tmp_path / "serve-race-2026-12-05.md"
    text = md.read_text()
    # ours speculative and target-only / llama-server's faster mode at each client count
    assert "| 1 | llama-server | 24.0 | 1.25× | 0.83× |" in text
    assert "| 2 | llama-server -md | 40.0 | 1.00× | 1.25× |" in text
    assert "| 2 | ours, target-only | 3 | 2 | 0 | 50.0 | 0.25 | 20.0 | 25.0 | 1.00 |" in text
    assert "| 2 | llama-server -md | 2 | 2 | 0 | 40.0 | 0.25 | 25.0 | 30.0 |  |" in text
    assert "| 4 | llama-server -md | 1 | failed: the server exited with code 1" in text
    assert "--spec-draft-n-max 12 --spec-draft-p-min 0.75" in text and "- a note" in text
    assert "    python benchmarks/serve_race.py -b /b\n" in text
    assert md.with_suffix(".png").stat().st_size > 0
