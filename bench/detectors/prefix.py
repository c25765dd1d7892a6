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

import math
import os
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("BENCH_CODE_ROOT"):
    sys.path.insert(0, os.environ["BENCH_CODE_ROOT"])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prefix_families as fam
from run import SETS, arl0_text, rate_text, score_sets, set_parser, with_overrides  # the issue-16 protocol

from sla_guard.detect import drift
from sla_guard.detect.evaluators import rate_params
from sla_guard.settings.detectors import DetectorsConfig

SIZES = {"none": (100, 16), "step10": (100, 16), "step_any": (60, 10), "ramp": (100, 16)}


PARAMS = rate_params(DetectorsConfig().prefix_hit, "down")  # what the guard's prefix_hit_drift evaluator runs


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
        days += max(0.0, end - warm) / drift.DAY
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
    return {
        "-0.10 step within 10 min": rate_text(*hits["step10"]),
        "-0.05..-0.3 step within 10 min": rate_text(*hits["step_any"]),
        "ramp flagged before 0.04 down": rate_text(*hits["ramp"]),
        "ARL0 (days per false alarm)": arl0_text(fa, days),
        "  of the false alarms, <= 2 h after a restart": f"{after_restart}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = set_parser(__doc__, "RateDriftParams")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    global PARAMS
    PARAMS = with_overrides(PARAMS, args.param, "--param")
    with Pool(args.jobs) as pool:
        score_sets(args.set, lambda n: pool.map(replay, _cases(SETS[n], args.quick), chunksize=4), score,
                   args.verbose, 46)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
