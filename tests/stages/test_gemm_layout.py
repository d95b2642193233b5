"""The projections' torch tier (`stages/gemm_torch.py`: the CPU GEMM forms `tuning/gemm_forms.py`
measured), when they are measured (`models/prepare.py`), and the per-device weight layout
(`models/weights.py`)."""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.models import prepare
from stagewise.models.weights import random_weights
from stagewise.stages.gemm_torch import gemm
from stagewise.tuning import gemm_forms as gemm_module
from stagewise.tuning.gemm_forms import SMALL_M


def out_major(w_in_out: torch.Tensor) -> torch.Tensor:
    return w_in_out.t().contiguous().t()  # same [K, N] numbers, stored [N, K] row-major


@pytest.mark.parametrize("m", [0, 1, 2, 7, SMALL_M, SMALL_M + 1, 130])
@pytest.mark.parametrize("layout", ["in_major", "out_major"])
def test_gemm_is_the_matrix_product(m, layout):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 37, generator=gen)  # [M, K]
    w = torch.randn(37, 53, generator=gen)  # [K, N]
    w = out_major(w) if layout == "out_major" else w
    out = gemm(x, w)
    expected = (x.double() @ w.double()).float()  # [M, N] in float64, the exact product to ~1e-7
    assert out.shape == (m, 53) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gemm_on_a_sliced_input_row():
    """A row taken out of a bigger batch (a strided view) gives that row's product."""
    x = torch.randn(5, 64)
    w = out_major(torch.randn(64, 96))
    torch.testing.assert_close(gemm(x[2:3], w), gemm(x, w)[2:3], rtol=1e-5, atol=1e-5)


def test_cpu_weights_are_out_major_views_and_the_lm_head_is_the_table():
    config = PRESETS["tiny"]
    ref = random_weights(config, seed=0)  # as built: [in, out] tensors, lm_head a view of embed
    w = ref.to("cpu", torch.float32)
    layer = w.layers[0]
    for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
        t = getattr(layer, name)
        assert t.shape == getattr(ref.layers[0], name).shape  # the [in, out] shape the stages read
        assert t.t().is_contiguous(), f"{name} should be stored [out, in] row-major on the CPU"
        assert torch.equal(t, getattr(ref.layers[0], name))
    assert config.tie_word_embeddings and w.tied()
    assert w.lm_head.data_ptr() == w.embed.data_ptr() and torch.equal(w.lm_head, w.embed.t())
    table = w.embed.numel() * 4
    assert w.num_bytes() == w.decode_bytes() - w.embed.shape[1] * 4  # the table is counted once
    assert w.decode_bytes() > table  # and it is read by every decode step, as the LM head


def test_in_major_layout_when_not_on_cpu_meta_sized():
    """The GPU layout (contiguous [in, out], separate LM head) is what `to` gives off the CPU."""
    w = random_weights(PRESETS["tiny"], seed=0).to("meta", torch.bfloat16)
    assert w.layers[0].w_qkv.is_contiguous() and w.lm_head.is_contiguous()
    assert not w.tied()


@pytest.mark.parametrize("n", [24, 3 * gemm_module.BLOCK_N])  # not a whole number of blocks, and three blocks
@pytest.mark.parametrize("m", [1, 2, 5, SMALL_M])
def test_every_cpu_form_is_the_same_product(m, n):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 40, generator=gen)
    w = out_major(torch.randn(40, n, generator=gen))
    expected = (x.double() @ w.double()).float()
    for name, form in gemm_module.FORM_FNS.items():
        out = form(x, w)
        assert out.shape == (m, n) and out.is_contiguous(), name
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(form(x[1:], w), expected[1:], rtol=1e-5, atol=1e-5, msg=name)  # a strided row view


def test_the_blocked_form_multiplies_each_block_of_columns_by_itself():
    """Column block j of the result comes from column block j of the weight, nowhere else."""
    bn = gemm_module.BLOCK_N
    x = torch.randn(3, 16)
    w = torch.zeros(16, 4 * bn)
    w[:, 2 * bn : 3 * bn] = torch.randn(16, bn)  # only block 2 is non-zero
    out = gemm_module.gemm_blocked(x, out_major(w))
    assert torch.count_nonzero(out[:, : 2 * bn]) == 0 and torch.count_nonzero(out[:, 3 * bn :]) == 0
    torch.testing.assert_close(out[:, 2 * bn : 3 * bn], x @ w[:, 2 * bn : 3 * bn], rtol=1e-5, atol=1e-5)


BUCKET_EDGES = [(1, "decode"), (3, "decode"), (4, "small batch"), (12, "small batch"), (13, "batch"), (64, "batch")]


@pytest.mark.parametrize(("m", "name"), BUCKET_EDGES)
def test_buckets(m, name):
    assert gemm_module.bucket(m) == name


def test_calibration_measures_every_form_and_gemm_follows_its_choice(monkeypatch):
    monkeypatch.setattr(gemm_module, "CPU_FORMS", gemm_module.CpuForms())
    weights = [out_major(torch.randn(64, 96)) for _ in range(4)] + [torch.randn(64, 96)]  # the last: not out-major
    forms = gemm_module.calibrate(weights, passes=1)
    assert forms is gemm_module.CPU_FORMS
    assert set(forms.measured_ms) == set(gemm_module.BUCKET_M)
    for bucket, times in forms.measured_ms.items():
        assert set(times) == set(gemm_module.FORMS) and all(t > 0 for t in times.values())
        assert forms.chosen[bucket] == min(times, key=times.get)  # the faster one
    for bucket, times in forms.measured_variant_ms.items():  # the rows as they are: their own choice
        assert set(times) == set(gemm_module.FORMS) and forms.chosen_variant[bucket] == min(times, key=times.get)
    assert "measured" in forms.describe()
    assert forms.agreeing == gemm_module.FORMS  # this CPU's BLAS: every padded form gives plain's bits
    calls = []
    monkeypatch.setitem(gemm_module.FORM_FNS, "transposed", lambda x, w: calls.append(("t", x.shape[0])) or x @ w)
    monkeypatch.setitem(gemm_module.FORM_FNS, "blocked", lambda x, w: calls.append(("b", x.shape[0])) or x @ w)
    forms.chosen = {"decode": "transposed", "small batch": "blocked", "batch": "plain"}
    forms.chosen_variant = {"decode": "transposed", "small batch": "blocked", "batch": "plain"}
    x, w = torch.randn(1, 64), weights[0]
    gemm(x, w)
    gemm(torch.randn(7, 64), w)
    gemm(torch.randn(20, 64), w)
    gemm(x, weights[-1])  # a row-major [K, N] weight: always plain
    gemm(torch.randn(SMALL_M + 1, 64), w)  # beyond the small-M range: always plain
    assert calls == [("t", 16), ("b", 8)]  # batch-invariant: padded to 16 columns, to 4-row multiples
    calls.clear()
    gemm(x, w, batch_invariant=False)
    gemm(torch.randn(7, 64), w, batch_invariant=False)
    assert calls == [("t", 1), ("b", 7)]  # the rows as they are
    calls.clear()
    forms.agreeing = ("plain",)  # a BLAS whose padded forms disagreed: the invariant tier keeps plain
    gemm(x, w)
    assert calls == []


def test_a_big_cpu_model_calibrates_once_per_process(monkeypatch):
    from stagewise.engine.llm import LLM

    monkeypatch.setattr(gemm_module, "CPU_FORMS", gemm_module.CpuForms())
    monkeypatch.setattr(prepare, "CALIBRATE_BYTES", 0)  # make `tiny` count as big
    LLM("tiny", backend="naive")
    assert not gemm_module.CPU_FORMS.measured_ms, "the textbook tier has nothing to calibrate"
    LLM("tiny", backend="torch", stage_backends={"ffn": "naive"})
    assert not gemm_module.CPU_FORMS.measured_ms, "only when every projection runs the torch tier"
    llm = LLM("tiny")  # the default tier: torch
    assert gemm_module.CPU_FORMS.measured_ms, "a CPU model with torch-tier projections calibrates"
    first = gemm_module.CPU_FORMS.measured_ms
    prepare.calibrate_for(llm.loaded.weights, llm.ops.backends)
    assert gemm_module.CPU_FORMS.measured_ms is first  # once per process


def test_every_form_gives_the_engine_the_same_greedy_tokens(tiny, monkeypatch):
    """A paged run on `tiny` with each form chosen for every bucket: decode steps of 1 to 6 rows, same tokens,
    and with the rows padded (batch-invariant, the default) the same logits, bit for bit.

    `tiny`'s gate_up (512 columns) and LM head (512) are whole blocks of 64; its 160-, 96-column weights
    take the blocked form's plain fallback.
    """
    from stagewise.engine.llm import LLM
    from stagewise.sampling_params import SamplingParams

    prompts = ["one", "two words", "three words here", "a b c d", "e f g h i", "so many words in this one"]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(len(prompts))
    ]
    tokens, logprobs = {}, {}
    for form in gemm_module.FORMS:
        forms = gemm_module.CpuForms(chosen=dict.fromkeys(gemm_module.BUCKET_M, form), agreeing=gemm_module.FORMS)
        monkeypatch.setattr(gemm_module, "CPU_FORMS", forms)
        calls: list[int] = []
        real = gemm_module.FORM_FNS[form]
        counted = lambda x, w, real=real, calls=calls: calls.append(x.shape[0]) or real(x, w)  # noqa: E731
        monkeypatch.setitem(gemm_module.FORM_FNS, form, counted)
        outs = LLM(tiny, backend="torch", mode="paged").generate(prompts, params)
        tokens[form] = [o.token_ids for o in outs]
        logprobs[form] = [o.logprobs.values for o in outs]
        multiple = gemm_module.COLUMN_MULTIPLE if form == "transposed" else gemm_module.ROW_MULTIPLE
        assert calls and all(m % multiple == 0 for m in calls), f"{form}: unpadded calls {sorted(set(calls))}"
    assert tokens["blocked"] == tokens["plain"] and tokens["transposed"] == tokens["plain"]
    for form in ("blocked", "transposed"):
        assert all(torch.equal(a, b) for a, b in zip(logprobs[form], logprobs["plain"])), form


def test_a_big_model_calibrates_on_its_first_layers(tiny):
    """Past the sample budget, calibration streams whole layers up to that size, not every weight."""
    weights = tiny.weights
    layers = weights.layers
    first = [layers[0].w_qkv, layers[0].w_o, layers[0].w_gate_up, layers[0].w_down]
    layer_bytes = sum(t.numel() * t.element_size() for t in first)
    head_bytes = weights.lm_head.numel() * weights.lm_head.element_size()
    one_layer = prepare.calibration_sample(weights, layer_bytes)  # no room for the head
    assert [t.data_ptr() for t in one_layer] == [t.data_ptr() for t in first]
    sample = prepare.calibration_sample(weights, len(layers) * layer_bytes + head_bytes)
    assert len(sample) == 4 * len(layers) + 1 and sample[-1] is weights.lm_head


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "everything"], "invalid choice"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--threads", "two"], "invalid int value"),
        (["--json", "no/such/folder/forms.json"], "does not exist"),
    ],
)
def test_cpu_forms_bench_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    from stagewise.bench.scripts import cpu_forms

    with pytest.raises(SystemExit) as exit_info:
        cpu_forms.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
