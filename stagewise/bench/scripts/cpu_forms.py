"""Measure the CPU formulations that sit beside the naive references (benchmarks/README.md quotes them).

    python -m stagewise.bench.scripts.cpu_forms [--threads 2] [--only gemm|attention] [--json cpu_forms.json]

- paged decode attention: the textbook loop (`paged_attention.naive`, one gather and one
  textbook attention per sequence) against the torch tier's batched form (`paged_attention_torch`: one padded
  gather and one fused `scaled_dot_product_attention` per group), for D decoding sequences of about
  L keys, SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64), float32, blocks shuffled;
- the projection GEMM forms of `tuning/gemm_forms.py`, streaming SmolLM2-135M-sized weights: what
  `calibrate` measures (one M per bucket), and every form at M = 1, 3, 8, 12, 16, 32 (the table in
  benchmarks/README.md, "CPU tier notes").

Variants alternate and each keeps its fastest of several rounds (the least disturbed by other work).
"""

import argparse
import json
import random
import sys

import torch

from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.timing import compare
from stagewise.errors import StagewiseError
from stagewise.files import check_writable, write_text_atomic
from stagewise.stages import paged_attention, paged_attention_torch
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.tuning import gemm_forms as gemm

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_inputs(num_seqs: int, length: int, seed: int = 0) -> dict:
    """num_seqs decoding sequences of length/2..length keys, blocks scattered over a pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(max(1, length // 2), length) for _ in range(num_seqs)]
    per_seq = -(-max(lens) // BLOCK_SIZE)
    pool = max(4096, num_seqs * per_seq)
    table = torch.randperm(pool, generator=gen)[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
    shape = (pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return {
        "q": torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen),
        "k_cache": torch.randn(shape, generator=gen),
        "v_cache": torch.randn(shape, generator=gen),
        "metadata": AttentionMetadata.build([1] * num_seqs, lens, "cpu", block_table=table),
        "scale": HEAD_DIM**-0.5,
    }


def decode_attention_forms(batch_sizes=(1, 2, 4, 8, 16, 32), lengths=(64, 256, 1024), repeats=7) -> list[dict]:
    rows = []
    for num_seqs in batch_sizes:
        for length in lengths:
            inputs = decode_inputs(num_seqs, length)
            timings = compare(
                {
                    "one_by_one": lambda i=inputs: paged_attention.naive(**i),
                    "batched": lambda i=inputs: paged_attention_torch.paged_attention_torch(**i),
                },
                repeats=repeats,
            )
            best = {name: min(t.samples_ms) for name, t in timings.items()}
            rows.append({"num_seqs": num_seqs, "max_len": length, **{f"{k}_us": v * 1e3 for k, v in best.items()}})
            print(f"D={num_seqs:3d} L<={length:5d}  " + "  ".join(f"{k} {v * 1e3:8.0f} us" for k, v in best.items()))
    return rows


def gemm_forms(rows_m=(1, 3, 8, 12, 16, 32), passes: int = 3) -> dict:
    """Each GEMM form streaming SmolLM2-135M-shaped weights (30 layers + LM head), out-major, float32."""
    hidden, inter, qkv, vocab = 576, 1536, 576 + 2 * 192, 49152
    shapes = [(hidden, qkv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)] * 30 + [(hidden, vocab)]
    weights = [torch.randn(n, k).t() for k, n in shapes]  # [K, N] views of row-major [N, K]
    forms = gemm.calibrate(weights)
    print(forms.describe())
    table = []
    for m in rows_m:
        best = gemm.time_forms(weights, m, passes)
        table.append({"m": m, **{f"{form}_ms": ms for form, ms in best.items()}})
        print(f"M={m:3d}  " + "  ".join(f"{form} {ms:6.1f} ms" for form, ms in best.items()))
    return {"chosen": forms.chosen, "measured_ms": forms.measured_ms, "by_m": table}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage too; one line, exit 2, as the CLI does
        print(f"cpu_forms: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", choices=("gemm", "attention"), default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        if args.threads is not None and args.threads < 1:
            raise StagewiseError(f"--threads must be >= 1, got {args.threads}")
        if args.json:
            check_writable(args.json, "--json")  # before minutes of measuring
    except StagewiseError as e:
        parser.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": machine_info()}
    with torch.inference_mode():
        if args.only != "gemm":
            result["decode_attention"] = decode_attention_forms()
        if args.only != "attention":
            result["gemm"] = gemm_forms()
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
