"""Per-token log-probabilities (`SamplingParams(logprobs=k)`): what the model said at each step.

For a request that asks, each row of logits that decides one of its output tokens becomes

    logprobs [V] = log_softmax(logits [V])       in float32, over the whole vocabulary

— the raw model output, before any penalty, temperature or filter (vLLM's
default) — and three things are kept per token: the k most likely tokens,
their log-probabilities, and the log-probability of the token that was drawn.
Nothing is rounded or re-derived, so two runs whose logits are the same bits
return the same bits here and `torch.equal` on them is a test of batch
invariance end to end (tests/engine/test_batch_invariance.py), as in vLLM's
batch-invariance suite.

The sampler (`sampler.py`, `speculative/verify.py`) calls `note_logprobs` with
the tokens it kept; `Request.append_token` moves one record per appended token
into `Request.logprobs`, so a stop string or max_tokens that cuts a verify
step's tokens short cuts their records at the same place.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLogprobs:
    """One output token's record: the step's top k and the drawn token, float32 as computed."""

    token_ids: torch.Tensor  # [k] int64: the k most likely tokens, most likely first
    values: torch.Tensor  # [k] float32: their log-probabilities
    sampled: torch.Tensor  # [] float32: the log-probability of the token that was drawn


@dataclass(frozen=True)
class Logprobs:
    """A request's records, one row per output token (`RequestOutput.logprobs`)."""

    token_ids: torch.Tensor  # [n, k] int64: each step's k most likely tokens
    values: torch.Tensor  # [n, k] float32: their log-probabilities
    sampled: torch.Tensor  # [n] float32: the log-probability of each generated token

    @staticmethod
    def of(steps: list[StepLogprobs], k: int) -> "Logprobs":
        if not steps:
            empty = torch.zeros(0, k)
            return Logprobs(empty.long(), empty, torch.zeros(0))
        return Logprobs(
            torch.stack([s.token_ids for s in steps]),  # [n, k]
            torch.stack([s.values for s in steps]),  # [n, k]
            torch.stack([s.sampled for s in steps]),  # [n]
        )

    def as_dicts(self, generated: list[int]) -> list[dict[int, float]]:
        """vLLM's shape: per output token {token id: logprob} for the top k and the drawn one."""
        out = []
        for ids, values, token, sampled in zip(
            self.token_ids.tolist(), self.values.tolist(), generated, self.sampled.tolist()
        ):
            step = dict(zip(ids, values))
            step.setdefault(token, sampled)
            out.append(step)
        return out


def note_logprobs(logits: torch.Tensor, requests: list, rows: list[int], kept: list[list[int]]):
    """logits [sum(rows), V]: request b owns `rows[b]` consecutive rows, and row i decided its
    token kept[b][i]. For each request with `params.logprobs` set, its records wait in
    `pending_logprobs` for `append_token` (host tensors: one device read, only when asked)."""
    start = 0
    for req, num_rows, tokens in zip(requests, rows, kept):
        k = req.params.logprobs
        if k is not None and tokens:
            lp = torch.log_softmax(logits[start : start + len(tokens)].float(), dim=-1)  # [n, V]
            top = lp.topk(k, dim=-1)  # [n, k] values and ids, largest first
            chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]  # [n]
            ids, values, chosen = top.indices.cpu(), top.values.cpu(), chosen.cpu()
            req.pending_logprobs = [
                StepLogprobs(ids[i], values[i], chosen[i]) for i in range(len(tokens))
            ]
        start += num_rows
