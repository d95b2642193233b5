"""Trace exports: a stable JSON document (with its JSON Schema) and Chrome trace events.

JSON (`to_json`, schema `TRACE_SCHEMA`, version 2) — what notebooks, tests and `stagewise view` read:

    {
      "schema": "stagewise.trace", "version": 1,
      "model":   {name, num_layers, hidden_size, num_heads, num_kv_heads, group_size, head_dim, ..., mode, backend},
      "prelude": [stage, ...],               stage calls before step 0 (tokenize)
      "steps":   [{index, mode, requests: [{request_id, num_computed_tokens, num_tokens, num_scheduled, phase}],
                   batch: {positions, slot_mapping, cu_seqlens_q, seq_lens, block_table, ...},
                   scheduler: {...}, stages: [stage, ...], sampled: {id: token}, text: {id: str},
                   start_us, dur_us, view}],
      "summary": {requests, prompt_tokens, output_tokens, steps, ttft_ms, tbt_ms, ...}
    }
    stage = {stage, layer, backend, inputs: [tensor], outputs: [tensor], scalars, start_us, dur_us, rank, kind}
            (kind "collective": stage is all_reduce or gather, backend gloo or nccl, scalars {bytes, world_size})
    tensor = {name, shape: [int], dtype, axes: [str] | null, packed: str | null}
             (packed: a packed weight's part, "q4_1 [K=576, N=960]"; its name is "w_qkv.codes" / ".scales" / ".mins")

A step's `view` (version 2; null outside the paged mode) is the paged engine after the step, as
`stagewise.engine.snapshot.engine_snapshot` makes it: the waiting / running / preempted queues, every
request's num_computed_tokens and num_tokens, the blocks each one holds (shared prefix blocks listed),
the step's prefill and decode tokens against its budget, TTFT / TBT of the tokens it produced. The live
page of `stagewise serve` draws the same dicts, so `stagewise view run.json` replays a run step by step;
`serve --record` writes a document of this format whose steps carry only the scheduler's part (no
stages). Version 1 had no `view`; everything else is unchanged, so readers of version 1 read version 2.

Untimed (`trace --no-timing`, and always for a shape-only model): `drop_times` removes every measured time,
so two runs give the same bytes in every format: `start_us` counts the stage calls (0, 1, 2, ...) instead of
microseconds, a stage's `dur_us` is null, a step's `dur_us` is the number of stage calls it made, and the
summary keeps its counts without TTFT, TBT, TPS and tokens/s. A shape-only trace's `text` is empty and its
summary says that the sampled ids are placeholders.

Chrome trace (`to_chrome`): the Trace Event Format that Perfetto and
chrome://tracing open — one complete event ("X", `ts`/`dur` in microseconds)
per engine step and per stage call (stages nested inside their step), counter
events ("C") for KV blocks in use, and metadata events ("M") naming the tracks.
Under tensor parallelism each rank is a process track of its own ("rank 0",
"rank 1", ...: pid = rank + 1), its stages and its collectives on two threads,
so Perfetto shows the ranks side by side, all-reduce against all-reduce.
"""

from stagewise.trace.tracer import Tracer

SCHEMA_NAME = "stagewise.trace"
SCHEMA_VERSION = 2  # 2: each step carries the engine's `view` (replay)

_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "dtype", "axes"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "dtype": {"type": "string"},
        "axes": {"type": ["array", "null"], "items": {"type": "string"}},
        "packed": {"type": ["string", "null"]},
    },
}
_STAGE = {
    "type": "object",
    "required": ["stage", "layer", "backend", "inputs", "outputs", "scalars", "start_us", "dur_us", "rank", "kind"],
    "properties": {
        "stage": {"type": "string"},
        "layer": {"type": ["integer", "null"]},
        "backend": {"enum": ["naive", "torch", "triton", "gloo", "nccl"]},
        "rank": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["stage", "collective"]},
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "items": _TENSOR},
        "scalars": {"type": "object"},
        "start_us": {"type": "number"},
        "dur_us": {"type": ["number", "null"]},
    },
}
_REQUEST = {
    "type": "object",
    "required": ["request_id", "num_computed_tokens", "num_tokens", "num_scheduled", "phase"],
    "properties": {
        "request_id": {"type": "string"},
        "num_computed_tokens": {"type": "integer", "minimum": 0},
        "num_tokens": {"type": "integer", "minimum": 1},
        "num_scheduled": {"type": "integer", "minimum": 0},
        "phase": {"type": "string"},
    },
}
_IDS = {"type": "array", "items": {"type": "string"}}
_BLOCK_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_VIEW_REQUEST = {
    "type": "object",
    "required": ["num_prompt_tokens", "num_computed_tokens", "num_tokens", "status", "blocks", "num_scheduled"],
    "properties": {
        "num_prompt_tokens": {"type": "integer", "minimum": 0},
        "num_computed_tokens": {"type": "integer", "minimum": 0},
        "num_tokens": {"type": "integer", "minimum": 0},
        "status": {"enum": ["waiting", "running", "finished"]},
        "blocks": _BLOCK_IDS,
        "num_scheduled": {"type": "integer", "minimum": 0},
        "phase": {"enum": ["prefill", "prefill chunk", "decode", "verify", None]},  # verify: speculative decoding
    },
}
VIEW_SCHEMA = {  # engine/snapshot.py's dict: one per step, the live page's and the replay's input
    "type": "object",
    "required": ["version", "step", "time", "queues", "requests", "kv", "budget", "latency"],
    "properties": {
        "version": {"const": 1},
        "step": {"type": "integer", "minimum": 0},
        "time": {"type": "number"},
        "queues": {
            "type": "object",
            "required": ["waiting", "running", "preempted"],
            "properties": {"waiting": _IDS, "running": _IDS, "preempted": _IDS},
        },
        "requests": {"type": "object", "additionalProperties": _VIEW_REQUEST},
        "kv": {
            "type": "object",
            "required": ["num_blocks", "block_size", "num_used", "shared"],
            "properties": {
                "num_blocks": {"type": "integer", "minimum": 0},
                "block_size": {"type": "integer", "minimum": 1},
                "shared": _BLOCK_IDS,
                "cached": {"type": ["array", "null"], "items": {"type": "integer"}},
                "prefix_cache": {"enum": ["hash", "radix", "none"]},  # older traces have none
            },
        },
        "budget": {
            "type": "object",
            "required": ["max_num_batched_tokens", "prefill_tokens", "decode_tokens"],
        },
        "latency": {"type": "array", "items": {"type": "object", "required": ["request_id"]}},
    },
}
TRACE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "stagewise trace",
    "type": "object",
    "required": ["schema", "version", "model", "prelude", "steps", "summary"],
    "properties": {
        "schema": {"const": SCHEMA_NAME},
        "version": {"const": SCHEMA_VERSION},
        "model": {
            "type": "object",
            "required": ["name", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"],
        },
        "prelude": {"type": "array", "items": _STAGE},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "index",
                    "mode",
                    "requests",
                    "batch",
                    "scheduler",
                    "stages",
                    "sampled",
                    "text",
                    "rank",
                    "view",
                ],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "rank": {"const": 0},
                    "mode": {"enum": ["naive", "kv", "paged"]},
                    "requests": {"type": "array", "items": _REQUEST},
                    "batch": {"type": "object"},
                    "scheduler": {"type": "object"},
                    "stages": {"type": "array", "items": _STAGE},
                    "sampled": {"type": "object", "additionalProperties": {"type": "integer"}},
                    "text": {"type": "object", "additionalProperties": {"type": "string"}},
                    "start_us": {"type": "number"},
                    "dur_us": {"type": "number"},
                    "view": {"oneOf": [VIEW_SCHEMA, {"type": "null"}]},
                },
            },
        },
        "summary": {"type": "object"},
    },
}


TIMING_VIEW_KEYS = {"ttft_ms", "tbt_ms"}  # a step view's measured latencies (null when untimed)
TIMING_KEYS = ("ttft_ms", "tbt_ms", "tps", "output_tokens_per_s")  # the run summary's measured times
SHAPE_ONLY_NOTE = "shape only (meta device): no values; the sampled ids are placeholders, not a model's output"


def drop_times(tracer: Tracer) -> None:
    """Replace every measured time by the order of the calls (in place): an untimed trace is reproducible."""
    calls = 0
    for rec in tracer.prelude:
        rec.start_us, rec.dur_us, calls = float(calls), None, calls + 1
    for step in tracer.steps:
        step.start_us = float(calls)
        for rec in step.stages:
            rec.start_us, rec.dur_us, calls = float(calls), None, calls + 1
        step.dur_us = float(len(step.stages))
        if step.view is not None:  # the engine's snapshot: its clock and its latencies are times too
            step.view = {**step.view, "time": float(step.index)}
            step.view["latency"] = [
                {**item, **dict.fromkeys(TIMING_VIEW_KEYS & item.keys())} for item in step.view["latency"]
            ]
    tracer.summary = {k: v for k, v in tracer.summary.items() if k not in TIMING_KEYS}


def mark_shape_only(tracer: Tracer) -> None:
    """A meta-device trace: no decoded text (there is none), a note that the sampled ids are placeholders."""
    for step in tracer.steps:
        step.text = {}
        if step.view is not None:  # nor in the engine's view of it
            requests = {rid: {**r, "text_tail": ""} for rid, r in step.view["requests"].items()}
            step.view = {**step.view, "requests": requests}
    tracer.model = {**tracer.model, "shape_only": True}
    tracer.summary = {**tracer.summary, "note": SHAPE_ONLY_NOTE}


def to_json(tracer: Tracer) -> dict:
    return {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, **tracer.to_dict()}


def _stage_name(rec) -> str:
    where = "final" if rec.layer is None else f"L{rec.layer}"
    return f"{rec.stage} ({where})"


def _shape_args(rec) -> dict:
    args = {t.name: t.label() for t in rec.inputs if not t.name.startswith("sampling.")}
    args.update({f"-> {t.name}": t.label() for t in rec.outputs})
    args["backend"] = rec.backend
    if rec.kind == "collective":
        args["bytes"] = rec.scalars.get("bytes")
        args["world_size"] = rec.scalars.get("world_size")
    return args


def _stage_event(rec) -> dict:
    """One stage call as a complete event on its rank's "stages" track (tid 2), a collective on tid 3."""
    return {
        "name": _stage_name(rec),
        "cat": rec.kind,
        "ph": "X",
        "ts": rec.start_us,
        "dur": 1.0 if rec.dur_us is None else rec.dur_us,  # untimed: one call = one tick
        "pid": rec.rank + 1,
        "tid": 3 if rec.kind == "collective" else 2,
        "args": _shape_args(rec),
    }


def _track_names(ranks: list[int]) -> list[dict]:
    if ranks == [0]:
        names = {1: "stagewise engine"}
    else:
        names = {r + 1: f"rank {r}" + (" (schedules, samples)" if r == 0 else "") for r in ranks}
    events = []
    for pid, name in names.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 2, "args": {"name": "stages"}})
        if len(names) > 1:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 3, "args": {"name": "collectives"}})
    events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "engine steps"}})
    return events


def to_chrome(tracer: Tracer) -> dict:
    """Trace Event Format: {"traceEvents": [...], "displayTimeUnit": "ms"}; one process per rank."""
    pid = 1  # rank 0: steps, counters, and its own stages
    ranks = sorted({0} | {rec.rank for step in tracer.steps for rec in step.stages})
    events = _track_names(ranks)
    events += [_stage_event(rec) for rec in tracer.prelude]
    for step in tracer.steps:
        requests = {r["request_id"]: f"{r['phase']} +{r['num_scheduled']}" for r in step.requests}
        events.append(
            {
                "name": f"step {step.index} ({step.num_tokens} tokens)",
                "cat": "step",
                "ph": "X",
                "ts": step.start_us,
                "dur": step.dur_us,
                "pid": pid,
                "tid": 1,
                "args": requests,
            }
        )
        events += [_stage_event(rec) for rec in step.stages]
        in_use = step.scheduler.get("kv_blocks_in_use")
        if isinstance(in_use, int):
            events.append(
                {"name": "KV blocks in use", "ph": "C", "ts": step.start_us, "pid": pid, "args": {"blocks": in_use}}
            )
        events.append(
            {"name": "tokens in step", "ph": "C", "ts": step.start_us, "pid": pid, "args": {"tokens": step.num_tokens}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
