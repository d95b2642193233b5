"""Solutions to the exercises of notebook 07 (LM head and sampling)."""

import torch


def my_softmax_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def my_top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    kth = probs.sort(dim=-1, descending=True).values[:, k - 1 : k]  # [B, 1]: the k-th largest
    kept = probs.masked_fill(probs < kth, 0.0)  # ties with the k-th are kept
    return kept / kept.sum(dim=-1, keepdim=True)


def my_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    kept = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


SOLUTIONS = {"07.temperature": my_softmax_temperature, "07.top_k": my_top_k, "07.min_p": my_min_p}
