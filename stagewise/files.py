"""Output files that are either complete or untouched: checked before the work, renamed into place after.

Every file a command writes (a trace, a benchmark's JSON and PNG, calc's plots)
goes through `atomic_path`: the content is written to a hidden temporary file
in the same folder, then renamed over the target in one step (`os.replace` is
atomic within a file system). An interrupted or failed write leaves the old
file as it was and removes the temporary file. `atomic_paths` does the same for
files that belong together (a benchmark's JSON and its PNG): all are written
first, then all are renamed, so a failure leaves the old set.

What the output path names decides how it is written, as careful Unix tools do:

    a regular file, or nothing yet   temporary file + rename; the old file's mode (and owner, where
                                     permitted) is kept, so a private 0600 file stays private
    a symbolic link                  followed: the file it points to is replaced, the link stays
    a FIFO or a character device     written straight into (`/dev/null`, `/dev/stdout`, a named pipe):
    (or an open descriptor,          there is nothing to rename, and replacing them would destroy them
    /dev/stdout, /dev/fd/N)
    anything else                    refused by name (a block device, a socket, a folder)

`check_writable` runs before any slow work, so a run does not compute for
minutes and then fail on a missing folder.
"""

import os
import signal
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stagewise.errors import StagewiseError

MAX_LINKS = 40  # as the kernel's own limit on a chain of symbolic links (ELOOP)


def can_create_files_in(folder: Path) -> bool:
    """Really try: permissions bits say little to root, or on read-only and special file systems."""
    import tempfile  # here: the command line's entry imports this module before its signal guard is up

    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _names_a_descriptor(path: Path) -> bool:
    """/dev/stdout, /dev/fd/1, /proc/self/fd/1 and the links that lead there: an already open file."""
    hops = [path]
    while hops[-1].is_symlink() and len(hops) <= MAX_LINKS:
        link = Path(os.readlink(hops[-1]))
        hops.append(link if link.is_absolute() else hops[-1].parent / link)
    return any(str(p).startswith(("/dev/fd/", "/proc/")) and "/fd/" in str(p) for p in hops)


def resolve_output(path: str | Path, what: str = "--out") -> tuple[Path, bool]:
    """(the path to write, written straight into?) for an output path, or a StagewiseError naming it.

    Straight into: FIFOs, character devices and open descriptors. Otherwise the returned path is the
    regular file to replace (a symlink's target), which may not exist yet.
    """
    path = Path(path)
    try:
        info = os.stat(path)  # follows links, /proc's descriptor links too
    except FileNotFoundError:
        info = None  # a new file (or a link to one that does not exist yet: it is created)
    except OSError as exc:  # a loop of links, a component that is not a folder, ...
        raise StagewiseError(f"{what} {path}: {exc.strerror}") from None
    if info is not None and (stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode)):
        if not os.access(path, os.W_OK):
            raise StagewiseError(f"{what} {path} exists and is not writable")
        return path, True
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise StagewiseError(f"{what} {path} is a folder; give a file name")
    if info is not None and not stat.S_ISREG(info.st_mode):
        kind = "a block device" if stat.S_ISBLK(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else None
        raise StagewiseError(
            f"{what} {path} is {kind or 'a special file'}; "
            "give a regular file, a FIFO or a character device such as /dev/null"
        )
    if info is not None and _names_a_descriptor(path):
        return path, True  # `--out /dev/stdout > file`: write where the shell opened it, do not rename its file
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    return target, False


def check_writable(path: str | Path, what: str = "--out") -> Path:
    """A file path whose folder exists and is writable (or a FIFO / device to write into); returns `path`."""
    path = Path(path)
    target, direct = resolve_output(path, what)
    if direct:
        return path
    shown = path if target == path else f"{path} (a link to {target})"
    folder = target.parent
    if not folder.is_dir():
        raise StagewiseError(f"{what} {shown}: folder {folder} does not exist")
    if not can_create_files_in(folder):
        raise StagewiseError(f"{what} {shown}: folder {folder} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise StagewiseError(f"{what} {shown} exists and is not writable")
    return path


def check_writable_folder(folder: str | Path, what: str = "--out") -> Path:
    """A folder that exists and is writable, or could be created (its nearest existing parent is writable).

    Nothing is created here: a run that fails its other checks leaves no empty folder behind.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise StagewiseError(f"{what} {folder} is a file; give a folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent if existing.parent != existing else Path(".")
        if existing.exists() and not existing.is_dir():
            raise StagewiseError(f"{what} {folder}: cannot create the folder ({existing} is a file)")
    if not can_create_files_in(existing):
        where = "is" if existing == folder else f"cannot be created: {existing} is"
        raise StagewiseError(f"{what} {folder} {where} not writable")
    return folder


def temp_path_for(path: Path) -> Path:
    """`.name.tmp-PID.ext` in the same folder; the extension is kept (matplotlib picks the format by it)."""
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


def _create_temp(tmp: Path, old: os.stat_result | None) -> None:
    """Create the empty temporary file with the old file's owner and mode before any content is in it.

    The writer then opens it again ('w' truncates and keeps both), so a private file's content is never
    readable by others, not even while it is being written. A new file gets the default mode (0666 less
    the umask), as `open` would give it.
    """
    tmp.unlink(missing_ok=True)  # left by an earlier process that had this PID and was killed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if old is not None else 0o666)
    try:
        if old is not None:
            try:
                os.fchown(fd, old.st_uid, old.st_gid)  # permitted to root, or to a group of one's own
            except OSError:
                pass  # not permitted: the file becomes ours, as any editor's saved copy does
            os.fchmod(fd, stat.S_IMODE(old.st_mode))  # after chown, which may clear set-id bits
    finally:
        os.close(fd)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while the block runs; the first one that arrived takes effect right after.

    For steps that must not be cut in the middle: the renames of a set of output files (microseconds), and
    the command line's first imports (a signal handler that raises inside torch's C++ start-up aborts the
    process, and one that lands in numpy's import from there is swallowed).
    Python runs signal handlers in the main thread, between bytecodes: there, the handlers are swapped for
    ones that only take note. Other threads cannot change handlers; their block runs without the guard.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {sig: signal.signal(sig, lambda s, f: caught.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for sig in caught[:1]:
            signal.raise_signal(sig)  # the original handler acts now (KeyboardInterrupt, ...)


@contextmanager
def atomic_paths(*paths: str | Path) -> Iterator[list[Path]]:
    """Yield one path to write per output; on success all replace their targets together, on failure none.

    Each output is resolved first (see the module docstring): a FIFO or device is yielded itself and
    written straight into; a regular file (or a link's target) gets a temporary file beside it.
    """
    plans = []  # (path to write, target to rename onto, or None when written straight into)
    for path in paths:
        target, direct = resolve_output(check_writable(path, "output"), "output")
        plans.append((target, None) if direct else (temp_path_for(target), target))
    try:
        for tmp, target in plans:
            if target is not None:
                _create_temp(tmp, target.stat() if target.exists() else None)
        yield [tmp for tmp, _ in plans]
        with signals_deferred():
            for tmp, target in plans:
                if target is not None:
                    os.replace(tmp, target)
    except BaseException:
        for tmp, target in plans:
            if target is not None:
                tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a path to write; on success it replaces `path`, on any exception it is removed."""
    with atomic_paths(path) as (tmp,):
        yield tmp


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
