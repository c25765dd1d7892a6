"""Closed loop around a simulated deployment: scrape -> store -> evaluators -> policy -> scale.

Everything runs in simulated time: every ``scrape_interval_s`` each live engine's exposition
(``generate_latest`` of its own registry, or a real HTTP GET in the demo) is ingested into the
guard's ``SeriesStore`` at the simulated timestamp; every ``eval_interval_s`` the evaluators (the
guard's SLO evaluators, detectors) and the scaling policy run against that store. Pure
orchestration: no clocks, no threads (the demo adds those at its edge).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from exporters import contract as c
from sla_guard.model import Finding, MetricsView
from sla_guard.sim.deployment import DOWN, DRAINING, READY, STARTING, STOPPED, Deployment
from sla_guard.sim.policy import Observation, Policy, PoolState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 16


@dataclass(slots=True)
class HistoryPoint:
    """One evaluation tick's view of the deployment, for reports and plots (values from the store)."""

    t: float
    values: dict[str, float] = field(default_factory=dict)


def make_store(retention_s: float = 26 * 3600, interval_s: float = 5.0):
    """The guard's SeriesStore sized for a run (import kept local: the store is another part)."""
    from sla_guard.store import SeriesStore

    slots = int(min(20_000, max(64, retention_s / interval_s + 8)))
    return SeriesStore(retention_s=retention_s, slots=slots, lookback_s=max(300.0, 3 * interval_s))


def scrape_into(dep: Deployment, store, fetch: Callable[[object], str | None] | None = None) -> int:
    """Ingest every target's exposition at the simulated time, with ``up`` as a scraper writes it;
    returns samples stored. Targets are replicas that serve or crashed (``up`` 0); starting ones
    are not discovered yet and stopped ones go stale. The P/D proxy (``dep.proxy``, the client
    scope) is one more target, ``pool="client"``. ``fetch(replica)`` returns exposition text
    (HTTP in the demo) or None on failure; default: the replica's registry in-process."""
    t = dep.epoch + dep.now
    n = 0
    for r in (*dep.replicas, dep.proxy):
        labels = {"instance": r.name, "model": dep.model, "pool": r.pool}
        if r.metrics is None or r.state == STOPPED:
            if r.state == DOWN or (r.state == STARTING and r.was_ready):  # crashed, restarting
                store.ingest_samples([("up", {}, 0.0)], t, labels)
            elif not r.stale_marked:  # scaled away: its series end here
                r.stale_marked = True
                store.mark_stale(labels, t)
            continue
        r.stale_marked = False
        if fetch is None:
            samples = r.metrics.samples()
            samples.append(("up", {}, 1.0))
            res = store.ingest_samples(samples, t, labels)
        else:
            text = fetch(r)
            if text is None:
                res = store.ingest_samples([("up", {}, 0.0)], t, labels)
            else:
                res = store.ingest_text(text + "up 1\n", t, labels)
        n += res.samples
    return n


def _window_mean(view: MetricsView, metric: c.Metric, matchers: Mapping[str, str], window: float, at: float):
    s = view.increase(metric.series("_sum"), matchers, window, at, ())
    n = view.increase(metric.series("_count"), matchers, window, at, ())
    if not s or not n:
        return None
    tot = sum(n.values())
    return sum(s.values()) / tot if tot > 0 else None


def observe_history(view: MetricsView, dep: Deployment, at: float, window: float = 60.0) -> HistoryPoint:
    """Per-pool indicators from the store (what the guard sees), for plots and the live status."""
    h = HistoryPoint(at - dep.epoch)
    v = h.values
    for pool in ("prefill", "decode"):
        m = {"pool": pool}
        for key, metric in (("ttft", c.REQUEST_TTFT), ("tpot", c.REQUEST_TPOT)):
            mean = _window_mean(view, metric, m, window, at)
            if mean is not None:
                v[f"{pool}_{key}_mean"] = mean
            q = view.histogram_quantile(0.9, metric.series("_bucket"), m, window, at, ())
            if q:
                val = next(iter(q.values()))
                if not math.isnan(val):
                    v[f"{pool}_{key}_p90"] = val
        w = view.instant(c.REQUESTS_WAITING.series(), m, at)
        if w:
            v[f"{pool}_waiting"] = sum(w.values())
    m = {"pool": c.Pool.CLIENT.value}
    mean = _window_mean(view, c.CLIENT_TTFT, m, window, at)
    if mean is not None:
        v["client_ttft_mean"] = mean
    q = view.histogram_quantile(0.9, c.CLIENT_TTFT.series("_bucket"), m, window, at, ())
    val = next(iter(q.values()), math.nan) if q else math.nan
    if not math.isnan(val):
        v["client_ttft_p90"] = val
    acc = view.increase(c.SPEC_ACCEPTED_TOKENS.series(), {"pool": "decode"}, window, at, ())
    drf = view.increase(c.SPEC_DRAFT_TOKENS.series(), {"pool": "decode"}, window, at, ())
    if acc and drf and sum(drf.values()) > 0:
        v["acceptance"] = sum(acc.values()) / sum(drf.values())
    for pool in ("prefill", "decode"):
        cnt = dep.pool_counts(pool)
        v[f"{pool}_ready"] = cnt[READY]
        v[f"{pool}_replicas"] = cnt[READY] + cnt[STARTING] + cnt[DRAINING]
    return h


class ClosedLoop:
    """Wires a deployment to a store, evaluators and a policy on simulated-time timers."""

    def __init__(self, dep: Deployment, *, store=None, policy: Policy | None = None,
                 evaluators: Iterable[object] = (), scrape_interval_s: float = 5.0,
                 eval_interval_s: float = 15.0, process_interval_s: float = 5.0,
                 limits: Mapping[str, PoolLimits] | None = None, gpu_budget: int | None = None,
                 fetch: Callable[[object], str | None] | None = None,
                 findings: Callable[[], Iterable[Finding]] | None = None,
                 on_tick: Callable[[float], None] | None = None, history_window_s: float = 60.0,
                 guard=None) -> None:
        self.dep = dep
        self.store = store
        self.policy = policy
        self.guard = guard  # sla_guard.service.Guard over ``store``: ticked at simulated time
        self.evaluators = list(evaluators)
        self.limits = dict(limits or {"prefill": PoolLimits(), "decode": PoolLimits()})
        self.gpu_budget = gpu_budget
        self.fetch = fetch
        self.findings = findings
        self.on_tick = on_tick
        self.history: list[HistoryPoint] = []
        self.actions: list[dict] = []
        self.eval_errors = 0
        self.guard_ticks: dict[str, int] = {}  # SLO verdict -> evaluation ticks with it
        self.history_window_s = history_window_s
        if dep.record:
            dep.every(process_interval_s, lambda d, now: d.sample_processes(), start_s=0.0)
        if store is not None and dep.record:
            dep.every(scrape_interval_s, lambda d, now: scrape_into(d, store, self.fetch), start_s=0.001)
        dep.every(eval_interval_s, self._tick)
        if policy is not None:
            dep.every(policy.interval_s, self._decide)

    def _tick(self, dep: Deployment, now: float) -> None:
        at = dep.epoch + now
        if self.guard is not None:
            res = self.guard.tick(at)
            self.eval_errors += len(res.errors)
            slo = self.guard.evaluator("slo")
            if slo is not None:
                st = slo.overall().value
                self.guard_ticks[st] = self.guard_ticks.get(st, 0) + 1
        for ev in self.evaluators:
            try:
                ev.evaluate(self.store, at)
            except Exception:  # an evaluator bug must not stop the run (the guard does the same)
                self.eval_errors += 1
                if self.eval_errors <= 3:  # said, not only counted; a few, not one per tick
                    log.exception("evaluator %s failed at %.0f s", getattr(ev, "name", ev), now)
        if self.store is not None:
            self.history.append(observe_history(self.store, dep, at, self.history_window_s))
        if self.on_tick is not None:
            self.on_tick(now)

    def observation(self, now: float) -> Observation:
        dep = self.dep
        pools = {}
        for pool in ("prefill", "decode"):
            cnt = dep.pool_counts(pool)
            lim = self.limits.get(pool, PoolLimits())
            pools[pool] = PoolState(pool, cnt[READY], cnt[STARTING], cnt[DRAINING], dep.profile.gpus_per_replica,
                                    lim.min_replicas, lim.max_replicas)
        found = tuple(self.findings()) if self.findings is not None else ()
        return Observation(now=dep.epoch + now, model=dep.model, pools=pools, view=self.store,
                           gpu_budget=self.gpu_budget, findings=found, profile=dep.profile,
                           slo_ttft_s=dep.slo_ttft_s, slo_tpot_s=dep.slo_tpot_s, extra={"sim_now": now})

    def _decide(self, dep: Deployment, now: float) -> None:
        obs = self.observation(now)
        try:
            desired = dict(self.policy.decide(obs.now, obs))
            restarts = list(self.policy.restarts()) if hasattr(self.policy, "restarts") else []
        except Exception:  # the run goes on holding the size; the traceback says why
            self.eval_errors += 1
            if self.eval_errors <= 3:
                log.exception("scaling policy %s failed at %.0f s", getattr(self.policy, "name", self.policy), now)
            return
        gpr = dep.profile.gpus_per_replica
        # replicas per pool as this tick leaves them: the budget left to a pool is what the other
        # pools hold after their own changes of this tick, not before (both pools growing in one
        # tick each saw the other's old size and together went over the budget)
        sizes = {p: s.current for p, s in obs.pools.items()}
        for pool, n in sorted(desired.items()):
            st = obs.pools.get(pool)
            if st is None:
                continue
            lim = self.limits.get(pool, PoolLimits())
            n = max(lim.min_replicas, min(lim.max_replicas, int(n)))
            if self.gpu_budget is not None:
                other = sum(v for p, v in sizes.items() if p != pool) * gpr
                n = min(n, max(lim.min_replicas, (self.gpu_budget - other) // gpr))
            if n != st.current:
                dep.set_replicas(pool, n)
                sizes[pool] = n
                self.actions.append({"t": now, "pool": pool, "from": st.current, "to": n})
        for name in restarts:
            if dep.rolling_restart(name):
                self.actions.append({"t": now, "restart": name})
