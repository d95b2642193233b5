"""Benchmarks: they time the engine and its stages, and write JSON + PNG results.

- `commands/`  what `stagewise bench modes|batching|stages|soak|serve|spec|quant|perplexity` runs,
               one module per command, with the parts only that command uses beside it
               (`serve_client`, `serve_process`, `serve_report`, `spec_report`, `spec_steps`)
- `harness/`   what the runs share: the timer (`timing`), the machine a number was measured on
               (`machine`), progress lines, plots, seeded workloads, the perplexity text, the
               transformers baseline, greedy agreement, Ctrl-C bursts, where a decode token's time goes
- `scripts/`   measurements run as `python -m stagewise.bench.scripts.<name>`: the CPU formulations
               (`cpu_forms`), a launcher's host cost (`launch_overhead`), packed vs float32 weights
               (`weight_formats`)

The GPU microbenchmarks (every Triton kernel at real model shapes, timed with CUDA events) belong to
the device check: `stagewise/devtools/gpu/`. What to expect before timing anything is the
calculator's job (`stagewise.calc`); the command line is `stagewise/cli/bench.py`.
"""
