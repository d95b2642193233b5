"""`stagewise serve` as a real process: the URL line, the warning for --host 0 (0.0.0.0), SIGTERM draining
the requests in flight (one finishes, one is aborted at --drain-timeout), writing the --record file
and exiting 143 with one line and no traceback. In-process (all before the model loads): a port in
use, a bad host or a bad option is one line and exit 2."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from stagewise import cli
from stagewise.errors import StagewiseError
from stagewise.serve.server import bind


def _serve(*args) -> subprocess.Popen:
    command = [sys.executable, "-m", "stagewise.cli", "serve", "--model", "tiny", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _stream(url: str, body: dict, out: dict) -> None:
    """Read one streaming answer to its end, however it ends; what came back goes in `out`."""
    out["chunks"], out["done"] = [], False
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    out["chunks"].append(json.loads(line[6:]))
    except httpx.HTTPError as exc:  # the connection went away
        out["error"] = exc


def _keep_signalling(proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def test_sigterm_drains_then_aborts_and_exits_143(tmp_path):
    record = tmp_path / "run.json"
    # "0" is 0.0.0.0 to the system: every interface, and the warning must say so whatever the spelling
    proc = _serve(
        "--host", "0", "--port", "0", "--drain-timeout", "1", "--record", str(record), "--prefix-cache", "radix"
    )
    try:
        line = proc.stdout.readline()  # the URL line, printed once the socket listens
        assert line.startswith("serving tiny (paged) at http://0.0.0.0:"), line + proc.stderr.read()
        port = int(line.split("http://0.0.0.0:")[1].split()[0])
        assert proc.stdout.readline().startswith(f"live view: http://0.0.0.0:{port}/  (open it in a browser")
        assert proc.stdout.readline() == f"recording every engine step to {record} (written when the server stops)\n"
        url = f"http://127.0.0.1:{port}"
        assert "no authentication" in proc.stderr.readline()  # the one-line warning for every interface
        short, long = {}, {}
        long_body = {"prompt": "Long", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        readers = [
            threading.Thread(target=_stream, args=(url, long_body, long)),
            threading.Thread(target=_stream, args=(url, {"prompt": "Short", "max_tokens": 6}, short)),
        ]
        readers[0].start()
        deadline = time.monotonic() + 60
        while not long.get("chunks") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert long.get("chunks"), "the long request produced nothing"
        readers[1].start()
        while not short.get("chunks") and time.monotonic() < deadline:
            time.sleep(0.005)  # the short request runs before the signal (its first token came)
        proc.send_signal(signal.SIGTERM)
        # a supervisor that keeps sending SIGTERM: the drain goes on, and neither the exit nor
        # Python's finalization is cut short (no traceback, no death by the signal)
        repeater = threading.Thread(target=_keep_signalling, args=(proc,), daemon=True)
        repeater.start()
        for r in readers:
            r.join(60)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err, err
    assert short["done"] and short["chunks"][-1]["choices"][0]["finish_reason"] in ("length", "stop"), short  # drained
    # the long one (1000 tokens: well over a second of steps) was aborted at the drain timeout
    assert long["done"] and "error" in long["chunks"][-1], long["chunks"][-1]
    assert "stopped before the request finished" in long["chunks"][-1]["error"]["message"]
    trace = json.loads(record.read_text())  # --record wrote the run on the way out, and said so
    assert f"wrote {record} ({len(trace['steps'])} steps; replay: stagewise view {record})" in out.splitlines(), out
    assert trace["steps"] and trace["model"]["recorded_by"] == "stagewise serve --record"
    assert {step["view"]["kv"]["prefix_cache"] for step in trace["steps"]} == {"radix"}  # --prefix-cache reached it


def _invoke(argv, monkeypatch, capsys) -> tuple[int, str]:
    """The CLI in-process (its own argv): -> (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", ["stagewise", "serve", "--model", "tiny", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    return exit_info.value.code, capsys.readouterr().err


def test_port_in_use_is_one_line_and_exit_2(monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = _invoke(["--port", str(port)], monkeypatch, capsys)
    assert code == 2
    assert err.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--host", "no-such-host.invalid"], "cannot use host 'no-such-host.invalid'"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--mode", "naive"], "--mode must be paged or kv"),
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--mode", "kv", "--record", "x.json"], "--record needs --mode paged"),
        (["--speculative", "bogus"], "--speculative expects ngram:K"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, words, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, err = _invoke([*argv, "--port", "0"] if "--port" not in argv else argv, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not list(tmp_path.iterdir())  # nothing recorded


def test_bind_refuses_a_bad_host_with_a_stagewise_error():
    with pytest.raises(StagewiseError, match="host"):
        bind("no-such-host.invalid", 0)
