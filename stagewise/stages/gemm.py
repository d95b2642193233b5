"""Moved: the calibrated CPU GEMM forms are the projections' torch tier, `stages/gemm_torch.py`.

This name stays for one release, for code that still imports `stagewise.stages.gemm`.
"""

from stagewise.stages.gemm_torch import (  # noqa: F401
    BLOCK_N,
    BUCKET_M,
    CPU_FORMS,
    FORM_FNS,
    FORMS,
    SMALL_M,
    CpuForms,
    bucket,
    calibrate,
    calibrate_for,
    gemm,
    gemm_blocked,
    gemm_plain,
    gemm_transposed,
    is_out_major,
    time_forms,
)
