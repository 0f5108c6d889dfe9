"""The code blocks of README.md and of the docs (docs/*.md, in the site's order) run as written.

Every code block is fenced and names its language: `sh` and `python` blocks are run, README
first and then the docs pages in the order of mkdocs.yml's nav, the way a new user would after
the set-up command (a fresh working directory holding the
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
MKDOCS = ROOT / "mkdocs.yml"
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


def doc_pages() -> list[Path]:
    """README, then the docs pages in the order of the site's nav (a page made at build time,
    such as the CLI reference or the design page's include of DESIGN.md, has no blocks)."""
    pages = re.findall(r"^\s+- [^:]+: (\S+\.md)$", MKDOCS.read_text(), re.M)
    assert len(pages) >= 10, "mkdocs.yml's nav lists the pages"
    return [README] + [ROOT / "docs" / p for p in pages]


def all_blocks() -> list[tuple[Path, "Block"]]:
    return [(page, b) for page in doc_pages() for b in read_blocks(page.read_text())]


def where(page: Path, b: "Block") -> str:
    return f"{page.relative_to(ROOT)} line {b.line}"


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
    total = 0
    for page in doc_pages():
        text = page.read_text()
        assert indented_code(text) == [], (
            f"{page.name}: indented code blocks: fence them and name the language")
        blocks = read_blocks(text)
        total += len(blocks)
        for prev, b in zip([None, *blocks], blocks):
            assert b.lang in LANGUAGES, f"{where(page, b)}: ```{b.lang} (use one of {LANGUAGES})"
            if b.output:
                assert b.lang == "text" and prev is not None and prev.lang == "sh", where(page, b)
        # a marker that does not match the pattern would silently run (or silently not check)
        # a block
        for n, line in enumerate(text.splitlines(), 1):
            if "readme-test" in line:
                assert MARKER.match(line), f"{page.name} line {n}: malformed marker {line!r}"
    assert total >= 25


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
    excerpts = [(page, b) for page, b in all_blocks() if b.lang == "cpp"]
    assert excerpts
    for page, b in excerpts:
        missing = [c for c in _code_lines(b.code) if c not in host]
        assert not missing, f"{where(page, b)}: not in tests/embed/host.cpp: {missing}"


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
    """The sh and python blocks of README and the docs pages in order, in one working directory
    and environment, as a user following them top to bottom after the set-up command."""
    work = tmp_path / "work"
    work.mkdir()
    for name in CHECKOUT:
        (work / name).symlink_to(ROOT / name)
    env = dict(os.environ, DRAFTPROOF_BUNDLE=str(default_bundle), PYTHONPATH="",
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
    for page, b in all_blocks():
        if b.skip:
            skipped.append(f"{where(page, b)}: {b.skip}")
            continue
        if b.output:
            assert previous is not None and previous.stdout == b.code, (
                f"{where(page, b)} shows an output that differs from what the block above "
                f"prints:\n{previous.stdout if previous else None}")
            continue
        if b.lang not in ("sh", "python"):
            continue
        command = (["bash", "-e", "-o", "pipefail", "-c", b.code] if b.lang == "sh"
                   else [sys.executable, "-c", b.code])
        previous = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=1200, stdin=subprocess.DEVNULL)
        print(f"{where(page, b)}: ran ({b.lang}, exit {previous.returncode})")
        assert previous.returncode == 0, (
            f"{where(page, b)} exits {previous.returncode}:\n{b.code}\n--- stdout\n"
            f"{previous.stdout[-3000:]}\n--- stderr\n{previous.stderr[-3000:]}")
        ran += 1
    return ran, skipped


# -- commands parsed against the command-line tools themselves (fast; also the skipped blocks) ---

REDIRECT = re.compile(r"(?<=\s)\d*>&\d+|(?<=\s)\d*>>?\s*[^\s&|;]+")
OPERATORS = set("();<>|&")


def cli_commands(code: str) -> list[list[str]]:
    """The `specrun ...` and `specexport ...` command lines of a shell block, as argument lists:
    continuation lines joined, comments and redirections dropped, split at `&&`, `|`, `;`, `&`
    and `$(`...`)` (a command inside quotes, such as "$(specrun where)", is an argument)."""
    import shlex

    out = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(REDIRECT.sub(" ", line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= OPERATORS:
                if command and command[0] in ("specrun", "specexport"):
                    out.append(command)
                command = []
            else:
                command.append(token)
    return out


def parse_cli(argv: list[str]) -> None:
    """Parse `argv` with the tool's own click objects, as running it would (options exist,
    values convert to their types, choices and ranges hold, no stray argument), without
    running it; a click.UsageError / BadParameter says what is wrong."""
    from draftproof.cli.specexport import main as specexport
    from draftproof.cli.specrun import main as specrun

    import click

    tool = {"specrun": specrun, "specexport": specexport}[argv[0]]
    parent = click.Context(tool, info_name=argv[0])
    command = tool.commands.get(argv[1]) if len(argv) > 1 else None
    if command is None:
        raise click.UsageError(f"{argv[0]} has no command {argv[1:2]}", parent)
    command.make_context(argv[1], argv[2:], parent=parent).close()


def test_cli_command_parser_oracle():
    """The splitter on hand-written lines, and the parser on a good and a bad command."""
    import click

    code = ('specrun serve > serve.log 2>&1 &     # a comment\n'
            'kill $(pgrep -f "specrun serve$")\n'
            'echo "Why?" | specrun generate --max-new-tokens 32\n'
            'specexport engine b && specrun generate "P" \\\n    --bundle "$(specrun where)"\n')
    assert cli_commands(code) == [["specrun", "serve"],
                                  ["specrun", "generate", "--max-new-tokens", "32"],
                                  ["specexport", "engine", "b"],
                                  ["specrun", "generate", "P", "--bundle", "$(specrun where)"]]
    parse_cli(["specrun", "generate", "P", "--max-new-tokens", "32", "--gamma", "auto"])
    for bad in (["specrun", "generate", "P", "--max-new-tokens", "lots"],   # a type
                ["specrun", "generate", "P", "--max-new-tokenz", "3"],      # an option
                ["specrun", "serve", "--port", "70000"],                    # a range
                ["specexport", "build", "--precision", "fp8"],              # a choice
                ["specexport", "verify", "some-bundle"]):                   # a stray argument
        with pytest.raises(click.UsageError):
            parse_cli(bad)


def test_every_shell_command_parses_with_the_cli():
    """Every specrun/specexport command of every sh block, the skipped ones included (they
    cannot run here: a GPU, the hub, several machines), parses with the CLI's own parser."""
    checked = 0
    for page, b in all_blocks():
        if b.lang != "sh":
            continue
        for argv in cli_commands(b.code):
            try:
                parse_cli(argv)
            except Exception as e:  # noqa: BLE001 — reported with the line it came from
                pytest.fail(f"{where(page, b)}: `{' '.join(argv)}` does not parse: {e}")
            checked += 1
    print(f"{checked} commands parsed")
    assert checked >= 30


def _synopsis() -> dict[str, str]:
    """The docs' synopsis block: {"specexport build": its text, ...}."""
    block = next(b for _, b in all_blocks()
                 if b.lang == "text" and b.code.startswith("specexport build"))
    out, current = {}, None
    for line in block.code.splitlines():
        if line.startswith(("specexport ", "specrun ")):
            current = " ".join(line.split()[:2])
            out[current] = ""
        out[current] += " " + line.split("#")[0]
    return out


def _option_names(command) -> set[str]:
    return {o for p in command.params for o in [*p.opts, *p.secondary_opts] if o.startswith("-")}


def test_synopsis_names_real_options_and_every_build_option():
    from draftproof.cli.specexport import main as specexport
    from draftproof.cli.specrun import main as specrun

    tools = {"specrun": specrun, "specexport": specexport}
    synopsis = _synopsis()
    assert {"specexport build", "specrun generate", "specrun serve"} <= set(synopsis)
    for name, text in synopsis.items():
        tool, sub = name.split()
        command = tools[tool].commands[sub]
        named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", text))
        assert named <= _option_names(command), (name, named - _option_names(command))
    build = _option_names(specexport.commands["build"]) - {"--help"}
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", synopsis["specexport build"]))
    assert build <= named, f"specexport build options missing from the synopsis: {build - named}"


def test_what_readme_commands_write_in_the_checkout_is_ignored_by_git():
    """Bundles (`--out DIR`), programs (`-o FILE`), logs (`> FILE`) and pid files that README's
    commands write into the working directory do not show in `git status`."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing can show in git status")
    written = set()
    for _, b in all_blocks():
        if b.lang == "sh":
            code = b.code.replace("\\\n", " ")
            written |= set(re.findall(r"(?:--out|-o|--pid-file)\s+([\w.-]+)", code))
            written |= set(re.findall(r"(?<=\s)>\s*([\w.-]+)", code))
    assert {"int4-bundle", "lookup-bundle", "fp16-bundle", "host", "serve.log",
            "serve.pid"} <= written
    shown = [w for w in sorted(written) if subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", w + ("/" if "bundle" in w else "")],
        cwd=ROOT).returncode != 0]
    assert not shown, f"README writes these into the checkout and git would show them: {shown}"


def _marked_slow(node, module_slow: bool) -> bool:
    import ast

    return module_slow or any("mark.slow" in ast.unparse(d) for d in node.decorator_list)


def test_the_fast_subset_builds_no_default_bundle():
    """README's `-m "not slow"` leaves out every test that builds the real default bundle (a
    minute or more of the suite): each test that asks for the `default_bundle` fixture, directly
    or through a fixture of its module, is marked slow."""
    import ast

    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n.targets[0])
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        needs = {"default_bundle"}
        for _ in functions:  # fixtures of the module that reach default_bundle, to a fixed point
            needs |= {f.name for f in functions if {a.arg for a in f.args.args} & needs}
        unmarked += [f"{path.name}::{f.name}" for f in functions if f.name.startswith("test_")
                     and {a.arg for a in f.args.args} & needs and not _marked_slow(f, module_slow)]
    assert not unmarked, f"build the default bundle but are not marked slow: {unmarked}"
    assert "-m \"not slow\"" in README.read_text()


def test_the_sampling_table_is_the_declared_controls():
    """The sampling controls are declared once (SamplingParams' fields); the docs' table is
    rendered from that declaration, so a control added, renamed or re-ranged there fails here
    until the table says so."""
    from spec_runtime.decode.sampling import SAMPLING_FIELDS, sampling_table

    table = sampling_table()
    assert len(table.splitlines()) == 2 + len(SAMPLING_FIELDS)
    for f in SAMPLING_FIELDS:  # the rendering names every control by its field and its option
        assert f"`{f.name}" in table and "--" + f.name.replace("_", "-") in table
    page = ROOT / "docs" / "generating.md"
    assert table in page.read_text(encoding="utf-8"), "render sampling_table() into the docs"


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing page or anchor, or a page left out of
    the site fails (the docs extra installs MkDocs and its Material theme)."""
    pytest.importorskip("material", reason="the docs extra (MkDocs Material) is not installed: "
                                           "pip install -e \".[docs]\"")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    for command in ("specexport build", "specrun generate", "specrun serve", "--max-new-tokens"):
        assert command in cli, f"the CLI reference lacks {command!r}"  # made from click's help
    assert (tmp_path / "site" / "results" / "pair-fp32-2026-12-04.png").is_file()


def test_readme_is_short_and_links_into_the_docs():
    """README is a five-minute read: at most 12,000 characters, the two set-up commands, and
    links to pages that exist."""
    text = README.read_text(encoding="utf-8")
    assert len(text) <= 12_000, len(text)
    setup = [b for b in read_blocks(text) if b.lang == "sh" and "pip install" in b.code]
    assert len(setup) == 2, [b.code for b in setup]
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert sum(link.startswith("docs/") for link in links) >= 10
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, missing
