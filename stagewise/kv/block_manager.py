"""The block manager: which physical KV blocks each request owns, with prefix caching.

The paged KV cache is a pool of `num_blocks` blocks of `block_size` token
slots. A request owns a list of block ids (its row of the block table); token
at position p lives in block `blocks[p // block_size]`, slot offset
`p % block_size`. Blocks are handed out from a free queue and returned to it
when the request finishes or is preempted — no request needs contiguous
memory, and at most `block_size - 1` slots per request are wasted.

Prefix caching (on by default): when a block is full, its content is named by
a chained hash — hash(parent block's hash, the block's token ids) — so equal
hashes mean equal prefixes, and K/V of a full block depend only on that
prefix. A new request looks up the hashes of its prompt's full blocks, takes
the longest run of hits (reference count + 1, shared, never written again)
and starts with `num_computed_tokens` already past them. The last prompt
token is never taken from the cache: its logits are needed, so it must be
computed. A freed block keeps its hash and stays findable until the free
queue hands it out again (eviction, least recently freed first).

A block is named while its step is scheduled, before the forward pass writes
its K/V. If that pass never completes (an exception, Ctrl-C), the names given
in the step are wrong: `forget_names_of_step()` takes them back, so no later
request can reuse K/V that were never written.

The manager knows requests only by plain values — a request id, token ids,
token counts — so the KV layer does not depend on the engine's `Request`.
"""

from collections import deque
from dataclasses import dataclass, field

NO_HASH = None


@dataclass
class Block:
    block_id: int  # index into the cache's num_blocks axis
    ref_count: int = 0  # requests holding this block; 0 = in the free queue
    block_hash: int | None = NO_HASH  # chained hash once full and registered, else None


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the cache
    hit_tokens: int = 0  # of those, tokens whose K/V were reused

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class BlockManager:
    num_blocks: int  # blocks in the pool
    block_size: int  # token slots per block
    enable_prefix_caching: bool = True  # share full prompt blocks between requests
    blocks: list[Block] = field(init=False)
    free_queue: deque = field(init=False)  # block ids with ref_count 0, least recently freed first
    cached: dict = field(init=False)  # block hash -> block id, for registered full blocks
    req_blocks: dict = field(init=False)  # request id -> list of block ids (its block-table row)
    req_hashes: dict = field(
        init=False
    )  # request id -> chained hashes of its registered full blocks
    stats: PrefixCacheStats = field(init=False)
    num_allocated: int = field(init=False, default=0)  # blocks ever taken from the free queue
    num_freed: int = field(init=False, default=0)  # blocks ever returned to the free queue
    named_in_step: list = field(
        init=False
    )  # block ids named since the current step began scheduling

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = deque(range(self.num_blocks))
        self.cached, self.req_blocks, self.req_hashes = {}, {}, {}
        self.stats = PrefixCacheStats()
        self.named_in_step = []

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks a request owns, in logical order (its block-table row); a copy to keep."""
        return list(self.req_blocks.get(request_id, ()))

    # ---- prefix cache ----

    def block_hashes(self, token_ids: list[int], parent: int | None = None) -> list[int]:
        """Chained hashes of every full block of `token_ids`."""
        hashes = []
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (never covering the last token)."""
        if not self.enable_prefix_caching:
            return []
        usable = (
            len(token_ids) - 1
        ) // self.block_size  # full blocks strictly before the last token
        hits = []
        for h in self.block_hashes(token_ids[: usable * self.block_size]):
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        return hits

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's lookup (of its `num_tokens`) in the hit statistics."""
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_cached_tokens

    # ---- allocation ----

    def allocate(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_prefix: list[int] = (),
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of a request (after any cached prefix).

        `num_computed_tokens`: the request's tokens whose K/V are already stored in its blocks.
        Returns False, changing nothing, when the free queue is too short.
        """
        owned = self.req_blocks.get(request_id, [])
        reuse = [
            b for b in cached_prefix if self.blocks[b].ref_count == 0
        ]  # cached blocks now in the free queue
        computed = num_computed_tokens + len(cached_prefix) * self.block_size
        need = max(
            0, self.blocks_needed(computed + num_new_tokens) - len(owned) - len(cached_prefix)
        )
        if need + len(reuse) > self.num_free_blocks:
            return False
        for b in cached_prefix:  # take shared references on the hits
            if self.blocks[b].ref_count == 0:
                self.free_queue.remove(b)
            self.blocks[b].ref_count += 1
        new = [self._pop_free() for _ in range(need)]
        self.req_blocks[request_id] = [*owned, *cached_prefix, *new]
        if cached_prefix:
            self.req_hashes[request_id] = [self.blocks[b].block_hash for b in cached_prefix]
        return True

    def _pop_free(self) -> int:
        block_id = self.free_queue.popleft()
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its old content is about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = NO_HASH
        block.ref_count = 1
        self.num_allocated += 1
        return block_id

    def register_full_blocks(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int
    ) -> None:
        """Name a request's blocks full up to `num_computed_tokens`, so others can reuse them.

        `token_ids`: the request's tokens so far (prompt + outputs), whose prefix the blocks hold.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(request_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        tokens = token_ids
        parent = hashes[-1] if hashes else None
        start = len(hashes) * self.block_size
        new_hashes = self.block_hashes(tokens[start : num_full * self.block_size], parent)
        owned = self.req_blocks[request_id]
        for i, h in enumerate(new_hashes, start=len(hashes)):
            block = self.blocks[owned[i]]
            if h not in self.cached:  # an equal block registered earlier keeps the name
                block.block_hash = h
                self.cached[h] = block.block_id
                self.named_in_step.append(block.block_id)
            hashes.append(h)

    def begin_step(self) -> None:
        """A new step starts scheduling: the blocks named by the previous one hold their K/V."""
        self.named_in_step.clear()

    def forget_names_of_step(self) -> None:
        """The step's forward pass did not complete: unname the blocks it named.

        Their K/V may never have been written.
        """
        for block_id in self.named_in_step:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = NO_HASH
        self.named_in_step.clear()

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
            block = self.blocks[owned.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0, f"block {block.block_id} past the end is shared"
            self.free_queue.append(block.block_id)
            self.num_freed += 1
            freed += 1
        return freed

    def free(self, request_id: str) -> None:
        """Drop a request's references; blocks reaching 0 go to the free queue (tail first).

        One block at a time, each leaving the request's list as its reference is dropped: cut
        short (Ctrl-C), the request still lists exactly the blocks it holds, and calling
        `free` again finishes the job.
        """
        owned = self.req_blocks.get(request_id, [])
        while owned:
            block = self.blocks[owned.pop()]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue.append(block.block_id)
                self.num_freed += 1
        self.req_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
