"""The options `specrun` commands share, each declared once, and the request they make.

A command takes an option by its decorator (`@gamma_option()`, `@sampling_options()`...);
`generation_options` turns a command's request options into the one GenerationOptions its
request is made from, checked before the bundle loads and refused in the command line's words
("--top-p 2.0 is invalid", not "top_p=2.0").
"""

from __future__ import annotations

import math
import re
import sys

import click

from spec_runtime.errors import InputError
from spec_runtime.request import MAX_NEW_TOKENS

from .common import BadInput


def bundle_option(fn):
    """-b/--bundle, the same for every command that reads a bundle."""
    return click.option("-b", "--bundle", type=click.Path(), default=None,
                        help="bundle directory [default: $SPECEDGE_BUNDLE, else where "
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
    from spec_runtime.devices import DEVICES

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


# the sampling controls: (option, type, what it does, its value when off; whether the bundle's
# generation_config may set it)
SAMPLING = [
    ("--temperature", float, "sampling temperature, >= 0; 0 = greedy", "0 = greedy", True),
    ("--top-k", int, "keep the k most likely tokens, >= 0; 0 = all", "0", True),
    ("--top-p", float, "keep the most likely tokens up to this probability mass, in (0, 1]",
     "1 = all", True),
    ("--min-p", float, "drop tokens less likely than min-p × the most likely one, in [0, 1]",
     "0 = off", True),
    ("--repetition-penalty", float, "divide the logits of tokens already in the context "
     "(prompt included), > 0; 1.1-1.3 curbs loops", "1 = off", True),
    ("--presence-penalty", float, "subtract from the logit of every token generated so far, "
     "in [-2, 2]", "0 = off", False),
    ("--frequency-penalty", float, "subtract this × how often a token was generated so far, "
     "in [-2, 2]", "0 = off", False),
]


def sampling_options(setting: dict | None = None, helps: dict | None = None):
    """The sampling controls. Without `setting` each defaults to the bundle's generation
    default (the model's generation_config), else off, and --logit-bias and --seed come with
    them (generate, chat); with it, the options in it (by parameter name) default to its
    values, shown in the help (check: the setting checked; bench: the temperature). `helps`
    replaces an option's help (by parameter name) where the command gives it another sense."""
    def decorate(fn):
        options = []
        for opt, kind, what, off, bundle in SAMPLING:
            name = opt[2:].replace("-", "_")
            if setting is not None and name not in setting:
                continue
            what = (helps or {}).get(name, what)
            if setting is not None:
                options.append(click.option(opt, type=kind, default=setting[name],
                                            show_default=True, help=what))
                continue
            default = f"[default: the bundle's, else {off}]" if bundle else f"[default: {off}]"
            options.append(click.option(opt, type=kind, default=None, help=f"{what} {default}"))
        if setting is None:
            options.append(click.option(
                "--logit-bias", multiple=True, metavar="ID=BIAS",
                help="add BIAS (in [-100, 100]) to token ID's logit; repeatable; -100 bans a "
                     "token"))
            options.append(click.option(
                "--seed", type=int, default=None,
                help="random seed, >= 0: the same seed gives the same sample in the same mode "
                     "(speculative and --no-draft draw differently) [default: random]"))
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def parse_gamma(value):
    """--gamma's value: None, "auto", or an integer (its range is the bundle's, checked when
    the request is made)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise BadInput(f"--gamma {value!r} is invalid: use an integer or 'auto'") from None


def parse_gammas(value: str) -> list:
    return [parse_gamma(part.strip()) for part in value.split(",")]


def parse_logit_bias(values) -> dict | None:
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


def generation_options(*, no_draft: bool = False, gamma=None, logit_bias=(), stop=(),
                       **values):
    """The GenerationOptions of a command's request options (click's parameter names: the
    fields', with --no-draft, --logit-bias ID=BIAS and --gamma as typed), checked now, before
    the bundle loads; BadInput in the command line's words."""
    from spec_runtime.request import GenerationOptions

    try:
        return GenerationOptions(use_draft=not no_draft, gamma=parse_gamma(gamma),
                                 logit_bias=parse_logit_bias(logit_bias), stop=tuple(stop),
                                 **values)
    except InputError as e:
        raise BadInput(cli_words(str(e))) from None


def in_cli_words(fn, *args, **kwargs):
    """fn(*args, **kwargs), an InputError about a request's value (γ against the bundle, a
    logit_bias id against its vocabulary) in the command line's words."""
    try:
        return fn(*args, **kwargs)
    except InputError as e:
        raise BadInput(cli_words(str(e))) from None


def cli_words(message: str) -> str:
    """A request's message in the command line's words: "top_p=1.5 is invalid" -> "--top-p 1.5
    is invalid", "logit_bias[5]=200" -> "--logit-bias 5=200", "stop string ''" -> "--stop:
    stop string ''"."""
    message = re.sub(r"^logit_bias\[(.*?)\]=", r"--logit-bias \1=", message)
    message = re.sub(r"^logit_bias token id", "--logit-bias token id", message)
    message = re.sub(r"^stop string", "--stop: stop string", message)
    return re.sub(r"^([a-z_]+)=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


def read_prompt(prompt, prompt_file, bundle):
    """The prompt: the argument, else --prompt-file, else stdin; a file or stdin is read up to
    what the bundle's cache can use (spec_runtime.limits.read_prompt), never to its end."""
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
    from spec_runtime.bundle import read_bundle_manifest
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
