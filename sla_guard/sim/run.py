"""One offline replay: trace + profile + policy -> summary, as ``sla-guard replay`` and the
scaling benchmarks run it. Deterministic for a given spec (seeded)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.detect.evaluators import build_evaluators
from sla_guard.detect.findings import FindingsBook
from sla_guard.settings.detectors import DetectorsConfig
from sla_guard.sim.deployment import Deployment, Summary
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.harness import ClosedLoop, PoolLimits, make_store
from sla_guard.sim.policy import get_policy
from sla_guard.sim.profile import Profile
from sla_guard.sim.traces import Trace


@dataclass(slots=True)
class ReplaySpec:
    profile: Profile
    trace: Trace
    policy: str = "static"
    prefill: int = 2
    decode: int = 2
    seed: int = 0
    faults: FaultSchedule = field(default_factory=FaultSchedule)
    min_replicas: int = 1
    max_replicas: int = 16
    gpu_budget: int | None = None
    slo_ttft_s: float = TTFT_SLO_S
    slo_tpot_s: float = TPOT_SLO_S
    scrape_interval_s: float = 5.0
    eval_interval_s: float = 15.0
    drain_s: float = 600.0
    metrics: bool = True
    policy_kwargs: dict = field(default_factory=dict)
    evaluators: list = field(default_factory=list)
    with_guard: bool = True
    with_detectors: bool = True


@dataclass(slots=True)
class ReplayResult:
    summary: Summary
    dep: Deployment
    loop: ClosedLoop
    store: object | None
    guard: object | None = None

    def write(self, out: Path, line: dict) -> None:
        """summary.json, actions.jsonl (scaling decisions applied) and timeline.csv (replicas)."""
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(line, indent=2) + "\n")
        with (out / "actions.jsonl").open("w") as fh:
            for a in self.loop.actions:
                fh.write(json.dumps(a) + "\n")
        with (out / "timeline.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["t_s", "prefill_ready", "decode_ready", "prefill_total", "decode_total"])
            w.writerows(self.dep.timeline)


def replay(spec: ReplaySpec) -> ReplayResult:
    """Run the trace to completion (plus ``drain_s``) and summarize."""
    if not spec.trace.requests:
        raise ValueError("the trace has no requests in the chosen window")
    dep = Deployment(spec.profile, spec.prefill, spec.decode, seed=spec.seed, faults=spec.faults,
                     record=spec.metrics, trace_block_tokens=spec.trace.block_tokens,
                     slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s)
    dep.submit(spec.trace)
    store = make_store(retention_s=spec.trace.duration_s + spec.drain_s + 3600,
                       interval_s=spec.scrape_interval_s) if spec.metrics else None
    policy = get_policy(spec.policy, **spec.policy_kwargs)
    lim = PoolLimits(spec.min_replicas, spec.max_replicas)
    findings = None
    evaluators = list(spec.evaluators)
    book = None
    if store is not None and spec.with_detectors:
        dets, book = detectors()
        evaluators += dets
        findings = book.open_findings
    guard = None
    if store is not None and spec.with_guard:
        guard = build_guard(store, spec.slo_ttft_s, spec.slo_tpot_s, spec.eval_interval_s, evaluators)
    loop = ClosedLoop(dep, store=store, policy=policy, guard=guard,
                      scrape_interval_s=spec.scrape_interval_s, eval_interval_s=spec.eval_interval_s,
                      limits={"prefill": lim, "decode": lim}, gpu_budget=spec.gpu_budget, findings=findings)
    dep.run_until(spec.trace.duration_s + spec.drain_s)
    s = dep.summary()
    s.extra.update({"prefill_final": dep.pool_counts("prefill")["ready"],
                    "decode_final": dep.pool_counts("decode")["ready"], "eval_errors": loop.eval_errors})
    if guard is not None:
        slo = guard.evaluator("slo")
        if slo is not None:
            s.extra["guard_status"] = slo.overall().value
            s.extra["guard_ticks"] = dict(sorted(loop.guard_ticks.items()))
    if book is not None:
        s.extra["findings"] = sorted({f.detector for f in book.all()})
    restarts = [a for a in loop.actions if "restart" in a]
    if restarts:
        s.extra["restarts"] = len(restarts)
    return ReplayResult(s, dep, loop, store, guard)


def guard_config(slo_ttft_s: float = TTFT_SLO_S, slo_tpot_s: float = TPOT_SLO_S, eval_interval_s: float = 15.0):
    """The guard's config for a simulated run, with the run's thresholds: TTFT is judged where the
    client sees it (the sim-proxy's ``pool="client"`` scope: what users sign, and what the replay's
    attainment counts), TPOT on the decode pool ("From Day 0 to Production SLAs": "TPOT by the
    Decode pool")."""
    from sla_guard.config import SLO, Indicator, Objective, SLOSet, parse_config

    ttft = [
        SLO(name="ttft_mean", indicator=Indicator.TTFT, objective=Objective.MEAN, threshold_s=slo_ttft_s),
        SLO(name="ttft_p90", indicator=Indicator.TTFT, objective=Objective.PERCENTILE, threshold_s=2 * slo_ttft_s,
            percentile=0.9),
        SLO(name="ttft_attainment", indicator=Indicator.TTFT, objective=Objective.ATTAINMENT,
            threshold_s=slo_ttft_s, target=0.99),
    ]
    tpot = [
        SLO(name="tpot_mean", indicator=Indicator.TPOT, objective=Objective.MEAN, threshold_s=slo_tpot_s),
        SLO(name="tpot_attainment", indicator=Indicator.TPOT, objective=Objective.ATTAINMENT,
            threshold_s=slo_tpot_s, target=0.99),
    ]
    sets = [SLOSet(pool="client", objectives=ttft), SLOSet(pool="decode", objectives=tpot)]
    return parse_config({"evaluation_interval_s": eval_interval_s, "slos": [x.model_dump() for x in sets]})


def build_guard(store, slo_ttft_s: float = TTFT_SLO_S, slo_tpot_s: float = TPOT_SLO_S, eval_interval_s: float = 15.0,
                evaluators=()):
    """``sla_guard.service.Guard`` over the replay's store, with the SLO evaluator and ``evaluators``."""
    from sla_guard.service import Guard

    return Guard.for_store(guard_config(slo_ttft_s, slo_tpot_s, eval_interval_s), store, list(evaluators))


def detectors(warmup_s: float | None = None, leak_warmup_s: float | None = None) -> tuple[list, FindingsBook]:
    """The detectors' evaluators and their findings book (``warmup_s``: a shorter warm-up of the
    drift detectors, for runs shorter than the default hour; ``leak_warmup_s``: the same for the
    leak detector's 90 min after a process start)."""
    cfg: dict = {} if warmup_s is None else {k: {"warmup_s": warmup_s} for k in ("acceptance", "prefix_hit", "tpot")}
    if leak_warmup_s is not None:
        cfg["leak"] = {"warmup_s": leak_warmup_s}
    book = FindingsBook()
    return build_evaluators(book, DetectorsConfig.model_validate(cfg)), book
