"""A trace's steps as text, for notebook 10: what each request computed, who waited, who was preempted.

Printing only: the notebook reads the tracer's JSON (`stagewise.trace.export.to_json`) through
these so its cells stay about the scheduler, not about formatting.
"""


def print_steps(trace: dict, label: dict, budget: int) -> None:
    """One line per traced step: each request's `computed -> after this step / num_tokens` and phase,
    who waits, who sampled; then, from step 3 on, the sizes of decode-only steps and of the others."""
    for s in trace["steps"]:
        parts = []
        for r in s["requests"]:
            done = r["num_computed_tokens"] + r["num_scheduled"]
            name, computed, total = label[r["request_id"]], r["num_computed_tokens"], r["num_tokens"]
            parts.append(f"{name} {computed:>2}->{done:<2}/{total:<2} {r['phase']}")
        waiting = [label[w] for w in s["scheduler"]["waiting"]]
        sampled = ",".join(label[k] for k in s["sampled"]) or "-"
        tokens = sum(r["num_scheduled"] for r in s["requests"])
        print(f"step {s['index']:>2} [{tokens:>2}/{budget} tokens] " + " | ".join(parts)
              + (f" || waiting {waiting}" if waiting else "") + f" || sampled {sampled}")  # fmt: skip
    later = [(s["index"], sum(r["num_scheduled"] for r in s["requests"]), s["requests"]) for s in trace["steps"][3:]]
    mixed = [(i, n) for i, n, reqs in later if any(r["phase"] != "decode" for r in reqs)]
    decode_only = sorted({n for _, n, reqs in later if all(r["phase"] == "decode" for r in reqs)})
    print(f"from step 3 on: decode-only steps carry {decode_only} tokens; "
          f"steps with a prompt beside decodes (step, tokens): {mixed}")  # fmt: skip


def print_preemptions(trace: dict, label: dict) -> None:
    """The steps that preempted a request or ran a prompt: who was preempted, who ran what, blocks in use."""
    for s in trace["steps"]:
        sched = s["scheduler"]
        if sched["preempted"] or any(r["phase"] != "decode" for r in s["requests"]):
            ran = ", ".join(f"{label[r['request_id']]} {r['phase']} +{r['num_scheduled']}" for r in s["requests"])
            print(f"step {s['index']:>2}: preempted {[label[p] for p in sched['preempted']]}, {ran}; "
                  f"blocks in use {sched['kv_blocks_in_use']}/{sched['kv_blocks_total']}")  # fmt: skip
