"""The jinja2 environment chat templates run in: Hugging Face's (an immutable sandbox, trimmed
blocks, loop controls, their `tojson` and `raise_exception`), with every way a template can
make something large or run long passing through a bound of chat_limits.py.

- The sandbox's own hooks: `*`, `+`, `**` and `%` (intercepted operators, `call_binop`);
  calls (`call`: each one a step; string methods that can make more than they read bounded
  before they run, every result measured after; a recursive loop's `loop(children)` counted);
  `str.format` and `format_map` (`wrap_str_format`: a formatter that bounds each field by its
  value, width and precision, nested ones filled in, before it is made, and counts the total);
  every filter (wrapped: bounded before, measured after).
- What is made of many pieces is counted as it is made (chat_limits.Tally), never estimated
  from a count of items: `join` (the filter and `str.join`) draws its items one at a time;
  every generator a filter or a call is given, or `*args` unpacks, is drawn through `_Metered`,
  which charges each item as it comes (`range(100000)|map('string')|list` is refused at the
  limit, not after a list of every item is made).
- The code generator, for what jinja2 compiles to plain Python that no hook sees:
  `~` (a `str_join` of its operands) becomes `environment.concat_values`, which counts the
  operands' lengths before joining; the output buffers of blocks, macros and
  `{% set %}...{% endset %}` count each piece as it is added, and `environment.concat` counts
  before it joins them; slices go through `getitem`; list, tuple and dict literals are
  measured where they are built (a list that holds another twice, 60 levels deep, prints
  2**60 items);
  each loop draws its items through `environment.counted`, one step each (jinja2 has no
  counter of its own: its sandbox bounds `range`, not loops over loops).
- `finalize`: what `{{ value }}` writes is measured before `str()` writes it.

The environment is compiled without constant folding, which would evaluate `'a' * 10**9`
while compiling, before any bound applies.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from functools import lru_cache, update_wrapper

from .chat_limits import (Limit, Tally, check_binop, check_numbers, check_replace, filter_bound,
                          gather, make, measure, method_bound, percent_bound, size_of,
                          spec_chars, step, text_chars, value_limit, REPR, ESCAPED)
from .errors import TemplateError


@lru_cache(maxsize=1)
def environment():
    from jinja2.ext import loopcontrols

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                           optimized=False, finalize=_finalize)
    env.filters["tojson"] = _tojson  # Hugging Face's: no HTML escaping, unicode kept
    env.filters["join"] = _join_filter()
    env.filters["pprint"] = _pprint
    env.filters["format"] = _format
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lipsum(n) makes n paragraphs in one C-speed call
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def _sandbox_class():
    from jinja2.runtime import LoopContext, markup_join
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _code_generator_class()
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            step()  # macros recurse through calls
            name = getattr(__obj, "__name__", "a call")
            check_numbers(args, kwargs, name)
            args = tuple(metered(a, name) for a in args)
            kwargs = {k: metered(v, name) for k, v in kwargs.items()}
            owner = getattr(__obj, "__self__", None)
            if name == "replace" and args[1:] and isinstance(owner, (str, bytes, bytearray)):
                check_replace(owner, args[0], args[1])
            if name == "join" and isinstance(owner, (str, bytes, bytearray)) and len(args) == 1:
                escape = ESCAPED if hasattr(owner, "__html__") else 1  # Markup.join escapes
                args = (gather(args[0], owner, "join()", convert=False, escape=escape),)
            bound = method_bound(name, owner, args, kwargs)
            if bound is not None:
                make(bound, f"{name}()")
            if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
                args = (_Counted(args[0]), *args[1:])
            result = super().call(__context, __obj, *args, **kwargs)
            make(size_of(result), f"{name}()")
            return result

        def wrap_str_format(self, value):
            """jinja2's own (both `getattr` and `getitem` reach it: `s['format']` too), with
            formatters that bound each field."""
            from markupsafe import Markup

            if super().wrap_str_format(value) is None:  # not a string's format method
                return None
            string, is_format_map = value.__self__, value.__name__ == "format_map"
            if isinstance(string, Markup):
                formatter = _bounded_formatter(True)(self, escape=string.escape)
            else:
                formatter = _bounded_formatter(False)(self)

            def bounded(*args, **kwargs):
                if is_format_map:
                    if kwargs:
                        raise TypeError("format_map() takes no keyword arguments")
                    if len(args) != 1:
                        raise TypeError(f"format_map() takes exactly one argument "
                                        f"({len(args)} given)")
                    args, kwargs = (), args[0]
                return type(string)(formatter.vformat(string, args, kwargs))

            return update_wrapper(bounded, value)

        def getitem(self, obj, argument):
            if not isinstance(argument, slice):
                return super().getitem(obj, argument)
            if isinstance(obj, (str, list, tuple)):
                try:
                    n = len(range(*argument.indices(len(obj))))
                except TypeError:  # bounds that are not integers: obj[argument] says so
                    n = 0
                make(n, "a slice")
            return obj[argument]  # as jinja2 slices: directly, errors and all

        @staticmethod
        def concat(pieces):
            """The output of a block or a macro, or `{% set %}...{% endset %}`, joined."""
            pieces = pieces if isinstance(pieces, list) else list(pieces)
            make(sum(map(len, pieces)), "a block's output")
            return "".join(pieces)

        @staticmethod
        def concat_values(markup: bool, values):
            """`a ~ b ~ ...`: the operands' text, counted before it is joined."""
            texts = []
            for v in values:
                if not isinstance(v, str):
                    make(size_of(v), "'~'")  # before str() writes it out
                    v = str(v)
                texts.append(v)
            n = sum(map(len, texts))
            if markup:  # an autoescape block: escaping writes at most 5 characters for one
                make(5 * n, "'~'")
                return markup_join(texts)
            make(n, "'~'")
            return "".join(texts)

        @staticmethod
        def literal(value):
            make(size_of(value), "a literal")
            return value

        @staticmethod
        def counted(iterable):
            return _Counted(iterable)

        @staticmethod
        def metered(iterable):
            return metered(iterable, "'*' unpacking")

        @staticmethod
        def output_buffer():
            return _Buffer()

    return BoundedSandbox


class _Counted:
    """A loop's iterable: each item drawn is a step. Its length is the iterable's, where it has
    one (`loop.length` and `loop.last` read it without drawing the items)."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __len__(self):
        return len(self.iterable)

    def __iter__(self):
        for item in self.iterable:
            step()
            yield item


class _Metered:
    """A generator (or any iterator) that a filter, a call or `*args` draws from: each item is
    charged what it prints as, and one more, as it is drawn, so that whatever keeps the items
    (`list`, `sort`, `*args`, `sum`) is refused at the limit on one value, however many there
    would have been. Its own attributes are private: the sandbox hides them."""

    __slots__ = ("_iterator", "_tally")

    def __init__(self, iterator, what):
        self._iterator, self._tally = iterator, Tally(f"the items drawn by {what}")

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._iterator)
        self._tally.add(measure(item, value_limit())[0] + 1)
        return item


def metered(value, what: str):
    """`value` drawn through `_Metered` if it is an iterator, else itself. A loop's `loop` is
    left as it is: its items are its loop's, counted already, and filters read its attributes."""
    if isinstance(value, (str, int, float, list, tuple, dict)) or value is None:
        return value  # most arguments: no need to ask the ABC
    if isinstance(value, Iterator) and not isinstance(value, _not_metered()):
        return _Metered(value, what)
    return value


@lru_cache(maxsize=1)
def _not_metered():
    from jinja2.runtime import LoopContext

    return _Metered, LoopContext


class _Buffer(list):
    """A block's or macro's output so far: each piece is counted as it is added (one more for
    the piece itself: empty pieces would grow it with nothing to show for it)."""

    size = 0

    def append(self, piece):
        self.size += len(piece) + 1
        if self.size > value_limit():
            raise Limit(f"a block's output passed {value_limit()} characters")
        make(len(piece) + 1, "a block's output")
        super().append(piece)

    def extend(self, pieces):
        for piece in pieces:
            self.append(piece)


def _code_generator_class():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator

    class BoundedCodeGenerator(CodeGenerator):
        """jinja2's code generator, with the constructs no sandbox hook sees made into calls
        of the environment (each the same value as before, bounded)."""

        def visit_Template(self, node, frame=None):
            # by identity (jinja2 allows no node types of one's own): the loops' iterables,
            # counted, and what `*args` unpacks (Python makes a tuple of it before the call)
            self.wrapped = {id(loop.iter): "environment.counted("
                            for loop in node.find_all(nodes.For)}
            for call in node.find_all((nodes.Call, nodes.Filter, nodes.Test)):
                if call.dyn_args is not None:
                    self.wrapped[id(call.dyn_args)] = "environment.metered("
            super().visit_Template(node, frame)

        def visit(self, node, *args, **kwargs):
            wrapper = getattr(self, "wrapped", {}).get(id(node))
            if wrapper is None:
                return super().visit(node, *args, **kwargs)
            self.write(wrapper)
            super().visit(node, *args, **kwargs)
            self.write(")")

        def visit_Concat(self, node, frame):
            if frame.eval_ctx.volatile:
                markup = "context.eval_ctx.autoescape"
            else:
                markup = repr(bool(frame.eval_ctx.autoescape))
            self.write(f"environment.concat_values({markup}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def buffer(self, frame):
            frame.buffer = self.temporary_identifier()
            self.writeline(f"{frame.buffer} = environment.output_buffer()")

        def visit_Getitem(self, node, frame):
            if not isinstance(node.arg, nodes.Slice):
                return super().visit_Getitem(node, frame)
            self.write("environment.getitem(")
            self.visit(node.node, frame)
            self.write(", slice(")
            for part in (node.arg.start, node.arg.stop, node.arg.step):
                if part is None:
                    self.write("None")
                else:
                    self.visit(part, frame)
                self.write(", ")
            self.write("))")

        def visit_List(self, node, frame):
            self.write("environment.literal(")
            super().visit_List(node, frame)
            self.write(")")

        def visit_Dict(self, node, frame):
            self.write("environment.literal(")
            super().visit_Dict(node, frame)
            self.write(")")

        def visit_Tuple(self, node, frame):
            if node.ctx != "load":  # an assignment's target: {% for k, v in ... %}
                return super().visit_Tuple(node, frame)
            self.write("environment.literal(")
            super().visit_Tuple(node, frame)
            self.write(")")

    return BoundedCodeGenerator


def _finalize(value):
    """What `{{ value }}` writes, measured before `str()` writes it (a list's text)."""
    if not isinstance(value, str):
        make(size_of(value), "an output")
    return value


def _bounded_formatter(escaping: bool):
    from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

    base = SandboxedEscapeFormatter if escaping else SandboxedFormatter

    class BoundedFormatter(base):
        """jinja2's sandboxed formatter, each field bounded before it is made (its value's text
        and its spec's width and precision, nested fields filled in: `{0:>{1}}`), the result's
        total counted as the fields are made."""

        tally = None

        def vformat(self, format_string, args, kwargs):
            outer, self.tally = self.tally, Tally("a {}-format", len(format_string))
            try:
                return super().vformat(format_string, args, kwargs)
            finally:
                self.tally = outer

        def convert_field(self, value, conversion):
            if conversion == "s":
                make(text_chars(value), "a {}-format")
            elif conversion is not None:  # !r or !a: repr() escapes a character in up to ten
                make(REPR * size_of(value) + 24, "a {}-format")
            return super().convert_field(value, conversion)

        def format_field(self, value, format_spec):
            n = text_chars(value) + spec_chars(format_spec)
            self.tally.expect(n * ESCAPED if escaping else n)
            text = super().format_field(value, format_spec)
            self.tally.add(len(text))
            return text

    return BoundedFormatter


def _bounded_filter(name, f):
    from jinja2.utils import _PassArg

    skip = 2 if _PassArg.from_obj(f) else 1  # the context or environment, then the value

    def bounded(*args, **kwargs):
        what = f"the filter {name!r}"
        check_numbers(args[skip:], kwargs, what)
        args = tuple(metered(a, what) for a in args)
        kwargs = {k: metered(v, what) for k, v in kwargs.items()}
        if name == "replace" and len(args) >= skip + 2:
            check_replace(*args[skip - 1 : skip + 2])
        if len(args) >= skip:
            bound = filter_bound(name, args[skip - 1], args[skip:], kwargs)
            if bound is not None:
                make(bound, what)
        result = f(*args, **kwargs)
        make(size_of(result), what)
        return result

    if hasattr(f, "jinja_pass_arg"):  # how jinja2 knows to pass the context or environment
        bounded.jinja_pass_arg = f.jinja_pass_arg
    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Hugging Face's `json.dumps`, written piece by piece and counted as it is written (its
    separators and indentation come once per item)."""
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    out = _Written("the filter 'tojson'")
    for piece in encoder.iterencode(value):  # the same text as dumps, made lazily
        out.write(piece)
    return out.getvalue()


def _pprint(value):
    """jinja2's `pprint` (pformat), written piece by piece and counted as it is written (a
    nested item's indentation is as long as the keys above it)."""
    from pprint import PrettyPrinter

    out = _Written("the filter 'pprint'")
    PrettyPrinter(stream=out).pprint(value)
    return out.getvalue()[:-1]  # pprint ends the text with a newline; pformat does not


class _Written(io.StringIO):
    """A stream that counts what is written to it, piece by piece, refusing the piece that
    would pass the limit on one value."""

    def __init__(self, what: str):
        super().__init__()
        self.tally = Tally(what)

    def write(self, piece):
        self.tally.add(len(piece))
        return super().write(piece)


def _join_filter():
    from jinja2.filters import make_attrgetter, sync_do_join
    from jinja2.utils import pass_eval_context

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        """jinja2's, of the items drawn and counted one at a time (chat_limits.gather)."""
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        escape = ESCAPED if eval_ctx.autoescape else 1
        items = gather(value, str(d), "the filter 'join'", convert=True, escape=escape)
        return sync_do_join(eval_ctx, items, d)

    return join


def _format(value, *args, **kwargs):
    """jinja2's `format` (a %-format of the value), bounded by its conversions first."""
    from jinja2.exceptions import FilterArgumentError
    from markupsafe import soft_str

    if args and kwargs:
        raise FilterArgumentError("can't handle positional and keyword arguments at the same "
                                  "time")
    make(text_chars(value), "the filter 'format'")
    text = soft_str(value)
    make(percent_bound(text, kwargs or args), "the filter 'format'")
    return text % (kwargs or args)


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")
