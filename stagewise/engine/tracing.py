"""Tell the active tracer (if any) what a step scheduled; a no-op when none is recording."""

from collections.abc import Callable

import torch

from stagewise.engine.request import Request
from stagewise.trace.hooks import active_tracer


def _plain(value):
    return value.tolist() if isinstance(value, torch.Tensor) else value


def begin_step(
    index: int, mode: str, requests: list[dict], batch: dict, scheduler: dict | None = None
) -> None:
    tracer = active_tracer()
    if tracer is not None:
        tracer.begin_step(
            index, mode, requests, {k: _plain(v) for k, v in batch.items()}, scheduler
        )


def end_step(sampled: list[tuple[Request, int]], view: Callable[[], dict] | None = None) -> None:
    """`view`, when given, makes the engine's snapshot after the step (engine/snapshot.py):
    the trace keeps it under the step's "view" key, what `stagewise view` replays."""
    tracer = active_tracer()
    if tracer is not None:
        tracer.end_step(
            sampled={r.request_id: tok for r, tok in sampled},
            text={r.request_id: r.text_stream.text for r, _ in sampled},
            view=view() if view is not None else None,
        )


def note_verified(verified: dict[str, dict]) -> None:
    """After a verify step: each speculating request's line in the trace gets what was kept
    (`accepted` guesses, `kept_token_ids`: those and the target's own token)."""
    tracer = active_tracer()
    if tracer is not None and tracer.steps and verified:
        for info in tracer.steps[-1].requests:
            info.update(verified.get(info["request_id"], {}))


def request_info(req: Request, num_scheduled: int, phase: str, **extra) -> dict:
    """One scheduled request as the tracer shows it: num_computed_tokens -> +num_scheduled of
    num_tokens."""
    return {
        "request_id": req.request_id,
        "num_computed_tokens": req.num_computed_tokens,
        "num_tokens": req.num_tokens,
        "num_scheduled": num_scheduled,
        "phase": phase,
        **extra,
    }
