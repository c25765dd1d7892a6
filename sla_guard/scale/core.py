"""Replica sizing for the prefill and decode pools: pure functions over numbers.

Prefill answers "how many replicas keep TTFT under the SLA": demand is *uncached* prompt tokens per
second (a prefix-cache hit costs no prefill compute) plus what it takes to drain the backlog, and
each replica is only loaded to a target utilisation because queueing delay, not compute, is what
breaks TTFT. Decode answers "how many replicas keep TPOT under the SLA": the per-replica batch is
capped by the learned ``step_time(batch) / accepted_length`` curve and by KV-cache room.

Every result carries reason codes and the numbers behind them, so a decision can be explained and
audited. The inputs (``PrefillObs`` / ``DecodeObs``) are built by adapters: one over a
``MetricsView`` (the guard) and one over the simulator's state (replay policies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.scale.learn import PrefillCapacity, StepModel
from sla_guard.settings.advisor import AdvisorConfig


@dataclass(frozen=True, slots=True)
class PrefillObs:
    ready: int  # replicas serving
    starting: int  # replicas launched but not serving yet
    uncached_tps: float | None  # computed (not cached) prompt tokens/s over the window, whole pool
    requests_per_s: float | None  # prefills finished per second
    waiting: float | None  # requests waiting, whole pool
    waiting_slope: float | None = None  # requests/s trend of ``waiting``
    ttft_tail_s: float | None = None  # TTFT at the control quantile (p90 default)
    queue_tail_s: float | None = None  # the pool's scheduler-queue time at that quantile (None: not exported)
    # the last tail measured within the stabilisation window, for the scale-down checks while
    # ``ttft_tail_s`` is None (no prefill finished in the window): a tail that stopped being
    # measured is not a tail that recovered
    last_ttft_tail_s: float | None = None
    ttft_slo_s: float = TTFT_SLO_S
    peak_uncached_tps: float | None = None  # highest demand over the stabilisation window
    settled: bool = True  # no replica started within the observation window (its tails are current)
    # share of a ready replica's time spent on prefills that alone take over half the TTFT SLA
    long_busy_share: float | None = None
    # the long-prompt share the N-1 head-of-line check is held to: its peak over the recurrence
    # horizon (long prompts come in bursts further apart than a window; None: the window's)
    hol_busy_share: float | None = None
    demand_slope: float | None = None  # uncached tokens/s per second: the arrival trend
    trend_horizon_s: float = 0.0  # how far the arrival trend is projected (until ordered replicas serve)
    # replicas ordered now serve after a start time: a backlog is sized to drain over a share of it,
    # not over the configured drain horizon alone (30 s of a 600 s cold start orders for a queue
    # that the present replicas have long drained when the new ones serve)
    backlog_horizon_s: float = 0.0
    # seconds until the capacity ordered so far serves (the replicas starting, else one ordered
    # now): the queue keeps growing until then
    serve_in_s: float = 0.0
    # seconds until a replica ordered now serves (its start time): what the ready replicas compute
    # of an old queue before then, beside the arrivals, is not backlog for it
    start_s: float = 0.0
    # requests waiting on each ready replica (empty: unknown, the pool's queue taken as even)
    queues: tuple[float, ...] = ()
    # requests/s by which the prefills not yet finished (waiting + running) are shrinking, <= 0:
    # while they drain the pool computes more than arrives
    drain_slope: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeObs:
    ready: int
    starting: int
    running: float | None  # requests in the running batches, whole pool
    running_slope: float | None = None  # requests/s trend of ``running``
    waiting: float | None = None
    kv_usage: float | None = None  # mean KV-cache usage ratio over ready replicas
    preemptions_per_s: float | None = None
    accepted_len: float = 1.0  # tokens per decode step (1 + accepted/drafts); 1 without spec decode
    tpot_tail_s: float | None = None  # TPOT at the control quantile
    last_tpot_tail_s: float | None = None  # as ``PrefillObs.last_ttft_tail_s``
    tpot_slo_s: float = TPOT_SLO_S
    peak_running: float | None = None  # highest concurrency over the stabilisation window
    settled: bool = True
    # prefill and decode decided together: the throughput prefill is about to add (its backlog
    # and growth, as a ratio to what it serves now, >= 1) reaches decode as new sequences
    upstream_gain: float = 1.0


@dataclass(slots=True)
class Sizing:
    """A raw (pre-guardrail) answer: desired replicas, why, and whether N-1 would still fit."""

    desired: int | None  # None: not enough data, hold
    reasons: list[str] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)
    fits_at_n_minus_1: bool = False
    confidence: float = 0.0
    strong_fit: bool = False  # N-1 fits with twice the margin and the tail is far inside the SLA
    load: float | None = None  # the load the sizing served (prefill: uncached tokens/s; decode: concurrency)
    demand_driven: bool = False  # desired > current because of measured demand (not a tail rule)
    # replicas that what is measured now needs (no trend projected; tails and queues count): a
    # scale-up within the no-reversal span after a scale-down needs this, not a forecast
    desired_now: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillKnobs:
    """Prefill sizing settings: built from the advisor's config (``from_config``), so the core
    never runs values production does not use."""

    target_utilization: float
    drain_horizon_s: float
    forecast_horizon_s: float
    scale_down_margin: float
    # share of arrivals N-1 replicas may leave stuck behind long prefills (the learn quantile's
    # miss budget)
    hol_budget: float
    # whether a queue moves to replicas that start serving (a central queue in the router) or
    # stays on the engine each request was routed to (vLLM's own scheduler queue)
    queue_moves: bool = False
    # highest utilisation at which the SLA was recently seen to hold (None = no evidence yet): N-1
    # may not be asked to run hotter than that or than half the target, whichever is higher
    proven_utilization: float | None = None

    @classmethod
    def from_config(cls, cfg: AdvisorConfig, *, target_utilization: float | None = None,
                    proven_utilization: float | None = None) -> PrefillKnobs:
        """The knobs of ``cfg``; ``target_utilization``: the learned one, else the configured start."""
        return cls(target_utilization=cfg.prefill_target_utilization if target_utilization is None
                   else target_utilization, proven_utilization=proven_utilization,
                   drain_horizon_s=cfg.drain_horizon_s, forecast_horizon_s=cfg.forecast_horizon_s,
                   scale_down_margin=cfg.scale_down_margin, hol_budget=1.0 - cfg.learn_quantile,
                   queue_moves=cfg.queue_moves)


def head_of_line_risk(long_busy_share: float, ready: int, replicas: int) -> float:
    """Chance that an arrival finds every one of ``replicas`` replicas busy with a long prefill,
    when ``ready`` replicas each spend ``long_busy_share`` of their time on one (the same work
    spread over fewer replicas; replicas taken as independent, least-loaded routing).

    Mean utilisation cannot see this: with heavy-tailed prompts, two replicas at 10% busy hold the
    TTFT SLA because a short prompt is routed around a 100k-token one, and one replica at 20% does
    not, since 20% of arrivals then wait seconds behind it."""
    if replicas <= 0:
        return 1.0
    rho = min(1.0, max(0.0, long_busy_share) * ready / replicas)
    return rho ** replicas


@dataclass(frozen=True, slots=True)
class DecodeKnobs:
    """Decode sizing settings: built from the advisor's config (``from_config``); the last two
    are the core's own constants, not settings."""

    tpot_headroom: float
    kv_target_usage: float
    forecast_horizon_s: float
    scale_down_margin: float
    max_batch: float = 1024.0
    tpot_spread_sigma: float | None = None  # learned per-request TPOT spread behind tpot_headroom (None: configured)
    tpot_floor_margin: float = 0.05  # TPOT within this of the empty-batch floor: unreachable by scaling

    @classmethod
    def from_config(cls, cfg: AdvisorConfig) -> DecodeKnobs:
        return cls(tpot_headroom=cfg.decode_tpot_headroom, kv_target_usage=cfg.kv_target_usage,
                   forecast_horizon_s=cfg.forecast_horizon_s, scale_down_margin=cfg.scale_down_margin)


# below this busy share, without a queue and with prompts whose prefill alone takes over half the SLA,
# a TTFT tail is the prompts' own length, not queueing: neither the proportional rule nor the
# utilisation learning act on it
LOAD_TAIL_UTILIZATION = 0.25

# a queue-time tail over this many TTFT SLAs (the prefill pool's share of it, where a client scope
# splits it) is a backlog's, not a wait behind a long prompt or in a burst's queue
BACKLOG_WAIT_SLO = 4.0


def waited_on_backlog(queue_tail_s: float | None, slo_s: float) -> bool:
    """Whether a window's queue-time tail is a backlog's (over ``BACKLOG_WAIT_SLO`` x ``slo_s``):
    waiting behind a long prompt costs the one or two prompts ahead (1.7-3.4 s on the tuning
    suite's step_up/s4), a backlog minutes (35-180 s while step_down/s4's start drained)."""
    return queue_tail_s is not None and queue_tail_s > BACKLOG_WAIT_SLO * slo_s


# an "overwhelming fit" without a latency tail (no request finished in the window yet): N-1 would
# carry at most this share of the load the strong-fit rule allows it
IDLE_SHARE = 0.5


def tail_from_load(utilization: float, target_utilization: float, waiting: float | None, ready: int,
                   long_busy_share: float | None, queue_tail_s: float | None, excess_s: float,
                   held_wait_s: float = math.inf, slo_s: float = math.inf) -> bool:
    """Whether a TTFT tail ``excess_s`` over its budget is load's doing, so that more replicas (the
    proportional rule) or a lower utilisation target (learning) would shorten it.

    A tail at low utilisation with no queue is the prompts' own length (a 100k-token prefill takes
    seconds on an idle replica) or the hand-off: acting on it spirals the pool up for misses no
    replica count removes. So without long prompts (prefills that alone take over half the SLA)
    any tail is load's; with them, a queue (more requests waiting than replicas) or a busy share
    of at least ``LOAD_TAIL_UTILIZATION`` is needed. Where the queue-time histogram is exported,
    a pool under its target utilisation with no queue now shares little of its prefill budget,
    so its queue's tail (same quantile) must also reach the excess. bursty/s0 of the tuning
    suite: a 4.5 s tail with a 9 ms queue p95 at 25% cut the target 0.5 -> 0.23 and prefill grew
    to 16. Above the target the sharing itself may be the load's part, and the queue says nothing.

    A queue wait over ``held_wait_s`` (the backlog horizon, where each engine keeps its own queue)
    was spent on a queue its engine held: replicas ordered now take none of it, and the pool's
    utilisation did not make it (surge_after_quiet/s2: a 160 s tail of requests that had waited up
    to 640 s in one replica's queue took prefill 13 -> 16 after the last arrival). So was a
    backlog's wait (``waited_on_backlog`` against ``slo_s``) once no queue is left: replicas ordered
    now meet none of it (step_down/s5 of the tuning suite: a 137 s tail with one request waiting
    took prefill 7 -> 11 at 13 minutes, for 22 minutes of idle replicas)."""
    if queue_tail_s is not None and queue_tail_s > held_wait_s:
        return False
    if waited_on_backlog(queue_tail_s, slo_s) and (waiting or 0.0) <= max(ready, 1):
        return False
    if not long_busy_share:
        return True
    crowded = (waiting or 0.0) > max(ready, 1)
    if not crowded and queue_tail_s is not None and utilization < target_utilization and queue_tail_s < excess_s:
        return False
    return crowded or utilization >= LOAD_TAIL_UTILIZATION


def _conf(samples: int, need: int) -> float:
    return round(min(1.0, samples / max(need, 1)), 3)


def held_queues(obs: PrefillObs, tokens_per_req: float, ahead: float, capacity: float,
                horizon_s: float, drained: float = 0.0) -> tuple[int, float]:
    """Replicas busy with their own queue for longer than ``horizon_s``, and the backlog (tokens/s
    over the horizon) of the others.

    A request waits on the engine it was routed to: vLLM keeps its own scheduler queue and the
    P/D proxies and routers pick a replica at arrival, so a replica that starts serving takes
    none of today's queue, only new arrivals (the router sends them where less is pending). A
    replica whose queue, with its share of the growth until the ordered capacity serves, takes
    longer than the horizon to drain carries nothing new meanwhile: it counts as busy, and the
    arrivals are sized for the others. Ordering for the queue itself buys replicas that never
    reach it (on the suite's surge, 16 prefill replicas whose 15 new ones idled beside one
    replica's 770 waiting requests). Of the others' queues, ``drained`` tokens per replica are
    computed by their own engines before the ordered capacity serves: only the rest is backlog."""
    ready = max(obs.ready, 1)
    queues = obs.queues or (((obs.waiting or 0.0) / ready,) * obs.ready)
    held, rest = 0, 0.0
    for w in queues:
        tokens = w * tokens_per_req + ahead / ready
        if tokens / capacity > horizon_s:
            held += 1
        else:
            rest += max(0.0, tokens - drained)
    return min(held, obs.ready), rest / horizon_s


def size_prefill(obs: PrefillObs, cap: PrefillCapacity, k: PrefillKnobs) -> Sizing:
    """Replicas = ceil((demand + backlog / drain) / (capacity x target utilisation)).

    Demand is served uncached tokens/s plus queue growth (a growing queue means arrivals exceed
    service) projected over the forecast horizon; TTFT above the SLA with a queue adds one more."""
    if obs.uncached_tps is None or obs.waiting is None:
        return Sizing(None, ["hold_missing_data", "prefill_no_token_or_queue_data"], {})
    if cap.tokens_per_s <= 0:  # learned only from half-busy windows: a light load without a profile
        return Sizing(None, ["hold_missing_data", "prefill_capacity_not_learned"], {})
    n_eff = obs.ready + obs.starting
    rps = obs.requests_per_s or 0.0
    tokens_per_req = obs.uncached_tps / rps if rps > 0 else cap.tokens_per_s * 0.1
    growth = max(0.0, obs.waiting_slope or 0.0) * tokens_per_req
    # the queue the ordered capacity will meet: it keeps growing until that capacity serves, so
    # a surge is ordered for in one step rather than one replica each time the queue is longer
    ahead = growth * obs.serve_in_s
    horizon = max(k.drain_horizon_s, obs.backlog_horizon_s)
    # the arrival trend, projected to when replicas ordered now would serve
    # (at most half the served demand: the ramp-in of a rate window over a step reads as a slope)
    trend = min(max(0.0, obs.demand_slope or 0.0) * obs.trend_horizon_s, 0.5 * obs.uncached_tps)
    # what the ready replicas compute of an old queue before the ordered capacity serves, beside
    # the arrivals and their trend: a queue they clear first is not backlog for replicas ordered
    # now, which would serve an empty queue (step_down/s4 of the tuning suite: 8 replicas ready
    # with 124k tokens/s to spare, 7.8M tokens queued, and 4 more ordered at 11.5 minutes, ready
    # at 22, idle to 33). Only a queue that no longer grows and whose wait is a backlog's: a
    # queue of a few seconds is the early sign of a load that keeps queueing (blind agentic/s811
    # lost 3 points without that), a growing one that of a surge (surge_after_quiet/s4, 0.8)
    fresh = max(0.0, obs.uncached_tps + growth + min(0.0, obs.drain_slope) * tokens_per_req)
    draining = (obs.waiting_slope is not None and obs.waiting_slope <= 0.0
                and waited_on_backlog(obs.queue_tail_s, obs.ttft_slo_s))
    spare = max(0.0, cap.tokens_per_s * obs.ready - fresh - trend) if draining else 0.0
    held = 0
    if k.queue_moves:
        backlog = max(0.0, obs.waiting * tokens_per_req + ahead - spare * obs.start_s) / horizon
    else:
        held, backlog = held_queues(obs, tokens_per_req, ahead, cap.tokens_per_s, horizon,
                                    spare / max(obs.ready, 1) * obs.start_s)
    # a queue draining is work that arrived before: the arrivals are what the pool computes less
    # the drain (blind step_down/s810 of the tuning-more workloads: after an overloaded start the
    # pool computed 142k tokens/s against 70k arriving while the old replicas emptied their
    # queues, and prefill was ordered 6 -> 9 for it). The growth is the waiting queue's:
    # orders for the running queue's growth came after the bursts that made it (tuning suite
    # GPU-hours +4.9 %, bursty/s0-s4 +10-29 %). The scale-down check keeps the computed peak.
    arrivals = fresh
    if held:
        # a replica holding its queue computes that queue, not arrivals, once new replicas take
        # them: the arrivals are what the pool computes plus the queue's change, signed (a queue
        # draining is work that arrived before)
        arrivals = max(0.0, obs.uncached_tps + (obs.waiting_slope or 0.0) * tokens_per_req)
    demand = arrivals + trend
    per_replica = cap.tokens_per_s * k.target_utilization
    need = held + (demand + backlog) / per_replica
    desired = max(1, math.ceil(need - 1e-9))
    desired_now = max(1, math.ceil(held + (arrivals + backlog) / per_replica - 1e-9))
    reasons: list[str] = []
    nums = {
        "demand_uncached_tokens_per_s": round(demand, 1),
        "backlog_tokens_per_s": round(backlog, 1),
        "capacity_tokens_per_s_per_replica": round(cap.tokens_per_s, 1),
        "target_utilization": k.target_utilization,
        "utilization": round(demand / (cap.tokens_per_s * max(obs.ready, 1)), 3),
        "waiting": obs.waiting,
        "replicas_needed": round(need, 3),
        "demand_trend_tokens_per_s": round(trend, 1),
        "backlog_ahead_tokens": round(ahead, 1),
        "queue_drain_tokens_per_s": round(-min(0.0, obs.drain_slope) * tokens_per_req, 1),
        "replicas_holding_backlog": held,
        "spare_tokens_per_s": round(spare, 1),
    }
    if obs.ttft_tail_s is not None:
        nums["ttft_tail_s"] = round(obs.ttft_tail_s, 4)
        nums["ttft_slo_s"] = obs.ttft_slo_s
    if obs.queue_tail_s is not None:
        nums["queue_tail_s"] = round(obs.queue_tail_s, 4)
    if obs.long_busy_share is not None:
        nums["long_busy_share"] = round(obs.long_busy_share, 4)
    demand_driven = desired > n_eff
    if desired > n_eff:
        reasons.append("prefill_demand_over_capacity" if backlog < demand * 0.5 and not held else "prefill_backlog")
    over_sla = obs.ttft_tail_s is not None and obs.ttft_tail_s > obs.ttft_slo_s
    held_wait = math.inf if k.queue_moves else horizon
    if over_sla and not tail_from_load(demand / (cap.tokens_per_s * max(obs.ready, 1)), k.target_utilization,
                                       obs.waiting, obs.ready, obs.long_busy_share, obs.queue_tail_s,
                                       obs.ttft_tail_s - obs.ttft_slo_s, held_wait, obs.ttft_slo_s):
        old_wait = obs.queue_tail_s is not None and obs.queue_tail_s > held_wait
        reasons.append("ttft_tail_from_held_queues" if old_wait else "ttft_tail_not_from_load")
        over_sla = False
    if over_sla and held:
        # a tail from queues held by their engines: added replicas take new arrivals (sized
        # above), none of the waiting requests, so the tail is no measure of how many are missing
        reasons.append("ttft_tail_from_held_queues")
        over_sla = False
    if over_sla and obs.starting == 0 and obs.settled:
        # HPA's proportional rule applied to the tail: queueing delay falls roughly with the load
        # per replica, so a tail at 1.6x the SLA asks for 1.6x the replicas (at least one more)
        prop = max(n_eff + 1, math.ceil(n_eff * obs.ttft_tail_s / obs.ttft_slo_s - 1e-9))
        if prop > desired:
            desired = prop
            reasons.append("ttft_over_sla")
        desired_now = max(desired_now, prop)
    # re-predict at N-1: the peak load of the window on the remaining replicas, with headroom;
    # the tests N-1 fails are reasons of their own (``n_minus_1_*``): why the pool is held
    fits = strong = False
    blocked: list[str] = []
    if n_eff > 1:
        peak = max(demand, obs.peak_uncached_tps or 0.0)
        util_n1 = (peak + backlog) / (cap.tokens_per_s * (n_eff - 1))
        nums["utilization_at_n_minus_1"] = round(util_n1, 3)
        # an empty pool (nothing computed, nothing waiting) has no tail to keep: the last one is
        # only held against it while requests are still being served
        serving = (obs.uncached_tps or 0.0) > 0 or obs.waiting > 0
        tail = obs.ttft_tail_s if obs.ttft_tail_s is not None else obs.last_ttft_tail_s if serving else None
        tail_ok = tail is None or tail <= (1 - k.scale_down_margin) * obs.ttft_slo_s
        proven = math.inf
        if k.proven_utilization is not None:
            nums["proven_utilization"] = round(k.proven_utilization, 3)
            proven = max(k.proven_utilization, 0.5 * k.target_utilization)
        busy = util_n1 > k.target_utilization * (1 - k.scale_down_margin)
        blocked = [name for name, failed in (("utilization", busy), ("ttft_tail", not tail_ok),
                                             ("proven_utilization", util_n1 > proven)) if failed]
        fits = not blocked
        strong_util = k.target_utilization * (1 - 2 * k.scale_down_margin)
        # no tail yet (too few prefills finished in the window) is no evidence against N-1 when the
        # load is a small share of what N-1 is sized for: an operator's oversized start on a light
        # load is then given back at once, as the baselines do, not after the break-even window
        idle = tail is None and util_n1 <= IDLE_SHARE * strong_util and obs.waiting <= max(obs.ready, 1)
        strong = util_n1 <= strong_util and (idle or (obs.ttft_tail_s is not None
                                                      and obs.ttft_tail_s <= 0.5 * obs.ttft_slo_s))
        if idle:
            nums["idle_at_n_minus_1"] = 1.0
        if obs.long_busy_share is not None and obs.ready > 0:
            hol = head_of_line_risk(max(obs.long_busy_share, obs.hol_busy_share or 0.0), obs.ready, n_eff - 1)
            nums["head_of_line_risk_at_n_minus_1"] = round(hol, 4)
            if hol > k.hol_budget:
                fits = strong = False
                blocked.append("head_of_line_risk")
    if desired < n_eff:
        reasons.append("prefill_over_provisioned" if fits else "prefill_n_minus_1_would_not_fit")
        reasons += [f"n_minus_1_{b}" for b in blocked]
    if not reasons:
        reasons.append("prefill_steady")
    conf = _conf(cap.samples, 5) if cap.prior <= 0 else max(0.5, _conf(cap.samples, 5))
    return Sizing(desired, reasons, nums, fits, conf, strong and fits, demand + backlog, demand_driven,
                  desired_now)


def tpot_unreachable(obs: DecodeObs, model: StepModel, k: DecodeKnobs) -> bool:
    """True when even an empty batch's step, per accepted token, misses the TPOT target: a step
    costs at least ``a`` however few sequences it carries, so more replicas cannot bring TPOT
    under the SLA. It happens when speculative acceptance collapses (mean accepted length
    2.97 -> 1.8 puts a 36 ms step at 20 ms per token): scaling on TPOT would then add replicas
    each cooldown up to the maximum, for a TPOT that stays over the SLA. The acceptance-drift
    finding names the cause; decode is still sized for concurrency and KV. Within
    ``tpot_floor_margin`` (5%) of that floor counts as unreachable too: the batch that would meet
    the SLA is a handful of sequences per replica, and each replica buys under 5% of TPOT."""
    return model.a > 0 and tpot_floor(obs, model) * (1 + k.tpot_floor_margin) >= obs.tpot_slo_s


def tpot_floor(obs: DecodeObs, model: StepModel) -> float:
    """TPOT of an empty batch: the fixed step cost per accepted token."""
    return model.a / max(obs.accepted_len, 1.0)


def decode_batch_limit(obs: DecodeObs, model: StepModel, k: DecodeKnobs) -> tuple[float, dict[str, float]]:
    """Largest per-replica batch that keeps TPOT and KV usage under target, and its parts."""
    target = obs.tpot_slo_s * k.tpot_headroom
    if model.a > 0 and tpot_floor(obs, model) * (1 + k.tpot_floor_margin) >= target:
        target = obs.tpot_slo_s  # the headroom is given up before the SLA is
    if tpot_unreachable(obs, model, k):
        b_tpot = float("inf")  # no useful batch meets it: TPOT gives no replica count (see size_decode)
    else:
        b_tpot = model.batch_for_step_time(target * max(obs.accepted_len, 1.0))
    if obs.tpot_tail_s is not None and obs.ready > 0 and obs.running and obs.tpot_tail_s <= obs.tpot_slo_s:
        # the tail meets the SLA at today's batch: that batch is proven, whatever a fit that
        # learned from a narrow range of small batches (1-5 sequences, 3% step jitter) says
        proven = obs.running / obs.ready
        if proven > b_tpot:
            b_tpot = proven
    nums = {"batch_limit_tpot": round(min(b_tpot, k.max_batch), 2)}
    b_kv = float("inf")
    if obs.kv_usage is not None and obs.kv_usage > 0.05 and obs.running and obs.ready > 0:
        per_replica = obs.running / obs.ready
        b_kv = per_replica * k.kv_target_usage / obs.kv_usage
        nums["batch_limit_kv"] = round(b_kv, 2)
    return max(1.0, min(b_tpot, b_kv, k.max_batch)), nums


def size_decode(obs: DecodeObs, model: StepModel, k: DecodeKnobs) -> Sizing:
    """Replicas = ceil(forecast concurrency / per-replica batch limit); KV preemptions and TPOT
    over the SLA force one more."""
    if obs.running is None:
        return Sizing(None, ["hold_missing_data", "decode_no_running_data"], {})
    if model.samples == 0 and model.a <= 0:
        return Sizing(None, ["hold_missing_data", "decode_step_time_not_learned"], {})
    n_eff = obs.ready + obs.starting
    # the concurrency trend, projected over the forecast horizon; at most half the batch, as
    # prefill's arrival trend is held to half the served demand (a burst's ramp-in read as a slope
    # ordered decode for 1.6x the burst's peak: blind bursty/s807, forecast 267 against a peak of 167)
    trend = min(max(0.0, obs.running_slope or 0.0) * k.forecast_horizon_s, 0.5 * obs.running)
    conc = (obs.running + (obs.waiting or 0.0)) * max(1.0, obs.upstream_gain) + trend
    limit, nums = decode_batch_limit(obs, model, k)
    need = conc / limit
    desired = max(1, math.ceil(need - 1e-9))
    desired_now = max(1, math.ceil((obs.running + (obs.waiting or 0.0)) / limit - 1e-9))
    per_replica_now = obs.running / max(obs.ready, 1)
    nums.update({
        "concurrency": round(obs.running, 2),
        "concurrency_forecast": round(conc, 2),
        "upstream_gain": round(obs.upstream_gain, 3),
        "batch_limit": round(limit, 2),
        "accepted_len": round(obs.accepted_len, 3),
        "step_base_s": round(model.a, 6),
        "step_per_request_s": round(model.b, 8),
        "tpot_predicted_s": round(model.step_time(per_replica_now) / max(obs.accepted_len, 1.0), 5),
        "replicas_needed": round(need, 3),
        "tpot_headroom": round(k.tpot_headroom, 4),
    })
    if k.tpot_spread_sigma is not None:
        nums["tpot_spread_sigma"] = round(k.tpot_spread_sigma, 4)
    reasons: list[str] = []
    unreachable = tpot_unreachable(obs, model, k)
    demand_driven = desired > n_eff
    if desired > n_eff:
        limiter = "kv" if nums.get("batch_limit_kv", math.inf) < nums["batch_limit_tpot"] else "tpot"
        reasons.append(f"decode_concurrency_over_{limiter}_limit")
    pressure = (obs.preemptions_per_s or 0.0) > 0
    over_sla = obs.tpot_tail_s is not None and obs.tpot_tail_s > obs.tpot_slo_s and not unreachable
    if obs.tpot_tail_s is not None:
        nums["tpot_tail_s"] = round(obs.tpot_tail_s, 5)
        nums["tpot_slo_s"] = obs.tpot_slo_s
    if (pressure or over_sla) and desired <= n_eff and obs.starting == 0 and obs.settled:
        desired = n_eff + 1
        reasons.append("kv_preemptions" if pressure else "tpot_over_sla")
        desired_now = desired
    fits = strong = False
    blocked: list[str] = []
    if n_eff > 1:
        at_n1 = (max(obs.running, obs.peak_running or 0.0) + (obs.waiting or 0.0)) / (n_eff - 1)
        nums["batch_at_n_minus_1"] = round(at_n1, 2)
        serving = (obs.running or 0.0) > 0 or (obs.waiting or 0.0) > 0
        tail = obs.tpot_tail_s if obs.tpot_tail_s is not None else obs.last_tpot_tail_s if serving else None
        tail_ok = tail is None or tail <= (1 - k.scale_down_margin) * obs.tpot_slo_s
        blocked = [name for name, failed in (("batch", at_n1 > limit * (1 - k.scale_down_margin)),
                                             ("kv_preemptions", pressure), ("tpot_tail", not tail_ok)) if failed]
        fits = not blocked
        strong_batch = limit * (1 - 2 * k.scale_down_margin)
        idle = tail is None and at_n1 <= IDLE_SHARE * strong_batch and not pressure
        strong = at_n1 <= strong_batch and (idle or (obs.tpot_tail_s is not None
                                                     and obs.tpot_tail_s <= 0.8 * obs.tpot_slo_s))
        if idle:
            nums["idle_at_n_minus_1"] = 1.0
    if desired < n_eff:
        reasons.append("decode_over_provisioned" if fits else "decode_n_minus_1_would_not_fit")
        reasons += [f"n_minus_1_{b}" for b in blocked]
    if unreachable:
        nums["tpot_at_empty_batch_s"] = round(tpot_floor(obs, model), 5)
        reasons.append("decode_tpot_unreachable_by_scaling")
    if not reasons:
        reasons.append("decode_steady")
    conf = _conf(model.samples, 10) if model.samples else 0.5
    return Sizing(desired, reasons, nums, fits, conf, strong and fits, conc, demand_driven, desired_now)
