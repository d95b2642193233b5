"""Launch plans kept per shape key, and the tuned kernel called directly once the tuner has chosen.

A launcher does two kinds of host work. Checks (dtype, layout, shape) must
run on every call: the tensors are new each time. A *plan* (grid, block
sizes, the `triton.Config`, the split count) depends only on plain values:
shapes, dtypes, the device. A decode step repeats the same few shapes
hundreds of times (SmolLM2-135M: ~10 launches a layer x 30 layers), so each
launcher computes its plan once per key and looks it up afterwards.

    @plan_cache
    def rope_launch_plan(num_tokens, num_heads, ...) -> ...:   # ints, dtypes, Targets only

Keys are plain hashable values, never tensors (a tensor hashes by identity:
every call would miss, and the cache would keep the tensors alive). A plan is
shared by every caller of its key: it is a tuple or a frozen dataclass, and a
dict in it (launch keyword arguments) is never modified by a launcher.

On a GPU a launch through `triton.autotune` pays the autotuner's Python on
every call too (it rebuilds its key from the arguments, then looks it up).
Once it has chosen a config for our key, `launch_tuned` calls the jitted
kernel directly with that config's meta-parameters, num_warps and num_stages.
Our key must be at least as fine as the autotuner's (its key arguments plus
every tensor argument's dtype), so one chosen config serves every call that
maps to it.
"""

import functools

PLAN_CACHE_SIZE = 4096  # per launcher: decode + a few hundred prefill lengths, a few bytes each

_caches: list = []  # every @plan_cache function, for clear_plan_caches
_tuned: dict = {}  # (kernel name, launcher's key) -> the chosen config's launch kwargs


def plan_cache(fn):
    """`functools.lru_cache` for a plan function of plain hashable arguments, registered for
    `clear_plan_caches`; the uncached function stays reachable as `fn.__wrapped__`."""
    cached = functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(fn)
    _caches.append(cached)
    return cached


def clear_plan_caches() -> None:
    """Forget every cached plan and every tuned choice (benchmarks: the cold path; tests)."""
    for cached in _caches:
        cached.cache_clear()
    _tuned.clear()


def launch_tuned(autotuner, kernel, key: tuple, grid, args: dict) -> None:
    """Launch `kernel` with the config `autotuner` chose for `key`; the first call tunes.

    The first call for a key goes through the autotuner (it benchmarks its candidates, or finds
    its cached choice) and records `autotuner.best_config`, the config that launch used; later
    calls skip the autotuner's wrapper and pass that config's keyword arguments themselves.
    """
    options = _tuned.get(key)
    if options is None:
        autotuner[grid](**args)
        config = autotuner.best_config
        if config.pre_hook is None:  # a config with a hook must run it: it keeps the autotuner
            _tuned[key] = _launch_kwargs(config)
        return
    kernel[grid](**args, **options)


def _launch_kwargs(config) -> dict:
    """What the autotuner passes the kernel for `config`: its meta-parameters, warps, stages (and,
    where Triton has them, ctas and a register cap: `Config.all_kwargs`)."""
    if hasattr(config, "all_kwargs"):
        return config.all_kwargs()
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def tuned_choices() -> dict:
    """What `launch_tuned` has recorded so far: (kernel, key) -> launch kwargs."""
    return dict(_tuned)


def cdiv(x: int, y: int) -> int:
    """Ceil division of host ints (`triton.cdiv` is a constexpr_function in triton 3.9: ~100x
    slower to call)."""
    return -(-x // y)


def next_power_of_2(x: int) -> int:
    """The smallest power of 2 >= x, for x >= 1 (0 for 0, as `triton.next_power_of_2`), in one
    int method call: 37 -> (36).bit_length() = 6 -> 64."""
    return 1 << (x - 1).bit_length() if x > 0 else 0
