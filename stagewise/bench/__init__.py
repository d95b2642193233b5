"""Benchmarks: they time the engine, its stages and its kernels, and write JSON + PNG results.

- `modes`, `batching`, `stage_bench`, `soak`   the `stagewise bench modes|batching|stages|soak` runs
- `kernel_bench`, `decode_gemm`, `device_timer` every Triton kernel at real model shapes, timed with CUDA events
- `cpu_forms`, `decode_overhead`               the CPU formulations, and where a decode token's time goes
- `perplexity`, `english_text`                 weights kept quantized vs float32: perplexity of a fixed text, greedy
                                               agreement (`stagewise bench perplexity`)
- `hf_baseline`, `workloads`, `timing`, `machine`, `plots`   what the runs share

What to expect before timing anything is the calculator's job (`stagewise.calc`); the command line is
`stagewise/cli/bench.py`.
"""
