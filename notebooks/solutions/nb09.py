"""Solutions to the exercises of notebook 09 (paged KV cache)."""

from stagewise.kv.block_manager import block_digest


def my_blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def my_slot_mapping(block_ids: list[int], positions: list[int], block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def my_allocate(free_queue, ref_counts, row, num_tokens, block_size):
    need = my_blocks_needed(num_tokens, block_size) - len(row)  # blocks beyond those it owns
    if need > len(free_queue):
        return False  # nothing changes: the request waits (or someone is preempted)
    for _ in range(max(need, 0)):
        block = free_queue.popleft()  # the least recently freed block
        ref_counts[block] = 1
        row.append(block)
    return row


def my_free(free_queue, ref_counts, row):
    returned = []
    for block in reversed(row):  # the tail first: its blocks are the least likely to be shared
        ref_counts[block] -= 1
        if ref_counts[block] == 0:  # nobody else holds it (a shared prefix block may stay)
            free_queue.append(block)
            returned.append(block)
    row.clear()
    return returned


def my_cached_prefix(token_ids, block_size, cached):
    usable = (len(token_ids) - 1) // block_size  # full blocks before the last token
    hits, parent = [], None
    for start in range(0, usable * block_size, block_size):
        parent = block_digest(parent, token_ids[start : start + block_size])  # chained: names the prefix
        if parent not in cached:
            break
        hits.append(cached[parent])
    return hits


SOLUTIONS = {
    "09.blocks_needed": my_blocks_needed,
    "09.slot_mapping": my_slot_mapping,
    "09.allocate": my_allocate,
    "09.free": my_free,
    "09.cached_prefix": my_cached_prefix,
}
