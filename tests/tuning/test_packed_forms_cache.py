"""The torch tier's repacked weights, kept on disk: a second load reads exactly the forms the first
built, under exactly their key; another file (or the same file changed), a damaged or foreign entry,
or a cache folder that cannot be written: built again, with one line, never a crash."""

import json
import os

import gguf
import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.cpu import int8_dot
from stagewise.models import prepare
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.quant.packed_parts import packed_leaves
from stagewise.stages import dequant_gemm_torch
from stagewise.tuning import packed_forms_cache
from tests.checkpoints import hf_tiny_model, write_gguf

TIERS = StageOps("torch").backends


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "tiny-q4_1.gguf"
    return write_gguf(path, hf_tiny_model(seed=5), projection_type=gguf.GGMLQuantizationType.Q4_1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("STAGEWISE_CACHE_DIR", str(folder))
    return folder / packed_forms_cache.FOLDER


@pytest.fixture
def builds(monkeypatch):
    """How many forms were built (not read): the real `prepare`, counted."""
    calls = []
    real = dequant_gemm_torch.prepare

    def counted(w):
        calls.append(w)
        return real(w)

    monkeypatch.setattr(dequant_gemm_torch, "prepare", counted)
    return calls


def forms_of(path) -> list:
    loaded = load_model(str(path), device="cpu", quantization="auto")
    prepare.build_packed_forms(loaded.weights, TIERS, loaded.source)
    leaves = prepare.torch_tier_leaves(loaded.weights, {})  # none: every form is built
    assert leaves == []
    forms = []
    for lw in loaded.weights.layers:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            forms += [w.prepared["torch"] for w in packed_leaves(getattr(lw, name))]
    forms += [w.prepared["torch"] for w in packed_leaves(loaded.weights.lm_head)]
    return forms


def same(a: list, b: list) -> bool:
    flat = lambda forms: [t for f in forms for t in (f if isinstance(f, tuple) else (f,))]  # noqa: E731
    pairs = list(zip(flat(a), flat(b)))  # equal values, and the same layout in memory (the kernel's)
    return len(a) == len(b) and all(torch.equal(x, y) and x.stride() == y.stride() for x, y in pairs)


def test_a_second_load_reads_the_forms_the_first_built(tiny_q4, cache, builds):
    first = forms_of(tiny_q4)
    built = len(builds)
    assert built > 0 and len(list(cache.glob("*.pt"))) == 1 and len(list(cache.glob("*.json"))) == 1
    second = forms_of(tiny_q4)
    assert len(builds) == built, "the second load built forms instead of reading them"
    assert same(first, second)
    for w in builds:  # each built form has the layout the cache checks a read one against
        form = w.prepared["torch"]
        tensors = form if isinstance(form, tuple) else (form,)
        assert [(tuple(t.shape), t.dtype) for t in tensors] == dequant_gemm_torch.form_layout(w)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = LLM(str(tiny_q4)).generate(["the cat sat on"], params)[0].token_ids
    os.environ["STAGEWISE_PACKED_CACHE"] = "0"
    try:
        fresh = LLM(str(tiny_q4)).generate(["the cat sat on"], params)[0].token_ids
    finally:
        del os.environ["STAGEWISE_PACKED_CACHE"]
    assert cached == fresh


def test_never_trusted_across_keys(tiny_q4, cache, builds, capsys):
    forms_of(tiny_q4)
    built = len(builds)
    # an entry under this key's name that records another key (copied from another machine's torch)
    entry = next(cache.glob("*.json"))
    meta = json.loads(entry.read_text())
    meta["key"]["torch"] = "0.0.0"
    entry.write_text(json.dumps(meta))
    forms_of(tiny_q4)
    assert "(it was built under another key); repacking and rewriting it" in capsys.readouterr().err
    assert len(builds) == 2 * built
    # the file changed (a new modification time): another key, built again, kept beside the first
    stat = tiny_q4.stat()
    os.utime(tiny_q4, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    forms_of(tiny_q4)
    assert len(builds) == 3 * built and len(list(cache.glob("*.pt"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "foreign tensors"])
def test_a_damaged_cache_is_rebuilt_not_a_crash(tiny_q4, cache, builds, capsys, damage):
    first = forms_of(tiny_q4)
    built = len(builds)
    data = next(cache.glob("*.pt"))
    meta_path = data.with_suffix(".json")
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        why = "its bytes do not match their checksum"
    else:  # a well-formed file, checksum and all, holding tensors of the wrong shapes
        meta = json.loads(meta_path.read_text())
        packed_forms_cache.store(meta["key"], [torch.zeros(3, dtype=torch.uint8)] * len(first))
        why = "its tensors are not the forms these weights need"
    again = forms_of(tiny_q4)
    err = capsys.readouterr().err
    assert f"repacked-weights cache {data.name} is unusable ({why}); repacking and rewriting it" in err
    assert len(builds) == 2 * built and same(first, again)
    forms_of(tiny_q4)  # rewritten: read back now
    assert len(builds) == 2 * built


def test_a_cache_that_cannot_be_written_costs_a_line(tiny_q4, tmp_path, monkeypatch, builds, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("STAGEWISE_CACHE_DIR", str(blocker))
    forms_of(tiny_q4)
    assert builds and "cannot write the repacked-weights cache" in capsys.readouterr().err


def test_the_load_lines_name_the_tier_that_runs(tiny_q4, cache):
    """No repacking line when no stage runs the torch tier; 'building the engine' names the backend; a
    second torch start reads the cache (its own line) instead of repacking."""
    from stagewise.runtime import listen_to_load_phases

    def phases(**kwargs) -> list[str]:
        seen: list[str] = []
        with listen_to_load_phases(lambda text, seconds: seen.append(text) if seconds is None else None):
            LLM(str(tiny_q4), **kwargs)
        return seen

    triton = phases(backend="triton")
    assert "building the engine (backend triton)" in triton and not any("repack" in t for t in triton), triton
    first, second = phases(), phases()
    layout = "rows8" if int8_dot.available() else "int4pack"  # the compiled kernel's form, or PyTorch's
    repack = [t for t in first if t.startswith("repacking the quantized weights for the torch tier (")]
    assert len(repack) == 1 and layout in repack[0] and repack[0].endswith(" layout)"), first
    assert "building the engine (backend torch)" in first
    assert "reading the torch tier's repacked weights from the cache" in second
    assert not any(t.startswith("repacking") for t in second), second
