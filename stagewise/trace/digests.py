"""Row digests: a short hash of every request's rows of every stage's output, to compare two runs.

    with Tracer(digests=True) as alone: llm.generate([prompt], params)
    with Tracer(digests=True) as batched: llm.generate(others + [prompt], params)
    first_divergence(alone, "req-0", batched, "req-5")   # -> where the request's numbers first part

A stage's output is a tensor whose rows are the step's tokens ([T, hidden],
[T, H, d], ...), several requests side by side. With digests on, the tracer
cuts each output into rows, gives each row to its owner — (request, position
in that request's sequence), from the step's request list and `positions`; a
static batch's padding rows belong to nobody — and keeps 8 bytes of BLAKE2b
of the row's bits, not the tensor. The LM head's rows are the tokens
`last_token_index` names. A key is independent of how the run was batched or
chunked:

    (layer, stage, call, output, position)      call: 0, 1 for a stage called twice per layer

so the same request run alone and at slot 5 of a batch has the same keys, and
each key the same digest when its bits are the same. Two runs part first at the
op whose inputs were all equal and whose output was not. Once a generated
token differs, every row from its position on differs because the input did,
so `first_divergence` looks only before the first position whose embedding
(its token) differs, takes the earliest op in the pipeline (the order the ops
first ran) with a differing row there, and the lowest position among its rows:
a row depends only on earlier ops, at its own and earlier positions, so all of
that op's inputs were equal. Ops after it differ because it did.
"""

import hashlib
from dataclasses import dataclass

import torch

DIGEST_BYTES = 8  # per row: enough that two different rows never collide in a lesson's run

OpKey = tuple[int | None, str, int]  # (layer, stage, call): one op of a step


@dataclass(frozen=True)
class Divergence:
    """Where two runs of one request first part: the op, its output, and the first row."""

    layer: int | None  # transformer block (None: the embedding, the final norm, the LM head)
    stage: str  # the stage whose output differed first
    call: int  # which call of the stage in its layer (rmsnorm runs twice per block)
    output: str  # the output tensor's name ("out", "residual_out", "q", ...)
    position: int  # the first position in the request's sequence whose row differs
    differing_rows: int  # rows of this op's output that differ (before the first different token)

    def describe(self) -> str:
        where = "outside the blocks" if self.layer is None else f"layer {self.layer}"
        nth = "" if self.call == 0 else f" (call {self.call + 1} in its layer)"
        return (
            f"{self.stage}{nth} {where}, output '{self.output}': first at position {self.position} "
            f"({self.differing_rows} rows differ)"
        )


def row_owners(requests: list[dict], positions: list[int]) -> list[tuple[str, int] | None]:
    """One entry per token row of a step: (request id, position), or None for a padding row.

    Request b owns `num_scheduled + padding` consecutive rows, its padding first (a static batch
    pads on the left; a finished request's decode row is all padding)."""
    owners: list[tuple[str, int] | None] = []
    for info in requests:
        pads = int(info.get("padding", 0))
        owners += [None] * pads
        start = len(owners)
        for j in range(info["num_scheduled"]):
            owners.append((info["request_id"], int(positions[start + j])))
    return owners


def row_digests(value: torch.Tensor) -> list[str]:
    """A [R, ...] tensor -> one hex digest of each row's bits (any dtype)."""
    rows = value.detach().to("cpu").contiguous()
    raw = rows.view(torch.uint8).reshape(rows.shape[0], -1).numpy() if rows.numel() else None
    if raw is None:
        return ["" for _ in range(rows.shape[0])]
    return [hashlib.blake2b(r.tobytes(), digest_size=DIGEST_BYTES).hexdigest() for r in raw]


def first_divergence(a, request_a: str, b, request_b: str) -> Divergence | None:
    """The first op at which request_a of tracer `a` and request_b of tracer `b` part, or None.

    Only keys both runs recorded are compared (a run may have computed more positions), and only
    before the first position whose input token differs."""
    da, db = a.row_digests.get(request_a, {}), b.row_digests.get(request_b, {})
    order = a.op_order
    changed = [key for key, digest in da.items() if db.get(key) not in (None, digest)]
    tokens = [key[4] for key in changed if key[1] == "embedding"]  # a different token went in there
    horizon = min(tokens, default=None)
    differing: dict[tuple, list[int]] = {}
    for layer, stage, call, output, position in changed:
        if horizon is None or position < horizon:
            differing.setdefault((layer, stage, call, output), []).append(position)
    if not differing:
        return None
    first = min(differing, key=lambda k: (order.get(k[:3], len(order)), k[3]))
    positions = sorted(differing[first])
    return Divergence(*first, position=positions[0], differing_rows=len(positions))


def first_token_divergence(a, request_a: str, b, request_b: str) -> int | None:
    """The first position whose LM-head row (the logits that choose the next token) differs."""
    da, db = a.row_digests.get(request_a, {}), b.row_digests.get(request_b, {})
    positions = [key[4] for key, digest in da.items() if key[1] == "lm_head" and db.get(key) not in (None, digest)]
    return min(positions, default=None)
