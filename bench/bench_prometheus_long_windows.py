"""What a Prometheus-mode tick asks of a real Prometheus over a 30-day period, before and now.

Prometheus reads every sample of each series a range selects, so a 30-day window costs every
sample of the period at every tick. This bench backfills a fleet's 30 days of one TPOT histogram
(the contract's 18 buckets) into a real Prometheus (promtool), judges the default-shaped objective
(99 % of decode TPOTs within 20 ms over 30 days, burn windows up to 3 days) as Prometheus mode does,
two ticks 15 s apart with the guard's own view, records the queries each tick sends and replays
each ``--repeats`` times on the same server at the time it was asked. Printed side by side: the
first tick (the long windows' hour slices and bucket-coverage pieces read once), the next tick,
and the same tick as before (the long windows read whole, every bucket, and their coverage check
with them). A second run has half the engines gain the 20 ms bucket ``--changed-days`` before the
end, so that the period is judged over the part the bucket covered.

Samples read grow with engines x scrape rate, and so does each query's time; the ratios are what
carry to a larger fleet. Usage:

    .venv/bin/python bench/bench_prometheus_long_windows.py [--engines 10] [--scrape-s 60]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from prometheus_client.utils import floatToGoString  # noqa: E402
from prometheus_support import Recording, backfilled, prometheus_binary, tpot_attainment  # noqa: E402

from exporters import contract as c  # noqa: E402
from sla_guard.config import parse_config  # noqa: E402
from sla_guard.ingest.prometheus import WINDOW_LABEL, PrometheusView, uncovered_query  # noqa: E402
from sla_guard.slo import SLOEvaluator  # noqa: E402

TPOT = c.REQUEST_TPOT.series()
DAY = 86_400
PERIOD_DAYS = 30
TICK_S = 15  # evaluation_interval_s's default
# the contract's TPOT buckets as prometheus_client writes them (18 and +Inf), the SLA's 20 ms among them
BUCKETS = (*(floatToGoString(b) for b in c.REQUEST_TPOT.buckets), "+Inf")


def history(engines: int, scrape_s: int, end: int, changed_days: float | None) -> str:
    """OpenMetrics text: ``engines`` decode engines' TPOT histograms over the period up to ``end``,
    every ``scrape_s``; with ``changed_days``, the odd engines restarted that long before ``end``
    with the 20 ms bucket (counters from 0), the even ones had it all along. Two requests a scrape,
    all at 15 ms."""
    start = end - PERIOD_DAYS * DAY
    change = None if changed_days is None else start + (PERIOD_DAYS - changed_days) * DAY // scrape_s * scrape_s
    out = [f"# TYPE {TPOT} histogram"]
    for e in range(engines):
        lab = f'instance="10.0.{e // 250}.{e % 250}:8000",job="engines",model="m",pool="decode"'
        moved = change is not None and e % 2 == 1
        times = range(start, end + 1, scrape_s)
        counts = []
        n = 0
        for t in times:
            if moved and t == change:
                n = 0
            n += 2
            counts.append(n)
        for le in BUCKETS:  # every request at 15 ms: each bucket counts them all
            out += [f'{TPOT}_bucket{{{lab},le="{le}"}} {n} {t}' for t, n in zip(times, counts, strict=True)
                    if not (le == "0.02" and moved and t < change)]  # no 20 ms bucket before the restart
        out += [f"{TPOT}_count{{{lab}}} {n} {t}" for t, n in zip(times, counts, strict=True)]
        out += [f"{TPOT}_sum{{{lab}}} {n * 0.015} {t}" for t, n in zip(times, counts, strict=True)]
    out += ["# EOF", ""]
    return "\n".join(out)


class _Timed(Recording):
    """The real transport, recording each query with the time it was asked at: the hour slices
    and the cover pieces are one query text at many times."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.timed.append((request.url.params.get("query", ""), request.url.params.get("time", "")))
        return super().handle_request(request)


def _replay(url: str, queries: list[tuple[str, str]], repeats: int) -> list[float]:
    """Each (query, time)'s median seconds over ``repeats`` runs on the server."""
    times = []
    with httpx.Client(timeout=300) as client:
        for q, at in queries:
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = client.get(f"{url}/api/v1/query", params={"query": q, "time": at})
                runs.append(time.perf_counter() - t0)
                r.raise_for_status()
            times.append(statistics.median(runs))
    return times


def _tick(view: PrometheusView, ev: SLOEvaluator, rec: _Timed, at: float, first: bool) -> list[tuple[str, str]]:
    """One tick as the guard runs it (the previous tick's queries sent ahead, then the evaluator);
    the distinct (query, time) it sent."""
    rec.timed.clear()
    if not first:
        view.prefetch(at)
    ev.evaluate(view, at)
    return list(dict.fromkeys(rec.timed))


def measure(engines: int, scrape_s: int, changed_days: float | None, repeats: int) -> dict:
    end = int(time.time()) // scrape_s * scrape_s - 1200  # Prometheus takes the backfill as history
    t0 = time.perf_counter()
    text = history(engines, scrape_s, end, changed_days)
    with backfilled(text, block="720h", flags=("--storage.tsdb.retention.time=40d",)) as prom:
        built = time.perf_counter() - t0
        rec = _Timed()
        view = PrometheusView(prom.url, timeout_s=300, transport=rec)
        ev = SLOEvaluator(parse_config({"slos": tpot_attainment(f"{PERIOD_DAYS}d")}))
        try:
            cold = _tick(view, ev, rec, end + 1, True)
            steady = _tick(view, ev, rec, end + 1 + TICK_S, False)
        finally:
            view.close()
        cold_t = _replay(prom.url, cold, repeats)
        steady_t = _replay(prom.url, steady, repeats)
        # what each tick read for the long windows before the hour slices and the two-bucket
        # selection: the buckets and the coverage check over the whole windows
        at = f"{end + 1 + TICK_S:.3f}"
        old_long = [(f"sum by (le,model,pool) (increase({TPOT}_bucket[{w}]))", at)
                    for w in ("1d", "3d", f"{PERIOD_DAYS}d")]
        old_cover = [(_whole_coverage(q), at) for q, _ in steady if q.startswith("label_replace(")]
        old_t = _replay(prom.url, old_long, repeats)
        old_cover_t = _replay(prom.url, old_cover, repeats)
    short = [t for (q, _), t in zip(steady, steady_t, strict=True)
             if not _long_part(q) and not q.startswith("label_replace(")]
    slo = ev.pools[("m", "decode")].slos[0] if ("m", "decode") in ev.pools else None
    cover = [t for (q, _), t in zip(cold, cold_t, strict=True) if "max_over_time((" in q]
    return {"cold_n": len(cold), "cold_s": sum(cold_t), "steady_n": len(steady), "steady_s": sum(steady_t),
            "before_s": sum(short) + sum(old_t) + sum(old_cover_t),
            "old_long": dict(zip(("1d", "3d", "30d"), old_t, strict=True)), "old_cover_s": sum(old_cover_t),
            "cover_s": sum(cover), "cover_n": len(cover), "built_s": built, "history_mb": len(text) / 1e6,
            "verdict": None if slo is None else f"{slo.status.value}: {slo.reason[:140]}",
            "top": sorted(((t, q) for (q, _), t in zip(steady, steady_t, strict=True)), reverse=True)[:4]}


def _whole_coverage(query: str) -> str:
    """The bucket-coverage query of a tick (``PrometheusView._uncovered_now``) as it was before the
    long windows came from hour slices: the same windows plus the day or longer ones, read whole."""
    windows = [float(w) for w in re.findall(rf'"{WINDOW_LABEL}", "([0-9.]+)"', query)]
    metric = c.REQUEST_TPOT if c.REQUEST_TPOT.series() in query else c.CLIENT_TPOT
    return uncovered_query(metric, 0.02, sorted({*windows, DAY, 3.0 * DAY, PERIOD_DAYS * float(DAY)}))


def _long_part(q: str) -> bool:
    """A query for a part of a long window (an hour slice's subquery, the newest or oldest part)."""
    return q.startswith("(sum by") or ("_bucket{le=~" in q and "increase(" in q and q.startswith("sum by (le"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=10)
    ap.add_argument("--scrape-s", type=int, default=60)
    ap.add_argument("--changed-days", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if prometheus_binary() is None or shutil.which("promtool") is None:
        raise SystemExit("needs prometheus and promtool (scripts/setup.sh --full)")
    samples = a.engines * (len(BUCKETS) + 2) * PERIOD_DAYS * DAY // a.scrape_s
    print(f"{a.engines} decode engines, 30 days every {a.scrape_s} s (~{samples / 1e6:.1f} M samples), "
          f"half of them gaining the 20 ms bucket {a.changed_days:g} days before the end in the second run; "
          f"median of {a.repeats} runs of each query a tick sent")
    for name, changed in (("no change", None), ("after the change", a.changed_days)):
        m = measure(a.engines, a.scrape_s, changed, a.repeats)
        print(f"\n{name}: history {m['history_mb']:.0f} MB backfilled in {m['built_s']:.0f} s; verdict: {m['verdict']}")
        print(f"  first tick: {m['cold_n']} queries, {m['cold_s'] * 1000:.0f} ms (hour slices and coverage pieces "
              f"read once)")
        print(f"  next tick:  {m['steady_n']} queries, {m['steady_s'] * 1000:.0f} ms; the same tick as before "
              f"(every bucket, whole windows: 1d {m['old_long']['1d'] * 1000:.0f} ms, 3d "
              f"{m['old_long']['3d'] * 1000:.0f} ms, 30d {m['old_long']['30d'] * 1000:.0f} ms; the coverage "
              f"check with them {m['old_cover_s'] * 1000:.0f} ms) "
              f"{m['before_s'] * 1000:.0f} ms: ratio {m['steady_s'] / m['before_s']:.2f}")
        for t, q in m["top"]:
            print(f"  {t * 1000:7.0f} ms  {q[:150]}")
        print(f"  of the first tick, the bucket-coverage pieces (kept once settled; the newest part asked "
              f"again once a slice): {m['cover_n']} queries, {m['cover_s'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
