"""The launch-overhead benchmark: every launcher timed with its kernels stubbed, and the kernels put back."""

import pytest
import torch

from stagewise.bench.scripts import launch_overhead as lo
from stagewise.kernels import INTERPRETER


@pytest.mark.skipif(not INTERPRETER, reason="the stubbed run is the CPU interpreter's")
def test_stubbed_run_times_every_launcher_and_restores_the_kernels():
    real = {(m, n): getattr(m, n) for m, names in lo.KERNELS.items() for n in names}
    rows = lo.launch_overhead(calls=2)
    assert [r["launcher"] for r in rows] == list(lo.decode_calls())
    assert all(r["cold_us"] > 0 and r["cached_us"] > 0 and not r["kernels_launched"] for r in rows)
    assert all(getattr(m, n) is kernel for (m, n), kernel in real.items())  # no stand-in left behind
    assert "paged_attention (decode)" in lo.format_rows(rows)


def test_a_stub_evaluates_the_grid_and_launches_nothing():
    out = torch.zeros(3)
    assert lo._NoLaunch()[lambda meta: (meta["n"] // 2,)](out, n=8) == (4,)
    assert torch.equal(out, torch.zeros(3))


def test_calls_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        lo.main(["--calls", "0"])
    assert "--calls must be >= 1" in capsys.readouterr().err
