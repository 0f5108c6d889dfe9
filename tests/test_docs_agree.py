"""What the docs say is what the software does: links that resolve where the pages are read
(the forge shows the repository's files; the site copies the reports under results/), the CLI
reference page the tools' own help, the help of each tool naming what it serves and reads, and
the pages agreeing with each other."""

import re
import sys
from pathlib import Path

from click.testing import CliRunner

from draftproof.cli.specexport import main as specexport
from draftproof.cli.specrun import main as specrun

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(page))


def test_every_relative_link_resolves_in_the_repository():
    broken = []
    for page in PAGES:
        for link in _links(page):
            target = link.split("#")[0]
            if re.match(r"[a-z]+:", link) or not target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert broken == []
    assert any("../benchmarks/results/" in link for link in _links(ROOT / "docs" /
                                                                    "performance.md"))


def test_the_site_serves_the_reports_the_pages_link():
    """The hook points a page's ../benchmarks/results/ links at the copies it serves."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import reference
    finally:
        sys.path.pop(0)
    page = "[report](../benchmarks/results/step-time-2026-12-05.md)"
    assert reference.on_page_markdown(page, None, None, None) == \
        "[report](results/step-time-2026-12-05.md)"


def _words(text: str) -> list[str]:
    return text.split()


def test_the_cli_reference_page_is_what_the_tools_print():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import reference
    finally:
        sys.path.pop(0)
    # compared word for word: a click release that wraps otherwise does not make it differ
    assert _words((ROOT / "docs" / "cli.md").read_text()) == _words(reference.cli_page()), \
        "docs/cli.md is out of date: run python docs/hooks/reference.py"


def _help(group, *names) -> str:
    r = CliRunner().invoke(group, [*names, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_serve_help_names_every_route_the_server_has():
    from spec_runtime.apps.server import ROUTES

    said = _help(specrun, "serve")
    assert [route for route in ROUTES if route not in said] == []


def test_specexport_help_names_every_kind_of_source_it_reads():
    said = _help(specexport)
    assert "GGUF" in said and "Hugging Face id" in said and "directory" in said


def test_the_gpu_install_hint_names_a_page_that_exists():
    from spec_runtime.engines.ort import GPU_INSTALL

    pages = re.findall(r"docs/\S+\.md", GPU_INSTALL)
    assert pages and all((ROOT / p).exists() for p in pages)


def test_readme_and_the_install_page_give_the_same_time_for_the_tests():
    said = [re.findall(r"The tests take about (\d+) minutes", page.read_text())
            for page in (ROOT / "README.md", ROOT / "docs" / "install.md")]
    assert said[0] and said[0] == said[1]


def test_no_word_is_broken_at_a_hyphen_across_lines():
    """Markdown joins lines with a space: "135-million-" then "parameter" reads
    "135-million- parameter"."""
    broken = []
    for page in PAGES:
        lines = _prose(page).splitlines()
        for a, b in zip(lines, lines[1:]):
            if re.search(r"\w-$", a) and re.match(r"\s*\w", b) and not a.lstrip().startswith("|"):
                broken.append(f"{page.name}: {a[-30:]!r}")
    assert broken == []


def test_an_empty_prompt_is_refused_before_the_bundle_loads(tmp_path):
    """quickstart.md: every subcommand checks its options before loading. A bundle that does
    not exist shows which came first: the prompt's refusal, not the bundle's."""
    missing = tmp_path / "no-bundle"
    r = CliRunner().invoke(specrun, ["generate", "", "--bundle", str(missing)])
    assert r.exit_code == 2 and "the prompt is empty" in r.output, r.output
    r = CliRunner().invoke(specrun, ["generate", "hello", "--bundle", str(missing)])
    assert r.exit_code == 2 and str(missing) in r.output  # the oracle: the load does refuse


def test_the_pages_speak_of_the_software_and_its_machines_not_of_the_project():
    """A page says what was measured on which machine, not on "this project's" machine."""
    said = [f"{page.name}: {line.strip()[:60]}" for page in PAGES
            for line in _prose(page).splitlines() if "this project" in line]
    assert said == []
