"""Interrupted exports and long runs: Ctrl-C (SIGINT) or SIGTERM in the middle of `specexport
build` leaves no directory that loads and no temporary directory, keeps an existing bundle, and a
rerun succeeds; 1,000 consecutive `generate` calls in one process do not grow its memory."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import spec_runtime
from spec_runtime.bundle.manifest import BundleError
from draftproof.cli.specexport import main as specexport


def build_until_first_graph_then(sig, target, draft, out: Path) -> tuple[int, str]:
    """Start `specexport build` in a subprocess, send `sig` once its temporary directory holds
    the target graph (the draft is then still being exported), return (exit code, stderr)."""
    cmd = [sys.executable, "-m", "draftproof.cli.specexport", "build", "--target", str(target),
           "--draft", str(draft), "--out", str(out), "--max-len", "64", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = [p for p in out.parent.glob(f".{out.name}.tmp-*")
                   if (p / "bundle" / "target.onnx").exists()]
            if tmp:
                proc.send_signal(sig)
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"the build ended (or hung) before its temporary directory held a graph: "
                        f"{proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_interrupted_build_leaves_nothing_that_loads_and_a_rerun_succeeds(tmp_path):
    from tiny_models import llama, save, truncated

    target = llama(7, layers=2)
    t = save(target, tmp_path / "target")
    d = save(truncated(target, 1), tmp_path / "draft")
    out = tmp_path / "bundle"

    # Ctrl-C on a fresh build: no bundle, no temporary directory
    code, err = build_until_first_graph_then(signal.SIGINT, t, d, out)
    assert code == 130 and "interrupted" in err and "Traceback" not in err, err
    assert leftovers(out) == []
    with pytest.raises(BundleError):
        spec_runtime.load(out)

    # the rerun succeeds
    r = CliRunner().invoke(specexport, ["build", "--target", str(t), "--draft", str(d), "--out",
                                        str(out), "--max-len", "64", "--quiet"])
    assert r.exit_code == 0, r.output
    before = (out / "manifest.json").read_text()
    tokens = spec_runtime.load(out).generate([5, 6, 7], max_new_tokens=8).tokens

    # SIGTERM while rebuilding over it: the temporary directory is removed, the bundle kept
    code, err = build_until_first_graph_then(signal.SIGTERM, t, d, out)
    assert code == 128 + signal.SIGTERM and "interrupted" in err, err
    assert leftovers(out) == []
    assert (out / "manifest.json").read_text() == before
    assert spec_runtime.load(out).generate([5, 6, 7], max_new_tokens=8).tokens == tokens


MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys, time
    import spec_runtime

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    gen = spec_runtime.load(sys.argv[1])
    prompts = ["hello world", "The cat sat on", "one two three, one two three, one", "a"]

    def call(i):
        kw = dict(max_new_tokens=12, seed=i)
        if i % 3 == 1:
            kw.update(temperature=1.0, top_p=0.9)
        if i % 5 == 2:
            kw.update(use_draft=False)
        if i % 7 == 3:
            return "".join(gen.stream(prompts[i % 4], **kw))
        return gen.generate(prompts[i % 4], **kw).tokens

    for i in range(420):  # warm-up, one full cycle of the request mix (lcm of 4, 3, 5, 7)
        call(i)
    gc.collect()
    warm = rss_mb()
    t0 = time.perf_counter()
    for i in range(1000):
        call(i)
    gc.collect()
    print(json.dumps({"warm_mb": warm, "end_mb": rss_mb(), "seconds": time.perf_counter() - t0}))
    """
)


def test_thousand_generate_calls_do_not_grow_memory(llama_pair):
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(llama_pair[2])],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    growth = r["end_mb"] / r["warm_mb"] - 1
    print(f"RSS after warm-up {r['warm_mb']:.1f} MB, after 1,000 more calls {r['end_mb']:.1f} MB "
          f"({growth:+.2%}), {r['seconds']:.1f} s")
    assert growth <= 0.05
