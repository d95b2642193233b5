"""Weights kept quantized vs dequantized to float32: accuracy, memory and decode speed, one file.

    python -m stagewise.bench.scripts.weight_formats [--model smollm2-135m] [--threads 1 2] [--tokens 64]

1. logits: the same prompts through both (the naive tier: kept-packed is then exactly the file's
   values; and the torch tier, whose int4pack / bfloat16 kernels round scales and activations);
   the largest |difference| against the float32 model, and that difference relative to the
   float32 logits' spread (their standard deviation).
2. greedy tokens: how many of `--tokens` tokens per prompt agree before the first difference.
3. memory: the weights' bytes held after load (and the forms the torch tier built) vs the
   file's tensor bytes.
4. speed: single-stream greedy decode (mode kv, the torch tier), tokens/s per thread count.

Output: a table on stdout and, with --output, the numbers as JSON. On a shared machine the
timings are indicative; the best of `--repeats` runs is kept.
"""

import argparse
import json
import time

import torch

from stagewise.bench.harness.agreement import PROMPTS, agreement
from stagewise.engine.llm import LLM
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.prepare import build_packed_forms
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams


def logits_of(loaded, backend: str, prompts: list[str]) -> torch.Tensor:
    """Every position's logits of every prompt, [sum of prompt lengths, vocab]."""
    ops = StageOps(backend)
    build_packed_forms(loaded.weights, ops.backends)
    model = LlamaModel(loaded, ops)
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    batch = ForwardBatch.from_sequences(ids, [0] * len(ids), "cpu")
    batch.last_token_index = torch.arange(batch.num_tokens)
    return model.forward(batch, NoKVCache(batch.cu_seqlens_q))


def decode_tok_s(llm: LLM, prompt: str, tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    best = 0.0
    for _ in range(repeats):
        out = llm.generate(prompt, params)[0]
        m = out.metrics
        decode_s = m.finish_time - m.first_token_time  # after the first token: decode steps only
        best = max(best, (len(out.token_ids) - 1) / decode_s)
    return best


def run(model: str, threads: list[int], tokens: int, repeats: int) -> dict:
    from stagewise.models.files import smollm2_gguf_path

    packed = load_model(model, device="cpu", quantization="auto")
    floats = load_model(model, device="cpu", quantization="none")
    result: dict = {"model": model}
    ref = logits_of(floats, "naive", PROMPTS)
    spread = ref.std().item()
    for backend in ("naive", "torch"):
        diff = (logits_of(packed, backend, PROMPTS) - ref).abs().max().item()
        result[f"logits_max_abs_diff_{backend}"] = diff
        result[f"logits_diff_over_std_{backend}"] = diff / spread
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    agree = {}
    for backend in ("naive", "torch"):
        ref_tokens = [o.token_ids for o in LLM(floats, backend=backend, mode="kv").generate(PROMPTS, params)]
        ours = [o.token_ids for o in LLM(packed, backend=backend, mode="kv").generate(PROMPTS, params)]
        agree[backend] = [agreement(a, b) for a, b in zip(ours, ref_tokens)]
    result["greedy_agreement"] = agree
    result["greedy_tokens_per_prompt"] = tokens
    result["weight_bytes_packed"] = packed.weights.num_bytes()
    result["prepared_bytes_torch_tier"] = packed.weights.prepared_bytes()
    result["weight_bytes_float32"] = floats.weights.num_bytes()
    if model == "smollm2-135m":
        from stagewise.models.gguf_loader import open_gguf

        reader = open_gguf(smollm2_gguf_path())
        result["file_tensor_bytes"] = int(sum(t.n_bytes for t in reader.tensors))
    speeds = {}
    before = torch.get_num_threads()
    for n in threads:
        torch.set_num_threads(n)
        row = {}
        for name, loaded in (("float32", floats), ("kept quantized", packed)):
            llm = LLM(loaded, backend="torch", mode="kv")
            row[name] = decode_tok_s(llm, PROMPTS[0], tokens, repeats)
        row["ratio"] = row["kept quantized"] / row["float32"]
        speeds[str(n)] = row
    torch.set_num_threads(before)
    result["decode_tok_s"] = speeds
    return result


def table(r: dict) -> str:
    mb = 1e6
    lines = [f"{r['model']}: kept quantized vs dequantized to float32"]
    for b in ("naive", "torch"):
        lines.append(
            f"  logits, {b} tier: max |diff| {r[f'logits_max_abs_diff_{b}']:.3g} "
            f"({r[f'logits_diff_over_std_{b}']:.2%} of the logits' std)"
        )
        agree, n = r["greedy_agreement"][b], r["greedy_tokens_per_prompt"]
        full = sum(a == n for a in agree)
        lines.append(f"  greedy, {b} tier: {full}/{len(agree)} prompts agree on all {n}: {agree}")
    lines.append(
        f"  weights held: {r['weight_bytes_packed'] / mb:.1f} MB packed "
        f"(+ {r['prepared_bytes_torch_tier'] / mb:.1f} MB the torch tier built) vs "
        f"{r['weight_bytes_float32'] / mb:.1f} MB float32"
        + (f"; file tensors {r['file_tensor_bytes'] / mb:.1f} MB" if "file_tensor_bytes" in r else "")
    )
    for n, row in r["decode_tok_s"].items():
        lines.append(
            f"  decode, {n} thread(s), torch tier: float32 {row['float32']:.1f} tok/s, kept "
            f"quantized {row['kept quantized']:.1f} tok/s ({row['ratio']:.2f}x)"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    r = run(args.model, args.threads, args.tokens, args.repeats)
    r["seconds"] = time.perf_counter() - start
    print(table(r))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
