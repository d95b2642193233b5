"""Shared test helpers: a verbose closeness check and per-dtype tolerances."""

import torch

TOLERANCES = {  # (atol, rtol) per dtype for naive-vs-reference comparisons of one stage
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding
    torch.float16: (2e-3, 2e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """Like torch.testing.assert_close, but prints the worst mismatches with their indices."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bool(bad.any()) or bool(torch.isnan(a).any() != torch.isnan(e).any()):
        flat = torch.where(bad.flatten(), err.flatten(), torch.zeros(()))
        worst = flat.topk(min(5, flat.numel())).indices
        lines = []
        for i in worst.tolist():
            idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), a.shape))
            lines.append(
                f"  at {idx}: got {a[idx].item():.6g}, expected {e[idx].item():.6g}, |diff| {err[idx].item():.3g}"
            )
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ (max |diff| {err.max().item():.3g}, "
            f"atol {atol}, rtol {rtol}); worst:\n" + "\n".join(lines)
        )
