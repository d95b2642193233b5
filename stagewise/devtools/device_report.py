"""The device check's results as markdown tables (the file committed beside the JSON)."""

import math


def _num(value, fmt: str = ",.2f") -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, fmt)
    return "—" if value is None else str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _env(env: dict) -> list[str]:
    m = env.get("machine", {})
    gpu = env.get("gpu") or {}
    lines = [
        f"- GPU: {gpu.get('name', 'none (dry run on the CPU)')}, compute capability {gpu.get('capability', '—')}, "
        f"{gpu.get('sms', '—')} SMs, {gpu.get('memory_GB', '—')} GB",
        f"- torch {m.get('torch')}, triton {m.get('triton')}, Python {m.get('python')}",
    ]
    if "copy" in env:
        c = env["copy"]
        lines.append(f"- copy bandwidth (read + write, {c['bytes'] / 1e9:.1f} GB moved): **{c['gb_per_s']:,.0f} GB/s**")
    if "matmul_bf16" in env:
        p = env["matmul_bf16"]
        lines.append(f"- torch.matmul bf16 {p['n']}^3: **{p['tflops']:,.0f} TFLOP/s**")
    return lines


def _kernels(sec: dict) -> list[str]:
    rows = []
    for r in sec.get("rows", []):
        if "error" in r:
            rows.append([r["kernel"], r["shape"], "ERROR", r["error"][:160], "", "", "", ""])
            continue
        vs = f"{r['ratio_vs_stock']:.2f}x {r.get('stock', '')}" if "ratio_vs_stock" in r else ""
        share = f"{100 * r['share_of_copy']:.0f}%" if "share_of_copy" in r else ""
        value = f"{_num(r.get('triton_value'), ',.1f')} {r.get('metric', '')}"
        if "same_bits" in r:  # a batch-invariance row: a row's bits alone = in the batch, invariant and variant
            value = f"same bits {_num(r['same_bits'])}, variant {_num(r.get('variant_same_bits'))}"
        rows.append([r["kernel"], r["shape"], _num(r["triton_ms"], ".4f"), value, vs, share,
                     _num(r.get("rel_err"), ".1e"), _num(r.get("passed"))])  # fmt: skip
    header = ["kernel", "shape", "Triton ms", "Triton", "vs stock", "of copy BW", "rel. error", "target met"]
    timings = sorted({r.get("timing", "") for r in sec.get("rows", []) if "error" not in r} - {""})
    note = ["", "Times are GPU time per call: " + "; ".join(timings) + "."] if timings else []
    return _table(header, rows) + note


def _e2e(sec: dict) -> list[str]:
    lines = []
    rows = [
        [d["model"] + (f" ({d['row']})" if d.get("row") else ""),
         d["backend"] + (" + CUDA graphs" if d.get("cuda_graphs") else ""),
         d["dtype"] + (f", {d['weights']} weights" if d.get("weights") else ""),
         _num(d["ms_per_token_p50"], ".2f"), _num(d["tokens_per_s"], ",.0f"),
         _num(d["streaming_floor_ms"], ".2f"), f"{100 * d['share_of_streaming_limit']:.0f}%"]
        for d in sec.get("decode", [])
    ]  # fmt: skip
    header = ["model", "backend", "dtype", "ms/token", "tokens/s", "weight-streaming floor ms", "share of limit"]
    lines += ["Decode at batch 1 (paged mode, greedy, median time between tokens):", "", *_table(header, rows), ""]
    packed = [d for d in sec.get("decode", []) if d.get("weights")]  # the 4-bit model beside the 16-bit one
    for d in packed:
        vs = f"{d['vs_bf16']:.2f}x" if d.get("vs_bf16") else "—"
        lines.append(
            f"- {d['weights']} weights (random codes): {d['ms_per_token_p50']:.2f} ms/token, {vs} this run's "
            f"{d['dtype']} row, **{d['vs_committed_bf16']:.2f}x** the committed bf16 figure (target {d['target']}; "
            f"met: {_num(d.get('passed'))}); weight-streaming floor {d['streaming_floor_ms']:.2f} ms "
            f"({d['weight_bytes'] / 1e9:.2f} GB packed / copy bandwidth)"
        )
    lines += [""] if packed else []
    one_b = [d for d in sec.get("decode", []) if d.get("row") == "1B-class"]
    for d in one_b:
        lines.append(
            f"- 1B-class row ({d['model']}, {d['dtype']}): {d['ms_per_token_p50']:.2f} ms/token, "
            f"{d['weight_bytes'] / 1e9:.2f} GB of weights a token at {d['weights_gb_per_s']:,.0f} GB/s = "
            f"**{100 * d['share_of_streaming_limit']:.0f}%** of the copy bandwidth (target {d['target']}; "
            f"met: {_num(d.get('passed'))})"
        )
    lines += [""] if one_b else []
    prof = sec.get("step_profiles") or []
    if prof:
        rows = [
            [p["backend"] + (" + CUDA graphs" if p.get("cuda_graphs") else ""), str(p["num_seqs"]),
             _num(p["step_ms_p50"], ".2f"), _num(p["steps_per_s"], ",.0f"),
             f"{100 * p['host_share']:.0f}%" if "host_share" in p else "—"]
            for p in prof
        ]  # fmt: skip
        lines += [
            "SmolLM2-shaped decode steps:",
            "",
            *_table(["backend", "seqs", "ms/step", "steps/s", "host share"], rows),
            "",
        ]
    syncs = sec.get("syncs")
    if syncs:
        lines.append(f"- host synchronisations in one Triton decode step: {syncs.get('syncs_per_step', syncs)}")
        for chain in syncs.get("call_chains", [])[:10]:
            lines.append("  - " + " <- ".join(f"`{frame}`" for frame in reversed(chain)))
    for key in ("greedy_fp32", "greedy_bf16"):
        g = sec.get(key)
        if g:
            for pair, label in (("triton_vs_naive", "Triton vs naive"), ("graphs_vs_eager", "CUDA graphs vs eager")):
                c = g[pair]
                lines.append(f"- {label} greedy tokens ({g['dtype']}, {g['new_tokens']} tokens): "
                             f"{c['identical_sequences']}/{g['prompts']} identical; first differences at "
                             f"{c['first_differing_position']}")  # fmt: skip
    for label, err in (sec.get("errors") or {}).items():
        lines.append(f"- ERROR in {label}: {err[:300]}")
    return lines


def _autotune(picks: list[dict]) -> list[str]:
    if not picks:
        return ["- autotuner picks: none (the interpreter, or single-config launches, tune nothing)"]
    rows = [[p["kernel"], ", ".join(f"{a}={k}" for a, k in zip(p["key_args"], p["key"])) or ", ".join(p["key"]),
             p["config"], str(p["candidates"])] for p in picks]  # fmt: skip
    return ["The autotuner's pick for each kernel and key:", "", *_table(["kernel", "key", "config", "of"], rows)]


def _bench(sec: dict) -> list[str]:
    lines = ["See bench/modes.json, bench/batching.json and their plots."]
    for m in sec.get("mismatches") or []:
        lines.append(f"- token mismatch (recorded, timings kept): {m}")
    return lines


def _tests(sec: dict) -> list[str]:
    counts = sec.get("counts") or {}
    lines = [f"`{sec.get('command', '?')}` -> {sec.get('summary', '?')} (exit {sec.get('returncode', '?')})"]
    if counts:
        lines.append("- " + ", ".join(f"{n} {k.lower()}" for k, n in counts.items()))
    return lines + [f"- {f}" for f in sec.get("failures") or []]


def _status(sec: dict) -> str:
    if "skipped" in sec:
        return f"skipped: {sec['skipped']}"
    if "failed" in sec:
        return "cut at its limit" if sec["failed"] == "exit timeout" else f"failed ({sec['failed']})"
    return "ok"


def _overview(secs: dict) -> list[str]:
    rows = []
    for name, sec in secs.items():
        took, limit = sec.get("wall_s"), sec.get("limit_s")
        share = f"{100 * took / limit:.0f}%" if took and limit else "—"
        rows.append([name, _status(sec), _num(took, ".0f"), _num(limit, ".0f"), share])
    return _table(["section", "status", "seconds", "limit s", "of limit"], rows)


RENDERERS = {"env": _env, "kernels": _kernels, "e2e": _e2e, "bench": _bench, "tests": _tests}
TITLES = {"bench": "bench (modes and batching, synthetic SmolLM2)", "tests": "tests on the device"}


def render_markdown(results: dict) -> str:
    """Every section that ran, was cut or was skipped, in the order it ran."""
    secs = results.get("sections", {})
    title = "Device check (dry run on the CPU: timings mean nothing)" if results.get("dry_run") else "Device check"
    lines = [f"# {title}", "", *_overview(secs), ""]
    for name, sec in secs.items():
        lines += [f"## {TITLES.get(name, name)}", ""]
        if "failed" in sec or "skipped" in sec:
            lines += [_status(sec), ""]
            if sec.get("tail"):
                lines += ["```", sec["tail"][-1500:], "```", ""]
            continue
        lines += RENDERERS.get(name, lambda s: [f"`{sorted(s)}`"])(sec) + [""]
        if "autotune" in sec:
            lines += _autotune(sec["autotune"]) + [""]
    lines += [f"Total {results.get('total_seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"
