"""SLO evaluation per (model, pool): status, values, error budget, multi-window burn rates.

Objectives come from the config's SLO spec (``sla_guard.config.SLO``):

- ``mean``: ``increase(x_sum[w]) / increase(x_count[w])`` summed over the pool's engines;
- ``percentile``: ``histogram_quantile(p, sum by (le) (rate(x_bucket[w])))``;
- ``attainment``: share of requests at or under the threshold (counted from the bucket whose
  upper bound *is* the threshold, so the threshold must be a bucket boundary) or, for the
  ``availability`` indicator (client scope only), share of requests the service did not fail
  (``contract.AVAILABILITY_*`` outcomes of the router's request counter), with an error
  budget over the period and the SRE workbook's multi-window multi-burn-rate verdicts, from the
  table the generated alert rules use too (``sla_guard.burn_windows``): fixed windows 1h & 5m,
  6h & 30m (critical), 1d & 2h, 3d & 6h (warning), factors scaled by the period (30d: 14.4, 6,
  3, 1; 7d: 3.36, 1.4, 0.7, 0.233333), rows longer than the period dropped.

Long windows are request-weighted: errors and requests are summed separately and divided once,
never averaged ratios. With a Prometheus source they are PromQL ``increase`` over the window;
with the embedded store (bounded retention) a per-pool ledger of exact, reset-aware per-tick
counter deltas (``SeriesStore.counter_delta``) in fixed time buckets provides them.

Never "ok" without evidence: fewer than ``min_requests`` requests, a dead target of the pool,
or no current sample (stale or missing) gives ``unknown`` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import numpy as np

from exporters import contract as c
from exporters.label_text import le_spellings
from exporters.prometheus import ContractMetrics
from sla_guard import promql
from sla_guard.burn_windows import PAGE, burn_rules
from sla_guard.burn_windows import burn_windows as _burn_windows
from sla_guard.config import SLO, GuardConfig, Indicator, Objective, parse_duration
from sla_guard.ingest.source import UP, TargetState
from sla_guard.model import Labels, MetricsView, Status, page_map

# Each latency indicator's histogram in the engine pools and in the client scope (pool="client"):
# the SLO sets address both the same way, by (model, pool). Availability has none: it counts outcomes.
AVAIL = Indicator.AVAILABILITY
HIST = {i: (c.latency_metric(i.value, None), c.latency_metric(i.value, c.Pool.CLIENT)) for i in Indicator
        if i is not AVAIL}
BY = ("model", "pool")
T = TypeVar("T")
# Requests that missed an indicator without an observation in its histogram, per indicator: (the
# engine pools' counter, the client scope's) from ``c.UNOBSERVED_MISSES`` (an engine pool's
# admission rejections; the proxy's streamed requests failed before / after their first token).
UNOBSERVED: dict[Indicator, tuple[str | None, str | None]] = {
    i: tuple(m.series() if (m := c.UNOBSERVED_MISSES.get(h)) else None for h in hists)  # type: ignore[misc]
    for i, hists in HIST.items()}

log = logging.getLogger("sla_guard.slo")


def _scoped(ind: Indicator, query: Callable[[c.Metric], dict[Labels, T]]) -> dict[Labels, T]:
    """``query`` on the engine family (every pool but client) and on the client family (pool
    client only), merged: a page scraped as ``pool: client`` that carries engine histograms must
    not count twice."""
    engine, client = HIST[ind]
    out = {lab: v for lab, v in query(engine).items() if dict(lab).get("pool") != c.Pool.CLIENT}
    out.update((lab, v) for lab, v in query(client).items() if dict(lab).get("pool") == c.Pool.CLIENT)
    return out


def _outcomes(query: Callable[[str, tuple[str, ...]], dict[Labels, float]],
              ) -> dict[tuple[str, str], tuple[float, float]]:
    """{(model, pool): (failed, counted)} requests of the client scope's outcome counter, the
    availability SLI's errors and total (``contract.AVAILABILITY_*``). ``query(series, by)`` is a
    counter query (``increase`` or ``counter_delta``): resets and windows as for every other counter."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for lab, v in query(c.CLIENT_REQUESTS.series(), (*BY, "outcome")).items():
        d = dict(lab)
        if d.get("pool") != c.Pool.CLIENT or d.get("outcome") not in c.AVAILABILITY_COUNTED:
            continue
        err, tot = out.get(_mp(lab), (0.0, 0.0))
        out[_mp(lab)] = (err + v * (d["outcome"] == c.AVAILABILITY_FAILED), tot + v)
    return out


SEVERITY_ORDER = {Status.VIOLATED: 3, Status.UNKNOWN: 2, Status.AT_RISK: 1, Status.OK: 0}


def fmt_window(seconds: float) -> str:
    """'5m', '6h', '3d' -- the window label used in metrics and the API."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def worst(statuses) -> Status:
    """Pool status from its objectives: violated > unknown > at_risk > ok."""
    out = Status.OK
    for s in statuses:
        if SEVERITY_ORDER[s] > SEVERITY_ORDER[out]:
            out = s
    return out


# ---------------------------------------------------------------- pure verdicts
@dataclass(slots=True)
class BurnAlert:
    long: str
    short: str
    factor: float
    severity: str
    burn_long: float | None
    burn_short: float | None
    firing: bool


def burn_rate(errors: float, total: float, target: float) -> float | None:
    """Error ratio over the window divided by the allowed ratio (1 - target); None if no requests."""
    if not total or total <= 0 or math.isnan(total) or math.isnan(errors):
        return None
    return max(0.0, errors / total) / (1.0 - target)


def burn_alerts(windows: Mapping[float, tuple[float, float]], target: float, period_s: float,
                min_requests: float = 0.0) -> list[BurnAlert]:
    """The period's multi-window verdicts (``burn_rules``, shared with the generated alert rules)
    from {window_s: (errors, total)}; an alert fires only when both its long and its short window
    burn faster than its factor and the short window holds at least ``min_requests`` requests:
    the generated rule has that traffic guard (``alerts/slo_rules.py``); without it one slow
    request in a quiet pool's short window paged here while the rule stayed silent."""
    out = []
    for row in burn_rules(period_s):
        bl = burn_rate(*windows.get(row.long_s, (math.nan, math.nan)), target)
        short = windows.get(row.short_s, (math.nan, math.nan))
        bs = burn_rate(*short, target)
        firing = bl is not None and bs is not None and bl > row.factor and bs > row.factor \
            and short[1] >= min_requests
        out.append(BurnAlert(row.long, row.short, row.factor, row.severity, bl, bs, firing))
    return out


def budget_remaining(errors: float, total: float, target: float) -> float | None:
    """1 - (errors spent / errors allowed) over the period; negative when overspent."""
    if not total or total <= 0:
        return None
    return 1.0 - (errors / total) / (1.0 - target)


def threshold_status(value: float, threshold: float, at_risk_ratio: float) -> Status:
    if value > threshold:
        return Status.VIOLATED
    if value > threshold * at_risk_ratio:
        return Status.AT_RISK
    return Status.OK


def attainment_status(budget: float | None, alerts: list[BurnAlert], at_risk_budget: float) -> Status:
    if budget is not None and budget <= 0:
        return Status.VIOLATED
    if any(a.firing and a.severity == PAGE for a in alerts):
        return Status.VIOLATED
    if any(a.firing for a in alerts) or (budget is not None and budget < at_risk_budget):
        return Status.AT_RISK
    return Status.OK


def le_count(buckets: Mapping[float, float], threshold: float) -> float | None:
    """Cumulative count of the bucket whose upper bound is ``threshold`` (None if no such bucket)."""
    for le, n in buckets.items():
        if math.isclose(le, threshold, rel_tol=1e-9, abs_tol=1e-12):
            return n
    return None


def not_cumulative(good: float | None, total: float | None) -> bool:
    """More requests in a threshold's bucket than in +Inf: the histogram's buckets are not
    cumulative (a broken page, not a good one): its attainment would read over 100 % and its
    error budget grow. Loose enough for extrapolation noise."""
    return good is not None and total is not None and good > total * (1 + 1e-6) + 1e-9


# ---------------------------------------------------------------- ledger
CHUNK = 64  # buckets per persisted part: a tick rewrites one chunk per tier, not the whole period


class _Ring:
    """good/total request counts in fixed time buckets covering ``span_s``."""

    def __init__(self, span_s: float, step_s: float) -> None:
        self.step = float(step_s)
        self.span = float(span_s)
        self.n = math.ceil(span_s / step_s) + 1
        self.idx = np.full(self.n, -1, dtype=np.int64)
        self.good = np.zeros(self.n)
        self.total = np.zeros(self.n)
        self.dirty: set[int] = set()  # chunks changed since the last dump (None-valued: dropped)
        self.dropped: set[int] = set()

    def add(self, t: float, good: float, total: float) -> None:
        b = int(t // self.step)
        p = b % self.n
        if self.idx[p] != b:
            if b // CHUNK not in self.dirty and self.idx[p] >= 0:
                self.dropped.add(b // CHUNK - self.n // CHUNK - 2)  # wholly out of the span by now
            self.idx[p] = b
            self.good[p] = 0.0
            self.total[p] = 0.0
        self.good[p] += good
        self.total[p] += total
        self.dirty.add(b // CHUNK)

    # -- persistence (only non-empty buckets, one part per chunk) ------------------------------
    def chunks(self) -> set[int]:
        return {int(b) // CHUNK for b in self.idx[self.idx >= 0]}

    def dump_chunk(self, c: int) -> dict:
        m = (self.idx // CHUNK == c) & (self.idx >= 0) & ((self.total != 0) | (self.good != 0))
        return {"b": self.idx[m].tolist(), "g": self.good[m].tolist(), "t": self.total[m].tolist()}

    def load_chunk(self, d: dict) -> None:
        for b, g, tot in zip(d["b"], d["g"], d["t"], strict=True):
            p = int(b) % self.n
            if self.idx[p] <= b:
                self.idx[p], self.good[p], self.total[p] = int(b), float(g), float(tot)

    def window(self, now: float, window_s: float) -> tuple[float, float]:
        hi = int(now // self.step)
        lo = int((now - window_s) // self.step)
        m = (self.idx > lo) & (self.idx <= hi)
        total = float(self.total[m].sum())
        return total - float(self.good[m].sum()), total


class Ledger:
    """Request-weighted long windows for one (model, pool, indicator, threshold): good and total
    request counts in time buckets over the SLO period. Two tiers keep it small and fast: 1-min
    buckets for windows up to 6 h (the 5m..6h burn windows), 15-min buckets for 1d..30d. Bounded:
    ~3,600 buckets for a 30-day period, whatever the evaluation rate."""

    def __init__(self, period_s: float, step_s: float = 60.0, fine_span_s: float = 6 * 3600.0,
                 coarse_step_s: float = 900.0) -> None:
        self.fine = _Ring(min(period_s, fine_span_s), step_s)
        self.coarse = _Ring(period_s, coarse_step_s) if period_s > fine_span_s else None
        self.first_t: float | None = None

    def add(self, t: float, good: float, total: float) -> None:
        self.fine.add(t, good, total)
        if self.coarse is not None:
            self.coarse.add(t, good, total)
        if self.first_t is None:
            self.first_t = t

    def window(self, now: float, window_s: float) -> tuple[float, float]:
        """(errors, total) over (now - window, now], at the tier's bucket resolution."""
        if self.coarse is None or window_s <= self.fine.span:
            return self.fine.window(now, window_s)
        return self.coarse.window(now, window_s)


# ---------------------------------------------------------------- results
@dataclass(slots=True)
class SLOResult:
    model: str
    pool: str
    slo: str
    indicator: str
    objective: str
    threshold_s: float | None  # None: availability
    status: Status
    value: float | None = None
    requests: float | None = None
    window: str = ""
    reason: str = ""
    percentile: float | None = None
    target: float | None = None
    budget_remaining: float | None = None
    burn_rates: dict[str, float | None] = field(default_factory=dict)
    alerts: list[BurnAlert] = field(default_factory=list)
    period_requests: float | None = None  # attainment: requests the period's ledger/query holds

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d


@dataclass(slots=True)
class PoolResult:
    model: str
    pool: str
    status: Status
    targets_up: int | None = None
    targets_total: int | None = None
    reason: str = ""
    goodput_lower_bound: float | None = None
    goodput_upper_bound: float | None = None
    slos: list[SLOResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("model", "pool", "targets_up", "targets_total", "reason",
                                           "goodput_lower_bound", "goodput_upper_bound")}
        d["status"] = self.status.value
        d["slos"] = [s.to_dict() for s in self.slos]
        return d


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


# ---------------------------------------------------------------- the evaluator
class SLOEvaluator:
    """Evaluates every configured objective for every (model, pool) it sees; an ``Evaluator``."""

    name = "slo"

    def __init__(self, config: GuardConfig, *, at_risk_ratio: float = 0.9, at_risk_budget: float = 0.25,
                 ledger_step_s: float = 60.0, max_pools: int = 1000, forget_after_s: float = 3600.0,
                 targets: Callable[[], Iterable[TargetState]] | None = None) -> None:
        self.config = config
        # the source's targets (``Source.targets``): a pool with targets down says why they are
        # down (their ``last_error``), not only how many, in the reason the operator reads first
        self._targets = targets
        self.at_risk_ratio = at_risk_ratio
        self.at_risk_budget = at_risk_budget
        self.ledger_step_s = ledger_step_s
        self.max_pools = max_pools
        self.pools: dict[tuple[str, str], PoolResult] = {}
        self.known: set[tuple[str, str]] = set()
        self.configured: set[tuple[str, str]] = set()
        for t in getattr(config.source, "targets", []):
            # a router's page names its own models, an honor_labels page (an aggregator) its own
            # pools: their configured model/pool is no pool (it was one, unknown for ever, without data)
            if getattr(t, "adapter", None) is None and not getattr(t, "honor_labels", False):
                self.configured.add((t.model, t.pool))
        self.known |= self.configured
        # a pool that disappeared (scaled to zero, renamed) is reported unknown for a while, then
        # forgotten: ``known`` must not grow forever
        self.forget_after_s = forget_after_s
        self._last_seen: dict[tuple[str, str], float] = {}
        self._had_data: set[tuple[str, str]] = set()  # known pools a tick saw data of
        self._ledgers: dict[tuple, Ledger] = {}
        self._last_feed: float | None = None
        self._metrics: ContractMetrics | None = None
        self._children: dict[tuple, object] = {}
        self._exported: set[tuple[str, str]] = set()  # pools with series on /metrics
        # pools seen this tick but not judged: ``known`` was full (max_pools)
        self.pools_over_limit = 0
        self.evaluated_at: float | None = None
        self.window_label: str | None = None
        # (indicator, threshold, period, model, pool) -> {burn window: targets whose threshold
        # bucket did not cover it}, from this tick's ``_long_windows`` (``_bucket_changes``)
        self._changed_long: dict[tuple, dict[float, list[str]]] = {}
        # the same keys -> (span, since, targets): a period the bucket did not cover, judged over the
        # last ``span`` it covered on every target of the pool (``_covered_spans``)
        self._covered_long: dict[tuple, tuple[float, float, list[str]]] = {}
        self._source_error: str | None = None  # the view's, at the last evaluation
        self._availability = any(o.indicator is AVAIL for s in config.slos for o in s.objectives)

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self._metrics = metrics

    # -- Evaluator -----------------------------------------------------------------------------
    def evaluate(self, view: MetricsView, now: float) -> None:
        # pools seen now (any indicator's count series) plus pools seen before or configured
        current: dict[Indicator, dict[Labels, float]] = {
            i: _scoped(i, lambda h: view.instant(h.series("_count"), {}, now)) for i in HIST}
        if self._availability:  # one query more per tick, only for a config that reads it
            current[AVAIL] = {lab: v for lab, v in view.instant(c.CLIENT_REQUESTS.series(), {}, now).items()
                              if dict(lab).get("pool") == c.Pool.CLIENT}
        seen_data: set[tuple[str, str]] = set()
        for i in current:
            for lab in current[i]:
                d = dict(lab)
                if "model" in d and "pool" in d:
                    seen_data.add((d["model"], d["pool"]))
        health, up_targets, down_targets = self._health(view, now)
        seen = seen_data | set(health)
        stalls = _hook_stalls(view, now)
        over = 0
        for key in seen:
            if key in self.known or len(self.known) < self.max_pools:
                self.known.add(key)
                self._last_seen[key] = now
            else:
                over += 1
        if over and not self.pools_over_limit:
            log.warning("slo: %d pools beyond max_pools=%d are not judged; the overall verdict is unknown",
                        over, self.max_pools)
        self.pools_over_limit = over
        # where the source reports target health per pool, a pool with no target left (removed
        # from discovery) is forgotten once its data is stale, not after forget_after_s: its
        # "unknown" would otherwise hold the overall verdict for an hour; one that never had data
        # (only an up: an aggregator's configured pool before its page named its pools) at once
        targetless = {k for k in self.known if health and k not in health}
        self._had_data |= seen_data & self.known
        for key in list(self.known - self.configured):
            limit = min(self.forget_after_s, 2 * self.config.staleness_s) if key in targetless \
                else self.forget_after_s
            if key in targetless and key not in self._had_data and not any(k[3:] == key for k in self._ledgers):
                limit = 0.0
            if now - self._last_seen.get(key, now) > limit:
                self.known.discard(key)
                self._last_seen.pop(key, None)
                self._had_data.discard(key)
                for lk in [k for k in self._ledgers if k[3:] == key]:
                    del self._ledgers[lk]
        fresh = {i: {(dict(k).get("model"), dict(k).get("pool")) for k in current[i]} for i in current}
        # targets of each pool with a current sample per indicator (where samples name one)
        fresh_targets: dict[Indicator, dict[tuple[str, str], set[str]]] = {i: {} for i in current}
        for i in current:
            for k in current[i]:
                d = dict(k)
                if "instance" in d:
                    fresh_targets[i].setdefault((d.get("model"), d.get("pool")), set()).add(d["instance"])
        source_error = self._source_error = view.last_error
        causes = {t.name: t.last_error for t in self._targets() if not t.up and t.last_error} \
            if self._targets is not None and down_targets else {}

        self.window_label = view.window_label
        plan = _Plan(self.config, self.known)
        windowed = self._windowed(view, now, plan)
        longwin = self._long_windows(view, now, plan)

        results: dict[tuple[str, str], PoolResult] = {}
        for model, pool in sorted(self.known):
            key = (model, pool)
            up, total_t = health.get(key, (None, None))
            pr = PoolResult(model, pool, Status.UNKNOWN, up, total_t)
            gate = ""
            if total_t and up is not None and up < total_t:
                gate = f"{total_t - up} of {total_t} targets down{self._down_why(down_targets.get(key, []), causes)}"
            elif key in targetless:
                gate = "no target left for this pool (removed from discovery); forgotten once its data is stale"
            elif stalls and key in stalls:
                gate = stalls[key]
            for slo in self.config.slos_for(model, pool):
                g = gate
                have = fresh_targets[slo.indicator].get(key)
                silent = sorted(up_targets.get(key, set()) - have) if have and not g else []
                if silent:  # up, but its data is stale or missing: the rest of the pool is not the pool
                    g = (f"{len(silent)} of {len(up_targets[key])} targets up without current "
                         f"{slo.indicator.value} data (stale timestamps or missing series): {', '.join(silent[:3])}")
                pr.slos.append(self._one(slo, key, g, fresh, windowed, longwin, source_error))
            if stalls is None and pool != c.Pool.CLIENT:  # a stalled hook not ruled out: its frozen data may read ok
                pr.slos = [dataclasses.replace(s, status=Status.UNKNOWN, reason=HOOK_UNCHECKED, alerts=[])
                           if s.status in (Status.OK, Status.AT_RISK) else s for s in pr.slos]
            self._goodput(pr, windowed)
            pr.status = worst(s.status for s in pr.slos) if pr.slos else Status.UNKNOWN
            # the pool says why it is not ok: its gate, else its worst objective's reason
            worst_reason = next((s.reason for s in sorted(pr.slos, key=lambda s: -SEVERITY_ORDER[s.status])
                                 if s.status is not Status.OK and s.reason), "")
            pr.reason = gate or worst_reason or ("" if pr.slos else "no objectives configured for this pool")
            results[key] = pr
        self.pools = results
        self.evaluated_at = now
        self._export()

    paged = True  # snapshot(limit, after): the pools by "model/pool" (/v1/status; /v1/slo has them all)

    def snapshot(self, limit: int | None = None, after: str | None = None) -> dict:
        pools, extra = page_map({f"{m}/{p}": pr for (m, p), pr in list(self.pools.items())}, limit, after, "pools")
        out = {
            "evaluated_at": self.evaluated_at,
            "status": self.overall().value,
            "pools": [p.to_dict() for p in pools.values()],
            "pools_over_limit": self.pools_over_limit,
            **extra,
        }
        if self.pools_over_limit:
            out["reason"] = (f"{self.pools_over_limit} pools beyond max_pools={self.max_pools} are not judged "
                             f"(a label bomb, or more pools than one guard covers)")
        elif not self.pools and self.evaluated_at is not None:
            # nothing to judge says why: a source failing from the start showed no pool and no reason
            out["reason"] = "no pool seen yet (no TTFT/TPOT series, no target's up)" + (
                f"; source failing: {self._source_error}" if self._source_error else "")
        return out

    def overall(self) -> Status:
        """violated if any objective is violated, else unknown if any is unknown, else
        at_risk / ok (also unknown when there is nothing to judge, or when pools beyond
        ``max_pools`` went unjudged: one of them may be violated). A pool no SLO set gives an
        objective (the prefill pool of sets written for the client and decode only) is shown,
        unknown with its reason, but has no say: it made the verdict unknown for ever, never ok."""
        judged = [p.status for p in self.pools.values() if p.slos]
        if not judged:
            return Status.UNKNOWN
        status = worst(judged)
        if self.pools_over_limit and status is not Status.VIOLATED:
            return Status.UNKNOWN
        return status

    def expire(self, reason: str, now: float) -> None:
        """Every verdict becomes unknown with ``reason`` (the guard's staleness watchdog calls
        this when ticks stop completing): a frozen guard must never keep serving "ok"."""
        pools = {}
        for key, pr in self.pools.items():
            slos = [dataclasses.replace(s, status=Status.UNKNOWN, reason=reason, alerts=[]) for s in pr.slos]
            pools[key] = dataclasses.replace(pr, status=Status.UNKNOWN, reason=reason, slos=slos,
                                             goodput_lower_bound=None, goodput_upper_bound=None)
        self.pools = pools
        self._export()

    # -- crash-safe state (sla_guard.state.Stateful) ---------------------------------------------
    def _persists(self) -> bool:
        # with a Prometheus source the windows are ``increase`` over the server: nothing to keep
        return getattr(self.config.source, "mode", "scrape") != "prometheus"

    def state_dump(self, full: bool) -> dict:
        """Ledger chunks changed since the last dump (all when ``full``) plus a small meta part:
        ``_last_feed``, each ledger's first sample time, the pools seen and when."""
        if not self._persists():
            return {}
        out: dict = {}
        firsts = {}
        for key, led in self._ledgers.items():
            kj = _json_key(key)
            firsts[kj] = led.first_t
            for tier, ring in (("f", led.fine), ("c", led.coarse)):
                if ring is None:
                    continue
                chunks = ring.chunks() if full else ring.dirty
                for ch in chunks:
                    out[f"ledger/{tier}/{ch}/{kj}"] = ring.dump_chunk(ch)
                for ch in ring.dropped - chunks:
                    out[f"ledger/{tier}/{ch}/{kj}"] = None
                ring.dirty, ring.dropped = set(), set()
        out["meta"] = {"last_feed": self._last_feed, "ledgers": firsts,
                       "last_seen": [[m, p, t] for (m, p), t in self._last_seen.items()]}
        return out

    def state_load(self, parts: dict, records: list[dict]) -> None:
        """Resume the ledgers where the last saved tick left them; the next tick feeds the
        interval from ``_last_feed`` on (see docs/guard.md, 'State and restarts')."""
        if not self._persists():
            return
        meta = parts.get("meta") or {}
        for kj, first in (meta.get("ledgers") or {}).items():
            key = _key_from_json(kj)
            if key is not None and len(self._ledgers) < self.max_pools * 4:
                led = self._ledgers.setdefault(key, Ledger(key[2], self.ledger_step_s))
                led.first_t = first
        for name, value in parts.items():
            if not name.startswith("ledger/") or not value:
                continue
            _, tier, _, kj = name.split("/", 3)
            led = self._ledgers.get(_key_from_json(kj))
            ring = None if led is None else (led.fine if tier == "f" else led.coarse)
            if ring is not None:
                ring.load_chunk(value)
        for m, p, t in meta.get("last_seen") or []:
            if len(self.known) < self.max_pools:
                self.known.add((m, p))
                self._last_seen[(m, p)] = float(t)
        if meta.get("last_feed") is not None:  # the later one: a file restored into a running guard
            self._last_feed = max(float(meta["last_feed"]), self._last_feed or -math.inf)  # fed nothing twice

    # -- data gathering ------------------------------------------------------------------------
    def _down_why(self, down: list[str], causes: Mapping[str, str]) -> str:
        """`` (d1: timeout: no complete answer within 2s; d2: connect; +1 more)``: the down targets
        with their failure kind, the first one's cause in full but bounded (its fix is at its end);
        the whole of each is in /v1/targets. A target the source has no error for (Prometheus mode:
        ``up`` is Prometheus's) is named, and where its cause is said."""
        if not down:
            return ""
        known = [n for n in down if n in causes] + [n for n in down if n not in causes]
        first, rest = known[0], known[1:]
        parts = [f"{_short(first, 60)}: {_short(causes[first], 240)}" if first in causes else _short(first, 60)]
        parts += [f"{_short(n, 60)}: {causes[n].split(':', 1)[0]}" if n in causes else _short(n, 60) for n in rest[:2]]
        if len(rest) > 2:
            parts.append(f"+{len(rest) - 2} more")
        if not causes and getattr(self.config.source, "mode", "") == "prometheus":
            parts.append("why: Prometheus's /targets page")
        return f" ({'; '.join(parts)})"

    @staticmethod
    def _health(view: MetricsView, now: float) -> tuple[dict[tuple[str, str], tuple[int, int]],
                                                          dict[tuple[str, str], set[str]],
                                                          dict[tuple[str, str], list[str]]]:
        """Per pool (targets up, targets), the instances of the targets that are up, and those of
        the targets that are down (sorted)."""
        out: dict[tuple[str, str], list[int]] = {}
        up: dict[tuple[str, str], set[str]] = {}
        down: dict[tuple[str, str], set[str]] = {}
        for lab, v in view.instant(UP, {}, now).items():
            d = dict(lab)
            if "model" not in d or "pool" not in d:
                continue
            cnt = out.setdefault((d["model"], d["pool"]), [0, 0])
            cnt[0] += int(v >= 1)
            cnt[1] += 1
            if "instance" in d:
                (up if v >= 1 else down).setdefault((d["model"], d["pool"]), set()).add(d["instance"])
        return {k: (a, b) for k, (a, b) in out.items()}, up, {k: sorted(v) for k, v in down.items()}

    def _windowed(self, view: MetricsView, now: float, plan: _Plan) -> dict:
        """{(indicator, window): {(model,pool): {'sum','count','buckets'}}} for mean/percentile
        and the attainment SLI window."""
        out: dict = {}
        for ind, w in plan.windows:
            if ind is AVAIL:
                out[(ind, w)] = {mp: {"count": tot, "good": tot - err} for mp, (err, tot) in
                                 _outcomes(lambda m, by, w=w: view.increase(m, {}, w, now, by)).items()}
                continue
            sums = _scoped(ind, lambda h, w=w: view.increase(h.series("_sum"), {}, w, now, BY))
            counts = _scoped(ind, lambda h, w=w: view.increase(h.series("_count"), {}, w, now, BY))
            buckets = _scoped(ind, lambda h, w=w: _bucket_increase(view, h.series(), w, now))
            per: dict = {}
            for thr in plan.thresholds.get((ind, w), ()):
                def inc(m, by, ind=ind, w=w):
                    return _scoped(ind, lambda h: view.increase(h.series("_bucket"), m, w, now, by))
                for mp, targets in _lacking(inc, thr).items():
                    per.setdefault(mp, {}).setdefault("lacking", {})[thr] = sorted(targets)
                for mp, targets in _bucket_changes(view, ind, thr, (w,), now, self.known).get(w, {}).items():
                    per.setdefault(mp, {}).setdefault("changed", {})[thr] = targets
            for lab, v in counts.items():
                per.setdefault(_mp(lab), {})["count"] = v
            for lab, v in sums.items():
                per.setdefault(_mp(lab), {})["sum"] = v
            for lab, b in buckets.items():
                per.setdefault(_mp(lab), {})["buckets"] = b
            for mp, v in _unobserved(ind, lambda m, w=w: view.increase(m, {}, w, now, BY)).items():
                per.setdefault(mp, {})["unobserved"] = v
            out[(ind, w)] = per
        return out

    def _long_windows(self, view: MetricsView, now: float, plan: _Plan) -> dict:
        """{(indicator, threshold, period): {(model,pool): {window_s: (errors, total)}}}."""
        out: dict = {}
        native = view.serves_long_windows
        if not native:
            self._feed_ledgers(view, now, plan)
        self._changed_long = {}
        self._covered_long = {}
        for ind, thr, period in plan.attainments:
            wins = plan.burn_windows(period)
            per: dict = {}
            if native and ind is AVAIL:
                for w in wins:
                    for mp, pair in _outcomes(lambda m, by, w=w: view.increase(m, {}, w, now, by)).items():
                        per.setdefault(mp, {})[w] = pair
            elif native:
                changed = _bucket_changes(view, ind, thr, tuple(wins), now, self.known)
                for w, by_pool in changed.items():
                    for mp, targets in by_pool.items():
                        self._changed_long.setdefault((ind, thr, period, *mp), {})[w] = targets
                cover = _covered_spans(view, ind, thr, period, wins, changed, now)
                for mp, got in cover.items():
                    self._covered_long[(ind, thr, period, *mp)] = got
                for w in sorted({*wins, *(span for span, _, _ in cover.values())}):
                    # the threshold's bucket and +Inf only: read over 30 days, each bucket costs
                    # Prometheus every sample of the period
                    buckets = _scoped(ind, lambda h, w=w, t=thr: _bucket_increase(view, h.series(), w, now, (t,)))
                    refused = _unobserved(ind, lambda m, w=w: view.increase(m, {}, w, now, BY))
                    for lab, b in buckets.items():
                        good = le_count(b, thr)
                        tot = b.get(math.inf)
                        if good is None or tot is None or not_cumulative(good, tot):
                            continue
                        mp = _mp(lab)
                        n = refused.get(mp, 0.0)
                        if mp in cover and cover[mp][0] == w:  # the period, over the part the bucket covered
                            per.setdefault(mp, {})[period] = (tot - good + n, tot + n)
                        if w not in wins or w in self._changed_long.get((ind, thr, period, *mp), {}):
                            continue  # the bucket counted part of the window, +Inf all of it
                        per.setdefault(mp, {})[w] = (tot - good + n, tot + n)
            else:
                for (i2, t2, p2, model, pool), led in self._ledgers.items():
                    if (i2, t2, p2) != (ind, thr, period):
                        continue
                    per[(model, pool)] = {w: led.window(now, w) for w in wins}
            out[(ind, thr, period)] = per
        return out

    def _feed_ledgers(self, view, now: float, plan: _Plan) -> None:
        t0 = self._last_feed if self._last_feed is not None else now - self.config.evaluation_interval_s
        if now <= t0:
            return
        for ind, thr, period in plan.attainments:
            if ind is AVAIL:
                for mp, (err, tot) in _outcomes(lambda m, by: view.counter_delta(m, {}, t0, now, by)).items():
                    self._ledger((ind, thr, period, *mp), period, now, tot - err, tot)
                continue
            deltas = _scoped(ind, lambda h: view.counter_delta(h.series("_bucket"), {}, t0, now, (*BY, "le")))
            good: dict[tuple[str, str], float] = {}
            total: dict[tuple[str, str], float] = {}
            for lab, v in deltas.items():
                d = dict(lab)
                try:
                    le = float(d.get("le", "nan"))
                except ValueError:
                    continue
                mp = (d.get("model", ""), d.get("pool", ""))
                if math.isinf(le):
                    total[mp] = total.get(mp, 0.0) + v
                elif math.isclose(le, thr, rel_tol=1e-9):
                    good[mp] = good.get(mp, 0.0) + v

            def delta(m, by, ind=ind):
                return _scoped(ind, lambda h: view.counter_delta(h.series("_bucket"), m, t0, now, by))
            for mp, targets in _lacking(delta, thr).items():  # their requests cannot be judged
                if mp in total:
                    total[mp] -= sum(targets.values())
            for mp, n in _unobserved(ind, lambda m: view.counter_delta(m, {}, t0, now, BY)).items():
                if mp in total:
                    total[mp] += n
            for mp, tot in total.items():
                if mp not in good or not_cumulative(good[mp], tot):
                    continue  # threshold is not a bucket / buckets not cumulative: reported per objective
                self._ledger((ind, thr, period, *mp), period, now, good[mp], tot)
        self._last_feed = now

    def _ledger(self, key: tuple, period: float, now: float, good: float, total: float) -> None:
        """Add one tick's counts to ``key``'s ledger (made on first use, up to the bound)."""
        led = self._ledgers.get(key)
        if led is None:
            if len(self._ledgers) >= self.max_pools * 4:
                return
            led = self._ledgers[key] = Ledger(period, self.ledger_step_s)
        led.add(now, good, total)

    # -- one objective -------------------------------------------------------------------------
    def _one(self, slo: SLO, key, gate: str, fresh, windowed, longwin, source_error: str | None = None) -> SLOResult:
        w = parse_duration(slo.window)
        r = SLOResult(key[0], key[1], slo.name, slo.indicator.value, slo.objective.value, slo.threshold_s,
                      Status.UNKNOWN, window=self.window_label or slo.window, percentile=slo.percentile,
                      target=slo.target)
        data = windowed.get((slo.indicator, w), {}).get(key, {})
        requests = data.get("count")
        r.requests = _num(requests)
        if gate:
            r.reason = gate
            return r
        if key not in fresh[slo.indicator]:
            r.reason = f"no current {slo.indicator.value} data (stale or missing)"
            if source_error:  # say why: a failing Prometheus is not an idle pool
                r.reason += f"; source failing: {source_error}"
            return r
        if slo.objective is Objective.ATTAINMENT:
            return self._attainment(slo, key, r, data, longwin)
        if requests is None or not math.isfinite(requests) or requests < slo.min_requests:
            # counted over the view's window: a one-shot check's is the engines' lifetime, not slo.window
            over = self.window_label or f"in {slo.window}"
            r.reason = f"{0 if requests is None else round(requests, 1)} requests {over}, need >= {slo.min_requests}"
            return r
        if slo.objective is Objective.MEAN:
            value = promql.mean_from_sum_count(data.get("sum", math.nan), requests)
        else:
            b = data.get("buckets") or {}
            value = promql.bucket_quantile(slo.percentile, list(b), list(b.values())) if b else math.nan
        if not math.isfinite(value):
            r.reason = "indicator is not a finite number (malformed or missing samples)"
            return r
        r.value = value
        r.status = threshold_status(value, slo.threshold_s, self.at_risk_ratio)
        return r

    def _attainment(self, slo: SLO, key, r: SLOResult, data, longwin) -> SLOResult:
        period = parse_duration(slo.period)
        b = data.get("buckets") or {}
        if b and le_count(b, slo.threshold_s) is None:
            h = c.latency_metric(slo.indicator.value, key[1])
            where = "the proxy's start" if key[1] == c.Pool.CLIENT else "engine start"
            # a router's buckets (Dynamo, llm-d) cannot be set: the boundaries it has are the other fix
            near = sorted((le for le in b if math.isfinite(le)), key=lambda le: abs(math.log(le / slo.threshold_s))
                          if le > 0 else math.inf)[:2]
            alt = f", or judge at a boundary it has ({' or '.join(f'{le:g}s' for le in sorted(near))})" if near else ""
            r.reason = (f"threshold {slo.threshold_s:g}s is not a bucket boundary of {h.name}; "
                        f"add it at {where} ({h.slo_threshold_env}={slo.threshold_s:g}){alt}")
            return r
        lacking = (data.get("lacking") or {}).get(slo.threshold_s)
        if lacking:
            h = c.latency_metric(slo.indicator.value, key[1])
            r.reason = (f"threshold {slo.threshold_s:g}s is not a bucket boundary of {h.name} on "
                        f"{len(lacking)} target(s) with requests ({', '.join(sorted(lacking)[:3])}): their requests "
                        f"cannot be judged; start them with {h.slo_threshold_env}={slo.threshold_s:g}")
            return r
        changed = (data.get("changed") or {}).get(slo.threshold_s)
        if changed:
            r.reason = _changed_reason(slo, key, [parse_duration(slo.window)], changed)
            return r
        if b and not_cumulative(le_count(b, slo.threshold_s), b.get(math.inf)):
            r.reason = (f"malformed histogram: its le={slo.threshold_s:g} bucket counts more requests than +Inf "
                        f"in {slo.window} (buckets must be cumulative); fix the engine's /metrics")
            return r
        wins = longwin.get((slo.indicator, slo.threshold_s, period), {}).get(key, {})
        refused = data.get("unobserved", 0.0)
        if not all(math.isfinite(x) for x in (*b.values(), refused, data.get("good", 0.0),
                                              *(n for pair in wins.values() for n in pair))):
            # Prometheus's increase() of a bucket counter that jumped to +Inf is +Inf: every burn
            # rate and the budget then read None, no row fired, and the pool was "ok"
            what = "request counts" if slo.indicator is AVAIL else "bucket counts"
            r.reason = (f"{what} of {slo.indicator.value} that are not finite numbers (+Inf or NaN): "
                        f"a broken exporter's counter; fix its /metrics")
            return r
        err_p, tot_p = wins.get(period, (math.nan, math.nan))
        alerts = burn_alerts(wins, slo.target, period, slo.min_requests)
        r.alerts = alerts
        r.burn_rates = {fmt_window(w): _num(burn_rate(e, t, slo.target)) for w, (e, t) in sorted(wins.items())}
        r.budget_remaining = _num(budget_remaining(err_p, tot_p, slo.target))
        r.period_requests = _num(tot_p)
        if slo.indicator is AVAIL:
            good, tot = data.get("good"), data.get("count")
        else:
            good, tot = (le_count(b, slo.threshold_s), b.get(math.inf)) if b else (None, None)
        if tot is not None:
            tot += refused
        cover = self._covered_long.get((slo.indicator, slo.threshold_s, period, *key))
        if tot and good is not None and tot >= slo.min_requests:
            r.value, r.requests = good / tot, tot
        elif tot_p and tot_p >= slo.min_requests:
            r.value, r.requests = (tot_p - err_p) / tot_p, tot_p
            r.window = fmt_window(cover[0]) if cover else self.window_label or slo.period
        changed = self._changed_long.get((slo.indicator, slo.threshold_s, period, *key), {})
        covered_note = _covered_note(slo, key, cover, [w for w in changed if w != period]) if cover else ""
        # those windows are left out: a page burning over the windows the bucket covered still is one
        if changed and not cover:
            r.status = attainment_status(r.budget_remaining, alerts, self.at_risk_budget)
            if r.status is Status.VIOLATED:
                r.reason = "burning " + ", ".join(f"{a.long}&{a.short}>{a.factor:g}" for a in alerts if a.firing)
                return r
            r.status = Status.UNKNOWN
            targets = sorted({t for ts in changed.values() for t in ts})
            r.reason = _changed_reason(slo, key, sorted(changed), targets)
            return r
        if not tot_p or math.isnan(tot_p) or tot_p < slo.min_requests:
            r.reason = f"{0 if not tot_p or math.isnan(tot_p) else round(tot_p, 1)} requests in the " \
                       f"period so far, need >= {slo.min_requests}"
            if cover:
                r.reason = r.reason.replace("the period so far", f"the last {fmt_window(cover[0])}") + \
                    f"; {covered_note}"
            r.status = Status.UNKNOWN
            return r
        r.status = attainment_status(r.budget_remaining, alerts, self.at_risk_budget)
        missing = [w for w in _Plan.burn_windows(period) if w not in wins and w not in changed]
        if missing and r.status is not Status.VIOLATED:
            # a burn window without an answer (its Prometheus query failed or timed out) is not a
            # window that does not burn: with the 1h query failing, a pool burning 16x read "ok"
            r.status = Status.UNKNOWN
            r.reason = (f"no data for the {', '.join(fmt_window(w) for w in missing)} burn window(s) "
                        f"(the query failed or returned nothing for this pool); the burn alerts cannot be judged")
            return r
        if r.status is not Status.OK:
            firing = [f"{a.long}&{a.short}>{a.factor:g}" for a in alerts if a.firing]
            r.reason = ("burning " + ", ".join(firing)) if firing else \
                f"error budget {100 * (r.budget_remaining or 0):.0f}% left"
        if cover:
            r.reason = f"{r.reason}; {covered_note}" if r.reason else covered_note
        if slo.indicator is AVAIL and tot and good is not None and tot > good:
            over = self.window_label or f"in {slo.window}"
            note = f"{tot - good:.0f} of {tot:.0f} requests failed by the service (outcome=error) {over}"
            r.reason = f"{r.reason}; {note}" if r.reason else note
        if refused > 0:
            over = self.window_label or f"in {slo.window}"
            what = ("refused at admission (HTTP 503, queue limit)" if key[1] != c.Pool.CLIENT else
                    "failed by the service before their first token" if slo.indicator is Indicator.TTFT else
                    "failed by the service after their first token (stream cut or stalled)")
            note = f"{refused:.0f} requests {what} {over}, counted as misses"
            r.reason = f"{r.reason}; {note}" if r.reason else note
        return r

    def _goodput(self, pr: PoolResult, windowed) -> None:
        """Both-thresholds share, bounded from the two marginal attainments (histograms do not
        give the joint distribution): lower max(0, a+b-1), upper min(a, b)."""
        slos = {s.indicator: s for s in self.config.slos_for(pr.model, pr.pool)
                if s.objective is Objective.ATTAINMENT}
        if Indicator.TTFT not in slos or Indicator.TPOT not in slos:
            return
        shares = []
        for ind in (Indicator.TTFT, Indicator.TPOT):
            s = slos[ind]
            data = windowed.get((ind, parse_duration(s.window)), {}).get((pr.model, pr.pool), {})
            b = data.get("buckets") or {}
            good, tot = le_count(b, s.threshold_s), b.get(math.inf)
            if (data.get("lacking") or {}).get(s.threshold_s) or (data.get("changed") or {}).get(s.threshold_s) \
                    or good is None or tot is None or not_cumulative(good, tot):
                return
            tot += data.get("unobserved", 0.0)  # refused requests met neither threshold
            if not tot or tot < s.min_requests:
                return
            shares.append(good / tot)
        a, b2 = shares
        pr.goodput_lower_bound = max(0.0, a + b2 - 1.0)
        pr.goodput_upper_bound = min(a, b2)

    # -- metrics -------------------------------------------------------------------------------
    def _child(self, metric, *labels: str):
        """prometheus_client children cached: .labels() costs ~10 us, and a tick sets ~15
        gauges per objective per pool."""
        key = (metric.name, labels)
        ch = self._children.get(key)
        if ch is None:
            ch = self._children[key] = self._metrics[metric].labels(*labels)
        return ch

    def _export(self) -> None:
        if self._metrics is None:
            return
        self._unexport_gone()
        ch = self._child
        for pr in self.pools.values():
            for s in pr.slos:
                for st in Status:
                    ch(c.GUARD_SLO_STATUS, pr.model, pr.pool, s.slo, st.value).set(1.0 if s.status is st else 0.0)
                ch(c.GUARD_SLO_VALUE, pr.model, pr.pool, s.slo).set(s.value if s.value is not None else math.nan)
                for w, br in s.burn_rates.items():
                    ch(c.GUARD_BURN_RATE, pr.model, pr.pool, s.slo, w).set(br if br is not None else math.nan)
                if s.objective == Objective.ATTAINMENT.value:
                    ch(c.GUARD_BUDGET_REMAINING, pr.model, pr.pool, s.slo).set(
                        s.budget_remaining if s.budget_remaining is not None else math.nan)
            ch(c.GUARD_GOODPUT, pr.model, pr.pool).set(
                pr.goodput_lower_bound if pr.goodput_lower_bound is not None else math.nan)

    def _unexport_gone(self) -> None:
        """Take the series of pools no longer judged (forgotten) off /metrics: left there, a
        removed pool's last verdict (its "unknown" = 1) stayed on /metrics for good, against the
        API, and every model ever seen kept its ~15 series per objective."""
        live = set(self.pools)
        if self._exported <= live:
            self._exported = live
            return
        gone = self._exported - live
        for key in [k for k in self._children if k[1][:2] in gone]:
            name, labels = key
            del self._children[key]
            with contextlib.suppress(KeyError):
                self._metrics.families[name].remove(*labels)
        self._exported = live


class _Plan:
    """Which (indicator, window) and (indicator, threshold, period) the objectives need, so each
    is queried once per tick for all pools (one vectorised query instead of one per pool)."""

    def __init__(self, config: GuardConfig, pools) -> None:
        windows: set[tuple[Indicator, float]] = set()
        att: set[tuple[Indicator, float | None, float]] = set()
        # attainment thresholds per (indicator, SLI window): checked on every target of a pool
        thresholds: dict[tuple[Indicator, float], set[float]] = {}
        objs: list[SLO] = []
        for model, pool in pools:
            objs.extend(config.slos_for(model, pool))
        for s in objs:
            windows.add((s.indicator, parse_duration(s.window)))
            if s.objective is Objective.ATTAINMENT:
                att.add((s.indicator, s.threshold_s, parse_duration(s.period)))
                if s.threshold_s is not None:  # (availability counts outcomes, no bucket)
                    thresholds.setdefault((s.indicator, parse_duration(s.window)), set()).add(s.threshold_s)
        self.windows = sorted(windows)
        self.thresholds = thresholds
        self.attainments = sorted(att)

    @staticmethod
    def burn_windows(period: float) -> list[float]:
        """The burn rows' windows (never longer than the period, so the ledger holds them) and the
        period itself (the error budget)."""
        return sorted({period, *_burn_windows(period)})


def _json_key(key: tuple) -> str:
    ind, thr, period, model, pool = key
    return json.dumps([str(ind.value if isinstance(ind, Indicator) else ind), thr, period, model, pool],
                      separators=(",", ":"))


def _key_from_json(kj: str) -> tuple | None:
    try:
        ind, thr, period, model, pool = json.loads(kj)
        return Indicator(ind), None if thr is None else float(thr), float(period), model, pool
    except (ValueError, TypeError):
        return None


def _mp(lab: Labels) -> tuple[str, str]:
    d = dict(lab)
    return d.get("model", ""), d.get("pool", "")


def _lacking(query: Callable[[Mapping[str, str], tuple[str, ...]], dict[Labels, float]],
             thr: float) -> dict[tuple[str, str], dict[str, float]]:
    """{(model, pool): {instance: requests}} of the targets with requests whose histogram has no
    bucket at ``thr`` (an engine started without the threshold bucket, e.g. mid rolling restart).
    Summed per pool, its requests would count as over the threshold (a two-engine pool read 50 %
    and burned its budget with every request in time). ``query(matchers, by)`` is a
    counter query over the ``_bucket`` series (``increase`` or ``counter_delta``); the common
    case costs one query per spelling of the bound, over one series per target."""
    by = (*BY, "instance")
    busy = {lab: v for lab, v in query({"le": "+Inf"}, by).items() if v > 0}
    if not busy:
        return {}
    have: set[Labels] = set()
    for spelling in le_spellings(thr):
        have.update(query({"le": spelling}, by))
    out: dict[tuple[str, str], dict[str, float]] = {}
    for lab, v in busy.items():
        if lab in have:
            continue
        inst = dict(lab).get("instance", "")
        les = {_le_of(dict(k).get("le", "")) for k in query({"instance": inst}, (*by, "le"))}
        if not any(math.isclose(x, thr, rel_tol=1e-9) for x in les):  # not merely spelled otherwise
            out.setdefault(_mp(lab), {})[inst or "?"] = v
    return out


def _unobserved(ind: Indicator, query: Callable[[str], dict[Labels, float]]) -> dict[tuple[str, str], float]:
    """{(model, pool): requests that missed ``ind`` unobserved} (``UNOBSERVED``): the engine
    pools' counter for every pool but client, the client scope's for pool client only, as
    ``_scoped`` splits the histograms. ``query(series)`` is a counter query by (model, pool)."""
    engine, client = UNOBSERVED.get(ind, (None, None))
    out = {} if engine is None else \
        {_mp(lab): v for lab, v in query(engine).items() if dict(lab).get("pool") != c.Pool.CLIENT}
    if client is not None:
        out.update((_mp(lab), v) for lab, v in query(client).items() if dict(lab).get("pool") == c.Pool.CLIENT)
    return out


UNCHECKED = "unchecked: the query failed"  # a target name that says the bucket check had no answer
HOOK_UNCHECKED = ("could not check that the sla-guard hook records on this pool's engines (the query failed; "
                  "see the source's errors)")


def _hook_stalls(view: MetricsView, now: float) -> dict[tuple[str, str], str] | None:
    """{(model, pool): why} of the pools with an engine whose sla-guard hook stopped recording
    (``PrometheusView.hook_stalls``): its series are frozen, so the pool is unknown, not idle or ok.
    None when the query failed. Only a view over Prometheus asks: the scraper checks each page as it
    reads it (``Scraper._hook_stalled``) and fails that target's scrape instead."""
    ask = getattr(view, "hook_stalls", None)
    if ask is None:
        return {}
    got = ask(now)
    if got is None:
        return None
    by_pool: dict[tuple[str, str], list[dict]] = {}
    for row in got:
        by_pool.setdefault((str(row.get("model", "")), str(row.get("pool", ""))), []).append(row)
    out = {}
    for mp, rows in by_pool.items():
        rows.sort(key=lambda r: (float(r["since"]), str(r.get("instance")), str(r.get("engine"))))
        first = rows[0]
        where = f"{first.get('instance', '?')} engine {first.get('engine', '?')!s}"
        more = f" (+{len(rows) - 1} more engines)" if len(rows) > 1 else ""
        still = now - float(first["since"])
        since = (f"not within {fmt_window(c.HOOK_STALL_LOOKBACK_S)}" if still >= c.HOOK_STALL_LOOKBACK_S
                 else f"{still // 60:.0f} min ago")
        out[mp] = (f"hook_stalled: the hook stopped recording on {_short(where, 80)}{more}: vLLM generated "
                   f"tokens there ({c.VLLM_GENERATION_TOKENS}) after a counter of the hook's last moved ({since}; "
                   f"its logger dropped by an elastic-EP scale-up, or record() failing: see "
                   f"{c.HOOK_ERRORS.series()}); its data is frozen, not idle, until the hook records again: "
                   f"restart that API server")
    return out


def _bucket_changes(view: MetricsView, ind: Indicator, thr: float, windows: tuple[float, ...], now: float,
                    pools: set[tuple[str, str]]) -> dict[float, dict[tuple[str, str], list[str]]]:
    """{window: {(model, pool): targets}} whose histogram child with requests in the window has no
    ``le=thr`` bucket over all of it (``PrometheusView.uncovered_buckets``). Only a view whose
    long windows are PromQL's own asks: the embedded store compares a histogram's buckets only
    over what they all saw (``SeriesStore._comparable``). A failed query marks every window of
    every pool of the family (``UNCHECKED``): a change it cannot rule out would read as errors."""
    ask = getattr(view, "uncovered_buckets", None)
    if ask is None:
        return {}
    out: dict[float, dict[tuple[str, str], set[str]]] = {}
    for hist, client in zip(HIST[ind], (False, True), strict=True):
        got = ask(hist, thr, windows, now)
        for w, children in (got.items() if got is not None else ((w, None) for w in windows)):
            if children is None:  # the query failed: every pool of this family is unchecked
                for mp in pools:
                    if (mp[1] == c.Pool.CLIENT) == client:
                        out.setdefault(w, {})[mp] = {UNCHECKED}
                continue
            for lab in children:
                if (dict(lab).get("pool") == c.Pool.CLIENT) == client:
                    out.setdefault(w, {}).setdefault(_mp(lab), set()).add(_target(lab))
    return {w: {mp: sorted(t) for mp, t in by_pool.items()} for w, by_pool in out.items()}


def _target(lab: Labels) -> str:
    """How a reason names a histogram child: its instance, else its labels other than model and pool."""
    return dict(lab).get("instance") or ",".join(f"{k}={x}" for k, x in lab if k not in BY)


def _clean_floor(seconds: float) -> float:
    """``seconds`` rounded down to whole days, else hours, else minutes (0 under a minute)."""
    for n in (86400, 3600, 60):
        if seconds >= n:
            return seconds // n * n
    return 0.0


def _covered_spans(view: MetricsView, ind: Indicator, thr: float, period: float, wins: list[float],
                   changed: dict[float, dict[tuple[str, str], list[str]]],
                   now: float) -> dict[tuple[str, str], tuple[float, float, list[str]]]:
    """{(model, pool): (span, since, targets)} for the pools whose ``le=thr`` bucket did not cover
    the period (``changed``, from ``_bucket_changes``): the longest clean window (``_clean_floor``)
    that the bucket covered on every such target of the pool, ``since`` the time it covers them
    from (``PrometheusView.bucket_covered_since``). The period is judged over that span instead of
    left unknown for a whole period after an operator added the threshold bucket. The span is read in
    slices of a burn window the bucket covered (the newest slice's end to now lies inside it), so
    it reads short, never long: reading long would count the requests before the bucket as misses.
    A pool is left out (unknown, as before) where the query failed, the bucket check had no
    answer, the newest slice is not covered, or the span is under a minute."""
    ask = getattr(view, "bucket_covered_since", None)
    uncovered = changed.get(period, {})
    if ask is None or not uncovered:
        return {}
    step = max(w for w in wins if w <= max(wins[0], period / 720))  # 5m for 2d, 1h for 30d: ~720 slices
    out: dict[tuple[str, str], tuple[float, float, list[str]]] = {}
    for hist, client in zip(HIST[ind], (False, True), strict=True):
        pools = {mp: t for mp, t in uncovered.items() if (mp[1] == c.Pool.CLIENT) == client
                 and UNCHECKED not in t and mp not in changed.get(step, {})}
        if not pools:
            continue
        got = ask(hist, thr, period, step, now)
        if got is None:  # unknown, saying the bucket changed, as before
            continue
        since: dict[tuple[str, str], float] = {}
        for lab, t in got.items():
            mp = _mp(lab)
            if mp in pools and _target(lab) in pools[mp]:
                since[mp] = max(since.get(mp, -math.inf), t)
        for mp, targets in pools.items():
            if mp not in since:
                continue  # uncovered over the period, yet no uncovered slice: not judged
            span = _clean_floor(now - since[mp])
            if 0 < span < min(w for w, by_pool in changed.items() if mp in by_pool):
                out[mp] = (span, since[mp], targets)
    return out


def _covered_note(slo: SLO, key: tuple[str, str], cover: tuple[float, float, list[str]],
                  left_out: list[float]) -> str:
    """What a period judged over the part its threshold bucket covered says about it."""
    span, since, targets = cover
    h = c.latency_metric(slo.indicator.value, key[1])
    full = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(since + parse_duration(slo.period)))
    burn = (f"; the {', '.join(map(fmt_window, sorted(left_out)))} burn window(s) it did not cover are left out"
            if left_out else "")
    return (f"period judged over the last {fmt_window(span)}, since the le={slo.threshold_s:g} bucket of {h.name} "
            f"appeared on {len(targets)} target(s) ({', '.join(targets[:3])}); the full period from {full}{burn}")


def _short(text: str, limit: int) -> str:
    """``text`` in at most about ``limit`` characters: its start (what failed) and its end (the
    errors of the scraper end with the fix: the config field to raise) around an ellipsis."""
    if len(text) <= limit:
        return text
    head, tail = text[:limit * 2 // 5], text[len(text) - limit * 3 // 5 + 5:]
    cut, start = head.rfind(" "), tail.find(" ")  # whole words, unless that loses more than 20
    head = head[:cut] if cut >= len(head) - 20 else head
    tail = tail[start + 1:] if 0 <= start < 20 else tail
    return f"{head} ... {tail}"


def _changed_reason(slo: SLO, key: tuple[str, str], windows: list[float], targets: list[str]) -> str:
    """Why an attainment objective's windows are not judged while its threshold bucket changes."""
    h = c.latency_metric(slo.indicator.value, key[1])
    if UNCHECKED in targets:
        return (f"could not check that the le={slo.threshold_s:g} bucket of {h.name} covers the "
                f"{', '.join(map(fmt_window, windows))} window(s) (the query failed; see the source's errors)")
    return (f"the le={slo.threshold_s:g} bucket of {h.name} changed within the {', '.join(map(fmt_window, windows))} "
            f"window(s) on {len(targets)} target(s) with requests ({', '.join(targets[:3])}): it appeared or vanished "
            f"there (an engine restarted with another bucket set), so it counts part of the window and +Inf all of "
            f"it; judged again once {fmt_window(max(windows))} has passed since the change (keep "
            f"{h.slo_threshold_env}={slo.threshold_s:g} on every engine)")


def _le_of(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _bucket_increase(view: MetricsView, hist: str, w: float, now: float,
                     les: tuple[float, ...] = ()) -> dict[Labels, dict[float, float]]:
    """sum by (le, model, pool) (increase(hist_bucket[w])), of the bounds ``les`` and +Inf only
    when given."""
    return view.bucket_increase(hist, {}, w, now, BY, les)
