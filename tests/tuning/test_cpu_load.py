"""A GEMM-form timing taken while other processes keep the cores busy is used, never remembered.

Real processes compete here: spinning Python interpreters, one per core, started around the probe.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from stagewise.tuning import cpu_load, gemm_forms, gemm_forms_cache

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the probe reads Linux's /proc/stat")

SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def spinners():
    """One busy process per core (killed by the caller)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 1)]
    time.sleep(0.3)  # let them start spinning
    return procs


def weights_timed_long_enough():
    """Out-major [K, N] views that keep a calibration busy for ~0.2 s on a quiet 2-core machine (longer
    under the spinners): past the probe's MIN_TICKS, so its share is measured, not unknown."""
    return [torch.randn(2048, 2048).t() for _ in range(6)]


def stop(procs) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_the_probe_sees_other_processes_and_not_its_own_work():
    with cpu_load.LoadProbe() as own:  # this process alone keeps one core busy
        end = time.process_time() + 0.4
        while time.process_time() < end:
            pass
    procs = spinners()
    try:
        with cpu_load.LoadProbe() as busy:
            time.sleep(0.6)  # idle here, while the spinners fill every core
    finally:
        stop(procs)
    # one spinner per core fills the machine: others' share is near 1; 0.6 leaves room for the scheduler
    # and for this process's own ticks (a share of CPU time, not a numerical tolerance on a kernel)
    assert busy.others is not None and busy.others > 0.6, busy.others
    assert busy.others > cpu_load.BUSY_SHARE
    # its own spinning is not "others": other suite workers may add up to ~half the machine on 2 cores, so the
    # margin is 0.3 below the spinners' share (counting its own ticks as others would close that gap)
    assert own.others is not None and own.others < busy.others - 0.3, (own.others, busy.others)


def test_a_busy_calibration_is_used_for_this_run_and_not_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(gemm_forms_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_load.BUSY_SHARE_ENV)  # the suite trusts its own busy timings (conftest): not here
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", gemm_forms.CpuForms())
    procs = spinners()
    try:
        forms = gemm_forms.calibrate_cached(weights_timed_long_enough(), passes=2)
    finally:
        stop(procs)
    assert forms.measured_ms and forms.others_share > cpu_load.BUSY_SHARE
    assert set(forms.chosen.values()) <= set(gemm_forms.FORMS)  # the run still gets an answer
    assert not gemm_forms_cache.cache_path().exists(), "a contended timing was remembered"
    err = capsys.readouterr().err
    assert "other processes used" in err and "measured again next time" in err
    assert len(err.strip().splitlines()) == 1


def test_a_run_that_shares_its_cores_on_purpose_may_keep_busy_timings(tmp_path, monkeypatch):
    monkeypatch.setenv(gemm_forms_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_load.BUSY_SHARE_ENV, "1")  # what the test suite sets for its parallel workers
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", gemm_forms.CpuForms())
    procs = spinners()
    try:
        forms = gemm_forms.calibrate_cached(weights_timed_long_enough(), passes=2)
    finally:
        stop(procs)
    assert forms.others_share is not None and forms.others_share > cpu_load.BUSY_SHARE, forms.others_share
    assert gemm_forms_cache.cache_path().exists()


def test_a_window_of_a_few_ticks_is_unknown_not_quiet():
    with cpu_load.LoadProbe() as probe:
        pass  # well under MIN_TICKS of the machine's time
    assert probe.others is None and not probe.contended
