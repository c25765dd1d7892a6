"""The TPOT drift detector on series of another generator: the simulated P/D deployment
(``sla_guard/sim``, its own step-time model of the default GLM/H200 profile, batching, MTP and
KV transfer), scraped every 15 s and fed to the guard's real ``TpotDriftEvaluator``.

    .venv/bin/python bench/detectors/tpot_sim.py [--hours 6] [--seeds 0 1 2] [--families diurnal bursty]

Per generated workload (``sla_guard.sim.workloads.generated``, seeds >= 500, never the advisor's
suite) three runs on a static 2P2D: no fault (every finding is a false alarm), and an MTP
acceptance drop on every decode replica at half the run, to 0.8x at once (a step) or over 2 h
(a ramp): TPOT at the same batch rises by what the lost accepted tokens cost. Prints, per run,
the findings' times and their reported slowdown. Nothing is tuned on these runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sla_guard.detect.evaluators import TpotDriftEvaluator
from sla_guard.detect.findings import FindingsBook
from sla_guard.settings.detectors import TpotConfig
from sla_guard.sim.deployment import Deployment
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.profile import load_profile
from sla_guard.sim.run import build_guard
from sla_guard.sim.workloads import generated


def run(family: str, seed: int, hours: float, fault: str) -> dict:
    span = hours * 3600.0
    onset = span * 2 / 3  # two hourly noise blocks measured after the warm-up and the 2 h hold
    faults = {"none": [],
              "step": [{"kind": "acceptance_drift", "start_s": onset, "end_s": onset + 1, "to_factor": 0.8}],
              "ramp": [{"kind": "acceptance_drift", "start_s": onset, "end_s": onset + 7200, "to_factor": 0.8}]}[fault]
    dep = Deployment(load_profile("default"), 2, 2, faults=FaultSchedule(faults), seed=seed)
    dep.submit(generated(family, seed, span))
    store = make_store(retention_s=span + 3600, interval_s=15)
    book = FindingsBook()
    ev = TpotDriftEvaluator(book, TpotConfig())
    guard = build_guard(store, evaluators=[ev])
    opened: dict[tuple[str, float], tuple[float, float]] = {}  # (key, opened_at) -> (run time, slowdown)
    start: list[float] = []

    def watch(now: float) -> None:
        start[:] = start or [now]
        for f in book.open_findings():
            if f.detector == "tpot_drift" and (f.key, f.opened_at) not in opened:
                opened[(f.key, f.opened_at)] = (now - start[0], float(f.details.get("after") or float("nan")))

    ClosedLoop(dep, store=store, scrape_interval_s=15, guard=guard, on_tick=watch)
    dep.run_until(span)
    alarms = sorted((t, a, k) for (k, _), (t, a) in opened.items())
    return {"family": family, "seed": seed, "fault": fault, "onset_h": onset / 3600 if fault != "none" else None,
            "alarms": [(round(t / 3600, 2), round(a, 3), k.split("/")[-1]) for t, a, k in alarms]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[500, 501])
    ap.add_argument("--families", nargs="+", default=["diurnal", "bursty", "ramp"])
    ap.add_argument("--faults", nargs="+", default=["none", "step", "ramp"])
    args = ap.parse_args(argv)
    for fam in args.families:
        for seed in args.seeds:
            for fault in args.faults:
                t0 = time.perf_counter()
                r = run(fam, seed, args.hours, fault)
                print(f"{fam}/s{seed} {fault:5s} onset {r['onset_h']} h: findings (h, x, pool) {r['alarms']} "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
