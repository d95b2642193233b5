"""The live view and the replay page in a real headless Chromium (Debian's, through Selenium).

No Selenium Manager and no download: the browser and its driver are the binaries that
scripts/install_browser.sh installs with apt (`make test` runs it first). When they are missing the
test fails; it never skips.

No race with the engine either: the server's hub is step-gated. After publishing each snapshot the
engine thread waits until the test lets it run one more step, so the test knows exactly which step
the page must show, and reads the page while the engine stands still at it. One browser for the module.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from stagewise import LLM
from stagewise.config import EngineConfig
from stagewise.serve.limits import ServerLimits
from stagewise.serve.view import RunRecorder, ViewHub
from tests.serve.harness import running_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60  # the most a page or the engine may take to reach a state (a loaded 2-core machine)
PREFIX = "the cat sat on the mat and the dog sat on the log " * 3  # a shared prompt prefix: shared KV blocks

READ_PAGE = """
const ids = (sel) => [...document.querySelectorAll(sel)].map((e) => e.getAttribute("data-request"));
const blocks = {};
for (const b of document.querySelectorAll(".block[data-owner]")) blocks[b.dataset.block] = b.dataset.owner;
const requests = {};
for (const r of document.querySelectorAll("#requests tr[data-request]"))
  requests[r.dataset.request] = [Number(r.dataset.computed), Number(r.dataset.tokens), r.dataset.status];
return {
  step: document.getElementById("view").dataset.step,
  waiting: ids("#queue-waiting li"), running: ids("#queue-running li"), preempted: ids("#queue-preempted li"),
  blocks: blocks, shared: [...document.querySelectorAll(".block[data-shared]")].map((b) => b.dataset.block),
  num_cells: document.querySelectorAll("#kv-grid .block").length,
  requests: requests, stats: document.getElementById("stats").textContent,
};
"""


class SteppedHub(ViewHub):
    """A ViewHub whose publish() (run by the engine thread) waits for the test's go-ahead; every step
    is published live (view_publish_hz=0), so the test knows which step the page must show."""

    def __init__(self):
        super().__init__(limits=ServerLimits(view_publish_hz=0))
        self._permits = threading.Semaphore(0)
        self.free = False  # True: no more waiting (the end of the test)

    def publish(self, snapshot: dict, live: bool = True) -> None:
        super().publish(snapshot, live)
        if not self.free:
            self._permits.acquire(timeout=WAIT_S)

    def advance(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def run_free(self) -> None:
        self.free = True
        self.advance(1)


@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: run scripts/install_browser.sh (as root)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should anything reach it, must not download
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    if os.geteuid() == 0:
        options.add_argument("--no-sandbox")  # Chromium refuses to run its sandbox as root
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


def wait_until(what: str, check, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def page_at(driver, step: int) -> dict:
    wait_until(f"the page to show step {step}", lambda: driver.execute_script(READ_PAGE)["step"] == str(step))
    return driver.execute_script(READ_PAGE)


def expected(snap: dict) -> dict:
    """What the page must show for a snapshot: the same queues, block owners and counters."""
    owners: dict[str, list[str]] = {}
    for rid, r in snap["requests"].items():
        for b in r["blocks"]:
            owners.setdefault(str(b), []).append(rid)
    requests = {rid: [r["num_computed_tokens"], r["num_tokens"], r["status"]] for rid, r in snap["requests"].items()}
    return {
        "step": str(snap["step"]),
        **snap["queues"],
        "blocks": {b: " ".join(ids) for b, ids in owners.items()},
        "shared": [str(b) for b in snap["kv"]["shared"]],
        "requests": requests,
    }


def stream_completion(url: str, prompt: str, max_tokens: int, out: list) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S * 4) as res:
        out.extend(line for line in res.iter_lines() if line.startswith("data: "))


def watch_live(browser, server, hub: "SteppedHub") -> dict[int, dict]:
    """Three requests through the server, the engine held at each step; -> step: what the page showed."""
    seen: dict[int, dict] = {}
    browser.get(server.url + "/")
    body = browser.find_element("tag name", "body")
    wait_until("the page to connect", lambda: body.get_attribute("data-connected") == "1")
    streams = []

    def start(prompt: str, max_tokens: int, in_flight: int) -> None:
        out: list = []
        thread = threading.Thread(target=stream_completion, args=(server.url, prompt, max_tokens, out), daemon=True)
        thread.start()
        streams.append((thread, out))
        wait_until(f"request {in_flight} in the server", lambda: server.state.loop.num_in_flight() == in_flight)

    start(PREFIX + "one", 6, 1)  # A: admitted alone, its first step is its prefill
    first = wait_until("the first step", hub.latest)["step"]
    page = page_at(browser, first)
    assert page == {**page, **expected(hub.latest())}
    assert page["running"] == ["req-0"] and page["blocks"] and set(page["blocks"].values()) == {"req-0"}
    assert page["num_cells"] == 48  # the whole pool: one cell per block

    start(PREFIX + "two", 30, 2)  # B joins the running batch (and shares A's prefix blocks)
    start("a different prompt", 4, 3)  # C waits: max_num_seqs=2 seats are taken
    for step in range(first + 1, first + 9):  # A decodes to its end and leaves; C takes its seat
        hub.advance()
        snap = wait_until(f"step {step}", lambda s=step: hub.latest()["step"] == s and hub.latest())
        seen[step] = page = page_at(browser, step)
        assert page == {**page, **expected(snap)}
    page = seen[first + 1]
    assert page["running"] == ["req-0", "req-1"] and page["waiting"] == ["req-2"]
    assert page["shared"], "B's prompt starts with A's full blocks: they are shared, and marked"
    assert {page["blocks"][b] for b in page["shared"]} == {"req-0 req-1"}
    assert any("req-2" in p["running"] for p in seen.values()), "C was admitted when A finished"
    assert any(p["requests"].get("req-0", [0, 0, ""])[2] == "finished" for p in seen.values())

    hub.run_free()
    for thread, out in streams:
        thread.join(WAIT_S * 4)
        assert out and out[-1] == "data: [DONE]"
    assert server.engine_idle()
    return seen


def test_live_page_follows_the_engine_and_replays_the_same(browser, tiny, tmp_path):
    ecfg = EngineConfig(block_size=4, num_kv_blocks=48, max_num_seqs=2, max_num_batched_tokens=128)
    llm = LLM(tiny, mode="paged", engine_config=ecfg)
    hub = SteppedHub()
    record = tmp_path / "run.json"
    recorder = RunRecorder(record, llm.describe())
    hub.subscribe(recorder)
    with running_server(llm, hub=hub, model_name="tiny") as server:
        try:
            seen = watch_live(browser, server, hub)
        finally:
            hub.run_free()  # the engine thread never waits on a test that failed
            browser.get("about:blank")
            hub.close()  # the page's event stream ends: the server stops at once
    recorder.close()

    # the recording, replayed by `stagewise view`, shows the same page at the same steps
    from tests.cli.test_cli_interrupt import AS_FROM_A_TERMINAL  # Ctrl-C's handler even when run in the background

    cmd = [sys.executable, "-c", AS_FROM_A_TERMINAL, "view", str(record), "--port", "0"]
    env = {**os.environ, "STAGEWISE_QUIET": "1", "NO_COLOR": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("replaying ") and " at http://127.0.0.1:" in line, (line, proc.stderr.read())
        browser.get(line.split(" at ")[1].split()[0])
        wait_until("the replay to load", lambda: browser.execute_script("return state.replay && state.replay.length"))
        for step, live in seen.items():
            index = browser.execute_script(f"return state.replay.findIndex((v) => v.step === {step})")
            assert index >= 0, f"step {step} is not in the recording"
            browser.execute_script(
                "const s = document.getElementById('slider'); s.value = arguments[0];"
                "s.dispatchEvent(new Event('input'));",
                index,
            )
            assert page_at(browser, step) == live
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err

    # a file chosen on the page (its file input) replays too: same state at the same step
    step, live = next(iter(seen.items()))
    browser.execute_script("state.replay = null; showStep = showStep;")
    browser.find_element("id", "file").send_keys(str(record))
    wait_until("the file to load", lambda: browser.execute_script("return state.replay && state.replay.length"))
    index = browser.execute_script(f"return state.replay.findIndex((v) => v.step === {step})")
    browser.execute_script("showStep(arguments[0])", index)
    assert page_at(browser, step) == live


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_in_a_cookie(browser, tiny):
    """--api-key covers the view's data: the page shows a key form, then the stream (sent the cookie)."""
    with running_server(LLM(tiny), hub=ViewHub(), api_key="k3y", model_name="tiny") as server:
        auth = {"Authorization": "Bearer k3y"}
        body = {"prompt": "a private prompt", "max_tokens": 3}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=WAIT_S).status_code == 200
        try:
            browser.get(server.url + "/")
            form = browser.find_element("id", "key-form")
            wait_until("the page to ask for the key", form.is_displayed)
            assert browser.execute_script(READ_PAGE)["step"] == ""  # nothing shown without the key
            browser.find_element("id", "key").send_keys("k3y")
            form.find_element("tag name", "button").click()
            body_el = browser.find_element("tag name", "body")
            wait_until("the page to connect", lambda: body_el.get_attribute("data-connected") == "1")
            wait_until("a step on the page", lambda: browser.execute_script(READ_PAGE)["step"] != "")
            assert not form.is_displayed()
        finally:
            browser.delete_all_cookies()  # cookies are per host, not per port: the next server's page starts clean
            browser.get("about:blank")
