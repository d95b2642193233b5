"""The prefix cache's one interface: what the block manager asks of it, whichever design answers.

A prefix cache remembers which KV blocks hold the K/V of which token prefixes, so that a new
request whose tokens start the same way skips computing them. Two designs answer here, the two
that serving engines use, and one that remembers nothing:

    "hash"   vLLM's      kv/hash_cache.py   full blocks named by a chained SHA-256 digest; the
                                            longest run of named blocks is reused
    "radix"  SGLang's    kv/radix_cache.py  a radix tree of token runs over the blocks; a match
                                            may end inside a block (token granularity)
    "none"               this module        every request computes its whole prompt

The block manager (kv/block_manager.py) owns the pool — reference counts, the free queue, each
request's row of blocks — and calls a cache at five moments:

    match(token_ids) -> PrefixHit     a waiting request is looked up (never its last token: its
                                      logits are needed, so it is always computed)
    admit(request_id, hit)            the request was admitted with that hit
    insert(request_id, token_ids, num_tokens, blocks, final)
                                      the request's first num_tokens tokens are (or, while a step
                                      is being scheduled, are about to be) in `blocks`: findable
                                      from now on. final=True when the request leaves
    release(request_id)               the request left (finished, preempted, aborted)
    evict(num_blocks) -> int          the free queue is short: give blocks back

and at three more that keep it honest: `on_reuse(block_id)` (a free block is handed out for new
content), `begin_step()` and `forget_step()` (a step's forward pass did not complete: whatever
was named in it may never have been written).

A hit's blocks are shared, never written by the request that reuses them: the block manager
copies a shared block before a request writes into it (copy-on-write), so a hit that ends inside
a block (radix) costs one block copy, and the copy happens where the step writes K/V.
"""

from dataclasses import dataclass

from stagewise.config import PREFIX_CACHES  # "hash", "radix", "none" (EngineConfig.prefix_cache)
from stagewise.errors import StagewiseError

__all__ = ["PREFIX_CACHES", "NO_HIT", "PrefixCache", "PrefixHit", "check_prefix_cache"]


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found: a prefix of the request's tokens whose K/V already sit in blocks."""

    # blocks holding the prefix, in logical order; the last may be partly used
    blocks: tuple[int, ...] = ()
    num_tokens: int = 0  # tokens whose K/V are reused (a request starts with this many computed)
    # "hash", "radix", or "fork" (a parallel sample sharing its first sample's prompt)
    origin: str = "none"
    token_ids: tuple[int, ...] = ()  # radix: the tokens matched, the path its admission locks


NO_HIT = PrefixHit()


def check_prefix_cache(value) -> str:
    """`value` if it names a prefix cache, else a one-line `StagewiseError` listing the choices."""
    if not isinstance(value, str) or value not in PREFIX_CACHES:
        raise StagewiseError(
            f"unknown prefix_cache {value!r}; use one of {', '.join(PREFIX_CACHES)}"
        )
    return value


class PrefixCache:
    """The interface, and the cache that remembers nothing ("none").

    `pool` is the block manager: a cache reads `pool.blocks[b].ref_count` and `pool.block_size`,
    and may take and drop references of its own (`pool.hold(b)`, `pool.release(b)`).
    """

    kind = "none"

    def __init__(self, pool):
        self.pool = pool

    def match(self, token_ids: list[int]) -> PrefixHit:
        return NO_HIT

    def admit(self, request_id: str, hit: PrefixHit) -> None:
        pass

    def insert(
        self, request_id: str, token_ids: list[int], num_tokens: int, blocks: list[int], final: bool
    ) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        return 0

    def on_reuse(self, block_id: int) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def forget_step(self) -> None:
        pass

    def cached_blocks(self, limit: int | None = None) -> list[int] | None:
        """Blocks the cache keeps findable that no request holds (None: more than `limit`)."""
        return []
