"""Ranks 1..N-1: join the group, hold one shard of the model, run every forward rank 0 asks for.

A worker has no scheduler, no sampler and no tokenizer. Its loop:

    wait for rank 0's StepMessage (control group)     -> Shutdown: leave
    build or reuse its cache for the message's CacheSpec (its KV heads only)
    forward(batch, kv) on its shards: the same stages as rank 0, the same
        collectives in the same order (embedding all-reduce, 2 all-reduces
        per block, the gather of its LM-head slice)
    tracing? send its stage and collective records to rank 0

Started by `parallel/launch.py` with torch.multiprocessing (one machine), or
by torchrun on every node (`LLM(...)` on a rank other than 0 calls `serve`).
A worker never outlives rank 0: it ignores Ctrl-C (rank 0 shuts it down),
its collectives time out, and a watchdog ends it if its parent disappears.
It leaves quietly: after rank 0 is gone the command has ended, and a worker
that printed its broken collective's traceback then would write into the
user's terminal, over whatever they do next.
"""

import os
import signal
import socket
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.config import ModelConfig, ParallelConfig
from stagewise.kv.contiguous import ContiguousKVCache
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.prepare import calibrate_for
from stagewise.models.registry import LoadedModel
from stagewise.models.weights import LlamaWeights
from stagewise.parallel.group import TensorParallelGroup
from stagewise.parallel.messages import Shutdown, StepMessage, build_cache, to_device, with_cache
from stagewise.parallel.shard import ShardPlan, local_config
from stagewise.trace.tracer import Tracer
from stagewise.tuning import gemm_forms

CONTROL_TIMEOUT = timedelta(days=7)  # workers wait for rank 0's next step for as long as the user is idle
FAULT_ENV = "STAGEWISE_TP_FAULT"  # tests: "RANK:STEP:raise|exit|hang" makes that rank fail at that step


def join_group(rank: int, pcfg: ParallelConfig, backend: str, store=None):
    """init_process_group (data group) + a gloo control group; returns the control group.

    With `store` (rank 0's loopback store: every rank on this machine) gloo listens on loopback too."""
    where = {"store": store} if store is not None else {"init_method": "env://"}  # torchrun sets MASTER_ADDR, ...
    timeout = timedelta(seconds=pcfg.timeout_s)
    with gloo_on_loopback() if store is not None else nullcontext():
        dist.init_process_group(backend, rank=rank, world_size=pcfg.tensor_parallel_size, timeout=timeout, **where)
        return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


@contextmanager
def gloo_on_loopback():
    """Make the gloo groups created inside listen on the loopback interface (all ranks are on this machine).

    gloo binds the address this machine's host name resolves to, which may be a network address; its
    `GLOO_SOCKET_IFNAME` picks the interface instead. Read when a group is created, restored after.
    """
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    try:
        yield
    finally:
        if lo is not None:
            if old is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = old


def build_model(
    config: ModelConfig, plan: ShardPlan, shard: LlamaWeights, device, dtype, backends, group, batch_invariant=True
):
    """This rank's LlamaModel: its local sizes, its shards, its collectives."""
    loaded = LoadedModel(local_config(config, plan), shard, None, f"{config.name} rank {plan.rank}", device, dtype)
    model = LlamaModel(loaded, StageOps("naive", overrides=backends, batch_invariant=batch_invariant), tp=group)
    calibrate_for(shard, model.ops.backends)  # CPU torch tier, once per process: this BLAS's fastest form
    return model


def serve(model: LlamaModel, group: TensorParallelGroup) -> None:
    """The worker loop: one forward per StepMessage, until Shutdown."""
    fault = _fault_for(group.rank)
    caches: dict[int, object] = {}  # rank 0's cache number -> this rank's cache (its KV heads only)
    for step in range(2**62):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group.control_group)
        msg = box[0]
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, StepMessage), type(msg)
        cache = None
        if msg.cache is not None:
            cache = caches.get(msg.cache.key)
            if cache is None:
                if msg.cache.kind == "contiguous":  # kv mode: a new batch's cache; the previous batch's is done
                    caches = {k: c for k, c in caches.items() if not isinstance(c, ContiguousKVCache)}
                cache = build_cache(msg.cache, model.config, model.dtype, model.device, model.batch_device)
                caches[msg.cache.key] = cache
        batch = to_device(msg.batch, model.batch_device)
        kv = with_cache(to_device(msg.kv, model.batch_device), cache)
        if fault is not None and step == fault[0]:
            _inject(fault[1])
        if msg.trace is None:
            model.forward(batch, kv)
            continue
        tracer = Tracer(timing=msg.trace.timing)
        tracer.rank, tracer._t0 = group.rank, msg.trace.t0  # rank 0's clock origin: records line up
        tracer.begin_step(msg.trace.index, "worker", [], {})
        with tracer:
            model.forward(batch, kv)
        dist.gather_object(tracer.current_step_records(), None, dst=0, group=group.control_group)


# ---- a worker process started by torch.multiprocessing (parallel/launch.py) ----


@dataclass
class WorkerArgs:
    rank: int  # this worker's rank, 1..N-1
    pcfg: ParallelConfig  # N, timeouts
    backend: str  # gloo or nccl
    host: str  # rank 0's TCPStore
    port: int
    config: ModelConfig  # the whole model's sizes
    plan: ShardPlan  # this rank's slices
    shard: LlamaWeights  # this rank's weights (shared memory on the CPU: no copy through the pipe)
    device: str  # this rank's device: cpu, or cuda:<rank>
    dtype: torch.dtype
    backends: dict  # stage -> naive|triton, as on rank 0
    errors: object  # the write end of a pipe to rank 0: a failure's one-line reason
    parent_pid: int  # rank 0's process: the watchdog ends this worker when it is gone
    cpu_forms: object  # rank 0's measured CPU GEMM forms (tuning/gemm_forms.py): same machine, same BLAS, no re-measure
    batch_invariant: bool = True  # as on rank 0: False runs the torch tier's batch-variant paths


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 shuts the others down
    if hasattr(signal, "pthread_sigmask"):  # born with SIGINT blocked (launch.py): ignored now, so unblock
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.pcfg.tensor_parallel_size))
    gemm_forms.CPU_FORMS.chosen, gemm_forms.CPU_FORMS.measured_ms = args.cpu_forms.chosen, args.cpu_forms.measured_ms
    gemm_forms.CPU_FORMS.chosen_variant = args.cpu_forms.chosen_variant  # the unpadded forms' choice
    gemm_forms.CPU_FORMS.agreeing = args.cpu_forms.agreeing  # the same BLAS: the same agreement
    try:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shard = args.shard if device == args.shard.embed.device else args.shard.to(device, args.dtype)
        store = dist.TCPStore(
            args.host,
            args.port,
            args.pcfg.tensor_parallel_size,
            is_master=False,
            timeout=timedelta(seconds=args.pcfg.start_timeout_s),
        )
        store.set(f"ready/{args.rank}", "1")
        control = join_group(args.rank, args.pcfg, args.backend, store)
        group = TensorParallelGroup(args.plan, args.backend, control)
        model = build_model(
            args.config, args.plan, shard, device, args.dtype, args.backends, group, args.batch_invariant
        )
        serve(model, group)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, rank 0 must hear why, then this process ends
        _leave(args, exc)


def _leave(args: WorkerArgs, exc: BaseException) -> None:
    """Tell rank 0 why this worker fails, in one line, then end the process (never a traceback).

    When rank 0 is gone (killed: every collective then fails with "connection closed") nobody is left to
    tell, and the command has ended: the worker exits without a word, as its watchdog would."""
    if os.getppid() == args.parent_pid:
        lines = traceback.format_exception_only(type(exc), exc)
        try:
            args.errors.send(lines[-1].strip() if lines else type(exc).__name__)
        except OSError:  # BrokenPipeError: rank 0 died a moment ago
            pass
    os._exit(1)  # no cleanup that could wait on a broken group


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone (killed): no orphan workers


def _fault_for(rank: int) -> tuple[int, str] | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault_rank, step, kind = spec.split(":")
    return (int(step), kind) if int(fault_rank) == rank else None


def _inject(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV})")
    if kind == "exit":
        os._exit(3)
    time.sleep(10**6)  # "hang": alive but silent; the others' collectives time out
