"""What `LLM(...)` builds once its arguments are checked and its weights loaded and readied.

build_model          one device: the `LlamaModel`; N ranks: tensor parallelism starts here
                     (rank 0's `TensorParallelModel` starts ranks 1..N-1, or serves a
                     torchrun rank other than 0 and ends the process)
build_paged_runner   mode "paged": the engine that lives as long as the `LLM` — its KV cache,
                     block manager, scheduler and, when asked, a speculative proposer; the
                     CUDA-graph runner (engine/graph_runner.py) only with `cuda_graphs`
"""

import sys

from stagewise.config import EngineConfig, ParallelConfig
from stagewise.engine.checks import check_engine_memory
from stagewise.engine.paged_runner import PagedRunner
from stagewise.engine.speculative import make_proposer
from stagewise.errors import StagewiseError
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import LoadedModel


def build_model(loaded: LoadedModel, ops: StageOps, pcfg: ParallelConfig, ecfg: EngineConfig):
    """One device: the LlamaModel; N ranks: rank 0's TensorParallelModel (starts the others)."""
    if pcfg.tensor_parallel_size == 1:
        return LlamaModel(loaded, ops)
    from stagewise.parallel.driver import serve_torchrun_worker, tensor_parallel_model
    from stagewise.parallel.launch import torchrun_rank

    if ecfg.cuda_graphs:
        raise StagewiseError(
            "cuda_graphs does not run under tensor parallelism; turn one of them off"
        )
    rank = torchrun_rank()
    if rank:  # torchrun, a rank other than 0: serve rank 0's steps, then end this process
        serve_torchrun_worker(loaded, ops, pcfg, rank)
        raise SystemExit(0)
    model = tensor_parallel_model(loaded, ops, pcfg)  # shared with other LLMs of the same model
    if ops.batch_invariant:  # said once the ranks run, so a refused start prints only its error
        _say_once(
            "batch invariance holds within one tensor-parallel degree; across degrees "
            f"(here {pcfg.tensor_parallel_size} ranks vs 1) the logits differ (out of scope)"
        )
    return model


def build_paged_runner(llm) -> PagedRunner:
    """The paged engine of `llm` (its model built, its max_model_len and speculative config set).

    Refused before anything is allocated when its KV cache cannot fit in free memory."""
    ecfg = llm.engine_config
    check_engine_memory(llm.loaded, ecfg, llm.max_model_len)
    spec = llm.speculative_config
    proposer = make_proposer(spec, llm) if spec is not None else None
    runner = PagedRunner
    if ecfg.cuda_graphs:  # the CUDA-graph runner wraps the plain one; a plain run never loads it
        from stagewise.engine.graph_runner import GraphRunner

        runner = GraphRunner
    try:
        return runner(
            llm.model,
            llm.tokenizer.stop_ids,
            llm.max_model_len,
            ecfg,
            proposer=proposer,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        )
    except (RuntimeError, MemoryError) as exc:  # the KV pool or block table does not fit
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StagewiseError(
            f"cannot allocate the paged KV cache ({first}); lower num_kv_blocks / max_num_seqs"
        ) from None


_SAID: set[str] = set()  # notices printed in this process


def _say_once(text: str) -> None:
    """One line on stderr, once per process (an LLM per request would repeat it)."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"stagewise: {text}", file=sys.stderr)
