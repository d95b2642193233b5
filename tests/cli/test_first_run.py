"""A class's first minute at a terminal: `python -m stagewise` and `--version` work, every help page fits
80 columns without cutting a word or an option name, and `--model tiny` says its weights are random."""

import importlib
import os
import subprocess
import sys

import click
import typer.core
import typer.main

ENV = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
ENV.pop("TYPER_USE_RICH", None)


def run(*args: str, columns: int = 80, quiet: bool = True) -> subprocess.CompletedProcess:
    env = {**ENV, "COLUMNS": str(columns)}
    if quiet:
        env["STAGEWISE_QUIET"] = "1"
    else:
        env.pop("STAGEWISE_QUIET", None)
    return subprocess.run([sys.executable, "-m", "stagewise", *args], capture_output=True, text=True, env=env)


def test_python_dash_m_stagewise_and_version():
    from stagewise import __version__

    res = run("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"stagewise {__version__} (torch "), res.stdout
    assert len(res.stdout.splitlines()) == 1


def help_pages(command: click.Command, ctx: click.Context):
    """(path, help text) of a command and of every command under it."""
    yield ctx.command_path, command.get_help(ctx)
    for name, sub in getattr(command, "commands", {}).items():
        yield from help_pages(sub, click.Context(sub, info_name=name, parent=ctx, terminal_width=80))


def test_every_help_page_fits_80_columns_whole(monkeypatch):
    """Below 100 columns the help is click's plain layout (stagewise/cli/__init__.py): every line fits,
    no option name or word is cut with an ellipsis, and a command's line in a list is whole."""
    commands = importlib.import_module("stagewise.cli.main")
    commands._register_commands()
    monkeypatch.setattr(typer.core, "HAS_RICH", False)  # what TYPER_USE_RICH=0 sets at import
    root = typer.main.get_command(commands.app)
    pages = dict(help_pages(root, click.Context(root, info_name="stagewise", terminal_width=80)))
    assert {"stagewise serve", "stagewise trace", "stagewise bench modes"} <= set(pages)
    for path, text in pages.items():
        lines = text.splitlines()
        assert max(map(len, lines)) <= 80, (path, max(lines, key=len))
        assert "…" not in text, path
        cut = [line for line in lines if line.rstrip().endswith("...") and not line.startswith("Usage:")]
        assert not cut, (path, cut)
    assert "--tensor-parallel-size, --tp <int>" in pages["stagewise serve"]
    assert "--speculative-config <str>" in pages["stagewise trace"]


def test_the_help_switch_follows_the_terminal():
    """The real command at 80 columns: the plain layout (no Rich panel, nothing cut). (At 100 and more,
    Rich's panels: test_every_help_page... checks the plain one; Rich's is typer's own.)"""
    narrow = run("serve", "--help", columns=80)
    assert narrow.returncode == 0 and "╭" not in narrow.stdout and "…" not in narrow.stdout, narrow.stdout
    assert "--prefix-caching / --no-prefix-caching" in narrow.stdout


def test_tiny_says_its_weights_are_random(monkeypatch, capsys):
    from stagewise.cli.options import load_llm

    monkeypatch.delenv("STAGEWISE_QUIET", raising=False)
    load_llm("tiny", dtype=None, stage_backend=[])
    err = capsys.readouterr().err
    assert "note: tiny has random weights (seeded): its text is noise; its shapes and speed are real" in err
    monkeypatch.setenv("STAGEWISE_QUIET", "1")
    load_llm("tiny", dtype=None, stage_backend=[])
    assert "random weights" not in capsys.readouterr().err
