"""Out-of-sample validation of the leak and drift detectors (issue 16).

    .venv/bin/python bench/detectors/run.py [--quick] [--only leaks|rates] [--set tuning|sealed|both]
        [--jobs N] [--leak-param FIELD=VALUE ...] [--rate-param FIELD=VALUE ...]

Series come from ``bench/detectors/families.py``, a generator written apart from the one the
detectors were first tuned on (``sla_guard/detect/synthetic.py``; its harness is
``bench/detectors/legacy.py``). Seeds are split: the *tuning* set is what a developer looks at
while changing a detector; the *sealed* set is printed beside it once per change and is never
tuned to. Every detector is replayed causally (``leak.scan``, ``drift.scan_rate``), as
``sla-guard analyze`` and the guard run it, and scored against the issue's targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per worker
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# BENCH_CODE_ROOT: score the detectors of another checkout (e.g. a worktree of an older commit)
if os.environ.get("BENCH_CODE_ROOT"):
    sys.path.insert(0, os.environ["BENCH_CODE_ROOT"])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import families as fam  # noqa: E402
import simple  # noqa: E402

from sla_guard.detect import drift, leak  # noqa: E402

HOUR, DAY = fam.HOUR, fam.DAY
LEAK_PARAMS = leak.LeakParams()
RATE_PARAMS = drift.RateDriftParams()
DETECTOR = "production"  # or "simple": the plain methods (bench/detectors/simple.py), RSS only
SIMPLE_LEAK = simple.SimpleLeakParams()
SIMPLE_RATE = simple.SimpleRateParams()
SETS = {"tuning": fam.TUNING_SEEDS.start, "sealed": fam.SEALED_SEEDS.start}

# corpus sizes per set: (full, quick)
SIZES = {"leak_none": (60, 10), "leak48": (100, 16), "leak24": (60, 10), "leak_any": (60, 10),
         "rate_none": (120, 16), "step10": (100, 16), "step_any": (60, 10), "ramp": (100, 16)}


def _params(cls, overrides: list[str], flag: str):
    """``KEY=VALUE`` strings -> a params dataclass, each value parsed as its field's default type."""
    return with_overrides(cls(), overrides, flag)


def with_overrides(p, overrides: list[str], flag: str):
    """``p`` (a params dataclass) with ``KEY=VALUE`` strings applied, each parsed as its field's type."""
    cls = type(p)
    kw = {}
    for item in overrides:
        key, sep, val = item.partition("=")
        if not sep or not hasattr(p, key):
            raise SystemExit(f"{flag} {item!r}: expected FIELD=VALUE with a {cls.__name__} field")
        cur = getattr(p, key)
        if isinstance(cur, bool):
            kw[key] = val.lower() in ("1", "true", "yes")
        elif isinstance(cur, tuple):
            kw[key] = tuple(float(x) for x in val.split(","))
        else:
            kw[key] = type(cur)(val)
    return dataclasses.replace(p, **kw)


# --- jobs ------------------------------------------------------------------------------------

def leak_job(args) -> dict:
    """(cohort, seed, rate[, parts left out]) -> alarms, first detection and onset per mode."""
    cohort, seed, rate, *without = args
    c = fam.leak_case(seed, leak_mib_h=rate, without=without[0] if without else frozenset())
    out = {"cohort": cohort, "name": c.name, "onset": c.onset, "rate": c.leak_mib_h, "family": c.family,
           "days": ((c.onset if c.onset is not None else c.t[-1]) - c.t[0]) / DAY}
    hold = min(LEAK_PARAMS.windows_s)
    for mode, load in (("rss", None), ("load", (c.t, c.running))):
        if DETECTOR == "simple":  # no load-aware mode: both columns are the RSS-only method
            vs = simple.leak_scan(c.t, c.rss, SIMPLE_LEAK)
        else:
            vs = leak.scan(c.t, c.rss, LEAK_PARAMS, limit_bytes=c.limit_bytes, load=load)
        eps = leak.episodes(vs, hold)
        first_after = next(((at, v) for at, v in vs if v.detected and c.onset is not None and at >= c.onset), None)
        out[mode] = {"alarms": [s for s, _ in eps],
                     "first": first_after[0] if first_after else None,
                     "onset_est": first_after[1].onset if first_after else None}
    return out


def rate_job(args) -> dict:
    cohort, seed, kind, change = args
    c = fam.rate_case(seed, kind=kind, change=change)
    if DETECTOR == "simple":
        alarms = simple.rate_scan(c.t, c.drafts, c.accepted, SIMPLE_RATE)
    else:
        alarms, _cus = drift.scan_rate(c.t, c.drafts, c.accepted, RATE_PARAMS)
    return {"cohort": cohort, "name": c.name, "onset": c.onset, "kind": kind, "change": c.change,
            "per_hour": c.per_hour, "family": c.family, "t_end": float(c.t[-1]),
            "deadline": (c.onset + 600.0 if kind == "step" else c.deviation_time(0.04)) if c.onset else None,
            "alarms": [(a.at, a.direction) for a in alarms],
            "days": ((c.onset if c.onset is not None else c.t[-1]) - c.t[0]) / DAY}


def leak_jobs(base: int, quick: bool) -> list[tuple]:
    q = 1 if quick else 0
    jobs = [("none", base + s, 0.0) for s in range(SIZES["leak_none"][q])]
    jobs += [("48", base + 10_000 + s, 48.0) for s in range(SIZES["leak48"][q])]
    jobs += [("24", base + 20_000 + s, 24.0) for s in range(SIZES["leak24"][q])]
    jobs += [("any", base + 30_000 + s, None) for s in range(SIZES["leak_any"][q])]
    return jobs


def rate_jobs(base: int, quick: bool) -> list[tuple]:
    q = 1 if quick else 0
    jobs = [("none", base + s, "none", None) for s in range(SIZES["rate_none"][q])]
    n = SIZES["step10"][q]
    jobs += [("step-0.10", base + 10_000 + s, "step", -0.10) for s in range(n // 2)]
    jobs += [("step+0.10", base + 10_000 + s, "step", 0.10) for s in range(n // 2, n)]
    jobs += [("step_any", base + 20_000 + s, "step", None) for s in range(SIZES["step_any"][q])]
    jobs += [("ramp", base + 30_000 + s, "ramp", None) for s in range(SIZES["ramp"][q])]
    return jobs


# --- scoring ---------------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k / n."""
    if not n:
        return 0.0, 1.0
    ph = k / n
    den = 1 + z * z / n
    mid = (ph + z * z / (2 * n)) / den
    half = z * np.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def poisson_ci(k: int) -> tuple[float, float]:
    """95 % interval of a Poisson count k (Wilson-Hilferty, exact enough for a report)."""
    lo = 0.0 if k == 0 else k * (1 - 1 / (9 * k) - 1.96 / (3 * np.sqrt(k))) ** 3
    k1 = k + 1
    hi = k1 * (1 - 1 / (9 * k1) + 1.96 / (3 * np.sqrt(k1))) ** 3
    return lo, hi


def _pct(k: int, n: int) -> str:
    if not n:
        return "-"
    lo, hi = wilson(k, n)
    return f"{100.0 * k / n:.1f}% ({k}/{n}; {100 * lo:.0f}-{100 * hi:.0f})"


def _fa(k: int, days: float) -> str:
    lo, hi = poisson_ci(k)
    return f"{30 * k / days:.2f} ({k} in {days:.0f} d; {30 * lo / days:.2f}-{30 * hi / days:.2f})"


def leak_scores(res: list[dict], mode: str) -> dict:
    fa = sum(len([a for a in r[mode]["alarms"] if r["onset"] is None or a < r["onset"]]) for r in res)
    days = sum(r["days"] for r in res)
    restart_days = sum(r["days"] for r in res if r["family"]["restarts"])
    restart_fa = sum(len([a for a in r[mode]["alarms"] if r["onset"] is None or a < r["onset"]])
                     for r in res if r["family"]["restarts"])

    def within(cohort, hours, pred=lambda r: True):
        rs = [r for r in res if r["cohort"] == cohort and pred(r)]
        ok = [r for r in rs if r[mode]["first"] is not None and r[mode]["first"] - r["onset"] <= hours * HOUR]
        return len(ok), len(rs)

    d48 = [(r[mode]["first"] - r["onset"]) / HOUR for r in res if r["cohort"] == "48" and r[mode]["first"]]
    on = [r for r in res if r["cohort"] == "48" and r[mode]["first"] is not None]
    on_ok = sum(1 for r in on if r[mode]["onset_est"] is not None and abs(r[mode]["onset_est"] - r["onset"]) <= 1800)
    anyr = [r for r in res if r["cohort"] == "any"]
    any_ok = [r for r in anyr if r[mode]["first"] is not None
              and r[mode]["first"] - r["onset"] <= max(2.0, 96.0 / r["rate"]) * HOUR]
    return {"fa": fa, "days": days, "fa30": 30 * fa / days if days else float("nan"),
            "restart_fa30": 30 * restart_fa / restart_days if restart_days else float("nan"),
            "restart_days": restart_days, "restart_fa": restart_fa,
            "w48": within("48", 2), "w24": within("24", 4),
            "w48_early": within("48", 2, lambda r: r["family"]["early_onset"]),
            "w48_restart": within("48", 2, lambda r: r["family"]["restarts"]),
            "d48": d48, "onset": (on_ok, len(on)), "any": (len(any_ok), len(anyr))}


def rate_scores(res: list[dict]) -> dict:
    fa = sum(len([a for a, _ in r["alarms"] if r["onset"] is None or a < r["onset"]]) for r in res)
    days = sum(r["days"] for r in res)

    def hit(r):
        want = "down" if r["change"] < 0 else "up"
        return any(r["onset"] <= a <= r["deadline"] and d == want for a, d in r["alarms"])

    steps = [r for r in res if r["cohort"] in ("step-0.10", "step+0.10")]
    ramps = [r for r in res if r["cohort"] == "ramp"]
    sany = [r for r in res if r["cohort"] == "step_any"]
    delays = [min(a for a, _ in r["alarms"] if a >= r["onset"]) - r["onset"] for r in steps
              if any(a >= r["onset"] for a, _ in r["alarms"])]
    return {"fa": fa, "days": days, "arl0": days / fa if fa else float("inf"),
            "step": (sum(map(hit, steps)), len(steps)), "ramp": (sum(map(hit, ramps)), len(ramps)),
            "step_any": (sum(map(hit, sany)), len(sany)),
            "ramp_early": (sum(hit(r) for r in ramps if r["family"]["early_onset"]),
                           sum(1 for r in ramps if r["family"]["early_onset"])),
            "step_delay": delays}


def leak_table(scores: dict[str, dict]) -> str:
    sets = list(scores)
    rows = [("case", "target", *sets)]
    for mode, label in (("rss", "RSS only"), ("load", "load-aware")):
        g = {s: scores[s][mode] for s in sets}
        rows += [
            (f"48 MiB/h within 2 h ({label})", ">= 99%", *(_pct(*g[s]["w48"]) for s in sets)),
            ("  of which onset in first 3 h after a start", "", *(_pct(*g[s]["w48_early"]) for s in sets)),
            ("  of which on restarting processes", "", *(_pct(*g[s]["w48_restart"]) for s in sets)),
            ("  delay median / p95 / max (h)", "", *(_q(g[s]["d48"]) for s in sets)),
            (f"24 MiB/h within 4 h ({label})", ">= 95%", *(_pct(*g[s]["w24"]) for s in sets)),
            (f"false alarms per 30 process-days ({label})", "<= 1",
             *(_fa(g[s]["fa"], g[s]["days"]) for s in sets)),
            ("  on restarting processes", "<= 1", *(_fa(g[s]["restart_fa"], g[s]["restart_days"])
                                                     for s in sets)),
            (f"onset within 30 min, 48 MiB/h ({label})", ">= 90%", *(_pct(*g[s]["onset"]) for s in sets)),
            ("10-200 MiB/h within max(2 h, 96 MiB / rate)", "", *(_pct(*g[s]["any"]) for s in sets)),
        ]
    return _render("host-memory leak (families.py)", rows)


def rate_table(scores: dict[str, dict]) -> str:
    sets = list(scores)
    rows = [("case", "target", *sets),
            ("0.10 step (down and up) within 10 min", ">= 99%", *(_pct(*scores[s]["step"]) for s in sets)),
            ("  delay median / p95 / max (min)", "", *(_q(np.asarray(scores[s]["step_delay"]) / 60 * HOUR / HOUR,
                                                         unit=1.0) for s in sets)),
            ("ramp flagged before 0.04 from its start", ">= 95%", *(_pct(*scores[s]["ramp"]) for s in sets)),
            ("  of which starting in the first 3 h", "", *(_pct(*scores[s]["ramp_early"]) for s in sets)),
            ("+-0.05..0.2 step within 10 min", "", *(_pct(*scores[s]["step_any"]) for s in sets)),
            ("ARL0 (days per false alarm)", ">= 30",
             *(f"{scores[s]['arl0']:.0f} ({scores[s]['fa']} in {scores[s]['days']:.0f} d; "
               f">= {scores[s]['days'] / poisson_ci(scores[s]['fa'])[1]:.0f})" for s in sets))]
    return _render("spec-decode acceptance drift (families.py)", rows)


def _q(v, unit: float = 1.0) -> str:
    v = np.asarray(v, float) * unit
    if not len(v):
        return "-"
    return f"{np.median(v):.2f} / {np.percentile(v, 95):.2f} / {v.max():.2f}"


def set_parser(doc: str, params_name: str) -> argparse.ArgumentParser:
    """The options tpot.py and prefix.py share: --quick, --set, --verbose, --param."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", choices=("tuning", "sealed", "both"), default="both")
    ap.add_argument("--verbose", action="store_true", help="list false alarms and late detections (tuning only)")
    ap.add_argument("--param", action="append", default=[], metavar="FIELD=VALUE",
                    help=f"a {params_name} field for this run (repeatable)")
    return ap


def rate_text(k: int, n: int) -> str:
    """``k`` of ``n`` as a percentage with its count and 95 % Wilson interval (tpot.py, prefix.py)."""
    lo, hi = wilson(k, n)
    return f"{100 * k / max(n, 1):5.1f} % ({k}/{n}, {100 * lo:.0f}-{100 * hi:.0f})"


def arl0_text(fa: int, days: float) -> str:
    """Days per false alarm, with the lower end of its 95 % Poisson interval."""
    lo = days / poisson_ci(fa)[1]
    head = f"{days / fa:6.1f} d ({fa} in {days:.0f} d)" if fa else f"inf (0 in {days:.0f} d)"
    return head + f", >= {lo:.0f} d at 95 %"


def score_sets(which: str, rows_for, score, verbose: bool, label_width: int) -> None:
    """Score the tuning and/or sealed set (``rows_for(name)`` replays one) and print them side by
    side, with the wall time on stderr (tpot.py, prefix.py)."""
    t0 = time.perf_counter()
    names = ("tuning", "sealed") if which == "both" else (which,)
    print_sets({n: score(rows_for(n), verbose=verbose and n == "tuning") for n in names}, label_width)
    print(f"wall {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def print_sets(cols: dict[str, dict[str, str]], label_width: int) -> None:
    """One row per case, one column per seed set (tuning, sealed), as tpot.py and prefix.py print."""
    names = list(cols)
    print(f"{'case':{label_width}s} " + " | ".join(f"{n:36s}" for n in names))
    for k in cols[names[0]]:
        print(f"{k:{label_width}s} " + " | ".join(f"{cols[n][k]:36s}" for n in names))


def _render(title: str, rows: list[tuple]) -> str:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [f"\n== {title} =="]
    for k, r in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
        if k == 0:
            lines.append("  ".join("-" * x for x in w))
    return "\n".join(lines)


def misses(res: list[dict], mode: str) -> list[str]:
    out = []
    for r in res:
        m = r[mode]
        if r["cohort"] in ("48", "24"):
            lim = 2 if r["cohort"] == "48" else 4
            if m["first"] is None or m["first"] - r["onset"] > lim * HOUR:
                d = "never" if m["first"] is None else f"{(m['first'] - r['onset']) / HOUR:.2f} h"
                out.append(f"  miss {mode} {r['name']} onset {r['onset'] / HOUR:.1f} h: {d} {r['family']}")
        fas = [a for a in m["alarms"] if r["onset"] is None or a < r["onset"]]
        if fas:
            out.append(f"  FA {mode} {r['name']} at {[round(a / HOUR, 1) for a in fas]} h {r['family']}")
    return out


def _rounded(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few series per cohort (development)")
    ap.add_argument("--only", choices=("all", "leaks", "rates"), default="all")
    ap.add_argument("--set", choices=("tuning", "sealed", "both"), default="both")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--verbose", action="store_true", help="list misses and false alarms (tuning set only)")
    ap.add_argument("--leak-param", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--rate-param", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--detector", choices=("production", "simple"), default="production",
                    help="simple: the issue's plain methods (bench/detectors/simple.py); --leak-param and "
                         "--rate-param then set SimpleLeakParams / SimpleRateParams fields")
    a = ap.parse_args(argv)
    global LEAK_PARAMS, RATE_PARAMS, DETECTOR, SIMPLE_LEAK, SIMPLE_RATE
    DETECTOR = a.detector
    if DETECTOR == "simple":
        SIMPLE_LEAK = _params(simple.SimpleLeakParams, a.leak_param, "--leak-param")
        SIMPLE_RATE = _params(simple.SimpleRateParams, a.rate_param, "--rate-param")
    else:
        LEAK_PARAMS = _params(leak.LeakParams, a.leak_param, "--leak-param")
        RATE_PARAMS = _params(drift.RateDriftParams, a.rate_param, "--rate-param")
    sets = ["tuning", "sealed"] if a.set == "both" else [a.set]
    t0 = time.time()
    lsc, rsc = {}, {}
    with Pool(a.jobs) as pool:
        for s in sets:
            if a.only in ("all", "leaks"):
                res = pool.map(leak_job, leak_jobs(SETS[s], a.quick), chunksize=1)
                lsc[s] = {m: leak_scores(res, m) for m in ("rss", "load")}
                if a.verbose and s == "tuning":
                    print("\n".join(misses(res, "rss") + misses(res, "load")))
            if a.only in ("all", "rates"):
                res = pool.map(rate_job, rate_jobs(SETS[s], a.quick), chunksize=2)
                rsc[s] = rate_scores(res)
                if a.verbose and s == "tuning":
                    for r in res:
                        fas = [x for x, _ in r["alarms"] if r["onset"] is None or x < r["onset"]]
                        if fas:
                            print(f"  FA {r['name']} at {[round(x / HOUR, 1) for x in fas]} h {r['family']}")
                        if r["onset"] is not None and not any(r["onset"] <= x <= r["deadline"] for x, _ in r["alarms"]):
                            late = [round((x - r["onset"]) / 60, 1) for x, _ in r["alarms"] if x >= r["onset"]]
                            print(f"  miss {r['name']} onset {r['onset'] / HOUR:.1f} h deadline "
                                  f"{(r['deadline'] - r['onset']) / 60:.0f} min, alarms after onset {late} min "
                                  f"{_rounded(r['family'])}")
    if lsc:
        print(leak_table(lsc))
    if rsc:
        print(rate_table(rsc))
    print("\n(k/n; lo-hi): count and 95 % Wilson interval; false alarms: 95 % Poisson interval; "
          "ARL0 >= its lower 95 % bound")
    print(f"{'quick' if a.quick else 'full'} run, {time.time() - t0:.0f} s, {DETECTOR} detectors from "
          f"{Path(leak.__file__).resolve().parents[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
