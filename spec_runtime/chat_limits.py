"""How big a chat template's values may grow, and how much work one render may do.

`Budget` is one render's: `limit` on any one value and on the output (the messages' own text
twice, plus MAX_CHARS), `work` (WORK_FACTOR limits' worth of characters made or walked by the
bounded operations, in all: every value the template keeps was made by one of them, so this
bounds the render's peak memory however many values it keeps, and its time spent on text), and
`steps` (loop iterations and calls). The clock (RENDER_SECONDS) is a backstop, checked at each
step and each bounded operation, for the work that cannot be counted (`in` over a long string
in a long loop body). `make` and `step` charge the budget of the render in progress
(`rendering`), and raise `Limit` past it.

`measure` is the size a value prints as: characters, one per item, nested values counted every
time they occur, as `join`, `tojson` or `str()` write them. The bounds of the filters and string
methods that can make more than they read are here too (chat_sandbox.py applies them).

What is made of many pieces (`join`, a `{}`- or `%`-format's fields, the items a filter or a call
draws from a generator) is counted as it is made, by a `Tally`: each piece is bounded before it is
made and the total is refused as soon as it would pass the limit on one value. No count of pieces
is estimated: a generator's cannot be, and `range(100000)|join(sep)` is 100000 separators.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager

RENDER_SECONDS = 1.0  # a real template renders in well under a millisecond
MAX_CHARS = 1 << 20  # output beyond the messages' own text; also caps any one value
WORK_FACTOR = 64  # characters a render may make or walk in all, in units of its value limit
MAX_STEPS = 20_000  # loop iterations and calls a render may take, plus, per message:
STEPS_PER_MESSAGE = 100  # (real templates take a few per message)
MAX_INT_BITS = 4096  # an integer `*` or `**` may make (a chat template counts, no more)
ESCAPED = 5  # characters an HTML escape writes for one (`'` is `&#39;`)
REPR = 10  # characters repr() writes for one at most ('\U000e0001')
FLOAT = 440  # characters a float formats as before its width and precision (1e308 with `,`)
# every line break str.splitlines (and so `indent`) breaks at, not only "\n"
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_DIGITS = re.compile(r"\d+")
# a %-conversion after its '%' and mapping key: flags, width, precision, length, type
_CONVERSION = re.compile(r"[-+ #0]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


class Limit(Exception):
    """A bound was hit: raised inside the template, reported as a BundleError."""


class Budget:
    """One render's bounds: `limit` on any one value and on the output, `work` characters made
    or walked in all, `steps` loop iterations and calls, and the clock's backstop."""

    def __init__(self, limit: int, steps: int):
        self.limit, self.work, self.steps = limit, WORK_FACTOR * limit, steps
        self.max_work, self.max_steps = self.work, steps
        self.deadline = time.perf_counter() + RENDER_SECONDS


_render_state = threading.local()  # .budget: the budget of the render in progress


@contextmanager
def rendering(budget: Budget):
    """Charge this thread's bounded operations to `budget` while a render runs."""
    _render_state.budget = budget
    try:
        yield budget
    finally:
        del _render_state.budget


def _budget() -> Budget:
    # outside a render (jinja2 folding a constant while it compiles) a fresh one: such work is
    # bounded by the template's own length
    budget = getattr(_render_state, "budget", None)
    return budget if budget is not None else Budget(MAX_CHARS, MAX_STEPS)


def value_limit() -> int:
    return _budget().limit


def _clock(budget: Budget) -> None:
    if time.perf_counter() > budget.deadline:
        raise Limit(f"rendering took more than {RENDER_SECONDS:g} s")


def make(n: int, what: str) -> None:
    """`what` is about to make (or walk) `n` characters: refused past the limit on one value
    or past the render's work in all."""
    budget = _budget()
    if n > budget.limit:
        raise Limit(f"{what} would make {n} characters (limit {budget.limit})")
    budget.work -= n
    if budget.work < 0:
        raise Limit(f"{what} passed the {budget.max_work} characters a render may make in "
                    f"all")
    _clock(budget)


class Tally:
    """What one operation has made so far, counted piece by piece as it makes them: `expect`
    refuses a piece before it is made if the total would pass the limit on one value; `add`
    counts it (and charges the render's work)."""

    def __init__(self, what: str, start: int = 0):
        self.what, self.total = what, 0
        self.add(start)

    def expect(self, n: int) -> None:
        limit = _budget().limit
        if self.total + n > limit:
            raise Limit(f"{self.what} would make more than {limit} characters")

    def add(self, n: int) -> None:
        self.expect(n)
        self.total += n
        make(n, self.what)


def step() -> None:
    """One loop iteration or call."""
    budget = _budget()
    budget.steps -= 1
    if budget.steps < 0:
        raise Limit(f"it ran more than {budget.max_steps} loop iterations and calls")
    _clock(budget)


def measure(value, stop: int) -> tuple[int, int]:
    """(size, depth): the characters `value` prints as, one more per item, nested values
    counted every time they occur (`[s] * 1000` is a thousand times `s`: `join` and `tojson`
    write it so); counting stops past `stop`."""
    if type(value) is str:  # most values: drawn items, filters' results
        return len(value), 1
    from jinja2.utils import Namespace

    size, deepest, stack = 0, 0, [(value, 1)]
    while stack and size <= stop:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, str):
            size += len(v) + (d > 1)  # an item prints its separator, even when empty
        elif isinstance(v, dict):
            size += 1
            stack.extend((x, d + 1) for pair in v.items() for x in pair)
        elif isinstance(v, (list, tuple, set, frozenset)):
            size += 1
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, (bytes, bytearray)):  # 'x'.encode() * 10**9 is as large as its str
            size += len(v) + (d > 1)
        elif isinstance(v, Namespace):  # {% set ns.x = ns.x ~ ns.x %} lives in its attributes
            stack.extend((x, d + 1) for x in v._Namespace__attrs.values())
        elif isinstance(v, int):  # `|int` of a message's digits prints thousands of them
            size += max(24, abs(v).bit_length() // 3 + 2)
        else:
            size += 24  # a float's or an object's repr
    return size, deepest


def size_of(value) -> int:
    return measure(value, value_limit())[0]


def text_chars(value) -> int:
    """At most the characters `str(value)` writes, or `format(value, spec)` before the spec's
    width and precision."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 12  # its repr: b'\x00'
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):  # in binary, '_' every four digits, signed and prefixed
        return abs(value).bit_length() * 5 // 4 + 8
    if isinstance(value, float):
        return FLOAT
    return REPR * size_of(value) + 24  # a container's repr: each item escaped, quoted


def _number(digits: str) -> int:
    # past 18 digits the value is past any limit, and int() refuses past 4300
    return int(digits) if len(digits) <= 18 else 10 ** 18


def spec_chars(spec: str) -> int:
    """At least a `{}`-format spec's width plus its precision (after its nested fields are
    filled in): the sum of its runs of digits, whatever the type's own grammar."""
    return sum(_number(d) for d in _DIGITS.findall(spec))


def percent_bound(fmt, values) -> int:
    """At most the characters `fmt % values` makes: its own text, and for each conversion its
    width, precision and value, matched to the values as Python matches them (`*` takes them
    from the values too). Where Python would stop with an error, what comes before."""
    if isinstance(fmt, (bytes, bytearray)):
        fmt = fmt.decode("latin-1")  # the same grammar, one character a byte
    positional = list(values) if isinstance(values, tuple) else [values]
    escape = ESCAPED if hasattr(fmt, "__html__") else 1  # Markup % escapes its values
    total, i = len(fmt), 0
    while (i := fmt.find("%", i) + 1) > 0:
        key = None
        if fmt.startswith("(", i):  # a mapping key, its parentheses nested as Python reads them
            depth, j = 1, i + 1
            while j < len(fmt) and depth:
                depth += (fmt[j] == "(") - (fmt[j] == ")")
                j += 1
            if depth:
                break
            key, i = fmt[i + 1 : j - 1], j
        m = _CONVERSION.match(fmt, i)
        width, precision, kind = m.groups()
        if m.end() == i + 1 and kind == "%" and key is None:  # '%%'
            i = m.end()
            continue
        i = m.end()
        if not kind or kind == "%":
            break
        for part in (width, precision):
            if part == "*":
                if not positional or not _integer(positional[0]):
                    return total
                total += abs(positional.pop(0))
            elif part:
                total += _number(part)
        if key is not None:
            value = values.get(key, "") if isinstance(values, dict) else values
        elif positional:
            value = positional.pop(0)
        else:
            break
        if kind in "ra":
            content = REPR * size_of(value) + 24
        elif kind in "s":
            content = text_chars(value)
        elif kind in "diouxX":
            content = text_chars(value) if _integer(value) else FLOAT
        elif kind in "eEfFgG":
            content = FLOAT
        elif kind == "c":
            content = 1
        else:  # Python: "unsupported format character"
            break
        total += content * escape
    return total


def _escaped(value) -> int:
    if isinstance(value, str):
        return ESCAPED * len(value)
    # a container's repr escaped: ten for a character at most (an escape sequence has no
    # character HTML escapes), and an item's quotes and separator (12 for `'', `)
    return (REPR + 2) * size_of(value) + 24


def filter_bound(name: str, value, args: tuple, kwargs: dict) -> int | None:
    """At most how many characters the filter `name` makes of `value` with these arguments;
    None for the filters that make no more than they read. `join` and `format` count as they
    make (chat_sandbox.py)."""
    def arg(i, key, default):
        return args[i] if len(args) > i else kwargs.get(key, default)

    def length(x):
        return len(x) if isinstance(x, str) else text_chars(x) if x is not None else 0

    if name == "string":
        return text_chars(value)
    if name in ("e", "escape", "forceescape", "xmlattr"):
        return _escaped(value)
    if name == "striptags":
        return text_chars(value)
    if name == "urlencode":  # a character's UTF-8 bytes, each written %XX
        return 3 * 4 * (len(value) if isinstance(value, str) else text_chars(value))
    if name == "urlize" and isinstance(value, str):
        # every word may become a link: its text twice, escaped, and the attributes
        attributes = 64 + ESCAPED * (length(arg(2, "target", None)) +
                                     length(arg(3, "rel", None)) + 16)
        return 2 * ESCAPED * len(value) + (len(value) // 2 + 1) * attributes
    if name == "tojson":  # counted as it is written; but its deepest line's indentation is
        indent = arg(1, "indent", None)  # made in one piece
        width = indent if _integer(indent) else len(indent) if isinstance(indent, str) else 0
        return max(width, 0) * measure(value, value_limit())[1]
    if name == "indent" and isinstance(value, str):
        width = arg(0, "width", 4)
        width = len(width) if isinstance(width, str) else max(int(width), 0)
        return len(value) + (sum(map(value.count, _LINE_BREAKS)) + 2) * width
    if name == "wordwrap" and isinstance(value, str):
        # a line per character at most (tabs expanded to 8), each ending in the wrap string
        chars = len(value) + 7 * value.count("\t") + 1
        return chars * (1 + length(arg(2, "wrapstring", None) or "\n"))
    if name == "center":
        width = arg(0, "width", 80)
        return text_chars(value) + (max(width, 0) if _integer(width) else 0)
    if name == "sum":
        return size_of(value) + size_of(arg(1, "start", 0))
    if name == "truncate" and isinstance(value, str):
        return len(value) + len(str(arg(2, "end", "...")))
    return None


def method_bound(name: str, self, args: tuple, kwargs: dict) -> int | None:
    """The same for a string's (or bytes') methods. `join` and `format` count as they make."""
    if not isinstance(self, (str, bytes, bytearray)):
        return None
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else 0
        return len(self) + (max(width, 0) if _integer(width) else 0)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(self) + self.count("\t") * (max(tab, 0) if _integer(tab) else 0)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(self) * max(1, max((size_of(v) for v in args[0].values()), default=0))
    if name == "encode":  # 'unicode_escape' writes ten bytes for a character
        return REPR * len(self) + 16
    if name == "hex":  # two digits a byte, and a separator
        return 3 * len(self)
    return None


def gather(items, sep, what: str, convert: bool, escape: int = 1) -> list:
    """The items `sep.join` will join, drawn one at a time and counted with the separators as
    they come: refused at the first that would pass the limit, however many are left (a
    generator's count cannot be known before). `convert`: non-strings are written with str(),
    as the `join` filter writes them (bounded first); `escape`: each character may be written
    escaped, as Markup writes it."""
    tally, kept = Tally(what), []
    for item in items:
        if kept:
            tally.add(len(sep) * escape)
        if not isinstance(item, (str, bytes, bytearray)):
            if convert and not hasattr(item, "__html__"):
                make(text_chars(item), what)
                item = str(item)
            else:  # join refuses it, or Markup writes it: at most its text
                tally.add(text_chars(item) * escape)
                kept.append(item)
                continue
        tally.add(len(item) * escape)
        kept.append(item)
    return kept


def check_numbers(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise Limit(f"{what} got the number {a!r} (limit {MAX_CHARS})")


def check_replace(s, old, new) -> None:
    """Bound `s.replace(old, new)` before it runs (the filter writes each with str() first):
    its matches counted where `s` and `old` are text of one kind, else one per character."""
    text = (str, bytes, bytearray)
    chars = len(s) if isinstance(s, text) else text_chars(s)
    matches = chars + 1
    if isinstance(s, text) and isinstance(old, text) and len(old) and \
            isinstance(s, str) == isinstance(old, str):
        matches = s.count(old)
    make(chars + matches * (len(new) if isinstance(new, text) else text_chars(new)), "replace")


def check_binop(operator: str, left, right) -> None:
    """Bound `left operator right` before it runs: sequences by what the result would print,
    integers by its bits, a %-format by its conversions."""
    sequences = (str, bytes, bytearray, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(n, int):
                make(size_of(seq) * max(n, 0), "'*'")
        if _integer(left) and _integer(right):
            _check_bits(left.bit_length() + right.bit_length(), "'*'")
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        make(size_of(left) + size_of(right), "'+'")
    elif operator == "**" and _integer(left) and _integer(right) and abs(left) > 1:
        _check_bits(abs(left).bit_length() * max(right, 0), "'**'")
    elif operator == "%" and isinstance(left, (str, bytes, bytearray)):
        make(percent_bound(left, right), "a %-format")


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise Limit(f"{what} would make an integer of {bits} bits (limit {MAX_INT_BITS})")
