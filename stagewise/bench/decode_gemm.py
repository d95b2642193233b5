"""Decode GEMMs (M = 1..16 rows) on a GPU: the split-K kernel vs torch.matmul, with and without the host.

    python -m stagewise.bench.decode_gemm [--model llama-3-8b] [--m 1 4 16] [--json decode_gemm.json]

Every case walks rotating copies of its weights (>= 1 GB, so L2 never holds
them) and is timed two ways:

- eager: CUDA events around a loop of Python calls (`time_calls`, as in the
  kernel benchmark). While a call's host work (Python, input checks, Triton's
  launcher) takes longer than its kernels, this measures the host, not the GPU.
- graph: the same calls captured once in a CUDA graph and replayed: no Python
  and no launcher, so it measures the kernels alone, as a decode step runs
  under CUDA graphs.

The gap between the two columns is the host cost per call. The decode kernel's
chosen config (`kernels/matmul_decode.py`) is printed with each shape.
"""

import argparse
import json
import sys

import torch

from stagewise.bench.device_timer import GB, copies_for, rel_error, time_calls, time_kernels
from stagewise.bench.kernel_bench import projection_shapes
from stagewise.config import PRESETS


def cases(model: str, rows: list[int], dtype: torch.dtype, working_set: int, device) -> list[dict]:
    from stagewise.kernels import matmul_decode
    from stagewise.kernels.matmul import matmul

    cfg = PRESETS[model]
    shapes = projection_shapes(cfg)
    out = []
    for m in rows:
        for name, (k, n) in shapes.items():
            weight_bytes = k * n * torch.finfo(dtype).bits // 8
            copies = copies_for(weight_bytes, working_set)
            xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(copies)]
            ws = [torch.randn(k, n, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
            triton_calls = [lambda x=x, w=w: matmul(x, w) for x, w in zip(xs, ws)]
            torch_calls = [lambda x=x, w=w: torch.matmul(x, w) for x, w in zip(xs, ws)]
            row = {"case": f"{model} {name} M={m} K={k} N={n}", "weight_bytes": weight_bytes}
            row["triton_eager_ms"] = time_calls(triton_calls, device, 5)
            row["torch_eager_ms"] = time_calls(torch_calls, device, 5)
            row["triton_graph_ms"] = time_kernels(triton_calls, device)[0]
            row["torch_graph_ms"] = time_kernels(torch_calls, device)[0]
            row["ratio_eager"] = row["torch_eager_ms"] / row["triton_eager_ms"]  # >= 0.8 is the target
            row["ratio_graph"] = row["torch_graph_ms"] / row["triton_graph_ms"]
            row["triton_graph_gb_per_s"] = weight_bytes / (row["triton_graph_ms"] * 1e-3) / GB
            row["rel_err"] = rel_error(matmul(xs[0], ws[0]), xs[0].double() @ ws[0].double())
            chosen = [c for key, c in matmul_decode.tuned_configs().items() if key[:3] == (n, k, dtype)]
            row["config"] = repr(chosen[0]) if chosen else None
            out.append(row)
            print(
                f"{row['case']:42s} eager {row['triton_eager_ms'] * 1e3:7.1f} us ({row['ratio_eager']:.2f}x)  "
                f"graph {row['triton_graph_ms'] * 1e3:7.1f} us ({row['ratio_graph']:.2f}x, "
                f"{row['triton_graph_gb_per_s']:5.0f} GB/s)  err {row['rel_err']:.1e}  {row['config']}",
                flush=True,
            )
            del xs, ws, triton_calls, torch_calls
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="decode rows (<= 16)")
    parser.add_argument("--working-set", type=float, default=1.0, help="GB of weight copies per case")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_gemm: needs a CUDA GPU (CUDA graphs); the interpreter's timings mean nothing")
    rows = cases(args.model, args.m, torch.bfloat16, int(args.working_set * GB), torch.device("cuda"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
