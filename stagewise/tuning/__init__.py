"""What this machine was measured to like: choices timed here, once, and remembered.

    gemm_forms.py        the CPU GEMM forms (plain, transposed, blocked): which way of asking the
                         BLAS for `x @ w` streams the model's weights fastest, per row count
    gemm_forms_cache.py  that answer kept on disk, per CPU, torch version, threads and shapes
    cpu_load.py          how busy the machine was while measuring (a contended timing is not kept)
    packed_forms_cache.py  the torch tier's repacked 4/8-bit weights, kept per weight file, torch
                         version and CPU layout, so a second start reads them instead of rebuilding

It sits between the packed-weight codecs (`quant/`) and the stages: the projections' torch tier
(`stages/gemm_torch.py`) asks it which form to use; `models/prepare.py` decides when to measure.
"""
