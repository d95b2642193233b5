"""A Llama-3-8B-shaped Q4_0 GGUF of random blocks, then load it kept quantized and decode a few tokens.

    python scripts/write_random_gguf.py write /tmp/llama3-8b-q4_0-random.gguf      # ~4.6 GB, once
    python scripts/write_random_gguf.py decode /tmp/llama3-8b-q4_0-random.gguf --threads 2 --tokens 8

`write` streams one tensor at a time (never the whole file in memory): every projection, the
embedding table and the output head are Q4_0 blocks (a random float16 scale d and 16 random bytes
of codes per 32 weights, d chosen so the weights have a std near 1/sqrt(in)), the norms float32
ones; the metadata is Llama-3-8B's shape (32 layers, hidden 4096, FFN 14336, 32 / 8 heads, vocab
128256) with the tiny byte-level BPE tokenizer of the tests, enough for the loader. Nothing is
downloaded; the numbers mean nothing, the bytes and the shapes are real.

`decode` loads it with `quantization="auto"`, prints the anonymous resident memory the load added,
decodes greedily from a few prompt ids and reports tokens/s beside the weight-streaming floor:
the weight bytes read per token over the read bandwidth measured here (a large tensor summed).
Not for CI (minutes, and gigabytes of disk and memory).
"""

import argparse
import json
import os
import time
from pathlib import Path

import gguf

from stagewise.bench.harness.random_gguf import write_tensors

SHAPE = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, head_dim=128)


def tensors(s: dict) -> list[tuple[str, tuple[int, int] | int]]:
    """(name, [out, in] of a Q4_0 matrix, or the length of a float32 norm), in file order."""
    h, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", (s["vocab"], h)), ("output_norm.weight", h), ("output.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", h), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h))]
        out += [(b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", h)]
        out += [(b + "ffn_gate.weight", (s["ffn"], h)), (b + "ffn_up.weight", (s["ffn"], h))]
        out += [(b + "ffn_down.weight", (h, s["ffn"]))]
    return out


def write(path: Path, s: dict, context: int) -> None:
    from stagewise.tokenizer.vocabulary import Tokenizer

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(context)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["head_dim"])
    w.add_vocab_size(s["vocab"])
    tok = Tokenizer.tiny()  # a minimal byte-level BPE tokenizer: the loader needs one
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types([3 if t in tok.special_tokens else 1 for t in tok.tokens])
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    write_tensors(w, tensors(s), seed=0)  # the harness's writer: header, then random Q4_0 blocks
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB")


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def read_bandwidth(torch, gb: float = 2.0) -> float:
    """Bytes/s of summing a float32 tensor far larger than any cache (best of 5)."""
    x = torch.ones(int(gb * 1e9) // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def decode(path: Path, threads: int, tokens: int, out: str | None) -> None:
    import torch

    torch.set_num_threads(threads)
    from stagewise.engine.llm import LLM
    from stagewise.models.registry import load_model
    from stagewise.sampling_params import SamplingParams

    bandwidth = read_bandwidth(torch)
    before = rss_anon()
    start = time.perf_counter()
    loaded = load_model(str(path), device="cpu", quantization="auto")
    llm = LLM(loaded, backend="torch", mode="kv")
    load_s = time.perf_counter() - start
    prompt = "the cat sat on the mat"  # the stand-in tokenizer's text; the ids go past its vocab
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    added = rss_anon() - before
    runs = []
    for _ in range(2):
        m = llm.generate(prompt, params)[0].metrics
        runs.append((tokens - 1) / (m.finish_time - m.first_token_time))
    w = loaded.weights
    # every weight once per token (the untied head included), of the embedding table one row
    step_bytes = w.num_bytes() - w.embed.nbytes + w.embed.row_bytes()
    floor = bandwidth / step_bytes
    r = {
        "file_bytes": path.stat().st_size,
        "threads": threads,
        "loadavg": os.getloadavg(),
        "load_seconds": load_s,
        "added_rss_anon_bytes": added,
        "weight_tensor_bytes": w.num_bytes(),
        "kernel_form_bytes": w.prepared_bytes(),
        "held_bytes": w.held_bytes(),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "bytes_per_token": step_bytes,
        "floor_tok_s": floor,
        "decode_tok_s": runs,
        "weights": llm.describe().get("weights"),
    }
    print(json.dumps(r, indent=1))
    if out:
        Path(out).write_text(json.dumps(r, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["write", "decode"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--context", type=int, default=1024, help="context length in the metadata (KV cache size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--output", help="write the decode numbers as JSON here")
    args = ap.parse_args()
    if args.action == "write":
        write(args.path, SHAPE, args.context)
    else:
        decode(args.path, args.threads, args.tokens, args.output)


if __name__ == "__main__":
    main()
