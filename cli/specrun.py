"""specrun: run exact speculative decoding on a specedge bundle."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import click

from spec_runtime.errors import InputError, install_extra

from .common import BadInput, BundleCommand, input_errors, library_messages

MAX_NEW_TOKENS = 128  # the one default, for every command (and Generator.generate)


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


def bundle_option(fn):
    """-b/--bundle, the same for every command that reads a bundle."""
    return click.option("-b", "--bundle", type=click.Path(), default=None,
                        help="bundle directory [default: $SPECEDGE_BUNDLE, else where "
                             "`specexport build` writes without --out: see `specrun where`]")(fn)


def device_options(fn):
    """--device, --draft-device and --threads, shared by the commands that load a bundle."""
    from spec_runtime.devices import DEVICES

    devices = click.Choice(sorted(DEVICES))
    fn = click.option("--threads", type=click.IntRange(min=1), default=None,
                      help="CPU threads of each ONNX Runtime session, >= 1 (llama.cpp's -t) "
                           "[default: the physical cores this process may run on]")(fn)
    fn = click.option("--draft-device", type=devices, default=None,
                      help="where a model draft runs [default: --device], e.g. an int4 draft on "
                           "cpu beside an fp16 target on cuda")(fn)
    return click.option("--device", type=devices, default="cpu", show_default=True,
                        help="where the target runs: cpu (ONNX Runtime's CPU provider), cuda or "
                             "tensorrt (ONNX Runtime's CUDA or TensorRT provider, which need "
                             "onnxruntime-gpu; tensorrt also runs engines built by "
                             "`specexport engine`)")(fn)


def _logit_bias(values) -> dict | None:
    out = {}
    for v in values:
        tok, sep, bias = v.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise BadInput(f"--logit-bias {v!r} is invalid: use TOKEN_ID=BIAS, e.g. "
                           f"--logit-bias 2=-100 to ban token 2") from None
        if not sep:
            raise BadInput(f"--logit-bias {v!r} is invalid: use TOKEN_ID=BIAS")
    return out or None


def sampling_options(fn, temperature_default=None):
    """The sampling controls, each defaulting to the bundle's generation default (the model's
    generation_config), else off; generate and chat share them."""
    the_bundles = "[default: the bundle's, else {}]"
    options = [
        click.option("--temperature", type=float, default=temperature_default,
                     help="sampling temperature, >= 0; 0 = greedy "
                          + the_bundles.format("0 = greedy")),
        click.option("--top-k", type=int, default=None,
                     help="keep the k most likely tokens, >= 0; 0 = all "
                          + the_bundles.format("0")),
        click.option("--top-p", type=float, default=None,
                     help="keep the most likely tokens up to this probability mass, in (0, 1] "
                          + the_bundles.format("1 = all")),
        click.option("--min-p", type=float, default=None,
                     help="drop tokens less likely than min-p × the most likely one, in [0, 1] "
                          + the_bundles.format("0 = off")),
        click.option("--repetition-penalty", type=float, default=None,
                     help="divide the logits of tokens already in the context (prompt "
                          "included), > 0; 1.1-1.3 curbs loops " + the_bundles.format("1 = off")),
        click.option("--presence-penalty", type=float, default=None,
                     help="subtract from the logit of every token generated so far, in [-2, 2] "
                          "[default: 0 = off]"),
        click.option("--frequency-penalty", type=float, default=None,
                     help="subtract this × how often a token was generated so far, in [-2, 2] "
                          "[default: 0 = off]"),
        click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
                     help="add BIAS (in [-100, 100]) to token ID's logit; repeatable; "
                          "-100 bans a token"),
        click.option("--seed", type=int, default=None,
                     help="random seed, >= 0: the same seed gives the same sample in the same "
                          "mode (speculative and --no-draft draw differently) [default: random]"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def sampling_kwargs(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                    frequency_penalty, logit_bias, seed) -> dict:
    """The sampling arguments for Generator.generate/stream, checked before a bundle loads
    (values that need the bundle, a token id's range, are checked by the generator)."""
    from spec_runtime.sampling import SamplingParams

    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
              frequency_penalty=frequency_penalty, logit_bias=_logit_bias(logit_bias))
    try:
        SamplingParams(seed=seed, **{k: v for k, v in kw.items() if v is not None})
    except InputError as e:
        raise BadInput(cli_words(str(e))) from None
    return dict(kw, seed=seed)


def check_gamma(gen, gamma) -> None:
    """--gamma against the loaded bundle's max_gamma, in the command line's words."""
    try:
        gen.check_gamma(gamma)
    except InputError as e:
        raise BadInput(cli_words(str(e))) from None


def cli_words(message: str) -> str:
    """A sampling message in the command line's words: "top_p=1.5 is invalid" -> "--top-p 1.5
    is invalid", "logit_bias[5]=200" -> "--logit-bias 5=200"."""
    message = re.sub(r"^logit_bias\[(.*?)\]=", r"--logit-bias \1=", message)
    message = re.sub(r"^logit_bias token id", "--logit-bias token id", message)
    return re.sub(r"^([a-z_]+)=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


def stats_line(stats: dict) -> str:
    s = (f"{stats['new_tokens']} tokens ({stats['finish_reason']}) · "
         f"{stats['tokens_per_s']:.1f} tok/s · {stats['tokens_per_target_call']:.2f} tokens/target call")
    if stats["mode"] == "speculative":
        s += (f" · α {stats['alpha']:.2f} · accepted {stats['accepted']}/{stats['proposed']}"
              f" · draft {stats['draft_kind']}")
    else:
        s += " · target-only"
    return s


@click.group(invoke_without_command=True)
@click.version_option(package_name="specedge", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx):
    """Generate with exact speculative decoding from a specedge bundle: `specrun generate
    "PROMPT"`, `specrun chat`, `specrun bench`, `specrun check`. Every command reads the bundle
    that `specexport build` wrote, or the one -b/--bundle names."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              default=None, help="read the prompt from this UTF-8 file ('-' = stdin) [default: the PROMPT "
                   "argument, else stdin]")
@bundle_option
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=MAX_NEW_TOKENS,
              show_default=True, help="stop after this many new tokens (or at EOS)")
@sampling_options
@click.option("--gamma", default=None,
              help="draft length γ, 1..the bundle's max_gamma, or 'auto' (re-chosen every round "
                   "from the measured acceptance and costs) [default: the bundle's]")
@click.option("--no-draft", is_flag=True, help="target-only decoding (the baseline)")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="end the answer where this text appears, cut before it (finish_reason "
                   "\"stop\"); repeatable [default: none, only EOS and --max-new-tokens]")
@click.option("--chat/--no-chat", default=None,
              help="apply the bundle's chat template to the prompt [default: on when the bundle "
                   "has one]")
@click.option("--stream", is_flag=True, help="print the text as it is generated")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object (tokens, text, stats); with --stream, one JSON object "
                   "per line: {\"text\": piece} per piece, then the whole text and stats")
@device_options
@input_errors
def generate(prompt, prompt_file, bundle, max_new_tokens, temperature, top_k, top_p, min_p,
             repetition_penalty, presence_penalty, frequency_penalty, logit_bias, seed, gamma,
             no_draft, stop, chat, stream, as_json, device, draft_device, threads):
    """Generate a continuation of PROMPT (or --prompt-file, or stdin)."""
    import spec_runtime
    from spec_runtime.text import stop_strings

    text = _read_prompt(prompt, prompt_file)
    try:
        stop = list(stop_strings(list(stop)))
    except InputError as e:
        raise BadInput(f"--stop: {e}") from None
    kwargs = dict(max_new_tokens=max_new_tokens, gamma=_gamma(gamma), use_draft=not no_draft,
                  chat=chat, stop=stop,
                  **sampling_kwargs(temperature, top_k, top_p, min_p, repetition_penalty,
                                    presence_penalty, frequency_penalty, logit_bias, seed))
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device,
                            threads=threads)
    check_gamma(gen, kwargs["gamma"])
    if stream:
        pieces = gen.stream(text, **kwargs)
        try:
            for piece in pieces:
                if as_json:
                    click.echo(json.dumps({"text": piece}))
                else:
                    click.echo(piece, nl=False)
        except KeyboardInterrupt:
            if not as_json:
                click.echo()  # "interrupted" goes on a line of its own
            raise
        last = pieces.result
        if as_json:
            click.echo(json.dumps({"done": True, "text": last.text, "tokens": last.tokens,
                                   "finish_reason": last.finish_reason, "stats": last.stats}))
        else:
            click.echo()
            click.echo(stats_line(last.stats), err=True)
        return
    result = gen.generate(text, **kwargs)
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "text": result.text,
                               "stats": result.stats}))
    else:
        click.echo(result.text)
        click.echo(stats_line(result.stats), err=True)


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=MAX_NEW_TOKENS,
              show_default=True, help="longest answer, in tokens")
@sampling_options
@click.option("--system", default=None,
              help="a system message that starts the conversation [default: the chat "
                   "template's own, if any]")
@click.option("--gamma", default=None,
              help="draft length γ, 1..the bundle's max_gamma, or 'auto' [default: the bundle's]")
@click.option("--no-draft", is_flag=True, help="target-only decoding (the baseline)")
@device_options
@input_errors
def chat(bundle, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
         presence_penalty, frequency_penalty, logit_bias, seed, system, gamma, no_draft, device,
         draft_device, threads):
    """Talk with the bundle's model: a multi-turn conversation through its chat template,
    answers streamed, the speed and acceptance of each on one line. Type /reset to start
    over, /stats for the conversation's totals, /exit (or Ctrl-D) to leave; Ctrl-C stops an
    answer."""
    import spec_runtime
    from spec_runtime.apps.chat_session import ChatSession

    kwargs = dict(max_new_tokens=max_new_tokens, gamma=_gamma(gamma), use_draft=not no_draft,
                  **sampling_kwargs(temperature, top_k, top_p, min_p, repetition_penalty,
                                    presence_penalty, frequency_penalty, logit_bias, seed))
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device,
                            threads=threads)
    check_gamma(gen, kwargs["gamma"])
    session = ChatSession(gen, system=system, **kwargs)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:
        click.echo(f"specrun chat · {gen.bundle_dir} · /reset /stats /exit · Ctrl-C stops an "
                   f"answer", err=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("\n(/exit or Ctrl-D leaves)", err=True)
            continue
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            click.echo("(conversation cleared)", err=True)
            continue
        if line == "/stats":
            click.echo(session.totals_line(), err=True)
            continue
        if line.startswith("/"):
            click.echo(f"unknown command {line.split()[0]!r}: /reset, /stats or /exit", err=True)
            continue
        try:
            for note in session.fit(line):
                click.echo(f"({note})", err=True)
        except spec_runtime.InputError as e:
            click.echo(f"error: {e}", err=True)
            continue
        answer = session.answer(line)
        try:
            for piece in answer:
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            answer.close()  # keeps what was said so far in the conversation
            click.echo()
            click.echo("(answer stopped)", err=True)
            continue
        except spec_runtime.InputError as e:  # this turn cannot run; the conversation goes on
            click.echo(f"error: {e}", err=True)
            continue
        click.echo()
        click.echo(stats_line(session.last_stats), err=True)


def _gammas(value: str) -> list:
    out = []
    for part in value.split(","):
        part = part.strip()
        out.append(part if part == "auto" else _gamma(part))
    return out


class _Progress:
    """A progress bar on a terminal, a line per step elsewhere (a log, CI)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0
        self.bar = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label=label, file=sys.stderr)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, n: int = 1):
        step = max(1, self.total // 10)  # about ten lines when it is not a terminal
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done // step > before // step or self.done == self.total:
            click.echo(f"{self.label}: {self.done}/{self.total}", err=True)


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSON {kind: [prompts]} or a text file, one prompt per line [default: "
                   "built-in grounded and chat prompts]")
@click.option("--kind", type=click.Choice(["all", "grounded", "chat"]), default="all",
              show_default=True, help="which built-in prompts")
@click.option("--gamma", default=None,
              help="γ values to compare, comma-separated integers or 'auto' [default: the "
                   "bundle's γ; with --full 1,2,4,8]")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="sampling temperature, >= 0; 0 = greedy")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=MAX_NEW_TOKENS,
              show_default=True, help="new tokens per generation")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="runs per prompt and mode")
@click.option("--full", is_flag=True,
              help="the whole grid: every built-in prompt (12) and γ 1,2,4,8 (about 10 minutes "
                   "on 2 cores); without it, 3 prompts of each kind at the bundle's γ (about a "
                   "minute)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="write a PNG of speedup vs γ (needs matplotlib) [default: no plot]")
@device_options
@input_errors
def bench(bundle, prompts_file, kind, gamma, temperature, max_new_tokens, repeats, full,
          as_json, plot, device, draft_device, threads):
    """Speculative vs target-only tokens/s on the same engines, alternating, with α, c and the
    paper's predicted speedup."""
    import spec_runtime
    from spec_runtime.apps.bench import QUICK_PROMPTS, format_table, load_prompts, run_bench
    from spec_runtime.apps.bench import plot as plot_report
    from spec_runtime.sampling import SamplingParams

    SamplingParams(temperature=temperature)
    gammas = _gammas(gamma) if gamma is not None else ([1, 2, 4, 8] if full else None)
    prompts = load_prompts(prompts_file, kind if prompts_file is None else "all",
                           per_kind=None if full or prompts_file else QUICK_PROMPTS)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device,
                            threads=threads)
    gammas = gammas or [gen.default_gamma]
    for g in gammas:
        check_gamma(gen, g)  # validate every γ before minutes of measuring
    with _Progress(len(gammas) * len(prompts) * repeats, "bench") as progress:
        report = run_bench(gen, prompts, gammas, temperature=temperature,
                           max_new_tokens=max_new_tokens, repeats=repeats,
                           progress=progress.update)
    if plot:
        plot_report(report, plot)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--tokens", type=int, default=3, show_default=True,
              help="length k (>= 1) of the continuations whose joint distribution is compared")
@click.option("--samples", type=int, default=None,
              help="continuations per mode (speculative, target-only), >= 1 [default: 400]")
@click.option("--seconds", type=float, default=None,
              help="time budget; sampling stops when it is spent, and the report says what the "
                   "fewer samples can detect [default: none, all samples are drawn]")
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="the sampling setting checked: temperature, > 0")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = all tokens")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="in (0, 1]; 1 = all")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="in [0, 1]; 0 = off")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="> 0; 1 = off")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]; 0 = off")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]; 0 = off")
@click.option("--gamma", default=None,
              help="draft length γ, 1..the bundle's max_gamma, or 'auto' [default: the bundle's]")
@click.option("--seed", type=int, default=0, show_default=True,
              help="seed of the whole check (each generation gets its own, drawn from it)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@device_options
@input_errors
def check(bundle, tokens, samples, seconds, temperature, top_k, top_p, min_p, repetition_penalty,
          presence_penalty, frequency_penalty, gamma, seed, as_json, device, draft_device,
          threads):
    """Test that speculative decoding on the bundle samples from the target's distribution: a
    two-sample chi-square of speculative vs target-only continuations, and greedy parity.
    Exit 0 when consistent, 1 when the test rejects, 2 on bad input."""
    import spec_runtime
    from spec_runtime.apps.check import DEFAULT_SAMPLES, format_report, run_check
    from spec_runtime.sampling import SamplingParams

    setting = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty)
    try:
        SamplingParams(**setting)  # bad values before the bundle loads
    except InputError as e:
        raise BadInput(cli_words(str(e))) from None
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device,
                            threads=threads)
    samples = DEFAULT_SAMPLES if samples is None else samples
    with _Progress(max(samples, 1), "check") as progress:
        check_gamma(gen, _gamma(gamma))
        report = run_check(gen, tokens=tokens, samples=samples, seconds=seconds, seed=seed,
                           gamma=_gamma(gamma), progress=progress.update, **setting)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    sys.exit(report["exit_code"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def pid_file_of(path):
    """While the server runs, `path` holds its process id (for `kill $(cat PATH)`, which cannot
    reach another user's server as `pkill -f` can); removed at exit. A file that names a live
    process is refused: it is another server's."""
    if path is None:
        yield
        return
    path = Path(path)
    try:
        old = int(path.read_text().strip())
    except (OSError, ValueError):
        old = None
    if old is not None and old != os.getpid() and _alive(old):
        raise BadInput(f"--pid-file {str(path)!r} names a running process ({old}), another "
                       f"server's: stop it (kill {old}) or choose another file")
    try:
        path.write_text(f"{os.getpid()}\n")
    except OSError as e:
        raise BadInput(f"--pid-file {str(path)!r} cannot be written ({e.strerror}): choose a "
                       f"writable path") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text().strip()) == os.getpid():
                path.unlink()


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; 127.0.0.1 serves this machine only, 0.0.0.0 every "
                   "interface (then set --api-key)")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port, 0..65535 (0: any free port, printed at start)")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests decoded at once, >= 1; each slot has its own KV caches, the "
                   "weights are shared")
@click.option("--queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="requests that may wait for a slot, >= 0; beyond it the server answers 429 "
                   "with Retry-After")
@click.option("--api-key", envvar="SPECEDGE_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' on /v1/ [default: $SPECEDGE_API_KEY, "
                   "else none]")
@click.option("--model-name", default=None,
              help="the name clients send as `model` [default: the target's file or "
                   "repository name]")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="on SIGTERM or Ctrl-C, how long requests in flight may finish before they "
                   "are cancelled (each gets an error), >= 0")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="the server's log level (not Ray's)")
@click.option("--pid-file", type=click.Path(dir_okay=False), default=None,
              help="write the server's process id to this file while it runs (removed at "
                   "exit), to stop it with `kill $(cat FILE)` [default: none; the id is printed "
                   "at start]")
@click.option("--ray", "use_ray", is_flag=True,
              help="serve as a Ray Serve application: --replicas copies, each with --slots "
                   "(needs the ray extra: pip install \"specedge[ray]\", or pip install -e "
                   "\".[ray]\" in a checkout) [default: one process]")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="with --ray: replicas of the server, >= 1, each one device's worth of slots "
                   "[default: 1]")
@click.option("--ray-address", default=None,
              help="with --ray: the Ray cluster to join, 'auto' (the one `ray start` runs "
                   "here) or HEAD:PORT [default: a Ray instance of its own on this machine]")
@device_options
@input_errors
def serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
          pid_file, use_ray, replicas, ray_address, device, draft_device, threads):
    """Serve the bundle over the OpenAI HTTP API: POST /v1/completions and
    /v1/chat/completions (streaming as server-sent events), GET /v1/models, /health and
    /metrics (Prometheus). Needs the serve extra: pip install "specedge[serve]", or
    pip install -e ".[serve]" in a checkout."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise BadInput(f"specrun serve needs {e.name}: {install_extra('serve')}") from None
    if not use_ray:
        for name, value in (("--replicas", replicas), ("--ray-address", ray_address)):
            if value is not None:
                raise BadInput(f"{name} {value} needs --ray: add --ray to serve through Ray "
                               f"Serve")
    elif threads is not None:
        raise BadInput(f"--threads {threads} applies to one server process; with --ray each "
                       f"replica takes its own machine's cores: leave --threads out")
    with pid_file_of(pid_file):
        _serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
               use_ray, replicas, ray_address, device, draft_device, threads)


def _serve(bundle, host, port, slots, queue, api_key, model_name, drain_seconds, log_level,
           use_ray, replicas, ray_address, device, draft_device, threads):
    pid = os.getpid()
    if use_ray:
        from spec_runtime.apps.ray_serve import run as run_ray  # imports ray itself, when it runs

        def ready_ray(info):
            n = info["replicas"]
            click.echo(f"serving {info['model_name']} on {info['url']} through Ray Serve (pid "
                       f"{pid}, {n} replica{'s' if n > 1 else ''} × {slots} "
                       f"slot{'s' if slots > 1 else ''})", err=True)

        with library_messages("spec_runtime", "specrun"):
            run_ray(bundle, replicas=replicas or 1, slots=slots, queue=queue, host=host,
                    port=port, api_key=api_key, model_name=model_name, device=device,
                    draft_device=draft_device, drain_seconds=drain_seconds,
                    ray_address=ray_address, on_ready=ready_ray)
        return
    from spec_runtime.apps.run_server import run_uvicorn
    from spec_runtime.apps.server import create_app

    app = create_app(bundle, slots=slots, queue=queue, api_key=api_key, device=device,
                     draft_device=draft_device, model_name=model_name,
                     drain_seconds=drain_seconds, threads=threads)

    def ready(server):
        for s in server.servers:
            for sock in s.sockets:
                address, bound = sock.getsockname()[:2]
                click.echo(f"serving {app.state.model_name} on http://{address}:{bound}/v1 "
                           f"(pid {pid}, {slots} slot{'s' if slots > 1 else ''}, queue {queue})",
                           err=True)

    with library_messages("spec_runtime", "specrun"):
        run_uvicorn(app, host, port, drain_seconds=drain_seconds, log_level=log_level,
                    on_ready=ready)


@main.command(name="list")
@click.argument("dirs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the list as JSON")
@input_errors
def list_bundles(dirs, as_json):
    """List the bundles on this machine: the default one ($SPECEDGE_BUNDLE, else `specrun
    where`) and the others beside it, or those in DIRS (bundles, or folders holding them), with
    their target, precision, draft, cache length and size. Reads manifests only."""
    from spec_runtime.apps.listing import find_bundles, format_bundles

    rows = find_bundles(dirs)
    click.echo(json.dumps(rows, indent=2) if as_json else format_bundles(rows))


@main.command()
def where():
    """Print the default bundle directory."""
    from spec_runtime.bundle import default_bundle_dir

    click.echo(default_bundle_dir())


if __name__ == "__main__":
    main()
