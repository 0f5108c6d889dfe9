"""The options `specrun` commands share, each declared once, and the request they make.

A command takes an option by its decorator (`@gamma_option()`, `@sampling_options()`...);
`generation_options` turns a command's request options into the one GenerationOptions its
request is made from, checked before the bundle loads and refused in the command line's words
("--top-p 2.0 is invalid", not "top_p=2.0": FLAGS maps each field to its option).
"""

from __future__ import annotations

import math
import sys

import click

from spec_runtime.request import MAX_NEW_TOKENS

from .common import BadInput


def bundle_option(fn):
    """-b/--bundle, the same for every command that reads a bundle."""
    return click.option("-b", "--bundle", type=click.Path(), default=None,
                        help="bundle directory [default: $DRAFTPROOF_BUNDLE, else where "
                             "`specexport build` writes without --out: see `specrun where`]")(fn)


class Threads(click.ParamType):
    """--threads: 1 .. the logical CPUs this process may run on (spec_runtime.limits), refused
    in one line naming the bound."""

    name = "integer"

    def convert(self, value, param, ctx):
        from spec_runtime.limits import check_threads

        try:
            value = int(value)
        except ValueError:
            raise BadInput(f"--threads {value!r} is invalid: use an integer >= 1") from None
        return in_cli_words(check_threads, value)


class FiniteFloat(click.ParamType):
    """A number option that must be finite (click's FLOAT and FloatRange take nan and inf)
    and at least `low` (above it, with `open_low`), refused in one line naming the option."""

    name = "float"

    def __init__(self, low: float, open_low: bool = False):
        self.low, self.open_low = low, open_low

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        above = number > self.low if self.open_low else number >= self.low
        if math.isfinite(number) and above:
            return number
        name = param.opts[0] if param is not None else "the value"
        raise BadInput(f"{name} {value} is invalid: use a finite number "
                       f"{'>' if self.open_low else '>='} {self.low:g}")


def device_options(fn):
    """--device, --draft-device and --threads, shared by the commands that load a bundle."""
    from spec_runtime.engines.devices import DEVICES

    devices = click.Choice(sorted(DEVICES))
    fn = click.option("--threads", type=Threads(), default=None,
                      help="CPU threads of each ONNX Runtime session, 1..the logical CPUs this "
                           "process may run on (llama.cpp's -t) [default: the physical cores "
                           "this process may run on]")(fn)
    fn = click.option("--draft-device", type=devices, default=None,
                      help="where a model draft runs [default: --device], e.g. an int4 draft on "
                           "cpu beside an fp16 target on cuda")(fn)
    return click.option("--device", type=devices, default="cpu", show_default=True,
                        help="where the target runs: cpu (ONNX Runtime's CPU provider), cuda or "
                             "tensorrt (ONNX Runtime's CUDA or TensorRT provider, which need "
                             "onnxruntime-gpu; tensorrt also runs engines built by "
                             "`specexport engine`)")(fn)


def max_new_tokens_option(help: str = "stop after this many new tokens (or at EOS)"):
    return click.option("--max-new-tokens", type=click.IntRange(min=1), default=MAX_NEW_TOKENS,
                        show_default=True, help=help)


def gamma_option(many: bool = False):
    """--gamma: the draft length of the command's requests; with `many` (bench), the values to
    compare."""
    if many:
        return click.option("--gamma", default=None,
                            help="γ values to compare, comma-separated integers or 'auto' "
                                 "[default: the bundle's γ; with --full 1,2,4,8]")
    return click.option("--gamma", default=None,
                        help="draft length γ, 1..the bundle's max_gamma, or 'auto' (re-chosen "
                             "every round from the measured acceptance and costs; greedy: a "
                             "model draft ends each round where its confidence falls) "
                             "[default: the bundle's]")


def no_draft_option(fn):
    return click.option("--no-draft", is_flag=True,
                        help="target-only decoding (the baseline)")(fn)


def json_option(help: str):
    return click.option("--json", "as_json", is_flag=True, help=help)


def sampling_options(setting: dict | None = None, helps: dict | None = None):
    """The sampling controls, one option each, made from their declaration
    (spec_runtime.decode.sampling.SAMPLING_FIELDS). Without `setting` each defaults to the bundle's
    generation default (the model's generation_config) where one may set it, else off
    (generate, chat); with it, only the options in it (by field name), defaulting to its
    values, shown in the help (check: the setting checked; bench: the temperature). `helps`
    replaces an option's help (by field name) where the command gives it another sense."""
    from spec_runtime.decode.sampling import SAMPLING_FIELDS

    def decorate(fn):
        options = []
        for f in SAMPLING_FIELDS:
            m = f.metadata
            if setting is not None and f.name not in setting:
                continue
            what = (helps or {}).get(f.name, m["cli"])
            if setting is not None:
                options.append(click.option(FLAGS[f.name], type=type(f.default),
                                            default=setting[f.name], show_default=True,
                                            help=what))
            elif f.name == "logit_bias":
                options.append(click.option(FLAGS[f.name], multiple=True, metavar="ID=BIAS",
                                            help=what))
            else:
                default = f"[default: the bundle's, else {m['off']}]" if m["bundle"] else \
                    f"[default: {m['off']}]"
                kind = int if f.name == "seed" else type(f.default)
                options.append(click.option(FLAGS[f.name], type=kind, default=None,
                                            help=f"{what} {default}"))
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def structured_options(fn):
    """--system, --json-object and --json-schema: what a prompt says besides its text, and the
    form of the answer (OpenAI's response_format, enforced by the grammar engine)."""
    fn = click.option("--json-schema", "json_schema", default=None, metavar="SCHEMA",
                      help="answer with JSON that this JSON Schema accepts: the schema inline "
                           "({...}) or a file holding it (llama.cpp's -j; OpenAI's "
                           "response_format json_schema) [default: any text]")(fn)
    fn = click.option("--json-object", is_flag=True,
                      help="answer with one JSON object (OpenAI's JSON mode) [default: any "
                           "text]")(fn)
    return click.option("--system", default=None,
                        help="a system message before the prompt, which then goes through the "
                             "chat template as the user's message [default: none, the chat "
                             "template's own if it has one]")(fn)


def response_format_of(json_object: bool, json_schema: str | None) -> dict | None:
    """--json-object / --json-schema as OpenAI's response_format, its schema checked now,
    before the bundle loads."""
    import json

    from spec_runtime.decode.constraint import grammar_of
    from spec_runtime.errors import InputError

    if json_object and json_schema is not None:
        raise BadInput("--json-object asks for any JSON object and --json-schema for one a "
                       "schema accepts: give one of them")
    if json_schema is None:
        return {"type": "json_object"} if json_object else None
    text, where = json_schema, "--json-schema"
    if not json_schema.lstrip().startswith(("{", "[")):
        where = f"--json-schema {json_schema!r}"
        try:
            with open(json_schema, encoding="utf-8") as f:
                text = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or "not UTF-8 text"
            raise BadInput(f"{where} cannot be read ({why}): give a JSON Schema inline, "
                           f"{{...}}, or a file holding one") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise BadInput(f"{where} is not JSON ({e}): give a JSON Schema object") from None
    if not isinstance(schema, dict):
        raise BadInput(f"{where} is not a JSON object: a JSON Schema is one ({{\"type\": ...}})")
    response_format = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    try:
        grammar_of(response_format)
    except InputError as e:
        raise BadInput(f"{where}: {e}") from None
    return response_format


def with_system(text: str, system: str | None, chat: bool | None):
    """The prompt with --system before it: the two as messages (through the chat template)."""
    if system is None:
        return text
    if chat is False:
        raise BadInput("--system is a message of a conversation, which --no-chat leaves out: "
                       "drop one of them")
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def parse_gammas(value: str) -> list:
    """bench's --gamma: comma-separated γ values (gamma.parse_gamma each; their range is the
    bundle's, checked when it is loaded)."""
    from spec_runtime.decode.gamma import parse_gamma

    return [in_cli_words(parse_gamma, part.strip()) for part in value.split(",")]


def parse_logit_bias(values) -> dict | None:
    out = {}
    for v in values:
        tok, sep, bias = v.partition("=")
        shown = repr(v) if len(v) <= 80 else repr(v[:60]) + f"... ({len(v)} characters)"
        try:
            # digits stay a string: SamplingParams reads an id past any vocabulary without
            # int(), which refuses more than 4,300 digits
            key = tok if tok.isascii() and tok.isdigit() else int(tok)
            out[key] = float(bias)
        except ValueError:
            raise BadInput(f"--logit-bias {shown} is invalid: use TOKEN_ID=BIAS, e.g. "
                           f"--logit-bias 2=-100 to ban token 2") from None
        if not sep:
            raise BadInput(f"--logit-bias {shown} is invalid: use TOKEN_ID=BIAS")
    return out or None


def generation_options(*, no_draft: bool = False, logit_bias=(), stop=(), **values):
    """The GenerationOptions of a command's request options (click's parameter names: the
    fields', with --no-draft and --logit-bias ID=BIAS as typed), made and checked once, now,
    before the bundle loads; BadInput in the command line's words."""
    from spec_runtime.request import GenerationOptions

    return in_cli_words(GenerationOptions, use_draft=not no_draft,
                        logit_bias=parse_logit_bias(logit_bias), stop=tuple(stop), **values)


def in_cli_words(fn, *args, **kwargs):
    """fn(*args, **kwargs), a FieldError about a request's value (made, or bound to the
    bundle: γ's range, a logit_bias id against its vocabulary) in the command line's words:
    the option that sets the field (FLAGS) where the library says the field's name."""
    from spec_runtime.errors import FieldError

    from spec_runtime.decode.sampling import cli_flag

    try:
        return fn(*args, **kwargs)
    except FieldError as e:
        # a field without an option of its own (a build option's) is the flag of its name
        raise BadInput(e.in_words(FLAGS.get(e.field, cli_flag(e.field)),
                                  words=lambda name: FLAGS.get(name, cli_flag(name)))) from None


def _flags() -> dict:
    from spec_runtime.request import OPTION_NAMES
    from spec_runtime.decode.sampling import cli_flag

    return {**{name: cli_flag(name) for name in OPTION_NAMES}, "use_draft": "--no-draft",
            "response_format": "--json-schema",
            **{name: cli_flag(name) for name in ("threads", "slots", "host", "port", "language",
                                                 "task")}}


# a request field (GenerationOptions') -> the option that sets it: the field's name with dashes,
# but use_draft, which --no-draft turns off, and response_format, which --json-schema sets; and
# the load's, the server's and a transcription's values
FLAGS = _flags()


def read_prompt(prompt, prompt_file, bundle):
    """The prompt: the argument, else --prompt-file, else stdin; a file or stdin is read up to
    what the bundle's cache can use (spec_runtime.limits.read_prompt), never to its end. An
    empty one is refused now, before the bundle loads."""
    from spec_runtime.text import EMPTY_PROMPT

    text = _read_prompt(prompt, prompt_file, bundle)
    if text == "":
        raise BadInput(EMPTY_PROMPT)
    return text


def _read_prompt(prompt, prompt_file, bundle):
    if prompt is not None and prompt_file is not None:
        raise BadInput("give the prompt as an argument or --prompt-file, not both")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogates)
            raise BadInput("the prompt argument is not UTF-8 text: convert it, or pass it "
                           "with --prompt-file") from None
        return prompt
    if prompt_file is None and (sys.stdin is None or sys.stdin.isatty()):
        raise BadInput("no prompt: give it as an argument, --prompt-file, or on stdin")
    from spec_runtime.bundle.reader import read_bundle_manifest
    from spec_runtime.limits import read_prompt as read_bounded_prompt

    manifest = read_bundle_manifest(bundle)
    if prompt_file is None:
        return read_bounded_prompt(sys.stdin.buffer, "stdin", manifest)
    source = f"--prompt-file {prompt_file!r}"
    try:
        with click.open_file(prompt_file, "rb") as f:  # "-": stdin, left open
            return read_bounded_prompt(f, source, manifest)
    except OSError as e:
        raise BadInput(f"{source} cannot be read ({e.strerror}): give a readable file") from None
