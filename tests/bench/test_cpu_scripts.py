"""The packed-GEMM scripts on tiny inputs: `bench/scripts/packed_gemm.py` (the integer-dot kernel
against PyTorch's int4 kernel by M) and `bench/scripts/decode_profile.py` (a decode step against
the read bandwidth) run end to end and write what they measured. (Their real runs use 8B-shaped
weights: never here.)"""

import json
import sys

import gguf
import pytest
import torch

from stagewise.bench.scripts import decode_profile, packed_gemm
from stagewise.cpu import build
from stagewise.stages import dequant_gemm_torch
from tests.checkpoints import hf_tiny_model, write_gguf

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the kernel is not built"),
    pytest.mark.usefixtures("int8_kernels"),  # opt-in: STAGEWISE_CPU_KERNELS=1
]


def test_packed_gemm_times_both_kernels_by_m(tmp_path, monkeypatch, capsys):
    out = tmp_path / "packed_gemm.json"
    argv = ["packed_gemm", "--threads", "1", "--shapes", "256x64", "--ms", "1,3", "--repeats", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    threads = torch.get_num_threads()
    packed_gemm.main()
    assert torch.get_num_threads() == threads
    runs = json.loads(out.read_text())["runs"]
    assert [(r["m"], r["threads"]) for r in runs] == [(1, 1), (3, 1)]
    for r in runs:
        assert r["int8_dot"]["median_ms"] > 0 and r["int4pack"]["median_ms"] > 0
        assert r["int4pack_over_int8_dot"] == r["int4pack"]["median_ms"] / r["int8_dot"]["median_ms"]
    assert capsys.readouterr().out.count("int8_dot") == 2


def test_decode_profile_splits_a_step_and_compares_the_kernels(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf", hf_tiny_model(seed=4), projection_type=gguf.GGMLQuantizationType.Q4_0)
    threads = torch.get_num_threads()
    try:
        r = decode_profile.run(str(model), threads=1, tokens=4, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert r["read_GBps"]["sum"] > 0 and r["read_GBps"]["stream"] > 0
    assert r["floor_ms"]["stream"] == pytest.approx(1e3 * r["decode_bytes"] / (r["read_GBps"]["stream"] * 1e9))
    proj = r["projections_alone"]
    assert proj["weights"] > 0 and proj["ab_sample"]["int4pack_ms"] > 0 and proj["ab_sample"]["torch_tier_ms"] > 0
    assert "qkv_proj" in r["traced_step"]["stages_ms"] and r["traced_step"]["outside_stages_ms"] >= 0
    text = decode_profile.report(r)
    assert "decode step" in text and "int4pack" in text and "outside stages" in text


def test_the_profiles_stock_copy_holds_pytorchs_form():
    w = packed_gemm.random_q4_0(96, 32, seed=0)
    stock = decode_profile.stock_copy(w)
    assert dequant_gemm_torch.form_name(w) == "rows8" and len(stock.prepared["torch"]) == 2  # int4pack
    x = torch.randn(2, 96)
    # two roundings of the same product (int8 vs bfloat16 activations), each ~1 % of the output range
    int8 = dequant_gemm_torch.gemm(x, w)
    assert (dequant_gemm_torch.gemm(x, stock) - int8).abs().max() <= 0.03 * int8.abs().max()
