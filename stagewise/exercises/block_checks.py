"""Checks for notebook 09's block allocator: allocate, free and the prefix-cache lookup.

Every call is made on a copy of a real `BlockManager`'s state, and the student's function must
make the decision the manager makes (which blocks, in which order, or "does not fit"). The
workloads are generated so that each rule of the exercise decides something, and each check
prints how often it did:

    allocate   exact fits (the queue holds exactly the blocks needed: granted), one block short
               (refused), rows that already hold enough, new rows and growing rows
    free       shared blocks that stay out of the queue, private blocks that go back, the row
               emptied
    lookup     hits, a miss that must stop the run although later blocks are still cached (a
               middle block's name removed), queries of a whole number of blocks whose last
               block is cached (it holds the last token: never reused)
"""

import copy
import random
from collections import Counter, deque

from stagewise.exercises.core import call, equal
from stagewise.kv.block_manager import BlockManager


def tally_line(counts: Counter, names: dict[str, str]) -> str:
    """'exact fits 7, one block short 5, ...' in the order `names` lists them."""
    return ", ".join(f"{label} {counts[key]}" for key, label in names.items())


def _state(bm: BlockManager, request_id: str):
    """A copy of what the student's functions work on: free queue, reference counts, a row."""
    return deque(bm.free_queue), [b.ref_count for b in bm.blocks], bm.block_ids(request_id)


def _same_state(bm: BlockManager, free_queue, ref_counts, where: str) -> None:
    equal(list(free_queue), list(bm.free_queue), f"{where}: the free queue afterwards")
    equal(list(ref_counts), [b.ref_count for b in bm.blocks], f"{where}: the reference counts afterwards")


# ---------------------------------------------------------------- allocate

ALLOCATE_RULES = {
    "exact": "exact fits",
    "short": "one block short",
    "refused": "refused (more short)",
    "owned": "fit in the blocks held",
    "new": "new rows",
    "grow": "growing rows",
}


def allocate_workload(seed: int = 9, calls: int = 70):
    """Yield (bm, request id, tokens held, tokens asked, rule) before each real `allocate`.

    Half of the asks are sized from the free queue: exactly the free blocks (an exact fit), one
    block more (refused by one), or what the row's last block still holds (no new block).
    """
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    held: dict[str, int] = {}  # request id -> tokens its blocks hold
    for op in range(calls):
        if held and (rng.random() < 0.2 or not bm.free_queue):
            rid = rng.choice(sorted(held))
            bm.free(rid)  # the real free: blocks return to the tail
            del held[rid]
            continue
        rid = rng.choice(sorted(held)) if held and rng.random() < 0.6 else f"r{op}"
        have, owned = held.get(rid, 0), len(bm.block_ids(rid))
        room = owned * bm.block_size - have  # slots left in the blocks the row holds
        shape = rng.choice(["exact", "short", "owned", "any", "any"])
        if shape == "owned" and room > 0:
            n = rng.randint(1, room)
        elif shape in ("exact", "short") and (bm.num_free_blocks or shape == "short"):
            blocks = bm.num_free_blocks + (shape == "short")  # new blocks to need
            n = room + (blocks - 1) * bm.block_size + rng.randint(1, bm.block_size)
        else:
            n = rng.randint(1, 24)
        need = bm.blocks_needed(have + n) - owned
        if need <= 0:
            rule = "owned"
        elif need == bm.num_free_blocks:
            rule = "exact"
        elif need == bm.num_free_blocks + 1:
            rule = "short"
        elif need > bm.num_free_blocks:
            rule = "refused"
        else:
            rule = "grow" if owned else "new"
        yield bm, rid, have, n, rule
        if bm.allocate(rid, have, n):
            held[rid] = have + n


def check_allocate(fn) -> str:
    """my_allocate(free_queue, ref_counts, row, num_tokens, block_size) -> the row, or False."""
    counts = Counter()
    for i, (bm, rid, have, n, rule) in enumerate(allocate_workload()):
        free_queue, ref_counts, row = _state(bm, rid)
        where = f"call {i}: {rid} holds {len(row)} blocks ({have} tokens), asks for {have + n} tokens"
        where += f" with {len(free_queue)} blocks free"
        got = call(fn, free_queue, ref_counts, row, have + n, bm.block_size)
        probe = copy.deepcopy(bm)
        fits = probe.allocate(rid, have, n)
        equal(got, probe.block_ids(rid) if fits else False, where)
        _same_state(probe, free_queue, ref_counts, where)
        equal(row, probe.block_ids(rid), f"{where}: the row afterwards")
        counts[rule] += 1
    return f"{sum(counts.values())} allocations agree with BlockManager.allocate: {tally_line(counts, ALLOCATE_RULES)}"


# ---------------------------------------------------------------- a trace with shared prefixes


def shared_prefix_trace(seed: int):
    """A block manager with prefix caching, requests sharing prompt beginnings; yields each step.

    Yields (bm, "admit", request id, prompt) after a request took its cached prefix and new
    blocks, and (bm, "free", request id, None) before a request is freed.
    """
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True)
    families = [[rng.randrange(30) for _ in range(24)] for _ in range(2)]
    live: list[str] = []
    for i in range(40):
        if live and (rng.random() < 0.35 or bm.num_free_blocks < 8):
            rid = live.pop(rng.randrange(len(live)))
            yield bm, "free", rid, None
            bm.free(rid)
            continue
        shared = rng.choice([0, 4, 8, 9, 12, 16])
        prompt = families[i % 2][:shared] + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
        hits = bm.find_cached_prefix(prompt)
        if not bm.allocate(f"r{i}", 0, len(prompt) - len(hits) * bm.block_size, cached_prefix=hits):
            continue
        bm.register_full_blocks(f"r{i}", prompt, len(prompt))
        live.append(f"r{i}")
        yield bm, "admit", f"r{i}", prompt


# ---------------------------------------------------------------- free

FREE_RULES = {"shared": "shared blocks kept", "returned": "blocks returned", "mixed": "rows of both kinds"}


def check_free(fn) -> str:
    """my_free(free_queue, ref_counts, row) -> the block ids that went back to the free queue."""
    counts, frees = Counter(), 0
    for bm, what, rid, _ in shared_prefix_trace(seed=10):
        if what != "free":
            continue
        free_queue, ref_counts, row = _state(bm, rid)
        held = list(row)
        kept = sum(bm.blocks[b].ref_count > 1 for b in held)
        before = len(bm.free_queue)
        where = f"free {frees}: {rid} holding blocks {held} (reference counts {[ref_counts[b] for b in held]})"
        got = call(fn, free_queue, ref_counts, row)
        probe = copy.deepcopy(bm)
        probe.free(rid)
        equal(got, list(probe.free_queue)[before:], f"{where}: blocks returned")
        _same_state(probe, free_queue, ref_counts, where)
        equal(row, [], f"{where}: the row afterwards (the request holds nothing now)")
        counts.update(shared=kept, returned=len(held) - kept, mixed=0 < kept < len(held))
        frees += 1
    return f"{frees} frees agree with BlockManager.free: {tally_line(counts, FREE_RULES)}"


# ---------------------------------------------------------------- the prefix-cache lookup

LOOKUP_RULES = {
    "hit": "with hits",
    "evicted": "stopped by an evicted middle block",
    "whole": "whole blocks (last block left out)",
    "miss": "no hit",
}


def lookup_cases(seed: int = 11):
    """Yield (query, cached dict, reference block ids, rule) along a real trace.

    Besides each admitted prompt (whole, cut to 8 and 9 tokens, lengthened), a query with at
    least three hits is asked again with its second block's name removed from `cached`, as if
    that block had been handed out, while the blocks after it keep theirs: the lookup must stop
    at the first miss whatever follows it.
    """
    for bm, what, _, prompt in shared_prefix_trace(seed):
        if what != "admit":
            continue
        for query in (prompt, prompt[:8], prompt[:9], prompt + [1, 2, 3]):  # 8: a block-multiple
            want, hashes = bm.find_cached_prefix(query), bm.block_hashes(query)
            whole = len(query) % bm.block_size == 0 and len(want) == len(hashes) - 1 and hashes[-1] in bm.cached
            yield query, dict(bm.cached), want, "whole" if whole else "hit" if want else "miss"
            if len(want) >= 3:
                evicted = copy.copy(bm)  # the same blocks, a copy of the hash cache's names
                evicted.prefixes = copy.copy(bm.prefixes)
                evicted.prefixes.pool, evicted.prefixes.cached = evicted, dict(bm.cached)
                del evicted.cached[hashes[1]]
                yield query, dict(evicted.cached), evicted.find_cached_prefix(query), "evicted"


def check_cached_prefix(fn) -> str:
    """my_cached_prefix(token_ids, block_size, cached) -> block ids of the longest cached prefix."""
    counts = Counter()
    for i, (query, cached, want, rule) in enumerate(lookup_cases()):
        got = call(fn, list(query), 4, dict(cached))
        where = f"lookup {i}: {len(query)} tokens {query[:12]}..."
        if rule == "evicted":
            where += " (its second block evicted, later blocks still cached)"
        equal(got, want, where)
        counts[rule] += 1
    total = sum(counts.values())
    return f"{total} lookups agree with BlockManager.find_cached_prefix: {tally_line(counts, LOOKUP_RULES)}"


CHECKS = {
    "09.allocate": check_allocate,
    "09.free": check_free,
    "09.cached_prefix": check_cached_prefix,
}
