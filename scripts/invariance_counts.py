"""The counts behind #37's "done": speculation and batching give plain decoding's greedy text.

    python scripts/invariance_counts.py                 # SmolLM2, packed (the default) and float32
    python scripts/invariance_counts.py --quick         # a smoke run: tiny, a few prompts, k = 1 and 4

For each weight format, on >= 100 prompts (sentences and paragraphs of the english_text corpus, the
copy-heavy and prose prompts of `bench spec`, and corpus sentences asked to be repeated), greedy:

    `bench batching`'s 32 requests  static against continuous (requests that part)
    plain decoding alone           the reference
    draft-model speculation, k = 4 (a truncated-layer draft, as `bench spec` writes it)
    all prompts batched together   continuous batching, one engine (count that differ)
    n-gram speculation, k = 1..8   the same text as the reference? (count of prompts that differ)

Every count should be 0 with batch invariance on (the default); `--no-batch-invariant` shows the counts of
the old paths. Long: about an hour per format on a 2-core CPU. Prints one line per count, and the
JSON with `--json PATH` (rewritten after each count, so a stopped run keeps what it reached).
"""

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

PARTS = ("batching", "draft", "batched", "ngram")  # what is counted, in this order


def prompts(quick: bool) -> list[str]:
    from stagewise.bench.commands.spec import WORKLOADS
    from stagewise.bench.harness.english_text import TEXT

    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", TEXT.replace("\n", " ")) if len(s.strip()) > 20]
    paragraphs = [p.strip() for p in TEXT.split("\n\n") if len(p.strip()) > 40]
    spec = [text for kind in ("copy", "prose") for _, text in WORKLOADS[kind]]
    repeat = [f"Repeat this sentence twice: {s}" for s in sentences[:30]]
    out = sentences + paragraphs + spec + repeat
    return out[:6] if quick else out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def count(name: str, reference: list[list[int]], outs: list[list[int]], report: dict, save) -> None:
    differ = [i for i, (a, b) in enumerate(zip(reference, outs)) if a != b]
    report[name] = {"prompts": len(reference), "differ": len(differ), "which": differ[:20]}
    print(f"  {name}: {len(differ)} of {len(reference)} prompts differ from plain decoding", flush=True)
    save()  # a long run that is stopped keeps the counts it reached


def run_format(model: str, fmt: str, texts: list[str], args, report: dict) -> None:
    from stagewise import LLM, SamplingParams
    from stagewise.bench.commands.batching import QUICK, BatchingSettings, run_batching
    from stagewise.bench.commands.spec import SpecSettings, draft_model
    from stagewise.config import EngineConfig
    from stagewise.models.registry import load_model

    loaded = load_model(model, "cpu", None, quantization=fmt)
    bi = not args.no_batch_invariant
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    one = EngineConfig(max_num_seqs=1)
    print(f"{model}, quantization={fmt}, batch_invariant={bi}: {len(texts)} prompts", flush=True)
    if "batching" in args.parts:
        settings = BatchingSettings(model=model, quantization=fmt, on_mismatch="record", batch_invariant=bi)
        if args.quick:
            settings = replace(settings, **QUICK)
        result = run_batching(settings, loaded=loaded)
        parted = sorted({m.split(":")[0] for m in result.get("mismatches", [])})
        requests = result["workload"]["num_requests"]
        report["bench batching"] = {"requests": requests, "static_vs_continuous_differ": len(parted), "which": parted}
        print(f"  bench batching: {len(parted)} of {requests} requests part between static and continuous", flush=True)
        args.save()
    if args.parts == {"batching"}:
        return
    plain = LLM(loaded, engine_config=one, batch_invariant=bi)
    reference = [plain.generate(t, params, chat=True)[0].token_ids for t in texts]
    if "draft" in args.parts:
        with tempfile.TemporaryDirectory(prefix="stagewise-counts-") as tmp:
            path, what = draft_model(SpecSettings(model=model), Path(tmp), loaded.config.num_layers)
            config = {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "draft_quantization": fmt}
            spec = LLM(loaded, engine_config=one, speculative_config=config, batch_invariant=bi)
            outs = [spec.generate(t, params, chat=True)[0].token_ids for t in texts]
            count(f"draft k=4 ({what})", reference, outs, report, args.save)
    if "batched" in args.parts:
        together = LLM(loaded, batch_invariant=bi).generate(texts, params, chat=True)
        count("all prompts in one continuous batch", reference, [o.token_ids for o in together], report, args.save)
    for k in args.k if "ngram" in args.parts else ():
        spec = LLM(loaded, engine_config=one, speculative_config=f"ngram:{k}", batch_invariant=bi)
        count(
            f"ngram k={k}",
            reference,
            [spec.generate(t, params, chat=True)[0].token_ids for t in texts],
            report,
            args.save,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default smollm2-135m (quick: tiny)")
    parser.add_argument("--formats", default=None, help="comma-separated: auto, none (default auto,none)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per prompt (default 64)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, run in this order: {', '.join(PARTS)}"
    )
    parser.add_argument("--k", default=None, help="comma-separated n-gram k (default 1..8)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 prompts, k = 1 and 4")
    parser.add_argument("--no-batch-invariant", action="store_true", help="the old, batch-variant paths")
    parser.add_argument("--json", default=None, help="also write the counts to this file")
    args = parser.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "smollm2-135m")
    formats = (args.formats or ("none" if args.quick else "auto,none")).split(",")
    args.max_tokens = args.max_tokens or (8 if args.quick else 64)
    try:
        args.k = tuple(int(k) for k in args.k.split(",")) if args.k else ((1, 4) if args.quick else tuple(range(1, 9)))
    except ValueError:
        args.k = ()
    args.parts = set(args.parts.split(","))
    if not args.parts <= set(PARTS):
        print(f"error: --parts takes {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if not args.k or min(args.k) < 1:
        print("error: --k must be comma-separated integers >= 1", file=sys.stderr)
        return 2
    if args.max_tokens < 1 or any(f not in ("auto", "none") for f in formats):
        print("error: --max-tokens must be >= 1 and --formats auto and/or none", file=sys.stderr)
        return 2
    texts = prompts(args.quick)
    report: dict = {"model": model, "batch_invariant": not args.no_batch_invariant, "prompts": len(texts)}
    start = time.perf_counter()

    def save() -> None:
        report["minutes"] = round((time.perf_counter() - start) / 60, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    args.save = save
    for fmt in formats:
        report[fmt] = {}
        run_format(model, fmt, texts, args, report[fmt])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
