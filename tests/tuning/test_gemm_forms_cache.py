"""The CPU GEMM calibration is kept per machine and shape (`tuning/gemm_forms_cache.py`).

The weights here are small out-major matrices: what is tested is when the forms are measured and
what the cache file holds, not which form wins.
"""

import json

import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.models import prepare
from stagewise.tuning import cpu_load, gemm_forms, gemm_forms_cache


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A fresh CPU_FORMS, the cache in tmp_path, and the list of (M, weights) each measurement got."""
    monkeypatch.setenv(gemm_forms_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", gemm_forms.CpuForms())
    # the suite's workers share the cores: every measurement counts as quiet (conftest; the busy case: test_cpu_load)
    monkeypatch.setenv(cpu_load.BUSY_SHARE_ENV, "1")
    calls = []
    real = gemm_forms.time_forms

    def time_forms(weights, m, passes=3, padded=True):
        if padded:  # one count per bucket (each is timed padded and as it is)
            calls.append(m)
        return real(weights, m, passes=1, padded=padded)

    monkeypatch.setattr(gemm_forms, "time_forms", time_forms)
    return calls


def weights(n: int = 256, k: int = 128) -> list[torch.Tensor]:
    return [torch.randn(n, k).t(), torch.randn(2 * n, k).t()]  # out-major [K, N] views


def fresh_process(monkeypatch) -> None:
    """What a new process starts with: nothing chosen yet."""
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", gemm_forms.CpuForms())


def test_a_second_load_reads_the_cache_instead_of_measuring(counted, monkeypatch):
    first = gemm_forms.calibrate_cached(weights())
    assert counted == list(gemm_forms.BUCKET_M.values()) and not first.cached_in
    chosen, measured = dict(first.chosen), first.measured_ms
    fresh_process(monkeypatch)
    second = gemm_forms.calibrate_cached(weights())
    assert len(counted) == len(gemm_forms.BUCKET_M), "the second load measured again"
    assert second.chosen == chosen and second.measured_ms == measured  # JSON keeps floats exactly
    assert second.cached_in == str(gemm_forms_cache.cache_path())
    assert "read from" in second.describe()
    gemm_forms.calibrate_cached(weights(), recalibrate=True)  # --recalibrate: measured again
    assert len(counted) == 2 * len(gemm_forms.BUCKET_M) and not gemm_forms.CPU_FORMS.cached_in


def test_other_shapes_or_threads_are_measured_again(counted, monkeypatch):
    gemm_forms.calibrate_cached(weights())
    fresh_process(monkeypatch)
    gemm_forms.calibrate_cached(weights(n=320))  # other shapes: another model
    assert len(counted) == 2 * len(gemm_forms.BUCKET_M)
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    try:
        torch.set_num_threads(other)
        fresh_process(monkeypatch)
        gemm_forms.calibrate_cached(weights())
    finally:
        torch.set_num_threads(threads)
    assert len(counted) == 3 * len(gemm_forms.BUCKET_M), "another thread count was trusted"
    entries = json.loads(gemm_forms_cache.cache_path().read_text())["entries"]
    padded = [e["key"]["threads"] for e in entries.values() if e["key"]["padded"]]  # each beside its unpadded twin
    assert sorted(padded) == sorted([threads, threads, other]) and len(entries) == 2 * len(padded)


@pytest.mark.parametrize(
    "damage",
    [
        "{not json",
        '{"version": 1, "entries": []}',
        "\xff\xfe",
    ],
)
def test_an_unusable_cache_file_is_rebuilt_with_one_line(counted, capsys, damage):
    path = gemm_forms_cache.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(damage.encode("latin-1"))
    gemm_forms.calibrate_cached(weights())
    assert len(counted) == len(gemm_forms.BUCKET_M)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "measuring again" in lines[0] and str(path) in lines[0]
    doc = json.loads(path.read_text())
    assert doc["version"] == gemm_forms_cache.CACHE_VERSION and len(doc["entries"]) == 2  # padded and as they are


def test_a_damaged_entry_is_measured_over(counted, monkeypatch, capsys):
    gemm_forms.calibrate_cached(weights())
    path = gemm_forms_cache.cache_path()
    doc = json.loads(path.read_text())
    (entry,) = [e for e in doc["entries"].values() if e["key"]["padded"]]
    entry["chosen"]["decode"] = "fastest"  # no such form
    path.write_text(json.dumps(doc))
    fresh_process(monkeypatch)
    gemm_forms.calibrate_cached(weights())
    assert len(counted) == 2 * len(gemm_forms.BUCKET_M)
    assert "damaged entry" in capsys.readouterr().err
    entries = json.loads(path.read_text())["entries"].values()
    assert len(entries) == 2 and all(e["chosen"]["decode"] in gemm_forms.FORMS for e in entries)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(gemm_forms_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gemm_forms_cache.cache_dir() == tmp_path / "xdg" / "stagewise"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gemm_forms_cache.cache_dir() == tmp_path / "home" / ".cache" / "stagewise"


def test_llm_calibrates_through_the_cache(counted, monkeypatch, tiny):
    from stagewise.engine.llm import LLM

    monkeypatch.setattr(prepare, "CALIBRATE_BYTES", 0)  # make `tiny` count as big
    LLM(tiny)
    assert len(counted) == len(gemm_forms.BUCKET_M)
    fresh_process(monkeypatch)
    LLM(tiny)
    assert len(counted) == len(gemm_forms.BUCKET_M) and gemm_forms.CPU_FORMS.cached_in
    LLM(tiny, recalibrate=True)
    assert len(counted) == 2 * len(gemm_forms.BUCKET_M)
    with pytest.raises(StagewiseError, match="recalibrate must be True or False"):
        LLM(tiny, recalibrate="yes")
