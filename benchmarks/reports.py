"""A benchmark's dated report: `<name>-<YYYY-MM-DD>.md` with the date, the machine, the exact
command and the run's tables, and `<same>.png` beside it (a matplotlib plot the markdown embeds
by a relative link). A report of the same name and date is never overwritten: the next one
takes a suffix (-2, -3, ...), so every run stays a file of its own.

Every benchmark script takes the same options (add_options): `--report DIR` (where; default:
beside the script's result files when it writes them, else no report), `--no-report`, and,
for the scripts whose JSON holds a whole run, `--from-json FILE` (the report of a stored run,
nothing measured; default DIR: benchmarks/results), with `--date` and `--machine` for a JSON
that does not record them.

matplotlib (the `bench` extra) is imported only to draw, on a Figure of its own with the Agg
canvas: no display, no pyplot state. Without it a report is written without its plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DPI = 100  # a plot of 10 × 6 inches is 1000 × 600 pixels, tens of KB
DATE = re.compile(r"\d{4}-\d{2}-\d{2}$")


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as a shell would take it back: `python` and sys.argv (or `argv`),
    each word quoted with shlex."""
    return shlex.join(["python", *(sys.argv if argv is None else argv)])


def today() -> str:
    return datetime.date.today().isoformat()


def run_date(stored: dict, given: str | None = None) -> str:
    """A stored run's date: `given` (--date), else the JSON's own "date" (its first 10
    characters: ISO times too), else today."""
    date = given or str(stored.get("date") or "")[:10] or today()
    if not DATE.match(date):
        raise SystemExit(f"--date {date!r}: use YYYY-MM-DD")
    return date


def write_run_report(run: dict, directory, name: str, *, title: str, sections, figure,
                     command: str | None = None, date: str | None = None,
                     machine: str | None = None, rebuilt_by: str | None = None) -> Path:
    """A stored run's report (every script's `dated` writes one): its sections, its plot, and
    the command, date and machine the run recorded unless given (--command, --date, --machine:
    what older JSON files lack)."""
    return write_report(
        directory, name, title=title, command=command or run.get("command") or command_line(),
        machine=machine_line(run.get("machine"), machine), sections=sections,
        figure=figure, date=run_date(run, date), rebuilt_by=rebuilt_by)


def write_report(directory, name: str, *, title: str, command: str, machine: str,
                 sections, figure=None, date: str | None = None,
                 rebuilt_by: str | None = None) -> Path:
    """Write DIRECTORY/NAME-DATE.md (and .png when `figure`, a matplotlib Figure, is given)
    and return the markdown's path. `command`: the command that measured; `rebuilt_by`: the
    command that made this report from the run's stored JSON, if one did. `sections`:
    markdown text, or a list of texts (tables, notes) put one after the other. DATE is today
    unless given; when NAME-DATE.md or .png exists, NAME-DATE-2, -3 ... instead."""
    if "/" in name or not name:
        raise ValueError(f"report name {name!r}: a file name without a directory")
    date = date or today()
    if not DATE.match(date):
        raise ValueError(f"report date {date!r}: use YYYY-MM-DD")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    md, n = None, 1
    while md is None:
        stem = f"{name}-{date}" + (f"-{n}" if n > 1 else "")
        n += 1
        if (directory / f"{stem}.png").exists():
            continue
        try:
            with open(directory / f"{stem}.md", "x"):  # claims the name, even against a race
                md = directory / f"{stem}.md"
        except FileExistsError:
            continue
    if isinstance(sections, str):
        sections = [sections]
    lines = [f"# {title}", "", f"Date: {date}  ", f"Machine: {machine}  ", "Command:", "",
             *("    " + line for line in command.splitlines()), ""]
    if rebuilt_by:
        lines += ["Report made from the run's stored JSON (nothing measured again) by:", "",
                  *("    " + line for line in rebuilt_by.splitlines()), ""]
    try:
        if figure is not None:
            figure.savefig(md.with_suffix(".png"), dpi=DPI)
            lines += [f"![{title}]({md.with_suffix('.png').name})", ""]
        body = "\n\n".join(s.strip("\n") for s in sections if s and s.strip())
        md.write_text("\n".join(lines) + ("\n" + body + "\n" if body else ""))
    except BaseException:  # no half-written report under the name
        md.unlink(missing_ok=True)
        md.with_suffix(".png").unlink(missing_ok=True)
        raise
    return md


# -- plots --------------------------------------------------------------------------------------

def figure(nrows: int = 1, ncols: int = 1, size=(8, 4)):
    """(Figure, 2-D array of axes) drawn by Agg, or (None, None) with a note on stderr when
    matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib, or the `bench` "
              "extra)", file=sys.stderr)
        return None, None
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def bars(ax, groups: list[str], series: dict, *, ylabel: str, title: str = "",
         low: dict | None = None, high: dict | None = None, line: float | None = None,
         rotate: bool = False, bold=(), value_format: str | None = None) -> None:
    """Grouped bars: one group per name in `groups`, one bar per series ({label: [value or
    None per group]}); `low`/`high` (the same shape) draw a range on each bar (p25–p75),
    `line` a horizontal reference (1.0 for a ratio); the groups in `bold` get bold labels;
    `value_format` ("{:.2f}×") writes each bar's value above it."""
    import numpy as np

    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(series.items()):
        pos = x - 0.4 + width * (i + 0.5)
        ok = [j for j, v in enumerate(values) if v is not None]
        vals = [values[j] for j in ok]
        drawn = ax.bar(pos[ok], vals, width, label=label, color=f"C{i}")
        if value_format:
            ax.bar_label(drawn, [value_format.format(v) for v in vals], fontsize=7, padding=1)
        if low and high and label in low:
            err = [[max(0.0, values[j] - low[label][j]) for j in ok],
                   [max(0.0, high[label][j] - values[j]) for j in ok]]
            ax.errorbar(pos[ok], vals, yerr=err, fmt="none", ecolor="black", elinewidth=0.8,
                        capsize=2)
    if line is not None:
        ax.axhline(line, color="gray", lw=0.8, ls="--")
    ax.set_xticks(x, groups, rotation=30 if rotate else 0, ha="right" if rotate else "center",
                  fontsize=8)
    for label in ax.get_xticklabels():
        if label.get_text() in bold:
            label.set_fontweight("bold")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def speed_plot(summary: dict, names: list[str], plain_of: dict, *, ours=(), heading: str):
    """Two panels from a race's summary ({kind: {system: {"tokens_per_s": {median, p25,
    p75}}}}): top, median tok/s (p25–p75) per system, a bar per prompt kind; bottom, each
    speculative system's median over its own target-only system's (`plain_of`), per kind,
    where both ran. Systems in `ours` get bold labels. None without matplotlib."""
    kinds = [k for k in summary if k != "all"] or list(summary)
    names = [n for n in names if any(n in summary[k] for k in kinds)]
    fig, axes = figure(2, 1, size=(10, 7.5))
    if fig is None:
        return None

    def q(kind, name, key):
        row = summary[kind].get(name)
        return row["tokens_per_s"][key] if row else None

    bars(axes[0, 0], names, {k: [q(k, n, "median") for n in names] for k in kinds},
         ylabel="tok/s (median, p25–p75)",
         low={k: [q(k, n, "p25") for n in names] for k in kinds},
         high={k: [q(k, n, "p75") for n in names] for k in kinds}, rotate=True, bold=set(ours),
         title=f"{heading}: tokens/s per system and prompt kind"
         + (" (ours in bold)" if ours else ""))

    def ratio(kind, name):
        plain = plain_of[name]
        if name in summary[kind] and plain in summary[kind]:
            return q(kind, name, "median") / q(kind, plain, "median")
        return None

    spec = [n for n in names if n in plain_of and any(ratio(k, n) for k in kinds)]
    labels = [f"{n} / {plain_of[n]}" for n in spec]
    ax = axes[1, 0]
    if spec:
        bars(ax, labels, {k: [ratio(k, n) for n in spec] for k in kinds}, line=1.0,
             value_format="{:.2f}×", ylabel="× its own target-only", rotate=True,
             bold={label for label, n in zip(labels, spec) if n in ours},
             title="speed-up of each speculative system over its own target-only system "
             "(median tok/s ratio)")
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no speculative system whose target-only system ran", ha="center")
    return fig


# -- options ------------------------------------------------------------------------------------

def gamma(value: str):
    """An argparse type: --gamma as the runtime parses it (decode.gamma.parse_gamma: an
    integer, or AUTO, which is the string "auto")."""
    from spec_runtime.decode.gamma import parse_gamma
    from spec_runtime.errors import FieldError

    try:
        return parse_gamma(value, "--gamma")
    except FieldError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gammas(value: str) -> list:
    """An argparse type: a comma-separated list of γ (`gamma` each), e.g. "1,2,4,auto"."""
    return [gamma(g.strip()) for g in value.split(",") if g.strip()]



def add_options(ap: argparse.ArgumentParser, *, default: str, from_json: bool = True) -> None:
    """--report DIR and --no-report; with `from_json`, --from-json FILE, --date, --machine.
    `default` says where the report goes without --report (for --help)."""
    g = ap.add_argument_group("report (a dated markdown file and its PNG plot)")
    g.add_argument("--report", type=Path, metavar="DIR",
                   help=f"write the report into DIR [default: {default}]")
    g.add_argument("--no-report", action="store_true", help="write no report")
    if from_json:
        g.add_argument("--from-json", type=Path, metavar="FILE",
                       help="make the report of a stored run from its JSON (measures nothing; "
                       "DIR default: benchmarks/results)")
        g.add_argument("--date", help="with --from-json: the run's date, YYYY-MM-DD "
                       "[default: the JSON's own, else today]")
        g.add_argument("--machine", help="with --from-json: the machine line when the JSON does "
                       "not record the machine")
        g.add_argument("--command", help="with --from-json: the command that ran, when the JSON "
                       "does not record it")


def directory(args, results: Path | None = None) -> Path | None:
    """Where this run's report goes: --report; else benchmarks/results for --from-json; else
    `results` (the directory the script writes its result files in; None when it writes
    none: no report)."""
    if args.no_report:
        return None
    if args.report is not None:
        return args.report
    if getattr(args, "from_json", None) is not None:
        return RESULTS
    return results


def machine_line(stored: dict | None, given: str | None = None) -> str:
    """--machine, else machine.describe() of what the JSON stored."""
    import machine

    if given:
        return given
    return machine.describe(stored) if stored else "not recorded in the run's JSON (--machine)"


def stored_command(stored: dict, given: str | None = None) -> str:
    """--command, else the command the JSON recorded."""
    return given or stored.get("command") or "not recorded in the run's JSON (--command)"


def rebuilt(args, stored: dict, directory: Path | None, render) -> None:
    """--from-json: `render(stored, directory, command=..., date=..., machine=...)` writes the
    report of the stored run, with the command that measured it and this one."""
    report(render, stored, directory, command=stored_command(stored, args.command),
           date=run_date(stored, args.date), machine=args.machine, rebuilt_by=command_line())


def finish(args, run: dict, table: str, render) -> None:
    """A measured run: its JSON to --out (when given), its table printed, and its report
    (`render(run, directory)`) where `directory(args)` puts it, beside --out by default."""
    if args.out:
        args.out.write_text(json.dumps(run, indent=1))
    print(table)
    report(render, run, directory(args, args.out.parent if args.out else None))


def report(render, run: dict, directory: Path | None, **given) -> None:
    """`render(run, directory, **given)` (a script's `dated`: command, date, machine,
    rebuilt_by) where a report is wanted (`directory` not None), and the paths it wrote said."""
    if directory is not None:
        done(render(run, directory, **given))


def done(path: Path | None) -> None:
    if path is not None:
        png = path.with_suffix(".png")
        print(f"wrote {path}" + (f" and {png.name}" if png.exists() else ""), file=sys.stderr)
