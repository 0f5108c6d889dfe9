"""The build's progress bar counts the stages the summary lists, each when it is done, grows for
a stage the plan did not name, and moves inside a long stage (its notes, the elapsed time)."""

import json
import re
import time

from spec_export.bundle import progress
from spec_export.bundle.progress import Stages


def _states(err: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) stages", err)]


def test_a_stage_counts_when_done_and_an_unplanned_one_adds_to_the_total(capfd):
    stages = Stages(["load", "export", "write"], True, tick=0.05)
    stages("load")
    assert (stages.bar.n, stages.bar.total) == (0, 3)  # started, not done
    stages("parity")  # not in the plan
    assert (stages.bar.n, stages.bar.total) == (1, 4)
    progress.note("call 2/5")
    # the ticker shows the note and the time while nothing else moves: three refreshes of its
    # own (waited for, however slowly the thread is scheduled)
    refreshes, refresh = [], stages.bar.refresh
    stages.bar.refresh = lambda *a, **k: (refreshes.append(1), refresh(*a, **k))
    deadline = time.monotonic() + 60
    while len(refreshes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(refreshes) >= 3
    del stages.bar.refresh
    stages("write")  # "export" skipped
    assert (stages.bar.n, stages.bar.total) == (2, 3)
    record = stages.record()
    assert [s["stage"] for s in record["stages"]] == ["load", "parity", "write"]
    assert (stages.bar.n, stages.bar.total) == (3, 3)
    err = capfd.readouterr().err
    assert "call 2/5" in err
    assert _states(err)[-1] == (3, 3) and all(n <= t for n, t in _states(err))
    progress.note("after the build")  # no bar: nothing happens


def test_a_builds_bar_ends_at_the_stages_its_summary_lists(tmp_path, capfd, monkeypatch):
    from tiny_models import llama, save, truncated

    from spec_export.build import build_bundle

    target = llama(0, layers=2)
    t, d = save(target, tmp_path / "t"), save(truncated(target, 1), tmp_path / "d")
    notes, note = [], Stages.note
    monkeypatch.setattr(Stages, "note", lambda self, text: (notes.append(text), note(self, text)))
    capfd.readouterr()
    bundle = build_bundle(str(t), str(d), tmp_path / "b", max_len=64, progress=True)
    err = capfd.readouterr().err
    stages = json.loads((bundle / "manifest.json").read_text())["created_by"]["build"]["stages"]
    states = _states(err)
    assert states[-1] == (len(stages), len(stages)), err
    assert [n for n, _ in states] == sorted(n for n, _ in states)  # never counts back
    assert all(n < t for n, t in states[:-1] if n < len(stages) - 1)
    # a long stage says what it does: each parity call, each graph written
    assert any(n.startswith("target: call 1/") for n in notes), notes
    assert "writing target.onnx" in notes and "writing draft.onnx" in notes, notes
