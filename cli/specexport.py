"""specexport: export a target and a draft model into a draftproof bundle."""

from __future__ import annotations

import json
from enum import Enum

import click

from spec_runtime.decode.sampling import cli_flag

from .common import BundleCommand, input_errors, library_messages, sigterm_as_interrupt
from .options import in_cli_words

BUNDLE_HELP = ("bundle directory [default: $DRAFTPROOF_BUNDLE, else "
               "~/.local/share/draftproof/default: where `specexport build` writes without --out "
               "and specrun looks; `specrun where` prints it]")


def bundle_option(fn):
    """-b/--bundle, the way every command of both tools takes a bundle."""
    return click.option("-b", "--bundle", type=click.Path(), default=None, help=BUNDLE_HELP)(fn)


@click.group(invoke_without_command=True)
@click.version_option(package_name="draftproof", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx):
    """Export a target and a draft model (a GGUF file, a Hugging Face id or a local directory)
    to ONNX bundles for exact speculative decoding: `specexport
    build` writes a bundle (the embedded default SmolLM2-135M-Instruct without options),
    `specexport verify` re-checks one against PyTorch, `specexport engine` builds TensorRT
    engines for one."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


def build_options(fn):
    """`specexport build`'s options, one a BuildOptions field (spec_export/bundle/options.py): its
    flag the field's name with dashes, its help and default the field's declaration."""
    from spec_export.bundle.options import BUILD_FIELDS

    for f in reversed(BUILD_FIELDS):
        m, flag = f.metadata, cli_flag(f.name)
        kind, said = m["cli"].get("type", str), m["default"]
        shown = f" [default: {said}]" if said else ""
        if m["cli"].get("flag"):
            fn = click.option(flag, is_flag=True, default=f.default, help=m["what"] + shown)(fn)
            continue
        if isinstance(kind, type) and issubclass(kind, Enum):
            kind = click.Choice([member.value for member in kind])
        elif kind == "directory":
            kind = click.Path(file_okay=False)
        default = f.default.value if isinstance(f.default, Enum) else f.default
        fn = click.option(flag, type=kind, default=default, show_default=not said,
                          help=m["what"] + shown)(fn)
    return fn


@main.command()
@build_options
@click.option("--quiet", is_flag=True,
              help="no progress bar on stderr; the summary is still printed [default: show "
                   "the bar]")
@input_errors
def build(quiet, **options):
    """Build a bundle: export, check parity against PyTorch, write it atomically."""
    from spec_export.build import build_bundle, request_interrupt

    with sigterm_as_interrupt(request_interrupt), library_messages("spec_export", "specexport"):
        # a build stopped by a signal removes its temporary directory; one killed outright is
        # cleaned up by the next build (spec_export/bundle/output.py)
        path = in_cli_words(build_bundle, progress=not quiet, **options)
    from spec_export.bundle.summary import build_summary

    click.echo(build_summary(path))


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--json", "as_json", is_flag=True,
              help="print the report as JSON instead of the table [default: the table]")
@input_errors
def verify(bundle, as_json):
    """Re-check a bundle: every file's sha256, then every graph against the PyTorch model it
    came from (loaded again from the source the manifest records). Exit 0 when every check
    passes, 2 when the bundle is missing or damaged or a graph fails."""
    from spec_export.parity.verify import format_report, verify_bundle

    with library_messages("spec_export", "specexport"):
        report = verify_bundle(bundle)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--fp16/--no-fp16", default=None,
              help="let TensorRT compute in float16 or not [default: float16 when the bundle's "
                   "graphs are fp16]")
@click.option("--workspace", type=int, default=4096, show_default=True,
              help="TensorRT's workspace memory limit while building, in MB, at least 64")
@click.option("--device-id", type=int, default=0, show_default=True,
              help="the GPU to build for, as CUDA numbers them: 0..(number of GPUs - 1)")
@input_errors
def engine(bundle, fp16, workspace, device_id):
    """Build native TensorRT engines from the bundle's portable graphs, on the machine that
    will run them (engines are tied to the TensorRT version and the GPU); `specrun --device
    tensorrt` then runs them without onnxruntime-gpu. Needs TensorRT and cuda-python, not
    torch."""
    from spec_export.graphs.trt_build import build_engines

    with library_messages("spec_export", "specexport"):
        record = build_engines(bundle, fp16=fp16, workspace_mb=workspace, device_id=device_id)
    click.echo(f"TensorRT {record['tensorrt_version']} engines for {record['gpu']} "
               f"({record['compute_capability']}): {', '.join(record['graphs'].values())}")


if __name__ == "__main__":
    main()
