"""Guardrails between a raw sizing and a decision: pure functions over explicit state.

Order matters and mirrors what makes autoscalers safe in practice: hold on missing data; count
starting replicas as present (no double scaling); scale up fast but by at most ``max_step_up``;
scale down slowly: only to the highest desire seen over the stabilisation window (before a full
window exists, only on an overwhelming fit with ``min_evidence_s`` of data), only when the
remaining replicas are predicted to fit, never within the window after a scale-up (no reversal),
only after the cooldown, one step at a time, and not back to a size that recently proved too
small for the same load; clamp to min/max; then share the GPU budget.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sla_guard.scale.core import Sizing
from sla_guard.scale.learn import record

WINDOW_POINTS = 512  # bounds of the memories over the stabilisation window and the recurrence horizon
LONG_POINTS = 2048


@dataclass(frozen=True, slots=True)
class Rails:
    min_replicas: int = 1
    max_replicas: int = 16
    max_step_up: int = 2
    max_step_down: int = 1
    stabilization_down_s: float = 300.0
    stabilization_up_s: float = 0.0
    cooldown_s: float = 60.0
    min_evidence_s: float = 60.0
    failed_size_memory_s: float = 21600.0
    failed_size_load_ratio: float = 0.8
    recurrence_horizon_s: float = 7200.0  # how far back lulls that ended are remembered
    no_reversal_s: float = 600.0  # a scale-down must not be undone within this long


@dataclass(slots=True)
class PoolMemory:
    """What the guardrails remember about one pool between decisions (bounded)."""

    history: list[tuple[float, int]] = field(default_factory=list)  # (t, raw desired)
    last_action_t: float | None = None
    last_up_t: float | None = None
    last_down_t: float | None = None
    first_t: float | None = None  # first decision: no scale-down before a full window was seen
    last_starting_t: float | None = None  # last time replicas were still starting
    starting_since: float | None = None  # first tick of the current start-up
    last_order_t: float | None = None  # last tick at which more replicas were starting than before
    starting_seen: int = 0  # replicas starting at the last tick
    start_s: float = 0.0  # observed time from ordering replicas to their serving (cold start)
    loads: list[tuple[float, float]] = field(default_factory=list)  # (t, load) over the window
    last_down_to: int | None = None
    last_down_load: float | None = None  # peak load the last scale-down was judged against
    failed: dict[int, tuple[float, float]] = field(default_factory=dict)  # size -> (t, load it failed at)
    raw_long: list[tuple[float, int]] = field(default_factory=list)  # (t, raw desired) over the recurrence horizon

    def merge(self, other: PoolMemory) -> None:
        """Fold ``other`` (a state file restored into a running guard) into this memory: the later
        of each clock and the histories of both in time order, so neither a scale-down nor an
        order of either guard is forgotten (the file's older clocks replaced this guard's, and the
        next scale-down step came inside the cooldown). Replicas starting now are this guard's."""
        self.history = _union(self.history, other.history, WINDOW_POINTS)
        self.loads = _union(self.loads, other.loads, WINDOW_POINTS)
        self.raw_long = _union(self.raw_long, other.raw_long, LONG_POINTS)
        for name in ("last_action_t", "last_up_t", "last_starting_t", "last_order_t"):
            setattr(self, name, later(getattr(self, name), getattr(other, name)))
        if other.last_down_t is not None and (self.last_down_t is None or other.last_down_t > self.last_down_t):
            self.last_down_t, self.last_down_to, self.last_down_load = (other.last_down_t, other.last_down_to,
                                                                        other.last_down_load)
        if other.first_t is not None:  # the earlier: a full window was seen since
            self.first_t = other.first_t if self.first_t is None else min(self.first_t, other.first_t)
        self.start_s = max(self.start_s, other.start_s)
        for size, (t, load) in other.failed.items():
            if size not in self.failed or t > self.failed[size][0]:
                self.failed[size] = (t, load)

    def remember_long(self, t: float, raw: int, horizon_s: float) -> None:
        record(self.raw_long, t, raw, 2 * horizon_s / (LONG_POINTS - 48), max)
        while self.raw_long and self.raw_long[0][0] < t - horizon_s:
            self.raw_long.pop(0)
        del self.raw_long[:-LONG_POINTS]

    def lulls(self, size: int, now: float, min_gap_s: float = 60.0) -> tuple[float, float, bool]:
        """For a pool of ``size`` replicas: how long no tick has wanted more than ``size`` (the
        current lull), the longest earlier lull that ended with the load wanting more again (0
        when none), and whether any tick in the remembered horizon wanted more. A load that came
        back after 25 minutes before is expected to come back after 25 minutes again."""
        need = [t for t, r in self.raw_long if r > size]
        if not need:
            first = self.raw_long[0][0] if self.raw_long else now
            return now - first, 0.0, False
        longest = max((b - a for a, b in itertools.pairwise(need) if b - a > min_gap_s), default=0.0)
        return now - need[-1], longest, True

    def remember(self, t: float, desired: int, horizon_s: float) -> None:
        if self.first_t is None:
            self.first_t = t
        self.history.append((t, desired))
        cutoff = t - horizon_s
        while self.history and self.history[0][0] < cutoff:
            self.history.pop(0)
        # hard bound: it covers a 660 s window down to 1.3 s ticks. Desires are not folded (the
        # stabilisation-up window takes their minimum, the down window their maximum)
        del self.history[:-WINDOW_POINTS]

    def watch_start(self, now: float, starting: int) -> None:
        """Track replicas starting: the last time some were, and how long ordered replicas take to
        serve, kept as the larger of the new observation and half the previous one. The
        observation runs from the last order seen (the last tick at which more replicas were
        starting than the tick before) to the first tick with none starting: the last replica
        ordered is the last to serve. Measured from the first order instead, orders staggered
        over a surge read as one start of their whole span (600 s cold starts ordered over 14
        minutes read as a 24-minute start, and the scale-down window, the break-even, doubled)."""
        if starting > 0:
            self.last_starting_t = now
            if self.starting_since is None:
                self.starting_since = now
            if starting > self.starting_seen:
                self.last_order_t = now
        elif self.starting_since is not None:
            # the first tick of a start-up is an order too, so last_order_t is set whenever starting_since is
            since = self.last_order_t if self.last_order_t is not None else self.starting_since
            self.start_s = max(self.start_s * 0.5, now - since)
            self.starting_since = None
        self.starting_seen = starting

    def peak_load(self, t: float, load: float | None, horizon_s: float) -> float | None:
        """Highest load over the window, ``load`` included (bounded like ``history``)."""
        if load is not None:
            record(self.loads, t, load, 2 * horizon_s / (WINDOW_POINTS - 32), max)
        while self.loads and self.loads[0][0] < t - horizon_s:
            self.loads.pop(0)
        del self.loads[:-WINDOW_POINTS]
        return max(v for _, v in self.loads) if self.loads else None

    def failed_at(self, size: int, now: float, peak: float | None, rails: Rails) -> tuple[int, float] | None:
        """A recent failure of ``size`` or a larger size at a load like ``peak`` (None: none).

        A scale-down that had to be undone (the SLA broke, the pool grew back) is evidence the
        model cannot see: with heavy-tailed prompts a single replica has no second queue to hide
        a 100k-token prompt behind, whatever its mean utilisation says. Without this memory the
        same shrink is retried every stabilisation window and each retry costs a cold start
        of SLA misses (the flapping of the benchmark's half-rate Mooncake replay)."""
        for k, (t, _) in list(self.failed.items()):
            if now - t >= rails.failed_size_memory_s:
                del self.failed[k]
        if peak is None:
            return None
        hits = [(k, load) for k, (_, load) in self.failed.items()
                if k >= size and peak >= rails.failed_size_load_ratio * load]
        return min(hits) if hits else None

    def grew_back(self, size: int, load: float | None, now: float, rails: Rails) -> bool:
        """Record ``size`` as failed when the pool grows back from the size a scale-down chose,
        with no action in between and at about the load that scale-down was judged against (a
        growth because the load grew is not a failure of the size). The failing load is the
        lower of the judged load and the load at which it broke."""
        judged = self.last_down_load
        if self.last_down_to != size or not judged or not _recent(self.last_down_t, now,
                                                                   rails.failed_size_memory_s):
            return False
        if load is not None and load > judged / rails.failed_size_load_ratio:
            return False
        self.failed[size] = (now, judged if load is None else min(judged, load))
        return True


def later(a: float | None, b: float | None) -> float | None:
    """The later of two clocks, either of them unset (None)."""
    return b if a is None else a if b is None else max(a, b)


def _union(a: list[tuple[float, int | float]], b: list[tuple[float, int | float]],
           bound: int) -> list[tuple[float, int | float]]:
    """Two (t, value) histories as one, in time order, each point once, the newest ``bound``."""
    return sorted(dict.fromkeys(map(tuple, [*a, *b])), key=lambda p: p[0])[-bound:]


@dataclass(slots=True)
class Decision:
    pool: str
    current: int  # ready + starting
    desired: int
    direction: str  # "up" | "down" | "none"
    reasons: list[str]
    numbers: dict[str, float]
    confidence: float
    action: str = "scale"  # "scale" | "hold"


def decide(pool: str, now: float, ready: int, starting: int, sizing: Sizing, mem: PoolMemory,
           rails: Rails) -> Decision:
    """Turn a raw sizing into a decision and update ``mem`` when it acts."""
    current = ready + starting
    mem.watch_start(now, starting)
    nums = dict(sizing.numbers)
    nums.update({"ready": ready, "starting": starting})
    reasons = list(sizing.reasons)
    if sizing.desired is None:
        return Decision(pool, current, current, "none", reasons or ["hold_missing_data"], nums, 0.0, "hold")
    raw = min(max(sizing.desired, rails.min_replicas), rails.max_replicas)
    nums["raw_desired"] = sizing.desired
    mem.remember(now, raw, max(rails.stabilization_down_s, rails.stabilization_up_s))
    mem.remember_long(now, raw, rails.recurrence_horizon_s)
    peak = mem.peak_load(now, sizing.load, rails.stabilization_down_s)
    desired = current
    if current < rails.min_replicas:
        desired = rails.min_replicas
        reasons.append("below_min_replicas")
    elif current > rails.max_replicas:
        desired = rails.max_replicas
        reasons.append("above_max_replicas")
    elif raw > current:
        window = [d for t, d in mem.history if t >= now - rails.stabilization_up_s]
        target = min(window) if rails.stabilization_up_s > 0 and window else raw
        if target > current and _recent(mem.last_down_t, now, rails.no_reversal_s) \
                and sizing.desired_now is not None and sizing.desired_now <= current:
            # a forecast (the concurrency or arrival trend, prefill's growth ahead) does not undo
            # a scale-down within the no-reversal span: what is measured now must ask for it
            reasons.append("hold_forecast_within_no_reversal")
        elif target > current:
            # the sizing counts starting replicas as present (n_eff), so a desire above ready +
            # starting is capacity still missing: a surge is met at once, not one replica per
            # cold start. Only the tail rules (which cannot see the starting replicas' effect)
            # wait for them (core: ``settled``).
            if starting > 0 and _recent(mem.last_up_t, now, rails.cooldown_s) and not sizing.demand_driven:
                reasons.append("hold_replicas_starting")
            else:
                desired = min(target, current + rails.max_step_up)
                if desired < target:
                    reasons.append("max_step_up")
    elif raw < current:
        window = [d for t, d in mem.history if t >= now - rails.stabilization_down_s]
        target = max(window) if window else raw
        seen = now - mem.first_t if mem.first_t is not None else 0.0
        # before a full window exists, only an overwhelming fit on enough evidence may shrink the
        # pool (an operator's initial size is not a decision the advisor has to reverse slowly)
        early = sizing.strong_fit and sizing.confidence >= 0.5 and seen >= rails.min_evidence_s
        if target >= current or (seen < rails.stabilization_down_s and not early):
            reasons.append("hold_stabilization_window")
        elif not sizing.fits_at_n_minus_1:
            reasons.append("hold_n_minus_1_would_not_fit")
        elif starting > 0:
            reasons.append("hold_replicas_starting")
        elif _recent(mem.last_up_t, now, rails.stabilization_down_s) or \
                _recent(mem.last_starting_t, now, rails.stabilization_down_s):
            # the window runs from when the added replicas began to serve, not from the order
            reasons.append("hold_no_reversal_within_window")
        elif _recent(mem.last_action_t, now, rails.cooldown_s):
            reasons.append("hold_cooldown")
        else:
            desired = max(target, current - rails.max_step_down, rails.min_replicas)
            # break-even against recurrence: a lull must also outlast the longest recent lull
            # that ended with the load back (plus the no-reversal span), or the replica given back
            # is expected to be ordered again within it
            lull, longest, recent = mem.lulls(desired, now)
            # a load that wanted more than N' within the remembered horizon may come back: the lull
            # at N' must then also outlast the no-reversal span past the break-even (and the
            # longest earlier lull that ended with the load back, plus that span)
            needed = max(longest, rails.stabilization_down_s) + rails.no_reversal_s if recent else 0.0
            nums["lull_s"], nums["lull_needed_s"] = round(lull, 1), round(needed, 1)
            failed = mem.failed_at(desired, now, peak, rails)
            if lull < needed:
                reasons.append("hold_load_recurs")
                desired = current
                failed = None
            if failed is not None:
                nums["failed_size"], nums["failed_size_load"] = failed[0], round(failed[1], 2)
                reasons.append("hold_size_failed_recently")
                desired = current
    direction = "up" if desired > current else "down" if desired < current else "none"
    if direction != "none":
        mem.last_action_t = now
        if direction == "up":
            if mem.grew_back(current, sizing.load, now, rails):
                reasons.append("learned_size_too_small")
            mem.last_up_t = now
            mem.last_down_to = None
        else:
            mem.last_down_t = now
            mem.last_down_to, mem.last_down_load = desired, peak
    return Decision(pool, current, desired, direction, reasons, nums, sizing.confidence,
                    "scale" if direction != "none" else "hold")


# a decision made without a sizing: it holds, and its numbers (desired = current = the replicas
# the view still shows, 0 once the targets are down) are no advice an autoscaler may follow
NO_DATA_REASONS = ("hold_missing_data", "hold_stale_data")


def without_data(reasons) -> bool:
    """Whether a decision (or recommendation) with these reasons had no data to size on."""
    return any(r in NO_DATA_REASONS for r in reasons)


def _recent(t: float | None, now: float, window: float) -> bool:
    return t is not None and now - t < window


def apply_budget(decisions: dict[str, Decision], gpus_per_replica: dict[str, int], budget: int | None,
                 pressure: dict[str, float]) -> dict[str, Decision]:
    """Fit both pools' desired replicas into one GPU budget.

    Growth is granted one replica at a time to the pool under the most SLA pressure (ratio of
    observed latency to its SLA); a pool is never cut below its current size here, since taking
    GPUs away is the scale-down path's job."""
    if budget is None:
        return decisions
    used = sum(d.current * gpus_per_replica.get(p, 1) for p, d in decisions.items())
    want = {p: max(0, d.desired - d.current) for p, d in decisions.items()}
    granted = dict.fromkeys(decisions, 0)
    free = budget - used + sum(max(0, d.current - d.desired) * gpus_per_replica.get(p, 1)
                               for p, d in decisions.items())
    order = sorted(decisions, key=lambda p: -pressure.get(p, 0.0))
    progress = True
    while progress:
        progress = False
        for p in order:
            cost = gpus_per_replica.get(p, 1)
            if granted[p] < want[p] and cost <= free:
                granted[p] += 1
                free -= cost
                progress = True
    for p, d in decisions.items():
        if want[p] > granted[p]:
            d.desired = d.current + granted[p]
            d.reasons.append("gpu_budget_exhausted")
            d.numbers["gpu_budget"] = budget
            if d.desired == d.current:
                d.direction, d.action = "none", "hold"
    return decisions
