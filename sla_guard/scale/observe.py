"""Read the advisor's inputs from a ``MetricsView`` (the guard's store, a Prometheus server, or
the simulator's replay store): pool totals for sizing and per-engine samples for learning.

All queries go through contract ``Metric`` objects; missing data comes back as ``None`` so the
sizing holds instead of acting on zeros.

TTFT is read where the client sees it when the deployment has a client scope (a P/D proxy or
router exporting ``pool="client"``, ``route="pd"``): :meth:`Reader.read_client` gives the client
TTFT and the router-measured stages, which the advisor uses to judge the SLA and to split the
blame between the pools. Without one, the prefill pool's own TTFT is read, as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from exporters import contract as c
from exporters.contract import Kind, Metric
from sla_guard import promql
from sla_guard.ingest.source import UP
from sla_guard.model import Labels, MetricsView, Series


def sample_name(m: Metric, suffix: str = "") -> str:
    """The sample name a view is queried with (``_total`` for counters, ``_sum``/``_count`` parts);
    public because the simulator's replay baselines query the same view the same way."""
    return m.series(suffix) if m.kind is Kind.HISTOGRAM else m.series()


def replica_of(labels: Labels) -> str:
    """The replica a series belongs to: its scrape ``instance`` (one vLLM server, which may run
    several data-parallel engines) when present, else its ``engine`` label."""
    d = dict(labels)
    return d.get("instance") or d.get("engine", "")


def _by_replica(values: Mapping[Labels, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in values.items():
        r = replica_of(k)
        out[r] = out.get(r, 0.0) + v
    return out


def _finite(values: dict[Labels, float]) -> dict[Labels, float]:
    """The series whose value is a finite number of at least 0 (requests, a KV-cache share); an
    engine whose gauge is not is left out, as an engine that sent no sample is. A running gauge
    at -1000 summed into the pool read as negative concurrency: decode 'steady' (or over
    provisioned) at one replica with 30 sequences running."""
    return {k: v for k, v in values.items() if 0.0 <= v < math.inf}


# the largest count a float64 holds exactly: a counter beyond it (or negative, or not finite) is a
# broken exporter's, not tokens or steps counted
MAX_COUNT = float(2**53)


def counts_ok(series: list[Series]) -> bool:
    """Whether every sample of these counter series is a count (finite, 0 to ``MAX_COUNT``).

    One that is not makes the rates read from them unknown, not the rates of the other series:
    a +Inf or 1e18 token counter read as a rate made the learned prefill capacity infinite (or
    1e16 tokens/s) for good, and prefill was then sized at one replica whatever the load."""
    return all(bool(((s.v >= 0.0) & (s.v <= MAX_COUNT)).all()) for s in series)


def _sum_series(series: list[Series]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per replica, the sum over its engines' series at each scrape time."""
    acc: dict[str, dict[float, float]] = {}
    for s in series:
        d = acc.setdefault(replica_of(s.labels), {})
        for t, v in zip(s.t.tolist(), s.v.tolist(), strict=True):
            d[t] = d.get(t, 0.0) + v
    out = {}
    for r, d in acc.items():
        ts = np.array(sorted(d))
        out[r] = (ts, np.array([d[t] for t in ts]))
    return out


def counter_rates(series: list[Series], by: str | None = None) -> dict[str, float]:
    """Per-``by`` rate of counters from raw samples: reset-aware growth over the time the samples
    actually cover. Unlike ``increase``, no extrapolation to the window's edges, so a replica
    (or a guard) that started inside the window is not under- or over-counted."""
    out: dict[str, float] = {}
    for s in series:
        if len(s.v) < 2:
            continue
        dt = float(s.t[-1] - s.t[0])
        if dt <= 0:
            continue
        d = np.diff(s.v)
        growth = float(np.where(d >= 0, d, s.v[1:]).sum())  # after a reset the counter restarts at 0
        key = s.label(by) if by else replica_of(s.labels)
        out[key] = out.get(key, 0.0) + growth / dt
    return out


def uncached_demand(computed: Mapping[str, float], prompt: Mapping[str, float], engines: list[str],
                    running: float | None, waiting: float | None) -> float | None:
    """Computed (not cached) prompt tokens/s of the pool, or None when it cannot be told.

    Without the ``source="computed"`` series but with other prompt-token series (an exporter that
    does not split by source), every prompt token counts as computed: demand is then overstated
    by the hit ratio, never understated. Without any prompt-token series, 0 only when the engines
    are idle (nothing running or waiting): a family the sidecar dropped, or a vLLM that does not
    export it, under load read as 0 tokens/s and let prefill scale to its minimum."""
    if computed:
        return sum(computed.values())
    if prompt:
        return sum(prompt.values())
    if engines and not (running or waiting):
        return 0.0
    return None


@dataclass(slots=True)
class EngineSample:
    """One replica's numbers over the window (learning input); ``engine`` is the replica key
    (``instance``, else ``engine``), summed over its data-parallel engines."""

    engine: str
    pool: str
    computed_tps: float | None = None
    prompt_tps: float | None = None  # every prompt token, prefix-cache hits included
    waiting_busy_share: float | None = None  # share of samples with requests waiting
    busy_share: float | None = None  # share of samples with a running batch
    running_mean: float | None = None
    running_min: float | None = None
    step_s: float | None = None  # window / steps while it had a running batch
    tpot_mean_s: float | None = None
    accepted_len: float | None = None


@dataclass(slots=True)
class PoolReading:
    pool: str
    engines: list[str] = field(default_factory=list)  # engines with a fresh sample
    # targets of the pool whose last scrape failed (``up`` 0) and with no fresh sample: replicas
    # that may be serving a load the view does not show
    down: list[str] = field(default_factory=list)
    totals: dict[str, float | None] = field(default_factory=dict)
    per_engine: dict[str, EngineSample] = field(default_factory=dict)
    waiting_by_engine: dict[str, float] = field(default_factory=dict)  # requests waiting, per replica
    # the window's TPOT histogram, whole pool: cumulative request count at each bucket edge (le)
    tpot_le: dict[float, float] = field(default_factory=dict)

    @property
    def unfinished(self) -> float | None:
        """Requests the pool holds and has not finished: waiting plus running.

        On a prefill engine every one of them still owes its prompt, and the split between the two
        says little: vLLM V1 admits a waiting request once the step's token budget has room for its
        first chunk, so a running prefill may still be most of its prompt away. On a decode engine
        running is the batch, not a queue."""
        w, r = self.totals.get("waiting"), self.totals.get("running")
        return None if w is None and r is None else (w or 0.0) + (r or 0.0)


def long_prefill_seconds(buckets: Mapping[float, float], longer_than_s: float) -> float | None:
    """Seconds of prefill spent in the window on requests whose prefill took longer than
    ``longer_than_s``, from the histogram's {upper bound: cumulative increase} (bucket
    midpoints; the +Inf bucket at its lower bound). None without buckets.

    The bucket across the threshold counts its part above it, as if spread evenly: with the
    contract's buckets the 1.25 s threshold (half a 2.5 s SLA) falls inside (1, 2.5], and
    counting whole buckets only left every prefill of 1.25-2.5 s out of the share (a first
    minute with such prefills read as free of long prompts, and prefill shrank on it)."""
    if not buckets:
        return None
    total, lo, below = 0.0, 0.0, 0.0
    for hi, cum in sorted(buckets.items()):
        n = max(0.0, cum - below)
        below = max(below, cum)
        start = max(lo, longer_than_s)  # the part of the bucket above the threshold
        if n > 0 and hi == float("inf"):
            total += n * lo if lo >= longer_than_s else 0.0
        elif n > 0 and hi > start:
            total += n * (hi - start) / (hi - lo) * (start + hi) / 2
        lo = hi
    return total


def tail_sample_floor(q: float, exceedances: float = 10.0) -> float:
    """Requests a window needs before its ``q`` quantile is a signal: ``exceedances`` above it.

    Below that, the "p90" of a window is one or two requests: at the start of a replay, or at a
    low request rate, a single 100k-token prompt would read as a TTFT breach at 2x the SLA and
    the proportional rule would double a pool that is 10% busy."""
    return exceedances / max(1.0 - q, 1e-9)


@dataclass(slots=True)
class ClientReading:
    """The client scope of one model over the window (P/D route): TTFT as the client sees it and
    the router-measured stages of it. ``None`` values: too few requests for that quantile, or
    no stage series (a router that exports TTFT only)."""

    requests: float = 0.0  # client TTFTs observed in the window
    ttft_mean_s: float | None = None
    ttft_tail_s: float | None = None  # at the tail (control) quantile
    ttft_learn_s: float | None = None  # at the learn quantile
    prefill_leg_mean_s: float | None = None
    decode_first_leg_mean_s: float | None = None
    proxy_mean_s: float | None = None
    prefill_leg_tail_s: float | None = None
    decode_first_leg_tail_s: float | None = None

    @property
    def outside_prefill_s(self) -> float | None:
        """Mean time of a request's TTFT the prefill pool cannot change (decode leg: KV hand-off,
        decode queue, first step; and the router's own time); None without stage series."""
        if self.decode_first_leg_mean_s is None:
            return None
        return self.decode_first_leg_mean_s + (self.proxy_mean_s or 0.0)


class Reader:
    """Stateless queries; one call per pool per tick."""

    def __init__(self, window_s: float = 60.0, tail_quantile: float = 0.9, learn_quantile: float = 0.95,
                 long_prefill_s: float = 1.25) -> None:
        self.window_s = window_s
        self.tail_quantile = tail_quantile
        self.learn_quantile = learn_quantile
        self.long_prefill_s = long_prefill_s

    def _quantile(self, view: MetricsView, metric: Metric, mt: Mapping[str, str], n: float, q: float,
                  now: float) -> float | None:
        if n < tail_sample_floor(q):
            return None  # a tail of a handful of requests is one request
        vals = [v for v in view.histogram_quantile(q, metric.name, mt, self.window_s, now, ()).values() if v == v]
        return max(vals) if vals else None

    def _mean(self, view: MetricsView, metric: Metric, mt: Mapping[str, str], now: float) -> tuple[float, float | None]:
        """(observations, mean) of a histogram over the window; mean None without observations,
        or when the sum or count is not a finite number (a +Inf or NaN ``_sum`` of the decode leg
        read as an infinite time outside prefill: the client's TTFT breach was then blamed on
        nobody, the prefill pool's part of it read as 0 s against a NaN budget)."""
        cnt = view.increase(sample_name(metric, "_count"), mt, self.window_s, now, ())
        n = sum(cnt.values()) if cnt else 0.0
        if not math.isfinite(n):
            return 0.0, None
        if n <= 0:
            return n, None
        tot = view.increase(sample_name(metric, "_sum"), mt, self.window_s, now, ())
        mean = sum(tot.values()) / n if tot else None
        return n, (mean if mean is not None and math.isfinite(mean) else None)

    def read_client(self, view: MetricsView, model: str, now: float) -> ClientReading | None:
        """The client scope's TTFT and stages for ``model`` (route "pd"); None when the deployment
        exports no client scope for it (no client TTFT series in the window)."""
        mt: dict[str, str] = {"pool": c.Pool.CLIENT.value, "route": c.Route.PD.value}
        if model not in ("", "*"):
            mt["model"] = model
        counted = view.increase(sample_name(c.CLIENT_TTFT, "_count"), mt, self.window_s, now, ())
        if not counted:
            return None
        r = ClientReading()
        r.requests, r.ttft_mean_s = self._mean(view, c.CLIENT_TTFT, mt, now)
        r.ttft_tail_s = self._quantile(view, c.CLIENT_TTFT, mt, r.requests, self.tail_quantile, now)
        r.ttft_learn_s = self._quantile(view, c.CLIENT_TTFT, mt, r.requests, self.learn_quantile, now)
        for stage in c.Stage:
            smt = {**mt, "stage": stage.value}
            n, mean = self._mean(view, c.CLIENT_STAGE, smt, now)
            setattr(r, f"{stage.value}_mean_s", mean)
            if stage is not c.Stage.PROXY:
                setattr(r, f"{stage.value}_tail_s", self._quantile(view, c.CLIENT_STAGE, smt, n,
                                                                   self.tail_quantile, now))
        return r

    def read(self, view: MetricsView, model: str, pool: str, now: float) -> PoolReading:
        w = self.window_s
        mt: Mapping[str, str] = {"pool": pool} if model in ("", "*") else {"model": model, "pool": pool}
        r = PoolReading(pool)
        # a gauge that is not a finite number (+Inf running requests from a broken exporter) is no
        # reading: summed, it raised out of the advisor's sizing on every tick
        running = _finite(view.instant(sample_name(c.REQUESTS_RUNNING), mt, now))
        waiting = _finite(view.instant(sample_name(c.REQUESTS_WAITING), mt, now))
        kv = _finite(view.instant(sample_name(c.KV_CACHE_USAGE), mt, now))
        r.engines = sorted({replica_of(k) for k in running} | {replica_of(k) for k in waiting})
        r.down = sorted({replica_of(k) for k, v in view.instant(UP, mt, now).items() if not v >= 1} - set(r.engines))
        t = r.totals
        t["running"] = sum(running.values()) if running else None
        t["waiting"] = sum(waiting.values()) if waiting else None
        r.waiting_by_engine = _by_replica(waiting)
        t["kv_usage"] = (sum(kv.values()) / len(kv)) if kv else None
        t["kv_usage_max"] = max(kv.values()) if kv else None

        by_e = ("instance", "engine")
        comp_mt = {**mt, "source": "computed"}
        computed = counter_rates(view.range(sample_name(c.PROMPT_TOKENS), comp_mt, now - w, now))
        # every prompt token (hits included), per replica: the pool's hit ratio and each replica's
        # miss ratio (a new replica's empty cache, advisor._demand_tps) come from the same rates
        prompt_series = view.range(sample_name(c.PROMPT_TOKENS), mt, now - w, now)
        prompt_rates = counter_rates(prompt_series)
        t["uncached_tps"] = uncached_demand(computed, prompt_rates, r.engines, t["running"], t["waiting"])
        if not counts_ok(prompt_series):  # the computed series are among them
            computed, prompt_rates, t["uncached_tps"] = {}, {}, None
        if prompt_rates and computed:
            tot = sum(prompt_rates.values())
            t["prefix_hit_ratio"] = 1.0 - sum(computed.values()) / tot if tot > 0 else None
        prefill_series = view.range(sample_name(c.REQUEST_PREFILL, "_count"), mt, now - w, now)
        prefills = counter_rates(prefill_series) if counts_ok(prefill_series) else {}
        t["requests_per_s"] = sum(prefills.values()) if prefills else None
        by_le = promql.split_le(view.increase(sample_name(c.REQUEST_PREFILL, "_bucket"), mt, w, now, ("le",)))
        long_s = long_prefill_seconds(by_le.get((), {}), self.long_prefill_s)
        if long_s is not None and r.engines:
            # in replicas kept busy (the work), not a share: the replicas ready at the next tick
            # may not be the ones that did it (advisor._long_work)
            t["long_busy_replicas"] = min(float(len(r.engines)), long_s / w)
        pre = view.increase(sample_name(c.PREEMPTIONS), mt, w, now, ())
        t["preemptions_per_s"] = sum(pre.values()) / w if pre else 0.0
        drafts = _by_replica(view.increase(sample_name(c.SPEC_DRAFTS), mt, w, now, by_e))
        acc = _by_replica(view.increase(sample_name(c.SPEC_ACCEPTED_TOKENS), mt, w, now, by_e))
        d_tot = sum(drafts.values()) if drafts else 0.0
        t["accepted_len"] = 1.0 + sum(acc.values()) / d_tot if d_tot > 0 and acc else 1.0
        t["accepted_len_seen"] = 1.0 if d_tot > 0 else 0.0
        # the scheduler-queue tail tells whether a TTFT breach came from load at all
        for ind, metric in (("ttft", c.REQUEST_TTFT), ("tpot", c.REQUEST_TPOT), ("queue", c.REQUEST_QUEUE)):
            counted = view.increase(sample_name(metric, "_count"), mt, w, now, ())
            n = sum(counted.values()) if counted else 0.0
            t[f"{ind}_requests"] = n
            for qname, qv in (("tail", self.tail_quantile), ("learn", self.learn_quantile), ("p99", 0.99)):
                if n < tail_sample_floor(qv):
                    t[f"{ind}_{qname}_s"] = None  # a tail of a handful of requests is one request
                    continue
                q = view.histogram_quantile(qv, metric.name, mt, w, now, ())
                vals = [v for v in q.values() if v == v]  # drop NaN (no requests)
                t[f"{ind}_{qname}_s"] = max(vals) if vals else None

        r.tpot_le = promql.split_le(view.increase(sample_name(c.REQUEST_TPOT, "_bucket"), mt, w, now,
                                                  ("le",))).get((), {})
        tsum = view.increase(sample_name(c.REQUEST_TPOT, "_sum"), mt, w, now, ())
        n_tpot = t.get("tpot_requests") or 0.0
        t["tpot_mean_s"] = sum(tsum.values()) / n_tpot if tsum and n_tpot > 0 else None
        # step time of a replica = mean over its data-parallel engines (each steps on its own)
        step_series = view.range(sample_name(c.ENGINE_STEPS), mt, now - w, now)
        step_rates = counter_rates(step_series, by="engine") if counts_ok(step_series) else {}
        eng_rep = {s.label("engine"): replica_of(s.labels) for s in step_series}
        step_times: dict[str, list[float]] = {}
        for eng, rate in step_rates.items():
            if rate > 0:
                step_times.setdefault(eng_rep.get(eng, eng), []).append(1.0 / rate)
        tpot_sum = _by_replica(view.increase(sample_name(c.REQUEST_TPOT, "_sum"), mt, w, now, by_e))
        tpot_cnt = _by_replica(view.increase(sample_name(c.REQUEST_TPOT, "_count"), mt, w, now, by_e))
        run_series = _sum_series(view.range(sample_name(c.REQUESTS_RUNNING), mt, now - w, now))
        wait_series = _sum_series(view.range(sample_name(c.REQUESTS_WAITING), mt, now - w, now))
        for e in r.engines:
            s = EngineSample(engine=e, pool=pool)
            if e in computed:
                s.computed_tps = computed[e]
            if e in prompt_rates:
                s.prompt_tps = prompt_rates[e]
            ws = wait_series.get(e)
            if ws is not None and len(ws[1]):
                s.waiting_busy_share = float((ws[1] > 0).mean())
            rs = run_series.get(e)
            if rs is not None and len(rs[1]):
                s.running_mean = float(rs[1].mean())
                s.running_min = float(rs[1].min())
                s.busy_share = float((rs[1] > 0).mean())
            if step_times.get(e) and s.running_min is not None and s.running_min >= 1:
                s.step_s = float(np.mean(step_times[e]))
            if tpot_cnt.get(e):
                s.tpot_mean_s = tpot_sum.get(e, 0.0) / tpot_cnt[e]
            if drafts.get(e):
                s.accepted_len = 1.0 + acc.get(e, 0.0) / drafts[e]
            r.per_engine[e] = s
        _drop_non_finite(r)
        return r


def _drop_non_finite(r: PoolReading) -> None:
    """Unknown (None) for every number of ``r`` that is not finite: a +Inf histogram sum or
    running gauge in the window read as an infinite (or NaN) mean, step time or accepted length,
    which the learned state kept for good (a NaN accepted length sized decode at one sequence a
    replica, 1 -> 5 replicas, until the guard's state file was deleted)."""
    t = r.totals
    for k, v in t.items():
        if v is not None and not math.isfinite(v):
            t[k] = None
    if t.get("accepted_len") is None:
        t["accepted_len"], t["accepted_len_seen"] = 1.0, 0.0
    for s in r.per_engine.values():
        for f in ("computed_tps", "prompt_tps", "running_mean", "running_min", "step_s", "tpot_mean_s",
                  "accepted_len"):
            v = getattr(s, f)
            if v is not None and not math.isfinite(v):
                setattr(s, f, None)
    if not all(math.isfinite(v) for v in r.tpot_le.values()):
        r.tpot_le = {}
