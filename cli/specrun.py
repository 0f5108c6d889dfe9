"""specrun: run exact speculative decoding on a draftproof bundle.

Each command makes its request once: options.generation_options makes the GenerationOptions
(each value checked once) before the bundle loads, Generator.request binds them to the bundle
and the prompt; `serve` lives in
serve.py, the options every command shares in options.py."""

from __future__ import annotations

import json
import sys

import click

from .common import BadInput, BundleCommand, Progress, input_errors
from .options import (FiniteFloat, bundle_option, device_options, gamma_option,
                      generation_options, in_cli_words, json_option, max_new_tokens_option,
                      no_draft_option, parse_gammas, read_prompt, response_format_of,
                      sampling_options, structured_options, with_system)
from .serve import serve
from .tokens import tokenize



def stats_line(stats) -> str:
    """A generation's statistics (decode.stats.GenerationStats) in one line."""
    s = (f"{stats.new_tokens} tokens ({stats.finish_reason}) · "
         f"{stats.tokens_per_s:.1f} tok/s · {stats.tokens_per_target_call:.2f} tokens/target call")
    if stats.mode == "speculative":
        s += (f" · α {stats.alpha:.2f} · accepted {stats.accepted}/{stats.proposed}"
              f" · draft {stats.draft_kind}")
    else:
        s += " · target-only"
    return s


@click.group(invoke_without_command=True)
@click.version_option(package_name="draftproof", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx):
    """Generate with exact speculative decoding from a draftproof bundle: `specrun generate
    "PROMPT"`, `specrun chat`, `specrun bench`, `specrun check`. Every command reads the bundle
    that `specexport build` wrote, or the one -b/--bundle names."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              default=None, help="read the prompt from this UTF-8 file ('-' = stdin) [default: "
                                 "the PROMPT argument, else stdin]")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, allow_dash=True),
              default=None,
              help="generate for every line of this file ('-' = stdin): a prompt a line, or a "
                   "JSON object {\"prompt\": ..., and options of its own}; prints one JSON line "
                   "a result, with its line number, as each ends (decoded together where the "
                   "bundle was built with --max-batch) [default: one prompt]")
@bundle_option
@max_new_tokens_option()
@sampling_options()
@gamma_option()
@no_draft_option
@click.option("--stop", multiple=True, metavar="TEXT",
              help="end the answer where this text appears, cut before it (finish_reason "
                   "\"stop\"); repeatable [default: none, only EOS and --max-new-tokens]")
@click.option("--chat/--no-chat", default=None,
              help="apply the bundle's chat template to the prompt [default: on when the bundle "
                   "has one]")
@structured_options
@click.option("--stream", is_flag=True, help="print the text as it is generated")
@json_option("print one JSON object (tokens, text, stats); with --stream, one JSON object per "
             "line: {\"text\": piece} per piece, then the whole text and stats")
@device_options
@input_errors
def generate(prompt, prompt_file, prompts_file, bundle, stream, as_json, device, draft_device,
             threads, system, json_object, json_schema, **request):
    """Generate a continuation of PROMPT (or --prompt-file, or stdin), or of every prompt of
    --prompts FILE."""
    import spec_runtime

    options = generation_options(**request,
                                 response_format=response_format_of(json_object, json_schema))
    if prompts_file is not None:
        if system is not None:
            raise BadInput("--system goes with one prompt; --prompts lines are prompts of "
                           "their own: put the system message in each line's text")
        return generate_many(prompts_file, prompt, prompt_file, stream, options, bundle,
                             device=device, draft_device=draft_device, threads=threads)
    text = with_system(read_prompt(prompt, prompt_file, bundle), system, options.chat)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device, threads=threads)
    req = in_cli_words(gen.request, text, options)
    if not stream:
        result = gen.generate(req)
        if as_json:
            click.echo(json.dumps({"tokens": result.tokens, "text": result.text,
                                   "finish_reason": result.finish_reason,
                                   "stats": result.stats.to_json()}))
        else:
            click.echo(result.text)
            click.echo(stats_line(result.stats), err=True)
        return
    pieces = gen.stream(req)
    try:
        for piece in pieces:
            click.echo(json.dumps({"text": piece}) if as_json else piece, nl=as_json)
    except KeyboardInterrupt:
        if not as_json:
            click.echo()  # "interrupted" goes on a line of its own
        raise
    last = pieces.result
    if as_json:
        click.echo(json.dumps({"done": True, "text": last.text, "tokens": last.tokens,
                               "finish_reason": last.finish_reason, "stats": last.stats.to_json()}))
    else:
        click.echo()
        click.echo(stats_line(last.stats), err=True)


def generate_many(prompts_file, prompt, prompt_file, stream, options, bundle, **load):
    """generate --prompts: every line's request made, and checked, before the first is
    decoded; a result a JSON line as each ends."""
    import spec_runtime

    from .prompts import read_prompts, result_line

    if prompt is not None or prompt_file is not None or stream:
        raise BadInput("--prompts reads every prompt from its file: leave out the PROMPT "
                       "argument, --prompt-file and --stream")
    lines = read_prompts(prompts_file, options)
    gen = spec_runtime.load(bundle, **load)
    requests = []
    from spec_runtime.errors import InputError

    for number, text, line_options in lines:
        try:
            requests.append(in_cli_words(gen.request, text, line_options))
        except (BadInput, InputError) as e:
            message = e.message if isinstance(e, BadInput) else str(e)
            raise BadInput(f"--prompts {prompts_file!r} line {number}: {message}") from None
    failed = []
    for piece in gen.batch(requests):
        click.echo(result_line(lines[piece.index][0], piece))
        if piece.error is not None:
            failed.append(lines[piece.index][0])
    if failed:  # each failed on its own (its line says why); the others were decoded
        raise BadInput(f"--prompts {prompts_file!r}: the request of line {failed[0]} failed"
                       + (f", and {len(failed) - 1} more" if len(failed) > 1 else "")
                       + ": its JSON line says why")


@main.command()
@click.argument("audio", type=click.Path(dir_okay=False, allow_dash=False))
@bundle_option
@click.option("--language", default=None, metavar="CODE",
              help="the spoken language, a code such as en or fr [default: detected, as "
                   "Whisper does, from the first decoder row]")
@click.option("--task", type=click.Choice(["transcribe", "translate"]), default="transcribe",
              show_default=True, help="transcribe, or translate into English")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="stop after this many new tokens (or at EOS) [default: what transformers' "
                   "Whisper generate allows: the decoder's length (448) less the prompt, or "
                   "what the bundle's cache holds]")
@click.option("--timestamps", is_flag=True,
              help="segments with their start and end (Whisper's timestamp tokens); always on "
                   "for a recording longer than one window, and for --format json, srt, vtt")
@click.option("--format", "fmt", type=click.Choice(["txt", "json", "srt", "vtt"]),
              default="txt", show_default=True,
              help="the transcript as text, JSON with segments, or subtitles")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default=None,
              help="write the transcript to this file [default: standard output]")
@click.option("--condition-on-previous-text/--no-condition-on-previous-text", default=False,
              show_default=True,
              help="with timestamps: each window's prompt holds the text before it (openai-"
                   "whisper's default; off as in transformers: it can make Whisper repeat "
                   "itself)")
@click.option("--fallback/--no-fallback", default=True, show_default=True,
              help="with timestamps: a window that fails a threshold is decoded again at "
                   "temperatures 0.2 higher, up to 1.0 (sampled, seeded by --seed)")
@click.option("--compression-ratio-threshold", type=float, default=2.4, show_default=True,
              help="with timestamps: a window whose tokens compress more than this (a "
                   "repeating transcript) fails")
@click.option("--logprob-threshold", type=float, default=-1.0, show_default=True,
              help="with timestamps: a window whose tokens' average log-probability is below "
                   "this fails")
@click.option("--no-speech-threshold", type=float, default=0.6, show_default=True,
              help="with timestamps: a window whose no-speech probability is above this, and "
                   "that fails --logprob-threshold, is silence: skipped")
@click.option("--vad", is_flag=True,
              help="with timestamps: transcribe only the speech Silero VAD finds (silences of "
                   "2 s or more left out), as faster-whisper's vad_filter does")
@sampling_options()
@gamma_option()
@no_draft_option
@json_option("print one JSON object (tokens, text, language, stats; with timestamps, the "
             "segments)")
@device_options
@input_errors
def transcribe(audio, bundle, language, task, max_new_tokens, timestamps, fmt, output,
               condition_on_previous_text, fallback, compression_ratio_threshold,
               logprob_threshold, no_speech_threshold, vad, as_json, device, draft_device,
               threads, **request):
    """Transcribe AUDIO (a WAV file of any length; FLAC and others where soundfile is
    installed) with a speech bundle: greedy by default, speculative with the bundle's draft,
    exactly the target's transcript. A recording longer than one window (30 s for Whisper) is
    transcribed window after window, as Whisper's long-form transcription does."""
    import spec_runtime
    from spec_runtime.speech import transcript_tokens

    # checked now, before the load; without --max-new-tokens the bundle's room sets it below
    given = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    options = generation_options(**given, **request)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device, threads=threads)
    # a model without timestamp tokens transcribes one window: a longer one is refused below
    if gen.audio is not None and (timestamps or vad or fmt != "txt" or (
            gen.audio.timestamps is not None and _longer_than_a_window(gen, audio))):
        from spec_runtime.longform import LongForm

        first = options.temperature or 0.0
        temps = tuple(t / 10 for t in range(round(first * 10), 11, 2)) \
            if fallback and first <= 1.0 else (first,)
        form = in_cli_words(LongForm, condition_on_previous_text, temps,
                            compression_ratio_threshold, logprob_threshold,
                            no_speech_threshold)
        return _transcribe_long(gen, audio, options, max_new_tokens, language, task, form,
                                "json" if as_json else fmt, output, vad)
    if max_new_tokens is None:  # Whisper's default, where the cache holds it
        from dataclasses import replace

        options = replace(options, max_new_tokens=transcript_tokens(gen, options.use_draft))
    req = in_cli_words(gen.transcription, audio, options, language=language, task=task)
    result = gen.generate(req)
    lang = result.language
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "text": result.text, "language": lang,
                               "stats": result.stats.to_json()}))
    else:
        click.echo(result.text.strip())
        click.echo(stats_line(result.stats), err=True)


def _transcribe_long(gen, audio, options, max_new_tokens, language, task, form, fmt, output,
                     vad: bool):
    """`specrun transcribe` with timestamps: longform.transcribe, written as `fmt`."""
    from dataclasses import replace

    from spec_runtime import longform

    options = replace(options, max_new_tokens=max_new_tokens or gen.capacity(options.use_draft))
    from spec_runtime.vad import VadOptions

    result = in_cli_words(longform.transcribe, gen, audio, options, language=language,
                          task=task, longform=form, vad=VadOptions() if vad else None)
    text = longform.render(result, fmt)
    if output is not None:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        click.echo(text, nl=False)
    st = result.stats
    click.echo(f"{len(result.segments)} segments · {st.windows} windows "
               f"({st.windows_skipped} silent, {st.fallbacks} fallbacks) · "
               f"{st.new_tokens} tokens · {st.real_time_factor:.3f}x real time · "
               f"{st.tokens_per_target_call:.2f} tokens/target call", err=True)


def _longer_than_a_window(gen, audio) -> bool:
    from spec_runtime.audio import HOP_LENGTH, SAMPLE_RATE, audio_seconds

    return audio_seconds(audio) > 2 * gen.target.max_source_len * HOP_LENGTH / SAMPLE_RATE


@main.command(cls=BundleCommand)
@bundle_option
@max_new_tokens_option("longest answer, in tokens")
@sampling_options()
@click.option("--system", default=None,
              help="a system message that starts the conversation [default: the chat "
                   "template's own, if any]")
@gamma_option()
@no_draft_option
@device_options
@input_errors
def chat(bundle, system, device, draft_device, threads, **request):
    """Talk with the bundle's model: a multi-turn conversation through its chat template,
    answers streamed, the speed and acceptance of each on one line. Type /reset to start
    over, /stats for the conversation's totals, /exit (or Ctrl-D) to leave; Ctrl-C stops an
    answer."""
    import spec_runtime
    from spec_runtime.apps.chat_session import ChatSession
    from spec_runtime.limits import read_prompt_line

    options = generation_options(**request)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device, threads=threads)
    in_cli_words(gen.check_gamma, options.gamma)  # before the first turn: each makes a request
    session = ChatSession(gen, system=system, options=options)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:
        click.echo(f"specrun chat · {gen.bundle_dir} · /reset /stats /exit · Ctrl-C stops an "
                   f"answer", err=True)
    lines = 0
    while True:
        try:
            if interactive:  # a terminal's line is bounded by the terminal
                line = input("> ")
            else:
                lines += 1
                line = read_prompt_line(sys.stdin.buffer, f"stdin line {lines}",
                                        gen.manifest) if sys.stdin is not None else None
                if line is None:
                    break
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


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSON {kind: [prompts]} or a text file, one prompt per line [default: "
                   "built-in grounded and chat prompts]")
@click.option("--kind", default="all", show_default=True,
              help="which prompts: all, or one kind (the built-in grounded or chat, or a key "
                   "of the --prompts file, e.g. code)")
@gamma_option(many=True)
@sampling_options({"temperature": 0.0})
@max_new_tokens_option("new tokens per generation")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="runs per prompt and mode")
@click.option("--full", is_flag=True,
              help="the whole grid: every built-in prompt (12) and γ 1,2,4,8 (about 10 minutes "
                   "on 2 cores); without it, 3 prompts of each kind at the bundle's γ (about a "
                   "minute)")
@click.option("--audio", "audio_files", multiple=True, type=click.Path(dir_okay=False),
              help="a speech bundle's input: an audio file to transcribe (repeat the option for "
                   "more); its language is detected once, before measuring")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests in flight at once: every prompt --repeats times, N at a time "
                   "(batched in one call where the bundle was built with --max-batch), total "
                   "tokens/s and ms per token by mode")
@json_option("print the report as JSON")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="write a PNG of speedup vs γ (needs matplotlib) [default: no plot]")
@device_options
@input_errors
def bench(bundle, prompts_file, kind, gamma, temperature, max_new_tokens, repeats, full,
          audio_files, concurrency, as_json, plot, device, draft_device, threads):
    """Speculative vs target-only tokens/s on the same engines, alternating, with α, c and the
    paper's predicted speedup."""
    import spec_runtime
    from spec_runtime.apps.bench import QUICK_PROMPTS, format_table, load_prompts, run_bench
    from spec_runtime.apps.bench import plot as plot_report

    options = generation_options(temperature=temperature, max_new_tokens=max_new_tokens)
    gammas = parse_gammas(gamma) if gamma is not None else ([1, 2, 4, 8] if full else None)
    if audio_files and prompts_file:
        raise BadInput("give --audio (a speech bundle's inputs) or --prompts (a text "
                       "bundle's), not both")
    if not audio_files:
        prompts = load_prompts(prompts_file, kind,
                               per_kind=None if full or prompts_file else QUICK_PROMPTS)
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device, threads=threads)
    if gen.audio is not None and not audio_files:
        raise BadInput("this bundle is a speech model: benchmark it on audio, with --audio "
                       "FILE.wav (repeat it for more files)")
    if audio_files:
        if gen.audio is None:
            raise BadInput("--audio is a speech bundle's input, and this bundle is a text "
                           "model: leave --audio out (it measures --prompts)")
        from spec_runtime.apps.bench import speech_prompts

        prompts = speech_prompts(gen, audio_files)
    gammas = gammas or [gen.default_gamma]
    for g in gammas:
        in_cli_words(gen.check_gamma, g)  # every γ before minutes of measuring
    if concurrency > 1:
        from spec_runtime.apps.bench import format_concurrent, run_concurrent

        if audio_files or plot:
            raise BadInput("--concurrency measures text requests in flight together: leave "
                           "out --audio and --plot")
        with Progress(len(gammas) * 2 * len(prompts) * repeats, "bench") as progress:
            report = run_concurrent(gen, prompts, gammas, options, concurrency,
                                    repeats=repeats, progress=progress.update)
        click.echo(json.dumps(report, indent=2) if as_json else format_concurrent(report))
        return
    with Progress(len(gammas) * len(prompts) * repeats, "bench") as progress:
        report = run_bench(gen, prompts, gammas, options, repeats=repeats,
                           progress=progress.update)
    if plot:
        plot_report(report, plot)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


def _check_setting() -> dict:
    from spec_runtime.decode.sampling import SAMPLING_FIELDS

    return {**{f.name: f.default for f in SAMPLING_FIELDS if f.name not in ("seed", "logit_bias")},
            "temperature": 1.0}


# the setting `specrun check` samples at, unless told otherwise: every control off, at
# temperature 1
CHECK_SETTING = _check_setting()


@main.command(cls=BundleCommand)
@bundle_option
@click.option("--tokens", type=int, default=3, show_default=True,
              help="length k (>= 1) of the continuations whose joint distribution is compared")
@click.option("--samples", type=int, default=None,
              help="continuations per mode (speculative, target-only), >= 1 [default: 400]")
@click.option("--seconds", type=FiniteFloat(0, open_low=True), default=None,
              help="time budget; sampling stops when it is spent, and the report says what the "
                   "fewer samples can detect [default: none, all samples are drawn]")
@sampling_options(CHECK_SETTING, {"temperature": "the sampling setting checked: temperature, "
                                                  "> 0 (greedy is the parity test's)"})
@gamma_option()
@click.option("--seed", type=int, default=0, show_default=True,
              help="seed of the whole check (each generation gets its own, drawn from it)")
@click.option("--audio", "audio_files", multiple=True, type=click.Path(dir_okay=False),
              help="a speech bundle's input (repeat for more) [default: built-in tones and "
                   "noise: the verdict does not depend on what is said]")
@json_option("print the report as JSON")
@device_options
@input_errors
def check(bundle, tokens, samples, seconds, gamma, seed, audio_files, as_json, device,
          draft_device, threads, **setting):
    """Test that speculative decoding on the bundle samples from the target's distribution: a
    two-sample chi-square of speculative vs target-only continuations, and greedy parity.
    Exit 0 when consistent, 1 when the test rejects, 2 on bad input."""
    import spec_runtime
    from spec_runtime.apps.check import DEFAULT_SAMPLES, format_report, run_check

    options = generation_options(gamma=gamma, **setting)  # bad values before the bundle loads
    gen = spec_runtime.load(bundle, device=device, draft_device=draft_device, threads=threads)
    samples = DEFAULT_SAMPLES if samples is None else samples
    with Progress(max(samples, 1), "check") as progress:
        report = in_cli_words(run_check, gen, options, tokens=tokens, samples=samples,
                              seconds=seconds, seed=seed, audio=audio_files,
                              progress=progress.update)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    sys.exit(report["exit_code"])


@main.command(name="list")
@click.argument("dirs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the list as JSON")
@input_errors
def list_bundles(dirs, as_json):
    """List the bundles on this machine: the default one ($DRAFTPROOF_BUNDLE, else `specrun
    where`) and the others beside it, or those in DIRS (bundles, or folders holding them), with
    their target, precision, draft, cache length and size. Reads manifests only."""
    from spec_runtime.apps.listing import find_bundles, format_bundles

    rows = find_bundles(dirs)
    click.echo(json.dumps(rows, indent=2) if as_json else format_bundles(rows))


@main.command()
@input_errors
def where():
    """Print the default bundle directory."""
    from spec_runtime.bundle.reader import default_bundle_dir

    click.echo(default_bundle_dir())


main.add_command(serve)
main.add_command(tokenize)

if __name__ == "__main__":
    main()
