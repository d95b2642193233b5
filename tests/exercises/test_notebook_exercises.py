"""The notebooks' exercises: every notebook ends with Takeaways and Exercises, every check works both ways.

Each notebook's Exercises section has at least two check cells, `check("NN.name", my_fn)`
(stagewise.exercises). The solved functions in notebooks/solutions/nbNN.py must pass every
check of their notebook; wrong answers (a generic perturbation of each solution, and a few
plausible student bugs) must fail; stubs must report "not yet" and never raise. Finally, no
teaching text may type a number the code computes (the list of numbers that drifted before).
"""

import importlib.util
import re
from pathlib import Path

import jupytext
import pytest
import torch
import torch.nn.functional as F

from stagewise.exercises import CHECKS, result
from stagewise.kv.block_manager import block_digest
from stagewise.stages.ffn import silu_and_mul_naive
from tests.test_notebooks import EXPECTED

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHECK_CALL = re.compile(r"""^check\(\s*["'](\d\d[a-z]?\.\w+)["']""", re.M)


CAPSTONE = "16_capstone"  # its Exercises re-run the checks of the parts it assembles, from other notebooks


def number(name: str) -> str:
    """A notebook's number, which prefixes its checks and names its solutions: '12a_triton_kernels' -> '12a'."""
    return name.split("_")[0]


def cells(name: str):
    return jupytext.read(NOTEBOOKS / f"{name}.py").cells


def exercise_checks(name: str) -> list[str]:
    """Check names called in the code cells after the notebook's '## Exercises' heading."""
    nb = cells(name)
    heads = [i for i, c in enumerate(nb) if c.cell_type == "markdown" and re.search(r"^## Exercises\b", c.source, re.M)]
    assert heads, f"{name}: no '## Exercises' section"
    return [m for c in nb[heads[-1] :] if c.cell_type == "code" for m in CHECK_CALL.findall(c.source)]


def solutions(name: str) -> dict:
    path = NOTEBOOKS / "solutions" / f"nb{number(name)}.py"
    assert path.is_file(), f"{name}: no solutions file {path.name}"
    spec = importlib.util.spec_from_file_location(f"solutions_nb{number(name)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOLUTIONS


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_closes_with_takeaways_then_exercises(name):
    markdown = [c.source for c in cells(name) if c.cell_type == "markdown"]
    headings = [line for source in markdown for line in source.splitlines() if line.startswith("## ")]
    assert headings[-2:] == ["## Takeaways", "## Exercises"], f"{name} ends with {headings[-2:]}"
    checks = exercise_checks(name)
    assert len(checks) >= 2, f"{name}: {len(checks)} check cells in Exercises, want at least 2"
    own = [c for c in checks if name == CAPSTONE or c.startswith(number(name) + ".")]  # the capstone re-checks parts
    assert own == checks and all(c in CHECKS for c in checks), f"{name}: unknown checks {checks}"


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != CAPSTONE])  # its parts: tests/exercises/test_capstone.py
def test_solutions_pass_every_check_of_their_notebook(name):
    solved = solutions(name)
    assert sorted(solved) == sorted(exercise_checks(name)), f"{name}: solutions and check cells differ"
    for check_name, fn in solved.items():
        outcome = result(check_name, fn)
        assert outcome.passed, outcome.line()


def perturbed(value):
    """A wrong answer next to a right one: one element or number changed."""
    if isinstance(value, torch.Tensor):
        wrong = value.clone()
        flat = wrong.view(-1)
        flat[0] += 1 if not wrong.is_floating_point() else 0.5 + flat.abs().max()
        return wrong
    if isinstance(value, tuple):
        return (perturbed(value[0]), *value[1:])
    if isinstance(value, list):
        return [perturbed(value[0]), *value[1:]]
    if isinstance(value, str):
        return value + "#"
    return value + 1 if isinstance(value, int) else value * 1.01 + 1


# 12a's checks take a Triton kernel, not a function whose result could be perturbed: their wrong
# answers are wrong kernels (tests/exercises/test_kernel_checks.py). The capstone's run a whole
# engine on parts from my_parts.py: its wrong answers are wrong parts (test_capstone.py)
KERNEL_CHECKS = {name for name in CHECKS if name.startswith("12a.")}
CAPSTONE_CHECKS = {name for name in CHECKS if name.startswith("16.")}


@pytest.mark.parametrize("check_name", sorted(set(CHECKS) - KERNEL_CHECKS - CAPSTONE_CHECKS))
def test_a_wrong_answer_fails(check_name):
    solved = solutions(next(n for n in EXPECTED if number(n) == check_name.split(".")[0]))[check_name]
    outcome = result(check_name, lambda *args, **kwargs: perturbed(solved(*args, **kwargs)))
    assert outcome.status == "fail", outcome.line()


def _attention_without_mask(q, k, v, scale):
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))  # [L, H, d]
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, kk) * scale, dim=-1)  # [H, L, L], every key visible
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _attention_on_new_key_only(cache, layer, q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    return v.repeat_interleave(group, dim=1)  # softmax over one key is 1: forgot to append to the cache


def _allocate_ignoring_owned(free_queue, ref_counts, row, num_tokens, block_size):
    need = -(-num_tokens // block_size)  # forgets the blocks the row already holds
    if need > len(free_queue):
        return False
    for _ in range(need):
        row.append(free_queue.popleft())
        ref_counts[row[-1]] = 1
    return row


def _free_head_first(free_queue, ref_counts, row):
    returned = []
    for block in row:  # head first: the shared prefix blocks come back before the private tail
        ref_counts[block] -= 1
        if ref_counts[block] == 0:
            free_queue.append(block)
            returned.append(block)
    return returned


def _prefix_covering_the_last_token(token_ids, block_size, cached):
    hits, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):  # every full block
        parent = block_digest(parent, token_ids[start : start + block_size])
        if parent not in cached:
            break
        hits.append(cached[parent])
    return hits


def _schedule_admitting_after_preemption(running, waiting, budget, max_num_seqs, allocate, free):
    scheduled, i = [], 0
    while i < len(running) and budget > 0:
        seq, n = running[i], min(running[i].num_tokens - running[i].num_computed_tokens, budget)
        while not allocate(seq, n):
            victim = running.pop()
            free(victim)
            victim.num_computed_tokens = 0
            waiting.appendleft(victim)
            if victim is seq:
                break
        if seq not in running:
            break
        scheduled.append((seq.request_id, n))
        budget, i = budget - n, i + 1
    while waiting and len(running) < max_num_seqs and budget > 0:  # admits even after a preemption
        seq = waiting[0]
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not allocate(seq, n):
            break
        running.append(waiting.popleft())
        scheduled.append((seq.request_id, n))
        budget -= n
    return scheduled


def _combine_normalized_splits(parts):
    """Each split's own output acc / l first, then weighted by its share: NaN for an empty split."""
    top = torch.stack([m for m, _, _ in parts]).max()
    weights = [total * torch.exp(m - top) for m, total, _ in parts]
    return sum(acc / total * w for (_, total, acc), w in zip(parts, weights)) / sum(weights)


def _combine_without_rescale(parts):
    """Adds the splits' sums as they are, each with its own max: right only for a single split."""
    return sum(acc for _, _, acc in parts) / sum(total for _, total, _ in parts)


PLAUSIBLE_BUGS = {
    "08.cached_attention": _attention_on_new_key_only,
    "09.allocate": _allocate_ignoring_owned,
    "09.free": _free_head_first,
    "09.cached_prefix": _prefix_covering_the_last_token,
    "10.schedule_step": _schedule_admitting_after_preemption,
    "02.rmsnorm": lambda x, w, eps: w * x / x.pow(2).mean(-1, keepdim=True).sqrt(),  # forgot eps
    "07.top_k": lambda p, k: (lambda kept: kept / kept.sum(-1, keepdim=True))(
        torch.zeros_like(p).scatter(-1, p.topk(k).indices, p.gather(-1, p.topk(k).indices))
    ),  # torch.topk drops ties with the k-th token
    "05.causal_attention": _attention_without_mask,  # no causal mask
    "09.slot_mapping": lambda block_ids, positions, block_size: list(positions),  # ignores the block table
    "10.static_rows": lambda p, o, seats: (sum(a + b - 1 for a, b in zip(p, o)), 0),  # as if there were no padding
    "03.kv_bytes_per_token": lambda cfg, b: cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * b,  # K only
    "13.decode_allreduces": lambda cfg, batch, b: (batch * cfg.hidden_size * b, 2 * cfg.num_layers),  # no embedding
    "15.greedy_accept": lambda drafts, p: [*drafts, int(p[-1].argmax())],  # keeps every guess
    "15.rejection_step": lambda p, q, x, u, e: (
        (True, x)  # forgets q: accepts when u < p(x)
        if u < p[x]
        else (False, int(torch.where(p > 0, p / e, -1.0).argmax()))
    ),  # and redraws from p, not p - q
    "17.key_splits": lambda n, programs: [  # a split per program: the classic split-KV count
        (s, min(s + -(-n // programs), n)) for s in range(0, n, -(-n // programs))
    ],
    "17.combine_splits": _combine_normalized_splits,
    "13.valid_tp_sizes": lambda cfg: [  # KV heads must divide: forgets that N may replicate them
        n
        for n in range(1, cfg.num_heads + 1)
        if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0 and cfg.intermediate_size % n == 0
    ],
}


@pytest.mark.parametrize("check_name", sorted(PLAUSIBLE_BUGS))
def test_a_plausible_bug_fails(check_name):
    outcome = result(check_name, PLAUSIBLE_BUGS[check_name])
    assert outcome.status == "fail", outcome.line()


def _online_step_of_one_tile(m, l, acc, scores, values):  # noqa: E741
    """A full softmax of the tile it is handed, the running state ignored."""
    m_tile = scores.max(dim=1).values
    p = torch.exp(scores - m_tile[:, None])
    return m_tile, p.sum(dim=1), p @ values


# Answers that are right on the easy inputs but skip what the exercise is about: each must FAIL
# with a readable line (the check's own message, never an exception from inside the package).
SKIPS_THE_POINT = [
    ("02.rmsnorm", lambda x, w, eps: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), "rounding steps"),
    (
        "02.rmsnorm",
        lambda x, w, eps: w.float() * x.float() / x.float().pow(2).mean(-1, keepdim=True).add(eps).sqrt(),
        "cast back",
    ),
    ("05.online_softmax", _online_step_of_one_tile, "after the tile of keys 8..15"),
    ("06.silu_and_mul", silu_and_mul_naive, "PyTorch's silu"),  # the stage's own function
    ("06.silu_and_mul", lambda gu: F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :], "PyTorch's silu"),
    ("06.silu_and_mul", lambda gu: torch.nn.SiLU()(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :], "silu"),
    (
        "06.silu_and_mul",
        lambda gu: torch.ops.aten.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :],
        "PyTorch's silu",
    ),  # fmt: skip
    (
        "06.silu_and_mul",
        lambda gu: F.silu(gu[:, : gu.shape[1] // 2].clone(), inplace=True) * gu[:, gu.shape[1] // 2 :],
        "PyTorch's silu",
    ),  # fmt: skip
    ("12b.softmax_exp2", lambda s, scale: torch.softmax(s * scale, dim=-1), "calls softmax"),
    ("12b.softmax_exp2", lambda s, scale: (s * scale).exp() / (s * scale).exp().sum(-1, keepdim=True), "calls exp"),
    (
        "09.slot_mapping",
        lambda block_ids, positions, size: [block_ids[p // size] * 2 * size + p for p in positions],
        "outside the pool",
    ),
    ("09.slot_mapping", lambda block_ids, positions, size: "slots", "want a list of ints"),
    (  # as many equal splits as 64-key chunks: the same for every batch, but not at 0, 64, 128, ...
        "17.key_splits",
        lambda n, programs: [(s, min(s + -(-n // -(-n // 64)), n)) for s in range(0, n, -(-n // -(-n // 64)))],
        "splits of 65 keys",
    ),
    ("17.combine_splits", _combine_without_rescale, "keys in"),
]


@pytest.mark.parametrize(("check_name", "wrong", "says"), SKIPS_THE_POINT)
def test_an_answer_that_skips_the_point_fails_readably(check_name, wrong, says):
    outcome = result(check_name, wrong)
    assert outcome.status == "fail" and says in outcome.message, outcome.line()


def test_stubs_report_not_yet_and_errors_are_caught():
    def raises(*args, **kwargs):
        raise NotImplementedError

    def ellipsis(*args, **kwargs): ...

    for check_name in set(CHECKS) - KERNEL_CHECKS:  # 12a's stubs are kernels: test_kernel_checks.py
        for stub in (raises, ellipsis):
            assert result(check_name, stub).status == "not yet", check_name
    assert result("02.rmsnorm", lambda *a: 1 / 0).status == "error"
    assert result("99.nothing", raises).status == "error"


# Numbers that were typed into the teaching text and drifted from the code, and notes about
# the machine the notebooks were written on. Notebooks compute and print such numbers instead.
TYPED = [
    r"~\s?300x",
    r"~\s?10,000x",
    r"0\.1 x 0\.39",
    r"\b7 MB\b",
    r"5\.5\s?\*?\s?d\b",
    r"about 4k tokens",
    r"20x slower",
    r"2-core",
    r"design target",
    r">= 80%",
    r"on a shared( or busy)? (CPU|machine)",
    r"test harness",
    r"committed device check",
    r"reference run",
]


@pytest.mark.parametrize("name", EXPECTED)
def test_no_typed_numbers_or_machine_notes_in_the_text(name):
    for cell in cells(name):
        if cell.cell_type != "markdown":
            continue
        for pattern in TYPED:
            found = re.search(pattern, cell.source)
            assert not found, f"{name}: markdown types {found.group(0)!r}; compute it in a cell"


def test_silu_written_out_any_way_passes():
    """06 forbids PyTorch's silu operator, not a formula: g * sigmoid(g) and g / (1 + exp(-g)) both pass."""
    for silu in (lambda g: g * torch.sigmoid(g), lambda g: g / (1 + torch.exp(-g))):
        outcome = result(
            "06.silu_and_mul", lambda gu, silu=silu: silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :]
        )
        assert outcome.passed, outcome.line()
