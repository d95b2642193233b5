"""Compiling the C++ kernels of this folder once per machine, and loading them.

    sources  stagewise/cpu/int8_dot.cpp, attention.cpp, rows.cpp (installed with the package)
    library  <cache dir>/cpu_kernels/int8_dot-<variant>-<key>.so
             (<cache dir>: $STAGEWISE_CACHE_DIR, else $XDG_CACHE_HOME/stagewise, else
             ~/.cache/stagewise; `tuning/gemm_forms_cache.py`)

The first process that needs the kernel compiles it with the system's C++ compiler ($CXX, else
c++, g++ or clang++) — a couple of seconds — and every later one loads the library. The key is
a hash of everything the machine code depends on: the source, the flags, the compiler's version,
the CPU (the "native" variant is built for the CPU in front of you: AVX-512 VNNI, AVX-VNNI, AVX2
or plain C, whichever it has). Concurrent first uses (the test suite's workers) take a file lock,
so one compiles and the others load its result.

Flags: -O3, -ffp-contract=off (no multiply-add is ever fused: the float part of every kernel is
the same IEEE operations whatever the compiler sees, `int8_dot.py`), -fopenmp (the threads of the
OpenMP runtime PyTorch has already loaded: the library asks for `libgomp.so.1`, which the dynamic
linker resolves to torch's copy, so both share one pool of threads).

The kernels are opt-in (STAGEWISE_CPU_KERNELS=1). Rounding every activation block to int8 costs
little on average (`stagewise bench perplexity` on SmolLM2's Q4_1 file: +0.06 % over float32, where
PyTorch's int4 kernel with bfloat16 activations gives +0.21 %) but moves near-ties: its greedy
tokens agreed with float32's on 39 % of them where the int4 kernel's agreed on 73 %, and SmolLM2
answers "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." instead of "Paris"
— as llama.cpp does on the same file, whose arithmetic this is. Off by default, or without a
compiler, or on a failed build, `library()` returns None (the last two say so in one line on
stderr) and the torch tier keeps PyTorch's own kernels.
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one the library links to)

from stagewise.tuning.gemm_forms_cache import cache_dir, cpu_model

try:
    import fcntl  # POSIX: the build lock
except ImportError:  # Windows: no lock, no build (PyTorch's kernels run)
    fcntl = None

SOURCE = Path(__file__).with_name("int8_dot.cpp")  # the packed-weight GEMM (the name messages use)
# every source of the one library: the GEMM, the paged attention, the row ops (RMSNorm, RoPE)
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("int8_dot.cpp", "attention.cpp", "rows.cpp")
)
FOLDER = "cpu_kernels"
# "1": build and use them (opt-in); anything else: PyTorch's kernels
ENV_SWITCH = "STAGEWISE_CPU_KERNELS"
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
# variant -> the instruction-set flags; "native" is what a run uses, the others exist so the
# tests can prove that every path gives the same bits (an older CPU's build, plain C)
VARIANTS = {"native": ["-march=native"], "avx2": ["-march=haswell"], "plain": ["-march=x86-64"]}

_said: set[str] = set()


def say_once(line: str) -> None:
    if line not in _said and not os.environ.get("STAGEWISE_QUIET"):
        print(f"stagewise: {line}", file=sys.stderr)
    _said.add(line)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "0") == "1"


@contextlib.contextmanager
def switched(on: bool | None):
    """The kernels on (True) or off (False) inside the block, as ENV_SWITCH would set them, then
    as before; None leaves the environment's choice. (Benchmarks compare both in one process.)"""
    if on is None:
        yield
        return
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or None
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def library_path(cxx: str, variant: str) -> Path:
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    for part in (*BASE_FLAGS, *VARIANTS[variant], _version(cxx), platform.machine(), cpu_model()):
        digest.update(part.encode() + b"\0")
    return cache_dir() / FOLDER / f"{SOURCE.stem}-{variant}-{digest.hexdigest()[:16]}.so"


def _compile(cxx: str, variant: str, target: Path) -> str | None:
    """Build into `target` (a temporary file renamed into place); None, or why it failed."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    arch = VARIANTS[variant] if x86 or variant == "native" else []
    attempts = [arch + ["-fopenmp"], arch, ["-fopenmp"], []]  # without OpenMP: one thread
    target.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    for extra in attempts:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cxx, *BASE_FLAGS, *extra, *map(str, SOURCES), "-o", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            done, last = None, str(exc)
        if done is not None and done.returncode == 0:
            os.replace(tmp, target)
            return None
        Path(tmp).unlink(missing_ok=True)
        if done is not None:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if variant != "native":
            break  # a test variant is built with its own flags or not at all
    return last


def library(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None when they cannot be had here."""
    if not enabled():
        return None  # the default: PyTorch's int4 CPU kernel
    return _library(variant)


def loaded(variant: str = "native") -> ctypes.CDLL | None:
    """The library whether or not the switch is on now: a weight whose form was built for the
    integer-dot kernel (while it was on) keeps being multiplied by it."""
    return _library(variant)


@functools.cache
def _library(variant: str) -> ctypes.CDLL | None:
    cxx = compiler()
    if fcntl is None:
        say_once(f"{SOURCE.name} is built on Linux and macOS only: using PyTorch's int4 CPU kernel")
        return None
    if cxx is None:
        say_once(
            "no C++ compiler found (set CXX, or install g++): packed weights use PyTorch's int4 "
            f"CPU kernel instead of {SOURCE.name}"
        )
        return None
    path = library_path(cxx, variant)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles, the others wait and load
            if not path.exists():
                why = _compile(cxx, variant, path)
                if why is not None:
                    say_once(
                        f"could not build {SOURCE.name} ({why}): packed weights use PyTorch's "
                        "int4 CPU kernel"
                    )
                    return None
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        say_once(f"could not build or load {SOURCE.name} ({exc}): using PyTorch's int4 kernel")
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sw_int8_dot_isa.restype = ctypes.c_char_p
    lib.sw_int8_dot_isa.argtypes = []
    lib.sw_int8_gemm.restype = ctypes.c_int
    lib.sw_int8_gemm.argtypes = [ctypes.c_int, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.sw_rows8_chunk_bytes.restype = ctypes.c_int
    lib.sw_rows8_chunk_bytes.argtypes = [ctypes.c_int]
    lib.sw_attention_isa.restype = ctypes.c_char_p
    lib.sw_attention_isa.argtypes = []
    i32, f32 = ctypes.c_int, ctypes.c_float
    lib.sw_paged_attention.restype = ctypes.c_int
    lib.sw_paged_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, ptr]
    lib.sw_paged_attention.argtypes += [i32, i32, i32, i32, i32, i32, f32, ptr, i32]
    lib.sw_rmsnorm.restype = None
    lib.sw_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.sw_rope.restype = ctypes.c_int
    lib.sw_rope.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i32]
    lib.sw_stream_read.restype = ctypes.c_uint64
    lib.sw_stream_read.argtypes = [ptr, i64, ctypes.c_int]


def describe(variant: str = "native") -> str:
    """One line: where the source is, where the library is kept, which instructions it uses."""
    if not enabled():
        return f"{SOURCE.name}: off ({ENV_SWITCH}=1 turns it on; PyTorch's int4 CPU kernel runs)"
    lib = library(variant)
    if lib is None:
        return f"{SOURCE.name}: not built (PyTorch's int4 CPU kernel runs instead)"
    isa = lib.sw_int8_dot_isa().decode()
    return f"{SOURCE} built for {isa}, kept in {library_path(compiler(), variant).parent}"
