"""Which part of families.py's series costs the leak detector what? (issue 16)

    .venv/bin/python bench/detectors/leak_ablation.py [--set tuning|sealed|both] [--parts P,...]
        [--alone] [--jobs N]

The leak targets (99 % of 48 MiB/h leaks within 2 h, at most one false alarm per 30
process-days) are far from met on families.py, and ``leak_bound.py`` showed that the floor's
rise alone separates nothing there. This script asks which of the series' parts (start-up
growth, sawtooth, spikes, steps, daily and hourly swings, load coupling) stands between the
detector and the targets. It replays the production detector (``leak.scan``, RSS only and
load-aware, as ``run.py`` does) on ``run.py``'s quiet cohort and 48 MiB/h cohort:

* with every part;
* with each part left out in turn, or (``--alone``) each part alone
  (``families.leak_case(without=)`` still draws a part it leaves out, so the rest of the series
  is unchanged);
* with all of them left out (a linear leak, restarts and noise only).

A part whose removal lifts detection or removes false alarms is one the detector cannot tell
from a leak. What remains with all parts out is the cost of the detector's own machinery (the
start-up exclusion, confirmation, window coverage).

Nothing here is tuned; it is a diagnosis. The sealed set is printed when asked, as everywhere.
"""

from __future__ import annotations

import argparse
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # bench/detectors/run.py: sets the path and thread limits, scores

fam = run.fam
COHORTS = {"none": (0, 60, 0.0), "48": (10_000, 100, 48.0)}


def variants(parts: list[str], alone: bool) -> list[tuple[str, frozenset[str]]]:
    every = frozenset(fam.LEAK_PARTS)
    each = ([(f"only {p}", every - {p}) for p in parts] if alone
            else [(f"without {p}", frozenset({p})) for p in parts])
    return [("every part", frozenset()), *each, ("without any part", every)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=["tuning", "sealed", "both"], default="tuning")
    ap.add_argument("--parts", default=",".join(fam.LEAK_PARTS), help="parts to leave out one at a time")
    ap.add_argument("--alone", action="store_true", help="keep one part at a time instead of leaving one out")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    sets = ["tuning", "sealed"] if a.set == "both" else [a.set]
    print("# leak_ablation.py: the production detector on families.py with parts of the series left out")
    print("# columns per mode: 48 MiB/h found within 2 h (early onsets; restarting processes),"
          " false alarms per 30 process-days (count), onset within 30 min")
    with Pool(a.jobs) as pool:
        for name in sets:
            base = run.SETS[name]
            print(f"\n## {name} set (seeds from {base})")
            for label, without in variants(parts, a.alone):
                jobs = [(c, base + off + s, rate, without) for c, (off, n, rate) in COHORTS.items() for s in range(n)]
                res = pool.map(run.leak_job, jobs)
                cols = []
                for mode in ("rss", "load"):
                    sc = run.leak_scores(res, mode)
                    (k, n), (ke, ne), (kr, nr) = sc["w48"], sc["w48_early"], sc["w48_restart"]
                    ok, on = sc["onset"]
                    cols.append(f"{mode}: {100 * k / n:5.1f} % ({ke}/{ne}; {kr}/{nr}),"
                                f" FA {sc['fa30']:.2f} ({sc['fa']}), onset {100 * ok / max(on, 1):5.1f} %")
                print(f"{label:<24} " + " | ".join(cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
