"""Numeric timestamps whose unit is not written: seconds, milliseconds, micro- or nanoseconds since
1970, told apart by their size. One rule for trace files (``sla-guard replay``) and recorded series
(``sla-guard analyze``): Grafana's CSV export and most databases write milliseconds, Mooncake's
trace too, BurstGPT seconds; read in the wrong unit, a day's samples a minute apart are 60 days
apart, or a whole trace arrives in one second."""

from __future__ import annotations

SECONDS_PER = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
DATES_S = (946_684_800.0, 4_102_444_800.0)  # 2000-01-01 .. 2100-01-01: a time in this range is a date


def epoch_unit(lo: float, hi: float) -> str | None:
    """The unit (a key of ``SECONDS_PER``) in which every time from ``lo`` to ``hi`` is a date of
    2000-2100; None when no unit makes them dates (numbers counted from 0, a trace's offsets)."""
    for unit, per in SECONDS_PER.items():
        if DATES_S[0] <= lo * per and hi * per < DATES_S[1]:
            return unit
    return None
