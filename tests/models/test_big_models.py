"""Loading big models honestly: tensor by tensor in the target dtype, and a refusal with numbers when they cannot fit.

The 7B file here is only a header: llama.cpp's metadata and tensor table of Llama 2 7B, followed by a
sparse hole where the 13.5 GB of float16 weights would be (nothing is written, nothing is read).
"""

import os

import gguf
import numpy as np
import pytest
import torch

import stagewise.models.memory as memory
from stagewise.errors import StagewiseError
from stagewise.models.gguf_loader import load_gguf
from stagewise.models.hf_loader import load_hf_dir
from stagewise.models.registry import load_model
from tests.checkpoints import hf_tiny_model, write_gguf, write_hf_dir, write_tiny_bpe_tokenizer

# Llama 2 7B: vocab 32000, hidden 4096, FFN 11008, 32 layers, 32 heads (no GQA), untied LM head.
V, D, F, L = 32000, 4096, 11008, 32
LLAMA2_7B_PARAMS = 2 * V * D + L * (2 * D + 4 * D * D + 3 * D * F) + D  # = 6_738_415_616, as published


def write_header_only_gguf(path, q4_0: bool = False) -> int:
    """A Llama 2 7B GGUF whose tensors are declared (float16; `q4_0`: its matrices Q4_0) but never
    written; returns the file size."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(32)
    w.add_head_count_kv(32)
    w.add_vocab_size(V)
    write_tiny_bpe_tokenizer(w)
    shapes = {"token_embd.weight": (V, D), "output.weight": (V, D), "output_norm.weight": (D,)}
    for i in range(L):
        b = f"blk.{i}."
        shapes |= {b + n: (D, D) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")}
        shapes |= {b + "ffn_gate.weight": (F, D), b + "ffn_up.weight": (F, D), b + "ffn_down.weight": (D, F)}
        shapes |= {b + "attn_norm.weight": (D,), b + "ffn_norm.weight": (D,)}
    nbytes = {}
    for name, shape in shapes.items():
        if q4_0 and len(shape) == 2:  # 18 bytes per block of 32 weights
            nbytes[name] = shape[0] * shape[1] // 32 * 18
            byte_shape = (shape[0], shape[1] // 32 * 18)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes[name], gguf.GGMLQuantizationType.Q4_0)
        else:
            nbytes[name] = int(np.prod(shape)) * 2
            w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()

    def aligned(n: int) -> int:
        return -(-n // 32) * 32  # GGUF aligns the data section and every tensor to 32 bytes

    size = aligned(os.path.getsize(path)) + sum(aligned(n) for n in nbytes.values())
    os.truncate(path, size)  # a sparse hole: the file "holds" 13.5 GB and uses no disk
    return size


def test_7b_refused_with_the_numbers(tmp_path, monkeypatch):
    path = tmp_path / "llama2-7b.gguf"
    assert write_header_only_gguf(path) > LLAMA2_7B_PARAMS * 2
    monkeypatch.setattr(memory, "free_bytes", lambda device: 22 * 10**9)
    assert LLAMA2_7B_PARAMS == 6_738_415_616
    message = r"^llama2-7b\.gguf needs 27\.0 GB in float32, 13\.5 GB in bfloat16; 22\.0 GB free on cpu$"
    with pytest.raises(StagewiseError, match=message):
        load_model(str(path), device="cpu", dtype=torch.float32)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 12 * 10**9)
    with pytest.raises(StagewiseError, match=r"needs 27\.0 GB in float32, 13\.5 GB in float16; 12\.0 GB free"):
        load_model(str(path), device="cpu", dtype=torch.float16)


def test_fits_check_counts_the_dtype(tmp_path, monkeypatch):
    """14.2 GB free: 13.5 GB of bfloat16 (plus 5% headroom) fits, 27 GB of float32 does not."""
    path = tmp_path / "llama2-7b.gguf"
    write_header_only_gguf(path)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 14.2 * 10**9)
    memory.check_fits(memory_config(path), torch.bfloat16, torch.device("cpu"), path.name)
    with pytest.raises(StagewiseError, match="needs 27.0 GB"):
        memory.check_fits(memory_config(path), torch.float32, torch.device("cpu"), path.name)


def test_fits_check_counts_packed_blocks_as_the_files_bytes(tmp_path, monkeypatch):
    """Kept quantized (Q4_0: 0.5625 bytes per weight), 7B is 3.8 GB: it fits in 5 GB, float32 does not."""
    path = tmp_path / "llama2-7b-q4_0.gguf"
    write_header_only_gguf(path, q4_0=True)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 5 * 10**9)
    with pytest.raises(StagewiseError, match="needs 27.0 GB in float32"):
        load_model(str(path), device="cpu", dtype=torch.float32, quantization="none")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 3 * 10**9)
    with pytest.raises(StagewiseError, match=r"^llama2-7b-q4_0\.gguf needs 3\.8 GB kept quantized; 3\.0 GB free"):
        load_model(str(path), device="cpu", dtype=torch.float32, quantization="auto")


def memory_config(path):
    from stagewise.models.gguf_loader import config_from_gguf, open_gguf

    config = config_from_gguf(open_gguf(path), path.name)
    assert config.num_parameters() == LLAMA2_7B_PARAMS
    return config


def test_free_memory_is_measured():
    free = memory.free_bytes(torch.device("cpu"))
    assert free is None or free > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loaders_cast_tensor_by_tensor(tmp_path, dtype):
    """Loading straight into a dtype gives exactly the float32 weights cast to it, for GGUF and HF."""
    model = hf_tiny_model(seed=11, tie=False)
    for path, load in (
        (write_gguf(tmp_path / "t.gguf", model), load_gguf),
        (write_hf_dir(tmp_path / "hf", model), load_hf_dir),
    ):
        _, full = load(path)
        _, cast = load(path, dtype=dtype)
        pairs = [(full.embed, cast.embed), (full.lm_head, cast.lm_head), (full.final_norm, cast.final_norm)]
        pairs += [(getattr(a, k), getattr(b, k)) for a, b in zip(full.layers, cast.layers) for k in vars(a)]
        for expected, actual in pairs:
            assert actual.dtype == dtype and torch.equal(actual, expected.to(dtype))
