"""The device check's GPU microbenchmarks: every Triton kernel at real model shapes, timed with CUDA events.

- `kernel_bench`     each kernel against its naive stage and the stock alternative (cuBLAS, SDPA, copy bandwidth)
- `device_timer`     timing one kernel call honestly (events, working sets beyond L2, graph replay)
- `decode_fusions`, `ffn_fusion`   the decode fusions against their two separate launches
- `quant_decode`     the W4A16 decode GEMV on its packed bytes

`device_sections.py` runs them in the check's `kernels` section; on a CPU they run in its dry run.
"""
