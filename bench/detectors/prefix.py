"""Out-of-sample check of the prefix-cache hit-rate drift detector (issue 16).

    .venv/bin/python bench/detectors/prefix.py [--quick] [--set tuning|sealed|both] [--verbose]

Series come from ``bench/detectors/prefix_families.py`` (a generator written apart from the
detector, request by request). Each is replayed through ``drift.scan_rate`` with the parameters
the guard's ``prefix_hit_drift`` evaluator builds from its config (``detectors.prefix_hit``,
downward only). Seeds are split: tune on ``tuning``, report ``sealed`` beside it.
``BENCH_CODE_ROOT=DIR`` scores another checkout's detector on the same series.

Scores (95 % Wilson intervals; false alarms as a Poisson rate):
* a -0.10 step flagged within 10 min; random -0.05..-0.3 steps within 10 min;
* a ramp flagged before it is 0.04 below its start;
* ARL0: days per alarm on series without a change and before every onset (warm-up excluded),
  and the share of those alarms within 2 h of an engine restart (an empty cache refilling).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("BENCH_CODE_ROOT"):
    sys.path.insert(0, os.environ["BENCH_CODE_ROOT"])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prefix_families as fam
from run import poisson_ci, wilson  # the issue-16 protocol's intervals

from sla_guard.detect import drift
from sla_guard.settings.detectors import DetectorsConfig

SIZES = {"none": (100, 16), "step10": (100, 16), "step_any": (60, 10), "ramp": (100, 16)}
SETS = {"tuning": fam.TUNING_SEEDS.start, "sealed": fam.SEALED_SEEDS.start}


def production_params() -> drift.RateDriftParams:
    """What ``evaluators.build_evaluators`` gives the prefix-hit evaluator, from the default config."""
    cfg = DetectorsConfig().prefix_hit
    return drift.RateDriftParams(interval_s=cfg.interval_s, warmup_s=cfg.warmup_s, shift=cfg.shift,
                                 tolerance=cfg.tolerance, sides="down", arl0_s=cfg.arl0_days * drift.DAY,
                                 family=1, arl_rule=cfg.arl_rule, jitter_blocks=cfg.jitter_blocks,
                                 refine_s=cfg.refine_s, reset_hold_s=cfg.reset_hold_s, trend_wander=cfg.wander,
                                 measured_wander_blocks=cfg.measured_wander_blocks)


PARAMS = production_params()


def _cases(base: int, quick: bool) -> list[tuple[str, int, str, float | None]]:
    q = 1 if quick else 0
    out = [("none", base + i, "none", None) for i in range(SIZES["none"][q])]
    out += [("step10", base + 1000 + i, "step", -0.10) for i in range(SIZES["step10"][q])]
    out += [("step_any", base + 2000 + i, "step", None) for i in range(SIZES["step_any"][q])]
    out += [("ramp", base + 3000 + i, "ramp", None) for i in range(SIZES["ramp"][q])]
    return out


def replay(job: tuple[str, int, str, float | None]) -> dict:
    cohort, seed, kind, change = job
    s = fam.prefix_case(seed, kind=kind, change=change)
    alarms, _ = drift.scan_rate(s.t, s.queries, s.hits, PARAMS)
    return {"cohort": cohort, "name": s.name, "onset": s.onset, "span": float(s.t[-1]), "per_hour": s.per_hour,
            "restarts": s.restarts, "deadline": s.deviation_time(0.04), "family": s.family,
            "opened": [a.at for a in alarms if a.direction == "down"]}


def _pct(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{100 * k / max(n, 1):5.1f} % ({k}/{n}, {100 * lo:.0f}-{100 * hi:.0f})"


def score(rows: list[dict], verbose: bool = False) -> dict[str, str]:
    fa = after_restart = 0
    days = 0.0
    hits = {"step10": [0, 0], "step_any": [0, 0], "ramp": [0, 0]}
    warm = PARAMS.warmup_s
    for r in rows:
        onset = r["onset"]
        end = onset if onset is not None else r["span"]
        early = [a for a in r["opened"] if a < end]
        fa += len(early)
        after_restart += sum(1 for a in early if any(0 <= a - x <= 2 * fam.HOUR for x in r["restarts"]))
        days += max(0.0, end - warm) / fam.DAY
        if verbose and early:
            print(f"  FA {r['name']} at {[round(a / 3600, 2) for a in early]} h, restarts "
                  f"{[round(x / 3600, 2) for x in r['restarts']]} h {r['family']}")
        if onset is None:
            continue
        first = min((a - onset for a in r["opened"] if a >= onset), default=math.inf)
        limit = 600.0 if r["cohort"] != "ramp" else r["deadline"] - onset
        hits[r["cohort"]][0] += first <= limit
        hits[r["cohort"]][1] += 1
        if verbose and first > limit:
            print(f"  late {r['name']} onset {onset / 3600:.1f} h: {first / 60:.0f} min "
                  f"(limit {limit / 60:.0f}) {r['family']}")
    arl = days / fa if fa else math.inf
    lo = days / poisson_ci(fa)[1]
    return {
        "-0.10 step within 10 min": _pct(*hits["step10"]),
        "-0.05..-0.3 step within 10 min": _pct(*hits["step_any"]),
        "ramp flagged before 0.04 down": _pct(*hits["ramp"]),
        "ARL0 (days per false alarm)": (f"{arl:6.1f} d ({fa} in {days:.0f} d)" if fa else f"inf (0 in {days:.0f} d)")
        + f", >= {lo:.0f} d at 95 %",
        "  of the false alarms, <= 2 h after a restart": f"{after_restart}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", choices=("tuning", "sealed", "both"), default="both")
    ap.add_argument("--verbose", action="store_true", help="list false alarms and late detections (tuning only)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], metavar="FIELD=VALUE",
                    help="a RateDriftParams field for this run (repeatable)")
    args = ap.parse_args(argv)
    global PARAMS
    for kv in args.param:
        k, v = kv.split("=", 1)
        cur = getattr(PARAMS, k)
        val = (tuple(float(x) for x in v.split(",")) if isinstance(cur, tuple)
               else v.lower() in ("1", "true", "yes") if isinstance(cur, bool) else type(cur)(v))
        PARAMS = dataclasses.replace(PARAMS, **{k: val})
    t0 = time.perf_counter()
    names = ("tuning", "sealed") if args.set == "both" else (args.set,)
    cols = {}
    with Pool(args.jobs) as pool:
        for name in names:
            rows = pool.map(replay, _cases(SETS[name], args.quick), chunksize=4)
            cols[name] = score(rows, verbose=args.verbose and name == "tuning")
    print(f"{'case':46s} " + " | ".join(f"{n:36s}" for n in names))
    for k in cols[names[0]]:
        print(f"{k:46s} " + " | ".join(f"{cols[n][k]:36s}" for n in names))
    print(f"wall {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
