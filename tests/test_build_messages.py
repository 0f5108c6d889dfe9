"""What `specexport build` tells its user, and only that: a hub that cannot be reached is said
at once with the way to pass a local directory, a quantized graph far from the float model is
written with a warning, and the libraries' own chatter stays out of the build's output."""

import json
import logging
import re
import shutil
import socket
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from helpers import assert_input_error, edit_manifest, run

from draftproof.cli.specexport import main as specexport
from spec_export.sources import source
from spec_export.parity.quality import WARN_TOP1_AGREEMENT
from spec_export.bundle.summary import build_summary


@pytest.fixture
def no_hub(monkeypatch):
    """A hub endpoint on a local port nothing listens on: refused at once, on any machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    source.hub_unreachable.cache_clear()
    yield port
    source.hub_unreachable.cache_clear()


def test_an_unreachable_hub_is_said_at_once_with_the_local_alternative(no_hub, tmp_path):
    r = run(specexport, "build", "--target", "nobody/no-such-model", "--out", tmp_path / "b",
            "--quiet")
    assert_input_error(r, "--target 'nobody/no-such-model'", "cannot be reached",
                       f"127.0.0.1:{no_hub}", "not in the local Hugging Face cache",
                       "pass a local directory", "--target DIR")
    assert "Retrying" not in r.output  # no rounds of retries before the answer
    assert not (tmp_path / "b").exists()
    # the command it suggests is one the installed huggingface_hub has
    suggested = re.search(r"`(hf download \S+) --local-dir DIR`", r.output)
    assert suggested, r.output
    hf = [e for e in entry_points(group="console_scripts") if e.name == "hf"]
    assert hf, "the installed huggingface_hub has no `hf` command"
    run_hf = (f"import sys; from {hf[0].module} import {hf[0].attr} as hf; "
              f"sys.argv = ['hf', 'download', '--help']; hf()")
    assert subprocess.run([sys.executable, "-c", run_hf], capture_output=True).returncode == 0


def test_offline_mode_is_named_as_the_reason(no_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source.hub_unreachable.cache_clear()
    r = run(specexport, "build", "--target", "llama", "--draft", "nobody/draft", "--out",
            tmp_path / "b", "--quiet")
    assert_input_error(r, "HF_HUB_OFFLINE is set", "pass a local directory")


def test_the_check_sees_a_listening_endpoint(monkeypatch):
    """The oracle for the two tests above: the same check finds a port that listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        source.hub_unreachable.cache_clear()
        try:
            assert source.hub_unreachable() is None
        finally:
            source.hub_unreachable.cache_clear()


def _with_top1(bundle, tmp_path, top1: float):
    copy = tmp_path / f"b{top1}"
    shutil.copytree(bundle, copy)
    edit_manifest(copy, lambda m: m["target"]["parity"]["int4"].update(top1_agreement=top1))
    return build_summary(copy)


def test_low_int4_agreement_is_written_with_a_warning(tmp_path):
    from conftest import build_llama_pair

    bundle = build_llama_pair(tmp_path, precision="int4")[2]
    measured = json.loads((bundle / "manifest.json").read_text())
    top1 = measured["target"]["parity"]["int4"]["top1_agreement"]
    warned = [line for line in build_summary(bundle).splitlines()
              if line.startswith("warning") and "target's int4" in line]
    assert bool(warned) == (top1 < WARN_TOP1_AGREEMENT), (top1, warned)
    low = _with_top1(bundle, tmp_path, 0.5)
    assert "warning  the target's int4 graph agrees with the float model on 50% of next " \
           "tokens (below 80%)" in low and "--precision int8" in low
    assert "target's int4" not in _with_top1(bundle, tmp_path, 0.95)


def test_library_chatter_stays_out_of_the_build_output(tmp_path):
    """A portable (torch.onnx) int8 build prints its summary on stdout and nothing on stderr:
    not torch.onnx's "torchvision is not installed", nor the INFO lines that onnxruntime's
    quantizer turns on for every library by configuring the root logger."""
    from tiny_models import llama, save

    target = save(llama(0, layers=1), tmp_path / "t")
    r = subprocess.run([sys.executable, "-m", "draftproof.cli.specexport", "build", "--target",
                        str(target), "--draft", "ngram", "--kernels", "portable", "--precision",
                        "int8", "--out", str(tmp_path / "b"), "--max-len", "32", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "" and "bundle written to" in r.stdout


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        if record.name == self.name:  # what was logged here, not what propagated
            self.messages.append(record.getMessage())


def test_known_library_messages_are_dropped_during_a_build_only():
    """The filters hold where levels do not: torch sets its loggers' levels itself when an
    export starts (here: WARNING, set inside the build), and onnxruntime's quantizers warn on the
    root logger."""
    from spec_export.build import _quiet_libraries

    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    root = logging.getLogger()

    def emit():
        records = _Records()
        on_root = _Records()
        records.name, on_root.name = registry.name, "root"
        registry.addHandler(records)
        root.addHandler(on_root)
        level = registry.level
        registry.setLevel(logging.WARNING)
        try:
            registry.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
            root.warning("Please consider to run pre-processing before quantization. ...")
            registry.warning("a warning of its own")
        finally:
            registry.setLevel(level)
            registry.removeHandler(records)
            root.removeHandler(on_root)
        return records.messages + on_root.messages

    with _quiet_libraries():
        assert emit() == ["a warning of its own"]
    assert len(emit()) == 3  # outside a build nothing is dropped


def test_the_float32_parity_tolerance_grows_with_the_logits_past_five():
    """1e-3 while PyTorch's logits stay within ±5; beyond, 2e-4 of the largest (a tiny random
    model with logits up to 33 differs by 2.7e-3 on one CPU's kernels, not on another's), so
    that a wrong export (off by a large part of a logit) is still refused."""
    from spec_export.parity.quality import fp32_tolerance

    assert fp32_tolerance(1.0) == 1e-3
    assert fp32_tolerance(5.0) == 1e-3
    assert fp32_tolerance(33.0) == pytest.approx(6.6e-3)
    assert fp32_tolerance(33.0) < 0.01 * 33.0
