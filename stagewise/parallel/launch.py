"""Starting and stopping the ranks: torch.multiprocessing on one machine, or torchrun on many.

One machine (`LLM(..., tensor_parallel_size=N)` in any Python process):

    rank 0 (this process) opens a TCPStore on a free port
    spawns ranks 1..N-1 (torch.multiprocessing, "spawn"), each handed its shard
        (CPU tensors travel as shared memory, not through the pipe)
    waits until every worker says "ready", watching for one that died first
    init_process_group(gloo | nccl, store) on every rank, then a gloo control group

Many machines: torchrun starts one process per rank on every node and sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the same script runs
everywhere, `init_process_group(init_method="env://")` joins them, and
`LLM(...)` on a rank other than 0 serves rank 0 until it is done (README).

Who may talk to the ranks. The store is a key-value server with no
authentication, and the control group carries pickled Python objects: a
process that joins either can run code in every rank. So on one machine
everything listens on the loopback address only: the store's socket is bound
to 127.0.0.1 here and handed to the store already listening (torch's own
server would bind every interface, whatever host name it is given), and gloo's
connections between the ranks use the loopback interface too. Processes of
other users on the same machine can still reach loopback; across machines
(torchrun) the store and gloo listen on the network, so run multi-node jobs
only on a network where every host is trusted (a private cluster network,
not one shared with strangers), as with any torch.distributed job.

Spawning re-imports the main module in every worker. A script whose top
level builds the LLM without an `if __name__ == "__main__":` guard would start
tensor parallelism again inside each worker; the worker notices (it is still
importing) and leaves at once with `REIMPORTED_EXIT`, and rank 0 says what
to add.
"""

import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stagewise.config import ParallelConfig
from stagewise.errors import StagewiseError
from stagewise.parallel.shard import shard_weights
from stagewise.parallel.worker import WorkerArgs, join_group, worker_main
from stagewise.tuning import gemm_forms

HOST = "127.0.0.1"  # the spawned ranks all live on this machine
JOIN_S = 10.0  # how long an orderly shutdown waits for a worker before killing it
WORKER_NAME = "stagewise-tp-rank"  # + the rank: the worker processes' names (multiprocessing)
REIMPORTED_EXIT = 87  # a worker's exit status when it found itself re-running an unguarded script's top level
MAIN_GUARD_HINT = (
    "tensor parallelism spawns its workers, and each worker re-imports your script: put the script's "
    'top-level code (at least everything that builds the LLM) under `if __name__ == "__main__":`'
)


def env_int(name: str, default: int | None = None) -> int:
    """A count a launcher put in the environment (RANK, WORLD_SIZE, ...), or a one-line error."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not (text.strip().isascii() and text.strip().isdigit()):
        raise StagewiseError(f"{name} must be a whole number >= 0 (torchrun sets it), got {text!r}")
    return int(text)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any env:// launcher) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        env_int("WORLD_SIZE")
        return env_int("RANK")
    return None


@dataclass
class Ranks:
    """The other ranks as rank 0 sees them: processes (when spawned here), their error pipes, the groups."""

    processes: dict[int, object] = field(default_factory=dict)  # rank -> multiprocessing Process
    errors: dict[int, object] = field(default_factory=dict)  # rank -> read end of its error pipe
    store: object = None  # the TCPStore every rank met at (spawned ranks)
    control_group: object = None  # set once the groups exist
    world_size: int = 1
    in_step: bool = False  # rank 0 is inside a step: the workers wait in its collectives, not for Shutdown

    def reasons(self, wait_s: float = 2.0) -> list[str]:
        """What failed workers reported ("rank 1: RuntimeError: ..."), or how they ended."""
        deadline = time.monotonic() + wait_s
        out = []
        for rank, conn in self.errors.items():
            proc = self.processes[rank]
            while proc.is_alive() and not conn.poll(0) and time.monotonic() < deadline:
                time.sleep(0.02)  # a failing worker writes its reason, then exits
            said = _read(conn)
            if said is not None:
                out.append(f"rank {rank}: {said}")
                continue
            proc.join(max(0.0, deadline - time.monotonic()))  # its sockets close a moment before it is reaped
            if not proc.is_alive():
                out.append(f"rank {rank} exited with code {proc.exitcode}")
        return out

    def stop(self, orderly: bool = False) -> None:
        """End every worker (orderly: give them JOIN_S to leave their loop; then terminate, then kill)."""
        deadline = time.monotonic() + (JOIN_S if orderly else 0.0)
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self.control_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.control_group = None


def _read(conn) -> str | None:
    """A worker's last words, if it wrote any (EOF: it ended without a word)."""
    try:
        return conn.recv() if conn.poll(0) else None
    except (EOFError, OSError):
        return None


def start(loaded, ops, pcfg: ParallelConfig, backend: str, plans) -> Ranks:
    """Spawn ranks 1..N-1 with their shards (nothing under torchrun: it started them)."""
    n = pcfg.tensor_parallel_size
    ranks = Ranks(world_size=n)
    if torchrun_rank() is not None:
        return ranks
    if dist.is_initialized():
        raise StagewiseError(
            "a tensor-parallel LLM is already running in this process (one process group at a time); "
            "call .shutdown() on it first"
        )
    if backend == "nccl" and torch.cuda.device_count() < n:
        raise StagewiseError(
            f"NCCL puts one rank per GPU: tensor_parallel_size={n} needs {n} GPUs, this machine has "
            f"{torch.cuda.device_count()}"
        )
    ranks.store = loopback_store(n, timedelta(seconds=pcfg.start_timeout_s))
    ctx = mp.get_context("spawn")
    try:
        for plan in plans[1:]:
            device = torch.device(f"cuda:{plan.rank}") if backend == "nccl" else loaded.device
            shard = shard_weights(loaded.weights, loaded.config, plan, loaded.device, loaded.dtype)
            if shard.embed.device.type == "cpu":
                shard = _shared(shard)
            reader, writer = ctx.Pipe(duplex=False)
            args = WorkerArgs(
                plan.rank,
                pcfg,
                backend,
                HOST,
                ranks.store.port,
                loaded.config,
                plan,
                shard,
                str(device),
                loaded.dtype,
                dict(ops.backends),
                writer,
                os.getpid(),
                gemm_forms.CPU_FORMS,
                ops.batch_invariant,
            )
            proc = ctx.Process(target=worker_main, args=(args,), name=f"{WORKER_NAME}{plan.rank}", daemon=True)
            with _sigint_blocked():  # the worker is born deaf to Ctrl-C, before its imports begin
                proc.start()
            writer.close()  # the worker holds the write end now
            ranks.processes[plan.rank], ranks.errors[plan.rank] = proc, reader
    except BaseException:
        ranks.stop()
        raise
    return ranks


@contextmanager
def _sigint_blocked():
    """Block SIGINT in this thread while a worker is spawned; one that arrives meanwhile is delivered after.

    A child inherits the signal mask through fork and exec, so the worker starts with SIGINT blocked and
    keeps it so until `worker_main` ignores it: a Ctrl-C while the worker still imports torch stays
    pending there, then is dropped, instead of a KeyboardInterrupt traceback on the terminal.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started by the first spawn otherwise, and it *unblocks* SIGINT after
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def loopback_store(world_size: int, timeout: timedelta):
    """Rank 0's TCPStore, listening on 127.0.0.1 only, on a port the OS picks.

    torch's store server binds every interface for any host name it is given, so the socket is made here:
    bound to loopback, listening, then handed over by file descriptor. `detach()` gives the descriptor to
    the store, which closes it when it is destroyed; a Python socket object left holding it would close it
    when garbage-collected, under the store's server thread (clients then time out, or the thread aborts).
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))  # port 0: the OS picks a free one
        listener.listen(world_size + 16)
        port = listener.getsockname()[1]
        fd = listener.detach()
    except BaseException:
        listener.close()
        raise
    try:
        return dist.TCPStore(
            HOST, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise


def exit_if_reimported() -> None:
    """In a worker that is still importing the user's script (spawn re-runs `__main__`): leave at once.

    Reaching `LLM(..., tensor_parallel_size=N)` there means the script builds it at import time, with no
    `__name__` guard; rank 0 turns this exit status into `MAIN_GUARD_HINT`.
    """
    me = mp.current_process()
    if getattr(me, "_inheriting", False) and me.name.startswith(WORKER_NAME):  # set by spawn while preparing
        os._exit(REIMPORTED_EXIT)


def _shared(weights):
    """Move every tensor into shared memory, so spawning a worker passes a handle, not the bytes."""
    for t in [weights.embed, weights.final_norm, *(v for lw in weights.layers for v in vars(lw).values())]:
        t.share_memory_()
    return weights


def join_as_rank0(ranks: Ranks, pcfg: ParallelConfig, backend: str):
    """Wait for the spawned workers to be ready (or fail), then form the groups as rank 0."""
    if ranks.store is None:  # torchrun
        ranks.control_group = join_torchrun(0, pcfg, backend)
        return ranks.control_group
    deadline = time.monotonic() + pcfg.start_timeout_s
    for rank in ranks.processes:
        while not ranks.store.check([f"ready/{rank}"]):
            dead = [r for r, p in ranks.processes.items() if not p.is_alive()]
            if any(ranks.processes[r].exitcode == REIMPORTED_EXIT for r in dead):
                raise StagewiseError(MAIN_GUARD_HINT)
            if dead:
                why = "; ".join(ranks.reasons()) or f"rank {dead[0]} exited"
                raise StagewiseError(f"a tensor-parallel worker failed to start ({why})")
            if time.monotonic() > deadline:
                raise StagewiseError(f"tensor-parallel rank {rank} did not start within {pcfg.start_timeout_s:.0f} s")
            time.sleep(0.02)
    ranks.control_group = join_group(0, pcfg, backend, ranks.store)
    return ranks.control_group


def join_torchrun(rank: int, pcfg: ParallelConfig, backend: str):
    world = env_int("WORLD_SIZE")
    if world != pcfg.tensor_parallel_size:
        raise StagewiseError(f"torchrun started {world} processes but tensor_parallel_size={pcfg.tensor_parallel_size}")
    if backend == "nccl":
        torch.cuda.set_device(env_int("LOCAL_RANK", rank))
    return join_group(rank, pcfg, backend)
