"""The fused rejection-sampling kernel vs the textbook loop: the same tokens and counts, exactly.

Chain: the stage's worked example -> irregular batches (k_b varying and 0, all accepted, first
rejected, greedy and sampling rows mixed, point-mass and draft probabilities, ties, a vocabulary
over several blocks) -> the launcher's errors. Runs in the CPU interpreter (compiled on a GPU).
"""

import pytest
import torch

import stagewise.kernels.rejection_sampling as kernel
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.rejection_sampling import rejection_sample
from stagewise.stages.rejection_sampling import naive
from tests.stages.test_rejection_sampling import worked_example

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def assert_same(inputs: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    want_out, want_counts = naive(**inputs, **kwargs)
    got_out, got_counts = rejection_sample(**on_device(inputs), **kwargs)
    assert got_counts.cpu().tolist() == want_counts.tolist(), (got_counts, want_counts)
    assert got_out.cpu().tolist() == want_out.tolist(), (got_out, want_out)
    assert got_out.dtype == torch.int64 and got_counts.dtype == torch.int32
    return want_out, want_counts


def batch(
    ks: list[int],
    vocab: int,
    seed: int,
    greedy: list[bool],
    with_q: bool,
    accept: str = "mixed",  # "mixed", "all" (u = 0, q = p) or "none" (u near 1, q far above p)
    ties: bool = False,
) -> dict:
    """A random batch with per-sequence draft counts `ks` (the layout of the interface)."""
    g = torch.Generator().manual_seed(seed)
    num_seqs, num_draft = len(ks), sum(ks)
    cu = [0]
    for k in ks:
        cu.append(cu[-1] + k)
    logits = 2.0 * torch.randn(num_draft + num_seqs, vocab, generator=g)
    if ties:  # few distinct values: argmax ties and equal race scores happen
        logits = (logits * 2).round() / 2
    target = torch.softmax(logits, dim=-1)
    rows = torch.tensor([cu[b] + b + i for b in range(num_seqs) for i in range(ks[b])], dtype=torch.int64)
    q = torch.softmax(logits[rows] + 0.7 * torch.randn(num_draft, vocab, generator=g), dim=-1)
    uniform = torch.rand(num_draft, generator=g)
    if accept == "all":
        q, uniform = target[rows].clone(), torch.zeros(num_draft)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0] if num_draft else torch.zeros(0, dtype=torch.int64)
    greedy_rows = [b for b in range(num_seqs) if greedy[b]]
    for b in greedy_rows:  # greedy guesses: the argmax of p until a random position, then a miss
        stop = int(torch.randint(0, ks[b] + 1, (1,), generator=g)) if accept == "mixed" else ks[b]
        for i in range(ks[b]):
            best = int(target[cu[b] + b + i].argmax())
            drafts[cu[b] + i] = best if (i < stop or accept == "all") else (best + 1) % vocab
    if accept == "none":
        uniform = torch.full((num_draft,), 0.999999)
        for j in range(num_draft):
            q[j] = 0.0
            q[j, drafts[j]] = 1.0
    return {
        "draft_token_ids": drafts,
        "cu_num_draft_tokens": torch.tensor(cu, dtype=torch.int32),
        "draft_probs": q if with_q else None,
        "target_probs": target,
        "is_greedy": torch.tensor(greedy, dtype=torch.bool),
        "uniform": uniform,
        "exponential": torch.empty(num_seqs, vocab).exponential_(generator=g),
    }


@pytest.mark.parametrize("with_q", [False, True])
def test_worked_example(with_q):
    out, counts = assert_same(worked_example(draft_probs=with_q))
    assert counts.tolist() == [2, 2, 1]


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize(
    ("ks", "vocab", "seed"),
    [([3, 0, 1, 4, 2], 37, 0), ([0], 5, 1), ([0, 0, 0], 16, 2), ([1, 5, 0, 2, 3, 1, 0], 100, 3)],
)
def test_irregular_batches_match(ks, vocab, seed, with_q):
    greedy = [b % 3 == 1 for b in range(len(ks))]
    _, counts = assert_same(batch(ks, vocab, seed, greedy, with_q))
    assert all(1 <= c <= k + 1 for c, k in zip(counts.tolist(), ks))


@pytest.mark.parametrize("with_q", [False, True])
def test_noise_per_target_row_matches_and_the_draw_uses_the_stopping_row(with_q):
    """exponential [num_draft + num_seqs, V]: kernel = loop; and the loop's draw is the one a
    per-sequence noise holding each sequence's stopping row would give."""
    ks, vocab = [3, 0, 1, 4, 2, 2], 70
    inputs = batch(ks, vocab, 7, [b % 4 == 1 for b in range(len(ks))], with_q)
    num_rows = sum(ks) + len(ks)
    g = torch.Generator().manual_seed(8)
    inputs["exponential"] = torch.empty(num_rows, vocab).exponential_(generator=g)
    out, counts = assert_same(inputs)
    cu = inputs["cu_num_draft_tokens"].tolist()
    stop = [cu[b] + b + c - 1 for b, c in enumerate(counts.tolist())]  # the row each draw used
    per_seq = dict(inputs, exponential=inputs["exponential"][stop])  # [num_seqs, V]
    out_seq, counts_seq = naive(**per_seq)
    assert counts_seq.tolist() == counts.tolist() and out_seq.tolist() == out.tolist()
    assert sorted(set(counts.tolist())) != [1], "want some guesses kept"


def test_random_batches_match():
    """Twelve seeded batches: 1..6 sequences of 0..4 guesses, greedy and q chosen at random."""
    for seed in range(12):
        g = torch.Generator().manual_seed(100 + seed)
        num_seqs = int(torch.randint(1, 7, (1,), generator=g))
        ks = torch.randint(0, 5, (num_seqs,), generator=g).tolist()
        greedy = (torch.rand(num_seqs, generator=g) < 0.4).tolist()
        with_q = bool(seed % 2)
        assert_same(batch(ks, 3 + 7 * seed, seed, greedy, with_q, ties=seed % 3 == 0))


@pytest.mark.parametrize("with_q", [False, True])
def test_all_accepted_gives_the_bonus_token(with_q):
    ks = [2, 3, 1, 0]
    _, counts = assert_same(batch(ks, 29, 4, [False, True, False, True], with_q, accept="all"))
    assert counts.tolist() == [k + 1 for k in ks]


@pytest.mark.parametrize("with_q", [False, True])
def test_first_rejected(with_q):
    ks = [3, 2, 4]
    _, counts = assert_same(batch(ks, 23, 5, [False, False, True], with_q, accept="none"))
    assert counts.tolist()[:2] == [1, 1]


@pytest.mark.parametrize("with_q", [False, True])
def test_ties(with_q):
    assert_same(batch([2, 1, 3, 0], 40, 6, [True, False, True, False], with_q, ties=True))
    flat = {  # every probability equal: the argmax and the race with equal noise take index 0
        "draft_token_ids": torch.tensor([3]),
        "cu_num_draft_tokens": torch.tensor([0, 1, 1], dtype=torch.int32),
        "draft_probs": torch.full((1, 8), 0.125) if with_q else None,
        "target_probs": torch.full((3, 8), 0.125),
        "is_greedy": torch.tensor([True, False]),
        "uniform": torch.zeros(1),
        "exponential": torch.ones(2, 8),
    }
    out, counts = assert_same(flat)
    assert out.tolist() == [[0, 0], [0, 0]] and counts.tolist() == [1, 1]


def test_blocks_do_not_change_the_answer(monkeypatch):
    """A vocabulary over several blocks (and a ragged last one): ties across block borders."""
    inputs = batch([2, 0, 3], 70, 7, [True, False, False], True, ties=True)
    monkeypatch.setattr(kernel, "BLOCK", 16)
    assert_same(inputs)


def test_width_given_and_padding():
    out, counts = assert_same(batch([1, 0], 11, 8, [False, True], False), max_num_draft_tokens=3)
    assert out.shape == (2, 4)
    assert all(v == 0 for row, c in zip(out.tolist(), counts.tolist()) for v in row[c:])


def test_empty_batch():
    inputs = batch([], 9, 9, [], False)
    out, counts = rejection_sample(**on_device(inputs))
    assert out.shape == (0, 1) and counts.shape == (0,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target_probs": torch.rand(4, 6).t()}, "target_probs must have a contiguous last dimension"),
        ({"target_probs": torch.rand(6, 4).half()}, "target_probs has dtype float16, expected float32"),
        ({"draft_token_ids": torch.tensor([2, 1, 3], dtype=torch.int32)}, "draft_token_ids has dtype int32"),
        ({"cu_num_draft_tokens": torch.tensor([0, 2, 3], dtype=torch.int32)}, "has shape [3], expected [4]"),
        ({"uniform": torch.rand(6)[::2]}, "uniform must be contiguous"),
        ({"exponential": torch.rand(3, 5)}, "exponential has shape [3, 5], expected [3, 4]"),
        ({"draft_probs": torch.rand(2, 4)}, "draft_probs has shape [2, 4], expected [3, 4]"),
        ({"is_greedy": torch.tensor([[True, False, True]])}, "is_greedy must be 1-D"),
    ],
)
def test_bad_layouts_refused_in_one_line(change, message):
    inputs = on_device(worked_example() | change)
    with pytest.raises(KernelInputError) as info:
        rejection_sample(**inputs)
    text = str(info.value)
    assert text.startswith("rejection_sampling: ") and message in text and "\n" not in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a GPU matter")
def test_no_host_sync_when_the_width_is_given():
    inputs = on_device(batch([2, 3, 0], 300, 10, [False, True, False], True))
    rejection_sample(**inputs, max_num_draft_tokens=3)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rejection_sample(**inputs, max_num_draft_tokens=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
