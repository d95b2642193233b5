"""`PackedParts`: one fused projection whose column blocks are packed in different formats.

The model multiplies by fused weights, `W_qkv = [W_q | W_k | W_v]` and `W_gate_up = [W_gate |
W_up]`, so one GEMM does the work of three (or two). A GGUF stores the parts as separate tensors,
and a "Q4_K_M" file gives them different types: W_q and W_k in Q4_K, W_v in Q6_K (the values
matter more, so they get 6 bits). Blocks of different formats cannot share one codes tensor,
but the product splits by output columns exactly:

    x [M, K] @ [W_1 | W_2 | ...] [K, N_1 + N_2 + ...] = [x @ W_1 | x @ W_2 | ...] [M, sum N_i]

because every output column n is the dot product of x with column n alone. So a `PackedParts`
keeps each part as its own `PackedWeight` [K, N_i] and the dequantize-GEMM multiplies part by
part and concatenates (`stages/dequant_gemm.py`). Neighbouring parts of one kind are joined into
one `PackedWeight` first (W_q | W_k are one Q4_K part), so a Q4_K_M qkv is two GEMMs, not three.

For SmolLM2-135M with q/k in Q4_K and v in Q6_K: W_q | W_k is [576, 576 + 192] = 442 368
weights at 0.75 bytes each (324 KiB held), W_v [576, 192] = 110 592 at 1.25 bytes (135 KiB);
the float32 copy it replaces held 576 * 960 * 4 = 2.1 MiB.

To every `is_packed` check a PackedParts is a packed weight (a projection sends it to the
dequantize-GEMM like any other), with the matrix's `shape` [K, sum N_i], a `dtype` naming its
kinds ("q4_k+q6_k") and its `nbytes`. It has no single codes or scales tensor: code that reads
those directly asks the parts (`parts`), and gets a one-line error otherwise.
"""

import torch

from stagewise.quant.packed_weight import PackedWeight, PackedWeightError, cat_out_features


class PackedParts(PackedWeight):
    """[K, N_1 + N_2 + ...]: PackedWeights [K, N_i] side by side along N (the output axis)."""

    def __init__(self, parts: list[PackedWeight]) -> None:  # noqa: D107 (no dataclass fields)
        parts = join_same_kind(parts)
        if len(parts) < 2:
            raise PackedWeightError("PackedParts holds two or more parts of different kinds")
        k = parts[0].shape[0]
        if any(p.shape[0] != k for p in parts):
            shapes = ", ".join(f"{p.kind} {list(p.shape)}" for p in parts)
            raise PackedWeightError(f"parts of one fused weight need the same K: {shapes}")
        self.parts = parts
        self.prepared = {}  # PackedWeight's field; each part keeps its own tiers' forms

    # ---- what the weight is (the same questions a PackedWeight answers) ----

    @property
    def kind(self) -> str:
        """The parts' kinds in order, e.g. "q4_k+q6_k" (the tracer prints it as the dtype)."""
        return "+".join(p.kind for p in self.parts)

    @property
    def dtype(self) -> str:
        return self.kind

    @property
    def shape(self) -> tuple[int, int]:
        """[K, sum N_i]: the fused matrix the parts stand for."""
        return (self.parts[0].shape[0], sum(p.shape[1] for p in self.parts))

    @property
    def widths(self) -> list[int]:
        """N_i of every part: where the output columns split."""
        return [p.shape[1] for p in self.parts]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def prepared_bytes(self) -> int:
        return sum(p.prepared_bytes() for p in self.parts)

    def held_bytes(self) -> int:
        """Bytes the parts keep in memory (each: its codes as held, scales, prepared forms)."""
        return sum(p.held_bytes() for p in self.parts)

    def release_codes(self) -> None:
        """Each part drops its file-layout codes where its torch form holds them exactly."""
        for p in self.parts:
            p.release_codes()

    def row_bytes(self) -> int:
        """Mean bytes of one output feature (rows of different parts differ in size)."""
        return self.nbytes // self.shape[1]

    def __repr__(self) -> str:
        k, n = self.shape
        inner = ", ".join(f"{p.kind} N={p.shape[1]}" for p in self.parts)
        return f"PackedParts([K={k}, N={n}]: {inner}, {self.device})"

    # a PackedWeight's own storage: a PackedParts has none, only its parts do
    def _no_single(self, name: str):
        raise PackedWeightError(
            f"{self!r} has no single {name} tensor; read each of its parts (.parts)"
        )

    codes = property(lambda self: self._no_single("codes"))
    scales = property(lambda self: self._no_single("scales"))
    mins = property(lambda self: self._no_single("mins"))
    code_rows = property(lambda self: self._no_single("codes"))
    file_parts = property(lambda self: self._no_single("codes"))
    bits = property(lambda self: self._no_single("bits"))
    offset = property(lambda self: self._no_single("offset"))
    group_size = property(lambda self: self._no_single("group_size"))

    # ---- moving and cutting: part by part, so every cut stays exact ----

    def to(self, device: torch.device | str) -> "PackedParts":
        if torch.device(device) == self.device:
            return self
        return PackedParts([p.to(device) for p in self.parts])

    def share_memory_(self) -> "PackedParts":
        for p in self.parts:
            p.share_memory_()
        return self

    def _with(self, fn, codes=None) -> "PackedParts":  # codes: a single weight's only
        return PackedParts([p._with(fn) for p in self.parts])

    def out_features(self, index: torch.Tensor | slice) -> "PackedWeight":
        """Output columns `index` (a tensor-parallel rank's heads): each run of columns inside one
        part is that part's rows, so the cut is exact; one kind left gives a plain PackedWeight."""
        columns = torch.arange(self.shape[1])[index]  # global column numbers, in the order asked
        starts = torch.tensor([0, *self.widths]).cumsum(0)  # [parts + 1]: where each part begins
        owner = torch.bucketize(columns, starts[1:], right=True)  # [n]: the part of each column
        pieces, begin = [], 0
        for i in range(1, len(columns) + 1):
            if i == len(columns) or owner[i] != owner[begin]:
                p = int(owner[begin])
                pieces.append(self.parts[p].out_features(columns[begin:i] - starts[p]))
                begin = i
        if not pieces:
            raise PackedWeightError(f"{self!r}: no output columns selected")
        pieces = join_same_kind(pieces)
        return pieces[0] if len(pieces) == 1 else PackedParts(pieces)

    def in_features(self, start: int, stop: int) -> "PackedParts":
        """Input rows [start, stop) of every part; each part refuses a cut inside its groups."""
        return PackedParts([p.in_features(start, stop) for p in self.parts])


def join_same_kind(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Neighbours of one kind (and group size) become one PackedWeight (W_q | W_k in Q4_K)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, PackedParts) else [p])]
    runs: list[list[PackedWeight]] = []
    for p in flat:
        if runs and runs[-1][0].kind == p.kind and runs[-1][0].group_size == p.group_size:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else cat_out_features(run) for run in runs]


def packed_leaves(w) -> list[PackedWeight]:
    """The plain PackedWeights inside w: its parts, or w itself."""
    return list(w.parts) if isinstance(w, PackedParts) else [w]
