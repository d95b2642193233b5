"""Tiles for the memory-bound row kernels: how they keep enough bytes in flight.

RoPE, the embedding gather, the KV store and silu_and_mul do (almost) no
arithmetic: each is as fast as the bytes it moves, *if* the GPU keeps enough
loads in flight to cover the memory latency. Little's law says how many:

    bytes in flight = bandwidth x latency ~ 4.8 TB/s x ~1-1.5 us ~ 5-7 MB on an H200
                    ~ 40-55 KB per SM (132 SMs)

A load occupies its destination registers until the data arrives, so what an
SM keeps in flight is (resident programs) x (bytes each has asked for and not
yet received). A program that copies one 2 KB token row, waits, stores and
exits — the first version of these kernels — leaves most of that pipe empty.
The rules the kernels follow:

1. Many bytes per program. A program handles BLOCK_T tokens at once, as one
   2-D or 3-D tile ([BLOCK_T, columns] or [BLOCK_T, heads, head_dim]), so it
   asks for BLOCK_T rows in one go and pays its fixed costs (index loads,
   address math, scheduling) once per tile. The tile is sized to ~4-16K
   elements: enough bytes, few enough registers that several programs still
   fit on an SM. The last tile of the batch is ragged: its rows past T are
   masked off.
2. Every load before any wait. Independent loads issue back to back and their
   latencies overlap. A load written after a store waits for that store's
   data, and the compiler will not hoist it above a store that might alias. So
   a kernel loads everything (q *and* k, K *and* V, gate *and* up) first.
3. No index load in front of data that does not depend on it. The KV store's
   slot says where to *write*, not what to read; RoPE's position picks cos/sin,
   not q and k. Those data loads go out first; the index load travels with them.
4. 16-byte vectors. Triton turns a load into 16-byte accesses (8 bf16) when it
   can prove 8 consecutive addresses are contiguous and 16-byte aligned: the
   innermost tile dimension is a `tl.arange`, strides are integers Triton
   specialises as multiples of 16, masks are constant over runs of 8.

How many tokens per program and warps per program is best depends on the GPU
(registers, latency, L2): under the CPU interpreter a launcher uses the one
tile `tokens_per_program` gives; on a GPU it lets `@triton.autotune` pick among
a few candidates around it (`gpu_candidates`), keyed on the kernel's row shape
and a power-of-two bucket of T (so a decode step and a long prefill tune apart,
but every step length in a bucket reuses one result). In-place kernels (RoPE)
are not autotuned: tuning reruns the kernel, and undoing an in-place rotation
between trials would copy q and k each time.
"""

from dataclasses import dataclass

import triton

from stagewise.kernels.plan_cache import launch_tuned, next_power_of_2

MAX_TOKENS_PER_PROGRAM = 64  # more than this buys nothing: the tile is big enough long before
MAX_BUCKET = 1 << 16  # longer batches share one tuning result


@dataclass(frozen=True)
class TileConfig:
    block_t: int  # tokens (rows) per program, a power of 2
    num_warps: int  # GPU only: warps per program
    block_c: int = 0  # columns per program (embedding, silu_and_mul); 0 for kernels tiled by heads

    def meta(self) -> dict:
        """The tile's constexpr meta-parameters, as the kernel names them."""
        return {"BLOCK_T": self.block_t} | ({"BLOCK_C": self.block_c} if self.block_c else {})

    def triton_config(self) -> "triton.Config":
        return triton.Config(self.meta(), num_warps=self.num_warps)


def tokens_per_program(num_tokens: int, elements_per_token: int, budget: int) -> int:
    """The largest power of 2 `b` with b * elements_per_token <= budget (at least 1, at most T
    rounded up)."""
    block_t = 1
    cap = min(triton.next_power_of_2(max(num_tokens, 1)), MAX_TOKENS_PER_PROGRAM)
    while block_t < cap and 2 * block_t * elements_per_token <= budget:
        block_t *= 2
    return block_t


def warps_for(tile_elements: int) -> int:
    """4 warps for tiles up to 4K elements, 8 above: ~16-32 elements (2-4 16-byte vectors) per
    thread."""
    return 4 if tile_elements <= 4096 else 8


def gpu_candidates(best: TileConfig) -> tuple[TileConfig, ...]:
    """What the GPU autotuner tries: the rule-of-thumb tile, half and twice as many tokens, and
    other warps."""
    tokens = sorted(
        {max(1, best.block_t // 2), best.block_t, min(MAX_TOKENS_PER_PROGRAM, 2 * best.block_t)}
    )
    return tuple(TileConfig(t, w, best.block_c) for t in tokens for w in (4, 8))


def token_bucket(num_tokens: int) -> int:
    """Next power of 2 >= T, capped: the autotune key's stand-in for T."""
    return min(next_power_of_2(max(num_tokens, 1)), MAX_BUCKET)


_autotuners: dict = {}


def autotuner(kernel, candidates: tuple[TileConfig, ...], key: tuple[str, ...]):
    """One `triton.autotune` wrapper per (kernel, candidate list, key), built on first use."""
    cache_key = (id(kernel), candidates, key)  # kernels are module-level: their ids stay valid
    if cache_key not in _autotuners:
        configs = [c.triton_config() for c in candidates]
        _autotuners[cache_key] = triton.autotune(configs, key=list(key))(kernel)
    return _autotuners[cache_key]


def launch(kernel, candidates: tuple[TileConfig, ...], key: tuple[str, ...], grid, **args) -> None:
    """Launch `kernel` with one fixed tile, or (several candidates: GPU only) through its autotuner.

    `grid` is a function of the meta-parameters (`meta["BLOCK_T"]`, ...), as Triton's launch
    accepts. Autotuned, only a key's first launch goes through the autotuner: later ones call the
    kernel with its choice (`plan_cache.launch_tuned`), keyed as the autotuner keys: the `key`
    arguments' values and every tensor argument's dtype.
    """
    if len(candidates) == 1:
        (tile,) = candidates
        kernel[grid](**args, **tile.meta(), num_warps=tile.num_warps)
        return
    dtypes = tuple(v.dtype for v in args.values() if hasattr(v, "dtype"))
    tuned_key = (id(kernel), candidates, tuple(args[name] for name in key), dtypes)
    launch_tuned(autotuner(kernel, candidates, key), kernel, tuned_key, grid, args)
