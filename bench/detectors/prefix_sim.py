"""The prefix-cache hit-rate drift detector on series of another generator: the simulated P/D
deployment (``sla_guard/sim``: its own prefix cache over the requests' block hashes, routing,
eviction), scraped every 15 s and fed to the guard's real ``prefix_hit_drift`` evaluator.

    .venv/bin/python bench/detectors/prefix_sim.py [--hours 9] [--cases diurnal/500 bursty/502]

Per generated workload (``sla_guard.sim.workloads.generated``, seeds >= 500, never the advisor's
suite; the default cases are the first two seeds of diurnal and bursty whose mix shares prefixes)
three runs on a static 2P2D: no fault; a crash of prefill replica p0 at half the run (it
restarts after the profile's cold start with fresh counters and an empty cache); and from half
the run 40 % of the requests share no prefix any more (``unshare``: an application that began
stamping each prompt with a request id), a real drop of the hit rate. In the first two every
finding is a false alarm; in the third the first finding after the change is the detection.
Each run feeds two evaluators side by side:
the detector before session 16 (the acceptance parameters, downward) and the default
``detectors.prefix_hit`` config. Nothing is tuned on these runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from exporters import contract as c
from sla_guard.detect.evaluators import RateDriftEvaluator
from sla_guard.detect.findings import FindingsBook
from sla_guard.settings.detectors import DetectorsConfig, RateConfig
from sla_guard.sim.deployment import Deployment
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.profile import load_profile
from sla_guard.sim.run import build_guard
from sla_guard.sim.workloads import generated

CONFIGS = {"before": RateConfig(per_position=False), "now": DetectorsConfig().prefix_hit}


def run(family: str, seed: int, hours: float, fault: str) -> dict:
    span = hours * 3600.0
    fault_at = span / 2
    faults = {"none": [], "unshare": [], "crash": [{"kind": "crash", "replica": "p0", "at_s": fault_at}]}[fault]
    dep = Deployment(load_profile("default"), 2, 2, faults=FaultSchedule(faults), seed=seed)
    trace = generated(family, seed, span)
    if fault == "unshare":  # from half the run 40 % of the requests carry only blocks of their own
        rng = random.Random(seed)
        fresh = iter(range(2_000_000_000, 3_000_000_000))
        trace = replace(trace, requests=tuple(
            replace(r, hash_ids=tuple(next(fresh) for _ in r.hash_ids)) if r.t >= fault_at and rng.random() < 0.4
            else r for r in trace.requests))
    dep.submit(trace)
    store = make_store(retention_s=span + 3600, interval_s=15)
    books = {name: FindingsBook() for name in CONFIGS}
    evs = [RateDriftEvaluator(books[name], f"prefix_hit_drift_{name}", "prefix_hit_drift", c.PREFIX_CACHE_QUERIES,
                              c.PREFIX_CACHE_HITS, cfg, "down", "prefix-cache hit rate", matchers={"cache": "local"})
           for name, cfg in CONFIGS.items()]
    guard = build_guard(store, evaluators=evs)
    opened: dict[str, dict] = {name: {} for name in CONFIGS}
    start: list[float] = []

    def watch(now: float) -> None:
        start[:] = start or [now]
        for name, book in books.items():
            for f in book.open_findings():
                if (f.key, f.opened_at) not in opened[name]:
                    opened[name][(f.key, f.opened_at)] = (now - start[0], f.details.get("before"),
                                                          f.details.get("after"), f.key.split("/")[-1])

    ClosedLoop(dep, store=store, scrape_interval_s=15, guard=guard, on_tick=watch)
    dep.run_until(span)
    rate = {ev.name: next(iter(ev.cusums.values())).p0 if ev.cusums else None for ev in evs}
    return {"family": family, "seed": seed, "fault": fault, "fault_h": fault_at / 3600 if fault != "none" else None,
            "reference": {k: round(v, 3) if v is not None else None for k, v in rate.items()},
            "findings": {name: sorted((round(t / 3600, 2), round(b or 0, 3), round(a or 0, 3), pool)
                                      for t, b, a, pool in o.values()) for name, o in opened.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=9.0)
    ap.add_argument("--cases", nargs="+", default=["diurnal/500", "diurnal/504", "bursty/502", "bursty/504"])
    ap.add_argument("--faults", nargs="+", default=["none", "crash", "unshare"])
    args = ap.parse_args(argv)
    for case in args.cases:
        fam, seed = case.split("/")[0], int(case.split("/")[1])
        for fault in args.faults:
            t0 = time.perf_counter()
            r = run(fam, seed, args.hours, fault)
            print(f"{fam}/s{seed} {fault:7s} fault at {r['fault_h']} h, reference {r['reference']}: "
                  f"findings (h, before, after, pool) {r['findings']} [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
