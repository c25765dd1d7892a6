"""What the period-cover query costs a Prometheus-mode tick, on a real Prometheus.

After an operator adds an SLA threshold bucket and rolls the engines, the guard judges an
attainment period over the part the new bucket covered (``PrometheusView.bucket_covered_since``,
one subquery over the whole period in ~720 slices). That query runs while any pool's period is
uncovered, up to a period (30 days) after the change. This bench backfills a fleet's 30 days of
one TPOT histogram into a real Prometheus (promtool), half the engines gaining the 20 ms bucket
``--changed-days`` before the end, judges the default-shaped objective (99 % of decode TPOTs within
20 ms over 30 days) as Prometheus mode does, records every query the tick sends, and replays each
one ``--repeats`` times on the same server: printed as the cover query's time against the rest of
the tick's queries, side by side, and against the same tick on a fleet without a change.

Samples read grow with engines x scrape rate, and so does each query's time; the ratio is what
carries to a larger fleet. Usage:

    .venv/bin/python bench/bench_prometheus_bucket_cover.py [--engines 20] [--scrape-s 60]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from prometheus_client.utils import floatToGoString  # noqa: E402
from prometheus_support import Recording, backfilled, judged, prometheus_binary, tpot_attainment  # noqa: E402

from exporters import contract as c  # noqa: E402

TPOT = c.REQUEST_TPOT.series()
DAY = 86_400
PERIOD_DAYS = 30
SLICE_S = 3600  # the cover query's slice for a 30-day period (slo._covered_spans), the answer reused that long
TICK_S = 15  # evaluation_interval_s's default
# the contract's TPOT buckets as prometheus_client writes them (18 and +Inf), the SLA's 20 ms among them
BUCKETS = (*(floatToGoString(b) for b in c.REQUEST_TPOT.buckets), "+Inf")
# what the tick read for a period's attainment before it selected the threshold's bucket and +Inf
ALL_BUCKETS = f"sum by (le,model,pool) (increase({TPOT}_bucket[{PERIOD_DAYS}d]))"


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


def _replay(url: str, queries: list[str], at: float, repeats: int) -> list[float]:
    """Each query's median seconds over ``repeats`` runs on the server at ``at``."""
    times = []
    with httpx.Client(timeout=300) as client:
        for q in queries:
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = client.get(f"{url}/api/v1/query", params={"query": q, "time": f"{at:.3f}"})
                runs.append(time.perf_counter() - t0)
                r.raise_for_status()
            times.append(statistics.median(runs))
    return times


def measure(engines: int, scrape_s: int, changed_days: float | None, repeats: int) -> dict:
    end = int(time.time()) // scrape_s * scrape_s - 1200  # Prometheus takes the backfill as history
    t0 = time.perf_counter()
    text = history(engines, scrape_s, end, changed_days)
    with backfilled(text, block="720h", flags=("--storage.tsdb.retention.time=40d",)) as prom:
        built = time.perf_counter() - t0
        rec = Recording()
        pools, _view = judged(prom, tpot_attainment(f"{PERIOD_DAYS}d"), end + 1, rec)
        queries = list(dict.fromkeys(rec.sent))
        times = _replay(prom.url, queries, end + 1, repeats)
        all_buckets = _replay(prom.url, [ALL_BUCKETS], end + 1, repeats)[0]
    cover = [t for q, t in zip(queries, times, strict=True) if "max_over_time((" in q]
    rest = [t for q, t in zip(queries, times, strict=True) if "max_over_time((" not in q]
    period_query = (f"sum by (le,model,pool) (increase({TPOT}_bucket{{", f"[{PERIOD_DAYS * DAY * 1000}ms]")
    period = [t for q, t in zip(queries, times, strict=True) if q.startswith(period_query[0]) and period_query[1] in q]
    slo = pools[("m", "decode")].slos[0] if ("m", "decode") in pools else None
    return {"queries": len(queries), "cover_s": sum(cover), "cover_n": len(cover), "rest_s": sum(rest),
            "period_s": sum(period), "all_buckets_s": all_buckets,
            "built_s": built, "history_mb": len(text) / 1e6,
            "verdict": None if slo is None else f"{slo.status.value}: {slo.reason[:140]}",
            "top": sorted(zip(times, queries, strict=True), reverse=True)[:3]}


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
          f"half of them gaining the 20 ms bucket {a.changed_days:g} days before the end; "
          f"median of {a.repeats} runs of each query the tick sent")
    base = measure(a.engines, a.scrape_s, None, a.repeats)
    changed = measure(a.engines, a.scrape_s, a.changed_days, a.repeats)
    for name, m in (("no change", base), ("after the change", changed)):
        print(f"\n{name}: {m['queries']} queries, history {m['history_mb']:.0f} MB backfilled in {m['built_s']:.0f} s")
        print(f"  verdict: {m['verdict']}")
        print(f"  cover query: {m['cover_n']} sent, {m['cover_s'] * 1000:.0f} ms; the tick's other queries "
              f"{m['rest_s'] * 1000:.0f} ms")
        for t, q in m["top"]:
            print(f"  {t * 1000:7.0f} ms  {q[:150]}")
        print(f"  the period's attainment counts: {m['period_s'] * 1000:.0f} ms for the threshold's bucket and +Inf, "
              f"{m['all_buckets_s'] * 1000:.0f} ms for every bucket as before (ratio "
              f"{m['period_s'] / m['all_buckets_s']:.2f})")
    if changed["rest_s"] > 0 and base["rest_s"] > 0:
        # the guard asks the cover query once a slice (1 h for 30 days), not every tick
        per_tick = changed["cover_s"] * TICK_S / SLICE_S
        print(f"\nratios: cover query / the tick's other queries {changed['cover_s'] / changed['rest_s']:.2f}; "
              f"a tick that asks it / a tick without a change "
              f"{(changed['cover_s'] + changed['rest_s']) / base['rest_s']:.2f}; asked once per {SLICE_S // 60} min, "
              f"it adds {per_tick * 1000:.1f} ms to the mean {TICK_S} s tick "
              f"({100 * per_tick / base['rest_s']:.1f} % of the tick's queries)")


if __name__ == "__main__":
    main()
