"""Chat templates, rendered the way Hugging Face tokenizers render them (sandboxed jinja2, the
same globals and filters), with bounds: a bundle's template is code from an untrusted file.

- jinja2's immutable sandbox stops attribute escapes and mutation of the messages;
- the template is compiled without constant folding, which would evaluate `'a' * 10**9` while
  compiling, before any bound applies;
- every result that could be large is bounded before it is made, by the size of what it
  would print (`_measure`: characters, one per item, nested values counted every time they
  occur, as `join` or `tojson` writes them): `*`, `+`, `**` and `%` (intercepted operators);
  every filter and string method that can produce more than it reads (`join`, `tojson` with an
  indent, `indent`, `wordwrap`, `format`, `replace`, `translate`, `expandtabs`, ...); calls and
  filters with a number argument over the output limit (`center(10**9)`); and every filter's
  and call's result is measured after it is made;
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
import threading
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


_render_state = threading.local()  # .limit: the output limit of the render in progress


def _limit() -> int:
    return getattr(_render_state, "limit", MAX_CHARS)


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
    _render_state.limit = limit
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
    finally:
        del _render_state.limit
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


def _measure(value, limit: int) -> tuple[int, int]:
    """(size, depth): the characters `value` prints as, one more per item, nested values
    counted every time they occur (`[s] * 1000` is a thousand times `s`: `join` and `tojson`
    write it so); counting stops past `limit`."""
    from jinja2.utils import Namespace

    size, deepest, stack = 0, 0, [(value, 1)]
    while stack and size <= limit:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, str):
            size += len(v)
        elif isinstance(v, dict):
            size += 1
            stack.extend((x, d + 1) for pair in v.items() for x in pair)
        elif isinstance(v, (list, tuple, set, frozenset)):
            size += 1
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, Namespace):  # {% set ns.x = ns.x ~ ns.x %} lives in its attributes
            stack.extend((x, d + 1) for x in v._Namespace__attrs.values())
        else:
            size += 24  # a number's or an object's repr
    return size, deepest


def _too_big(value, limit: int) -> bool:
    """The trace's check of a variable, on every line: cheap (lengths; what operators and
    filters build is measured where it is built)."""
    from jinja2.utils import Namespace

    if isinstance(value, (str, list, tuple, dict)):
        return len(value) > limit
    if isinstance(value, Namespace):  # {% set ns.x = ns.x ~ ns.x %} lives in its attributes
        return any(_too_big(v, limit) for v in value._Namespace__attrs.values())
    return False


def _check_size(n, what: str) -> None:
    if n > _limit():
        raise _Limit(f"{what} would make {n} characters (limit {_limit()})")


def _size(value) -> int:
    return _measure(value, _limit())[0]


def _count(value) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict, set)) else _size(value)


def _fields(fmt: str) -> int:
    return fmt.count("{") + fmt.count("%")


def _largest(values) -> int:
    return max((_size(v) for v in values), default=0)


def _filter_bound(name: str, value, args: tuple, kwargs: dict) -> int | None:
    """At most how many characters the filter `name` makes of `value` with these arguments;
    None for the filters that make no more than they read."""
    def arg(i, key, default):
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name == "join":
        return _size(value) + len(str(arg(0, "d", ""))) * _count(value)
    if name in ("string", "pprint", "e", "escape", "forceescape", "urlencode", "xmlattr",
                "urlize", "striptags"):
        return 6 * _size(value)  # an escape writes at most 6 characters per character
    if name == "tojson":
        size, deepest = _measure(value, _limit())
        indent = arg(0, "indent", None)
        width = len(indent) if isinstance(indent, str) else int(indent or 0)
        return 6 * size + size * width * deepest  # each item on a line of its own, indented
    if name == "indent" and isinstance(value, str):
        width = arg(0, "width", 4)
        width = len(width) if isinstance(width, str) else int(width)
        return len(value) + (value.count("\n") + 1) * width
    if name == "wordwrap" and isinstance(value, str):
        return len(value) * (1 + len(str(arg(3, "wrapstring", None) or "\n")))
    if name == "format" and isinstance(value, str):
        return len(value) + _fields(value) * _largest((*args, *kwargs.values()))
    if name == "sum":
        return _size(value) + _size(arg(1, "start", 0))
    if name == "truncate" and isinstance(value, str):
        return len(value) + len(str(arg(2, "end", "...")))
    return None


def _method_bound(name: str, self, args: tuple, kwargs: dict) -> int | None:
    """The same for a string's methods."""
    if not isinstance(self, str):
        return None
    if name == "join" and args:
        return _size(args[0]) + len(self) * _count(args[0])
    if name in ("format", "format_map"):
        return len(self) + _fields(self) * _largest((*args, *kwargs.values()))
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(self) + self.count("\t") * (tab if isinstance(tab, int) else 0)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(self) * max(1, _largest(args[0].values()))
    return None


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
                        _check_size(_size(seq) * n, "'*'")
            elif operator == "+" and isinstance(left, (str, list, tuple)) \
                    and isinstance(right, (str, list, tuple)):
                _check_size(_size(left) + _size(right), "'+'")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                    and abs(left) > 1 and right > 64:
                raise _Limit(f"'**' with the exponent {right} (limit 64)")
            elif operator == "%":
                _check_format(left, "a %-format")
                if isinstance(left, str):
                    values = right if isinstance(right, tuple) else (right,)
                    _check_size(len(left) + _fields(left) * _largest(values), "a %-format")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            name = getattr(__obj, "__name__", "a call")
            _check_numbers(args, kwargs, name)
            owner = getattr(__obj, "__self__", None)
            if name == "replace" and args[1:]:
                _check_replace(owner, args[0], args[1])
            bound = _method_bound(name, owner, args, kwargs)
            if bound is not None:
                _check_size(bound, f"{name}()")
            result = super().call(__context, __obj, *args, **kwargs)
            _check_size(_size(result), f"{name}()")
            return result

        def getattr(self, obj, attribute):
            value = super().getattr(obj, attribute)
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj, "a {}-format")
                method = value  # jinja2's own sandboxed formatter, which hides the string

                def bounded_format(*args, **kwargs):
                    _check_size(_method_bound(attribute, obj, args, kwargs), f"{attribute}()")
                    return method(*args, **kwargs)

                return bounded_format
            return value

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                         optimized=False)
    env.filters["tojson"] = _tojson  # Hugging Face's: no HTML escaping, unicode kept
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lipsum(n) makes n paragraphs in one C-speed call
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _bounded_filter(name, f):
    from jinja2.utils import _PassArg

    skip = 2 if _PassArg.from_obj(f) else 1  # the context or environment, then the value

    def bounded(*args, **kwargs):
        what = f"the filter {name!r}"
        _check_numbers(args[skip:], kwargs, what)
        if name == "replace" and len(args) >= skip + 2:
            _check_replace(*args[skip - 1 : skip + 2])
        if name == "format" and len(args) >= skip:
            _check_format(args[skip - 1], "a %-format")
        if len(args) >= skip:
            bound = _filter_bound(name, args[skip - 1], args[skip:], kwargs)
            if bound is not None:
                _check_size(bound, what)
        result = f(*args, **kwargs)
        _check_size(_size(result), what)
        return result

    if hasattr(f, "jinja_pass_arg"):  # how jinja2 knows to pass the context or environment
        bounded.jinja_pass_arg = f.jinja_pass_arg
    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")
