"""MkDocs hooks: the benchmark reports of benchmarks/results/ served under results/
(the performance page links to them and shows their plots; a page's links to
../benchmarks/results/, which resolve in the repository, point there in the site)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CLI_PAGE = ROOT / "docs" / "cli.md"


def on_files(files, config):
    """benchmarks/results/**/*.md and *.png as pages and images under results/."""
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in (".md", ".png") and path.is_file():
            dest = Path("results") / path.relative_to(RESULTS)
            files.append(File(str(dest), str(ROOT / "benchmarks"), config["site_dir"],
                              config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    """The pages link the reports where they live in the repository (../benchmarks/results/,
    which the forge shows); the site serves them under results/."""
    return markdown.replace("](../benchmarks/results/", "](results/")


def cli_page() -> str:
    """docs/cli.md: every command's help as the tools print it (`python docs/hooks/reference.py`
    writes it; tests/test_docs_agree.py holds the page to the tools)."""
    return ("# CLI reference\n\nThe help of every command, as `specexport --help` and `specrun "
            "COMMAND --help` print it\n(`python docs/hooks/reference.py` writes this page from the "
            "tools themselves).\n\n" + cli_reference())


def cli_reference() -> str:
    """Every command's --help, as click prints it, in a text block per command."""
    import click

    from draftproof.cli.specexport import main as specexport
    from draftproof.cli.specrun import main as specrun

    out = []
    for name, group in (("specexport", specexport), ("specrun", specrun)):
        out.append(f"## {name}\n")
        ctx = click.Context(group, info_name=name, terminal_width=100)
        out.append(f"```text\n{group.get_help(ctx)}\n```\n")
        for sub in sorted(group.list_commands(ctx)):
            command = group.get_command(ctx, sub)
            sub_ctx = click.Context(command, info_name=f"{name} {sub}", parent=ctx,
                                    terminal_width=100)
            out.append(f"### {name} {sub}\n\n```text\n{command.get_help(sub_ctx)}\n```\n")
    return "\n".join(out)


if __name__ == "__main__":
    CLI_PAGE.write_text(cli_page())
    print(f"wrote {CLI_PAGE}")
