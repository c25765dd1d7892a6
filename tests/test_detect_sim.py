"""Closed loop on the simulated P/D deployment: faults injected in the simulator (an EngineCore
leak on one decode replica, an acceptance drop on the decode pool) reach the guard only through
the scraped contract metrics, and the detectors turn them into findings.

Time scale (leak only): the simulated run lasts 60 min, so the leak detector runs with its
production parameters compressed 6x (``detectors.leak.time_scale: 6``: the 2 h window is 20 min,
the warm-up 5 min), the simulated processes' own time constants (warm-up growth, GC period) are
compressed 6x too, and the injected leak is 6 x 48 = 288 MiB/h, i.e. 48 MiB/h in production
units. The simulated trace itself is not compressed: its first ~15 min fill the engines (load, and
with it RSS, ramps up), so the leak detector's warm-up is set to 2 h production = 20 min here
and the leak starts at 25 min. The acceptance detector runs with production parameters except
a 10 min warm-up.
"""

from __future__ import annotations

import pytest

from sla_guard.detect.evaluators import build_evaluators
from sla_guard.detect.findings import FindingsBook
from sla_guard.settings.detectors import DetectorsConfig
from sla_guard.sim.deployment import Deployment
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.harness import ClosedLoop, make_store
from sla_guard.sim.profile import load_profile
from sla_guard.sim.run import build_guard
from sla_guard.sim.traces import BUNDLED_MOONCAKE, load_trace

pytestmark = pytest.mark.slow
SCALE = 6.0


def test_sim_leak_and_acceptance_drop_become_findings():
    faults = [{"kind": "leak", "replica": "d0", "role": "engine_core", "mib_per_hour": 288, "start_s": 1500},
              {"kind": "acceptance_drift", "start_s": 1500, "end_s": 1501, "to_factor": 0.8}]
    prof = load_profile("default")
    fast = [p.model_copy(update={"warmup_s": p.warmup_s / SCALE, "gc_period_s": p.gc_period_s / SCALE})
            for p in prof.processes]
    dep = Deployment(prof.model_copy(update={"processes": fast}), 2, 2, faults=FaultSchedule(faults))
    dep.submit(load_trace(BUNDLED_MOONCAKE).scaled(duration_s=3600))
    store = make_store(interval_s=15)
    book = FindingsBook()
    cfg = DetectorsConfig.model_validate({"leak": {"time_scale": SCALE, "limit_bytes": 96 * 2**30, "warmup_s": 7200},
                           "acceptance": {"warmup_s": 600}})
    guard = build_guard(store, evaluators=build_evaluators(book, cfg))
    opened: dict[str, float] = {}

    def watch(now: float) -> None:
        for f in book.open_findings():
            opened.setdefault(f.key, now)

    ClosedLoop(dep, store=store, scrape_interval_s=15, guard=guard, on_tick=watch)
    dep.run_until(3600)
    leaks = {k: t for k, t in opened.items() if k.startswith("leak/")}
    assert leaks, {k: (v.status, v.reason) for k, v in guard.evaluator("leak").verdicts.items()}
    assert all(k.startswith("leak/d0/") for k in leaks), leaks
    assert min(leaks.values()) - 1500 <= 2 * 3600 / SCALE  # 2 h of production time after onset
    f = next(f for f in book.all() if f.key in leaks)
    assert 20 < f.details["slope_mib_per_h"] / SCALE < 80  # production-equivalent MiB/h
    drift = {k: t for k, t in opened.items() if k.startswith("acceptance_drift/")}
    assert drift, guard.evaluator("acceptance_drift").snapshot()
    assert all("/decode" in k for k in drift)
    assert 0 < min(drift.values()) - 1500 <= 600
    assert not [k for k in opened if k.startswith(("acceptance_drift/", "leak/")) and "prefill" in k]
