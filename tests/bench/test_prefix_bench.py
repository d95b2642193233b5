"""`bench prefix`: none vs hash vs radix on chat, few-shot and n samples, proven on the quick config.

The quick run is also the end-to-end check of the three caches: on every workload each request's
tokens and log-probabilities equal the run without a cache, bit for bit, and the radix tree reuses
what the hashed cache reuses and more. No timing assertions: speed lives in the results.
"""

import json

from typer.testing import CliRunner

from stagewise.cli.bench import bench_app
from stagewise.errors import StagewiseError


def test_quick_run_same_bits_and_radix_reuses_more(tmp_path):
    result = CliRunner().invoke(bench_app, ["prefix", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "prefix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "prefix.json").read_text())
    res, bs = data["results"], data["settings"]["block_size"]
    assert set(res) == {"chat", "few-shot", "samples"}
    for workload, caches in res.items():
        assert list(caches) == ["none", "hash", "radix"]
        assert all(r["identical"] for r in caches.values()), workload
        none, hash_, radix = (caches[c]["reused_tokens"] for c in ("none", "hash", "radix"))
        assert radix >= hash_ >= none, workload
        assert caches["none"]["hit_tokens"] == 0
    assert res["samples"]["none"]["forked_tokens"] > 0  # the samples share their prompt without a cache
    extra = data["chat_extra_tokens_per_turn"]
    assert 0 < extra < bs, "radix should reuse part of the block that hash leaves at each turn"
    assert res["chat"]["radix"]["computed_tokens"] < res["chat"]["hash"]["computed_tokens"]
    assert data["model"]["prefix_cache"] == "none"


def test_bad_options_are_one_line(tmp_path):
    for args, message in (
        (["--caches", "hash,lru"], "unknown prefix cache 'lru'"),
        (["--workloads", "chat,code"], "unknown workload 'code'"),
        (["--turns", "0"], "--turns must be >= 1"),
    ):
        result = CliRunner().invoke(bench_app, ["prefix", "--quick", "--model", "tiny", "--out", str(tmp_path), *args])
        assert isinstance(result.exception, StagewiseError), result.output  # exit 2 under run_command
        assert message in str(result.exception) and "\n" not in str(result.exception)
