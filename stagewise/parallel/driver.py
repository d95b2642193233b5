"""Rank 0: the driver. It owns the scheduler and the sampler; the model it hands the runners is this.

`TensorParallelModel` looks like a `LlamaModel` to every runner (`config`,
`ops`, `device`, `dtype`, `batch_device`, `forward(batch, kv)`), so the
paged, kv and naive runners work unchanged: their `self.model.forward(...)`
call becomes

    broadcast StepMessage(batch, kv)     -> ranks 1..N-1 start the same forward
    forward on rank 0's shards           -> collectives with every rank
    (tracing: gather the workers' records)
    -> logits [B, vocab], gathered from the N vocabulary slices

Its `config` is rank 0's *local* config (H/N heads, Hkv/N KV heads, ...), so
the runners build caches that hold this rank's KV heads only; the workers
build the same caches for theirs.

Failure is all or nothing. Any exception during a step — a worker that raised
(its reason arrives through a pipe), a worker that died (its sockets close),
a collective timeout (a stuck rank), Ctrl-C — shuts every rank down, because
the ranks' collectives are out of step from then on, and rank 0 raises one
`TensorParallelError` naming the rank and the reason. The LLM then refuses
further steps with a clear message; make a new one.

Ctrl-C may come twice, and the second one may land anywhere, in the middle of
the cleanup too. So the cleanup is written to be interrupted: the model is
marked closed before anything else, an interrupt does not wait for the
workers' reasons (they have none: rank 0 stopped them), the killing of the
workers runs to its end whatever lands meanwhile, and a step that was left
half-done without that (the interrupt came before the cleanup began) is
noticed by the next call, which then ends the ranks instead of joining
collectives nobody else is in.
"""

import weakref

import torch
import torch.distributed as dist

from stagewise.config import ModelConfig, ParallelConfig
from stagewise.errors import StagewiseError
from stagewise.models.prepare import calibrate_for
from stagewise.models.registry import LoadedModel
from stagewise.parallel import launch
from stagewise.parallel.group import TensorParallelGroup
from stagewise.parallel.messages import Shutdown, TraceRequest, step_message
from stagewise.parallel.shard import check_tp_size, local_config, shard_plan, shard_weights
from stagewise.parallel.worker import build_model
from stagewise.trace.hooks import active_tracer


class TensorParallelError(StagewiseError):
    """A rank failed (raised, died or timed out); every rank has been shut down."""


def choose_backend(pcfg: ParallelConfig, device: torch.device) -> str:
    backend = pcfg.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise StagewiseError("the nccl backend needs CUDA devices; on a CPU use gloo")
    if device.type == "meta":
        raise StagewiseError(
            "tensor parallelism runs real weights; a shape-only model has none "
            "(see `stagewise calc --tp N` for the per-device numbers)"
        )
    return backend


# The process's one running TP model per (weights, N, stage backends): torch.distributed allows one
# default process group per process, so LLMs of other modes over the same model share its ranks
# (`bench modes --tp` alternates kv and paged over one group). Shut down when its last LLM is.
_RUNNING: dict[tuple, "TensorParallelModel"] = {}


def tensor_parallel_model(loaded: LoadedModel, ops, pcfg: ParallelConfig) -> "TensorParallelModel":
    """A running TensorParallelModel for these weights, N and backends (started, or shared), one user more."""
    launch.exit_if_reimported()  # a worker re-running an unguarded script: leave before starting ranks again
    key = (id(loaded.weights), pcfg, tuple(sorted(ops.backends.items())), ops.batch_invariant)
    model = _RUNNING.get(key)
    if model is None or model._closed is not None:
        model = TensorParallelModel(loaded, ops, pcfg)
        _RUNNING[key] = model
        model._key = key
    model.users += 1
    return model


class TensorParallelModel:
    def __init__(self, loaded: LoadedModel, ops, pcfg: ParallelConfig):
        n = pcfg.tensor_parallel_size
        full: ModelConfig = loaded.config
        check_tp_size(full, n)
        self.backend = choose_backend(pcfg, loaded.device)
        self.world_size = n
        self.full_config = full  # the whole model's sizes
        self.ops, self.device, self.dtype = ops, loaded.device, loaded.dtype
        plans = [shard_plan(full, r, n) for r in range(n)]
        self.config = local_config(full, plans[0])  # rank 0's sizes: what the runners build caches for
        self.pcfg = pcfg
        calibrate_for(loaded.weights, ops.backends)  # once per process, whole model; workers inherit it
        self._closed: str | None = None  # why no further step can run (None: running)
        self.users = 0  # LLMs sharing these ranks (tensor_parallel_model); the last one's shutdown ends them
        self._source = loaded.weights  # held, so its id (the sharing key) cannot be reused by other weights
        self._key = None
        self.ranks = launch.start(loaded, ops, pcfg, self.backend, plans)  # the worker processes (if spawned)
        try:
            control = launch.join_as_rank0(self.ranks, pcfg, self.backend)
            self.group = TensorParallelGroup(plans[0], self.backend, control)
            shard = shard_weights(loaded.weights, full, plans[0], loaded.device, loaded.dtype)
            self.local = build_model(
                full, plans[0], shard, loaded.device, loaded.dtype, ops.backends, self.group, ops.batch_invariant
            )
        except BaseException:
            self.ranks.stop()
            raise
        self.batch_device = self.local.batch_device
        self.weights = self.local.weights  # rank 0's shards
        self._finalizer = weakref.finalize(self, _shutdown, self.ranks)

    def forward(self, batch, kv) -> torch.Tensor:
        """The runners' one call: the same forward on every rank; -> logits [B, vocab] on rank 0."""
        if self._closed is None and self.ranks.in_step:  # the last step never finished, nor cleaned up
            self._fail(KeyboardInterrupt())
        if self._closed is not None:
            raise TensorParallelError(self._closed)
        tracer = active_tracer()
        trace = None
        if tracer is not None:
            index = tracer.steps[-1].index if tracer.steps else 0
            trace = TraceRequest(timing=tracer.timing, t0=tracer._t0, index=index)
        self.ranks.in_step = True
        try:
            box = [step_message(batch, kv, trace)]
            dist.broadcast_object_list(box, src=0, group=self.group.control_group)  # -> every worker's loop
            logits = self.local.forward(batch, kv)  # [B, vocab], every collective on the way
            if tracer is not None:
                gathered = [None] * self.world_size
                dist.gather_object(None, gathered, dst=0, group=self.group.control_group)
                for records in gathered[1:]:
                    tracer.add_records(records)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.ranks.in_step = False
        return logits

    def failure(self) -> str | None:
        """Why no step can run any more (a rank failed or exited, or the ranks were shut down), or
        None. A worker that died between steps is seen here before a step trips over it (a
        server's /health)."""
        if self._closed is not None:
            return self._closed
        dead = {rank: proc.exitcode for rank, proc in self.ranks.processes.items() if not proc.is_alive()}
        if dead:
            rank, code = next(iter(dead.items()))
            return f"tensor-parallel rank {rank} exited with code {code}; create a new LLM"
        return None

    def _fail(self, exc: BaseException) -> None:
        """Shut every rank down and say which rank failed and why (KeyboardInterrupt stays itself)."""
        if isinstance(exc, KeyboardInterrupt):
            self._closed = "the tensor-parallel ranks were shut down by an interrupted step; create a new LLM"
            _to_the_end(self._stop)  # no reasons to wait for: the workers are fine, rank 0 stops them
            return
        self._closed = "the tensor-parallel run failed earlier; create a new LLM"  # first: in case of Ctrl-C
        try:
            reasons = self.ranks.reasons()  # what the workers reported before exiting, if anything
        finally:
            _to_the_end(self._stop)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if not reasons and "timed out" in first.lower():
            waited = f"timeout_s={self.pcfg.timeout_s:g} s"
            reasons = [f"a collective waited longer than {waited}: a rank is stuck ({first})"]
        if not reasons:
            reasons = [f"rank 0: {type(exc).__name__}: {first}"]
        why = "; ".join(reasons)
        self._closed = f"the tensor-parallel run failed earlier ({why}); create a new LLM"
        raise TensorParallelError(f"tensor-parallel run failed: {why}; every rank was shut down") from exc

    def _stop(self) -> None:
        if _RUNNING.get(self._key) is self:
            del _RUNNING[self._key]
        self._finalizer.detach()
        self.ranks.stop()

    def release(self) -> None:
        """One LLM less: the last one shuts the ranks down."""
        self.users -= 1
        if self.users <= 0:
            self.shutdown()

    def shutdown(self) -> None:
        """Tell every worker to leave, wait for them, close the groups (idempotent)."""
        if _RUNNING.get(self._key) is self:
            del _RUNNING[self._key]
        if self._closed is None:
            self._closed = "this LLM was shut down"
            self._finalizer.detach()
            try:
                _shutdown(self.ranks)
            except KeyboardInterrupt:  # Ctrl-C while the workers leave: end them now, then stop
                _to_the_end(self.ranks.stop)
                raise

    def describe(self) -> dict:
        return {"tensor_parallel_size": self.world_size, "tp_backend": self.backend}


def _shutdown(ranks) -> None:
    """The orderly end: Shutdown to every worker, then join (and kill any that does not leave).

    Not after a step left half-done: the workers wait in its collectives and would never read Shutdown."""
    try:
        if ranks.control_group is not None and not ranks.in_step:
            dist.broadcast_object_list([Shutdown()], src=0, group=ranks.control_group)
    except Exception:  # noqa: BLE001 - a broken group: stop() kills what is left
        pass
    ranks.stop(orderly=not ranks.in_step)


def _to_the_end(cleanup) -> None:
    """Run `cleanup` (idempotent) to its end even if Ctrl-C lands meanwhile; then raise that interrupt.

    A KeyboardInterrupt can surface between any two bytecodes, so the cleanup simply starts again
    (every step of it may run twice); an interrupt that came during the cleanup is raised after it."""
    interrupt = None
    while True:
        try:
            cleanup()
            break
        except KeyboardInterrupt as exc:
            interrupt = exc
    if interrupt is not None:
        raise interrupt


def serve_torchrun_worker(loaded: LoadedModel, ops, pcfg: ParallelConfig, rank: int) -> None:
    """`LLM(...)` on a torchrun rank other than 0: serve rank 0's steps, then return (the caller exits)."""
    from stagewise.parallel.worker import serve

    backend = choose_backend(pcfg, loaded.device)
    plan = shard_plan(loaded.config, rank, pcfg.tensor_parallel_size)
    control = launch.join_torchrun(rank, pcfg, backend)
    group = TensorParallelGroup(plan, backend, control)
    shard = shard_weights(loaded.weights, loaded.config, plan, loaded.device, loaded.dtype)
    local = build_model(
        loaded.config, plan, shard, loaded.device, loaded.dtype, ops.backends, group, ops.batch_invariant
    )
    serve(local, group)
    dist.destroy_process_group()
