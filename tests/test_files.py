"""Output files (stagewise.files): complete or untouched, through links, into FIFOs and devices, modes kept.

Real files in tmp_path: a real symlink, a real FIFO read by a thread, a real Unix socket, a real character
device (a node like /dev/null's, or /dev/null itself where no node can be made).
"""

import os
import socket
import stat
import subprocess
import sys
import threading

import pytest

from stagewise.errors import StagewiseError
from stagewise.files import atomic_path, atomic_paths, check_writable, write_text_atomic

OLD = "the old result, which must survive\n"


def leftovers(folder) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp-" in p.name]


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text(OLD)
    link = tmp_path / "link.txt"
    link.symlink_to("real.txt")
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == "real.txt"
    assert target.read_text() == "new\n" and leftovers(tmp_path) == []


def test_a_dangling_symlink_creates_its_target(tmp_path):
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "sub" / "new.txt")
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and (tmp_path / "sub" / "new.txt").read_text() == "new\n"
    assert leftovers(tmp_path) == []


def test_a_link_to_a_missing_folder_names_the_folder(tmp_path):
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "nowhere" / "x.txt")
    with pytest.raises(StagewiseError, match="a link to .*nowhere.*does not exist"):
        check_writable(link)


def test_a_fifo_is_written_into_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    write_text_atomic(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert received == ["through the pipe\n"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and leftovers(tmp_path) == []


@pytest.fixture
def null_device(tmp_path):
    """A character device to write into: a node like /dev/null's in tmp_path where creating one is permitted
    (root: a broken implementation then replaces that node, never the system's), else /dev/null itself
    (not root: /dev is not writable, so it cannot be replaced)."""
    try:
        node = tmp_path / "null"
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        return node
    except (PermissionError, OSError):
        if os.access("/dev", os.W_OK):
            pytest.skip("cannot create a device node here, and /dev/null itself could be replaced")
        return "/dev/null"


def test_a_character_device_is_written_into_never_replaced(null_device):
    before = os.stat(null_device)
    assert stat.S_ISCHR(before.st_mode)
    assert check_writable(null_device) == check_writable(null_device)  # its folder need not be writable
    write_text_atomic(null_device, "discarded\n")
    after = os.stat(null_device)
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_rdev, after.st_mode) == (before.st_ino, before.st_rdev, before.st_mode)


def test_stdout_redirected_to_a_file_is_written_where_the_shell_opened_it(tmp_path):
    """`--out /dev/stdout > file`: through the descriptor, not a rename of the shell's file. The link is our
    own copy of /dev/stdout's (-> /proc/self/fd/1): a broken implementation replaces that, not the system's."""
    out = tmp_path / "shell.txt"
    out.write_text("")
    inode = out.stat().st_ino
    stdout_link = tmp_path / "stdout"
    stdout_link.symlink_to("/proc/self/fd/1")
    code = f"from stagewise.files import write_text_atomic; write_text_atomic({str(stdout_link)!r}, 'hi\\n')"
    with out.open("w") as stdout:
        subprocess.run([sys.executable, "-c", code], stdout=stdout, check=True, timeout=60)
    assert out.read_text() == "hi\n" and out.stat().st_ino == inode
    assert stdout_link.is_symlink() and leftovers(tmp_path) == []


def test_other_special_files_are_refused_by_name(tmp_path):
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(StagewiseError, match="is a socket; give a regular file, a FIFO or a character device"):
            check_writable(path)
    with pytest.raises(StagewiseError, match="is a folder"):
        check_writable(tmp_path)


def test_the_old_files_mode_is_kept_and_never_widened_while_writing(tmp_path):
    target = tmp_path / "trace.txt"
    target.write_text("the prompt, private\n")
    target.chmod(0o600)
    with atomic_path(target) as tmp:
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o600  # the temporary file is private before it holds anything
        tmp.write_text("a new private prompt\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "a new private prompt\n"
    target.chmod(0o640)
    write_text_atomic(target, "again\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_new_file_gets_the_default_mode(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    write_text_atomic(tmp_path / "new.txt", "x")
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o666 & ~umask


def test_files_that_belong_together_land_together_or_not_at_all(tmp_path):
    pair = [tmp_path / "modes.json", tmp_path / "modes.png"]
    for path in pair:
        path.write_text(OLD)
    with pytest.raises(RuntimeError), atomic_paths(*pair) as (json_tmp, png_tmp):
        json_tmp.write_text("new json")
        raise RuntimeError("the plot failed")  # after the JSON is complete
    assert [p.read_text() for p in pair] == [OLD, OLD] and leftovers(tmp_path) == []
    with atomic_paths(*pair) as temps:
        for tmp in temps:
            tmp.write_text("new")
    assert [p.read_text() for p in pair] == ["new", "new"] and leftovers(tmp_path) == []
