"""The jinja2 environment chat templates run in: Hugging Face's (an immutable sandbox, trimmed
blocks, loop controls, their `tojson` and `raise_exception`), with every way a template can
make something large or run long passing through a bound of chat_limits.py.

- The sandbox's own hooks: `*`, `+`, `**` and `%` (intercepted operators, `call_binop`);
  calls (`call`: each one a step; string methods that can make more than they read bounded
  before they run, every result measured after; a recursive loop's `loop(children)` counted);
  `str.format` (`getattr`); every filter (wrapped: bounded before, measured after).
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

import json
import time
from functools import lru_cache

from .chat_limits import (Limit, check_binop, check_format, check_numbers, check_replace,
                          filter_bound, make, method_bound, size_of, step, value_limit)
from .errors import TemplateError


@lru_cache(maxsize=1)
def environment():
    from jinja2.ext import loopcontrols

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                           optimized=False, finalize=_finalize)
    env.filters["tojson"] = _tojson  # Hugging Face's: no HTML escaping, unicode kept
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
            owner = getattr(__obj, "__self__", None)
            if name == "replace" and args[1:]:
                check_replace(owner, args[0], args[1])
            bound = method_bound(name, owner, args, kwargs)
            if bound is not None:
                make(bound, f"{name}()")
            if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
                args = (_Counted(args[0]), *args[1:])
            result = super().call(__context, __obj, *args, **kwargs)
            make(size_of(result), f"{name}()")
            return result

        def getattr(self, obj, attribute):
            value = super().getattr(obj, attribute)
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                check_format(obj, "a {}-format")
                method = value  # jinja2's own sandboxed formatter, which hides the string

                def bounded_format(*args, **kwargs):
                    make(method_bound(attribute, obj, args, kwargs), f"{attribute}()")
                    return method(*args, **kwargs)

                return bounded_format
            return value

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
            # the loops' iterables, by identity (jinja2 allows no node types of one's own)
            self.loop_iterables = {id(loop.iter) for loop in node.find_all(nodes.For)}
            super().visit_Template(node, frame)

        def visit(self, node, *args, **kwargs):
            if id(node) not in getattr(self, "loop_iterables", ()):
                return super().visit(node, *args, **kwargs)
            self.write("environment.counted(")
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


def _bounded_filter(name, f):
    from jinja2.utils import _PassArg

    skip = 2 if _PassArg.from_obj(f) else 1  # the context or environment, then the value

    def bounded(*args, **kwargs):
        what = f"the filter {name!r}"
        check_numbers(args[skip:], kwargs, what)
        if name == "replace" and len(args) >= skip + 2:
            check_replace(*args[skip - 1 : skip + 2])
        if name == "format" and len(args) >= skip:
            check_format(args[skip - 1], "a %-format")
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
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")
