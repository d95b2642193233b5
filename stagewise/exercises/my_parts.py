"""The student's answers, kept in one file for the capstone: `my_parts.py` beside the notebooks.

A check cell in notebooks 00-12a that passes `save=True` (`check("09.allocate", my_allocate,
save=True)`) writes, when its check passes, the source of the function (or Triton kernel) into
`my_parts.py` in the notebook's folder, under the exercise's name, with what it needs from the
notebook: the functions it calls that the notebook defines, the constants it reads, the modules and
names it imports. A part saved again replaces its old block. Notebook 16 loads the file (`load`):
each block runs in its own namespace, so two notebooks' helpers of the same name never collide.

The file is the student's (git ignores it); nothing here ever writes a shipped solution into it.
"""

import ast
import inspect
import re
import textwrap
import types
from pathlib import Path

FILE_NAME = "my_parts.py"
HEADER = '''"""Your exercise answers, kept by the notebooks' check cells (check(..., save=True)) for notebook 16.

Each block is one exercise's answer, with what it needs; notebook 16 runs each block on its own.
"""

import stagewise.kernels  # noqa: F401 - first: chooses the GPU or Triton's CPU interpreter
'''
BLOCK = re.compile(r"^# ---- (?P<name>\d\d[a-z]?\.\w+)\n(?P<body>.*?)^# ---- end (?P=name)\n", re.M | re.S)


def path_in(folder=None) -> Path:
    return Path(folder if folder is not None else Path.cwd()) / FILE_NAME


def _function_of(obj):
    """The Python function of a function or a Triton kernel (`@triton.jit` wraps it in `.fn`)."""
    while not inspect.isfunction(obj) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj if inspect.isfunction(obj) else None


def _names_read(fn) -> set[str]:
    """Every global name the function's source mentions: body, signature annotations, decorators."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | set(fn.__code__.co_names)


def _needs(fn, seen: set[str]) -> list[str]:
    """Source lines for what `fn` reads from its notebook's globals, dependencies first."""
    lines, module = [], fn.__module__
    for name in sorted(_names_read(fn)):
        if name in seen or name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        seen.add(name)
        inner = _function_of(value)
        if isinstance(value, types.ModuleType):
            lines.append(f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}")
        elif inner is not None and inner.__module__ == module:  # defined in the notebook too: keep its source
            lines += _needs(inner, seen) + [inspect.getsource(value if inner is value else inner)]
        elif getattr(value, "__module__", None) not in (None, module) and hasattr(value, "__qualname__"):
            lines.append(f"from {value.__module__} import {value.__qualname__.split('.')[0]} as {name}")
        elif isinstance(value, (int, float, str, bool, tuple)):
            lines.append(f"{name} = {value!r}")
    return lines


def source_of(name: str, obj) -> str:
    """The block that keeps exercise `name`'s answer `obj` (a function or a Triton kernel)."""
    fn = _function_of(obj)
    if fn is None:
        raise TypeError(f"{name}: only a function or a Triton kernel can be kept, not {type(obj).__name__}")
    own = inspect.getsource(fn)
    needs = _needs(fn, {fn.__name__})
    body = "\n".join(needs + ["", own.rstrip(), "", f"PART = {fn.__name__}", ""])
    return f"# ---- {name}\n{body}\n# ---- end {name}\n"


def save(name: str, obj, folder=None) -> Path:
    """Write (or replace) exercise `name`'s block in my_parts.py; -> the file."""
    path = path_in(folder)
    text = path.read_text() if path.is_file() else HEADER
    block = source_of(name, obj)
    found = [m for m in BLOCK.finditer(text) if m.group("name") == name]
    if found:
        text = text[: found[0].start()] + block + text[found[0].end() :]
    else:
        text = text.rstrip("\n") + "\n\n\n" + block
    path.write_text(text)
    return path


def load(folder=None) -> tuple[dict, dict]:
    """(exercise name -> the student's function, exercise name -> why its block did not load)."""
    path = path_in(folder)
    if not path.is_file():
        return {}, {}
    text = path.read_text()
    header = text[: BLOCK.search(text).start()] if BLOCK.search(text) else text
    parts, broken = {}, {}
    for match in BLOCK.finditer(text):
        name = match.group("name")
        first_line = text.count("\n", 0, match.start("body"))
        padded = "\n" * first_line + match.group("body")  # line numbers of the file: inspect reads it there
        namespace = {"__name__": f"my_parts_{name.replace('.', '_')}", "__file__": str(path)}
        try:
            exec(compile(header, str(path), "exec"), namespace)
            exec(compile(padded, str(path), "exec"), namespace)
            parts[name] = namespace["PART"]
        except Exception as err:  # the student's file: say what broke, keep the other parts
            broken[name] = f"{type(err).__name__}: {err}"
    return parts, broken
