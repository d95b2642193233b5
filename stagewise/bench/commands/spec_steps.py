"""What a verify step costs, and a truncated-layer draft: the two helpers of `bench spec`.

`step_cost` times the target's forward pass over the paged cache for one
sequence at a given context: a plain decode step (1 query token, the LM head
on 1 row) against a verify step (k + 1 query tokens, the LM head on all k + 1
rows, as the speculative engine runs it). While weights dominate the bytes a
step moves, both read the same weights once, so their ratio stays near 1; the
extra rows cost arithmetic (more on a format whose kernels are compute-heavy,
such as dequantizing packed 4-bit weights) and the LM head's k extra rows.

`write_truncated_gguf` writes a copy of a GGUF that keeps only some of its
layers (renumbered 0, 1, ...): the same tokenizer, embedding, final norm and
LM head, the packed tensors copied byte for byte. A cheap draft model without
a second checkpoint; its guesses are only as good as those layers make them.
"""

import re
import statistics
import time
from pathlib import Path

import torch

from stagewise.kv.paged import PagedKVCache, PagedKVStep
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.prepare import build_packed_forms
from stagewise.models.registry import LoadedModel
from stagewise.stages.attention_metadata import AttentionMetadata

BLOCK = 16  # KV cache tokens per block (the engine's default)


def _forward(model, cache, row: int, tokens: list[int], start: int, all_rows: bool):
    """Feed `tokens` at positions start.. of the one sequence; logits of the last or of every row."""
    device = model.batch_device
    n = len(tokens)
    batch = ForwardBatch.from_sequences([tokens], [start], device)
    if all_rows:  # the verify step: the LM head on every row
        batch.last_token_index = torch.arange(n, device=device)
    seq_len = start + n
    metadata = AttentionMetadata.build(
        [n],
        [seq_len],
        device,
        block_table=cache.block_table[row : row + 1, : -(-seq_len // BLOCK)].contiguous(),
        slot_mapping=list(range(start, seq_len)),  # block b holds slots b*16 .. : blocks 0, 1, ...
        cu_seqlens_q=batch.cu_seqlens_q,
    )
    return model.forward(batch, PagedKVStep(cache, metadata))


@torch.inference_mode()
def step_costs(loaded: LoadedModel, backend: str, context: int, rows: list[int], repeats: int) -> dict[int, float]:
    """Median ms of one step over `n` query tokens at `context` tokens of cache, for each n in
    `rows` (the LM head on all n rows when n > 1, as a verify step runs it)."""
    ops = StageOps(backend)
    build_packed_forms(loaded.weights, ops.backends)
    model = LlamaModel(loaded, ops)
    max_len = context + max(rows)
    num_blocks = -(-max_len // BLOCK)
    cache = PagedKVCache(loaded.config, num_blocks, BLOCK, 1, max_len, loaded.dtype, loaded.device, model.batch_device)
    row = cache.write_row("bench", list(range(num_blocks)))  # block i of the sequence is block i
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.config.vocab_size, (max_len,), generator=generator).tolist()
    _forward(model, cache, row, ids[:context], 0, False)  # the context's K/V, once
    times: dict[int, list[float]] = {n: [] for n in rows}
    for i in range(repeats + 1):  # alternate the shapes, forwards then backwards; round 0 warms up
        for n in rows if i % 2 == 0 else rows[::-1]:
            start = time.perf_counter()
            _forward(model, cache, row, ids[context : context + n], context, all_rows=n > 1)
            if i > 0:
                times[n].append(1000 * (time.perf_counter() - start))
    return {n: statistics.median(ts) for n, ts in times.items()}


def step_cost(loaded: LoadedModel, backend: str, context: int, k: int, repeats: int) -> dict:
    """A decode step (1 row) against a verify step (k + 1 rows) at `context` tokens, in ms."""
    ms = step_costs(loaded, backend, context, [1, k + 1], repeats)
    return {
        "context": context,
        "verify_rows": k + 1,
        "decode_ms": ms[1],
        "verify_ms": ms[k + 1],
        "verify_over_decode": ms[k + 1] / ms[1],
    }


def write_truncated_gguf(source: Path, target: Path, keep: list[int]) -> Path:
    """A copy of `source` with only the layers `keep` (renumbered 0..), tensors copied as stored."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer adds these itself
        value = len(keep) if key == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    new_index = {old: new for new, old in enumerate(keep)}
    for tensor in reader.tensors:
        name, match = tensor.name, re.match(r"blk\.(\d+)\.(.*)", tensor.name)
        if match:
            if int(match.group(1)) not in new_index:
                continue
            name = f"blk.{new_index[int(match.group(1))]}.{match.group(2)}"
        writer.add_tensor(name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
