"""What each `stagewise bench <command>` runs: settings, the measurement, its table and its plot.

`stagewise/cli/bench.py` parses the command line and calls these; `stages.py` is `bench stages`.
"""
