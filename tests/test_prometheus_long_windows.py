"""Prometheus mode's long windows (a day or more) summed from hour slices, on a REAL Prometheus.

A 30-day ``increase`` read every sample of the period at every tick: a thousand engines scraped
every 15 s would have asked ~14 s of Prometheus a tick for the period alone, past the query
deadline, so the period read unknown. The guard now sums hour slices, each asked once, with the
newest and the oldest part asked each tick (``PrometheusView._sliced_increase``). Here the sum is
checked against Prometheus's own ``increase`` over the same window on a history with a varying
rate, an engine restart (counter reset) and an engine that started inside the window."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_support import Recording, backfilled, prometheus_binary

from sla_guard.ingest.prometheus import PrometheusView

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

NAME = "slaguard_test_requests"
STEP = 60
DAY = 86_400
SPAN = 4 * DAY


def _history(base: int) -> str:
    """Three engines' request counters every minute over 4 days: ``e0`` at a rate that swings
    over the day, ``e1`` the same but restarted (from 0) at day 2.5, ``e2`` started at day 1.7."""
    lines = [f"# TYPE {NAME} counter"]
    for e, restart, start in (("e0", None, 0), ("e1", int(2.5 * DAY), 0), ("e2", None, int(1.7 * DAY))):
        n = 0.0
        for t in range(start, SPAN + 1, STEP):
            if t == restart:
                n = 0.0
            n += 10 + 8 * math.sin(2 * math.pi * t / DAY)  # requests this minute
            lines.append(f'{NAME}_total{{engine="{e}",model="m",pool="decode"}} {n:.3f} {base + t}')
    return "\n".join([*lines, "# EOF", ""])


@pytest.fixture(scope="module")
def history():
    base = int(time.time()) // 3600 * 3600 - SPAN - 3600  # whole hours back: taken as history
    with backfilled(_history(base)) as prom:
        yield prom, base


def _truth(prom, window: str, at: float) -> dict[str, float]:
    return {r["metric"]["engine"]: float(r["value"][1])
            for r in prom.query(f"sum by (engine) (increase({NAME}_total[{window}]))", at)}


@pytest.mark.parametrize("window_s,window", [(DAY, "1d"), (3 * DAY, "3d")])
def test_the_slices_sum_to_prometheus_own_increase(history, window_s, window):
    prom, base = history
    view = PrometheusView(prom.url, timeout_s=30)
    try:
        for at in (base + SPAN - 17 * 60 - 23, base + SPAN - 2 * 3600 + 1):  # mid-hour and just past one
            got = {dict(k)["engine"]: v for k, v in view.increase(f"{NAME}_total", {}, window_s, at,
                                                                   ("engine",)).items()}
            want = _truth(prom, window, at)
            assert got.keys() == want.keys()
            for e in want:  # each part extrapolates to its own edges: within a minute's requests
                assert got[e] == pytest.approx(want[e], rel=2e-3), (e, got, want)
        assert view.errors == {}, view.last_error
    finally:
        view.close()


def test_slices_are_asked_once_and_a_failed_one_keeps_nothing(history):
    """A tick 15 s on asks no slice again, only the newest and oldest parts; an hour on, one
    subquery for the one new slice. A failed slice query reads no data (unknown), keeps nothing,
    and the next call, answered, is whole."""
    prom, base = history
    rec = Recording()
    view = PrometheusView(prom.url, timeout_s=30, transport=rec)
    at = base + SPAN - 17 * 60
    try:
        first = view.increase(f"{NAME}_total", {}, DAY, at, ("engine",))
        subqueries = [q for q in rec.sent if q.startswith("(sum by")]
        assert len(subqueries) == 1 and len(first) == 3
        view.prefetch(at + 15)
        view.increase(f"{NAME}_total", {}, DAY, at + 15, ("engine",))
        assert [q for q in rec.sent if q.startswith("(sum by")] == subqueries
        view.increase(f"{NAME}_total", {}, DAY, at + 3600, ("engine",))
        later = [q for q in rec.sent if q.startswith("(sum by")][1:]
        assert len(later) == 1 and later[0].endswith("[3600000ms:3600000ms]"), later
    finally:
        view.close()

    failing = Recording(fail="(sum by")
    view = PrometheusView(prom.url, timeout_s=30, transport=failing)
    try:
        assert view.increase(f"{NAME}_total", {}, DAY, at, ("engine",)) == {}
        assert view.failed_queries == 1
        failing.fail = None
        again = {dict(k)["engine"]: v for k, v in view.increase(f"{NAME}_total", {}, DAY, at, ("engine",)).items()}
        want = _truth(prom, "1d", at)
        assert again == pytest.approx(want, rel=2e-3)
    finally:
        view.close()


def test_a_long_first_read_goes_in_pieces_each_kept(history):
    """A restarted guard's first read of a long window asks at most a day of slices a query, newest
    first, and keeps each piece answered: a fleet whose whole period passes the query deadline is
    read over a few ticks (unknown meanwhile), not retried whole and never read."""
    prom, base = history
    rec = Recording(fail="(sum by", nth=2)
    view = PrometheusView(prom.url, timeout_s=30, transport=rec)
    at = base + SPAN - 17 * 60
    try:
        assert view.increase(f"{NAME}_total", {}, 3 * DAY, at, ("engine",)) == {}  # the second piece failed
        assert rec.matched == 2 and view.failed_queries == 1
        got = {dict(k)["engine"]: v for k, v in view.increase(f"{NAME}_total", {}, 3 * DAY, at, ("engine",)).items()}
        assert rec.matched == 4  # the two pieces left (71 slices: 24 + 24 + 23), not the first again
        assert got == pytest.approx(_truth(prom, "3d", at), rel=2e-3)
    finally:
        view.close()
