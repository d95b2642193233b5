"""Output files that are either complete or untouched: checked before the work, renamed into place after.

Every file a command writes (a trace, a benchmark's JSON and PNG, calc's plots)
goes through `atomic_path`: the content is written to a hidden temporary file
in the same folder, then renamed over the target in one step (`os.replace` is
atomic within a file system). An interrupted or failed write leaves the old
file as it was and removes the temporary file.

`check_writable` runs before any slow work, so a run does not compute for
minutes and then fail on a missing folder.
"""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stagewise.errors import StagewiseError


def can_create_files_in(folder: Path) -> bool:
    """Really try: permissions bits say little to root, or on read-only and special file systems."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_writable(path: str | Path, what: str = "--out") -> Path:
    """A file path whose folder exists and is writable, and that is not a folder itself."""
    path = Path(path)
    if path.is_dir():
        raise StagewiseError(f"{what} {path} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise StagewiseError(f"{what} {path}: folder {folder} does not exist")
    if not can_create_files_in(folder):
        raise StagewiseError(f"{what} {path}: folder {folder} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise StagewiseError(f"{what} {path} exists and is not writable")
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


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on any exception it is removed."""
    path = check_writable(path, "output")
    tmp = temp_path_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
