"""An engine upgraded to another bucket set, read through a REAL Prometheus (Prometheus mode).

Hours of an engine's TPOT histogram are backfilled into a real Prometheus: before the upgrade it
has no 20 ms bucket (the SLA's threshold), after it (a restart: the counters start again) it
has. ``increase(bucket{le="0.02"}[w])`` counts only since the new series appeared while
``increase(bucket{le="+Inf"}[w])`` counts the whole window, so a window spanning the upgrade read
a few percent attainment, "violated", with every request at 15 ms. The same for a rolling
upgrade that replaces the pod (the old instance never had the bucket). Every request is written
by the test, so each expected count is exact."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_support import PrometheusProcess, Recording, backfilled, judged, prometheus_binary, tpot_attainment

from exporters import contract as c
from sla_guard.ingest.prometheus import PrometheusView
from sla_guard.model import Status

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

TPOT = c.REQUEST_TPOT.series()
STEP = 15  # seconds between scrapes
BEFORE = 2 * 3600 // STEP  # scrapes of the old engine
AFTER = (6 * 3600 + 20 * 60) // STEP  # scrapes of the upgraded one
OLD = ("0.01", "0.025", "0.05")  # no 20 ms bucket
NEW = ("0.01", "0.02", "0.025", "0.05")
SLOS = tpot_attainment("6h")


def _child(
    lines: dict[str, list[str]], labels: str, times: list[float], n: list[int], bounds: tuple[str, ...], took: float
) -> None:
    """Samples of one histogram child: ``n[k]`` requests at ``times[k]``, each ``took`` seconds."""
    for le in (*bounds, "+Inf"):
        key = f'{TPOT}_bucket{{{labels},le="{le}"}}'
        lines.setdefault(key, []).extend(
            f"{k if took <= float(le) else 0} {t:.0f}" for k, t in zip(n, times, strict=True)
        )
    lines.setdefault(f"{TPOT}_count{{{labels}}}", []).extend(f"{k} {t:.0f}" for k, t in zip(n, times, strict=True))
    lines.setdefault(f"{TPOT}_sum{{{labels}}}", []).extend(f"{k * took} {t:.0f}" for k, t in zip(n, times, strict=True))


def _history(base: float) -> str:
    """Model "up": upgraded in place (same labels, counters reset); "roll": the upgraded engine is
    a new pod (another instance); "slow": upgraded in place, every request after it at 30 ms;
    "gone": upgraded in place to a bucket set without the threshold. Each engine serves 2
    requests a scrape, 15 ms each before the upgrade."""
    old_t = [base + STEP * i for i in range(BEFORE)]
    new_t = [base + STEP * (BEFORE + i) for i in range(AFTER)]
    old_n = [1000 + 2 * i for i in range(BEFORE)]
    new_n = [2 * (i + 1) for i in range(AFTER)]
    lines: dict[str, list[str]] = {}
    for model, took_after, second in (
        ("up", 0.015, "e0"),
        ("roll", 0.015, "e1"),
        ("slow", 0.030, "e0"),
        ("gone", 0.015, "e0"),
    ):
        lab = f'instance="{{}}",job="engines",model="{model}",pool="decode"'
        before, after = (NEW, OLD) if model == "gone" else (OLD, NEW)
        _child(lines, lab.format("e0"), old_t, old_n, before, 0.015)
        _child(lines, lab.format(second), new_t, new_n, after, took_after)
    out = [f"# TYPE {TPOT} histogram", *(f"{k} {p}" for k, ps in lines.items() for p in ps), "# EOF", ""]
    return "\n".join(out)


@pytest.fixture(scope="module")
def upgraded():
    base = float(int(time.time()) - 12 * 3600)  # Prometheus takes the backfill as history
    with backfilled(_history(base)) as prom:
        yield prom, base + STEP * BEFORE  # the upgraded engine's first scrape


def _judge(
    prom: PrometheusProcess,
    at: float,
    transport: httpx.BaseTransport | None = None,
) -> tuple[dict, PrometheusView]:
    pools, view = judged(prom, SLOS, at, transport)
    return {m: pools[(m, "decode")].slos[0] for m in ("up", "roll", "slow", "gone")}, view


def test_prometheus_reads_the_upgrade_as_a_violation(upgraded):
    """What PromQL itself makes of the windows that span the upgrade: 1 h holds 480 requests, 40
    of them (since the upgrade) in the new 20 ms bucket."""
    prom, upgrade = upgraded
    at = upgrade + 10 * 60 - STEP
    sel = f'{TPOT}_bucket{{model="up"}}'
    got = {r["metric"]["le"]: float(r["value"][1]) for r in prom.query(f"sum by (le) (increase({sel}[1h]))", at)}
    assert got["0.02"] / got["+Inf"] < 0.2, got


def test_a_window_spanning_the_upgrade_is_unknown_with_its_cause_not_violated(upgraded):
    """Ten minutes after the upgrade: the 5 m window holds only the new engine (every request
    in time: 100 %), the burn windows (30 m .. 6 h) span the change. They read 33 %, 17 % and
    8 % attainment and the objective "violated" (a minute after it, 25 % over 5 m); now they are
    left unjudged and the period is judged over the minutes the bucket covered, the reason naming
    the change (a minute after it: nothing covered, unknown). The slow model (30 ms after the
    upgrade) is never "ok"; nor is a bound removed by the upgrade."""
    prom, upgrade = upgraded
    slos, _ = _judge(prom, upgrade + 60)
    assert {m: s.status for m, s in slos.items()} == dict.fromkeys(slos, Status.UNKNOWN), slos
    assert "changed within the 5m window" in slos["up"].reason, slos["up"].reason
    assert "changed within the 5m window" in slos["gone"].reason, slos["gone"].reason
    slos, view = _judge(prom, upgrade + 10 * 60 - STEP)
    assert view.errors == {}, view.last_error
    for model in ("up", "roll"):
        s = slos[model]
        assert s.status is Status.OK and s.budget_remaining == 1.0, (model, s.status, s.burn_rates, s.reason)
        assert s.value == 1.0, (model, s.value)
        assert "period judged over the last " in s.reason and "le=0.02" in s.reason and "e0" in s.reason, s.reason
        assert "30m, 1h burn window(s) it did not cover are left out" in s.reason, s.reason
    slow = slos["slow"]
    assert slow.status is not Status.OK and slow.value == 0.0, (slow.status, slow.value, slow.reason)
    assert slos["gone"].status is Status.UNKNOWN, slos["gone"]


def test_once_every_window_has_passed_the_upgrade_it_is_judged_exactly(upgraded):
    prom, upgrade = upgraded
    slos, _ = _judge(prom, upgrade + (6 * 3600 + 15 * 60))
    for model in ("up", "roll"):
        s = slos[model]
        assert s.status is Status.OK and s.value == 1.0 and s.budget_remaining == 1.0, (model, s.status, s.reason)
    slow = slos["slow"]
    assert slow.status is Status.VIOLATED and slow.value == 0.0, (slow.status, slow.reason)
    assert slos["gone"].status is Status.UNKNOWN and "not a bucket boundary" in slos["gone"].reason


def test_a_failed_bucket_check_reads_unknown_not_ok(upgraded):
    """Where the query that finds a changed bucket fails, a change is not ruled out: unknown,
    saying so, however good the other answers look."""
    prom, upgrade = upgraded
    slos, view = _judge(prom, upgrade + (6 * 3600 + 15 * 60), Recording(fail="label_replace("))
    assert view.failed_queries >= 1
    s = slos["up"]
    assert s.status is Status.UNKNOWN and "could not check" in s.reason, (s.status, s.reason)



def test_a_bucket_gone_since_the_hourly_coverage_answer_is_seen_at_once(upgraded):
    """Windows of a day or more take their coverage from an answer asked once an hour (hour
    slices); a bucket that vanished after it ("gone", 30 min before this tick; the answer from 20
    min before the upgrade, every bucket there) is caught by the last 2 h, read every tick. Read
    from the hourly answer alone, the 1-day window counted the half hour's requests as misses."""
    prom, t0 = upgraded
    rec = Recording()
    view = PrometheusView(prom.url, timeout_s=30, transport=rec)
    day = 86_400.0
    try:
        before = view.uncovered_buckets(c.REQUEST_TPOT, 0.02, (300.0, day), t0 - 20 * 60)
        assert before is not None and not any(dict(lab)["model"] == "gone" for w in before.values() for lab in w)
        hourly = sum(q.startswith("max_over_time(") for q in rec.sent)
        after = view.uncovered_buckets(c.REQUEST_TPOT, 0.02, (300.0, day), t0 + 30 * 60)
        assert after is not None and {dict(lab)["model"] for lab in after[day]} >= {"gone"}, after
        assert sum(q.startswith("max_over_time(") for q in rec.sent) == hourly >= 1  # not asked again
        assert 2 * 3600.0 not in after  # the last 2 h, asked for this, is not a window of the answer
    finally:
        view.close()
