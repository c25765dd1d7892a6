"""The advisor: per model, every tick, desired prefill and decode replicas with reasons.

``Advisor`` holds the learned state (prefill capacity, decode step-time model), the short
histories trends are computed from, and the guardrails' memory. It reads only a ``MetricsView``
plus the replica counts a controller knows (ready / starting), so the guard service and the
replay policy run the very same code. The sizing and guardrail math lives in ``core`` and
``guardrails``; this module wires it and decides which samples are admissible for learning
(warm engines only: a replica younger than ``warmup_s`` teaches nothing, which is what makes
other planners over-scale right after a cold start).

Where the deployment exports a client scope (a P/D proxy's ``pool="client"`` series), TTFT is
judged as the client sees it and blamed by stage (:func:`prefill_ttft_share`, ``_size_decode``);
otherwise the prefill pool's own TTFT is used, as before.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from exporters import contract as c
from sla_guard.defaults import TPOT_SLO_S, TTFT_SLO_S
from sla_guard.model import Finding, MetricsView, PoolRecommendation
from sla_guard.scale.core import (
    DecodeKnobs,
    DecodeObs,
    PrefillKnobs,
    PrefillObs,
    Sizing,
    size_decode,
    size_prefill,
    tail_from_load,
    waited_on_backlog,
)
from sla_guard.scale.guardrails import Decision, PoolMemory, Rails, apply_budget, decide, without_data
from sla_guard.scale.learn import (
    PrefillCapacity,
    StepModel,
    TpotSpread,
    adapt_target_utilization,
    ewma,
    record,
    slope,
    tail_within_bucket,
    tpot_headroom,
    update_prefill_capacity,
    update_step_model,
    update_tpot_spread,
)
from sla_guard.scale.observe import ClientReading, PoolReading, Reader, sample_name
from sla_guard.settings.advisor import AdvisorConfig

POOLS = ("prefill", "decode")
# history bounds: points kept at least 2 x span / (bound - margin) apart (learn.record), so a
# bounded history covers its span at any decision interval
PEAK_POINTS = 1024
PROVEN_POINTS = 512
PROVEN_SPAN_S = 3600.0  # how long a utilisation that held the SLA is evidence for N-1
TREND_POINTS = 64


@dataclass(slots=True)
class _Learned:
    prefill: PrefillCapacity
    decode: StepModel
    first_seen: dict[str, float] = field(default_factory=dict)  # engine -> first time seen
    initial_engines: set[str] | None = None
    waiting_hist: dict[str, deque] = field(default_factory=dict)
    running_hist: deque = field(default_factory=lambda: deque(maxlen=TREND_POINTS))
    tpot_spread: TpotSpread = field(default_factory=TpotSpread)
    tpot_spread_t: float | None = None  # when the last window joined it (windows do not overlap)


def leak_restarts(findings: list[Finding] | tuple[Finding, ...], model: str) -> list[PoolRecommendation]:
    """An open leak finding recommends a rolling restart of that replica, never scaling: more
    replicas would not stop the leaking one from running out of memory."""
    out = []
    for f in findings:
        if f.detector != "leak" or not f.open:
            continue
        if model not in ("", "*") and f.labels.get("model", model) != model:
            continue
        pool = f.labels.get("pool", "")
        replica = f.labels.get("engine") or f.labels.get("instance") or f.labels.get("process", "")
        numbers = {k: float(v) for k, v in f.details.items() if isinstance(v, int | float)}
        out.append(PoolRecommendation(model=f.labels.get("model", model), pool=pool, current=0, desired=0,
                                      reasons=["leak_rolling_restart"],
                                      confidence=1.0 if f.severity == "critical" else 0.7,
                                      numbers=numbers, action="rolling_restart", replica=replica,
                                      finding=f.key))
    return out


@dataclass(frozen=True, slots=True)
class PrefillTTFT:
    """The TTFT signal the prefill pool is sized on: its tails and the SLA budget they are held to."""

    tail_s: float | None
    learn_s: float | None
    budget_s: float
    numbers: dict[str, float] = field(default_factory=dict)


def prefill_ttft_share(client: ClientReading, slo_s: float) -> PrefillTTFT:
    """The client's TTFT as the prefill pool's signal: the client's tails minus the mean time
    spent outside prefill (decode first leg: KV hand-off, decode queue, first step; the router's
    own time), held to the SLA minus that same time. So the prefill pool is over its budget exactly
    when the client's tail is over the SLA and only for the part it can change, and the
    proportional rule scales on the prefill part alone. The budget never drops below half the SLA:
    when the decode side takes more than that, the decode side is responsible (``_size_decode``),
    and prefill acts only if its own part exceeds half the SLA too. Without stage series (a router
    exporting TTFT only) the whole client TTFT is the prefill pool's."""
    nums: dict[str, float] = {"ttft_from_client": 1.0}
    if client.ttft_tail_s is not None:
        nums["client_ttft_tail_s"] = round(client.ttft_tail_s, 4)
    other = client.outside_prefill_s
    if other is None:
        return PrefillTTFT(client.ttft_tail_s, client.ttft_learn_s, slo_s, nums)
    nums["ttft_outside_prefill_s"] = round(other, 4)

    def part(v: float | None) -> float | None:
        return None if v is None else max(0.0, v - other)

    return PrefillTTFT(part(client.ttft_tail_s), part(client.ttft_learn_s), max(slo_s - other, 0.5 * slo_s), nums)


class Advisor:
    """Stateful advisor for one model. ``step`` is called once per tick."""

    def __init__(self, cfg: AdvisorConfig | None = None, model: str = "*", slo_ttft_s: float = TTFT_SLO_S,
                 slo_tpot_s: float = TPOT_SLO_S) -> None:
        self.cfg = cfg or AdvisorConfig()
        self.model = model
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        prof = self.cfg.profile
        self.learned = _Learned(
            prefill=PrefillCapacity(prof.prefill_tokens_per_s or 0.0, 0, prof.prefill_tokens_per_s or 0.0),
            decode=StepModel(a=prof.decode_step_base_s or 0.0, b=prof.decode_step_per_request_s or 0.0),
        )
        self.reader = Reader(self.cfg.window_s, self.cfg.tail_quantile, self.cfg.learn_quantile,
                             long_prefill_s=slo_ttft_s / 2)
        self.memory = {p: PoolMemory() for p in POOLS}
        self.last: dict[str, Decision] = {}
        self.pending: dict[str, tuple[int, float]] = {}
        self.pending_timeout_s = 1800.0
        # pool -> replicas of its target the scheduler cannot place, as the actuator read them this
        # tick (the evaluator sets it; absent: not known, the ordered ones count as starting)
        self.unschedulable: dict[str, int] = {}
        self._accepted_len: float | None = None
        self.u_target = self.cfg.prefill_target_utilization
        self._proven: deque[tuple[float, float]] = deque(maxlen=PROVEN_POINTS)  # (t, utilisation that met the SLA)
        self._longest: dict[str, float] = {}  # pool -> longest request seen (s)
        self._grace_t: dict[str, float] = {}
        self._last_tail: dict[str, tuple[float, float]] = {}  # pool -> (t, last measured tail)

    # -- learning ------------------------------------------------------------------------------
    def _warm(self, engine: str, now: float) -> bool:
        L = self.learned
        if L.initial_engines is not None and engine in L.initial_engines:
            return True
        return now - L.first_seen.get(engine, now) >= self.cfg.warmup_s

    def _learn(self, now: float, readings: dict[str, PoolReading], excluded: dict[str, int]) -> None:
        L = self.learned
        for r in readings.values():
            for e in r.engines:
                L.first_seen.setdefault(e, now)
        if L.initial_engines is None:
            L.initial_engines = {e for r in readings.values() for e in r.engines}
        for e, s in readings["prefill"].per_engine.items():
            if not self._warm(e, now):
                excluded["prefill"] += 1
                continue
            if s.computed_tps and s.busy_share is not None:
                L.prefill = update_prefill_capacity(L.prefill, s.computed_tps, s.busy_share)
        for e, s in readings["decode"].per_engine.items():
            if not self._warm(e, now):
                excluded["decode"] += 1
                continue
            step = s.step_s
            if step is None and s.tpot_mean_s and s.running_min is not None and s.running_min >= 1:
                step = s.tpot_mean_s * (s.accepted_len or 1.0)
            if step and s.running_mean and s.running_mean >= 1:
                L.decode = update_step_model(L.decode, s.running_mean, step)
        # the TPOT spread behind decode's headroom, one window at a time (windows do not overlap)
        d = readings["decode"]
        mean, n = d.totals.get("tpot_mean_s"), d.totals.get("tpot_requests") or 0.0
        if mean and n >= 20 and d.tpot_le and (L.tpot_spread_t is None or now - L.tpot_spread_t >= self.cfg.window_s):
            L.tpot_spread = update_tpot_spread(L.tpot_spread, d.tpot_le, mean)
            L.tpot_spread_t = now

    # -- one tick ------------------------------------------------------------------------------
    def step(self, view: MetricsView | None, now: float, counts: dict[str, tuple[int, int]],
             findings: tuple[Finding, ...] | list[Finding] = ()) -> tuple[dict[str, Decision],
                                                                        list[PoolRecommendation]]:
        """Decisions per pool (``counts``: pool -> (ready, starting)) and leak restarts."""
        cfg = self.cfg
        restarts = leak_restarts(findings, self.model)
        if view is None:
            decs = {p: decide(p, now, *counts.get(p, (0, 0)), Sizing(None, ["hold_missing_data"]),
                              self.memory[p], self._rails(p)) for p in POOLS}
            self.last = decs
            return decs, restarts
        readings = {p: self.reader.read(view, self.model, p, now) for p in POOLS}
        client = self.reader.read_client(view, self.model, now)
        known = {p: (*counts[p], 0) if p in counts else self._counts_from_view(p, readings[p], now) for p in POOLS}
        counts = {p: (k[0], k[1]) for p, k in known.items()}
        stuck = {p: k[2] for p, k in known.items()}
        excluded = dict.fromkeys(POOLS, 0)
        self._learn(now, readings, excluded)
        pre = self._size_prefill(now, readings["prefill"], counts["prefill"], client)
        gain, growing = self._upstream(pre, counts["prefill"])
        dec = self._size_decode(now, readings["decode"], counts["decode"], client, gain)
        if growing and dec.desired is not None and (dec.fits_at_n_minus_1 or dec.strong_fit):
            # one pool's backlog is the other's arrivals: decode does not give capacity back
            # while prefill is growing (its extra throughput is about to reach decode)
            dec.fits_at_n_minus_1 = dec.strong_fit = False
            dec.reasons.append("hold_prefill_growing")
        sizings = {"prefill": pre, "decode": dec}
        decs: dict[str, Decision] = {}
        for p in POOLS:
            ready, starting = counts[p]
            sz = sizings[p]
            if not readings[p].engines and ready > 0:
                sz = Sizing(None, ["hold_stale_data"], sz.numbers)
            down = readings[p].down
            if down and sz.desired is not None and sz.desired < ready + max(starting, len(down)):
                sz = Sizing(None, ["hold_missing_data", _down_reason(down, ready)], sz.numbers)
            if stuck[p]:
                sz = self._hold_unschedulable(p, sz, ready + starting, stuck[p], starting)
            rails = self._rails(p)
            d = decide(p, now, ready, starting, sz, self.memory[p], rails)
            if stuck[p] and "hold_replicas_unschedulable" not in d.reasons:
                d.reasons.append("replicas_unschedulable")
            d.numbers["cold_samples_excluded"] = excluded[p]
            d.numbers["break_even_s"] = round(rails.stabilization_down_s, 1)
            grace = self._drain_grace(view, p, now)
            if grace is not None:
                d.numbers["drain_grace_s"] = grace
            decs[p] = d
        pn = sizings["prefill"].numbers
        pressure = {"prefill": (pn.get("ttft_tail_s", 0.0) / (pn.get("ttft_slo_s") or self.slo_ttft_s)),
                    "decode": (sizings["decode"].numbers.get("tpot_tail_s", 0.0) / self.slo_tpot_s)}
        gpus = {p: cfg.limits(p).gpus_per_replica for p in POOLS}
        decs = apply_budget(decs, gpus, cfg.gpu_budget, pressure)
        for p, d in decs.items():  # after the guardrails and the budget: the number served
            (ready, starting), down = counts[p], readings[p].down
            if down and not without_data(d.reasons) and d.desired < ready + max(starting, len(down)):
                decs[p] = Decision(p, d.current, d.current, "none", ["hold_missing_data", _down_reason(down, ready)],
                                   d.numbers, 0.0, "hold")
        self.last = decs
        return decs, restarts

    def expect(self, pool: str, replicas: int, now: float) -> None:
        """Record that ``pool`` was asked for ``replicas`` (active mode): until they show up in the
        metrics (or ``pending_timeout_s`` passes) the missing ones count as starting, so the
        advisor does not ask twice for the same capacity; those the actuator reports
        ``unschedulable`` do not (they are not coming)."""
        self.pending[pool] = (replicas, now)

    def _counts_from_view(self, pool: str, r: PoolReading, now: float) -> tuple[int, int, int]:
        """(ready, starting, unschedulable) of ``pool``. Ordered replicas the scheduler cannot
        place are not starting: counted so, the pool looked 1 ready + 3 starting (current 4) for
        30 minutes while it served on 1. The order is kept while they stay unplaceable (past
        ``pending_timeout_s`` too), so the hold on ordering more holds as long as they do."""
        ready = len(r.engines)
        want, since = self.pending.get(pool, (0, -1e18))
        stuck = min(self.unschedulable.get(pool, 0), max(0, want - ready))
        late = now - since > self.pending_timeout_s
        if ready >= want or (late and not stuck):
            self.pending.pop(pool, None)
            return ready, 0, 0
        return ready, 0 if late else want - ready - stuck, stuck

    def _hold_unschedulable(self, pool: str, sz: Sizing, current: int, stuck: int, starting: int) -> Sizing:
        """With ordered replicas of ``pool`` unschedulable, ordering more cannot help (the cluster
        has no room for the ones ordered): a sizing above ready + starting holds
        (``hold_replicas_unschedulable``). A start cut short by finding them so is no start time."""
        mem = self.memory[pool]
        if not starting:
            mem.starting_since = None
        nums = {**sz.numbers, "unschedulable": stuck, "ordered": self.pending.get(pool, (0, 0.0))[0]}
        if sz.desired is None or sz.desired <= current:
            sz.numbers = nums
            return sz
        nums["sized_desired"] = sz.desired
        return Sizing(None, ["hold_replicas_unschedulable", *sz.reasons], nums)

    def _drain_grace(self, view: MetricsView, pool: str, now: float) -> float | None:
        """Seconds a replica of ``pool`` needs to drain before it may stop: the longest request
        seen (p99.9 of the end-to-end histogram over the last hour, the highest value kept) x 1.5
        plus 60 s for the last KV pull. For ``terminationGracePeriodSeconds`` and the actuator's
        check before a scale-down."""
        if now - self._grace_t.get(pool, -1e18) >= 300.0:  # an hour-long quantile: every 5 minutes
            self._grace_t[pool] = now
            q = view.histogram_quantile(0.999, sample_name(c.REQUEST_E2E, "_bucket"),
                                        {"pool": pool} if self.model in ("", "*") else
                                        {"pool": pool, "model": self.model}, 3600.0, now, ())
            vals = [v for v in (q or {}).values() if v == v and v != float("inf")]
            if vals:
                self._longest[pool] = max(self._longest.get(pool, 0.0), max(vals))
        longest = self._longest.get(pool)
        return round(longest * 1.5 + 60.0, 1) if longest else None

    def start_time(self, pool: str) -> float:
        """Expected time from ordering a replica of ``pool`` to its serving: the observed one,
        or the configured ``cold_start_s`` when longer (0 when neither is known)."""
        return max(self.memory[pool].start_s, self.cfg.cold_start_s or 0.0)

    def _serve_in(self, pool: str, now: float, starting: int) -> float:
        """Seconds until the capacity ordered for ``pool`` serves: what is left of the start of the
        replicas starting (from the first tick they were), else a whole start time."""
        since = self.memory[pool].starting_since
        if starting > 0 and since is not None:
            return max(0.0, self.start_time(pool) - (now - since))
        return self.start_time(pool)

    def _rails(self, pool: str) -> Rails:
        lim, cfg = self.cfg.limits(pool), self.cfg
        # Break-even of a scale-down: a replica given back saves its GPUs for as long as the lull
        # lasts, and coming back costs a cold start of GPUs that serve nothing plus the SLO risk
        # of a load that returns before they serve. A lull that has already lasted a start time
        # plus a cooldown is, by the usual "expected remaining length ~ length so far" of
        # heavy-tailed lulls, expected to last that long again: past that point the saving
        # outweighs the cost of coming back. So the scale-down window (a lull is a window in
        # which no tick wanted the current size, judged against the window's peak load) is at
        # least the start time plus the cooldown, never a fixed 300 s.
        window = max(cfg.stabilization_down_s, self.start_time(pool) + cfg.cooldown_s
                     if self.start_time(pool) > 0 else 0.0)
        return Rails(min_replicas=lim.min_replicas, max_replicas=lim.max_replicas, max_step_up=lim.max_step_up,
                     max_step_down=lim.max_step_down, stabilization_down_s=window,
                     stabilization_up_s=cfg.stabilization_up_s, cooldown_s=cfg.cooldown_s,
                     min_evidence_s=cfg.min_evidence_s, failed_size_memory_s=cfg.failed_size_memory_s,
                     failed_size_load_ratio=cfg.failed_size_load_ratio,
                     recurrence_horizon_s=cfg.recurrence_horizon_s, no_reversal_s=cfg.no_reversal_s)

    def _peak(self, key: str, now: float, value: float | None, span_s: float | None = None) -> float | None:
        """Highest value over ``span_s`` (default: the stabilisation window; bounded history)."""
        hist = self.learned.waiting_hist.setdefault(key, deque(maxlen=PEAK_POINTS))
        if span_s is None:
            span_s = self._rails("prefill" if key.startswith("prefill") else "decode").stabilization_down_s
        if value is not None:
            record(hist, now, value, 2 * span_s / (PEAK_POINTS - 32), max)
        vals = [v for t, v in hist if t >= now - span_s]
        return max(vals) if vals else None

    def _long_busy_recent(self, now: float, work: float | None, ready: int, *, queued: bool = False) -> float | None:
        """The long-prompt share per ready replica that the N-1 head-of-line check is held to: the
        most long-prefill work (``_long_work``) seen over the recurrence horizon, spread over
        today's ready replicas. Long prompts come in bursts further apart than the stabilisation
        window, and a shrink judged between two bursts meets the next one with one replica fewer
        to route around it.

        A window whose requests ``queued`` is not remembered: a replica working through a queue
        is busy all the time and shares each step among the prompts it admitted, so every prefill
        takes long whatever its length (step_down/s4 of the tuning suite: a share of 1.0 on 8-12
        replicas draining an overloaded start's queue held 11 replicas at 7-15 % utilisation for
        the last 45 minutes of the run)."""
        return self._long_work("prefill_long_work", now, None if queued else work, ready,
                               self.cfg.recurrence_horizon_s)

    def _long_work(self, key: str, now: float, work: float | None, ready: int,
                   span_s: float | None = None) -> float | None:
        """Highest long-prefill ``work`` (replicas kept busy, as the reader measures it) over
        ``span_s`` (default: the stabilisation window), per replica ready now. The work is
        remembered, not a share of the replicas it was read over: on the tick new replicas come up
        the work is still the old ones' (step_up/s5 of the tuning suite: a share of 1.0 on the 2
        replicas that served the window, read as 6 replicas of long prompts once 6 were ready, held
        the head-of-line risk at 1.0 and 6 replicas at 20-30 % utilisation to the end of the run)."""
        peak = self._peak(key, now, work, span_s)
        return peak / ready if peak is not None and ready > 0 else None

    def _queued(self, t: dict, ready: int) -> bool:
        """Whether the window's requests waited behind a backlog (``core.waited_on_backlog``
        against the TTFT SLA; without a queue-time tail, more requests waiting than replicas now)."""
        if t.get("queue_tail_s") is not None:
            return waited_on_backlog(t["queue_tail_s"], self.slo_ttft_s)
        return (t.get("waiting") or 0.0) > max(ready, 1)

    def _remember_proven(self, now: float, utilization: float) -> None:
        """A utilisation at which the SLA held, kept over ``PROVEN_SPAN_S`` at any interval (a
        bound of 512 ticks kept 43 minutes of the hour at 5 s ticks)."""
        record(self._proven, now, utilization, 2 * PROVEN_SPAN_S / (PROVEN_POINTS - 32), max)

    def _proven_utilization(self, now: float) -> float | None:
        """The highest utilisation the SLA was seen to hold at over the last ``PROVEN_SPAN_S``."""
        recent = [u for ts, u in self._proven if ts >= now - PROVEN_SPAN_S]
        return max(recent) if recent else None

    def _trend(self, hist: deque, now: float, value: float | None, span_s: float) -> float | None:
        if value is None:
            return None
        record(hist, now, value, 2 * span_s / (TREND_POINTS - 16))
        if hist[0][0] > now - span_s + 1e-6:
            return None  # no trend before a whole span has been watched (a fill is not a trend)
        pts = [(t, v) for t, v in hist if t >= now - span_s]
        return slope([t for t, _ in pts], [v for _, v in pts])

    def _recent_tail(self, pool: str, now: float, tail: float | None) -> float | None:
        """The last tail of ``pool`` measured within its stabilisation window (``tail`` when
        measured now): for the scale-down checks, which must not read a window without finished
        requests as a tail that recovered."""
        if tail is not None:
            self._last_tail[pool] = (now, tail)
            return tail
        t, v = self._last_tail.get(pool, (-1e18, 0.0))
        return v if now - t <= self._rails(pool).stabilization_down_s else None

    def _settled(self, pool: str, now: float, starting: int) -> bool:
        """True once no replica of ``pool`` has been starting for a whole observation window, so
        the window's tails describe the current size, not the one before the scale-up."""
        last = self.memory[pool].last_starting_t  # as of the previous tick: decide() updates it
        return starting == 0 and (last is None or now - last >= self.cfg.window_s)

    def _demand_tps(self, r: PoolReading, now: float) -> tuple[float | None, float]:
        """Uncached prompt tokens/s as prefill demand, and the cold-cache work left out of it.

        A replica that began serving less than a start time ago has an empty prefix cache: the
        sessions routed to it recompute their whole history until their next turns have filled
        it. That work is real but passing, and replicas ordered for it serve after it has gone
        (step_down/s5 of the tuning suite: the pool computed 164k tokens/s against 35k arriving
        while seven new replicas filled their caches, and prefill was ordered to 16). So a young
        replica's prompt tokens count at the miss ratio of the replicas already warm; with no warm
        replica (a fresh deployment) the computed rate stands."""
        total = r.totals.get("uncached_tps")
        if total is None:
            return None, 0.0
        L, young_s = self.learned, self.start_time("prefill")
        young, warm = [], []
        for e, s in r.per_engine.items():
            if s.computed_tps is None or not s.prompt_tps:
                continue
            fresh = e not in (L.initial_engines or ()) and now - L.first_seen.get(e, now) < young_s
            (young if fresh else warm).append(s)
        if not young or not warm:
            return total, 0.0
        miss = sum(s.computed_tps for s in warm) / sum(s.prompt_tps for s in warm)
        cold = sum(max(0.0, s.computed_tps - miss * s.prompt_tps) for s in young)
        return max(0.0, total - cold), cold

    def _size_prefill(self, now: float, r: PoolReading, counts: tuple[int, int],
                      client: ClientReading | None = None) -> Sizing:
        t, cfg = r.totals, self.cfg
        settled = self._settled("prefill", now, counts[1])
        if client is not None:
            sig = prefill_ttft_share(client, self.slo_ttft_s)
        else:  # no client scope: the prefill pool's own TTFT, against the whole SLA
            sig = PrefillTTFT(t.get("ttft_tail_s"), t.get("ttft_learn_s"), self.slo_ttft_s)
        hist = self.learned.waiting_hist.setdefault("prefill", deque(maxlen=TREND_POINTS))
        wslope = self._trend(hist, now, t.get("waiting"), max(4 * cfg.interval_s, 60.0))
        uhist = self.learned.waiting_hist.setdefault("prefill_unfinished", deque(maxlen=TREND_POINTS))
        uslope = self._trend(uhist, now, r.unfinished, max(4 * cfg.interval_s, 60.0))
        dhist = self.learned.waiting_hist.setdefault("prefill_demand_trend", deque(maxlen=TREND_POINTS))
        demand_tps, cold_tps = self._demand_tps(r, now)
        dslope = self._trend(dhist, now, demand_tps, 300.0)
        obs = PrefillObs(ready=counts[0], starting=counts[1], uncached_tps=demand_tps,
                         requests_per_s=t.get("requests_per_s"), waiting=t.get("waiting"), waiting_slope=wslope,
                         ttft_tail_s=sig.tail_s, ttft_slo_s=sig.budget_s, queue_tail_s=t.get("queue_tail_s"),
                         last_ttft_tail_s=self._recent_tail("prefill", now, sig.tail_s),
                         peak_uncached_tps=self._peak("prefill_demand", now, demand_tps),
                         settled=settled,
                         # long prompts come in bursts: the window's share can be 0 between two
                         long_busy_share=self._long_work("prefill_long_busy", now, t.get("long_busy_replicas"),
                                                         counts[0]),
                         hol_busy_share=self._long_busy_recent(now, t.get("long_busy_replicas"), counts[0],
                                                               queued=self._queued(t, counts[0])),
                         # half the start time: a linear trend is not trusted further than that
                         demand_slope=dslope, trend_horizon_s=0.25 * self.start_time("prefill"),
                         backlog_horizon_s=0.25 * self.start_time("prefill"),
                         serve_in_s=self._serve_in("prefill", now, counts[1]), start_s=self.start_time("prefill"),
                         queues=tuple(r.waiting_by_engine.values()), drain_slope=min(0.0, uslope or 0.0))
        cap = self.learned.prefill
        # learn the utilisation target only against a learned capacity (a profile prior can be far
        # off) and only while the pool is settled (no replica starting); against all the work the
        # replicas did, cold-cache recompute included, since that is what they queued behind
        raw_tps = t.get("uncached_tps")
        if self.cfg.adapt_utilization and cap.samples >= 3 and counts[0] > 0 and raw_tps is not None \
                and settled:
            u_obs = raw_tps / (cap.tokens_per_s * counts[0])
            # only a tail that load made teaches the target (the same test as the proportional rule's)
            held_wait = None if cfg.queue_moves else max(cfg.drain_horizon_s, obs.backlog_horizon_s)
            if sig.learn_s is None or tail_from_load(u_obs, self.u_target, obs.waiting, counts[0], obs.long_busy_share,
                                                     t.get("queue_learn_s"), sig.learn_s - sig.budget_s,
                                                     held_wait or math.inf, sig.budget_s):
                self.u_target = adapt_target_utilization(self.u_target, u_obs, sig.learn_s, sig.budget_s)
            learn_tail = sig.learn_s
            if learn_tail is not None and learn_tail <= 0.8 * sig.budget_s:
                self._remember_proven(now, u_obs)
        proven = self._proven_utilization(now)
        knobs = PrefillKnobs.from_config(cfg, target_utilization=self.u_target, proven_utilization=proven)
        s = size_prefill(obs, cap, knobs)
        if cold_tps > 0:
            s.numbers["cold_cache_tokens_per_s"] = round(cold_tps, 1)
        if t.get("prefix_hit_ratio") is not None:
            s.numbers["prefix_hit_ratio"] = round(float(t["prefix_hit_ratio"]), 4)
        s.numbers.update(sig.numbers)
        return s

    @staticmethod
    def _upstream(pre: Sizing, counts: tuple[int, int]) -> tuple[float, bool]:
        """What prefill's sizing means for decode: the ratio of the throughput prefill is about
        to serve (demand + backlog) to what it serves now (>= 1, at most 3), when prefill is
        growing for demand; and whether prefill is growing (ordering or starting replicas)."""
        n = pre.numbers
        growing = counts[1] > 0 or (pre.desired is not None and pre.desired > sum(counts))
        served = n.get("demand_uncached_tokens_per_s", 0.0) - n.get("demand_trend_tokens_per_s", 0.0)
        if not pre.demand_driven or served <= 0:
            return 1.0, growing
        ahead = n.get("demand_uncached_tokens_per_s", 0.0) + n.get("backlog_tokens_per_s", 0.0)
        return min(3.0, max(1.0, ahead / served)), growing

    def _size_decode(self, now: float, r: PoolReading, counts: tuple[int, int],
                     client: ClientReading | None = None, upstream_gain: float = 1.0) -> Sizing:
        t, cfg = r.totals, self.cfg
        settled = self._settled("decode", now, counts[1])
        rslope = self._trend(self.learned.running_hist, now, t.get("running"), max(8 * cfg.interval_s, 120.0))
        if t.get("accepted_len_seen"):
            self._accepted_len = ewma(self._accepted_len, t["accepted_len"], 0.3)
        tail = t.get("tpot_tail_s")
        sigma = self.learned.tpot_spread.sigma() if cfg.learn_tpot_spread else None
        if tail is not None and sigma is not None and r.tpot_le and t.get("tpot_mean_s"):
            tail = tail_within_bucket(r.tpot_le, t["tpot_mean_s"], sigma, cfg.tail_quantile) or tail
        obs = DecodeObs(ready=counts[0], starting=counts[1], running=t.get("running"), running_slope=rslope,
                        waiting=t.get("waiting"), kv_usage=t.get("kv_usage"),
                        preemptions_per_s=t.get("preemptions_per_s"), accepted_len=self._accepted_len or 1.0,
                        tpot_tail_s=tail, tpot_slo_s=self.slo_tpot_s,
                        last_tpot_tail_s=self._recent_tail("decode", now, tail),
                        peak_running=self._peak("decode_running", now, t.get("running")), settled=settled,
                        upstream_gain=upstream_gain)
        model = self.learned.decode
        prior_b = cfg.profile.decode_step_per_request_s
        if prior_b and model.b > 3 * prior_b:
            # a slope fitted on a narrow range of small batches (where per-request acceptance
            # variance, not the batch, moves TPOT) can come out many times the profiled one; the
            # prior bounds it at 3x (the profile is a starting point, not a ceiling elsewhere)
            model = replace(model, b=3 * prior_b)
        s = size_decode(obs, model, self._decode_knobs())
        if cfg.profile.decode_step_base_s and s.desired is not None:
            # a profiled step model is a prior as prefill's capacity is: the first few fitted
            # samples do not make the advisor less sure than it was with none
            s.confidence = max(0.5, s.confidence)
        if client is not None and s.desired is not None:
            self._decode_ttft_blame(s, client, obs)
        return s

    def _decode_knobs(self) -> DecodeKnobs:
        """The decode knobs with the TPOT headroom learned (``_learn``): the mean TPOT at which the learning
        quantile of requests (p95) meets the SLA, from how far single requests' TPOT scatter
        around the mean (``TpotSpread``). The configured headroom (0.85) stands until enough
        requests were seen, and the learned one is held within [0.5, 0.95] (the step-time fit's
        own error). Blind bursty/s807: per-request TPOT 1.07-1.10x the mean at p95, so a fixed
        0.85 held decode to 55-60 sequences a replica where 85 met the SLA, and decode ran 4-5
        replicas where a static 2 reached a higher attainment."""
        knobs, cfg = DecodeKnobs.from_config(self.cfg), self.cfg
        sigma = self.learned.tpot_spread.sigma() if cfg.learn_tpot_spread else None
        if sigma is None:
            return knobs
        return replace(knobs, tpot_headroom=min(0.95, max(0.5, tpot_headroom(sigma, cfg.learn_quantile))),
                       tpot_spread_sigma=sigma)

    def _decode_ttft_blame(self, s: Sizing, client: ClientReading, obs: DecodeObs) -> None:
        """The client's TTFT tail over the SLA with the decode first leg (KV hand-off, decode
        queue, first step) slower than the prefill leg at the same quantile: the decode side is
        where the time goes, so decode may not shrink and, once settled, grows by one (as for a
        TPOT breach). The prefill pool is not blamed for that part (``prefill_ttft_share``)."""
        tail, d_leg, p_leg = client.ttft_tail_s, client.decode_first_leg_tail_s, client.prefill_leg_tail_s
        if tail is None or d_leg is None or p_leg is None:
            return
        s.numbers["decode_first_leg_tail_s"] = round(d_leg, 4)
        s.numbers["prefill_leg_tail_s"] = round(p_leg, 4)
        if tail <= self.slo_ttft_s or d_leg <= p_leg:
            return
        s.fits_at_n_minus_1 = s.strong_fit = False
        n_eff = obs.ready + obs.starting
        if s.desired <= n_eff and obs.starting == 0 and obs.settled:
            s.desired = s.desired_now = n_eff + 1  # a measured tail: it may undo a scale-down
            s.reasons = [x for x in s.reasons if x not in ("decode_steady", "decode_over_provisioned",
                                                           "decode_n_minus_1_would_not_fit")
                         and not x.startswith("n_minus_1_")]
            s.reasons.append("client_ttft_over_sla_decode_leg")


def _down_reason(down: list[str], ready: int) -> str:
    """Why a pool with targets down gets no number below its real size: the view shows only the
    replicas still scraped, and their load. Sized on that, 3 of 4 prefill targets failing their
    scrapes (a network policy, an overloaded metrics port) served desired 2 to KEDA while 5
    replicas were busy: a scale-down on a partial view. A number at or above ready + down is
    still served (the visible load alone already needs it)."""
    return (f"{len(down)} of {ready + len(down)} targets of the pool down ({', '.join(down[:3])}): "
            "the view shows only part of the pool, so no number below its real size")


def to_recommendation(model: str, d: Decision) -> PoolRecommendation:
    return PoolRecommendation(model=model, pool=d.pool, current=d.current, desired=d.desired, reasons=d.reasons,
                              confidence=d.confidence, numbers=d.numbers, action=d.action)
