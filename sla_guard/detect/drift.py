"""Change detection for rates (spec-decode acceptance, prefix-cache hit rate) and for latency
at comparable load: pure state machines, fed interval by interval; no I/O, no clocks.

Rates: a count-weighted binomial CUSUM (Page 1954). Each interval contributes the binomial
log-likelihood ratio of its (successes x out of n) under the shifted rate p1 versus the baseline
p0, divided by an overdispersion factor phi_i = 1 + n_i * tau^2 / (p0 (1 - p0)) that caps the
evidence one interval can carry when the rate itself jitters between intervals (workload mix).
The alarm threshold h follows from the configured mean time between false alarms (ARL0):
Lorden's bound ARL0 >= e^h steps for an LLR CUSUM gives h = ln(ARL0 / interval * sides * family).
The derivation and its assumptions are in docs/detectors.md.

Latency: TPOT per interval is compared with a baseline for the same load bin (running requests,
log2 bins) learned during warm-up, through a Gaussian-mean CUSUM on the relative increase, so a
busier batch is not called a drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DAY = 86400.0


def threshold_for_arl(arl0_s: float, interval_s: float, sides: int = 1, family: int = 1) -> float:
    """CUSUM threshold h (nats) whose false-alarm mean time is at least ``arl0_s`` for a family
    of ``family`` detectors with ``sides`` one-sided CUSUMs each (rates of false alarms add)."""
    steps = arl0_s / interval_s * max(1, sides) * max(1, family)
    return math.log(max(steps, math.e))


@dataclass(frozen=True, slots=True)
class RateDriftParams:
    interval_s: float = 60.0  # one CUSUM step
    warmup_s: float = 3600.0  # baseline learned over this span
    min_warmup_trials: int = 2000  # and at least this many trials (tokens) in it
    shift: float = 0.05  # design shift (absolute rate) beyond the tolerance band: p1 = p0 - 0.075,
    # a 0.10 drop less the wander a baseline can be off by
    tolerance: float = 0.025  # indifference band: slow wander within +-tolerance is not drift
    sides: str = "both"  # "down" | "up" | "both"
    arl0_s: float = 30 * DAY  # mean time between false alarms, per detector family
    family: int = 1  # detectors sharing the ARL0 budget (e.g. overall + per position)
    min_tau: float = 0.005  # floor on the between-interval jitter of the rate
    lr_lags: int = 10  # autocovariance lags of the long-run jitter variance (Bartlett weights):
    # the request mix outlives one interval, so adjacent intervals' excesses add up in the CUSUM
    resolve_s: float = 1800.0  # recent window whose rate must be back near baseline to resolve

    @property
    def n_sides(self) -> int:
        return 2 if self.sides == "both" else 1

    @property
    def threshold(self) -> float:
        return threshold_for_arl(self.arl0_s, self.interval_s, self.n_sides, self.family)


def long_run_tau2(n: np.ndarray, x: np.ndarray, p0: float, lags: int) -> float:
    """Extra-binomial variance of interval rates (method of moments) as a *long-run* variance:
    the lag-0 excess over binomial noise plus twice the Bartlett-weighted autocovariances of the
    rate residuals up to ``lags`` intervals (binomial noise is independent between intervals, so
    only the jitter contributes there). The CUSUM sums intervals; when the request mix stays
    correlated across interval boundaries the variance of that sum is the long-run one, and the
    lag-0 variance alone understates it (more false alarms than ARL0 promises). Never below the
    lag-0 estimate."""
    n = np.asarray(n, dtype=float)
    r = np.asarray(x, dtype=float) / n - p0
    var0 = float(np.mean(r * r - p0 * (1 - p0) / n))
    acc = 0.0
    for k in range(1, min(lags, len(r) - 1) + 1):
        acc += (1.0 - k / (lags + 1.0)) * float(np.dot(r[:-k], r[k:])) / len(r)
    return max(var0, var0 + 2.0 * acc)


def binomial_llr(x: float, n: float, p0: float, p1: float) -> float:
    """log P(x | n, p1) - log P(x | n, p0)."""
    return x * math.log(p1 / p0) + (n - x) * math.log((1 - p1) / (1 - p0))


@dataclass(slots=True)
class Alarm:
    at: float
    direction: str  # "down" | "up"
    baseline: float
    after: float  # rate since the estimated change point
    change_at: float  # estimated change point (last time the CUSUM was at zero)
    statistic: float


@dataclass(slots=True)
class RateCusum:
    """Two one-sided binomial CUSUMs with a warm-up baseline. Feed ``update(t, n, x)`` with
    the trials and successes of each interval (already differenced from counters)."""

    params: RateDriftParams = field(default_factory=RateDriftParams)
    started: float | None = None
    warm_n: float = 0.0
    warm_x: float = 0.0
    warm_rates: list[tuple[float, float]] = field(default_factory=list)  # (n, x), warm-up only
    p0: float | None = None
    tau2: float = 0.0
    s_down: float = 0.0
    s_up: float = 0.0
    since_down: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (t of last zero, n, x) since then
    since_up: tuple[float, float, float] = (0.0, 0.0, 0.0)
    recent: list[tuple[float, float, float]] = field(default_factory=list)  # (t, n, x) for resolve
    alarm: Alarm | None = None  # the open alarm, if any
    alarms: int = 0
    skipped: int = 0

    @property
    def ready(self) -> bool:
        return self.p0 is not None

    def _learn(self) -> None:
        p = self.params
        p0 = self.warm_x / self.warm_n
        p0 = min(max(p0, 1e-4), 1 - 1e-4)
        # method of moments for the extra-binomial variance of interval rates
        rows = np.array([(n, x) for n, x in self.warm_rates if n > 0], dtype=float).reshape(-1, 2)
        tau2 = long_run_tau2(rows[:, 0], rows[:, 1], p0, p.lr_lags) if len(rows) else 0.0
        self.tau2 = max(tau2, p.min_tau**2)
        self.p0 = p0
        self.warm_rates.clear()

    def update(self, t: float, n: float, x: float) -> Alarm | None:
        """One interval; returns a new Alarm when a CUSUM crosses its threshold."""
        p = self.params
        if not (n > 0) or not (0 <= x <= n) or not math.isfinite(n + x):
            self.skipped += 1
            return None
        if self.started is None:
            self.started = t
        if self.p0 is None:
            self.warm_n += n
            self.warm_x += x
            self.warm_rates.append((n, x))
            if t - self.started >= p.warmup_s and self.warm_n >= p.min_warmup_trials:
                self._learn()
                self.since_down = self.since_up = (t, 0.0, 0.0)
            return None
        p0 = self.p0
        phi = 1.0 + n * self.tau2 / (p0 * (1 - p0))
        self.recent.append((t, n, x))
        while self.recent and self.recent[0][0] <= t - p.resolve_s:
            self.recent.pop(0)
        new: Alarm | None = None
        if p.sides in ("down", "both"):
            h0 = max(p0 - p.tolerance, 2e-4)
            p1 = max(h0 - p.shift, 1e-4)
            self.s_down, self.since_down = self._step(self.s_down, self.since_down, t, n, x,
                                                      binomial_llr(x, n, h0, p1) / phi)
            if self.s_down > p.threshold:
                new = self._fire(t, "down", self.s_down, self.since_down)
                self.s_down, self.since_down = 0.0, (t, 0.0, 0.0)
        if p.sides in ("up", "both"):
            h0 = min(p0 + p.tolerance, 1 - 2e-4)
            p1 = min(h0 + p.shift, 1 - 1e-4)
            self.s_up, self.since_up = self._step(self.s_up, self.since_up, t, n, x,
                                                  binomial_llr(x, n, h0, p1) / phi)
            if self.s_up > p.threshold:
                new = self._fire(t, "up", self.s_up, self.since_up)
                self.s_up, self.since_up = 0.0, (t, 0.0, 0.0)
        if (new is None and self.alarm is not None and t - self.alarm.at >= p.resolve_s
                and self._back_to_baseline()):
            self.alarm = None
        return new

    @staticmethod
    def _step(s, since, t, n, x, llr):
        s = s + llr
        if s <= 0:
            return 0.0, (t, 0.0, 0.0)
        return s, (since[0], since[1] + n, since[2] + x)

    def _fire(self, t, direction, stat, since) -> Alarm | None:
        """A crossing opens an alarm; while the same alarm is open it only refreshes it."""
        after = since[2] / since[1] if since[1] > 0 else float("nan")
        if self.alarm is not None and self.alarm.direction == direction:
            self.alarm.after, self.alarm.statistic = after, stat
            return None
        self.alarm = Alarm(t, direction, float(self.p0), after, since[0], stat)
        self.alarms += 1
        return self.alarm

    def recent_rate(self) -> float | None:
        n = sum(r[1] for r in self.recent)
        return sum(r[2] for r in self.recent) / n if n > 0 else None

    def _back_to_baseline(self) -> bool:
        rate = self.recent_rate()
        return rate is not None and abs(rate - float(self.p0)) < self.params.tolerance + self.params.shift / 2

    def snapshot(self) -> dict:
        return {"baseline": self.p0, "tau": math.sqrt(self.tau2) if self.p0 is not None else None,
                "cusum_down": self.s_down, "cusum_up": self.s_up, "threshold": self.params.threshold,
                "recent_rate": self.recent_rate(), "alarms": self.alarms, "skipped_intervals": self.skipped,
                "open": self.alarm is not None}


def counter_increments(t: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample increments of a cumulative counter (a fall means a reset: the new value is the
    increment, as in Prometheus' increase())."""
    d = np.diff(c)
    d = np.where(d < 0, c[1:], d)
    return t[1:], d


def bin_counts(t: np.ndarray, n: np.ndarray, x: np.ndarray, interval_s: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum increments into intervals (stamped at the interval end)."""
    if len(t) == 0:
        return np.empty(0), np.empty(0), np.empty(0)
    idx = np.floor((t - t[0]) / interval_s).astype(np.int64)
    nb = int(idx[-1]) + 1
    nn = np.bincount(idx, weights=n, minlength=nb)
    xx = np.bincount(idx, weights=x, minlength=nb)
    ends = t[0] + (np.arange(nb) + 1.0) * interval_s
    keep = nn > 0
    return ends[keep], nn[keep], xx[keep]


def scan_rate(t: np.ndarray, trials: np.ndarray, successes: np.ndarray,
              params: RateDriftParams = RateDriftParams()) -> tuple[list[Alarm], RateCusum]:
    """Replay a recorded pair of cumulative counters through the CUSUM."""
    t = np.asarray(t, float)
    order = np.argsort(t, kind="stable")
    t, trials, successes = t[order], np.asarray(trials, float)[order], np.asarray(successes, float)[order]
    ti, dn = counter_increments(t, trials)
    _, dx = counter_increments(t, successes)
    ok = (dn >= 0) & (dx >= 0) & (dx <= dn)
    te, nn, xx = bin_counts(ti[ok], dn[ok], dx[ok], params.interval_s)
    cus = RateCusum(params)
    alarms = [a for a in (cus.update(float(a), float(b), float(c)) for a, b, c in zip(te, nn, xx, strict=True))
              if a is not None]
    return alarms, cus


# --- latency at comparable load ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LatencyDriftParams:
    interval_s: float = 60.0
    warmup_s: float = 3600.0
    min_warmup_intervals: int = 5  # per load bin; bins seen less often stay unknown
    rel_shift: float = 0.15  # design: latency 15 % above the baseline of the same load
    arl0_s: float = 30 * DAY
    family: int = 1
    min_cv: float = 0.02  # floor on the interval-to-interval coefficient of variation
    resolve_s: float = 1800.0

    @property
    def threshold(self) -> float:
        return threshold_for_arl(self.arl0_s, self.interval_s, 1, self.family)


def load_bin(running: float) -> int:
    """log2 bins of the running batch: 1, 2-3, 4-7, 8-15, ..."""
    return math.floor(math.log2(max(running, 1.0)))


@dataclass(slots=True)
class LatencyCusum:
    """One-sided (slower) CUSUM of interval-mean TPOT against a per-load-bin baseline."""

    params: LatencyDriftParams = field(default_factory=LatencyDriftParams)
    started: float | None = None
    warm: dict[int, list[float]] = field(default_factory=dict)
    base: dict[int, tuple[float, float]] | None = None  # bin -> (mean, sd)
    s: float = 0.0
    since: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (t0, sum of ratios, intervals)
    recent: list[tuple[float, float]] = field(default_factory=list)  # (t, ratio to baseline)
    alarm: Alarm | None = None
    alarms: int = 0
    unknown: int = 0

    def update(self, t: float, mean_tpot: float, running: float) -> Alarm | None:
        p = self.params
        if not (mean_tpot > 0 and math.isfinite(mean_tpot) and running >= 0):
            self.unknown += 1
            return None
        if self.started is None:
            self.started = t
        b = load_bin(running)
        if self.base is None:
            self.warm.setdefault(b, []).append(mean_tpot)
            if t - self.started >= p.warmup_s:
                self.base = {k: (float(np.mean(v)), float(np.std(v, ddof=1)))
                             for k, v in self.warm.items() if len(v) >= p.min_warmup_intervals}
                self.warm.clear()
                self.since = (t, 0.0, 0.0)
            return None
        if b not in self.base:
            self.unknown += 1
            return None
        mu, sd = self.base[b]
        sd = max(sd, p.min_cv * mu)
        d = p.rel_shift * mu
        llr = d / sd**2 * (mean_tpot - mu - d / 2)
        ratio = mean_tpot / mu
        self.recent.append((t, ratio))
        while self.recent and self.recent[0][0] <= t - p.resolve_s:
            self.recent.pop(0)
        self.s += llr
        if self.s <= 0:
            self.s, self.since = 0.0, (t, 0.0, 0.0)
        else:
            self.since = (self.since[0], self.since[1] + ratio, self.since[2] + 1)
        if self.s > p.threshold:
            after = self.since[1] / self.since[2] if self.since[2] else float("nan")
            fresh = self.alarm is None
            if fresh:
                self.alarm = Alarm(t, "up", 1.0, after, self.since[0], self.s)
                self.alarms += 1
            else:
                self.alarm.after, self.alarm.statistic = after, self.s
            self.s, self.since = 0.0, (t, 0.0, 0.0)
            return self.alarm if fresh else None
        if self.alarm is not None and self.recent and t - self.alarm.at >= p.resolve_s:
            r = float(np.mean([q for _, q in self.recent]))
            if r < 1 + p.rel_shift / 2:
                self.alarm = None
        return None

    def snapshot(self) -> dict:
        return {"baseline": ({str(2**k): {"mean_s": m, "sd_s": s} for k, (m, s) in self.base.items()}
                             if self.base is not None else None),
                "cusum": self.s, "threshold": self.params.threshold, "alarms": self.alarms,
                "unknown_intervals": self.unknown, "open": self.alarm is not None}
