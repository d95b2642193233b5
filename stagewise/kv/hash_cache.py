"""The hashed prefix cache (vLLM's): full blocks named by a chained digest, found by their name.

When a block is full, its content is named by a chained digest — SHA-256 of (the parent block's
digest, the block's token ids) — so the name covers the whole prefix, and K/V of a full block
depend only on that prefix. A new request looks up the digests of its prompt's full blocks,
takes the longest run of hits (reference count + 1, shared, never written again) and starts
with `num_computed_tokens` already past them. Only whole blocks are reused: a prefix that ends
inside a block shares nothing of that block. A freed block keeps its name and stays findable
until the free queue hands it out again (eviction, least recently freed first): the cache holds
no reference of its own.

A name is only where to look, never proof: two different prefixes could share a name (Python's
`hash()` of a tuple of ints is 64 bits, unsalted and easy to collide on purpose — one user's
prompt answered from another's cache, vLLM's CVE-2025-25183). So the digest is SHA-256, and
every hit is checked against what the block really holds: its own token ids and its parent (the
block holding the prefix before it, still holding it), both stored when the block is named. A
block whose check fails is a miss. With any digest at all — a constant included — no request
reads K/V computed for another prefix; a weak digest only costs hits.

A block is named while its step is scheduled, before the forward pass writes its K/V. If that
pass never completes (an exception, Ctrl-C), the names given in the step are wrong:
`forget_step()` takes them back, so no later request can reuse K/V that were never written.

The names live on the pool's blocks (`Block.block_hash`, `token_ids`, `parent`), where the view
and the tests read them.
"""

import hashlib
from array import array

from stagewise.kv.prefix_cache import PrefixCache, PrefixHit

NO_HASH = None
ROOT = bytes(32)  # the parent digest of a sequence's first block
# (block id, its generation) of the block holding the prefix before; None: a sequence's first block
Parent = tuple[int, int] | None


def block_digest(parent: bytes | None, token_ids) -> bytes:
    """SHA-256 of (parent block's digest, this block's token ids): 32 bytes naming the prefix.

    `parent` is None for a sequence's first block. Token ids go in as 8-byte integers.
    """
    h = hashlib.sha256(parent or ROOT)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class HashPrefixCache(PrefixCache):
    kind = "hash"

    def __init__(self, pool):
        super().__init__(pool)
        self.cached: dict[bytes, int] = {}  # block digest -> block id, for named full blocks
        self.req_hashes: dict[str, list] = {}  # request id -> digests of its named full blocks
        # request id -> for each of those, (block id, generation) of a block holding that prefix
        self.req_holders: dict[str, list] = {}
        self.named_in_step: list[int] = []  # block ids named since the current step began

    def block_hashes(self, token_ids: list[int], parent: bytes | None = None) -> list[bytes]:
        """Chained digests of every full block of `token_ids`."""
        bs, hashes = self.pool.block_size, []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = block_digest(parent, token_ids[start : start + bs])
            hashes.append(parent)
        return hashes

    def _holds(self, block_id: int, token_ids, parent: Parent) -> bool:
        """Does the named block hold exactly `token_ids` after the prefix `parent` holds?"""
        block = self.pool.blocks[block_id]
        return block.token_ids == tuple(token_ids) and block.parent == parent

    def _orphaned(self, block_id: int) -> bool:
        """Was the parent this named block was computed after handed out again since?"""
        parent = self.pool.blocks[block_id].parent
        return parent is not None and self.pool.blocks[parent[0]].generation != parent[1]

    def _ref(self, block_id: int) -> Parent:
        return (block_id, self.pool.blocks[block_id].generation)

    def match(self, token_ids: list[int]) -> PrefixHit:
        """The longest run of named full blocks of `token_ids` (never covering the last token).

        A name found is checked against the block's stored token ids and parent: a collision is
        a miss.
        """
        bs = self.pool.block_size
        usable = (len(token_ids) - 1) // bs  # full blocks before the last token
        hits, digest, parent = [], None, None
        for start in range(0, usable * bs, bs):
            chunk = token_ids[start : start + bs]
            digest = block_digest(digest, chunk)
            block_id = self.cached.get(digest)
            if block_id is None or not self._holds(block_id, chunk, parent):
                break
            hits.append(block_id)
            parent = self._ref(block_id)
        return PrefixHit(tuple(hits), len(hits) * bs, "hash")

    def admit(self, request_id: str, hit: PrefixHit) -> None:
        """The request's first blocks are the hits: their names are its names."""
        blocks = self.pool.blocks
        self.req_hashes[request_id] = [blocks[b].block_hash for b in hit.blocks]
        self.req_holders[request_id] = [self._ref(b) for b in hit.blocks]

    def insert(self, request_id, token_ids, num_tokens, blocks, final) -> None:
        """Name the request's blocks full up to `num_tokens` (its tokens so far: `token_ids`).

        Blocks are named as their step is scheduled, so a request leaving (`final`) adds nothing.
        """
        if final:
            return
        bs = self.pool.block_size
        hashes = self.req_hashes.setdefault(request_id, [])
        holders = self.req_holders.setdefault(request_id, [])
        num_full = num_tokens // bs
        for i in range(len(hashes), num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_digest(hashes[-1] if hashes else None, chunk)
            parent = holders[-1] if holders else None
            named = self.cached.get(h)
            if named is not None and self._orphaned(named):  # its parent was evicted: unreachable
                self._unname(named)
                named = None
            if named is not None and self._holds(named, chunk, parent):
                holder = named  # an equal block registered earlier keeps the name
            else:  # a new name, or (a collision) a name taken by other content: keep our own
                holder = blocks[i]
                if named is None:
                    block = self.pool.blocks[holder]
                    block.block_hash, block.token_ids, block.parent = h, chunk, parent
                    self.cached[h] = holder
                    self.named_in_step.append(holder)
            hashes.append(h)
            holders.append(self._ref(holder))

    def release(self, request_id: str) -> None:
        self.req_hashes.pop(request_id, None)
        self.req_holders.pop(request_id, None)

    def on_reuse(self, block_id: int) -> None:
        self._unname(block_id)  # evict: its old content is about to be overwritten

    def begin_step(self) -> None:
        """A new step starts scheduling: the blocks named by the previous one hold their K/V."""
        self.named_in_step.clear()

    def forget_step(self) -> None:
        """The step's forward pass did not complete: unname the blocks it named."""
        for block_id in self.named_in_step:
            self._unname(block_id)
        self.named_in_step.clear()

    def _unname(self, block_id: int) -> None:
        block = self.pool.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids, block.parent = NO_HASH, (), None

    def cached_blocks(self, limit: int | None = None) -> list[int] | None:
        if limit is not None and len(self.cached) > limit:
            return None
        blocks = self.pool.blocks
        return sorted(b for b in self.cached.values() if blocks[b].ref_count == 0)
