"""The device check's orchestration in a CPU dry run: sections in child processes, JSON + markdown out.

The full dry run (every section, tiny shapes) is `bash benchmarks/gpu/run.sh --dry-run`; here every
section goes through the same orchestrator and report, the costly ones cut at a short limit.
"""

import json
import subprocess
import sys
import time

import pytest

from stagewise.devtools.device_check import SECTIONS


def test_dry_run_report_path_renders_every_section(tmp_path):
    """Every section through the real orchestrator: env and tests run (tests only collected), kernels,
    e2e and bench are cut at a 1 s limit (each killed with its process group), and the markdown
    renders each with its status instead of crashing on a section that has no results."""
    cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--dry-run", "--out", str(tmp_path)]
    limits = "kernels=1,e2e=1,bench=1"
    proc = subprocess.run([*cmd, "--limits", limits], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "device_check.json").read_text())
    assert results["dry_run"] is True and list(results["sections"]) == list(SECTIONS)
    secs = results["sections"]
    assert secs["env"]["copy"]["gb_per_s"] > 0 and secs["env"]["machine"]["torch"]
    assert secs["tests"]["returncode"] == 0 and "collected" in secs["tests"]["summary"]
    for name in ("kernels", "e2e", "bench"):
        assert secs[name]["failed"] == "exit timeout" and secs[name]["limit_s"] == 1, secs[name]
        assert secs[name]["wall_s"] < 30  # killed, not waited for
    md = (tmp_path / "device_check.md").read_text()
    assert md.startswith("# Device check (dry run") and "copy bandwidth" in md
    for name in ("kernels", "e2e"):
        assert f"| {name} | cut at its limit |" in md, md
    assert "| tests | ok |" in md and "## tests on the device" in md and "collected" in md
    assert "== env" in (tmp_path / "log.txt").read_text()


def test_the_gpu_plan_fits_about_eight_minutes_and_its_readme_says_so():
    """The budget bounds the sections together; with the machine's start (150 s at most) the check
    ends within about 8 minutes, and benchmarks/gpu/README.md quotes the limits and budget in force."""
    from pathlib import Path

    from stagewise.devtools.device_check import BUDGET_S, DRY_BUDGET_S, DRY_LIMITS_S, LIMITS_S

    assert BUDGET_S + 150 <= 8 * 60 and all(LIMITS_S[s] < BUDGET_S for s in SECTIONS)
    readme = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "README.md").read_text()
    gpu, dry = (", ".join(f"{s} {limits[s]:.0f}" for s in SECTIONS) for limits in (LIMITS_S, DRY_LIMITS_S))
    assert f"| limits, s | {gpu} | {dry} |" in readme
    assert f"| budget, s | {BUDGET_S:.0f} | {DRY_BUDGET_S:.0f} |" in readme


def test_a_spent_budget_skips_sections_and_still_writes_the_tables(tmp_path):
    from stagewise.devtools.device_check import orchestrate

    results = orchestrate(tmp_path, dry_run=True, budget_s=5, sections=["env", "tests"])
    assert results["sections"] == {n: {"skipped": "time budget spent (5 s)"} for n in ("env", "tests")}
    md = (tmp_path / "device_check.md").read_text()
    assert "| tests | skipped: time budget spent (5 s) |" in md and "## tests on the device" in md


def test_report_renders_results_of_every_kind():
    """A GPU run's shapes of results (ok, cut, failed, mismatches, autotuner picks) as tables."""
    from stagewise.devtools.device_report import render_markdown

    results = {"dry_run": False, "total_seconds": 300, "sections": {
        "kernels": {"rows": [{"kernel": "matmul", "shape": "M=1", "error": "ValueError: bad"}], "wall_s": 40,
                    "limit_s": 90, "autotune": [{"kernel": "_matmul_kernel", "key_args": ["M", "N"],
                    "key": ["1", "4096"], "config": "BLOCK_M: 16, num_warps: 4", "candidates": 6}]},
        "e2e": {"failed": "exit 1", "tail": "Traceback ... boom", "wall_s": 3, "limit_s": 150},
        "bench": {"mismatches": ["8 tokens: 'paged (run 1)' produced different tokens"], "wall_s": 60, "limit_s": 90},
        "tests": {"command": "pytest -v", "returncode": "timeout", "summary": "cut after 110 s: ...",
                  "counts": {"PASSED": 160, "FAILED": 2, "ERROR": 0, "SKIPPED": 1},
                  "failures": ["FAILED tests/kernels/test_matmul.py::test_out_dtype"], "wall_s": 112, "limit_s": 120},
    }}  # fmt: skip
    md = render_markdown(results)
    assert "| kernels | ok | 40 | 90 | 44% |" in md and "| e2e | failed (exit 1) | 3 | 150 | 2% |" in md
    assert "| _matmul_kernel | M=1, N=4096 | BLOCK_M: 16, num_warps: 4 | 6 |" in md
    assert "Traceback ... boom" in md and "token mismatch (recorded, timings kept): 8 tokens" in md
    assert "- FAILED tests/kernels/test_matmul.py::test_out_dtype" in md and "160 passed, 2 failed" in md


def test_a_mismatch_is_recorded_or_raised():
    from stagewise.bench.commands.modes import check_identical
    from stagewise.errors import StagewiseError

    found = []
    check_identical({"kv": [1, 2, 3], "paged": [1, 2, 3]}, "3 tokens", found)
    assert found == []
    check_identical({"kv": [1, 2, 3], "paged": [1, 5, 3]}, "3 tokens", found)
    assert len(found) == 1 and "first difference at output token 1: [2, 3] vs [5, 3]" in found[0]
    with pytest.raises(StagewiseError, match="timings of different outputs are not compared"):
        check_identical({"kv": [1, 2], "paged": [1, 5]}, "2 tokens")


NESTED = """
import subprocess, sys, time
from stagewise.devtools.process_group import forward_terminate, run_in_group
forward_terminate()  # as a section does: pass a kill on to the group it starts below
worker = subprocess.Popen(["sleep", "60"])  # in this group: the outer kill reaches it directly
print(worker.pid, flush=True)
inner = "import subprocess, sys, time; print(subprocess.Popen(['sleep', '60']).pid, file=open(sys.argv[1], 'w')); "
run_in_group([sys.executable, "-c", inner + "time.sleep(60)", sys.argv[1]], 60)  # own group, as pytest is
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_a_timed_out_command_is_killed_with_everything_it_started(tmp_path):
    from stagewise.devtools.process_group import run_in_group

    inner_pid = tmp_path / "inner.pid"
    t0 = time.perf_counter()
    out, code = run_in_group([sys.executable, "-c", NESTED, str(inner_pid)], timeout=4)
    assert code == "timeout" and "process group was killed" in out and time.perf_counter() - t0 < 20
    pids = [int(ln) for ln in out.splitlines() if ln.strip().isdigit()] + [int(inner_pid.read_text())]
    assert len(pids) == 2, out  # the section's own worker and the one in the group it started
    deadline = time.time() + 5
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def test_autotune_picks_reads_a_real_autotuner():
    """Triton's own Autotuner object, its cache filled as a GPU run fills it (`cache[key] = config`)."""
    import triton
    import triton.language as tl

    from stagewise.devtools.device_sections import autotune_picks

    @triton.jit
    def _copy_for_picks(x, n, BLOCK: tl.constexpr):
        pass

    configs = [triton.Config({"BLOCK": 32}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4)]
    tuner = triton.autotune(configs, key=["n"])(_copy_for_picks)
    tuner.cache[(4096, "torch.float32")] = configs[1]
    picks = [p for p in autotune_picks() if p["kernel"] == "_copy_for_picks"]
    assert picks == [{"kernel": "_copy_for_picks", "key_args": ["n"], "key": ["4096", "torch.float32"],
                      "config": str(configs[1]), "candidates": 2}]  # fmt: skip


def test_unknown_section_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, "--sections", "env,warp"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown sections ['warp']" in proc.stderr


SAMPLE_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def test_report_names_failures_even_when_the_run_is_cut_short(tmp_path):
    """The tests section's parser on real pytest -v output: whole, and cut before the summary (a timeout)."""
    from stagewise.devtools.device_sections import test_report

    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", "-rfE", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    whole = test_report(proc.stdout)
    assert whole["counts"] == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1}, proc.stdout
    assert sorted(f.split()[0] for f in whole["failures"]) == ["ERROR", "FAILED"]
    assert any("test_fails" in f and "assert 1 == 2" in f for f in whole["failures"])  # the summary's reason
    assert "1 failed, 1 passed, 1 skipped, 1 error" in whole["summary"]
    cut = proc.stdout[: proc.stdout.index("short test summary")]  # what a killed run leaves
    assert sorted(f.split("::")[-1] for f in test_report(cut)["failures"]) == ["test_errors", "test_fails"], cut


def test_report_reads_xdist_lines():
    """pytest-xdist -v (the device machine runs 8 workers) prints the worker and progress first."""
    from stagewise.devtools.device_sections import test_report

    stdout = "\n".join([
        "[gw1] [  3%] PASSED tests/engine/test_host_sync.py::test_counter_sees_every_kind_of_read[item]",
        "[gw0] [  6%] FAILED tests/engine/test_cuda_graphs.py::test_graph_path_gives_the_eager_tokens[triton]",
        "[gw2] [  9%] SKIPPED tests/kernels/test_precision.py::test_tf32 ",
        "[gw3] [ 12%] ERROR tests/models/test_triton_model.py::test_per_stage_override",
    ])  # fmt: skip
    report = test_report(stdout)
    assert report["counts"] == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1}
    assert report["failures"] == [
        "FAILED tests/engine/test_cuda_graphs.py::test_graph_path_gives_the_eager_tokens[triton]",
        "ERROR tests/models/test_triton_model.py::test_per_stage_override",
    ]
