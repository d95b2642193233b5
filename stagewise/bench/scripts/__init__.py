"""Measurements run as scripts, `python -m stagewise.bench.scripts.<name>`, whose numbers docstrings quote."""
