"""The paged KV cache: one tensor of fixed-size blocks, and the block table that maps into it.

    kv:          [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = K and V)
    block_table: [max_num_reqs, max_num_blocks_per_req] int32; row r = one request's block ids

    slot = block_id * block_size + offset        (where a token's K/V live)
    block_id = slot // block_size,  offset = slot % block_size

The number of blocks comes from a memory budget: a byte count, or a fraction
of the memory that is free (capped at what `max_num_seqs` requests of
`max_model_len` tokens could ever use). `describe()` says how many tokens
that holds.
"""

import os
from dataclasses import dataclass

import torch

from stagewise.config import EngineConfig, ModelConfig
from stagewise.errors import StagewiseError
from stagewise.kv.access import KVAccess
from stagewise.runtime import to_device
from stagewise.stages import kv_store, paged_attention, rope
from stagewise.stages.attention_metadata import AttentionMetadata


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V, every layer, every KV head: 2 * L * Hkv * d * bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for_budget(
    cfg: ModelConfig, ecfg: EngineConfig, max_model_len: int, dtype, device
) -> int:
    per_block = ecfg.block_size * kv_bytes_per_token(cfg, dtype)
    if ecfg.num_kv_blocks is not None:
        if ecfg.num_kv_blocks < 1:
            raise StagewiseError(f"num_kv_blocks must be >= 1, got {ecfg.num_kv_blocks}")
        return ecfg.num_kv_blocks
    if ecfg.kv_cache_bytes is not None:
        budget = ecfg.kv_cache_bytes
    else:
        useful = ecfg.max_num_seqs * -(-max_model_len // ecfg.block_size) * per_block
        budget = min(int(free_memory_bytes(device) * ecfg.kv_cache_fraction), useful)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise StagewiseError(
            f"a KV budget of {budget} bytes holds no block of {per_block} bytes; "
            "raise kv_cache_bytes"
        )
    return int(num_blocks)


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        dtype,
        device,
        table_device=None,
        spare_block: bool = False,
    ):
        # spare_block: one more block that no request ever owns, where padded rows of a CUDA-graph
        # batch store their K/V (engine/cuda_graphs.py); `num_blocks` stays what requests can use.
        shape = (
            cfg.num_layers,
            2,
            num_blocks + int(spare_block),
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        # torch.empty: every slot is written by kv_store before attention ever reads it
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # first slot of the spare block
        self.spare_slot = num_blocks * block_size if spare_block else None
        self.max_blocks_per_req = -(-max_model_len // block_size)
        table_device = table_device or device  # the CPU for shape-only (meta) models
        self.block_table = torch.zeros(
            max_num_reqs, self.max_blocks_per_req, dtype=torch.int32, device=table_device
        )
        self.free_rows = list(range(max_num_reqs))[::-1]  # block-table rows not owned by a request
        self.row_of: dict[str, int] = {}  # request id -> its block-table row

    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        mib = self.num_bytes() / 2**20
        blocks = f"{self.num_blocks} blocks x {self.block_size} tokens"
        return f"KV cache: {blocks} = {tokens} tokens, {mib:.1f} MiB"

    def row(self, request_id: str) -> int:
        if request_id not in self.row_of:
            self.row_of[request_id] = self.free_rows.pop()
        return self.row_of[request_id]

    def release_row(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def reclaim_lost_rows(self) -> None:
        """Put back rows that are neither free nor owned (an interrupt fell between the two)."""
        held = set(self.free_rows) | set(self.row_of.values())
        lost = [r for r in range(self.block_table.shape[0]) if r not in held]
        self.free_rows.extend(lost)

    def write_row(self, request_id: str, block_ids: list[int]) -> int:
        """Copy a request's block list into its block-table row; returns the row index."""
        row = self.row(request_id)
        self.block_table[row, : len(block_ids)] = to_device(
            block_ids, torch.int32, self.block_table.device
        )
        return row


@dataclass
class PagedKVStep(KVAccess):
    """How one step's tokens store and read K/V in a `PagedKVCache`.

    `metadata` (built once per step by the runner) holds the paged layout: the block-table rows
    of this step's sequences, their lengths, and every new token's slot
    (`block_id * block_size + offset`; a paged batch has no padding, so every slot is valid).
    """

    cache: PagedKVCache  # the engine's cache (None in a tensor-parallel step message)
    metadata: AttentionMetadata  # the step's lengths, block table and slots
    # copy-on-write (kv/block_manager.py): (source, destination) blocks whose K/V are copied in
    # each layer before the step stores any, so every copy reads its source as the step began
    block_copies: tuple[tuple[int, int], ...] = ()

    def copy_blocks(self, layer: int) -> None:
        """This layer's copies: K and V of each source block into its destination block."""
        if not self.block_copies:
            return
        src, dst = zip(*self.block_copies)
        layer_kv = self.cache.kv[layer]  # [2, num_blocks, block_size, Hkv, d]
        device = layer_kv.device
        layer_kv[:, to_device(dst, torch.long, device)] = layer_kv[
            :, to_device(src, torch.long, device)
        ]

    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self.copy_blocks(layer)
        m = self.metadata
        # [2, num_blocks, block_size, Hkv, d] -> K and V, [num_blocks, block_size, Hkv, d] views
        k_cache, v_cache = self.cache.kv[layer].unbind(0)
        flat = (-1, *k_cache.shape[2:])  # the same memory seen as [num_slots, Hkv, d]
        ops(
            kv_store,
            layer=layer,
            k=k,
            v=v,
            k_cache=k_cache.view(flat),
            v_cache=v_cache.view(flat),
            metadata=m,
        )
        return self._paged_attention(ops, layer, q, k_cache, v_cache, scale)

    def rope_and_attend(
        self,
        ops,
        layer: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """RoPE, the KV store and attention; RoPE and the store as one Triton kernel when both
        stages run the triton tier (`ops.fuses(rope, kv_store)`), else as `KVAccess` does.

        Fused: q is rotated in place, rope(k) and v go to their slots, and k in the QKV buffer
        stays unrotated (attention reads keys from the cache only). -> attention output [T, H, d].
        """
        if not ops.fuses(rope, kv_store):
            return super().rope_and_attend(ops, layer, positions, q, k, v, cos_sin_cache, scale)
        from stagewise.kernels.rope_kv_store import rope_kv_store  # lazily: picks the interpreter

        self.copy_blocks(layer)
        m = self.metadata
        k_cache, v_cache = self.cache.kv[layer].unbind(0)  # [num_blocks, block_size, Hkv, d] each
        flat = (-1, *k_cache.shape[2:])  # [num_slots, Hkv, d]

        def rotate_and_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata):
            slots = metadata.slot_mapping  # [T]
            return rope_kv_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots)

        q = ops.fused(
            (rope, kv_store),
            rotate_and_store,
            layer=layer,
            positions=positions,
            q=q,
            k=k,
            v=v,
            cos_sin_cache=cos_sin_cache,
            k_cache=k_cache.view(flat),
            v_cache=v_cache.view(flat),
            metadata=m,
        )  # q [T, H, d], rotated in place
        return self._paged_attention(ops, layer, q, k_cache, v_cache, scale)

    def _paged_attention(self, ops, layer, q, k_cache, v_cache, scale) -> torch.Tensor:
        """q [T, H, d] against this layer's cache blocks -> [T, H, d]."""
        return ops(
            paged_attention,
            layer=layer,
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            metadata=self.metadata,
            scale=scale,
        )  # [T, H, d]
