"""The block manager: which physical KV blocks each request owns, shared prefixes, copy-on-write.

The paged KV cache is a pool of `num_blocks` blocks of `block_size` token
slots. A request owns a list of block ids (its row of the block table); token
at position p lives in block `blocks[p // block_size]`, slot offset
`p % block_size`. Blocks are handed out from a free queue and returned to it
when the request finishes or is preempted — no request needs contiguous
memory, and at most `block_size - 1` slots per request are wasted.

A block may be shared: its reference count says how many holders it has —
requests, and the radix prefix cache, which keeps blocks of its own. Sharing
comes from two places:

- the prefix cache (`prefix_cache`: "hash" by default, "radix" or "none"; the
  one interface both designs answer is kv/prefix_cache.py). A waiting request
  is looked up (`match_prefix`), and a hit's blocks join its row with one more
  reference each: it starts with `num_computed_tokens` already past them;
- parallel sampling (`share_prefix`): the n samples of one prompt share the
  blocks of the first sample's prompt.

Copy-on-write keeps sharing safe: a request never writes into a block that
another holder still holds. When `allocate` sees that the new tokens land in a
shared block — a radix hit that ended inside it, a sample's share of the
prompt's last block — the request gets a fresh block instead, and the copy
(source block -> fresh block) is listed in `copies`. The step that writes
those tokens makes the copies first, layer by layer, before it stores any K/V
(kv/paged.py), so a copy reads the source as it was before the step.

Memory is accounted in blocks everywhere: a request's row, the free queue,
the blocks a cache keeps. When the free queue runs short, the prefix cache
gives blocks back first (`evict`), and only then does the scheduler preempt.

The manager knows requests only by plain values — a request id, token ids,
token counts — so the KV layer does not depend on the engine's `Request`.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from stagewise.kv.hash_cache import NO_HASH, HashPrefixCache, Parent, block_digest
from stagewise.kv.prefix_cache import NO_HIT, PrefixCache, PrefixHit, check_prefix_cache
from stagewise.kv.radix_cache import RadixCache

__all__ = ["Block", "BlockManager", "PrefixCacheStats", "block_digest", "NO_HIT", "PrefixHit"]

CACHES = {"hash": HashPrefixCache, "radix": RadixCache, "none": PrefixCache}


@dataclass
class Block:
    block_id: int  # index into the cache's num_blocks axis
    ref_count: int = 0  # holders (requests, the radix cache); 0 = in the free queue
    block_hash: bytes | None = NO_HASH  # hash cache: chained digest once full and named, else None
    token_ids: tuple = ()  # hash cache: the token ids it holds, stored when named
    parent: Parent = None  # hash cache: the block holding the prefix before it, when named
    generation: int = 0  # times handed out by the free queue: a parent reference names one content


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the cache
    hit_tokens: int = 0  # of those, tokens whose K/V were reused
    forked_tokens: int = 0  # tokens parallel samples took from their first sample's prompt
    lookups: int = 0  # match_prefix calls
    lookup_seconds: float = 0.0  # time spent in them (hashing, or walking the tree)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class BlockManager:
    num_blocks: int  # blocks in the pool
    block_size: int  # token slots per block
    enable_prefix_caching: bool = True  # False: no prefix cache, whatever `prefix_cache` says
    prefix_cache: str = "hash"  # the prefix cache's design: "hash", "radix" or "none"
    blocks: list[Block] = field(init=False)
    free_queue: deque = field(init=False)  # block ids with ref_count 0, least recently freed first
    req_blocks: dict = field(init=False)  # request id -> list of block ids (its block-table row)
    prefixes: PrefixCache = field(init=False)  # the prefix cache (kv/prefix_cache.py)
    stats: PrefixCacheStats = field(init=False)
    num_allocated: int = field(init=False, default=0)  # blocks ever taken from the free queue
    num_freed: int = field(init=False, default=0)  # blocks ever returned to the free queue
    copies: dict = field(init=False)  # this step's copy-on-write: destination -> source block

    def __post_init__(self) -> None:
        kind = check_prefix_cache(self.prefix_cache) if self.enable_prefix_caching else "none"
        self.prefix_cache = kind
        self.enable_prefix_caching = kind != "none"
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = deque(range(self.num_blocks))
        self.req_blocks = {}
        self.prefixes = CACHES[kind](self)
        self.stats = PrefixCacheStats()
        self.copies = {}

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a holder: requests' blocks and those the radix cache keeps."""
        return self.num_blocks - len(self.free_queue)

    def num_held_blocks(self) -> int:
        """Blocks some request holds (a block shared by several counts once)."""
        return len({b for row in self.req_blocks.values() for b in row})

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks a request owns, in logical order (its block-table row); a copy to keep."""
        return list(self.req_blocks.get(request_id, ()))

    @property
    def cached(self) -> dict:
        """The hash cache's names (digest -> block id); empty for the other designs."""
        return getattr(self.prefixes, "cached", {})

    def block_hashes(self, token_ids: list[int], parent: bytes | None = None) -> list[bytes]:
        """Chained digests of every full block of `token_ids` (the hash cache's names)."""
        return HashPrefixCache(self).block_hashes(token_ids, parent)

    # ---- sharing: the prefix cache and parallel samples ----

    def match_prefix(self, token_ids: list[int]) -> PrefixHit:
        """The longest cached prefix of `token_ids`, never covering its last token."""
        start = time.perf_counter()
        hit = self.prefixes.match(token_ids)
        self.stats.lookups += 1
        self.stats.lookup_seconds += time.perf_counter() - start
        return hit

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of `match_prefix` (the hash cache: its full blocks)."""
        return list(self.match_prefix(token_ids).blocks)

    def share_prefix(self, request_id: str, num_tokens: int) -> PrefixHit:
        """The blocks holding a running request's first `num_tokens` tokens, to share (a fork)."""
        owned = self.req_blocks.get(request_id, [])
        return PrefixHit(tuple(owned[: self.blocks_needed(num_tokens)]), num_tokens, "fork")

    def record_lookup(self, num_tokens: int, hit: PrefixHit | int) -> None:
        """Count one admitted request's lookup (of its `num_tokens`) in the statistics."""
        num_hit = hit if isinstance(hit, int) else hit.num_tokens
        if isinstance(hit, PrefixHit) and hit.origin == "fork":
            self.stats.forked_tokens += num_hit
        elif self.enable_prefix_caching:
            self.stats.queried_tokens += num_tokens
            self.stats.hit_tokens += num_hit

    # ---- the pool ----

    def hold(self, block_id: int) -> None:
        """One more holder; a block taken from the free queue keeps its content."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.remove(block_id)
        block.ref_count += 1

    def release(self, block_id: int) -> bool:
        """One holder fewer; -> True when that was the last (the block is free again)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue.append(block_id)
            self.num_freed += 1
            return True
        return False

    def _pop_free(self) -> int:
        block_id = self.free_queue.popleft()
        block = self.blocks[block_id]
        self.prefixes.on_reuse(block_id)  # its old content is about to be overwritten
        block.generation += 1  # references to it as a parent named the old content
        block.ref_count = 1
        self.num_allocated += 1
        return block_id

    # ---- allocation ----

    def allocate(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_prefix: PrefixHit | list[int] = NO_HIT,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of a request (after any cached prefix).

        `num_computed_tokens`: the request's tokens whose K/V are already stored in its blocks.
        `cached_prefix`: a hit (`match_prefix`, `share_prefix`; a list of full block ids is read
        as a hash hit) that becomes the start of a new request's row. Returns False when the
        pool is short even after the prefix cache gave back what it could; nothing but those
        evictions changes then.
        """
        hit = cached_prefix
        if not isinstance(hit, PrefixHit):
            hit = PrefixHit(tuple(hit), len(hit) * self.block_size, "hash")
        owned = self.req_blocks.get(request_id, [])
        start = num_computed_tokens + hit.num_tokens  # the first position written
        end = start + num_new_tokens
        admitted = bool(hit.blocks) and hit.origin == self.prefix_cache
        if admitted:
            self.prefixes.admit(request_id, hit)  # radix: locks the hit's path against eviction
        want = self._blocks_wanted(owned, hit, start, end)
        if want > len(self.free_queue):
            self.prefixes.evict(want - len(self.free_queue))
            want = self._blocks_wanted(owned, hit, start, end)
        if want > len(self.free_queue):
            if admitted:
                self.prefixes.release(request_id)
            return False
        for b in hit.blocks:  # take shared references on the hits
            self.hold(b)
        row = [*owned, *hit.blocks]
        for j in self._written(row, start, end):
            if self.blocks[row[j]].ref_count > 1:  # someone else holds it: write into a copy
                row[j] = self._copy_on_write(row[j])
        row += [self._pop_free() for _ in range(self.blocks_needed(end) - len(row))]
        self.req_blocks[request_id] = row
        return True

    def _written(self, row: list[int], start: int, end: int) -> range:
        """Indices of the row's existing blocks that positions start .. end-1 write into."""
        if end <= start:
            return range(0)
        return range(start // self.block_size, min(len(row), self.blocks_needed(end)))

    def _blocks_wanted(self, owned: list[int], hit: PrefixHit, start: int, end: int) -> int:
        """Blocks `allocate` would take from the free queue: new ones, copies, free hits."""
        row = [*owned, *hit.blocks]
        new = max(0, self.blocks_needed(end) - len(row))
        hits = set(hit.blocks)
        copies = sum(
            self.blocks[row[j]].ref_count + (row[j] in hits) > 1
            for j in self._written(row, start, end)
        )
        free_hits = sum(self.blocks[b].ref_count == 0 for b in hit.blocks)  # the hash cache's
        return new + copies + free_hits

    def _copy_on_write(self, block_id: int) -> int:
        """A fresh block for a holder about to write into shared `block_id`; the copy is listed."""
        fresh = self._pop_free()
        self.release(block_id)
        # a copy made this step: its source
        self.copies[fresh] = self.copies.get(block_id, block_id)
        return fresh

    def register_full_blocks(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int
    ) -> None:
        """Make a request's first `num_computed_tokens` tokens findable by others (full blocks).

        `token_ids`: the request's tokens so far (prompt + outputs), whose prefix the blocks hold.
        Called as a step is scheduled, before its forward pass writes them.
        """
        if self.enable_prefix_caching:
            owned = self.req_blocks[request_id]
            self.prefixes.insert(request_id, token_ids, num_computed_tokens, owned, final=False)

    def begin_step(self) -> None:
        """A new step starts scheduling: the previous step's names hold their K/V, its copies
        were made."""
        self.prefixes.begin_step()
        self.copies = {}

    def forget_names_of_step(self) -> None:
        """The step's forward pass did not complete: what it named may never have been written,
        nor the copies it was to make."""
        self.prefixes.forget_step()
        self.copies = {}

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks that `num_tokens` tokens need; free the rest (-> how many).

        Speculative decoding wrote K/V for guesses the target rejected: the blocks past the
        request's new end hold nothing but those, were never named (only verified tokens are
        registered), and go back to the free queue, the last one first.
        """
        owned = self.req_blocks.get(request_id, [])
        keep = self.blocks_needed(num_tokens)
        freed = 0
        while len(owned) > keep:
            block_id = owned.pop()
            assert self.blocks[block_id].ref_count == 1, f"block {block_id} past the end is shared"
            self.release(block_id)
            freed += 1
        return freed

    def free(
        self, request_id: str, token_ids: list[int] | None = None, num_computed_tokens: int = 0
    ) -> None:
        """Drop a request's references; blocks reaching 0 go to the free queue (tail first).

        With `token_ids`, the prefix cache first keeps what the request computed (its first
        `num_computed_tokens` tokens): the radix cache inserts them, its generated tokens too.
        One block at a time, each leaving the request's list as its reference is dropped: cut
        short (Ctrl-C), the request still lists exactly the blocks it holds, and calling
        `free` again finishes the job.
        """
        owned = self.req_blocks.get(request_id, [])
        if token_ids is not None and owned and self.enable_prefix_caching:
            self.prefixes.insert(request_id, token_ids, num_computed_tokens, owned, final=True)
        while owned:
            self.release(owned.pop())
        self.req_blocks.pop(request_id, None)
        self.prefixes.release(request_id)
