"""`SamplingParams`: how one request turns next-token logits into a token.

A request carries one frozen `SamplingParams`. The engine turns the params of
every running request into per-row tensors (`stagewise.stages.sampling.
SamplingTensors`) once per step, and the sampling stage applies them in this
order (the seed's order, as in vLLM):

    repetition penalty -> greedy? (temperature < 1e-5: argmax) -> temperature
    -> min_p -> top-k -> top-p -> draw

It sits beside `config.py`, in the ground layer: the engine, the sampling stage
and the Triton sampling kernel all read it, and none of them imports another.

Every value is checked here, at construction, so a bad parameter fails with a
one-line `StagewiseError` (a `ValueError`) that names the parameter and its
allowed range, before any request is queued.
"""

import math
import numbers
from dataclasses import dataclass

from stagewise.errors import StagewiseError

GREEDY_TEMPERATURE = 1e-5  # temperatures below this mean greedy decoding (argmax)
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal positive float32
# A repetition penalty divides or multiplies a logit, and can push it past float32 (2.0 / 1e-38); the
# samplers clamp penalized logits to +-1e33, so that even divided by the smallest sampling temperature
# (1e-5) they stay below 1e38, finite in float32. Real logits are far inside (|z| < 1e3): the clamp
# changes no ordinary result.
PENALIZED_LOGIT_MAX = 1e33
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds travel in an int64 tensor


def _is_int(value) -> bool:
    """A Python or numpy integer (numpy registers its scalars with `numbers`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A real number (int, float, numpy float or int), not a bool or a complex."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64  # most tokens to generate for the request (>= 1)
    temperature: float = 1.0  # divides the logits; < 1e-5 means greedy (argmax), >= 0
    top_k: int = -1  # keep the k most likely tokens; 0 or -1 = off
    top_p: float = 1.0  # keep the smallest top set whose mass >= top_p, in (0, 1]; 1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob, in [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; > 1 discourages tokens already in prompt or output; 1 = off
    seed: int | None = None  # per-request random seed; None (or -1, as in vLLM) = the engine picks one
    stop: tuple[str, ...] = ()  # stop strings: generation ends at the first one (a list is accepted)
    ignore_eos: bool = False  # keep generating past the end-of-sequence token (for benchmarks)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise StagewiseError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise StagewiseError(f"top_k must be an int >= 1, or 0 / -1 for off, got {self.top_k!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # numpy ints become Python ints
        object.__setattr__(self, "top_k", int(self.top_k))
        self._check_real("temperature", low=0.0, high=FLOAT32_MAX, low_open=False, high_open=False)
        self._check_real("top_p", low=0.0, high=1.0, low_open=True, high_open=False)
        self._check_real("min_p", low=0.0, high=1.0, low_open=False, high_open=False)
        # Positive and a normal float32 (the sampler computes in float32): 1e-300 would round to 0 there.
        self._check_real("repetition_penalty", low=FLOAT32_TINY, high=FLOAT32_MAX, low_open=False, high_open=False)
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise StagewiseError(f"seed must be None or an int in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.seed is not None:  # -1 means "no seed" in vLLM: a fresh random draw per request
            object.__setattr__(self, "seed", None if self.seed == -1 else int(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise StagewiseError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))  # frozen: store the list as a tuple
        if not isinstance(self.ignore_eos, bool):
            raise StagewiseError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    def _check_real(self, name: str, low: float, high: float, low_open: bool, high_open: bool) -> None:
        """Check a finite real number in a range and store it as a float."""
        value = getattr(self, name)
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        try:
            ok = _is_real(value) and math.isfinite(value)
        except OverflowError:  # an int beyond any float (10**400)
            ok = False
        ok = ok and (value > low if low_open else value >= low)
        ok = ok and (value < high if high_open else value <= high)
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise StagewiseError(f"{name} must be a finite number in {interval}, got {shown}")
        object.__setattr__(self, name, float(value))

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature < 1e-5): the argmax, no randomness."""
        return self.temperature < GREEDY_TEMPERATURE
