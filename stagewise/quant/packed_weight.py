"""`PackedWeight`: a projection kept as small integers and a few scales, for the model's life.

Decode reads every weight once per token, so a step takes about the time to
stream the weights from memory (the seeds' arithmetic: ~2 FLOPs per weight,
far below the ridge point). Four bits per weight instead of 32 is 8x fewer
bytes to stream. A GGUF file already holds them that way; this record keeps
them so, instead of expanding them to float32 at load.

The weights are cut into *groups* of G = 32 consecutive numbers along the
input axis K, and each group shares a scale d (and, for some formats, a
minimum m). Each number is stored as an integer code q:

    kind    bits  one weight                 per group         bytes per weight
    q4_0    4     w = d * (q - 8)            d (float16)       (16 + 2) / 32 = 0.5625
    q4_1    4     w = d * q + m              d, m (float16)    (16 + 4) / 32 = 0.625
    q8_0    8     w = d * q   (q signed)     d (float16)       (32 + 2) / 32 = 1.0625

These are llama.cpp's block formats, kept with their exact values: the codes
and the float16 scales are the file's own bits, only moved apart (codes in one
tensor, scales in another) so a kernel can read each with plain strides.

llama.cpp's K-quants ("Q4_K_M" files are mostly Q4_K with some Q6_K) group
256 values into a *super-block* with one or two float16 numbers (d, dmin) and
small integer sub-scales per group inside it. Every group's scale is then a
product, d * sc, of a float16 and a 6-bit (or 8-bit) integer: at most 11 + 8
significant bits, so float32 holds it exactly (float16, with 11, would not).
The super-blocks are expanded at load into plain groups with float32 scales,
the same numbers the reference computes, so every weight is bit for bit the
file's value:

    kind  file   one weight                      per group               bytes per weight
    q4_k  Q4_K   w = s * q + m    q 0..15, G 32  s = d*sc, m = -dmin*mn  0.5 + 8/32 = 0.75
    q5_k  Q5_K   w = s * q + m    q 0..31, G 32  (as q4_k, float32)      1 + 8/32 = 1.25
    q6_k  Q6_K   w = s * q        q -32..31, G 16  s = d*sc (sc int8)    1 + 4/16 = 1.25

(the file holds 0.5625, 0.6875 and 0.8203 bytes per weight: the expanded
scales cost memory, and bring the formats down to the three layouts every
tier already reads). q4_k is q4_1's layout with float32 scales; q5_k keeps one
5-bit code per byte (int8, 0..31); q6_k keeps q - 32 as a signed byte, like q8_0
with groups of 16.

A `PackedWeight` stands for a [K, N] = [in, out] matrix (the shape the stages
write `x @ w` with), stored "out-major" like the files: one row per output
feature n, holding that row's K codes.

    codes   4-bit: [N, K/2] uint8, two codes per byte in GGUF's block order: byte i
            of a 16-byte group holds value i in its low nibble and value i + 16 in
            its high nibble.   8-bit: [N, K] int8, one code per byte.
    scales  [N, K/G] float16 (K-quants: float32): d of every group
    mins    [N, K/G] like scales: m of every group (q4_1, q4_k, q5_k), else None

A tied embedding table [vocab, hidden] is the LM head's storage read by rows
(row n = token n), so one `PackedWeight` serves both. `prepared` caches the
forms other tiers build from the codes (e.g. the torch tier's int4pack), once.

One layout held, not two. The CPU's default tier reads its own form of the
codes (`int4pack.py`: the same 4 bits per code, in the kernel's order; q8_0
and q5_k as two 4-bit halves). Holding that form *and* the file's codes would
hold every code twice: SmolLM2-135M's Q4_1 file is 96.6 MB of blocks, and its
tensors came to 198 MB. So once the torch tier has built an int4pack form,
`release_codes` drops the file-layout codes, and `codes` (a property) rebuilds
them from the form, exactly, whenever another reader asks: the naive and
Triton tiers, a tensor-parallel cut, `to()` another device. The trade is bytes
for time: 0.5 bytes per 4-bit weight (1 per 8-bit one) no longer held, against
a rebuild of ~0.1-0.2 us per weight when the whole matrix is asked for
(measured on 2 shared cores, indicative: SmolLM2's 49152 x 576 table, 28 M
codes, ~5 s). So the rebuilt codes are kept (a weight two tiers read holds both
layouts, as before), and forms are built only for the weights the torch tier
reads (`models.prepare.build_packed_forms` leaves the others as they are). The
embedding's row gather asks for a few rows (`code_rows`): those T rows are
rebuilt, T x K bytes read (~0.2 ms for 3 rows of that table), not the table.
`scales` and `mins` stay in the file's float16 (a few percent of the bytes),
so the naive tier still computes the file's numbers bit for bit. A q6_k weight
(and an 8-bit one with N not a multiple of 16) keeps its codes: its torch form
is a bfloat16 copy, which rounds, so the codes cannot come back from it.
"""

import torch

from stagewise.quant import int4pack

GROUP_SIZE = 32  # values per group (llama.cpp's QK4_0 = QK4_1 = QK8_0 = 32)
KINDS = {  # kind -> (bits held per code, offset subtracted from q, has a minimum)
    "q4_0": (4, 8, False),
    "q4_1": (4, 0, True),
    "q8_0": (8, 0, False),
    "q4_k": (4, 0, True),
    "q5_k": (8, 0, True),
    "q6_k": (8, 0, False),
}
# kind -> (code dtype, scale dtype, fixed group size or None: any multiple the tiers take)
LAYOUT = {
    "q4_0": (torch.uint8, torch.float16, None),
    "q4_1": (torch.uint8, torch.float16, None),
    "q8_0": (torch.int8, torch.float16, None),
    "q4_k": (torch.uint8, torch.float32, 32),
    "q5_k": (torch.int8, torch.float32, 32),
    "q6_k": (torch.int8, torch.float32, 16),
}


class PackedWeightError(ValueError):
    """A packed weight whose parts do not fit together (shapes, dtypes, group boundaries)."""


class PackedWeight:
    """kind + integer codes + per-group scales (and minimums): the tables above."""

    def __init__(
        self,
        kind: str,  # "q4_0", "q4_1", "q8_0", "q4_k", "q5_k" or "q6_k" (the tables above)
        codes: torch.Tensor,  # [N, K/2] uint8 (4-bit) or [N, K] int8 (8-bit): the integer codes
        scales: torch.Tensor,  # [N, K/G] float16 (K-quants float32): one scale d per group
        mins: torch.Tensor | None = None,  # [N, K/G] like scales (q4_1, q4_k, q5_k), else None
        group_size: int | None = None,  # G: values per group along K (None: the kind's, else 32)
    ) -> None:
        self.kind, self.scales, self.mins, self.group_size = kind, scales, mins, group_size
        self._codes: torch.Tensor | None = codes  # the file layout; None once released
        # tier -> what it built from the codes once (its own layout); not part of the weight's value
        self.prepared: dict = {}
        if kind not in KINDS:
            raise PackedWeightError(f"unknown packed kind '{kind}'; known: {', '.join(KINDS)}")
        if codes.dim() != 2 or codes.dtype != LAYOUT[kind][0]:
            raise PackedWeightError(
                f"{kind}: codes must be 2-D {LAYOUT[kind][0]}, got {codes.dtype} "
                f"{tuple(codes.shape)}"
            )
        per_byte = 2 if KINDS[kind][0] == 4 else 1
        self._shape = (codes.shape[1] * per_byte, codes.shape[0])  # [K, N], whichever form is held
        self._check()

    def _check(self) -> None:
        _, _, has_mins = KINDS[self.kind]
        _, scale_dtype, fixed_group = LAYOUT[self.kind]
        if self.group_size is None:
            self.group_size = fixed_group or GROUP_SIZE
        if fixed_group is not None and self.group_size != fixed_group:
            raise PackedWeightError(
                f"{self.kind}: groups are {fixed_group} values, got group_size {self.group_size}"
            )
        n, k = self.shape[1], self.shape[0]
        groups = k // self.group_size if self.group_size else 0
        if self.group_size <= 0 or k % self.group_size:
            raise PackedWeightError(
                f"{self.kind}: K = {k} is not a whole number of groups of {self.group_size}"
            )
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is None:
                continue
            if t.dtype != scale_dtype or tuple(t.shape) != (n, groups):
                raise PackedWeightError(
                    f"{self.kind}: {name} must be {scale_dtype} [{n}, {groups}], got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
        if has_mins != (self.mins is not None):
            raise PackedWeightError(f"{self.kind}: mins {'missing' if has_mins else 'unexpected'}")

    # ---- the codes: the file's layout, held or rebuilt from the torch tier's form ----

    @property
    def codes(self) -> torch.Tensor:
        """[N, K/2] uint8 or [N, K] int8, the file's layout.

        When released, they are rebuilt exactly from the int4pack form the first time a reader
        asks for the whole matrix, and held from then on: a weight read in two layouts (another
        tier beside the torch one) keeps both, rather than paying the rebuild at every call.
        """
        if self._codes is None:
            self._codes = self.code_rows(None)
        return self._codes

    @property
    def codes_held(self) -> bool:
        """True while the file-layout codes are held (False: rebuilt from the int4pack form)."""
        return self._codes is not None

    def code_rows(self, rows: torch.Tensor | slice | None) -> torch.Tensor:
        """File-layout codes of some storage rows ([T, ...]; all of them when rows is None)."""
        if self._codes is not None:
            return self._codes if rows is None else self._codes[rows]
        if isinstance(rows, slice):
            rows = torch.arange(self.shape[1])[rows]
        if len(self.prepared["torch"]) == 1:  # the rows8 form (one tensor): codes moved, not split
            from stagewise.quant import rows8  # rows8 builds on this module

            codes = rows8.unpack_rows(self.prepared["torch"][0], self.bits, rows)
            return codes[: self.shape[1]] if rows is None else codes
        packed, _ = self.prepared["torch"]  # int4pack: [N, K/2] (8-bit: [N, 2K] codes' halves)
        q = int4pack.unpack(packed) if rows is None else int4pack.unpack_rows(packed, rows)
        k = self.shape[0]
        if self.bits == 8:  # [T, 2K] 0..15: high nibbles, then low ones; q = 16 (h - 8) + l
            high, low = q[:, :k].to(torch.int16), q[:, k:].to(torch.int16)
            return (16 * (high - 8) + low).to(torch.int8)  # [T, K]
        # [T, K] codes -> groups' bytes: byte i holds value i (low nibble), value i + G/2 (high)
        g = q.view(q.shape[0], k // self.group_size, 2, self.group_size // 2)  # [T, K/G, 2, G/2]
        return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(q.shape[0], k // 2)  # [T, K/2]

    def file_parts(self) -> dict[str, torch.Tensor]:
        """codes, scales (and mins) by name, in the file's layout, for who describes the weight
        (the tracer): released codes come as a shape-only tensor (device "meta"), not rebuilt."""
        codes = self._codes
        if codes is None:
            k, n = self.shape
            shape = (n, k // 2) if self.bits == 4 else (n, k)
            codes = torch.empty(shape, dtype=LAYOUT[self.kind][0], device="meta")
        parts = {"codes": codes, "scales": self.scales}
        return parts if self.mins is None else {**parts, "mins": self.mins}

    def release_codes(self) -> None:
        """Drop the file-layout codes, if the torch tier's form holds them all.

        The form is exact for the int4pack, two-nibble and rows8 forms (every code's bits kept,
        nothing rounded); a bfloat16 copy (q6_k, or N not a multiple of 16) is not, and then the
        codes stay.
        """
        form = self.prepared.get("torch")
        if isinstance(form, tuple) and form[0].device == self.scales.device:
            self._codes = None

    # ---- what the weight is ----

    @property
    def bits(self) -> int:
        return KINDS[self.kind][0]

    @property
    def offset(self) -> int:
        """Subtracted from every code before the scale (q4_0: 8, so codes 0..15 mean -8..7)."""
        return KINDS[self.kind][1]

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix this stands for, [K, N] = [in, out] (storage is [N, ...], out-major)."""
        return self._shape

    @property
    def device(self) -> torch.device:
        return self.scales.device

    @property
    def dtype(self) -> str:
        """The format's name where a tensor would say its dtype (the tracer prints it)."""
        return self.kind

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        """The weight's bytes in the file's layout: codes, scales, mins (what a decode step reads).

        The same number whichever form holds the codes (int4pack's bytes equal the file's);
        `held_bytes` is what this object keeps in memory.
        """
        k, n = self.shape
        code_bytes = n * k * self.bits // 8
        parts = [self.scales] + ([self.mins] if self.mins is not None else [])
        return code_bytes + sum(t.numel() * t.element_size() for t in parts)

    def held_bytes(self) -> int:
        """Bytes this object keeps: file codes (unless released), scales, mins, `prepared` forms."""
        released = 0 if self._codes is not None else self.shape[0] * self.shape[1] * self.bits // 8
        return self.nbytes - released + self.prepared_bytes()

    def prepared_bytes(self) -> int:
        """Bytes of the forms other tiers built from the codes (tensors in `prepared`)."""
        total = 0
        for value in self.prepared.values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def row_bytes(self) -> int:
        """Bytes of one storage row (one output feature; one token of an embedding table)."""
        return self.nbytes // self.shape[1]

    def __repr__(self) -> str:
        k, n = self.shape
        return f"PackedWeight({self.kind}, [K={k}, N={n}], group {self.group_size}, {self.device})"

    # ---- moving and cutting (all exact: whole rows, whole groups) ----

    def _with(self, fn, codes: torch.Tensor | None = None) -> "PackedWeight":
        """A new weight of fn(part, name) for each part (codes: given, or fn of the full codes)."""
        mins = None if self.mins is None else fn(self.mins, "mins")
        codes = fn(self.codes, "codes") if codes is None else codes
        return PackedWeight(self.kind, codes, fn(self.scales, "scales"), mins, self.group_size)

    def to(self, device: torch.device | str) -> "PackedWeight":
        """The same codes and scales on `device` (a packed weight has no float dtype to cast)."""
        if torch.device(device) == self.device:
            return self
        return self._with(lambda t, _: t.to(device))

    def share_memory_(self) -> "PackedWeight":
        """Codes, scales and prepared forms into shared memory (a spawned process gets handles)."""
        forms = [t for v in self.prepared.values() for t in (v if isinstance(v, tuple) else (v,))]
        for t in (self._codes, self.scales, self.mins, *forms):
            if isinstance(t, torch.Tensor):
                t.share_memory_()
        return self

    def out_features(self, index: torch.Tensor | slice) -> "PackedWeight":
        """Some output features (storage rows): a head permutation, a tensor-parallel shard."""
        codes = self.code_rows(index).contiguous()  # only these rows rebuilt, if released
        return self._with(lambda t, _: t[index].contiguous(), codes)

    def in_features(self, start: int, stop: int) -> "PackedWeight":
        """Input features [start, stop) (a row-parallel shard), both on group boundaries."""
        g = self.group_size
        if start % g or stop % g:
            raise PackedWeightError(
                f"{self.kind}: input range [{start}, {stop}) does not fall on groups of {g}; "
                "a packed weight is cut only between groups"
            )
        per_byte = 2 if self.bits == 4 else 1

        def cut(t: torch.Tensor, name: str) -> torch.Tensor:
            if name == "codes":
                return t[:, start // per_byte : stop // per_byte].contiguous()
            return t[:, start // g : stop // g].contiguous()

        return self._with(cut)


def cat_out_features(parts: list[PackedWeight]) -> PackedWeight:
    """[K, N1], [K, N2], ... of one kind -> [K, N1 + N2 + ...] (W_q | W_k | W_v, gate | up)."""
    first = parts[0]
    if any(p.kind != first.kind or p.shape[0] != first.shape[0] for p in parts):
        kinds = ", ".join(f"{p.kind} K={p.shape[0]}" for p in parts)
        raise PackedWeightError(
            f"cannot concatenate packed weights of different kinds or K: {kinds}"
        )
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return PackedWeight(
        first.kind,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
        first.group_size,
    )


def is_packed(w) -> bool:
    return isinstance(w, PackedWeight)
