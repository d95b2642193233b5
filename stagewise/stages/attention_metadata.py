"""`AttentionMetadata`: everything attention needs to know about one engine step, in one object.

A step packs the new tokens of B sequences end to end, `[T]` rows, no padding
between sequences. Attention must know, per sequence b:

    its query rows        cu_seqlens_q[b] : cu_seqlens_q[b+1]            (this step's tokens)
    its keys              seq_lens[b] of them, this step's included       (the cache, or the batch)
    where the keys lie    contiguous: rows cu_seqlens_k[b] : cu_seqlens_k[b] + seq_lens[b]
                          paged:      block_table[b, p // block_size], offset p % block_size
    where new K/V go      slot_mapping[t] for each new token t (-1: padding, not stored)

The runner builds this object ONCE per step (`kv/` and `engine/`), and the
same object goes to every layer's `kv_store`, `attention` or `paged_attention`
stage. The scheduler knows every length as a Python int, so the object holds
them on the host too (`cu_seqlens_q_host`, `seq_lens_host`, the maxima): the
PyTorch tiers slice with them and the Triton launchers size their grids from
them, so no stage reads a device tensor back. On a GPU such a read waits for
every queued kernel — a host-bound step that no CUDA graph could capture.
"""

import itertools
from dataclasses import dataclass

import torch

from stagewise.runtime import to_device


@dataclass
class AttentionMetadata:
    # ---- queries: this step's tokens ----
    # [B+1] int32: sequence b owns query rows cu_seqlens_q[b] : cu_seqlens_q[b+1]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_host: list[int]  # [B+1] the same offsets as host ints
    max_q_len: int  # the most query rows of one sequence (sizes the attention grid)
    # ---- keys: what each sequence attends to ----
    seq_lens: torch.Tensor  # [B] int32: keys of sequence b, this step's tokens included
    seq_lens_host: list[int]  # [B] the same as host ints
    max_seq_len: int  # the most keys of one sequence (the paged kernel's split-K choice)
    # ---- where the keys lie: the contiguous layout (attention) ... ----
    # [B+1] int32: sequence b's keys start at row cu_seqlens_k[b] of k/v (None: paged layout)
    cu_seqlens_k: torch.Tensor | None = None
    cu_seqlens_k_host: list[int] | None = None  # [B+1] the same as host ints
    # ---- ... or the paged one (paged_attention) ----
    # [B, max_blocks] int32: row b = the physical cache blocks of sequence b, in order
    block_table: torch.Tensor | None = None
    # ---- where this step's new K/V are stored (kv_store) ----
    # [T] int64: the cache slot of each new token, -1 = padding (None: nothing is stored)
    slot_mapping: torch.Tensor | None = None
    all_slots_valid: bool = True  # no slot is -1 (a host flag: kv_store needs no mask)
    # ---- the torch tier of paged_attention: its batched-decode plan ----
    # list of `paged_attention_torch.DecodeGroup`: built at the first layer of a step that runs
    # that tier, reused by every later layer; None when the tier does not run (or not yet)
    decode_plan: list | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        seq_lens: list[int],
        device,
        k_starts: list[int] | None = None,
        block_table: torch.Tensor | None = None,
        slot_mapping: list[int] | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
    ) -> "AttentionMetadata":
        """The metadata of one step from host lengths (one host->device copy per tensor).

        q_lens [B]: this step's tokens per sequence; seq_lens [B]: its keys, these included.
        k_starts [B+1]: the contiguous layout's first key row per sequence (and the end);
        block_table [B, max_blocks]: the paged layout. slot_mapping [T]: where new K/V go.
        cu_seqlens_q: the step's offsets, when the batch already holds them on the device.
        """
        cu_q = list(itertools.accumulate(q_lens, initial=0))  # [B+1]
        if cu_seqlens_q is None:
            cu_seqlens_q = to_device(cu_q, torch.int32, device)
        return cls(
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_q_host=cu_q,
            max_q_len=max(q_lens, default=0),
            seq_lens=to_device(seq_lens, torch.int32, device),
            seq_lens_host=list(seq_lens),
            max_seq_len=max(seq_lens, default=0),
            cu_seqlens_k=None if k_starts is None else to_device(k_starts, torch.int32, device),
            cu_seqlens_k_host=None if k_starts is None else list(k_starts),
            block_table=block_table,
            slot_mapping=None
            if slot_mapping is None
            else to_device(slot_mapping, torch.long, device),
            all_slots_valid=slot_mapping is None or -1 not in slot_mapping,
        )

    @classmethod
    def over_batch(
        cls, cu_seqlens: torch.Tensor, cu_seqlens_host: list[int] | None = None
    ) -> "AttentionMetadata":
        """No cache: each sequence attends to its own rows of this batch (queries = keys).

        Without `cu_seqlens_host` the offsets are read back from the device (a host sync).
        """
        cu = cu_seqlens.tolist() if cu_seqlens_host is None else list(cu_seqlens_host)
        lens = [b - a for a, b in zip(cu, cu[1:])]  # [B]
        return cls(
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_q_host=cu,
            max_q_len=max(lens, default=0),
            seq_lens=(cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32),  # on the device, no read
            seq_lens_host=lens,
            max_seq_len=max(lens, default=0),
            cu_seqlens_k=cu_seqlens,
            cu_seqlens_k_host=cu,
        )
