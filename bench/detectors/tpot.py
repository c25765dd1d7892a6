"""Out-of-sample check of the TPOT-at-same-load drift detector (issue 16).

    .venv/bin/python bench/detectors/tpot.py [--quick] [--set tuning|sealed|both] [--verbose]

Series come from ``bench/detectors/tpot_families.py`` (a generator written apart from the
detector). Each series is replayed as ``TpotDriftEvaluator`` feeds ``drift.LatencyCusum``: every
60 s the mean TPOT of the requests that finished in the interval (the histogram's Δsum / Δcount;
an interval with a counter reset is skipped) and the running requests at the interval's end.
``BENCH_CODE_ROOT=DIR`` scores another checkout's detector (a ``git worktree`` of an older
commit) on the same series. Seeds are split: tune on ``tuning``, report ``sealed`` beside it.

Scores (with 95 % Wilson intervals; false alarms as a Poisson rate):
* a +20 % step flagged within 10 min, and within 30 min; random +10..40 % steps within 10 min;
* a ramp flagged before it is 10 % above its start, and before +20 % (of the ramps that reach it);
* ARL0: days per alarm on series without a change and before every onset;
* coverage: the share of intervals after the first 3 h that the detector judges (not "unknown").
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("BENCH_CODE_ROOT"):
    sys.path.insert(0, os.environ["BENCH_CODE_ROOT"])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import tpot_families as fam
from run import SETS, arl0_text, rate_text, score_sets, set_parser, with_overrides  # the issue-16 protocol

from sla_guard.detect import drift

INTERVAL_S = 60.0
# the detector before this bench (BENCH_CODE_ROOT at an older commit): another name, no request count
DETECTOR = getattr(drift, "LatencyDrift", None) or drift.LatencyCusum
COUNTS = "requests" in inspect.signature(DETECTOR.update).parameters
MEAN_RUNNING = COUNTS  # ... and read the running requests at the interval's end, not their mean over it
SIZES = {"none": (120, 16), "step20": (100, 16), "step_any": (60, 10), "ramp": (100, 16)}


PARAMS = drift.LatencyDriftParams()


def replay(s: fam.TpotSeries) -> dict:
    """Alarm openings, intervals judged after 3 h and intervals after 3 h, as the guard would see them."""
    cus = DETECTOR(PARAMS)
    ends = np.arange(s.t[0] + INTERVAL_S, s.t[-1] + 1e-9, INTERVAL_S)
    idx = np.searchsorted(s.t, ends, side="right") - 1
    opened, judged, late = [], 0, 0
    prev = idx[0]
    for te, i in zip(ends[1:], idx[1:], strict=True):
        ds, dc = s.tpot_sum[i] - s.tpot_sum[prev], s.tpot_count[i] - s.tpot_count[prev]
        prev_i, prev = prev, i
        if dc <= 0 or ds < 0:  # nothing finished, or a counter reset in the interval
            continue
        before = (cus.unknown, cus.alarm is not None)
        run = float(np.mean(s.running[prev_i + 1:i + 1])) if MEAN_RUNNING and i > prev_i else float(s.running[i])
        cus.update(float(te), float(ds / dc), run, *((float(dc),) if COUNTS else ()))
        if te - s.t[0] >= 3 * fam.HOUR:
            late += 1
            judged += cus.unknown == before[0]
        if cus.alarm is not None and not before[1]:
            opened.append(float(te))
    return {"name": s.name, "opened": opened, "judged": judged, "late": late, "onset": s.onset,
            "kind": s.kind, "change": s.change, "per_hour": s.per_hour, "span": float(s.t[-1] - s.t[0]),
            "family": s.family}


def _cases(base: int, quick: bool) -> list[tuple[str, fam.TpotSeries]]:
    q = 1 if quick else 0
    out = [("none", fam.tpot_case(base + i)) for i in range(SIZES["none"][q])]
    out += [("step20", fam.tpot_case(base + 1000 + i, kind="step", change=0.20)) for i in range(SIZES["step20"][q])]
    out += [("step_any", fam.tpot_case(base + 2000 + i, kind="step")) for i in range(SIZES["step_any"][q])]
    out += [("ramp", fam.tpot_case(base + 3000 + i, kind="ramp")) for i in range(SIZES["ramp"][q])]
    return out


def score(rows: list[tuple[str, dict]], verbose: bool = False) -> dict[str, str]:
    fa, days, judged, late = 0, 0.0, 0, 0
    hits = {"step20_10": [0, 0], "step20_30": [0, 0], "step_any_10": [0, 0], "ramp_10pct": [0, 0],
            "ramp_20pct": [0, 0]}
    for cohort, r in rows:
        onset = r["onset"]
        end = onset if onset is not None else r["span"]
        early = [a for a in r["opened"] if a < end]
        fa += len(early)
        days += max(0.0, end - fam.HOUR) / fam.DAY  # the first hour is the warm-up
        if cohort == "none":
            judged += r["judged"]
            late += r["late"]
            if verbose and early:
                print(f"  FA {r['name']} at {[round(a / 3600, 1) for a in early]} h {r['family']}")
            continue
        after = [a - onset for a in r["opened"] if a >= onset]
        first = after[0] if after else math.inf
        if cohort == "ramp":
            deadline = 0.10 / r["per_hour"] * fam.HOUR
            hits["ramp_10pct"][0] += first <= deadline
            hits["ramp_10pct"][1] += 1
            if r["change"] >= 0.20:  # the ramps that reach +20 %
                hits["ramp_20pct"][0] += first <= 2 * deadline
                hits["ramp_20pct"][1] += 1
        else:
            key = "step20" if cohort == "step20" else "step_any"
            hits[f"{key}_10"][0] += first <= 600
            hits[f"{key}_10"][1] += 1
            if key == "step20":
                hits["step20_30"][0] += first <= 1800
                hits["step20_30"][1] += 1
        if verbose and (first > (600 if cohort != "ramp" else 0.10 / r["per_hour"] * fam.HOUR)):
            print(f"  late {r['name']} ({cohort}): {first / 60:.0f} min {r['family']}")
    return {
        "+20 % step within 10 min": rate_text(*hits["step20_10"]),
        "+20 % step within 30 min": rate_text(*hits["step20_30"]),
        "+10..40 % step within 10 min": rate_text(*hits["step_any_10"]),
        "ramp flagged before +10 %": rate_text(*hits["ramp_10pct"]),
        "ramp flagged before +20 %": rate_text(*hits["ramp_20pct"]),
        "ARL0 (days per false alarm)": arl0_text(fa, days),
        "coverage after 3 h (no change)": rate_text(judged, late),
    }


def main(argv: list[str] | None = None) -> int:
    ap = set_parser(__doc__, "LatencyDriftParams")
    args = ap.parse_args(argv)
    global PARAMS
    PARAMS = with_overrides(PARAMS, args.param, "--param")
    score_sets(args.set, lambda n: [(c, replay(s)) for c, s in _cases(SETS[n], args.quick)], score, args.verbose, 34)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
