"""Remembering which CPU GEMM form won (`gemm_torch.calibrate`), across processes.

Calibration streams the model's weights with every form, a few passes each, which would
cost every load seconds. Its answer depends only on the machine and the shapes, so it is
written to a small JSON file and read back next time:

    $STAGEWISE_CACHE_DIR/gemm_forms.json        (if set; the tests point it at a tmp folder)
    $XDG_CACHE_HOME/stagewise/gemm_forms.json   (else; the XDG convention on Linux)
    ~/.cache/stagewise/gemm_forms.json          (else)

An answer is reused only under exactly the key it was measured under: the CPU model,
the torch version (its BLAS), the number of torch threads, the dtype, and the [K, N]
shapes of every weight streamed (with the Ms measured at and the forms compared). Any
other key, e.g. a run with one thread instead of two, measures again and adds an entry.
A file that cannot be read as such a cache is measured over, with one line that says so.
"""

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import torch

from stagewise.errors import StagewiseError
from stagewise.files import write_text_atomic

CACHE_DIR_ENV = "STAGEWISE_CACHE_DIR"
CACHE_FILE = "gemm_forms.json"
# bump when the file's layout or the meaning of an entry changes (2: entries measured while other
# processes kept the cores busy are no longer written; version 1 files may hold such entries;
# 3: the forms are timed as the batch-invariant tier runs them, their rows padded)
CACHE_VERSION = 3


def cache_dir() -> Path:
    """The folder for stagewise's caches on this machine (see the module docstring)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "stagewise"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux), else whatever `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def calibration_key(
    weights: list[torch.Tensor], bucket_m: dict, forms: tuple, padded: bool = True
) -> dict:
    """Everything the measured answer depends on, as plain JSON values (`padded`: the forms as
    the batch-invariant tier runs them, rows padded; False: the rows as they are)."""
    return {
        "padded": padded,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(weights[0].dtype).removeprefix("torch.") if weights else None,
        "shapes": [list(w.shape) for w in weights],  # [K, N] of every weight, in order
        "bucket_m": dict(bucket_m),
        "forms": list(forms),
    }


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def notice(text: str) -> None:
    print(f"stagewise: {text}", file=sys.stderr)


def read_entries(path: Path, quiet: bool = False) -> dict | None:
    """The file's entries (key id -> entry), {} when there is no file, None when it is unusable
    (said in one line unless `quiet`)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = f"is unreadable ({type(exc).__name__})"
    else:
        entries = doc.get("entries") if isinstance(doc, dict) else None
        if (
            isinstance(doc, dict)
            and doc.get("version") == CACHE_VERSION
            and isinstance(entries, dict)
        ):
            return entries
        why = "is not a cache this version of stagewise writes"
    if not quiet:
        notice(f"GEMM calibration cache {path} {why}; measuring again and rewriting it")
    return None


def valid_entry(entry, key: dict) -> bool:
    """An entry measured under exactly `key`, with a known form chosen for every bucket."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    chosen, measured = entry.get("chosen"), entry.get("measured_ms")
    buckets, forms = set(key["bucket_m"]), set(key["forms"])
    return (
        isinstance(chosen, dict)
        and set(chosen) == buckets
        and set(chosen.values()) <= forms
        and isinstance(measured, dict)
        and set(measured) == buckets
        and all(isinstance(t, dict) for t in measured.values())
    )


def load(key: dict) -> tuple[dict, dict] | None:
    """(chosen, measured_ms) stored under `key`, or None (no file, no such entry, unusable file)."""
    path = cache_path()
    entries = read_entries(path)
    entry = (entries or {}).get(key_id(key))
    if entry is None:
        return None
    if not valid_entry(entry, key):
        notice(f"GEMM calibration cache {path} holds a damaged entry; measuring again")
        return None
    return entry["chosen"], entry["measured_ms"]


def store(key: dict, chosen: dict, measured_ms: dict) -> None:
    """Add (or replace) the entry for `key`; other keys' entries stay. A cache that cannot be
    written costs a notice, never the run."""
    path = cache_path()
    entries = dict(read_entries(path, quiet=True) or {})  # an unusable file is replaced
    entries[key_id(key)] = {"key": key, "chosen": chosen, "measured_ms": measured_ms}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            path, json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1) + "\n"
        )
    except (OSError, StagewiseError) as exc:  # a folder that is not writable, a full disk
        notice(f"cannot write the GEMM calibration cache {path} ({exc}); measured again next time")
