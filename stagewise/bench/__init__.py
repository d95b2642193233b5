"""Measuring and predicting: benchmarks that time the engine, and the calculator that says what to expect.

The calculator (`stagewise calc`) is four short modules read in this order:

- `hardware`     peak FLOP/s, memory bandwidth and capacity of a few GPUs, and a probe of this machine
- `calc_counts`  parameters, FLOPs and KV-cache bytes: exact counts and the seeds' shortcuts
- `calc_steps`   prefill / decode / naive steps on the roofline, and the largest batch that fits
- `calc_seeds`   the seeds' worked numbers (Llama 3 405B) next to ours
- `calc`         the facade: `analyze()`, `summarize()`; `calc_cli` and `calc_plots` present it
"""
