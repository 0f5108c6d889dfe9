"""Chat templates, rendered the way Hugging Face tokenizers render them (sandboxed jinja2, the
same globals and filters), with bounds: a bundle's template is code from an untrusted file.

- jinja2's immutable sandbox stops attribute escapes and mutation of the messages;
- the template is compiled without constant folding, which would evaluate `'a' * 10**9` while
  compiling, before any bound applies;
- every result that could be large is checked before it is made: `*`, `+`, `**` and `%`
  (intercepted operators), calls and filters with a number argument over the output limit
  (`center(10**9)`), `replace` and str.format widths;
- rendering stops after RENDER_SECONDS: a trace function on the template's own frames checks
  the clock and the size of its variables on every line, which bounds loops (nested
  `range(100000)` loops would run for hours) and repeated `~` concatenation;
- the output is streamed and stops at the limit.

A template that breaks any of this, or fails on the messages (syntax, an undefined name, a
sandbox violation), is a bundle error; one that calls `raise_exception` refuses the messages
(a TemplateError: the user's input). `compile_chat_template` checks a template when the bundle
loads, by rendering a one-message conversation.
"""

from __future__ import annotations

import json
import re
import sys
import time
from functools import lru_cache

from .errors import BundleError, InputError, TemplateError
from .manifest import REBUILD

RENDER_SECONDS = 1.0  # a real template renders in well under a millisecond
MAX_CHARS = 1 << 20  # output beyond the messages' own text; also caps any one value
TEMPLATE_FILE = "<template>"  # the file name jinja2 gives code compiled from a string
_WIDTH = re.compile(r"\d{7,}|\*")  # a width or precision of a million or more, or one read
                                  # from the arguments, in a %- or {}-format


class _Limit(Exception):
    """A bound was hit: raised inside the template, reported as a BundleError."""


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """Compile and test-render `template`; BundleError if it cannot serve a conversation."""
    from jinja2 import TemplateError as JinjaError

    try:
        compiled = _environment().from_string(template)
    except (JinjaError, _Limit, RecursionError, MemoryError) as e:
        raise BundleError(f"the bundle's chat template does not compile ({_describe(e)}); "
                          f"{REBUILD} from a model whose chat template works") from None
    try:
        _render(compiled, [{"role": "user", "content": "Hello"}], {})
    except TemplateError as e:
        raise BundleError(f"the bundle's chat template refuses a one-message conversation "
                          f"({e}); {REBUILD} from a model whose chat template works") from None
    return compiled


def render_chat(template: str, messages: list[dict], special_tokens: dict) -> str:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise InputError(f"message {i} is {m!r}: each message needs a 'role' and a "
                             f"'content', both strings")
    return _render(compile_chat_template(template), messages, special_tokens)


def _render(compiled, messages: list[dict], special_tokens: dict) -> str:
    size = sum(len(m["role"]) + len(m["content"]) for m in messages)
    limit = MAX_CHARS + 2 * size
    context = dict(messages=messages, add_generation_prompt=True,
                   bos_token=special_tokens.get("bos_token", ""),
                   eos_token=special_tokens.get("eos_token", ""))
    pieces, n = [], 0
    try:
        with _bounded(limit):
            for piece in compiled.generate(**context):
                n += len(piece)
                if n > limit:
                    raise _Limit(f"its output passed {limit} characters")
                pieces.append(piece)
    except TemplateError:
        raise
    except Exception as e:  # the template's own code failed: syntax is checked, so this is
        # an undefined name, a sandbox violation, a bound, or any error of its expressions
        raise BundleError(f"the bundle's chat template failed ({_describe(e)}); {REBUILD} "
                          f"from a model whose chat template works") from None
    return "".join(pieces)


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if isinstance(e, _Limit):
        return text[0]
    line = getattr(e, "lineno", None)
    where = f"line {line}: " if line else ""
    return f"{where}{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


class _bounded:
    """Trace the template's frames: on every line, the clock and the size of its variables."""

    def __init__(self, limit: int):
        self.limit = limit

    def __enter__(self):
        deadline = time.perf_counter() + RENDER_SECONDS
        limit = self.limit

        def on_line(frame, event, arg):
            if event == "line":
                if time.perf_counter() > deadline:
                    raise _Limit(f"rendering took more than {RENDER_SECONDS:g} s")
                for value in frame.f_locals.values():
                    if _too_big(value, limit):
                        raise _Limit(f"a value grew past {limit} characters")
            return on_line

        def on_call(frame, event, arg):
            return on_line if frame.f_code.co_filename == TEMPLATE_FILE else None

        self.previous = sys.gettrace()
        sys.settrace(on_call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.previous)


def _too_big(value, limit: int) -> bool:
    from jinja2.utils import Namespace

    if isinstance(value, (str, list, tuple, dict)):
        return len(value) > limit
    if isinstance(value, Namespace):  # {% set ns.x = ns.x ~ ns.x %} lives in its attributes
        return any(_too_big(v, limit) for v in value._Namespace__attrs.values())
    return False


def _check_size(n, what: str) -> None:
    if n > MAX_CHARS:
        raise _Limit(f"{what} would make {n} items (limit {MAX_CHARS})")


def _check_numbers(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise _Limit(f"{what} got the number {a!r} (limit {MAX_CHARS})")


def _check_format(spec, what: str) -> None:
    if isinstance(spec, str) and _WIDTH.search(spec):
        raise _Limit(f"{what} has a width or precision over {MAX_CHARS - 1} or taken from "
                     f"its arguments")


def _check_replace(s, old, new) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        matches = len(s) + 1 if old == "" else s.count(old)
        _check_size(len(s) + matches * len(new), "replace")


@lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "'*'")
            elif operator == "+" and isinstance(left, (str, list, tuple)) \
                    and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "'+'")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                    and abs(left) > 1 and right > 64:
                raise _Limit(f"'**' with the exponent {right} (limit 64)")
            elif operator == "%":
                _check_format(left, "a %-format")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            _check_numbers(args, kwargs, getattr(__obj, "__name__", "a call"))
            if getattr(__obj, "__name__", None) == "replace" and args[1:]:
                _check_replace(getattr(__obj, "__self__", None), args[0], args[1])
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj, "a {}-format")
            return super().getattr(obj, attribute)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                         optimized=False)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson  # Hugging Face's: no HTML escaping, unicode kept
    env.globals.pop("lipsum", None)  # lipsum(n) makes n paragraphs in one C-speed call
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _bounded_filter(name, f):
    from jinja2.utils import _PassArg

    skip = 2 if _PassArg.from_obj(f) else 1  # the context or environment, then the value

    def bounded(*args, **kwargs):
        _check_numbers(args[skip:], kwargs, f"the filter {name!r}")
        if name == "replace" and len(args) >= skip + 2:
            _check_replace(*args[skip - 1 : skip + 2])
        if name == "format" and len(args) >= skip:
            _check_format(args[skip - 1], "a %-format")
        return f(*args, **kwargs)

    if hasattr(f, "jinja_pass_arg"):  # how jinja2 knows to pass the context or environment
        bounded.jinja_pass_arg = f.jinja_pass_arg
    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")
