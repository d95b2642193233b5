"""The shape tracer: what each engine step scheduled and every tensor shape each stage saw.

    with Tracer() as tracer:
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    for step in tracer.steps:
        print(step.index, step.num_tokens, [s.stage for s in step.stages])

While a tracer is active, every stage call made through `StageOps` is
recorded: stage, layer, backend, each input and output tensor's name, shape,
dtype and the meaning of each axis (from the stage's `axes`), and optionally
the wall time. The attention stages' `AttentionMetadata` is recorded as the
tensors of it each stage reads, under their own names (`cu_seqlens_q`,
`seq_lens`, `block_table`, `slot_mapping`, ...). Runners open a step with the scheduler's decision and the batch
metadata (positions, slot_mapping, cu_seqlens, block_table rows...).

Under tensor parallelism (`stagewise/parallel/`) every record carries the
`rank` that made it: each worker traces its own forward on its shards and
sends the records to rank 0 at the end of the step, and every collective
(all-reduce, gather) is a record of kind "collective" with its tensor, its
bytes and its wall time, among the stages of its layer.

`Tracer(digests=True)` also keeps, for every request, a short hash of each of
its rows of every stage's output (`trace/digests.py`): two runs of the same
request (alone and batched, invariance on and off) can then be compared, and
`first_divergence` names the first op whose output differed.

Inactive, it costs one `if` per stage call (`active_tracer()` is None).
"""

import time
from dataclasses import asdict, dataclass, field, is_dataclass

import torch

from stagewise.quant.packed_parts import PackedParts
from stagewise.quant.packed_weight import PackedWeight
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.trace import digests as row_hash
from stagewise.trace.hooks import pop_tracer, push_tracer


@dataclass
class TensorRecord:
    name: str  # argument or output name, e.g. "q" or "sampling.temperature"
    shape: list[int]  # tensor shape
    dtype: str  # e.g. "float32"
    axes: list[str] | None  # one name per dimension when the stage declares them
    packed: str | None = None  # part of a packed weight: its format and the matrix it stands for, "q4_1 [K=576, N=960]"

    def label(self) -> str:
        """'[num_tokens=23, hidden=576]' (or '[23, 576]' without axis names)."""
        if self.axes and len(self.axes) == len(self.shape):
            return "[" + ", ".join(f"{a}={n}" for a, n in zip(self.axes, self.shape)) + "]"
        return "[" + ", ".join(str(n) for n in self.shape) + "]"


@dataclass
class StageRecord:
    stage: str  # registry name
    layer: int | None  # transformer block index; None outside the blocks
    backend: str  # "naive" or "triton"
    inputs: list[TensorRecord]  # tensor arguments (and tensor fields of dataclass arguments)
    outputs: list[TensorRecord]  # returned tensors, named by the stage's `outputs`
    scalars: dict  # non-tensor arguments worth showing (eps, scale, ...)
    start_us: float  # microseconds since the tracer started
    dur_us: float | None  # wall time when timing is on
    rank: int = 0  # tensor-parallel rank that ran it (0 without tensor parallelism)
    kind: str = "stage"  # "stage", or "collective" (all_reduce, gather: backend is gloo or nccl)


@dataclass
class StepRecord:
    index: int  # engine step number, from 0
    mode: str  # "naive", "kv" or "paged"
    requests: list[dict]  # per scheduled request: id, num_computed_tokens, num_scheduled, phase, ...
    batch: dict  # batch metadata: positions, slot_mapping, cu_seqlens_q, seq_lens, block_table rows, ...
    stages: list[StageRecord] = field(default_factory=list)
    sampled: dict = field(default_factory=dict)  # request id -> token sampled this step
    text: dict = field(default_factory=dict)  # request id -> output text so far, after this step
    scheduler: dict = field(default_factory=dict)  # blocks allocated/freed, preemptions, cache hits, ...
    start_us: float = 0.0
    dur_us: float = 0.0
    rank: int = 0  # the rank that scheduled and sampled it: always 0
    view: dict | None = None  # the paged engine after the step: queues, requests, block owners (replay)

    @property
    def num_tokens(self) -> int:
        return sum(r["num_scheduled"] for r in self.requests)


COLLECTIVES = ("all_reduce", "gather")  # what tensor parallelism records besides the stages
COLLECTIVE_AXES = {"all_reduce": ["num_tokens", "hidden"], "gather": ["num_seqs", "vocab/N"]}


NOT_PER_TOKEN = ("tokenize", "sampling", "rejection_sampling")  # outputs whose rows are not the step's tokens


class Tracer:
    def __init__(self, timing: bool = True, digests: bool = False):
        self.timing = timing  # record wall time per stage (synchronizes CUDA)
        self.digests = digests  # keep a hash of every request's rows of every stage output
        # request id -> {(layer, stage, call, output, position): hex digest of that row's bits}
        self.row_digests: dict[str, dict[tuple, str]] = {}
        self.op_order: dict[tuple, int] = {}  # (layer, stage, call) -> the order ops first ran in
        self._owners: list | None = None  # this step's token rows -> (request id, position)
        self._calls: dict[tuple, int] = {}  # (layer, stage) -> calls so far in this step
        self.prelude: list[StageRecord] = []  # stage calls outside any engine step (tokenize)
        self.steps: list[StepRecord] = []
        self.summary: dict = {}  # filled by the runner at the end: tokens, KV blocks, TTFT, TBT, ...
        self.model: dict = {}  # config of the traced model (sizes), filled by the LLM
        self.rank = 0  # tensor-parallel rank of this process (a worker's tracer sets its own)
        self._t0 = time.perf_counter()  # time origin; a worker's tracer takes rank 0's (one clock per machine)
        self._current: StepRecord | None = None

    def __enter__(self) -> "Tracer":
        push_tracer(self)
        return self

    def __exit__(self, *exc) -> None:
        pop_tracer(self)

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    # ---- called by the engine ----

    def begin_step(self, index: int, mode: str, requests: list[dict], batch: dict, scheduler: dict | None = None):
        self._current = StepRecord(index, mode, requests, batch, scheduler=scheduler or {}, start_us=self._now_us())
        self.steps.append(self._current)
        self._owners, self._calls = None, {}

    def end_step(self, sampled: dict, text: dict, view: dict | None = None) -> None:
        step = self._current
        if step is None:
            return
        step.sampled, step.text, step.view = sampled, text, view
        step.dur_us = self._now_us() - step.start_us
        self._current = None

    # ---- called by StageOps ----

    def record_stage(self, stage: str, layer: int | None, backend: str, fn, kwargs: dict):
        spec = STAGES[stage]
        timing = self.timing
        if timing and _on_cuda(kwargs):
            torch.cuda.synchronize()
        start = self._now_us()
        result = fn(**kwargs)
        if timing and _on_cuda(kwargs):
            torch.cuda.synchronize()
        dur = self._now_us() - start if timing else None
        inputs, scalars = [], {}
        for name, value in kwargs.items():
            inputs += _tensor_records(name, value, spec.axes)
            if isinstance(value, str):
                scalars[name] = value if len(value) <= 80 else value[:77] + "..."
            elif isinstance(value, int | float) and not isinstance(value, bool):
                scalars[name] = value
            elif isinstance(value, AttentionMetadata):  # its host maxima, as when they were arguments
                scalars.update(max_q_len=value.max_q_len, max_seq_len=value.max_seq_len)
        outs = result if isinstance(result, tuple) else (result,)
        outputs = []
        for name, value in zip(spec.outputs, outs):
            outputs += _tensor_records(name, value, spec.axes)
        record = StageRecord(stage, layer, backend, inputs, outputs, scalars, start, dur, rank=self.rank)
        self.add_records([record])
        if self.digests and self._current is not None and stage not in NOT_PER_TOKEN:
            self._digest(stage, layer, kwargs, spec.outputs, outs)
        return result

    def _digest(self, stage: str, layer: int | None, kwargs: dict, names: tuple, outs: tuple) -> None:
        """Each output row's digest, under its owner (request, position): `trace/digests.py`."""
        if self._owners is None:
            positions = self._current.batch.get("positions")
            self._owners = [] if positions is None else row_hash.row_owners(self._current.requests, positions)
        owners = self._owners
        if stage == "lm_head":  # its rows are the tokens `last_token_index` picks
            owners = [owners[i] for i in kwargs["last_token_index"].tolist()]
        call = self._calls.get((layer, stage), 0)
        self._calls[(layer, stage)] = call + 1
        self.op_order.setdefault((layer, stage, call), len(self.op_order))
        for name, value in zip(names, outs):
            if not isinstance(value, torch.Tensor) or value.is_meta or value.dim() == 0:
                continue
            if value.shape[0] != len(owners) or not owners:
                continue
            for owner, digest in zip(owners, row_hash.row_digests(value)):
                if owner is not None:
                    request_id, position = owner
                    self.row_digests.setdefault(request_id, {})[(layer, stage, call, name, position)] = digest

    # ---- called by the tensor-parallel group and its driver ----

    def record_collective(
        self, op: str, layer: int | None, backend: str, tensor: torch.Tensor, world_size: int, dur_s: float, rank: int
    ) -> None:
        """One collective: op ("all_reduce", "gather"), its tensor, payload bytes, wall time."""
        axes = COLLECTIVE_AXES.get(op)
        rec = TensorRecord("x", list(tensor.shape), str(tensor.dtype).removeprefix("torch."), axes)
        nbytes = tensor.numel() * tensor.element_size()
        dur_us = dur_s * 1e6
        scalars = {"bytes": nbytes, "world_size": world_size}
        record = StageRecord(
            op, layer, backend, [rec], [rec], scalars, self._now_us() - dur_us, dur_us, rank=rank, kind="collective"
        )
        self.add_records([record])

    def add_records(self, records: list[StageRecord]) -> None:
        """Append records to the open step (or the prelude): this rank's, or the ones a worker sent."""
        (self._current.stages if self._current is not None else self.prelude).extend(records)

    def current_step_records(self) -> list[StageRecord]:
        return self._current.stages if self._current is not None else self.prelude

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "prelude": [asdict(s) for s in self.prelude],
            "steps": [asdict(s) for s in self.steps],
            "summary": self.summary,
        }


def _on_cuda(kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in kwargs.values())


def _tensor_records(name: str, value, axes: dict[str, str]) -> list[TensorRecord]:
    if isinstance(value, torch.Tensor):
        names = axes.get(name)
        return [
            TensorRecord(
                name, list(value.shape), str(value.dtype).removeprefix("torch."), names.split() if names else None
            )
        ]
    if isinstance(value, AttentionMetadata):
        # the step's metadata: the tensors this stage reads (the ones its `axes` name), under their own
        # names (cu_seqlens_q, seq_lens, block_table, slot_mapping, ...), as if passed one by one
        out = []
        for key, inner in vars(value).items():
            if isinstance(inner, torch.Tensor) and key in axes:
                out += _tensor_records(key, inner, axes)
        return out
    if isinstance(value, PackedWeight):
        return _packed_records(name, value)
    if is_dataclass(value) and not isinstance(value, type):
        out = []
        for key, inner in vars(value).items():
            if isinstance(inner, torch.Tensor):
                out.append(
                    TensorRecord(f"{name}.{key}", list(inner.shape), str(inner.dtype).removeprefix("torch."), None)
                )
        return out
    return []


def _packed_records(name: str, w: PackedWeight) -> list[TensorRecord]:
    """A packed weight as its stored parts, each named for the matrix axis it cuts.

    w_qkv (q4_1, [K=576, N=960]) -> w_qkv.codes [N=960, K/2=288] uint8 (two 4-bit codes a byte),
    w_qkv.scales [N=960, K/32=18] float16, w_qkv.mins [N=960, K/32=18] float16. Parts of mixed
    kinds (`PackedParts`, q4_k+q6_k) are listed part by part: w_qkv[0].codes, ..., w_qkv[1].codes.
    """
    if isinstance(w, PackedParts):
        return [r for i, p in enumerate(w.parts) for r in _packed_records(f"{name}[{i}]", p)]
    k, n = w.shape
    what = f"{w.kind} [K={k}, N={n}]"
    out = []
    for key, inner in w.file_parts().items():  # codes, scales, mins (file layout)
        axes = None
        if inner.dim() == 2 and inner.shape[0] == n and inner.shape[1] and k % inner.shape[1] == 0:
            per = k // inner.shape[1]
            axes = ["N", "K" if per == 1 else f"K/{per}"]
        dtype = str(inner.dtype).removeprefix("torch.")
        out.append(TensorRecord(f"{name}.{key}", list(inner.shape), dtype, axes, packed=what))
    return out
