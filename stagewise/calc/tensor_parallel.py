"""Tensor parallelism on paper: what one of N devices holds, and what the all-reduces cost.

`stagewise calc --tp N` splits the model the way `stagewise/parallel/` does
(Megatron-style: heads, FFN columns and vocabulary over N ranks, norms
replicated) and asks, per device:

- weights: the sharded model of one rank (`parallel.shard.local_config`)
  — Llama 3 405B in bf16 is 810 GB: 101 GB per device at N=8, too much for
  an 80 GB H100, fine on a 141 GB H200;
- KV cache per token: 2 * L * Hkv/N * d * bytes (each rank keeps its KV
  heads only; with N > Hkv a head is replicated, so it stops shrinking);
- communication: every block ends its attention and its FFN with an
  all-reduce of the [T, hidden] activations, 2 per block (plus 1 after the
  vocabulary-parallel embedding). A ring all-reduce of M bytes over N ranks
  sends and receives 2(N-1)/N * M per rank, so

      t(all-reduce) = 2(N-1)/N * M / link bandwidth + latency

  The latency term (launch + synchronisation, a few to tens of µs) does not
  shrink with M: a decode step of one 405B token all-reduces 16384 * 2 B =
  32 KB, 0.13 µs of NVLink bandwidth against ~10 µs of latency — latency-bound,
  which is why engines fuse, overlap or use one-shot all-reduces for small M.

The step times below are the roofline's speed of light of one rank's shard
plus the all-reduces, nothing overlapped: an upper bound on what TP saves.
The link numbers are per GPU, per direction, datasheet-rounded; the latencies
are rough orders of magnitude (measure yours with nccl-tests).
"""

from dataclasses import dataclass

from stagewise.calc.counts import Quantity, kv_bytes_per_token, num, weight_bytes
from stagewise.calc.hardware import Hardware
from stagewise.calc.steps import Capacity, Step, capacity, decode_step, prefill_step
from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError
from stagewise.parallel.shard import check_tp_size, local_config, shard_plan


@dataclass(frozen=True)
class Interconnect:
    name: str  # what to call it in tables
    bandwidth: float  # bytes/s per GPU per direction (what a ring all-reduce's steps run at)
    latency: float  # seconds one small all-reduce costs whatever its size (launch + synchronisation)
    notes: str = ""  # where the numbers come from


INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM, NVSwitch)", 450e9, 10e-6, "900 GB/s bidirectional per GPU"),
    "nvlink3": Interconnect("NVLink 3 (A100 SXM, NVSwitch)", 300e9, 10e-6, "600 GB/s bidirectional per GPU"),
    "pcie5": Interconnect("PCIe 5.0 x16", 50e9, 25e-6, "64 GB/s raw per direction, ~50 usable"),
    "pcie4": Interconnect("PCIe 4.0 x16", 25e9, 30e-6, "32 GB/s raw per direction, ~25 usable"),
}


# The link each hardware preset ships with: an A100 SXM board has NVLink 3, the H100/H200 SXM boards NVLink 4.
# A probed machine's link is unknown: PCIe 4.0 is the modest guess (say --interconnect when you know better).
DEFAULT_INTERCONNECT = {"h100": "nvlink4", "h200": "nvlink4", "h100-seeds": "nvlink4", "a100": "nvlink3"}


def default_interconnect(hardware: str) -> str:
    """'a100' -> 'nvlink3', 'h100' -> 'nvlink4'; anything else (the probe) -> 'pcie4'."""
    return DEFAULT_INTERCONNECT.get(hardware.strip().lower(), "pcie4")


def get_interconnect(name: str) -> Interconnect:
    key = name.strip().lower()
    if key not in INTERCONNECTS:
        raise StagewiseError(f"unknown interconnect '{name}'; choose one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[key]


def ring_all_reduce_time(message_bytes: float, n: int, link: Interconnect) -> Quantity:
    """2(N-1)/N * M / bandwidth + latency, for one all-reduce of M bytes over N ranks."""
    moved = 2 * (n - 1) / n * message_bytes
    value = moved / link.bandwidth + link.latency
    formula = (
        f"2(N-1)/N * M / bw + latency = 2*{n - 1}/{n} * {num(message_bytes)} / {link.bandwidth:.3g} "
        f"+ {link.latency * 1e6:g} µs"
    )
    return Quantity(value, "s", formula)


@dataclass(frozen=True)
class TensorParallelAnalysis:
    tp: int  # N, devices (ranks)
    link: Interconnect  # between the devices
    local: ModelConfig  # one rank's sizes: H/N heads, Hkv/N KV heads (or 1), inter/N, V/N
    weights_per_device: Quantity  # one rank's shards
    kv_per_token_per_device: Quantity  # its KV heads only
    capacity: Capacity  # per device: memory left for KV, largest batch at N tokens
    all_reduces_per_step: Quantity  # 2 per block + 1 (embedding)
    all_reduce_bytes_per_token_per_layer: Quantity  # 2 * hidden * bytes
    decode_message: Quantity  # one all-reduce of a decode step: B * hidden * bytes
    decode_all_reduce: Quantity  # its ring time
    decode_latency_share: Quantity  # latency / its ring time
    decode_comm: Quantity  # all the all-reduces of one decode step
    decode_shard: Step  # one rank's decode step on the roofline
    decode_time: Quantity  # shard + communication
    prefill_comm: Quantity  # the all-reduces of one prefill of B x N tokens
    prefill_shard: Step  # one rank's prefill on the roofline
    prefill_time: Quantity  # shard + communication


def analyze_tp(
    cfg: ModelConfig, hw: Hardware, n: int, dtype: str, nbytes: int, context: int, batch: int, link: Interconnect
) -> TensorParallelAnalysis:
    check_tp_size(cfg, n)
    local = local_config(cfg, shard_plan(cfg, 0, n))
    layers, hidden = cfg.num_layers, cfg.hidden_size
    count = 2 * layers + 1
    per_layer = 2 * hidden * nbytes
    decode_msg = batch * hidden * nbytes
    one = ring_all_reduce_time(decode_msg, n, link)
    prefill_one = ring_all_reduce_time(batch * context * hidden * nbytes, n, link)
    args = (local, hw, dtype, nbytes, context, batch)
    decode, prefill = decode_step(*args), prefill_step(*args)
    decode_comm = Quantity(count * one.value, "s", f"(2L+1) * t(all-reduce) = {count} * {one.value * 1e6:.3g} µs")
    prefill_comm = Quantity(count * prefill_one.value, "s", f"(2L+1) * ({prefill_one.formula})")
    return TensorParallelAnalysis(
        tp=n,
        link=link,
        local=local,
        weights_per_device=weight_bytes(local, nbytes),
        kv_per_token_per_device=kv_bytes_per_token(local, nbytes),
        capacity=capacity(local, hw, nbytes, context),
        all_reduces_per_step=Quantity(count, "all-reduces", f"2 per block * L + 1 (embedding) = 2*{layers} + 1"),
        all_reduce_bytes_per_token_per_layer=Quantity(
            per_layer, "B", f"2 all-reduces * hidden * bytes = 2 * {hidden} * {nbytes}"
        ),
        decode_message=Quantity(decode_msg, "B", f"B * hidden * bytes = {batch} * {hidden} * {nbytes}"),
        decode_all_reduce=one,
        decode_latency_share=Quantity(link.latency / one.value, "x", "latency / t(all-reduce): near 1 = latency-bound"),
        decode_comm=decode_comm,
        decode_shard=decode,
        decode_time=Quantity(decode.time.value + decode_comm.value, "s", "shard's speed of light + all-reduces"),
        prefill_comm=prefill_comm,
        prefill_shard=prefill,
        prefill_time=Quantity(prefill.time.value + prefill_comm.value, "s", "shard's speed of light + all-reduces"),
    )
