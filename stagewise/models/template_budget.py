"""What a chat template's render may spend, and how the sandbox measures it.

`Limits` says how much; a `RenderBudget` counts one render against them: loop steps, calls,
the characters and items every operation builds, and the characters written. `weight` is the
size of a value as text would show it (a list holding one 1 MB string a thousand times prints
as 1 GB), and `estimate` is about the largest size a method or filter that amplifies its input
(`center`, `replace`, `join`, `format`, ...) can build, so it is checked before it is built.
`template_sandbox.py` calls these from jinja2's hooks.
"""

import re
import time
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field

from jinja2 import TemplateError
from jinja2.utils import Namespace

INT_BITS = 1 << 16  # the largest integer `*` and `**` may build (about 20,000 digits)
# filters that walk their input item by item in Python: each item costs a loop step
WALKERS = frozenset(
    "sort unique groupby dictsort map select reject selectattr rejectattr sum min max list "
    "batch slice join reverse pprint".split()
)
TEXT_WALKERS = frozenset({"urlize", "wordwrap", "striptags"})  # a step per ~10 characters
# methods and filters that build a value much larger than their arguments
AMPLIFIERS = frozenset(
    "center ljust rjust zfill expandtabs indent wordwrap slice batch tojson replace join "
    "translate format format_map".split()
)


class TemplateLimitError(TemplateError):
    """A render went past one of its limits."""


@dataclass
class Limits:
    """What one render may spend."""

    steps: int = 100_000  # loop iterations
    calls: int = 10_000  # calls of macros, methods and functions (a macro call costs ~50 steps)
    chars: int = 1_000_000  # the largest value one operation may build (characters and items)
    # what all operations together may build, and what all writes together may write, as a
    # multiple of `chars`: a template that builds 1 MB strings in a loop stops after a few
    built_factor: int = 16
    seconds: float = 10.0  # wall-clock deadline, checked at every step and call


@dataclass
class RenderBudget:
    """The counts of one render against its `Limits`."""

    limits: Limits
    steps_left: int = 0
    calls_left: int = 0
    built_left: int = 0
    written_left: int = 0
    deadline: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.steps_left = self.limits.steps
        self.calls_left = self.limits.calls
        self.built_left = self.limits.built_factor * self.limits.chars
        self.written_left = self.limits.built_factor * self.limits.chars
        self.deadline = time.monotonic() + self.limits.seconds

    def step(self) -> None:
        """One loop iteration."""
        self.steps_left -= 1
        if self.steps_left < 0:
            raise TemplateLimitError(
                f"the template ran more than {self.limits.steps:,} loop iterations"
            )
        self.check_time()

    def steps(self, count: int, what: str) -> None:
        """`count` loop steps at once (a filter that walks a list)."""
        if count > self.steps_left:
            raise TemplateLimitError(
                f"{what} walks {count:,} items: more than the {self.steps_left:,} steps left"
            )
        self.steps_left -= count
        self.check_time()

    def call(self) -> None:
        """One call."""
        self.calls_left -= 1
        if self.calls_left < 0:
            raise TemplateLimitError(f"the template made more than {self.limits.calls:,} calls")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran longer than {self.limits.seconds:g} s")

    def write(self, text: str) -> None:
        """Text written to the output or into a buffer (a macro's, which its caller writes
        again)."""
        self.written_left -= len(text)
        if self.written_left < 0:
            total = self.limits.built_factor * self.limits.chars
            raise TemplateLimitError(f"the template wrote more than {total:,} characters")

    def build(self, size: int, what: str) -> None:
        """An operation is about to build (or has built) a value of `size` characters and
        items."""
        if size > self.limits.chars:
            raise TemplateLimitError(
                f"{what} would hold more than {self.limits.chars:,} characters or items"
            )
        self.built_left -= size
        if self.built_left < 0:
            total = self.limits.built_factor * self.limits.chars
            raise TemplateLimitError(f"the template built more than {total:,} characters in all")

    def measure(self, value) -> int:
        """`weight(value)`, counted up to just past the one-value limit."""
        return weight(value, self.limits.chars)


_SCALARS = (bool, float, type(None))  # print in a few characters
_CONTAINERS = (Mapping, list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)


def weight(value, limit: int) -> int:
    """Characters and items in `value`, nested lists and dicts included; stops past `limit`.

    A list that holds one 1 MB string a thousand times is small in memory but prints as 1 GB,
    so every reference counts. Each item costs one, a string its length, an integer its digits.
    """
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, Mapping):
            item = (*item.keys(), *item.values())
        elif isinstance(item, ItemsView):
            item = tuple(x for pair in item for x in pair)
        elif isinstance(item, Namespace):  # prints every attribute it holds
            item = (object.__getattribute__(item, "_Namespace__attrs"),)
        elif not isinstance(item, _CONTAINERS):  # the value itself is a leaf
            item, total = (item,), total - 1
        total += 1
        for x in item:  # one level, with the common leaves inline (this loop is the cost)
            kind = type(x)
            if kind is str:
                total += len(x)
            elif kind is int:
                total += 1 + (x.bit_length() * 3 // 10 if x.bit_length() > 64 else 0)
            elif kind in _SCALARS:
                total += 1
            elif isinstance(x, (*_CONTAINERS, Namespace)):
                stack.append(x)
            elif isinstance(x, str):  # Markup and other str subclasses
                total += len(x)
            else:
                total += 1
    return total


_FORMAT_NUMBER = re.compile(r"\d+")


def _depth(value, limit: int) -> int:
    """How deeply lists and dicts nest in `value` (tojson indents each level)."""
    deepest, stack, seen = 0, [(value, 1)], 0
    while stack and seen <= limit:
        item, depth = stack.pop()
        seen += 1
        if isinstance(item, Mapping | list | tuple):
            deepest = max(deepest, depth)
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, Mapping) else item)
            )
    return deepest


def estimate(name: str, value, args: tuple, kwargs: dict, limit: int) -> int:
    """About the largest size `value.name(*args, **kwargs)` (or filter `name`) can build."""
    given = (*args, *kwargs.values())
    ints = [abs(a) for a in given if isinstance(a, int) and not isinstance(a, bool)]
    widest = max(ints, default=0)
    if widest > limit:  # a width, a count or an indent beyond every limit
        return widest
    size = weight(value, limit) + sum(weight(a, limit) for a in given)
    longest = max((len(a) for a in given if isinstance(a, str)), default=0)
    if name == "tojson":  # every item on its own line, indented once per level
        return size * (2 + widest * _depth(value, limit))
    if not isinstance(value, str):  # slice(n), batch(n) add up to n lists or fill items
        return size + widest
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        return len(value) + (value.count(args[0]) + 1) * len(args[1])
    if name == "indent":  # a prefix on every line
        return len(value) + (value.count("\n") + 1) * max(widest, longest)
    if name == "wordwrap":  # a break string after every `width` characters
        return len(value) + (len(value) // max(widest, 1) + 1) * max(longest, 1)
    if name == "expandtabs":
        return len(value) * max(widest, 8)
    if name == "translate" and args and isinstance(args[0], Mapping):
        return len(value) * max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
    if name in ("format", "format_map"):  # '{:>1000000000}' and '%1000000000s' hold their widths
        numbers = _FORMAT_NUMBER.findall(value)
        return size + sum(int(n) if len(n) < 12 else limit + 1 for n in numbers)
    if name == "join":  # value is the separator
        items = args[0] if args else ()
        return size + len(value) * (len(items) if hasattr(items, "__len__") else limit)
    return size + widest  # center, ljust, rjust, zfill: the width at most
