"""`generate` with several prompts streams them one after another (not silently until the end), and
`--stats` prints TTFT, TBT, TPS, latency and tokens/s per request in a table (no raw RunStats dump)."""

import io
import os
import subprocess
import sys

from stagewise import LLM, SamplingParams
from stagewise.cli.streaming import stream_texts

PROMPTS = ["Hello there", "A second prompt that is longer", "Third"]
ENV = {**os.environ, "STAGEWISE_QUIET": "1", "COLUMNS": "80", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


class Recorder(io.StringIO):
    """stdout that remembers how many engine events had arrived at each write."""

    def __init__(self, counter: list[int]):
        super().__init__()
        self.counter, self.writes = counter, []

    def write(self, text: str) -> int:
        if text:
            self.writes.append((self.counter[0], text))
        return super().write(text)


def test_several_prompts_stream_one_after_another(tiny):
    llm = LLM(tiny)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    seen = [0]

    def counted(events):
        for event in events:
            seen[0] += 1
            yield event

    out = Recorder(seen)
    clocks = stream_texts(counted(llm.stream(PROMPTS, params)), PROMPTS, out=out)
    total = seen[0]
    text = out.getvalue()
    assert text == "".join(f"[{i}] {p!r}\n{t}\n\n" for i, (p, t) in enumerate(zip(PROMPTS, expected)))
    first_text = next(n for n, piece in out.writes if piece.strip() and not piece.startswith("["))
    assert first_text < total  # request 0's text was out before the last token of the batch arrived
    assert [len(c.times) for c in clocks] == [6, 6, 6]


def test_stats_table_per_request():
    cmd = [sys.executable, "-m", "stagewise.cli", "generate", *PROMPTS, "--model", "tiny", "--max-tokens", "5"]
    res = subprocess.run([*cmd, "--stats"], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "RunStats(" not in res.stderr
    for header in ("TTFT", "TBT", "TPS", "(1/TBT)", "latency", "tokens/s", "all requests: 15 output tokens"):
        assert header in res.stderr, header
    rows = [line for line in res.stderr.splitlines() if line.startswith("│ ")]
    assert [row.split("│")[1].strip() for row in rows] == ["0", "1", "2"]
    assert all(row.split("│")[2].strip() == "5" for row in rows)
    assert max(map(len, res.stderr.splitlines())) <= 80 and "…" not in res.stderr
    assert "TTFT" not in res.stdout  # stdout keeps the text only
