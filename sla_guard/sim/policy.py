"""The scaling-policy interface the simulator's replay drives (``sla-guard replay --policy``).

A policy sees what an autoscaler in a real deployment sees: the contract metrics (through the
same ``MetricsView`` the guard's evaluators use, fed by scraping the simulated engines at
simulated time) and the replica counts a controller knows (ready, starting, draining). It
answers with the desired replica count per pool. The simulator applies the answer with real
dynamics: new replicas cold-start before serving, removed ones drain before they stop.

Policies are looked up by name (:func:`get_policy`), all defined here so that imports point one
way (the simulator uses the scaling library, never the reverse):

- ``static``: never changes the replica counts (the baseline every other policy beats);
- ``queue``: what vLLM production-stack's KEDA tutorial deploys: per pool, desired =
  ceil(waiting requests / 5), scale up at once, scale down only after a 360 s cooldown;
- ``planner``: a re-implementation of NVIDIA Dynamo planner's published rules (not its code): a
  throughput loop every 180 s sizing pools from profiled per-engine capacity at the TTFT / ITL
  targets with observed/expected correction factors, and a 5 s load loop that adds one replica
  when every engine misses its target and removes one only if N-1 engines would meet it at
  load x N/(N-1); nothing new while a scaling is in progress. TTFT is the client's where the
  deployment has a client scope (Dynamo reads it at its frontend), else the prefill engines';
- ``guard``: the advisor (``sla_guard.scale.advisor``) with profile priors and online learning.

All see the same ``Observation`` on the same simulated deployment, so the closed-loop comparison
is like for like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from exporters import contract as c
from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.model import Finding, MetricsView
from sla_guard.scale.advisor import Advisor
from sla_guard.scale.observe import sample_name
from sla_guard.settings.advisor import AdvisorConfig, PoolLimits, ProfilePrior


@dataclass(frozen=True, slots=True)
class PoolState:
    """What a deployment controller knows about one pool (like a Deployment's status)."""

    pool: str  # "prefill" | "decode"
    ready: int  # replicas serving
    starting: int  # replicas cold-starting (count against the budget, serve nothing yet)
    draining: int  # replicas finishing in-flight work after a scale-down
    gpus_per_replica: int
    min_replicas: int = 1
    max_replicas: int = 64

    @property
    def current(self) -> int:
        """Replicas that exist or are coming (ready + starting): what ``desired`` is compared to."""
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class Observation:
    """Input of one policy decision, at simulated time ``now`` (unix seconds).

    ``view`` holds every contract series scraped from the simulated engines so far (engine
    label = replica name, e.g. ``p0``; ``model`` and ``pool`` labels as in a real deployment).
    ``findings`` are the detectors' open findings when detectors run, else empty.
    ``profile`` is the simulator's performance profile (a ``sla_guard.sim.profile.Profile``):
    policies that read capacities "from a profile" (Dynamo-planner style) may use it; policies
    that learn online should use ``view`` only.
    """

    now: float
    model: str
    pools: Mapping[str, PoolState]
    view: MetricsView | None
    gpu_budget: int | None = None  # total GPUs both pools may use, None = unlimited
    findings: tuple[Finding, ...] = ()
    profile: object | None = None
    slo_ttft_s: float = TTFT_SLO_S
    slo_tpot_s: float = TPOT_SLO_S
    extra: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """A scaling policy. ``decide`` is called every ``interval_s`` of simulated time.

    Return the desired replicas per pool (omit a pool to leave it unchanged). The simulator
    clamps to [min_replicas, max_replicas] and the GPU budget, counts every change as one
    scaling action, and records it. ``restarts`` (optional, may be absent) returns replica
    names to restart one at a time (a leak finding recommends a rolling restart, not scaling).
    """

    name: str
    interval_s: float

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]: ...


class StaticPolicy:
    """Fixed size: never changes the replica counts (the baseline every other policy beats)."""

    name = "static"

    def __init__(self, interval_s: float = 30.0, **_: object) -> None:
        self.interval_s = interval_s

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        return {}


# ---------------------------------------------------------------------------------------------
# Profile-derived capacities (what Dynamo gets from its pre-deployment profiling sweep)


def prefill_tokens_per_s(profile, isl: float) -> float:
    """Uncached prompt tokens/s of one prefill engine running full chunks of prompts of ``isl``."""
    pm = profile.prefill
    per_tok = pm.per_token_s + pm.per_token_per_kctx_s * max(isl, 1.0) / 2 / 1000
    return pm.chunk_tokens / (pm.step_base_s + pm.chunk_tokens * per_tok)


def prefill_ttft_s(profile, isl: float) -> float:
    """TTFT of one prompt of ``isl`` uncached tokens on an idle prefill engine."""
    pm = profile.prefill
    chunks = max(1, math.ceil(isl / pm.chunk_tokens))
    return chunks * pm.step_base_s + isl * (pm.per_token_s + pm.per_token_per_kctx_s * isl / 2 / 1000)


def accepted_len(profile) -> float:
    """Expected tokens per decode step: 1 + sum of per-position acceptance (unconditional rates)."""
    return 1.0 + float(sum(profile.spec.acceptance_per_pos)) if profile.spec.num_spec_tokens else 1.0


def decode_step_s(profile, batch: float, ctx: float) -> float:
    dm = profile.decode
    return dm.step_base_s + dm.per_seq_s * batch + dm.per_kctx_s * batch * ctx / 1000


def decode_batch_at_itl(profile, itl_s: float, ctx: float) -> float:
    """Largest per-engine batch whose ITL (step / accepted length) meets ``itl_s``, within KV."""
    dm = profile.decode
    alen = accepted_len(profile)
    slope = dm.per_seq_s + dm.per_kctx_s * ctx / 1000
    b = (itl_s * alen - dm.step_base_s) / slope if slope > 0 else dm.max_num_seqs
    kv_b = profile.kv.decode_capacity_tokens / max(ctx, 1.0)
    return max(0.0, min(b, kv_b, dm.max_num_seqs))


def guard_prior(profile, isl: float = 8000.0, ctx: float = 12000.0) -> ProfilePrior:
    """Profile numbers the guard starts from (it keeps learning online)."""
    dm = profile.decode
    return ProfilePrior(prefill_tokens_per_s=prefill_tokens_per_s(profile, isl),
                        decode_step_base_s=dm.step_base_s,
                        decode_step_per_request_s=dm.per_seq_s + dm.per_kctx_s * ctx / 1000)


def _total(view, metric, matchers, window, now, suffix: str = "") -> float | None:
    r = view.increase(sample_name(metric, suffix), matchers, window, now, ())
    return sum(r.values()) if r else None


def _inst(view, metric, matchers, now) -> float | None:
    r = view.instant(sample_name(metric), matchers, now)
    return sum(r.values()) if r else None


def _mean(view, metric, matchers, window, now) -> float | None:
    s = _total(view, metric, matchers, window, now, "_sum")
    n = _total(view, metric, matchers, window, now, "_count")
    return s / n if s is not None and n else None


CLIENT_PD = {"pool": c.Pool.CLIENT.value, "route": c.Route.PD.value}


def client_ttft_mean(view, window, now) -> float | None:
    """Mean TTFT as the client sees it (the P/D proxy's client scope), None without one: what
    Dynamo's planner reads from its frontend."""
    return _mean(view, c.CLIENT_TTFT, CLIENT_PD, window, now)


# ---------------------------------------------------------------------------------------------


class QueuePolicy:
    """KEDA threshold on waiting requests (vLLM production-stack tutorial: threshold 5, cooldown 360 s)."""

    name = "queue"

    def __init__(self, interval_s: float = 15.0, threshold: float = 5.0, cooldown_s: float = 360.0,
                 **_: object) -> None:
        self.interval_s = interval_s
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._last: dict[str, float] = {}

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        out: dict[str, int] = {}
        if obs.view is None:
            return out
        for pool, st in obs.pools.items():
            waiting = _inst(obs.view, c.REQUESTS_WAITING, {"pool": pool}, now)
            if waiting is None:
                continue  # no metric, no scaling (HPA semantics)
            desired = max(st.min_replicas, math.ceil(waiting / self.threshold))
            cooled = now - self._last.get(pool, -math.inf) >= self.cooldown_s
            if desired > st.current or (desired < st.current and cooled):
                out[pool] = desired
                self._last[pool] = now
        return out


class PlannerPolicy:
    """Dynamo-planner-style baseline (see module docstring). Reads capacities from the profile."""

    name = "planner"

    def __init__(self, interval_s: float = 5.0, throughput_interval_s: float = 180.0, sensitivity: float = 0.9,
                 mode: str = "both", **_: object) -> None:
        if mode not in ("both", "throughput", "load"):
            raise ValueError("planner mode is 'both', 'throughput' or 'load'")
        self.mode = mode
        self.interval_s = interval_s if mode != "throughput" else min(interval_s, 15.0)
        self.throughput_interval_s = throughput_interval_s
        self.sensitivity = sensitivity
        self._next_throughput = -math.inf
        self._targets: dict[str, int] = {}

    def _throughput(self, now: float, obs: Observation) -> None:
        view, prof, w = obs.view, obs.profile, self.throughput_interval_s
        pre = {"pool": "prefill"}
        dec = {"pool": "decode"}
        n_req = _total(view, c.REQUEST_PREFILL, pre, w, now, "_count")
        prompt = _total(view, c.PROMPT_TOKENS, pre, w, now)
        computed = _total(view, c.PROMPT_TOKENS, {**pre, "source": "computed"}, w, now)
        gen = _total(view, c.GENERATION_TOKENS, dec, w, now)
        n_dec = _total(view, c.REQUEST_DECODE, dec, w, now, "_count")
        if not n_req or not prompt:
            return
        isl = prompt / n_req
        hit = 1.0 - (computed or 0.0) / prompt
        osl = gen / n_dec if gen and n_dec else 300.0
        # prefill: correction = observed / expected TTFT, applied as min(1, corr) like Dynamo; the
        # observed TTFT is the client's (Dynamo reads it at its frontend) where a client scope exists
        ttft = (client_ttft_mean(view, w, now) or _mean(view, c.REQUEST_TTFT, pre, w, now)
                or _mean(view, c.REQUEST_TTFT, {}, w, now))
        p_corr = (ttft / prefill_ttft_s(prof, isl * (1 - hit))) if ttft else 1.0
        demand = n_req / w * isl * (1 - hit) * min(1.0, p_corr)
        num_p = math.ceil(demand / prefill_tokens_per_s(prof, isl))
        # decode: correction = observed / expected ITL at the observed batch and context
        ctx = isl + osl / 2
        running = _inst(view, c.REQUESTS_RUNNING, dec, now) or 0.0
        n_d_now = max(obs.pools["decode"].ready, 1)
        tpot = _mean(view, c.REQUEST_TPOT, dec, w, now)
        expected_itl = decode_step_s(prof, running / n_d_now, ctx) / accepted_len(prof)
        d_corr = (tpot / expected_itl) if tpot and expected_itl > 0 else 1.0
        itl_target = obs.slo_tpot_s / max(d_corr, 1e-3)
        b = decode_batch_at_itl(prof, itl_target, ctx)
        per_engine_tps = b / itl_target if b > 0 else 0.0
        dec_demand = (n_dec or n_req) / w * osl
        num_d = math.ceil(dec_demand / per_engine_tps) if per_engine_tps > 0 else obs.pools["decode"].current + 1
        self._targets = {"prefill": max(1, num_p), "decode": max(1, num_d)}

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        if obs.view is None or obs.profile is None:
            return {}
        if any(st.starting or st.draining for st in obs.pools.values()):
            return {}  # nothing new while a scaling is in progress
        out: dict[str, int] = {}
        if self.mode != "load" and now >= self._next_throughput:
            self._next_throughput = now + self.throughput_interval_s
            self._throughput(now, obs)
            for pool, n in self._targets.items():
                if pool in obs.pools and n != obs.pools[pool].current:
                    out[pool] = n
            if out:
                return out
        if self.mode != "throughput":
            out.update(self._load_loop(now, obs))
        return out

    def _load_loop(self, now: float, obs: Observation) -> dict[str, int]:
        """Live per-engine state: up by one when every engine misses its target, down by one when
        N-1 engines would still meet it at load x N/(N-1) (with the sensitivity margin)."""
        view, prof, out = obs.view, obs.profile, {}
        w, by = 60.0, ("engine",)
        st = obs.pools.get("prefill")
        if st is not None and st.ready:
            s = view.increase(sample_name(c.REQUEST_TTFT, "_sum"), {"pool": "prefill"}, w, now, by)
            n = view.increase(sample_name(c.REQUEST_TTFT, "_count"), {"pool": "prefill"}, w, now, by)
            # per engine TTFT as the client would see it: the engine's own plus what the client
            # scope shows beyond the prefill engines (hand-off, decode's first step, proxy), if any
            client = client_ttft_mean(view, w, now)
            engine = _mean(view, c.REQUEST_TTFT, {"pool": "prefill"}, w, now)
            extra = max(0.0, client - engine) if client is not None and engine is not None else 0.0
            ttft = [s[k] / n[k] + extra for k in n if n[k] > 0 and k in s]
            if ttft and len(ttft) >= st.ready and all(x > obs.slo_ttft_s for x in ttft):
                out["prefill"] = st.current + 1
            elif ttft and st.ready > 1 and max(ttft) * st.ready / (st.ready - 1) < obs.slo_ttft_s * self.sensitivity:
                # TTFT taken as growing linearly with the load per engine
                out["prefill"] = st.current - 1
        st = obs.pools.get("decode")
        if st is not None and st.ready:
            s = view.increase(sample_name(c.REQUEST_TPOT, "_sum"), {"pool": "decode"}, w, now, by)
            n = view.increase(sample_name(c.REQUEST_TPOT, "_count"), {"pool": "decode"}, w, now, by)
            itl = [s[k] / n[k] for k in n if n[k] > 0 and k in s]
            running = view.instant(sample_name(c.REQUESTS_RUNNING), {"pool": "decode"}, now)
            if itl and len(itl) >= st.ready and all(x > obs.slo_tpot_s for x in itl):
                out["decode"] = st.current + 1
            elif itl and running and st.ready > 1:
                b = sum(running.values()) / st.ready
                ctx = 12000.0
                grow = decode_step_s(prof, b * st.ready / (st.ready - 1), ctx) / decode_step_s(prof, b, ctx)
                if max(itl) * grow < obs.slo_tpot_s * self.sensitivity:
                    out["decode"] = st.current - 1
        return out


class KedaHpaPolicy:
    """KEDA on queue length with the HPA it creates, at Kubernetes' defaults (``keda-hpa``).

    As production-stack's KEDA tutorial deploys it: a Prometheus trigger on
    ``vllm:num_requests_waiting`` per pool with an ``AverageValue`` target of ``threshold`` (5)
    waiting requests per replica, KEDA polling every ``polling_s`` (30 s, KEDA's default
    ``pollingInterval``), the HPA syncing every 15 s with HPA's defaults: External metric with an
    AverageValue target -> desired = ceil(total / target), held when the usage ratio
    total / (target x current) is within the 10% tolerance; scale-up at most max(double, +4) per
    15 s; scale-down to the highest recommendation of the last 300 s (the default scale-down
    stabilisation window). KEDA's ``cooldownPeriod`` only governs scaling to zero, so with
    ``minReplicaCount`` >= 1 it never applies."""

    name = "keda-hpa"

    def __init__(self, interval_s: float = 15.0, threshold: float = 5.0, tolerance: float = 0.1,
                 stabilization_down_s: float = 300.0, polling_s: float = 30.0, **_: object) -> None:
        self.interval_s = interval_s
        self.threshold = threshold
        self.tolerance = tolerance
        self.stabilization_down_s = stabilization_down_s
        self.polling_s = polling_s
        self._metric: dict[str, tuple[float, float]] = {}  # pool -> (polled at, value)
        self._recs: dict[str, list[tuple[float, int]]] = {}

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        out: dict[str, int] = {}
        if obs.view is None:
            return out
        for pool, st in obs.pools.items():
            polled = self._metric.get(pool)
            if polled is None or now - polled[0] >= self.polling_s - 1e-6:
                waiting = _inst(obs.view, c.REQUESTS_WAITING, {"pool": pool}, now)
                if waiting is None:
                    continue  # no metric, no scaling (HPA semantics)
                polled = self._metric[pool] = (now, waiting)
            total, cur = polled[1], max(st.current, 1)
            ratio = total / (self.threshold * cur)
            rec = cur if abs(ratio - 1.0) <= self.tolerance else math.ceil(total / self.threshold)
            rec = max(st.min_replicas, min(st.max_replicas, rec))
            recs = self._recs.setdefault(pool, [])
            recs.append((now, rec))
            while recs and recs[0][0] < now - self.stabilization_down_s:
                recs.pop(0)
            desired = rec
            if rec < cur:
                desired = min(cur, max(r for _, r in recs))  # stabilised scale-down
            elif rec > cur:
                desired = min(rec, max(2 * cur, cur + 4))
            if desired != st.current:
                out[pool] = desired
        return out


class SloKedaPolicy:
    """llm-d's SLO-aware KEDA law (``slo-keda``), per pool (P/D is "future work" in llm-d: each
    pool gets its own ScaledObject on its own latency).

    Signal: s_raw = p90 latency / target over 1-minute bucket rates (prefill: the client's TTFT
    where a client scope exists, else the prefill engines'; decode: TPOT), the guide's
    max(TTFT/target, TPOT/target) restricted to the pool's own SLO; no traffic -> 0; clamped at 2
    and averaged over 45 s. Law: above the dead band (s > 0.55) desired = ceil(ready x s / 0.55),
    proportional like HPA; below it (s < 0.40) one replica fewer; in between, hold. Replicas still
    warming up are credited: the target is compared with ready + starting, so capacity already
    ordered is not ordered again. The HPA KEDA creates keeps its default 300 s scale-down
    stabilisation."""

    name = "slo-keda"

    def __init__(self, interval_s: float = 15.0, high: float = 0.55, low: float = 0.40, clamp: float = 2.0,
                 smooth_s: float = 45.0, stabilization_down_s: float = 300.0, **_: object) -> None:
        self.interval_s = interval_s
        self.high, self.low, self.clamp, self.smooth_s = high, low, clamp, smooth_s
        self.stabilization_down_s = stabilization_down_s
        self._sig: dict[str, list[tuple[float, float]]] = {}
        self._recs: dict[str, list[tuple[float, int]]] = {}

    def _raw(self, obs: Observation, pool: str, now: float) -> float:
        view = obs.view
        if pool == "prefill":
            q = view.histogram_quantile(0.9, sample_name(c.CLIENT_TTFT, "_bucket"), CLIENT_PD, 60.0, now, ())
            vals = [v for v in q.values() if not math.isnan(v)] if q else []
            if not vals:
                q = view.histogram_quantile(0.9, sample_name(c.REQUEST_TTFT, "_bucket"), {"pool": "prefill"}, 60.0,
                                            now, ())
                vals = [v for v in q.values() if not math.isnan(v)] if q else []
            target = obs.slo_ttft_s
        else:
            q = view.histogram_quantile(0.9, sample_name(c.REQUEST_TPOT, "_bucket"), {"pool": "decode"}, 60.0,
                                        now, ())
            vals = [v for v in q.values() if not math.isnan(v)] if q else []
            target = obs.slo_tpot_s
        return min(self.clamp, vals[0] / target) if vals else 0.0

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        out: dict[str, int] = {}
        if obs.view is None:
            return out
        for pool, st in obs.pools.items():
            sig = self._sig.setdefault(pool, [])
            sig.append((now, self._raw(obs, pool, now)))
            while sig and sig[0][0] < now - self.smooth_s:
                sig.pop(0)
            s = sum(v for _, v in sig) / len(sig)
            ready = max(st.ready, 1)
            if s > self.high:
                rec = max(st.current, math.ceil(ready * s / self.high))  # warming replicas credited
            elif s < self.low:
                rec = st.current - 1
            else:
                rec = st.current
            rec = max(st.min_replicas, min(st.max_replicas, rec))
            recs = self._recs.setdefault(pool, [])
            recs.append((now, rec))
            while recs and recs[0][0] < now - self.stabilization_down_s:
                recs.pop(0)
            desired = rec if rec >= st.current else min(st.current, max(r for _, r in recs))
            if desired != st.current:
                out[pool] = desired
        return out


DECISION_NUMBERS = ("raw_desired", "utilization", "demand_uncached_tokens_per_s", "ttft_tail_s", "tpot_tail_s",
                    "concurrency_forecast", "batch_limit", "accepted_len", "tpot_at_empty_batch_s",
                    "upstream_gain", "break_even_s", "lull_s", "lull_needed_s", "queue_tail_s", "long_busy_share",
                    "capacity_tokens_per_s_per_replica", "target_utilization", "backlog_tokens_per_s",
                    "replicas_holding_backlog", "batch_at_n_minus_1", "idle_at_n_minus_1", "concurrency",
                    "batch_limit_tpot", "batch_limit_kv", "tpot_predicted_s", "cold_cache_tokens_per_s",
                    "head_of_line_risk_at_n_minus_1", "utilization_at_n_minus_1")


class GuardPolicy:
    """The advisor, driven by the simulator: same code as the guard service's evaluator."""

    name = "guard"

    def __init__(self, interval_s: float = 15.0, config: dict | None = None, **_: object) -> None:
        self.interval_s = interval_s
        self._cfg_overrides = dict(config or {})
        self.advisor: Advisor | None = None
        self.restarted: set[str] = set()
        self._pending_restarts: list[str] = []
        # (seconds since the first decision, prefill desired, decode desired, prefill raw, decode raw)
        self.recommended: list[tuple[float, int, int, int, int]] = []
        self.decisions: list[dict] = []
        self._last_reasons: dict[str, tuple[str, ...]] = {}
        self._t0: float | None = None

    def _build(self, obs: Observation) -> Advisor:
        pools = {p: PoolLimits(min_replicas=st.min_replicas, max_replicas=st.max_replicas,
                               gpus_per_replica=st.gpus_per_replica) for p, st in obs.pools.items()}
        data = {"interval_s": self.interval_s, "gpu_budget": obs.gpu_budget, "pools": pools}
        if obs.profile is not None:
            data["profile"] = guard_prior(obs.profile)
            data["warmup_s"] = 120.0
            data["cold_start_s"] = float(getattr(obs.profile, "cold_start_s", 0.0) or 0.0) or None
        data.update(self._cfg_overrides)
        cfg = AdvisorConfig.model_validate(data)
        return Advisor(cfg, model=obs.model, slo_ttft_s=obs.slo_ttft_s, slo_tpot_s=obs.slo_tpot_s)

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        if self.advisor is None:
            self.advisor = self._build(obs)
        counts = {p: (st.ready, st.starting) for p, st in obs.pools.items()}
        decs, restarts = self.advisor.step(obs.view, now, counts, obs.findings)
        if self._t0 is None:
            self._t0 = now - obs.extra.get("sim_now", 0.0) if obs.extra else now
        for pool, dec in decs.items():  # the decision log: every action and every change of reasons
            key = (pool, dec.direction, tuple(dec.reasons))
            if dec.direction != "none" or self._last_reasons.get(pool) != key[2]:
                self.decisions.append({"t": now - self._t0, "pool": pool, "current": dec.current,
                                       "desired": dec.desired, "direction": dec.direction,
                                       "reasons": list(dec.reasons), "confidence": round(dec.confidence, 2),
                                       "numbers": {k: dec.numbers[k] for k in DECISION_NUMBERS
                                                   if k in dec.numbers}})
                self._last_reasons[pool] = key[2]
        del self.decisions[:-2000]
        if "prefill" in decs and "decode" in decs:
            p, d = decs["prefill"], decs["decode"]
            self.recommended.append((now - self._t0, p.desired, d.desired,
                                     int(p.numbers.get("raw_desired", p.desired)),
                                     int(d.numbers.get("raw_desired", d.desired))))
        for r in restarts:
            replica = r.replica
            if replica and replica not in self.restarted:
                self.restarted.add(replica)
                self._pending_restarts.append(replica)
                st = obs.pools.get(r.pool)
                cur = st.current if st is not None else 0
                # logged as a decision too: a restart is an action, and its reason belongs in the story
                self.decisions.append({"t": now - self._t0, "pool": r.pool, "current": cur, "desired": cur,
                                       "direction": "restart", "replica": replica, "reasons": list(r.reasons),
                                       "confidence": round(r.confidence, 2),
                                       "numbers": {k: r.numbers[k] for k in ("slope_mib_per_h", "eta_s")
                                                   if k in r.numbers}})
        return {p: d.desired for p, d in decs.items() if d.direction != "none"}

    def restarts(self) -> list[str]:
        out, self._pending_restarts = self._pending_restarts, []
        return out


class PlannerThroughputPolicy(PlannerPolicy):
    """Dynamo's planner in throughput mode only: the 180 s throughput loop, profiled capacities,
    constant load predictor (the documented defaults)."""

    name = "planner-throughput"

    def __init__(self, **kw: object) -> None:
        kw.pop("mode", None)
        super().__init__(mode="throughput", **kw)


class PlannerLoadPolicy(PlannerPolicy):
    """Dynamo's planner in load mode only: the 5 s loop on live per-engine latency."""

    name = "planner-load"

    def __init__(self, **kw: object) -> None:
        kw.pop("mode", None)
        super().__init__(mode="load", **kw)


POLICIES: dict[str, Callable[..., Policy]] = {"static": StaticPolicy, "queue": QueuePolicy,
                                              "planner": PlannerPolicy, "keda-hpa": KedaHpaPolicy,
                                              "planner-throughput": PlannerThroughputPolicy,
                                              "planner-load": PlannerLoadPolicy, "slo-keda": SloKedaPolicy,
                                              "guard": GuardPolicy}


def policy_names() -> list[str]:
    """The names ``--policy`` accepts (for help texts and errors)."""
    return sorted(POLICIES)


def get_policy(name: str, **kw: object) -> Policy:
    """The policy called ``name``; a clear error lists the known names otherwise."""
    if name in POLICIES:
        return POLICIES[name](**kw)
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
