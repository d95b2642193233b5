"""Keeping the torch tier's repacked weights on disk, so a second start reads them instead of
building them again.

The torch tier multiplies by a GGUF's 4- and 8-bit weights through PyTorch's int4 CPU kernel,
which reads its own layout (`quant/int4pack.py`). Building that layout from the file's codes is
the largest part of a small model's start (SmolLM2-135M: about 1 s on a quiet 2-core machine, many
more on a busy one), and its result depends only on the file, the torch version and the CPU. So,
like the GEMM-form calibration beside it (`gemm_forms_cache.py`), it is kept:

    <cache dir>/packed_forms/<key id>.pt     the forms, one per packed weight, in order
    <cache dir>/packed_forms/<key id>.json   the key they were built under, and the .pt's sha256

(<cache dir> as in `gemm_forms_cache.cache_dir`: $STAGEWISE_CACHE_DIR, else the XDG cache.)

The key: the weight file's identity (resolved path, size, modification time, inode), what was
repacked (each weight's kind, shape, group size and form, in order, and a hash of their scales),
the torch version and the CPU's int4 layout (the CPU model, its vector capability as torch sees
it, and the layout's block rows, measured). Forms are used only under exactly their key, and only
when the .pt's bytes hash to the recorded sha256 and every tensor has the shape and dtype its
weight's form must have; anything else (another key, a damaged or half-written file, a cache of
another version) is built again and rewritten, with one line that says so. A cache that cannot be
written costs a notice, never the run.
"""

import hashlib
import io
import json
import os
import platform
from pathlib import Path

import torch

from stagewise.errors import StagewiseError
from stagewise.files import atomic_path, write_text_atomic
from stagewise.tuning.gemm_forms_cache import cache_dir, cpu_model, notice

FOLDER = "packed_forms"
CACHE_VERSION = 1  # bump when a form's layout or the files' meaning changes

Layout = list[tuple[tuple[int, ...], torch.dtype]]  # the tensors of one form: (shape, dtype) each


def file_identity(source: str) -> dict | None:
    """The weight file's identity, or None when `source` is not a regular file (no cache then)."""
    try:
        path = Path(source).resolve()
        st = path.stat()
    except (OSError, ValueError, RuntimeError):
        return None
    if not path.is_file():
        return None
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def cpu_layout(block_rows: int) -> dict:
    """What the int4 kernel's layout depends on: the CPU, its vector width, the measured block."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "capability": capability,
        "block_rows": block_rows,
    }


def scales_hash(weights: list) -> str:
    """sha256 of every weight's scales (and minimums): a cheap fingerprint of the values."""
    digest = hashlib.sha256()
    for w in weights:
        for t in (w.scales, w.mins):
            if t is not None:
                digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def make_key(identity: dict, weights: list, forms: list[str], block_rows: int) -> dict:
    """Everything the repacked forms depend on, as plain JSON values."""
    return {
        "version": CACHE_VERSION,
        "file": identity,
        "weights": [[w.kind, list(w.shape), w.group_size, form] for w, form in zip(weights, forms)],
        "scales_sha256": scales_hash(weights),
        "torch": torch.__version__,
        "cpu_layout": cpu_layout(block_rows),
    }


def _paths(key: dict) -> tuple[Path, Path]:
    key_id = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache_dir() / FOLDER
    return folder / f"{key_id}.pt", folder / f"{key_id}.json"


def _flat(forms: list) -> list[torch.Tensor]:
    return [t for form in forms for t in (form if isinstance(form, tuple) else (form,))]


def _matches(forms, layouts: list[Layout]) -> bool:
    if not isinstance(forms, list) or len(forms) != len(layouts):
        return False
    for form, layout in zip(forms, layouts):
        tensors = form if isinstance(form, tuple) else (form,)
        if len(tensors) != len(layout) or not all(isinstance(t, torch.Tensor) for t in tensors):
            return False
        if any(
            tuple(t.shape) != shape or t.dtype != dtype
            for t, (shape, dtype) in zip(tensors, layout)
        ):
            return False
    return True


def exists(key: dict) -> bool:
    """Whether anything is kept under `key` (usable or not: `load` decides)."""
    return any(path.exists() for path in _paths(key))


def load(key: dict, layouts: list[Layout]) -> list | None:
    """The forms kept under `key`, each shaped as `layouts` says; None when none can be trusted
    (said in one line when a file was there but unusable)."""
    data_path, key_path = _paths(key)
    if not data_path.exists() and not key_path.exists():
        return None
    try:
        meta = json.loads(key_path.read_text(encoding="utf-8"))
        data = data_path.read_bytes()
        if not isinstance(meta, dict) or meta.get("key") != key:
            raise ValueError("it was built under another key")
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError("its bytes do not match their checksum")
        forms = torch.load(io.BytesIO(data), weights_only=True)
        forms = (
            [tuple(f) if isinstance(f, list) else f for f in forms]
            if isinstance(forms, list)
            else forms
        )
        if not _matches(forms, layouts):
            raise ValueError("its tensors are not the forms these weights need")
    except Exception as exc:  # noqa: BLE001 (any damage, whatever torch.load raises: built again)
        why = exc if isinstance(exc, ValueError) else type(exc).__name__
        name = data_path.name
        notice(f"repacked-weights cache {name} is unusable ({why}); repacking and rewriting it")
        return None
    return forms


def store(key: dict, forms: list) -> Path | None:
    """Write the forms and their key (the .pt first, then the .json that vouches for it)."""
    data_path, key_path = _paths(key)
    buffer = io.BytesIO()
    torch.save([list(f) if isinstance(f, tuple) else f for f in forms], buffer)
    data = buffer.getvalue()
    meta = {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    try:
        data_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(data_path) as tmp:
            tmp.write_bytes(data)
        write_text_atomic(key_path, json.dumps(meta, indent=1) + "\n")
    except (OSError, StagewiseError) as exc:  # a folder that is not writable, a full disk
        notice(
            f"cannot write the repacked-weights cache {data_path} ({exc}); repacked again next time"
        )
        return None
    return data_path


def total_bytes(forms: list) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(forms))


def enabled() -> bool:
    """STAGEWISE_PACKED_CACHE=0 turns the cache off (a measurement of the repacking itself)."""
    return os.environ.get("STAGEWISE_PACKED_CACHE", "1") != "0"
