"""The soak (`bench soak`) with speculative decoding on: nothing lost, duplicated or leaked.

A short run with every fault of the full one (abandoned streams, real SIGINT
bursts on streams, a thread generating beside a stream, a pool small enough to
preempt), the n-gram proposer guessing throughout. The long run is
`stagewise bench soak --speculative ngram:4`.
"""

import torch

from stagewise.bench.commands.soak import SoakSettings, run_soak


def test_soak_with_speculation_loses_and_duplicates_nothing():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `bench soak` runs
    try:
        settings = SoakSettings(
            num_requests=16,
            num_kv_blocks=12,
            streams_every=8,
            arrivals_per_step=2,
            interrupts_every=7,
            threads_every=9,
            speculative="ngram:4",
        )
        result = run_soak(settings)
    finally:
        torch.set_num_threads(threads)
    summary = result["summary"]
    assert result["ok"], (summary, result["lost"], result["mismatched"])
    assert summary["lost_requests"] == summary["outputs_differing_from_alone"] == 0
    assert summary["blocks_held_at_end"] == 0 and summary["requests_ended_in_error"] == 0
    assert summary["preemptions"] > 0 and summary["interrupt_bursts"] >= 1
    assert summary["spec_draft_tokens"] > 0 and summary["spec_accepted_tokens"] > 0
