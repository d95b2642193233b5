"""Solutions to the exercises of notebook 06 (FFN)."""

import torch


def my_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return gate * torch.sigmoid(gate) * up


def my_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return my_silu_and_mul(x @ w_gate_up) @ w_down


SOLUTIONS = {"06.silu_and_mul": my_silu_and_mul, "06.ffn": my_ffn}
