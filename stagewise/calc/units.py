"""Quantities as text: decimal prefixes, readable durations, and one `Quantity` for a table cell.

    si(1.216e17, "FLOP")  -> '121.6 PFLOP'
    seconds(0.0042)       -> '4.2 ms'
    human(weight_bytes(PRESETS["llama-3-8b"], 2))  -> '16.06 GB'

The `stagewise calc` command and notebooks 08, 11 and 13 print the calculator's numbers with these.
"""

from stagewise.calc.counts import Quantity

_PREFIXES = [(1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]


def si(value: float, unit: str) -> str:
    """1.216e17, 'FLOP' -> '121.6 PFLOP' (decimal prefixes, as the seeds use)."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.3g} h"
    if value >= 60:
        return f"{value / 60:.3g} min"
    for scale, name in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if value >= scale:
            return f"{value / scale:.3g} {name}"
    return f"{value * 1e9:.3g} ns"


def human(q: Quantity) -> str:
    """A Quantity for a table cell."""
    if q.unit == "s":
        return seconds(q.value)
    if q.unit == "B":
        if q.value < 1000:
            return f"{int(q.value)} B"
        exact = f"{int(q.value):,} B = " if q.value < 1e8 else ""
        return exact + si(q.value, "B")
    if q.unit == "params":
        return f"{int(q.value):,} ({si(q.value, '').strip()})"
    if q.unit in ("FLOP", "FLOP/s"):
        return si(q.value, q.unit)
    if q.unit in ("sequences",):
        return f"{int(q.value):,} {q.unit}"
    return f"{q.value:,.4g} {q.unit}"
