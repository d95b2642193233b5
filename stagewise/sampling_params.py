"""`SamplingParams`: how one request turns next-token logits into a token.

A request carries one frozen `SamplingParams`. The engine turns the params of
every running request into per-row tensors (`SamplingTensors`, below) once per
step, and the sampling stage applies them in this order (the seed's order, as
in vLLM):

    repetition penalty -> greedy? (temperature < 1e-5: argmax) -> temperature
    -> min_p -> top-k -> top-p -> draw

It sits beside `config.py`, in the ground layer: the engine, the sampling stage
and the Triton sampling kernel all read both classes, and none of them imports
another (the kernel sits below the stage, the stage below the engine).

Every value is checked here, at construction, so a bad parameter fails with a
one-line `StagewiseError` (a `ValueError`) that names the parameter and its
allowed range, before any request is queued.
"""

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from stagewise.errors import StagewiseError
from stagewise.runtime import to_device

GREEDY_TEMPERATURE = 1e-5  # temperatures below this mean greedy decoding (argmax)
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal positive float32
# A repetition penalty divides or multiplies a logit, and can push it past float32 (2.0 / 1e-38); the
# samplers clamp penalized logits to +-1e33, so that even divided by the smallest sampling temperature
# (1e-5) they stay below 1e38, finite in float32. Real logits are far inside (|z| < 1e3): the clamp
# changes no ordinary result.
PENALIZED_LOGIT_MAX = 1e33
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds travel in an int64 tensor
MAX_SAMPLES = 16  # the most samples one request may ask for (SamplingParams.n)


def _is_int(value) -> bool:
    """A Python or numpy integer (numpy registers its scalars with `numbers`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value) -> str:
    """The value as the error message shows it: its repr, cut to 40 characters (10**400 stays one line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
    # per generated token, the log-probabilities of the k most likely tokens and of the token drawn:
    # the raw float32 log-softmax of the step's logits, as computed (RequestOutput.logprobs); None: off
    logprobs: int | None = None
    # parallel sampling: n samples of the prompt, 1 <= n <= MAX_SAMPLES; in paged mode they share the
    # prompt's K/V blocks (copy-on-write). Seeded, sample i draws with sample_seed(seed, i): seed + i
    n: int = 1

    def __post_init__(self) -> None:
        # Integers travel to the device as int64 (top_k; max_tokens is counted beside int64 positions):
        # one beyond 2**63 - 1 could be queued, then fail inside every step that converts it.
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise StagewiseError(f"max_tokens must be an int in [1, 2**63 - 1], got {_shown(self.max_tokens)}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise StagewiseError(f"top_k must be an int in [1, 2**63 - 1], or 0 / -1 for off, got {_shown(self.top_k)}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # numpy ints become Python ints
        object.__setattr__(self, "top_k", int(self.top_k))
        self._check_real("temperature", low=0.0, high=FLOAT32_MAX, low_open=False, high_open=False)
        self._check_real("top_p", low=0.0, high=1.0, low_open=True, high_open=False)
        self._check_real("min_p", low=0.0, high=1.0, low_open=False, high_open=False)
        # Positive and a normal float32 (the sampler computes in float32): 1e-300 would round to 0 there.
        self._check_real("repetition_penalty", low=FLOAT32_TINY, high=FLOAT32_MAX, low_open=False, high_open=False)
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise StagewiseError(f"seed must be None or an int in [-2**63, 2**63 - 1], got {_shown(self.seed)}")
        if self.seed is not None:  # -1 means "no seed" in vLLM: a fresh random draw per request
            object.__setattr__(self, "seed", None if self.seed == -1 else int(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise StagewiseError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))  # frozen: store the list as a tuple
        if not isinstance(self.ignore_eos, bool):
            raise StagewiseError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not 0 <= self.logprobs <= INT64_MAX:
                raise StagewiseError(f"logprobs must be None or an int >= 0, got {_shown(self.logprobs)}")
            object.__setattr__(self, "logprobs", int(self.logprobs))
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise StagewiseError(f"n must be an int in [1, {MAX_SAMPLES}], got {_shown(self.n)}")
        object.__setattr__(self, "n", int(self.n))

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
            raise StagewiseError(f"{name} must be a finite number in {interval}, got {_shown(value)}")
        object.__setattr__(self, name, float(value))

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature < 1e-5): the argmax, no randomness."""
        return self.temperature < GREEDY_TEMPERATURE


def sample_seed(seed: int, i: int) -> int:
    """The seed of sample i (0 .. n-1) of a request seeded with `seed`: seed + i, as vLLM does.

    So sample 0 draws as the same request with n = 1, and every sample has its own reproducible
    stream. The count skips -1 (which means "no seed") and wraps around within int64.
    """
    value = seed + i
    if seed < -1 <= value:
        value += 1
    return (value - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingTensors:
    """Per-row sampling settings for one engine step (row b = the b-th scheduled sequence).

    The tensors feed the kernels; the host fields below say the same things as Python values
    (they come from `SamplingParams`, host objects), so a step decides which work to do, and
    seeds the naive path's generators, without reading a device tensor back.
    """

    temperature: Tensor  # [B] float32; < 1e-5 = greedy
    top_k: Tensor  # [B] int64; 0 = off (SamplingParams' -1 is stored as 0)
    top_p: Tensor  # [B] float32; 1.0 = off
    min_p: Tensor  # [B] float32; 0.0 = off
    repetition_penalty: Tensor  # [B] float32; 1.0 = off
    seen: Tensor  # [B, V] bool; tokens in the prompt or generated so far (the penalized set)
    seeds: Tensor  # [B] int64; the request's seed
    # [B] int64; tokens this request has drawn so far (position in its random stream)
    offsets: Tensor
    greedy_rows: list[bool]  # [B] host: row b decodes greedily (temperature < 1e-5)
    seeds_host: list[int]  # [B] host: the seeds above
    offsets_host: list[int]  # [B] host: the offsets above
    any_penalty: bool  # host: some row has repetition_penalty != 1
    any_min_p: bool  # host: some row has min_p > 0
    any_top_k: bool  # host: some row has top_k > 0
    any_top_p: bool  # host: some row has top_p < 1

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seen: Tensor,
        offsets: list[int],
        seeds: list[int],
        device: torch.device | str,
    ) -> "SamplingTensors":
        """Stack the requests' params into row tensors (and host flags).

        `seeds[b]` is used when `params[b].seed` is None (the engine picks it once per
        request and keeps it); a seed set in the params always wins.
        """
        num_seqs = len(params)
        if not (len(offsets) == len(seeds) == num_seqs and seen.dim() == 2 and seen.shape[0] == num_seqs):
            raise ValueError(
                f"from_params: {num_seqs} params need seen [{num_seqs}, V] and {num_seqs} offsets and seeds, "
                f"got seen {list(seen.shape)}, {len(offsets)} offsets, {len(seeds)} seeds"
            )
        row_seeds = [p.seed if p.seed is not None else s for p, s in zip(params, seeds)]
        top_k = [max(p.top_k, 0) for p in params]  # -1 and 0 both mean off -> 0
        if torch.device(device).type == "cuda" and seen.device.type == "cpu":
            seen = seen.pin_memory().to(device, non_blocking=True)  # from pinned memory: queued, no host wait
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            min_p=to_device([p.min_p for p in params], torch.float32, device),
            repetition_penalty=to_device([p.repetition_penalty for p in params], torch.float32, device),
            seen=seen.to(device=device, dtype=torch.bool),
            seeds=to_device(row_seeds, torch.int64, device),
            offsets=to_device(list(offsets), torch.int64, device),
            greedy_rows=[p.greedy for p in params],
            seeds_host=row_seeds,
            offsets_host=list(offsets),
            any_penalty=any(p.repetition_penalty != 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1 for p in params),
        )

    @property
    def greedy(self) -> Tensor:
        return self.temperature < GREEDY_TEMPERATURE  # [B] bool

    @property
    def all_greedy(self) -> bool:
        """True when every row is greedy: the step needs no probabilities and no randomness (host flags)."""
        return all(self.greedy_rows)
