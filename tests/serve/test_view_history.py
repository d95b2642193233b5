"""The live view in a real headless Chromium: a page opened late, reloaded or reconnected keeps the
run's steps, and the page reads on a projector (1024x768 and 1920x1080, screenshots taken here).

The browser is Debian's chromium through Selenium, as in test_view_browser.py (its fixture, through
this folder's conftest.py: it fails, never skips, when the binaries are missing). Screenshots go to
the test's temporary folder; with STAGEWISE_DOCS_SHOTS=1 they are written to docs/ instead (the
README's pictures).
"""

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from stagewise import LLM
from stagewise.config import EngineConfig
from stagewise.serve.limits import ServerLimits
from stagewise.serve.view import ViewHub
from tests.serve.harness import running_server
from tests.serve.test_view_browser import WAIT_S, SteppedHub, wait_until

DOCS = Path(__file__).resolve().parents[2] / "docs"

CHARTS = """
const b = document.getElementById("budget-chart").dataset, l = document.getElementById("latency-chart").dataset;
return {
  step: document.getElementById("view").dataset.step,
  history: state.history.map((s) => s.step),
  budget_steps: (b.steps || "").split(" ").filter((x) => x).map(Number),
  budget_label: b.label || "",
  points: Number(l.points || 0), pauses: Number(l.pauses || 0),
};
"""


def complete(url: str, prompt: str, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    res = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S * 4)
    assert res.status_code == 200, res.text


def charts_hold(driver, hub: ViewHub, points: int | None = None) -> dict:
    """Wait until the page holds exactly the server's steps, drawn in the budget chart, and (if given)
    `points` tokens in the latency chart; -> what it shows. (The server's steps are read at each look:
    the last step of a request is published just after its answer, so the page and the server can
    agree one step early; the token count says when every step of the requests so far is in.)"""

    def check():
        page, want = driver.execute_script(CHARTS), [s["step"] for s in hub.history()]
        drawn = points is None or page["points"] == points
        return page if page["history"] == want and page["budget_steps"] == want and drawn else None

    try:
        return wait_until("the page to hold the server's steps", check)
    except AssertionError:
        steps = [s["step"] for s in hub.history()]
        raise AssertionError(f"the page holds {driver.execute_script(CHARTS)}, the server {steps}") from None


def test_page_opened_late_keeps_the_history_across_reload_and_reconnect(browser, tiny):
    ecfg = EngineConfig(block_size=4, num_kv_blocks=48, max_num_seqs=2, max_num_batched_tokens=64)
    hub = ViewHub(limits=ServerLimits(view_publish_hz=0))  # every step live: the test counts the steps
    with running_server(LLM(tiny, mode="paged", engine_config=ecfg), hub=hub, model_name="tiny") as server:
        try:
            for prompt in ("one two three", "four five six seven"):  # traffic before anyone looks
                complete(server.url, prompt, 5)

            browser.get(server.url + "/")  # opened after the requests ran: every step is there
            page = charts_hold(browser, hub, points=10)
            ran = page["history"]
            assert len(ran) >= 10 and page["step"] == str(ran[-1]) and page["points"] == 10  # 2 requests x 5 tokens

            complete(server.url, "eight nine", 3)  # a new request: its steps extend the history
            more = charts_hold(browser, hub, points=13)["history"]
            assert more[: len(ran)] == ran and len(more) > len(ran)

            browser.refresh()  # F5 on the projector
            page = charts_hold(browser, hub, points=13)
            assert page["history"] == more and page["points"] == 13

            # a slow page gets only the latest step (the server coalesces): the gap is filled from the history
            browser.execute_script("state.history.splice(-3)")  # as if the stream had skipped the last 3 steps
            complete(server.url, "ten eleven", 2)
            page = charts_hold(browser, hub, points=15)
            assert page["history"][: len(more)] == more

            # a reconnect (the stream drops and comes back): its first event repeats the latest step
            browser.execute_script("state.source.close(); startLive();")
            wait_until(
                "the stream to reconnect",
                lambda: browser.execute_script("return document.body.dataset.connected === '1'"),
            )
            complete(server.url, "ten", 2)
            page = charts_hold(browser, hub, points=17)
            assert page["history"][: len(more)] == more and page["points"] == 17

            # a big pool whose blocks in use are spread out (the free queue hands blocks out in LRU order):
            # each cluster is drawn with a margin, every long free run between them folds into one gap
            runs = browser.execute_script("return blockRuns(1000, [500, 501, 900])")
            assert [(r["from"], r["to"], r["gap"]) for r in runs] == [
                (0, 492, True),
                (492, 510, False),
                (510, 892, True),
                (892, 909, False),
                (909, 1000, True),
            ]
            assert browser.execute_script("return blockRuns(48, [3, 40])") == [{"from": 0, "to": 48, "gap": False}]

            # only a smaller step number means a restart (a new server): then the charts start over
            latest = hub.latest()
            browser.execute_script(
                "receive(Object.assign({}, arguments[0], {step: 0, time: arguments[0].time + 1}))", latest
            )
            assert browser.execute_script(CHARTS)["history"] == [0]
        finally:
            browser.get("about:blank")
            hub.close()


PROJECTOR_SIZES = ((1024, 768), (1920, 1080))
SYSTEM = "You are a patient teacher. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is a prime number?",
    "Name a planet with rings.",
    "What do bees make?",
    "How many legs has a spider?",
]

LAYOUT = """
const cell = document.querySelector("#kv-grid .block");
const label = (id) => document.getElementById(id).dataset;
return {
  scroll_width: document.documentElement.scrollWidth, inner_width: window.innerWidth,
  inner_height: window.innerHeight,
  cell_px: cell ? cell.getBoundingClientRect().width : 0,
  num_cells: document.querySelectorAll("#kv-grid .block").length,
  gaps: [...document.querySelectorAll("#kv-grid .gap")].map((g) => Number(g.dataset.count)),
  kv_note: document.getElementById("kv-note").textContent,
  budget_label: label("budget-chart").label, pauses: Number(label("latency-chart").pauses || 0),
  legend: document.getElementById("bar-legend").textContent.replace(/\\s+/g, " ").trim(),
  running: document.querySelectorAll("#queue-running li").length,
  waiting: document.querySelectorAll("#queue-waiting li").length,
  latency_bottom: document.getElementById("latency-chart").getBoundingClientRect().bottom,
};
"""


class HeldHub(SteppedHub):
    """A SteppedHub that holds the engine for as long as the test looks at the page (on a loaded
    machine that can pass SteppedHub's minute, and the engine would step on): released at the end."""

    def publish(self, snapshot: dict, live: bool = True) -> None:
        ViewHub.publish(self, snapshot, live)
        if not self.free:
            self._permits.acquire(timeout=HOLD_S)


HOLD_S = 900  # the most the engine is held at one step (the test frees it in its `finally`)


def chat(url: str, question: str, max_tokens: int, out: list) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S * 10).status_code)


@pytest.mark.model
def test_page_reads_on_a_projector(browser, smollm, tmp_path):
    """SmolLM2 with a big pool (1200 blocks): a first request, a pause, then six chat requests held
    mid-run with four seats taken; the page at 1024x768 and 1920x1080: no sideways scroll, readable
    KV cells with the free runs folded and the total said in words, the budget label whole, the pause
    cut out of the time axis, a legend for the request bars. Screenshots of both sizes."""
    shots = DOCS if os.environ.get("STAGEWISE_DOCS_SHOTS") == "1" else tmp_path
    ecfg = EngineConfig(num_kv_blocks=1200, max_num_seqs=4, max_num_batched_tokens=512)
    hub = HeldHub()
    hub.free = True
    statuses: list = []
    with running_server(LLM(smollm, mode="paged", engine_config=ecfg), hub=hub, model_name="smollm2") as server:
        try:
            chat(server.url, "Say hello to the class.", 8, statuses)  # before the pause
            time.sleep(1.5)  # idle: the time axis cuts this out
            hub.free = False  # from now on the engine waits for the test at every step
            threads = []
            for i, question in enumerate(QUESTIONS):
                thread = threading.Thread(target=chat, args=(server.url, question, 10, statuses), daemon=True)
                thread.start()
                threads.append(thread)
                wait_until(f"request {i + 1} in the server", lambda n=i + 1: server.state.loop.num_in_flight() == n)

            def decoded(snap: dict) -> int:  # the fewest output tokens among the running requests
                return min((snap["requests"][r]["num_output_tokens"] for r in snap["queues"]["running"]), default=0)

            while decoded(hub.latest()) < 5:  # the prefill, then decode steps: four running, two waiting
                step = hub.latest()["step"]
                hub.advance()
                wait_until("the next step", lambda s=step: hub.latest()["step"] > s)
            latest = hub.latest()
            assert len(latest["queues"]["running"]) == 4 and len(latest["queues"]["waiting"]) == 2, latest["queues"]

            browser.get(server.url + "/")
            for width, height in PROJECTOR_SIZES:
                metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
                browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # the viewport, exactly
                wait_until("the window size", lambda w=width: browser.execute_script("return window.innerWidth") == w)
                browser.execute_script("window.dispatchEvent(new Event('resize'))")
                wait_until(
                    "the page at the latest step",
                    lambda: browser.execute_script(CHARTS)["step"] == str(latest["step"]),
                    timeout=3 * WAIT_S,
                )
                page = browser.execute_script(LAYOUT)
                assert page["scroll_width"] <= page["inner_width"], f"sideways scroll at {width}x{height}: {page}"
                assert page["running"] == 4 and page["waiting"] == 2
                assert page["cell_px"] >= 16 and page["num_cells"] < 200, page  # readable cells, not 1200 specks
                assert page["gaps"] and sum(page["gaps"]) + page["num_cells"] == 1200, page
                assert page["kv_note"].startswith(f"{latest['kv']['num_used']} of 1200 blocks in use"), page
                assert "folded" in page["kv_note"], page
                assert page["budget_label"] == "budget 512 tokens per step, above the scale", page
                assert page["pauses"] == 1, page  # the 1.5 s pause, cut out and marked
                assert page["legend"].startswith("computed: its K/V in the cache"), page
                path = shots / f"live_view_{width}x{height}.png"
                assert browser.save_screenshot(str(path)), path
                assert path.stat().st_size > 10_000
        finally:
            hub.run_free()
            browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
            browser.get("about:blank")
            hub.close()
        for thread in threads:
            thread.join(WAIT_S * 4)
    assert statuses == [200] * 7
