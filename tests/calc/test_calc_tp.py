"""`calc --tp N`: per-device memory and the ring all-reduce's cost, checked by hand on the seeds' 405B."""

import json

import pytest

from stagewise.calc.hardware import HARDWARE
from stagewise.calc.tensor_parallel import INTERCONNECTS, Interconnect, analyze_tp, ring_all_reduce_time
from stagewise.config import PRESETS
from stagewise.errors import StagewiseError
from tests.calc.test_calc import run_calc

L405 = PRESETS["llama-3-405b"]


def test_ring_all_reduce_by_hand():
    link = Interconnect("test link", bandwidth=100e9, latency=10e-6)
    t = ring_all_reduce_time(32768, 8, link)  # 2*7/8 * 32768 B = 57344 B at 100 GB/s = 0.57344 µs, + 10 µs
    assert t.value == pytest.approx(10e-6 + 57344 / 100e9)
    assert ring_all_reduce_time(1e9, 2, link).value == pytest.approx(1e9 / 100e9 + 10e-6)  # 2(N-1)/N = 1 at N=2


def test_405b_on_8_gpus_per_device():
    t = analyze_tp(L405, HARDWARE["h200"], 8, "bf16", 2, context=8192, batch=1, link=INTERCONNECTS["nvlink4"])
    assert (t.local.num_heads, t.local.num_kv_heads, t.local.intermediate_size) == (16, 1, 53248 // 8)
    assert t.weights_per_device.value == pytest.approx(2 * L405.num_parameters() / 8, rel=0.001)  # ~101 GB
    assert t.kv_per_token_per_device.value == 2 * 126 * 1 * 128 * 2  # its 1 of 8 KV heads
    assert t.decode_message.value == 16384 * 2  # ~32 KB: one token's hidden vector in bf16
    assert t.all_reduces_per_step.value == 2 * 126 + 1
    assert t.decode_latency_share.value > 0.9  # latency-bound
    assert t.capacity.free_for_kv.value > 0  # 101 GB fits a 141 GB H200 ...
    h100 = analyze_tp(L405, HARDWARE["h100"], 8, "bf16", 2, context=8192, batch=1, link=INTERCONNECTS["nvlink4"])
    assert h100.capacity.free_for_kv.value == 0  # ... not an 80 GB H100


def test_a_size_that_does_not_split_names_the_valid_ones():
    with pytest.raises(StagewiseError, match="N in 1, 2, 4, 8"):
        analyze_tp(L405, HARDWARE["h100"], 3, "bf16", 2, 8192, 1, INTERCONNECTS["nvlink4"])


def test_cli(tmp_path):
    out = tmp_path / "calc.json"
    res = run_calc("--tp", "8", "--hardware", "h200", "--context", "8192", "--json-out", str(out))
    assert res.returncode == 0, res.stderr
    for text in ("Tensor parallelism: 8 x H200 SXM", "32,768 B", "latency-bound", "253 all-reduces"):
        assert text in res.stdout, text
    assert json.loads(out.read_text())["tensor_parallel"]["decode_message"]["value"] == 32768
    bad = run_calc("--tp", "2", "--devices", "2")
    assert bad.returncode == 2 and "not both" in bad.stderr
