"""Bad input on every command: one line on stderr, exit 2, no traceback, no file touched.

Table-driven and in-process (the CLI's `main()` with its own argv), so a
hundred cases cost seconds; `test_cli_interrupt.py` runs real subprocesses for
Ctrl-C. In each case the working folder holds an `old.txt` and (for bench)
an earlier `modes.json`: the test checks that nothing in it changed and that
no temporary file was left behind.
"""

import json
import re
import sys

import pytest

from stagewise import cli

OLD = "an earlier result\n"


def invoke(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["stagewise", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
        raise SystemExit(0)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


def snapshot(folder) -> dict:
    """Every file's bytes and every folder (None): a failed command may not create an empty folder either."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "old.txt").write_text(OLD)
    (tmp_path / "sub").mkdir()
    results = tmp_path / "results"
    results.mkdir()
    (results / "modes.json").write_text(json.dumps({"settings": {"model": "smollm2-135m", "prompt_tokens": 32}}))
    (tmp_path / "config-list.json").write_text("[1, 2]")
    (tmp_path / "config-missing.json").write_text(json.dumps({"hidden_size": 64}))
    sizes = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    (tmp_path / "config-zero-heads.json").write_text(json.dumps({**sizes, "num_attention_heads": 0}))
    (tmp_path / "hf-list").mkdir()
    (tmp_path / "hf-list" / "config.json").write_text("[1]")
    (tmp_path / "hf-zero").mkdir()
    llama = {"model_type": "llama", **sizes, "num_attention_heads": 0}
    (tmp_path / "hf-zero" / "config.json").write_text(json.dumps(llama))
    (tmp_path / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00 not really a gguf file")
    monkeypatch.chdir(tmp_path)
    return tmp_path


TINY = ["--model", "tiny"]
Q = ["--out", "results", "--model", "tiny"]
CASES = [
    # trace: every filter checked, for every format
    (["trace", "hi", *TINY, "--layers", "99"], "--layers 99 is out of range: tiny has 2 layers, valid 0-1"),
    (["trace", "hi", *TINY, "--layers", "0-999999999999"], "--layers 0-999999999999 is out of range"),
    (["trace", "hi", *TINY, "--layers", "5-3"], "runs backwards"),
    (["trace", "hi", *TINY, "--layers", ""], "--layers has an empty item"),
    (["trace", "hi", *TINY, "--layers", "1,,2"], "--layers has an empty item"),
    (["trace", "hi", *TINY, "--layers", "-1"], "--layers expects numbers"),
    (["trace", "hi", *TINY, "--steps", "99"], "--steps 99 is out of range: this run has 3 steps, valid 0-2"),
    (["trace", "hi", *TINY, "--width", "0"], "--width must be >= 40"),
    (["trace", "hi", *TINY, "--format", "json", "--layers", "7"], "--layers 7 is out of range"),
    (["trace", "hi", *TINY, "--format", "chrome", "--steps", "5"], "--steps 5 is out of range"),
    (["trace", "hi", *TINY, "--format", "json", "--stage", "nope"], "unknown stage 'nope'"),
    (["trace", "hi", *TINY, "--max-tokens", "0"], "max_tokens must be"),
    (["trace", "hi", *TINY, "--kv-blocks", "0"], "--kv-blocks must be >= 1"),
    (["trace", "hi", *TINY, "--kv-blocks", "1000000000000"], "cannot allocate|needs .* GiB"),
    (["trace", "hi", *TINY, "--max-num-seqs", "1000000000000"], "cannot allocate|needs .* GiB"),
    (["trace", "hi", *TINY, "--out", "missing/t.txt"], "folder missing does not exist"),
    (["trace", "hi", *TINY, "--out", "sub"], "--out sub is a folder"),
    (["trace", "hi", *TINY, "--device", "cuda"], "no CUDA device|cuda"),
    (["trace", "hi", *TINY, "--device", "tpu"], "unknown device 'tpu'"),
    (["trace", "word " * 1100, *TINY], "more than max_model_len"),
    # generate
    (["generate", "hi", "--model", "llama-3-405b"], "llama-3-405b has no weights .* can be traced"),
    (["generate", "hi", *TINY, "--device", "meta"], "tiny has no weights"),
    (["generate", "   ", *TINY], "the prompt is empty"),
    (["generate", "hi", *TINY, "--top-p", "0"], "top_p must be"),
    (["generate", "hi", *TINY, "--batch-invariant=maybe"], "does not take a value"),
    (["generate", "hi", *TINY, "--prefix-cache", "lru"], "unknown prefix_cache 'lru'; use one of hash, radix, none"),
    (["trace", "hi", *TINY, "--no-prefix-caching", "--prefix-cache", "radix"], "enable_prefix_caching=False"),
    (["serve", *TINY, "--prefix-cache", "trie"], "unknown prefix_cache 'trie'; use one of hash, radix, none"),
    (["serve", *TINY, "--no-prefix-caching", "--prefix-cache", "radix"], "drop --no-prefix-caching"),
    (["bench", "invariance", *Q, "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "invariance", *Q, "--quantization", "int3"], "unknown weight format 'int3'"),
    (["trace", "hi", *TINY, "--no-batch-invariant=1"], "does not take a value"),
    (["serve", *TINY, "--no-batch-invariant=yes"], "does not take a value"),
    (["generate", "hi", *TINY, "--seed", "-99999999999999999999"], "seed must be"),
    (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["generate", "hi", "--model", "missing/model.gguf"], "not found"),
    (["generate", "hi", "--model", "corrupt.gguf"], "corrupt.gguf"),
    (["generate", "hi", *TINY, "--mode", "fast"], "unknown mode 'fast'"),
    (["generate", "hi", "--model", "hf-list"], "must hold a JSON object, got list"),
    (["generate", "hi", "--model", "hf-zero"], "num_attention_heads must be an int >= 1, got 0"),
    (["generate", "hi", *TINY, "--max-tokens", "x"], "Invalid value for '--max-tokens'"),
    (["generate", "hi", *TINY, "--bogus"], "No such option: --bogus"),
    (["generate", "hi", *TINY, "--tp", "0"], "tensor_parallel_size must be an int >= 1, got 0"),
    (["generate", "hi", *TINY, "--tp", "4"], "cannot split tiny: .* only for N in 1, 2"),
    (["trace", "hi", *TINY, "--tp", "0"], "tensor_parallel_size must be an int >= 1, got 0"),
    # bench: 0 is an error, not "the default"; outputs checked before running
    (["bench", "modes", *Q, "--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
    (["bench", "modes", *Q, "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "modes", *Q, "--modes", ""], "--modes needs at least one name"),
    (["bench", "modes", *Q, "--modes", ","], "--modes needs at least one name"),
    (["bench", "modes", *Q, "--formats", ""], "--formats needs at least one name"),
    (["bench", "modes", *Q, "--formats", "bogus"], "unknown quantization 'bogus'"),
    (["bench", "modes", *Q, "--output-lengths", ""], "--output-lengths must be positive integers"),
    (["bench", "modes", "--out", "results", "--model", "llama-3-405b"], "no weights here .* nothing to measure"),
    (["bench", "modes", *Q, "--device", "meta"], "no weights here"),
    (["bench", "modes", "--out", "old.txt", *TINY], "--out old.txt is a file"),
    (["bench", "modes", *Q, "--quick"], "different settings .* --overwrite"),
    (["bench", "batching", *Q, "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
    (["bench", "batching", *Q, "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["bench", "batching", *Q, "--continuous-seats", "0"], "--continuous-seats must be >= 1, got 0"),
    (["bench", "batching", *Q, "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "batching", *Q, "--quantization", "int3"], "unknown quantization 'int3'"),
    (["bench", "batching", *Q, "--on-mismatch", "ignore"], "--on-mismatch must be raise or record, got 'ignore'"),
    (["bench", "batching", *Q, "--prompt-tokens", "0-4"], "LOW-HIGH"),
    (["bench", "modes", *TINY, "--out", "new", "--prompt-tokens", "5000"], "5000 with --output-lengths up to"),
    (
        ["bench", "batching", *TINY, "--out", "new", "--prompt-tokens", "900-1000", "--output-tokens", "100-200"],
        "tiny allows 1024",
    ),
    (["generate", "hi", "--model", ""], "model name is empty"),
    (["trace", "hi", *TINY, "--device", "cpu:1"], "there is one CPU device"),
    (["calc", "--model", "corrupt.gguf"], "corrupt.gguf is not a valid GGUF file"),
    (["bench", "batching", *Q, "--prefill-beside-decodes", "0"], "--prefill-beside-decodes must be >= 1, got 0"),
    (["bench", "modes", *Q, "--tp", "0"], "--tp must be positive integers, got '0'"),
    (["bench", "modes", *Q, "--tp", "1,x"], "--tp must be comma-separated integers"),
    (["bench", "stages", "--out", "results", "--repeats", "-1"], "--repeats must be >= 1, got -1"),
    (["bench", "stages", "--out", "results", "--prefill-tokens", "0"], "--prefill-tokens must be >= 1"),
    (["bench", "stages", "--out", "results", "--stages", ","], "--stages needs at least one name"),
    (["bench", "stages", "--out", "results", "--device", "meta"], "--device meta holds no data"),
    (["bench", "modes", *Q, "--threads", "0"], "--threads must be >= 1"),
    (["bench", "modes", "--out", "new/folder", *TINY, "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "modes", "--out", "/proc/stagewise-results", *TINY], "not writable"),
    (["bench", "soak", "--out", "results", "--num-requests", "0"], "--num-requests must be >= 1"),
    # calc
    (["calc", "--plot", "old.txt"], "--plot old.txt is a file"),
    (["calc", "--json-out", "sub"], "--json-out sub is a folder"),
    (["calc", "--json-out", "missing/x.json"], "does not exist"),
    (["calc", "--json-out", "/proc/x.json"], "not writable"),
    (["calc", "--plot", "/proc/plots"], "not writable"),
    (["calc", "--model", "config-list.json"], "must hold a JSON object, got list"),
    (["calc", "--model", "config-missing.json"], "lacks the size field vocab_size"),
    (["calc", "--model", "config-zero-heads.json"], "num_attention_heads must be an int >= 1, got 0"),
    (["calc", "--context", "0"], "context must be > 0"),
    (["calc", "--devices", "0"], "devices must be >= 1"),
    (["calc", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["calc", "--tp", "5"], "cannot split llama-3-405b: .* only for N in 1, 2, 4, 8"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(argv, message, workdir, monkeypatch, capsys):
    before = snapshot(workdir)
    code, out, err = invoke(argv, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err + out
    assert snapshot(workdir) == before, "a failed command changed or left files"


def test_invalid_utf8_argument(workdir, monkeypatch, capsys):
    bad = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # what Python makes of a Latin-1 byte in argv
    code, _, err = invoke(["generate", bad, *TINY], monkeypatch, capsys)
    assert code == 2 and err.strip() == "error: argument 2 ('caf?') is not valid UTF-8", err


def test_an_unexpected_exception_is_one_line_and_debug_shows_it(workdir, monkeypatch, capsys):
    from stagewise.engine.llm import LLM

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(LLM, "stream", broken)
    code, _, err = invoke(["generate", "hi", *TINY], monkeypatch, capsys)
    assert code == 1 and "Traceback" not in err
    assert err.strip() == "error: unexpected RuntimeError: boom (rerun with --debug for the traceback)"
    monkeypatch.setattr(sys, "argv", ["stagewise", "--debug", "generate", "hi", *TINY])
    with pytest.raises(RuntimeError, match="boom"):
        cli.main()


def test_a_result_of_the_same_settings_is_replaced_and_overwrite_replaces_any(workdir, monkeypatch, capsys):
    args = ["bench", "modes", *Q, "--prompt-tokens", "6", "--output-lengths", "2,3", "--repeats", "1", "--modes", "kv"]
    assert invoke([*args, "--overwrite"], monkeypatch, capsys)[0] == 0
    first = json.loads((workdir / "results" / "modes.json").read_text())
    assert first["settings"]["prompt_tokens"] == 6
    assert invoke(args, monkeypatch, capsys)[0] == 0  # same settings: a rerun replaces it
    assert not [p for p in (workdir / "results").iterdir() if ".tmp-" in p.name]


def test_quick_runs_go_to_their_own_folder(workdir, monkeypatch, capsys):
    from stagewise.bench.harness.machine import machine_tag

    published = workdir / "benchmarks" / "results" / machine_tag()
    published.mkdir(parents=True)
    (published / "modes.json").write_text(OLD)
    args = ["bench", "modes", "--quick", *TINY, "--output-lengths", "2,3", "--modes", "kv,paged"]
    code, _, err = invoke(args, monkeypatch, capsys)
    assert code == 0, err
    assert (published / "modes.json").read_text() == OLD
    assert json.loads((published / "quick" / "modes.json").read_text())["settings"]["model"] == "tiny"


def test_a_quick_run_with_other_settings_goes_to_a_settings_named_file(workdir, monkeypatch, capsys):
    """A quick run is a smoke test: other settings than the quick result's are written beside it, not refused;
    the same settings find the same file again (a rerun replaces it)."""
    from stagewise.bench.harness.machine import machine_tag

    quick = workdir / "benchmarks" / "results" / machine_tag() / "quick"
    quick.mkdir(parents=True)
    (quick / "modes.json").write_text(json.dumps({"settings": {"model": "smollm2-135m"}}))
    args = ["bench", "modes", "--quick", *TINY, "--output-lengths", "2", "--modes", "kv"]
    code, out, err = invoke(args, monkeypatch, capsys)
    assert code == 0, err
    named = [p for p in quick.glob("modes-*.json")]
    assert len(named) == 1 and json.loads(named[0].read_text())["settings"]["model"] == "tiny"
    assert named[0].with_suffix(".png").exists() and named[0].name in " ".join(out.split())
    assert json.loads((quick / "modes.json").read_text())["settings"] == {"model": "smollm2-135m"}
    assert invoke(args, monkeypatch, capsys)[0] == 0
    assert [p.name for p in quick.glob("modes-*.json")] == [named[0].name]
