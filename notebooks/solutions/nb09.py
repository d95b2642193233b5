"""Solutions to the exercises of notebook 09 (paged KV cache)."""


def my_blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def my_slot_mapping(block_ids: list[int], positions: list[int], block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


SOLUTIONS = {"09.blocks_needed": my_blocks_needed, "09.slot_mapping": my_slot_mapping}
