"""Every command-line entry point of stagewise, in one package at the top of the layers.

- `main`     the `stagewise` script: generate, stages, and the commands below
- `trace`    `stagewise trace` (also the `trace` script): the shape flow of a run
- `bench`    `stagewise bench modes|batching|stages|soak` (`python -m stagewise.cli.bench` alone)
- `calc`     `stagewise calc`, the calculator (`python -m stagewise.cli.calc` alone)
- `command`  `run_command`: how every command ends (exit 0, 2 for bad input, 130 for Ctrl-C, 1 otherwise)

`pyproject.toml` names `stagewise.cli:main` and `stagewise.cli:trace_main`; `python -m stagewise.cli` runs `main`.
"""

from stagewise.cli.main import main, trace_main

__all__ = ["main", "trace_main"]
