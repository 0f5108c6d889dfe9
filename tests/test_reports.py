"""The benchmarks' dated reports (benchmarks/reports.py): the name, date, machine line, exact
command and embedded plot of a report, that no report is overwritten, and reports rebuilt from
small hand-made JSON files carry those files' numbers. Fast: nothing is measured."""

import json
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
    argv = ["benchmarks/pair.py", "--precision", "fp32", "--specedge", "a b=/tmp/my bundle"]
    command = reports.command_line(argv)
    assert command == ("python benchmarks/pair.py --precision fp32 --specedge "
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
