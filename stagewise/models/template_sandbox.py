"""A jinja2 sandbox with limits, for chat templates read from model files.

A chat template is a small program that comes with the model file, written by whoever made the
file. jinja2's `SandboxedEnvironment` keeps it away from Python's insides (no `__class__`, no
files, no imports), but not from spending time and memory: two nested `range(100000)` loops run
for minutes, and `'x' * 10000000000` asks for 10 GB before anything is printed. A real template
loops over the messages and writes a few markers around each one, so this environment counts
what a render spends and stops it, with one line naming the limit, well before that:

- steps: loop iterations, and calls (macros, methods, `range`), each counted;
- sizes: `*`, `**`, `+`, `%`, `~`, list and dict literals, filters and method calls check the
  size of what they would build *before* building it, so no value grows past `limits.chars`
  (nested lists count every string they hold, however often they hold the same one);
- output: every character written, at the top or into a macro's or `{% set %}`'s buffer;
- time: a deadline, checked at every step (a last resort: the counts above stop every
  template we know of first);
- other templates: `include`, `import` and `extends` are refused when the template is compiled.

The counts live in a `RenderBudget`, one per render, that the compiled template finds in its
context. The hooks are jinja2's own (`intercepted_binops`, `call`, `finalize`, a code generator
subclass); nothing here runs a thread or a timer.
"""

import re
import time
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from functools import wraps

from jinja2 import TemplateError, nodes, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

BUDGET_KEY = "stagewise:budget"  # the context key of the render's budget (no template can spell it)
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


def _estimate(name: str, value, args: tuple, kwargs: dict, limit: int) -> int:
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


def _checked_literal(visit):
    """A code generator visitor that wraps a list, tuple or dict literal in `environment.built`."""

    def visitor(self, node, frame) -> None:
        if getattr(node, "ctx", "load") != "load":  # an assignment target: `a, b = ...`
            return visit(self, node, frame)
        self.write("environment.built(context, ")
        visit(self, node, frame)
        self.write(")")
        return None

    return visitor


class _LimitedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with the few places a render can grow routed through the budget:
    loops, `~`, list/tuple/dict literals, and the buffers of macros and `{% set %}` blocks."""

    def visit_For(self, node, frame) -> None:
        counter = node.iter.node if isinstance(node.iter, nodes.Call) else None
        if not (isinstance(counter, nodes.EnvironmentAttribute) and counter.name == "counted"):
            # `for x in items` -> `for x in environment.counted(context, items)`
            where = {"lineno": node.lineno, "environment": self.environment}
            function = nodes.EnvironmentAttribute("counted", **where)
            context = nodes.ContextReference(**where)
            node.iter = nodes.Call(function, [context, node.iter], [], None, None, **where)
        super().visit_For(node, frame)

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer(context)")

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat_parts(context, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    visit_List = _checked_literal(CodeGenerator.visit_List)
    visit_Tuple = _checked_literal(CodeGenerator.visit_Tuple)
    visit_Dict = _checked_literal(CodeGenerator.visit_Dict)


class _CountedBuffer(list):
    """The output buffer of a macro, a call block or a `{% set %}` block: every write counts."""

    def __init__(self, budget: RenderBudget):
        super().__init__()
        self.budget = budget

    def append(self, text) -> None:
        self.budget.write(text)
        super().append(text)

    def extend(self, texts) -> None:
        for text in texts:  # one at a time: a block's generator may yield without end
            self.append(text)


def _budget(context) -> RenderBudget:
    budget = context.parent.get(BUDGET_KEY)  # a render variable: in every derived context too
    if budget is None:
        raise TemplateLimitError("render through stagewise.models.template_sandbox.render")
    return budget


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """`ImmutableSandboxedEnvironment` whose renders count steps, sizes and output."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        super().__init__(finalize=_checked_output, **options)
        self.globals["range"] = _counted_range
        self.globals.pop("lipsum", None)  # random text of any length: no template needs it
        self.filters = {name: _checked_filter(name, f) for name, f in self.filters.items()}

    def set_filter(self, name: str, filter_fn) -> None:
        """Add or replace a filter, behind the same size checks as jinja2's own."""
        self.filters[name] = _checked_filter(name, filter_fn)

    def call_binop(self, context, operator: str, left, right):
        budget = _budget(context)
        if operator in ("*", "**") and all(isinstance(v, int) for v in (left, right)):
            bits = (
                abs(right) * abs(left).bit_length() if operator == "**" and right > 0 else 0
            ) + (left.bit_length() + right.bit_length() if operator == "*" else 0)
            if bits > INT_BITS:
                raise TemplateLimitError(f"'{operator}' would build an integer of {bits:,} bits")
        elif operator == "*":
            count = right if isinstance(right, int) else left
            sequence = left if isinstance(right, int) else right
            if isinstance(count, int):
                budget.build(budget.measure(sequence) * max(count, 0), "'*'")
        elif operator == "+":
            budget.build(budget.measure(left) + budget.measure(right), "'+'")
        elif operator == "%" and isinstance(left, str):
            budget.build(_estimate("format", left, (right,), {}, budget.limits.chars), "'%'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's spelling)
        budget = _budget(__context)
        budget.call()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str) and name in AMPLIFIERS:
            size = _estimate(name, owner, args, kwargs, budget.limits.chars)
            if size > budget.limits.chars:
                budget.build(size, f"'.{name}()'")
        result = super().call(__context, __obj, *args, **kwargs)
        budget.build(budget.measure(result), f"the result of {name or 'a call'}")
        return result

    def counted(self, context, iterable):
        budget = _budget(context)
        for item in iterable:
            budget.step()
            yield item

    def output_buffer(self, context) -> _CountedBuffer:
        return _CountedBuffer(_budget(context))

    def concat_parts(self, context, parts: tuple) -> str:
        budget = _budget(context)
        budget.build(sum(map(budget.measure, parts)), "'~'")
        return "".join(map(str, parts))

    def built(self, context, value):
        budget = _budget(context)
        budget.build(budget.measure(value), "a list or dict literal")
        return value


@pass_context
def _checked_output(context, value):
    """`{{ value }}`: checked before it is turned into text (a nested list prints every item)."""
    budget = _budget(context)
    budget.build(budget.measure(value), "an output")
    return value


@pass_context
def _counted_range(context, *args) -> range:
    """`range`, refused when it is longer than the steps left (each item would cost one)."""
    budget = _budget(context)
    numbers = range(*args)
    if len(numbers) > budget.steps_left:
        raise TemplateLimitError(
            f"range of {len(numbers):,} items: more than the {budget.steps_left:,} steps left"
        )
    return numbers


def _checked_filter(name: str, filter_fn):
    """`filter_fn`, refusing to build a value past the render's limit.

    The wrapper takes the context (to find the budget) and hands the original what it asked
    for (the context, the evaluation context, the environment or nothing), as jinja2 would.
    """
    passes = getattr(getattr(filter_fn, "jinja_pass_arg", None), "name", None)

    @pass_context
    @wraps(filter_fn)
    def checked(context, *args, **kwargs):
        budget = _budget(context)
        limit = budget.limits.chars
        if args and name in WALKERS and hasattr(args[0], "__len__"):
            budget.steps(len(args[0]), f"filter '{name}'")
        elif args and name in TEXT_WALKERS and isinstance(args[0], str):
            budget.steps(len(args[0]) // 10, f"filter '{name}'")
        if name in AMPLIFIERS and args:
            value, rest = args[0], args[1:]
            if name == "join":  # the filter's (items, separator) is the method's separator.join
                args = (value if hasattr(value, "__len__") else list(value), *rest)
                value, rest = (rest[0] if rest else kwargs.get("d", "")), (args[0],)
            size = _estimate(name, value, tuple(rest), {} if name == "join" else kwargs, limit)
            if size > limit:
                budget.build(size, f"filter '{name}'")
        first = {"context": (context,), "eval_context": (context.eval_ctx,)}.get(passes, ())
        first = (context.environment,) if passes == "environment" else first
        result = filter_fn(*first, *args, **kwargs)
        budget.build(budget.measure(result), f"filter '{name}'")
        return result

    return checked


def refuse_other_templates(ast: nodes.Template) -> None:
    """A chat template stands alone: `include`, `import` and `extends` would read other files."""
    for node in ast.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        kind = type(node).__name__.lower().replace("fromimport", "from-import")
        raise TemplateLimitError(
            f"line {node.lineno}: '{kind}' loads another template; a chat template must stand alone"
        )


def render(template, limits: Limits, **variables) -> str:
    """Render a template compiled by `LimitedSandbox`, within `limits`; streams the output and
    stops as soon as it is too long."""
    budget = RenderBudget(limits)
    pieces = []
    for piece in template.generate(**variables, **{BUDGET_KEY: budget}):
        budget.write(piece)
        pieces.append(piece)
    return "".join(pieces)
