"""What the generated SLO rules' 1d and 3d burn windows cost Prometheus at each evaluation, read
raw (every sample of every engine, as the rules did) and summed from the 5-min slices' records.

Backfills ``--days`` of ``--engines`` decode engines' TPOT histograms (the contract's 18 buckets,
two requests a scrape, one at 30 ms on every fourth engine, over the 20 ms SLA) into a real
Prometheus with promtool; evaluates the generated rules' 5-min slice records (errors, judged and
all requests per second) over that history at each minute with ``query_range`` (what the rule
group records, one evaluation a minute) and backfills them into a second Prometheus with the same
history. On it, each window's error ratio is timed both ways at the same instant, median of
``--repeats``, and the values printed side by side: the 5-min one as one raw query before, now two
raw slice records (errors and judged) and their ratio; the 1d and 3d ones raw before, now sums of
the slice records.

Samples read grow with engines x scrape rate for the raw form only; the ratio is what carries to a
larger fleet. Usage:

    .venv/bin/python bench/bench_rules_long_windows.py [--engines 10] [--scrape-s 60] [--days 3]
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
sys.path.insert(0, str(ROOT))

from prometheus_support import backfilled, prometheus_binary, tpot_attainment  # noqa: E402

from alerts.params import RuleParams  # noqa: E402
from alerts.slo_rules import LABELS, SLICE, slo_groups  # noqa: E402
from exporters import contract as c  # noqa: E402
from exporters import promql as q  # noqa: E402
from sla_guard.config import parse_config  # noqa: E402

DAY = 86_400
STEP_S = 60  # Prometheus's default evaluation_interval


def history(engines: int, scrape_s: int, start: int, end: int) -> list[str]:
    """OpenMetrics lines: every engine's TPOT histogram, two requests a scrape at 15 ms, but one of
    them at 30 ms on every fourth engine (over the 20 ms SLA)."""
    name = c.REQUEST_TPOT.series()
    out = [f"# TYPE {name} histogram"]
    times = range(start, end + 1, scrape_s)
    for e in range(engines):
        lab = f'instance="10.0.{e // 250}.{e % 250}:8000",job="engines",model="m",pool="decode"'
        for b in [*c.REQUEST_TPOT.buckets, float("inf")]:
            per = 1 if e % 4 == 0 and 0.015 <= b < 0.03 else 2 if b >= 0.015 else 0
            le = "+Inf" if b == float("inf") else q.le(b)
            out += [f'{name}_bucket{{{lab},le="{le}"}} {per * i} {t}' for i, t in enumerate(times)]
        out += [f"{name}_count{{{lab}}} {2 * i} {t}" for i, t in enumerate(times)]
        out += [f"{name}_sum{{{lab}}} {0.03 * i:.3f} {t}" for i, t in enumerate(times)]
    return out


def _query(client: httpx.Client, url: str, expr: str, at: float) -> tuple[float, list]:
    t0 = time.perf_counter()
    r = client.get(f"{url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"})
    took = time.perf_counter() - t0
    r.raise_for_status()
    return took, r.json()["data"]["result"]


def recorded(client: httpx.Client, url: str, rules: list[dict], start: int, end: int) -> list[str]:
    """The 5-min slice records as the rule group writes them each minute, as OpenMetrics lines."""
    out = []
    for rule in rules:
        name = rule["record"]
        out.append(f"# TYPE {name} gauge")
        for chunk in range(start, end, 10_000 * STEP_S):  # query_range's 11,000-point limit
            r = client.get(f"{url}/api/v1/query_range", params={
                "query": rule["expr"], "start": chunk, "end": min(chunk + 9_999 * STEP_S, end), "step": STEP_S})
            r.raise_for_status()
            for s in r.json()["data"]["result"]:
                labels = {**{k: v for k, v in s["metric"].items() if k != "__name__"}, **rule["labels"]}
                lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                out += [f"{name}{{{lab}}} {v} {int(t)}" for t, v in s["values"] if v != "NaN"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=10)
    ap.add_argument("--scrape-s", type=int, default=60)
    ap.add_argument("--days", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if prometheus_binary() is None or shutil.which("promtool") is None:
        raise SystemExit("needs prometheus and promtool (scripts/setup.sh --full)")
    end = int(time.time()) // a.scrape_s * a.scrape_s - 1200  # Prometheus takes the backfill as history
    start = end - int(a.days * DAY)
    group = slo_groups(parse_config({"slos": tpot_attainment("30d")}), RuleParams())[0]["rules"]
    by_name = {r["record"]: r for r in group if "record" in r}
    slices = [by_name[f"model_pool_slo:sli_{p}:rate{SLICE}"] for p in ("errors", "judged", "requests")]
    raw = history(a.engines, a.scrape_s, start, end)
    samples = sum(1 for line in raw if not line.startswith("#"))
    print(f"{a.engines} decode engines, {a.days:g} days every {a.scrape_s} s ({samples / 1e6:.1f} M samples); "
          f"median of {a.repeats} runs at the same instant")
    with backfilled("\n".join([*raw, "# EOF", ""]), block="720h") as prom, httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        records = recorded(client, prom.url, slices, start + STEP_S, end)
        built = time.perf_counter() - t0
    print(f"the 5-min slice records over the history (3 series, one a minute): {built:.0f} s to evaluate")
    at = end + 1
    with backfilled("\n".join([*raw, *records, "# EOF", ""]), block="720h") as prom, \
            httpx.Client(timeout=600) as client:
        total = {"raw": 0.0, "summed": 0.0}
        for w in (SLICE, "1d", "3d"):
            share = q.share_at_or_below(c.REQUEST_TPOT, 0.02, w, LABELS, ['pool="decode"'],
                                        refused=c.UNOBSERVED_MISSES.get(c.REQUEST_TPOT))
            old = [f"1 - ({share})"]  # the rules' ratio before the slices
            new = [by_name[f"model_pool_slo:sli_error:ratio_rate{w}"]["expr"]]
            if w == SLICE:
                new = [r["expr"] for r in slices[:2]] + new
            row = {}
            for kind, exprs in (("raw", old), ("summed", new)):
                took, res = 0.0, []
                for expr in exprs:
                    runs = []
                    for _ in range(a.repeats):
                        t, res = _query(client, prom.url, expr, at)
                        runs.append(t)
                    took += statistics.median(runs)
                row[kind] = (took, res[0]["value"][1] if res else None)
                total[kind] += took
            print(f"  error ratio {w:>2}: before {row['raw'][0] * 1000:7.1f} ms (value {row['raw'][1]}), now "
                  f"{row['summed'][0] * 1000:6.1f} ms (value {row['summed'][1]}): ratio "
                  f"{row['summed'][0] / row['raw'][0]:.3f}")
        print(f"  an evaluation's error ratios: before {total['raw'] * 1000:.1f} ms, now {total['summed'] * 1000:.1f} "
              f"ms, ratio {total['summed'] / total['raw']:.3f}")

if __name__ == "__main__":
    main()
