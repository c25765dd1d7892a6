"""Simulator speed: the full Mooncake conversation trace (12,031 requests, one hour) on 8 replicas
(4P4D), pinned to one core. Target: < 60 s wall with the contract metrics recorded.

Prints each configuration side by side with the baseline (pure simulation, no metrics) as a ratio,
plus requests simulated per second and the speed-up over real time.
"""

from __future__ import annotations

import os
import sys
import time

from sla_guard.sim.deployment import Deployment
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.profile import load_profile
from sla_guard.sim.traces import BUNDLED_MOONCAKE, load_trace

TARGET_S = 60.0


def run(trace, record: bool, store: bool) -> tuple[float, int, object]:
    dep = Deployment(load_profile("default"), 4, 4, record=record)
    dep.submit(trace)
    if store:
        ClosedLoop(dep, store=make_store(interval_s=15), scrape_interval_s=15)
    elif record:
        dep.every(5, lambda d, now: d.sample_processes(), start_s=0)
    t0 = time.perf_counter()
    dep.run_until(trace.duration_s + 600)
    wall = time.perf_counter() - t0
    s = dep.summary()
    assert s.finished + s.aborted + s.unfinished == s.requests == len(trace.requests)
    return wall, s.requests, s


def main() -> int:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    trace = load_trace(sys.argv[1] if len(sys.argv) > 1 else BUNDLED_MOONCAKE)
    rows = []
    base = None
    for name, record, store in (("baseline: pure simulation, no metrics", False, False),
                                ("contract metrics recorded (per-engine registries)", True, False),
                                ("metrics + scraped into the guard store every 15 s", True, True)):
        wall, n, s = run(trace, record, store)
        base = base or wall
        rows.append((name, wall, n, s))
    print(f"trace {trace.name}: {len(trace.requests)} requests over {trace.duration_s / 3600:.2f} h, 4P4D, one core")
    print(f"{'configuration':52s} {'wall s':>8s} {'x baseline':>10s} {'req/s':>9s} {'x real time':>11s} "
          f"{'vs 60 s target':>14s}")
    for name, wall, n, _ in rows:
        print(f"{name:52s} {wall:8.2f} {wall / base:10.2f} {n / wall:9.0f} {trace.duration_s / wall:11.0f} "
              f"{wall / TARGET_S:13.2f}x")
    s = rows[1][3]
    print(f"(attainment {s.slo_attainment:.3f}, TTFT p90 {s.ttft_p90_s:.2f} s, "
          f"TPOT mean {s.tpot_mean_s * 1000:.1f} ms)")
    return 0 if rows[1][1] < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
