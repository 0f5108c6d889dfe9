"""specrun: run exact speculative decoding on a specedge bundle."""

from __future__ import annotations

import json
import sys

import click

from .common import BadInput, input_errors


def _gamma(value):
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise BadInput(f"--gamma {value!r} is invalid: use an integer or 'auto'") from None


def _read_prompt(prompt, prompt_file):
    if prompt is not None and prompt_file is not None:
        raise BadInput("give the prompt as an argument or --prompt-file, not both")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogates)
            raise BadInput("the prompt argument is not UTF-8 text: convert it, or pass it "
                             "with --prompt-file") from None
        return prompt
    if prompt_file is not None:
        data, source = click.open_file(prompt_file, "rb").read(), f"--prompt-file {prompt_file!r}"
    else:
        if sys.stdin is None or sys.stdin.isatty():
            raise BadInput("no prompt: give it as an argument, --prompt-file, or on stdin")
        data, source = sys.stdin.buffer.read(), "stdin"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{source} is not UTF-8 text (byte {e.start}): convert it, e.g. "
                         f"`iconv -t UTF-8`") from None


def device_options(fn):
    """--device and --draft-device, shared by the commands that load a bundle."""
    from spec_runtime.kv_cache import DEVICES

    devices = click.Choice(sorted(DEVICES))
    fn = click.option("--draft-device", type=devices, default=None,
                      help="where a model draft runs [default: --device], e.g. an int4 draft on "
                           "cpu beside an fp16 target on cuda")(fn)
    return click.option("--device", type=devices, default="cpu", show_default=True,
                        help="where the target runs: ONNX Runtime's CPU, CUDA or TensorRT "
                             "provider (the last two need onnxruntime-gpu)")(fn)


def stats_line(stats: dict) -> str:
    s = (f"{stats['new_tokens']} tokens ({stats['finish_reason']}) · "
         f"{stats['tokens_per_s']:.1f} tok/s · {stats['tokens_per_target_call']:.2f} tokens/target call")
    if stats["mode"] == "speculative":
        s += (f" · α {stats['alpha']:.2f} · accepted {stats['accepted']}/{stats['proposed']}"
              f" · draft {stats['draft_kind']}")
    else:
        s += " · target-only"
    return s


@click.group()
def main():
    """Generate with exact speculative decoding from a specedge bundle."""


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              default=None)
@click.option("--bundle", type=click.Path(), default=None,
              help="bundle directory [default: where `specexport build` writes]")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--gamma", default=None, help="draft length γ, or 'auto' [default: the bundle's]")
@click.option("--no-draft", is_flag=True, help="target-only decoding (the baseline)")
@click.option("--chat/--no-chat", default=None,
              help="apply the bundle's chat template [default: on when it has one]")
@click.option("--stream", is_flag=True, help="print text as it is generated")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: tokens, text, stats")
@device_options
@input_errors
def generate(prompt, prompt_file, bundle, max_new_tokens, temperature, top_k, top_p, seed, gamma,
             no_draft, chat, stream, as_json, device, draft_device):
    """Generate a continuation of PROMPT (or --prompt-file, or stdin)."""
    import spec_runtime

    text = _read_prompt(prompt, prompt_file)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device)
    if chat is None:
        chat = bool(gen.chat_template)
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                  top_p=top_p, seed=seed, gamma=_gamma(gamma), use_draft=not no_draft, chat=chat)
    if stream and not as_json:
        for piece in gen.stream(text, **kwargs):
            click.echo(piece, nl=False)
        click.echo()
        click.echo(stats_line(gen.last_stats), err=True)
        return
    result = gen.generate(text, **kwargs)
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "text": result.text,
                               "stats": result.stats}))
    else:
        click.echo(result.text)
        click.echo(stats_line(result.stats), err=True)


def _gammas(value: str) -> list:
    out = []
    for part in value.split(","):
        part = part.strip()
        out.append(part if part == "auto" else _gamma(part))
    return out


@main.command()
@click.option("--bundle", type=click.Path(), default=None)
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSON {kind: [prompts]} or a text file, one prompt per line [default: built-in]")
@click.option("--kind", type=click.Choice(["all", "grounded", "chat"]), default="all",
              show_default=True, help="which built-in prompts")
@click.option("--gamma", default="1,2,4,8", show_default=True, help="γ values, or 'auto'")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="write a PNG of speedup vs γ (needs matplotlib)")
@device_options
@input_errors
def bench(bundle, prompts_file, kind, gamma, temperature, max_new_tokens, repeats, as_json, plot,
          device, draft_device):
    """Speculative vs target-only tokens/s on the same engines, alternating, with α, c and the
    paper's predicted speedup."""
    import spec_runtime
    from spec_runtime.bench import format_table, load_prompts, run_bench
    from spec_runtime.bench import plot as plot_report

    if repeats < 1:
        raise BadInput(f"--repeats {repeats} is invalid: use an integer >= 1")
    prompts = load_prompts(prompts_file, kind if prompts_file is None else "all")
    gammas = _gammas(gamma)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device)
    for g in gammas:
        gen.gamma_policy(g)  # validate every γ before minutes of measuring
    with click.progressbar(length=len(gammas) * len(prompts) * repeats, label="bench",
                           file=sys.stderr) as bar:
        report = run_bench(gen, prompts, gammas, temperature=temperature,
                           max_new_tokens=max_new_tokens, repeats=repeats, progress=bar.update)
    if plot:
        plot_report(report, plot)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--tokens", type=int, default=3, show_default=True,
              help="length k of the continuations whose joint distribution is compared")
@click.option("--samples", type=int, default=None,
              help="continuations per mode (speculative, target-only) [default: 400]")
@click.option("--seconds", type=float, default=None,
              help="time budget; sampling stops when it is spent [default: 90]")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--gamma", default=None, help="draft length γ, or 'auto' [default: the bundle's]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@device_options
@input_errors
def check(bundle, tokens, samples, seconds, temperature, top_k, top_p, gamma, seed, as_json,
          device, draft_device):
    """Test that speculative decoding on BUNDLE samples from the target's distribution: a
    two-sample chi-square of speculative vs target-only continuations, and greedy parity.
    Exit 0 when consistent, 1 when the test rejects, 2 on bad input."""
    import spec_runtime
    from spec_runtime.check import DEFAULT_SAMPLES, DEFAULT_SECONDS, format_report, run_check

    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device)
    samples = DEFAULT_SAMPLES if samples is None else samples
    with click.progressbar(length=max(samples, 1), label="check", file=sys.stderr) as bar:
        report = run_check(gen, tokens=tokens, samples=samples,
                           seconds=DEFAULT_SECONDS if seconds is None else seconds,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           gamma=_gamma(gamma), progress=bar.update)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    sys.exit(report["exit_code"])


@main.command()
def where():
    """Print the default bundle directory."""
    from spec_runtime.bundle import default_bundle_dir

    click.echo(default_bundle_dir())


if __name__ == "__main__":
    main()
