"""Sample the next token of every scheduled request from its logits row.

The one place a step reads the device: the sampled ids come back to the host
(one `.tolist()`), because the engine needs them to detect EOS and stop
strings and to schedule the next step. Everything before is queued without a
wait: the sampling settings are host values copied to the device.
"""

import torch

from stagewise.engine.logprobs import note_logprobs
from stagewise.engine.request import Request
from stagewise.models.ops import StageOps
from stagewise.stages import sampling as sampling_stage
from stagewise.stages.sampling import SamplingTensors


def sample_next_tokens(ops: StageOps, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [num_seqs, vocab] (row b = requests[b]) -> one token id per request."""
    vocab = logits.shape[-1]
    # a shape-only model has no numbers: sample from all-zero logits (token 0, greedy)
    if logits.is_meta:
        logits = torch.zeros(logits.shape, dtype=logits.dtype)
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        seen = torch.stack([r.seen_mask(vocab) for r in requests])  # [B, vocab] bool, on the host
    else:
        # no penalty: nothing
        seen = torch.zeros(len(requests), vocab, dtype=torch.bool, device=logits.device)
    sampling = SamplingTensors.from_params(
        params=[r.params for r in requests],
        seen=seen,
        offsets=[
            len(r.output_token_ids) for r in requests
        ],  # each request's position in its own stream
        seeds=[r.seed for r in requests],
        device=logits.device,
    )
    tokens = ops(sampling_stage, logits=logits, sampling=sampling)  # [B, vocab] -> [B]
    ids = read_token_ids(tokens)
    if any(r.params.logprobs is not None for r in requests):  # SamplingParams(logprobs=k)
        note_logprobs(logits, requests, [1] * len(requests), [[t] for t in ids])
    return ids


def plain_greedy(requests: list[Request]) -> bool:
    """Every request takes the argmax of its raw logits: greedy, no repetition penalty, and no
    logprobs asked (a graphed step's argmax runs inside the graph: no logits come out)."""
    return all(
        r.params.greedy and r.params.repetition_penalty == 1.0 and r.params.logprobs is None
        for r in requests
    )


def read_token_ids(tokens: torch.Tensor) -> list[int]:
    """[B] token ids on the device -> host ints: the step's one device -> host read (the engine
    needs the ids for EOS, stop strings and the next step's inputs)."""
    return tokens.tolist()
