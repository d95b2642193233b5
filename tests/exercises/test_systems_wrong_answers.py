"""The wrong answers students write for notebooks 09 and 10: each must FAIL its check.

Every wrong answer here is the solution with one rule broken (notebooks/solutions/nb09.py,
nb10.py), so the check can only catch it if its workload makes that rule decide something; the
checks count, and print, how often each rule did, and the last tests hold those counts above 0.
"""

from collections import Counter

import pytest

from stagewise.exercises import result
from stagewise.exercises.block_checks import ALLOCATE_RULES, LOOKUP_RULES, allocate_workload, lookup_cases
from stagewise.exercises.schedule_checks import RULES, check_schedule_step
from stagewise.kv.block_manager import block_digest
from tests.exercises.test_notebook_exercises import solutions

NB09, NB10 = solutions("09_paged_kv_cache"), solutions("10_continuous_batching")


def allocate_refusing_exact_fits(free_queue, ref_counts, row, num_tokens, block_size):
    need = -(-num_tokens // block_size) - len(row)
    if need >= len(free_queue):  # `>=` for `>`: refuses when the queue holds exactly what is needed
        return False
    for _ in range(max(need, 0)):
        row.append(free_queue.popleft())
        ref_counts[row[-1]] = 1
    return row


def allocate_from_the_back(free_queue, ref_counts, row, num_tokens, block_size):
    need = -(-num_tokens // block_size) - len(row)
    if need > len(free_queue):
        return False
    for _ in range(max(need, 0)):
        row.append(free_queue.pop())  # the most recently freed block, not the least
        ref_counts[row[-1]] = 1
    return row


def allocate_partly_then_refuse(free_queue, ref_counts, row, num_tokens, block_size):
    need = -(-num_tokens // block_size) - len(row)
    for _ in range(max(need, 0)):
        if not free_queue:
            return False  # took some blocks, then says "does not fit": changed the state
        row.append(free_queue.popleft())
        ref_counts[row[-1]] = 1
    return row


def free_leaving_the_row_full(free_queue, ref_counts, row):
    returned = []
    for block in reversed(row):
        ref_counts[block] -= 1
        if ref_counts[block] == 0:
            free_queue.append(block)
            returned.append(block)
    return returned  # forgets row.clear(): the request still lists blocks it no longer holds


def free_ignoring_shares(free_queue, ref_counts, row):
    returned = list(reversed(row))
    for block in returned:  # every block back to the queue, even one another request still holds
        ref_counts[block] = 0
        free_queue.append(block)
    row.clear()
    return returned


def free_to_the_front(free_queue, ref_counts, row):
    returned = []
    for block in reversed(row):
        ref_counts[block] -= 1
        if ref_counts[block] == 0:
            free_queue.appendleft(block)  # the front: the next allocation reuses it first
            returned.append(block)
    row.clear()
    return returned


def prefix_past_the_first_miss(token_ids, block_size, cached):
    usable = (len(token_ids) - 1) // block_size
    hits, parent = [], None
    for start in range(0, usable * block_size, block_size):
        parent = block_digest(parent, token_ids[start : start + block_size])
        if parent in cached:  # keeps looking after a miss
            hits.append(cached[parent])
    return hits


def prefix_without_the_chain(token_ids, block_size, cached):
    usable = (len(token_ids) - 1) // block_size
    hits = []
    for start in range(0, usable * block_size, block_size):
        h = block_digest(None, token_ids[start : start + block_size])  # names the block, not its prefix
        if h not in cached:
            break
        hits.append(cached[h])
    return hits


WRONG_09 = {
    "09.allocate": [allocate_refusing_exact_fits, allocate_from_the_back, allocate_partly_then_refuse],
    "09.free": [free_leaving_the_row_full, free_ignoring_shares, free_to_the_front],
    "09.cached_prefix": [prefix_past_the_first_miss, prefix_without_the_chain],
}


def scheduler(
    seats_check=lambda running, seats: len(running) < seats,
    admit_without_budget=False,
    decode_past_budget=False,
    skip_blocked_head=False,
    allocate_before_seats=False,
    victim_index=-1,
    victim_to_back=False,
    keep_computed=False,
):
    """The solution's schedule() with one rule broken (each keyword breaks one)."""

    def schedule(running, waiting, budget, max_num_seqs, allocate, free):
        scheduled, preempted, i = [], False, 0
        while i < len(running) and (budget > 0 or decode_past_budget):
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if decode_past_budget and n == 0:
                n = 1  # a decode is "only one token": scheduled past the budget
            while not allocate(seq, n):
                victim = running.pop(victim_index)
                free(victim)
                if not keep_computed:
                    victim.num_computed_tokens = 0
                waiting.append(victim) if victim_to_back else waiting.appendleft(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in running:
                break
            scheduled.append((seq.request_id, n))
            budget, i = budget - n, i + 1
        queue = list(waiting)
        while queue and not preempted and (budget > 0 or admit_without_budget):
            seq = queue[0]
            if allocate_before_seats:
                if not allocate(seq, min(seq.num_tokens - seq.num_computed_tokens, budget)):
                    break
            if not seats_check(running, max_num_seqs):
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not allocate(seq, n):
                if skip_blocked_head:
                    queue.pop(0)  # a smaller request behind may fit: let it jump the queue
                    continue
                break
            queue.pop(0)
            waiting.remove(seq)
            running.append(seq)
            scheduled.append((seq.request_id, n))
            budget -= n
        return scheduled

    return schedule


WRONG_10 = {
    "ignores max_num_seqs": scheduler(seats_check=lambda running, seats: True),
    "allows one more seat": scheduler(seats_check=lambda running, seats: len(running) <= seats),
    "decode tokens past the budget": scheduler(decode_past_budget=True),
    "a smaller request jumps the blocked head": scheduler(skip_blocked_head=True),
    "admits with no budget left": scheduler(admit_without_budget=True),
    "allocates before checking the seats": scheduler(allocate_before_seats=True),
    "preempts the oldest running request": scheduler(victim_index=0),
    "sends the preempted request to the back": scheduler(victim_to_back=True),
    "keeps the preempted request's computed tokens": scheduler(keep_computed=True),
}


@pytest.mark.parametrize(
    ("check_name", "wrong"), [(c, w) for c, ws in WRONG_09.items() for w in ws], ids=lambda x: getattr(x, "__name__", x)
)
def test_a_wrong_allocator_fails(check_name, wrong):
    outcome = result(check_name, wrong)
    assert outcome.status == "fail", outcome.line()


@pytest.mark.parametrize("name", sorted(WRONG_10))
def test_a_wrong_scheduler_fails(name):
    outcome = result("10.schedule_step", WRONG_10[name])
    assert outcome.status == "fail", f"{name}: {outcome.line()}"


def test_the_broken_scheduler_helper_is_the_solution_when_nothing_is_broken():
    assert result("10.schedule_step", scheduler()).passed  # so each failure above is its one broken rule


def test_every_rule_of_the_allocator_decides_something():
    counts = Counter(rule for *_, rule in allocate_workload())
    assert all(counts[rule] > 0 for rule in ALLOCATE_RULES), counts
    counts = Counter(rule for *_, rule in lookup_cases())
    assert all(counts[rule] > 0 for rule in LOOKUP_RULES), counts
    for name in ("09.allocate", "09.free", "09.cached_prefix"):
        outcome = result(name, NB09[name])
        assert outcome.passed and " 0," not in outcome.message and not outcome.message.endswith(" 0"), outcome.line()


def test_every_rule_of_the_scheduler_decides_something():
    summary = check_schedule_step(NB10["10.schedule_step"])
    for label in RULES.values():
        count = int(summary.split(f"{label} ")[1].split(",")[0])
        assert count > 0, summary
