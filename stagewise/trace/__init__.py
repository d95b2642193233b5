"""The shape tracer and its outputs.

    from stagewise.trace import Tracer
    with Tracer() as tracer:
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))

`Tracer` records (tracer.py); `to_json` / `to_chrome` export (export.py);
`render_tree`, `render_table`, `render_markdown` draw (render_*.py); the
`trace` command is `stagewise/cli/trace.py`. The names are loaded on first use: the engine
imports `stagewise.trace.hooks` while the stages are still importing, so this
package must not import the tracer (which imports the stages) eagerly.
"""

import importlib

_EXPORTS = {
    "Tracer": "stagewise.trace.tracer",
    "TRACE_SCHEMA": "stagewise.trace.export",
    "to_json": "stagewise.trace.export",
    "to_chrome": "stagewise.trace.export",
    "render_tree": "stagewise.trace.render_tree",
    "render_table": "stagewise.trace.render_table",
    "render_markdown": "stagewise.trace.render_table",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stagewise.trace' has no attribute {name!r}")
