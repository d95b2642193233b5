"""Tensor parallelism against the operating system: who can reach the ranks, signals, dead processes, scripts.

Each case runs the real thing: the rendezvous is checked in the kernel's own
socket tables (/proc/net/tcp, /proc/net/tcp6) while a real worker process is
joined; Ctrl-C is a real SIGINT to a real process group; rank 0 is killed
with a real SIGKILL; the unguarded script is a real file run by Python.
"""

import fcntl
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams
from stagewise.parallel.launch import MAIN_GUARD_HINT

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc socket tables")

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "STAGEWISE_QUIET": "1", "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
LISTEN = "0A"  # the TCP state column of a listening socket in /proc/net/tcp*


def _address(hex_addr: str) -> str:
    """/proc/net/tcp* writes addresses as hex words in host byte order: 0100007F is 127.0.0.1."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, IPv4 and IPv6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(m.group(1))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                addr, port = cols[1].rsplit(":", 1)
                out.add((_address(addr), int(port, 16)))
    return out


def _ipv4_of(interface: str) -> str | None:
    """The interface's IPv4 address (SIOCGIFADDR), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def test_the_rendezvous_listens_on_loopback_only(tiny, monkeypatch):
    """The store (unauthenticated, and the way into the pickle-carrying control group) and gloo: loopback."""
    others = [(name, _ipv4_of(name)) for _, name in socket.if_nameindex() if not name.startswith("lo")]
    others = [(name, ip) for name, ip in others if ip is not None]
    if others:  # a multi-node setting left in the environment must not pull the spawned ranks onto the network
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", others[0][0])
    before = listening(os.getpid())
    with LLM(tiny, tensor_parallel_size=2) as llm:
        assert llm.generate("hi", SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids  # rank 1 joined
        port = llm.model.ranks.store.port
        ours = listening(os.getpid()) - before
        worker = listening(llm.model.ranks.processes[1].pid)
        assert (("127.0.0.1", port)) in ours, (port, ours)
        for addr, p in ours | worker:  # the store and every gloo pair socket, in both processes
            assert addr in ("127.0.0.1", "::1"), f"port {p} listens on {addr} (every interface or the network)"
        for name, ip in others:  # a client from the network side, in another process, is refused
            knock = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=3); print('connected')"
            res = subprocess.run([sys.executable, "-c", knock], capture_output=True, text=True, timeout=30)
            assert "ConnectionRefusedError" in res.stderr, (name, ip, res.stdout, res.stderr)
    assert os.environ.get("GLOO_SOCKET_IFNAME") == (others[0][0] if others else None)  # restored after


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tp_script.py"
    path.write_text(textwrap.dedent(body))
    return path


TWICE = """\
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (a background job ignores SIGINT)
from stagewise import LLM, SamplingParams


def absorb(call):
    try:
        call()
        return "finished"
    except KeyboardInterrupt:
        return "interrupted"


if __name__ == "__main__":
    llm = LLM("tiny", tensor_parallel_size=2, mode="naive")
    print("generating", flush=True)
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    print(absorb(lambda: llm.generate("hello", long)), flush=True)
    absorb(lambda: time.sleep(1.5))  # the second Ctrl-C, if the first one's cleanup is already over
    start = time.monotonic()
    try:
        llm.generate("hi", SamplingParams(max_tokens=2))
        print("next call ran")
    except Exception as exc:
        print(f"next call {time.monotonic() - start:.3f} s {type(exc).__name__}: {exc}", flush=True)
    llm.shutdown()
"""


def _ctrl_c_twice(tmp_path) -> tuple[list[str], float]:
    """Run TWICE, press Ctrl-C twice 0.3 s apart: (its output lines, seconds from Ctrl-C to exit)."""
    proc = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, TWICE))],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground command
    )
    assert proc.stdout.readline() == "generating\n", proc.communicate()
    time.sleep(1.0)  # well inside the 1000 steps
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process of the group
    start = time.monotonic()
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - start
    assert proc.returncode == 0, err
    assert took < 10, f"{took:.1f} s from Ctrl-C to exit"  # ~2 s here: 1.5 s of it the script's own sleep
    lines = out.splitlines()
    assert lines[0] == "interrupted", out
    return lines, took


def test_ctrl_c_twice_ends_every_rank_and_the_next_call_refuses_at_once(tmp_path):
    """Two Ctrl-C 0.3 s apart: the second lands in the first one's cleanup; no 60 s collective timeout.

    A Ctrl-C that lands between two steps (rank 0 sampling or scheduling, no collective under way)
    interrupts only rank 0's Python: the ranks are intact and the next call runs, as it should. The
    case under test is a Ctrl-C inside a step, so the run is repeated (up to 4 times) until one
    lands there; every run must exit promptly either way."""
    for _ in range(4):
        lines, _took = _ctrl_c_twice(tmp_path)
        if lines[1] == "next call ran":  # landed between steps: the ranks were never in a collective
            continue
        m = re.fullmatch(r"next call ([\d.]+) s TensorParallelError: (.*)", lines[1])
        assert m and "create a new LLM" in m.group(2), lines
        assert float(m.group(1)) < 0.5, lines  # refused at once, not after the collective timeout
        return
    pytest.fail("4 runs, and no Ctrl-C landed inside a step")


KILLED = """\
from stagewise import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM("tiny", tensor_parallel_size=2, mode="naive")
    print(llm.model.ranks.processes[1].pid, flush=True)
    llm.generate("hello", SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
"""


def test_a_killed_rank0_leaves_no_output_behind(tmp_path):
    """SIGKILL rank 0 mid-run: its worker notices (broken collective, watchdog) and exits without a word."""
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(_script(tmp_path, KILLED))],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=err,  # the worker inherits it, as it inherits a terminal
            text=True,
            start_new_session=True,
        )
    worker = int(proc.stdout.readline())
    time.sleep(0.5)  # generating
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    said = err_path.read_text()
    for _ in range(100):  # the worker ends too (its process group empties)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {worker} outlived rank 0 by 10 s")
    assert err_path.read_text()[len(said) :] == "", "the worker wrote after rank 0 was gone"
    assert proc.stdout.read() == ""


UNGUARDED = """\
from stagewise import LLM, SamplingParams

llm = LLM("tiny", tensor_parallel_size=2)
print(llm.generate("hi", SamplingParams(max_tokens=2))[0].text)
"""


def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path):
    res = subprocess.run(
        [sys.executable, str(_script(tmp_path, UNGUARDED))],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    assert res.stderr.splitlines()[-1] == f"stagewise.errors.StagewiseError: {MAIN_GUARD_HINT}"
    assert 'if __name__ == "__main__":' in MAIN_GUARD_HINT
    assert res.stderr.count("Traceback") == 1, res.stderr  # rank 0's own error only: the worker left quietly


# `python -m stagewise.cli ARGS` with Ctrl-C's usual handler (a test run started in the background hands its
# children SIGINT ignored, and a Python started that way keeps ignoring it)
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'stagewise'; runpy.run_module('stagewise.cli', run_name='__main__', alter_sys=True)"
)


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid` (field 5 of /proc/PID/stat)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(entry))
    return out


def _spawned(pgid: int) -> list[int]:
    """The multiprocessing-spawned workers in the group (not its resource tracker, which blocks SIGINT itself)."""
    out = []
    for pid in _group(pgid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def test_ctrl_c_while_a_worker_starts_prints_one_line(tmp_path):
    """The worker is deaf to SIGINT from its first instruction, not only once its imports are over."""
    args = ["generate", "hi", "--model", "tiny", "--tp", "2", "--max-tokens", "5"]
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *args],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (workers := _spawned(proc.pid)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    status, masks = "(gone before it could be read)", [0, 0]
    for _ in range(50):  # its first half second: forked, exec'd, importing
        try:
            status = Path(f"/proc/{workers[0]}/status").read_text()
        except OSError:
            break
        masks = [int(re.search(rf"{field}:\s*(\w+)", status)[1], 16) for field in ("SigBlk", "SigIgn")]
        if not (masks[0] | masks[1]) & (1 << (signal.SIGINT - 1)):
            break  # a moment when Ctrl-C would raise KeyboardInterrupt in it
        time.sleep(0.01)
    sigint_deaf = bool((masks[0] | masks[1]) & (1 << (signal.SIGINT - 1)))
    os.killpg(proc.pid, signal.SIGINT)  # while the worker imports torch
    out, err = proc.communicate(timeout=60)
    assert sigint_deaf, status
    assert (proc.returncode, err) == (130, "interrupted\n")
