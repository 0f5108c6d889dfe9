"""README.md's code blocks run as written.

Every code block is fenced and names its language: `sh` and `python` blocks are run, in README
order, the way a new user would after the set-up command (a fresh working directory holding the
repository's tests/, benchmarks/ and scripts/, the default bundle where `specrun` looks); a
`text` block marked `<!-- readme-test: output of the previous block -->` must be exactly what the
previous block printed; `cpp` blocks are excerpts, and every line of one must be a line of the
host program tests/test_embed.py builds and runs; `yaml` blocks are Ray Serve configs, which
tests/test_serve_ray.py loads and builds. A block that cannot run here says why in a
`<!-- readme-test: skip: REASON -->` line above it, and the test prints the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HOST = ROOT / "tests" / "embed" / "host.cpp"
LANGUAGES = {"sh", "python", "cpp", "text", "yaml"}
MARKER = re.compile(r"^<!-- readme-test: (?:skip: (?P<why>.*\S)|(?P<output>output of the "
                    r"previous block)) -->$")
# what a README block may use from the checkout, besides the installed package
CHECKOUT = ("tests", "benchmarks", "scripts", "docs")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None = None
    output: bool = False


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of `text`, with the marker line right above each (if any)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"README line {i + 1}: a code fence that is never closed"
        block = Block(opening.group(1).strip(), "\n".join(lines[i + 1:end]) + "\n", i + 1)
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            block.skip, block.output = marker.group("why"), bool(marker.group("output"))
        blocks.append(block)
        i = end + 1
    return blocks


def indented_code(text: str) -> list[int]:
    """Lines outside fences that Markdown would show as an indented code block."""
    found, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (line.startswith("    ") or line.startswith("\t")) and line.strip():
            found.append(n)
    return found


def test_every_block_is_fenced_and_names_its_language():
    text = README.read_text()
    assert indented_code(text) == [], "indented code blocks: fence them and name the language"
    blocks = read_blocks(text)
    assert len(blocks) >= 10
    for prev, b in zip([None, *blocks], blocks):
        assert b.lang in LANGUAGES, f"README line {b.line}: ```{b.lang} (use one of {LANGUAGES})"
        if b.output:
            assert b.lang == "text" and prev is not None and prev.lang == "sh", b.line
    # a marker that does not match the pattern would silently run (or silently not check) a block
    for n, line in enumerate(text.splitlines(), 1):
        if "readme-test" in line:
            assert MARKER.match(line), f"README line {n}: malformed marker {line!r}"


def _code_lines(source: str) -> list[str]:
    """Lines without their comments and indentation, blank ones dropped."""
    out = []
    for line in source.splitlines():
        code = re.sub(r"\s*//.*$", "", line).strip()
        if code:
            out.append(code)
    return out


def test_cpp_excerpts_are_lines_of_the_host_that_is_built_and_run():
    host = set(_code_lines(HOST.read_text()))
    excerpts = [b for b in read_blocks(README.read_text()) if b.lang == "cpp"]
    assert excerpts
    for b in excerpts:
        missing = [c for c in _code_lines(b.code) if c not in host]
        assert not missing, f"README line {b.line}: not in tests/embed/host.cpp: {missing}"


def test_marker_parsing_oracle():
    """The parser itself, on a hand-written document."""
    doc = ("x\n\n    indented\n\n<!-- readme-test: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n"
           "```sh\necho hi\n```\n<!-- readme-test: output of the previous block -->\n```text\n"
           "hi\n```\n")
    assert indented_code(doc) == [3]
    b = read_blocks(doc)
    assert [(x.lang, x.code, x.line, x.skip, x.output) for x in b] == [
        ("sh", "nvidia-smi\n", 6, "needs a GPU", False), ("sh", "echo hi\n", 9, None, False),
        ("text", "hi\n", 13, None, True)]


@pytest.mark.slow
def test_every_example_runs_as_written(default_bundle, tmp_path):
    """The sh and python blocks in README order, in one working directory and environment, as a
    user following the README top to bottom after the set-up command."""
    work = tmp_path / "work"
    work.mkdir()
    for name in CHECKOUT:
        (work / name).symlink_to(ROOT / name)
    env = dict(os.environ, SPECEDGE_BUNDLE=str(default_bundle), PYTHONPATH="",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    try:
        ran, skipped = run_blocks(work, env)
    finally:
        stop_what_runs_in(work)  # a server a block started in the background
    for why in skipped:
        print("skipped", why)
    assert ran >= 8


def stop_what_runs_in(work: Path) -> None:
    """SIGTERM to the processes whose working directory is `work` (only this test's)."""
    import signal

    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == work:
                os.kill(int(proc.name), signal.SIGTERM)
        except OSError:
            continue


def run_blocks(work: Path, env: dict) -> tuple[int, list[str]]:
    ran, skipped, previous = 0, [], None
    for b in read_blocks(README.read_text()):
        if b.skip:
            skipped.append(f"README line {b.line}: {b.skip}")
            continue
        if b.output:
            assert previous is not None and previous.stdout == b.code, (
                f"README line {b.line} shows an output that differs from what the block above "
                f"prints:\n{previous.stdout if previous else None}")
            continue
        if b.lang not in ("sh", "python"):
            continue
        command = (["bash", "-e", "-o", "pipefail", "-c", b.code] if b.lang == "sh"
                   else [sys.executable, "-c", b.code])
        previous = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=1200, stdin=subprocess.DEVNULL)
        print(f"README line {b.line}: ran ({b.lang}, exit {previous.returncode})")
        assert previous.returncode == 0, (
            f"README line {b.line} exits {previous.returncode}:\n{b.code}\n--- stdout\n"
            f"{previous.stdout[-3000:]}\n--- stderr\n{previous.stderr[-3000:]}")
        ran += 1
    return ran, skipped
