"""The period of an attainment objective after its threshold bucket appeared, read through a REAL
Prometheus (Prometheus mode).

Engines get the SLA's 20 ms TPOT bucket a day into a 2-day period (an operator set
``SLA_GUARD_TPOT_SLO_S=0.02`` and rolled them). ``increase`` of the new bucket counts only since it
appeared while ``+Inf`` counts the whole period, so the raw period reads every earlier request as
a miss; the guard left the period unjudged ("unknown") for a whole period after the change. It now
judges the period over the part the bucket covered on every engine of the pool, saying so. Every
request is written by the test, so each expected count is exact."""

from __future__ import annotations

import time

import pytest
from prometheus_support import Recording, backfilled, judged, prometheus_binary, tpot_attainment

from exporters import contract as c
from sla_guard.model import Status

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

TPOT = c.REQUEST_TPOT.series()
STEP = 60  # seconds between scrapes
DAY = 86400
SPAN = DAY * 3 // 2  # history: judged 1.5 days after its start
OLD = ("0.01", "0.025", "0.05")  # no 20 ms bucket
NEW = ("0.01", "0.02", "0.025", "0.05")
SLOS = tpot_attainment("2d")
# model -> its engines: (instance, seconds after the start the engine got the bucket (restarted,
# its counters from 0), requests a scrape after it, seconds of each request by time since the start)
ENGINES = {
    "up": [("e0", DAY, 2, lambda t: 0.015)],
    # 30 ms for 4 hours from an hour after the change, ended 7 h before the verdict: no burn row
    # the bucket covers fires (1h, 6h), the budget over the covered part is gone
    "late": [("e0", DAY, 2, lambda t: 0.030 if DAY + 3600 <= t < DAY + 5 * 3600 else 0.015)],
    "two": [("e0", DAY, 2, lambda t: 0.015), ("e1", DAY + 6 * 3600, 2, lambda t: 0.015)],
    "quiet": [("e0", DAY, 0, lambda t: 0.015)],
}


def _history(base: float) -> str:
    lines: dict[str, list[str]] = {}
    for model, engines in ENGINES.items():
        for inst, change, after, took in engines:
            lab = f'instance="{inst}",job="engines",model="{model}",pool="decode"'
            n, below, total = 0, 0, 0.0  # requests, of them <= 20 ms, seconds
            for i in range(SPAN // STEP):
                t = i * STEP
                if t == change:
                    n, below, total = 0, 0, 0.0  # restarted with the new bucket set
                k = 2 if t < change else after
                n += k
                below += k if took(t) <= 0.02 else 0
                total += k * took(t)
                ts = f"{base + t:.0f}"
                bounds = NEW if t >= change else OLD
                for le in (*bounds, "+Inf"):
                    v = n if le == "+Inf" or float(le) >= 0.025 else below if le == "0.02" else 0
                    if le == "0.01":
                        v = 0
                    lines.setdefault(f'{TPOT}_bucket{{{lab},le="{le}"}}', []).append(f"{v} {ts}")
                lines.setdefault(f"{TPOT}_count{{{lab}}}", []).append(f"{n} {ts}")
                lines.setdefault(f"{TPOT}_sum{{{lab}}}", []).append(f"{total} {ts}")
    out = [f"# TYPE {TPOT} histogram", *(f"{k} {p}" for k, ps in lines.items() for p in ps), "# EOF", ""]
    return "\n".join(out)


@pytest.fixture(scope="module")
def changed():
    base = float(int(time.time()) // STEP * STEP - SPAN - 600)  # Prometheus takes the backfill as history
    with backfilled(_history(base)) as prom:
        yield prom, base


def _judge(prom, at, transport=None):
    pools, view = judged(prom, SLOS, at, transport)
    return {m: pools[(m, "decode")].slos[0] for m in ENGINES}, view


def test_prometheus_reads_the_raw_period_as_misses(changed):
    """What PromQL makes of the 2-day period 12 h after the change: a third of the requests."""
    prom, base = changed
    at = base + SPAN - STEP
    sel = f'{TPOT}_bucket{{model="up"}}'
    got = {r["metric"]["le"]: float(r["value"][1]) for r in prom.query(f"sum by (le) (increase({sel}[2d]))", at)}
    assert got["0.02"] / got["+Inf"] < 0.4, got


def test_the_period_is_judged_over_the_part_the_bucket_covered(changed):
    """12 h after the change: the period is judged over the last 11 h (the 12 h the bucket covered,
    read short by the 5 m slice the change fell in, rounded down), its requests exactly
    Prometheus's own over those 11 h, none of the day before the bucket counted as a miss."""
    prom, base = changed
    at = base + SPAN - STEP
    slos, view = _judge(prom, at)
    assert view.errors == {}, view.last_error
    up = slos["up"]
    assert up.status is Status.OK, (up.status, up.reason, up.budget_remaining, up.burn_rates)
    assert up.budget_remaining == 1.0 and up.value == 1.0, (up.budget_remaining, up.value)
    assert "judged over the last 11h" in up.reason and "le=0.02" in up.reason and "e0" in up.reason, up.reason
    want = sum(float(r["value"][1]) for r in prom.query(f'increase({TPOT}_count{{model="up"}}[11h])', at))
    assert up.period_requests == pytest.approx(want) and 1300 < want < 1330, (up.period_requests, want)
    full = time.strftime("%Y-%m-%d", time.gmtime(base + DAY + 2 * DAY))
    assert f"the full period from {full}" in up.reason, up.reason


def test_a_violation_in_the_covered_part_is_violated(changed):
    """4 h of 30 ms requests inside the covered part, over before the 6 h burn window: no burn
    row the bucket covers fires, the budget over the covered 11 h is spent."""
    prom, base = changed
    slos, _ = _judge(prom, base + SPAN - STEP)
    late = slos["late"]
    assert late.status is Status.VIOLATED, (late.status, late.reason, late.budget_remaining, late.burn_rates)
    assert late.budget_remaining is not None and late.budget_remaining < -30, late.budget_remaining
    assert "judged over the last 11h" in late.reason, late.reason


def test_the_pool_is_judged_over_what_every_engine_covered(changed):
    """Engine e1 got the bucket 6 h after e0: the pool's period is judged over the last 5 h."""
    prom, base = changed
    slos, _ = _judge(prom, base + SPAN - STEP)
    two = slos["two"]
    assert two.status is Status.OK and two.budget_remaining == 1.0, (two.status, two.reason)
    assert "judged over the last 5h" in two.reason and "e1" in two.reason, two.reason


def test_too_few_requests_since_the_change_is_unknown(changed):
    prom, base = changed
    slos, _ = _judge(prom, base + SPAN - STEP)
    quiet = slos["quiet"]
    assert quiet.status is Status.UNKNOWN and "need >= 5" in quiet.reason and "11h" in quiet.reason, quiet.reason


def test_a_failed_coverage_query_is_unknown_not_ok(changed):
    """The hour slices' coverage answers for the windows of a day or more: where it fails, those
    windows are unchecked (unknown, saying so), the shorter ones judged as before."""
    prom, base = changed
    slos, view = _judge(prom, base + SPAN - STEP, Recording(fail="max_over_time("))
    assert view.failed_queries >= 1
    up = slos["up"]
    assert up.status is Status.UNKNOWN and "could not check" in up.reason, (up.status, up.reason)
    assert "covers the 1d, 2d window(s)" in up.reason, up.reason


def test_the_cover_answer_serves_the_ticks_of_one_slice(changed):
    """The cover query reads the whole period's samples, as much as the period's own query
    (bench/bench_prometheus_long_windows.py), for up to a period after a change: it is asked once
    a slice (5 m for 2 days), not every tick, nor sent ahead with the next tick's queries, and the
    ticks between judge the same span from that answer. (The long windows' coverage asks it too, in
    hour slices, for each histogram family: once an hour.)"""
    from sla_guard.config import parse_config
    from sla_guard.ingest.prometheus import PrometheusView
    from sla_guard.slo import SLOEvaluator

    prom, base = changed
    rec = Recording()
    view = PrometheusView(prom.url, timeout_s=30, transport=rec)
    ev = SLOEvaluator(parse_config({"slos": SLOS}))
    at = base + SPAN - 20 * STEP  # 15 min after a 5-min slice began: the next one starts 5 min on
    reasons, asked = [], []
    try:
        for tick in (0, 15, 60, 120, 240, 300):  # seconds after the first tick; the guard's order
            if tick:
                view.prefetch(at + tick)
            rec.sent.clear()
            ev.evaluate(view, at + tick)
            reasons.append(ev.pools[("up", "decode")].slos[0].reason)
            asked.append([q for q in rec.sent if q.startswith("max_over_time(")])
        # the first tick asks the 2 days in pieces of 24 slices (2 h of 5 min; hour slices for the
        # burn windows' coverage), each kept; the ticks to 240 s ask none; a slice on, only the
        # newest part of the 5-min answer again, not its settled pieces
        assert len(asked[0]) > 24 and asked[1:5] == [[]] * 4, [len(a) for a in asked]
        assert len(asked[5]) == 1 and asked[5][0].endswith(":300000ms])"), asked[5]
        assert all("judged over the last 11h" in r for r in reasons), reasons
        assert view.errors == {}, view.last_error
    finally:
        view.close()


def test_the_periods_attainment_reads_two_buckets_not_every_one(changed):
    """Prometheus reads every sample of each bucket a query selects: over 30 days, a fleet's
    attainment that selected all of a histogram's ~20 buckets cost ~20x the two it uses
    (bench/bench_prometheus_long_windows.py). The long windows select the threshold's bucket
    and +Inf, in every spelling exporters write, and judge as before."""
    prom, base = changed
    rec = Recording()
    slos, view = _judge(prom, base + SPAN - STEP, rec)
    long = [q for q in rec.sent if q.startswith(f"(sum by (le,model,pool) (increase({TPOT}_bucket")]  # hour slices
    assert long and all('le=~"\\\\+Inf|0\\\\.02|inf"' in q for q in long), long
    up = slos["up"]
    assert up.status is Status.OK and up.value == 1.0 and "judged over the last 11h" in up.reason, up.reason
    assert view.errors == {}, view.last_error


def test_no_tick_reads_a_long_window_whole(changed):
    """Over a day or more, neither the attainment's counts nor its bucket-coverage check reads the
    window whole each tick: hour slices (asked once, a subquery) and parts of at most an hour do.
    The judgement is the one the whole windows gave (the tests above)."""
    prom, base = changed
    rec = Recording()
    slos, view = _judge(prom, base + SPAN - STEP, rec)
    whole = [q for q in rec.sent if not q.startswith(("max_over_time(", "(sum by"))
             and any(f"[{w * 1000}ms]" in q for w in (DAY, 2 * DAY))]
    assert whole == [], whole
    assert slos["up"].status is Status.OK and view.errors == {}, (slos["up"].reason, view.last_error)



def test_the_cover_answer_is_read_in_pieces_each_kept(changed):
    """A whole period's cover subquery at fleet scale passes the query deadline (1,000 engines'
    30 days: ~20 s). It is asked a piece of 24 slices at a time, newest first, each kept: a failed
    piece reads unknown (None) and the next call asks only the pieces left, for the same answer a
    view that never failed gives."""
    from sla_guard.ingest.prometheus import PrometheusView

    prom, base = changed
    at = base + SPAN - STEP
    rec, whole = Recording(fail="max_over_time(", nth=2), Recording()
    view, fresh = (PrometheusView(prom.url, timeout_s=30, transport=rec),
                   PrometheusView(prom.url, timeout_s=30, transport=whole))
    try:
        assert view.bucket_covered_since(c.REQUEST_TPOT, 0.02, 2 * DAY, 300, at) is None
        assert rec.matched == 2
        got = view.bucket_covered_since(c.REQUEST_TPOT, 0.02, 2 * DAY, 300, at)
        want = fresh.bucket_covered_since(c.REQUEST_TPOT, 0.02, 2 * DAY, 300, at)
        assert got == want and {dict(k)["model"] for k in got} == {"up", "late", "two", "quiet"}, got
        pieces = len(whole.sent)  # 2 days of 2 h pieces (23 or 24 by the clock) and the newest part
        assert pieces >= 24 and rec.matched == 2 + pieces - 1  # the first piece kept, not asked again
    finally:
        view.close()
        fresh.close()
