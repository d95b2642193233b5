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

The counts live in a `RenderBudget` (`template_budget.py`), one per render, that the compiled
template finds in its context. The hooks are jinja2's own (`intercepted_binops`, `call`,
`finalize`, a code generator subclass); nothing here runs a thread or a timer.
"""

from functools import wraps

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stagewise.models.template_budget import (
    AMPLIFIERS,
    INT_BITS,
    TEXT_WALKERS,
    WALKERS,
    Limits,
    RenderBudget,
    TemplateLimitError,
    estimate,
)

BUDGET_KEY = "stagewise:budget"  # the context key of the render's budget (no template can spell it)


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
            budget.build(estimate("format", left, (right,), {}, budget.limits.chars), "'%'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's spelling)
        budget = _budget(__context)
        budget.call()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str) and name in AMPLIFIERS:
            size = estimate(name, owner, args, kwargs, budget.limits.chars)
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
            size = estimate(name, value, tuple(rest), {} if name == "join" else kwargs, limit)
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
