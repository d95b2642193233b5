"""Sample the next token of every scheduled request from its logits row."""

import torch

from stagewise.engine.request import Request
from stagewise.models.ops import StageOps
from stagewise.stages.sampling import SamplingTensors


def sample_next_tokens(ops: StageOps, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [num_seqs, vocab] (row b = requests[b]) -> one token id per request."""
    vocab = logits.shape[-1]
    if logits.is_meta:  # a shape-only model has no numbers: sample from all-zero logits (token 0, greedy)
        logits = torch.zeros(logits.shape, dtype=logits.dtype)
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        seen = torch.stack([r.seen_mask(vocab) for r in requests])  # [B, vocab] bool
    else:
        seen = torch.zeros(len(requests), vocab, dtype=torch.bool)  # no penalty: nothing to mark
    sampling = SamplingTensors.from_params(
        params=[r.params for r in requests],
        seen=seen,
        offsets=[len(r.output_token_ids) for r in requests],  # each request's position in its own stream
        seeds=[r.seed for r in requests],
        device=logits.device,
    )
    return ops("sampling", logits=logits, sampling=sampling).tolist()  # [B, vocab] -> [B]
