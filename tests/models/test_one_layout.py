"""A GGUF loaded for the torch tier holds each packed weight once: the file's codes are released
where the int4pack form holds them, and rebuilt exactly when another reader asks.

The tiny checkpoint (tests/checkpoints.py) stores its projections as Q4_1 and its tied embedding
as Q8_0, SmolLM2's layout; the float32 load of the same file is the reference.
"""

import gguf
import pytest
import torch

from stagewise.engine.llm import LLM
from stagewise.quant.dequantize import dequantize
from stagewise.stages import embedding
from tests.checkpoints import hf_tiny_model, write_gguf


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "tiny-Q4_1.gguf"
    return write_gguf(path, hf_tiny_model(seed=3), projection_type=gguf.GGMLQuantizationType.Q4_1)


def test_torch_tier_holds_one_layout_and_the_files_values(tiny_q4_1):
    packed = LLM(str(tiny_q4_1), backend="torch", mode="kv", device="cpu", quantization="auto")
    floats = LLM(str(tiny_q4_1), backend="naive", mode="kv", device="cpu", quantization="none")
    pw, fw = packed.loaded.weights, floats.loaded.weights
    released = [w for w in pw.packed() if not w.codes_held]
    assert released, "no packed weight released its codes"
    for w in released:
        assert isinstance(w.prepared["torch"], tuple)  # an int4pack form: exact
    assert pw.held_bytes() < pw.num_bytes() + pw.prepared_bytes()  # codes not held twice
    code_bytes = sum(w.shape[0] * w.shape[1] * w.bits // 8 for w in released)
    assert pw.held_bytes() == pw.num_bytes() + pw.prepared_bytes() - code_bytes
    for lp, lf in zip(pw.layers, fw.layers):  # rebuilt codes: still the file's numbers
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            assert torch.equal(dequantize(getattr(lp, name)), getattr(lf, name)), name
    ids = torch.tensor([5, 0, 5])
    assert torch.equal(embedding.naive(ids, pw.embed), fw.embed[ids])  # rows of the table


def test_naive_tier_keeps_the_file_layout(tiny_q4_1):
    llm = LLM(str(tiny_q4_1), backend="naive", mode="kv", device="cpu", quantization="auto")
    w = llm.loaded.weights
    assert all(p.codes_held and not p.prepared for p in w.packed())
    assert w.held_bytes() == w.num_bytes()


def test_a_weight_another_tier_reads_keeps_its_codes(tiny_q4_1):
    """torch projections beside a naive LM head: the tied table is read by the naive tier (and
    the embedding), so it keeps the file's codes; the projections hold int4pack only."""
    llm = LLM(
        str(tiny_q4_1),
        backend="torch",
        stage_backends={"lm_head": "naive"},
        mode="kv",
        device="cpu",
        quantization="auto",
    )
    w = llm.loaded.weights
    assert w.lm_head.codes_held and not w.lm_head.prepared
    assert not w.layers[0].w_qkv.codes_held
