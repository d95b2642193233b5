"""What quantizing at load costs in logits, and what the torch tier's K-quant routes cost vs naive.

    .venv/bin/python scripts/measure_quantization.py [--json benchmarks/results/<machine>/quantization_error.json]

1. The tiny checkpoint (tests/checkpoints.py, written as a Hugging Face directory) and SmolLM2-135M
   (its GGUF dequantized to float32, then quantized at load exactly as an HF checkpoint would be:
   `models/quantize_at_load.quantize_weights`), each in float32 and as int8 / int4 (group 32, and 64 /
   128 where the shapes allow): the last-token logits of a few prompts through the naive tier,
   max |difference| and RMS against float32 beside the logits' own std, and whether the argmax agrees.
   SmolLM2's floats are already its file's Q4_1 / Q8_0 values, so int4:g32 (= q4_1 RTN) lands close
   to them: read the g64 / g128 and int8 rows as the informative ones there.
2. K-quants through the torch tier vs naive on one SmolLM2-sized matrix (1536 x 576 -> K = 1536).
3. One decode row (M = 1) through a 4096 x 4096 K-quant matrix, one thread, best of 20: the torch
   tier's route per kind beside float32 `F.linear` and a bfloat16 copy (indicative on a shared
   machine: the timings say which route is in which range, not a benchmark's figures).
"""

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stagewise.kv.none import NoKVCache  # noqa: E402
from stagewise.models.forward_batch import ForwardBatch  # noqa: E402
from stagewise.models.llama import LlamaModel  # noqa: E402
from stagewise.models.ops import StageOps  # noqa: E402
from stagewise.models.quantize_at_load import quantize_weights  # noqa: E402
from stagewise.models.registry import load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "Water boils at",
]


def logits(loaded) -> torch.Tensor:
    model = LlamaModel(loaded, StageOps("naive"))
    seqs = [loaded.tokenizer.encode(p) for p in PROMPTS]
    batch = ForwardBatch.from_sequences(seqs, [0] * len(seqs), torch.device("cpu"))
    return model.forward(batch, NoKVCache.of(batch))  # [B, vocab]


def compare(name: str, ref: torch.Tensor, out: torch.Tensor) -> dict:
    diff = (out - ref).float()
    row = {
        "model": name,
        "max_abs": float(diff.abs().max()),
        "rms": float(diff.pow(2).mean().sqrt()),
        "logit_std": float(ref.std()),
        "argmax_agree": f"{int((out.argmax(-1) == ref.argmax(-1)).sum())}/{ref.shape[0]}",
    }
    print(
        f"{name:28s} max |d| {row['max_abs']:.4f}  rms {row['rms']:.4f}  (logit std "
        f"{row['logit_std']:.2f})  argmax {row['argmax_agree']}"
    )
    return row


def hf_rows() -> list[dict]:
    from tests.checkpoints import hf_tiny_model, write_hf_dir

    path = write_hf_dir(Path(tempfile.mkdtemp()) / "tiny-hf", hf_tiny_model(seed=3))
    ref = logits(load_model(str(path), device="cpu", quantization="none"))
    return [
        compare(f"tiny {q}", ref, logits(load_model(str(path), device="cpu", quantization=q))) for q in ("int8", "int4")
    ]


def smollm2_rows() -> list[dict]:
    floats = load_model("smollm2-135m", device="cpu", quantization="none")
    ref = logits(floats)
    rows = []
    for q in ("int8", "int8:g64", "int4", "int4:g64"):  # K = 576: not groups of 128
        weights = quantize_weights(floats.weights, q, "smollm2-135m")
        rows.append(compare(f"smollm2 {q}", ref, logits(replace(floats, weights=weights))))
    return rows


def kquant_rows() -> list[dict]:
    from stagewise.quant.gguf_blocks import packed_from_blocks
    from stagewise.stages import dequant_gemm, dequant_gemm_torch
    from tests.kquant_blocks import quantize_k

    gen = np.random.default_rng(0)
    n, k = 576, 1536  # SmolLM2's down projection, [out, in]
    w = (gen.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = torch.from_numpy(gen.standard_normal((4, k)).astype(np.float32))
    rows = []
    for type_name in ("Q4_K", "Q5_K", "Q6_K"):
        packed = packed_from_blocks(quantize_k(w, type_name), type_name, (n, k), "w")
        ref = dequant_gemm.naive(x, packed)
        out = dequant_gemm_torch.gemm(x, packed)
        diff = (out - ref).abs()
        row = {
            "kind": packed.kind,
            "torch_form": dequant_gemm_torch.form_name(packed),
            "max_abs": float(diff.max()),
            "rel_rms": float(diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
        }
        print(
            f"torch tier {packed.kind} ({row['torch_form']}): max |d| {row['max_abs']:.2e}, "
            f"relative rms {row['rel_rms']:.2e} vs naive"
        )
        rows.append(row)
    return rows


def best_ms(fn, repeats: int = 20) -> float:
    import time

    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def kquant_speed_rows() -> list[dict]:
    import torch.nn.functional as F

    from stagewise.quant.dequantize import dequantize_rows
    from stagewise.quant.gguf_blocks import packed_from_blocks
    from stagewise.stages import dequant_gemm_torch
    from tests.kquant_blocks import quantize_k

    n = k = 4096
    w = (np.random.default_rng(1).standard_normal((n, k)) * 0.02).astype(np.float32)
    x = torch.randn(1, k)
    rows = [{"route": "float32 F.linear", "ms": best_ms(lambda: F.linear(x, torch.from_numpy(w)))}]
    for type_name in ("Q4_K", "Q5_K", "Q6_K"):
        packed = packed_from_blocks(quantize_k(w, type_name), type_name, (n, k), "w")
        bf16 = dequantize_rows(packed).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        form = dequant_gemm_torch.form_name(packed)
        rows.append(
            {
                "route": f"{packed.kind} torch tier ({form})",
                "ms": best_ms(lambda p=packed: dequant_gemm_torch.gemm(x, p)),
            }
        )
        rows.append({"route": f"{packed.kind} as a bf16 copy", "ms": best_ms(lambda a=xb, b=bf16: F.linear(a, b))})
    for row in rows:
        print(f"4096 x 4096, M = 1: {row['route']:32s} {row['ms']:.3f} ms")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"hf_at_load": hf_rows(), "kquants_torch_tier": kquant_rows()}
    result["kquants_decode_ms_1_thread"] = kquant_speed_rows()
    result["load_average"] = open("/proc/loadavg").read().split()[:3]
    if not args.no_smollm2:
        result["hf_at_load"] += smollm2_rows()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
