"""MkDocs hooks: the CLI reference made from click's own help at build time (so it never
drifts from the tools), and the benchmark reports of benchmarks/results/ served under results/
(the performance page links to them and shows their plots)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- cli-reference -->"


def on_files(files, config):
    """benchmarks/results/**/*.md and *.png as pages and images under results/."""
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in (".md", ".png") and path.is_file():
            dest = Path("results") / path.relative_to(RESULTS)
            files.append(File(str(dest), str(ROOT / "benchmarks"), config["site_dir"],
                              config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())


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
