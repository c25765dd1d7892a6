"""Change detection for rates (spec-decode acceptance, prefix-cache hit rate) and for latency
at comparable load: pure state machines, fed interval by interval; no I/O, no clocks.

Rates: a count-weighted binomial CUSUM (Page 1954). Each interval contributes the binomial
log-likelihood ratio of its (successes x out of n) under the shifted rate p1 versus the baseline
p0, divided by an overdispersion factor phi_i = 1 + n_i * tau^2 / (p0 (1 - p0)) that caps the
evidence one interval can carry when the rate itself jitters between intervals (workload mix).
The alarm threshold h follows from the configured mean time between false alarms (ARL0), for
steps = ARL0 / interval * sides * family: by default the h at which a CUSUM of Gaussian
log-likelihood ratios (increments N(-theta^2/2, theta^2); Brook & Evans' Markov chain) has exactly
that run length at the theta that makes it shortest, about ln(steps) - 1.58 nats; opt-in
(arl_rule="lorden") Lorden's bound ARL0 >= e^h, h = ln(steps). The reference p0 is learned in a
1 h warm-up (issue 16: a baseline that keeps learning absorbs a slow decline; refine_s > 0 restores
that) and grows afterwards only under a test that no change is present (ref_hold_s, ref_clear_z);
its standard error widens the bands (ref_margin). Beside the step pair, a slow-drift test (issue
16, round 3) compares the mean rate over trailing windows of 10-80 min with the reference, in
standard errors that include the reference's own error and a slow wander of the mix, at a z set
from the ARL0 budget; it replaced round 2's narrow-band CUSUM pair (in git history). The jitter tau
keeps learning from alarm-free blocks (jitter_blocks): a 1 h estimate is too rough for the exact
threshold. The derivation and the measurements are in docs/detectors.md.

Latency: TPOT per interval is compared with a reference curve of TPOT over the running batch, so a
busier batch is not called a drift, by the mean log ratio over trailing windows (``LatencyDrift``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from sla_guard import defaults as d

DAY = d.DAY


def threshold_for_arl(arl0_s: float, interval_s: float, sides: int = 1, family: int = 1) -> float:
    """CUSUM threshold h (nats) whose false-alarm mean time is at least ``arl0_s`` for a family
    of ``family`` detectors with ``sides`` one-sided CUSUMs each (rates of false alarms add)."""
    steps = arl0_s / interval_s * max(1, sides) * max(1, family)
    return math.log(max(steps, math.e))


_erf = np.vectorize(math.erf, otypes=[float])


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(z, dtype=float) / math.sqrt(2.0)))


def gaussian_cusum_arl(h: float, theta: float, cells: int = 400) -> float:
    """In-control mean run length (steps) of S <- max(0, S + l), alarm at S > h, for i.i.d.
    l ~ N(-theta^2/2, theta^2): the log-likelihood ratio of a shift of theta standard deviations,
    under the null. Brook & Evans (1972): a Markov chain on the state S = 0 plus ``cells`` equal
    cells of (0, h] represented by their midpoints; the ARL is the first entry of
    (I - P)^-1 1. The discretisation error is O(cells^-2) and underestimates the ARL (a higher,
    safer h)."""
    w = h / cells
    mu = -0.5 * theta * theta
    k = np.arange(-cells, cells + 1)
    f_mid = _norm_cdf(((k + 0.5) * w - mu) / theta)  # P(l <= (k + 1/2) w)
    d = np.arange(cells)[None, :] - np.arange(cells)[:, None]  # target cell - source cell
    f_edge = _norm_cdf((np.arange(cells + 1) * w - mu) / theta)  # from S = 0: P(l <= j w)
    p = np.empty((cells + 1, cells + 1))
    p[0, 0], p[0, 1:] = f_edge[0], np.diff(f_edge)
    p[1:, 0] = f_mid[cells - 1 - np.arange(cells)]  # P(l <= -(i + 1/2) w)
    p[1:, 1:] = f_mid[d + cells] - f_mid[d + cells - 1]
    return float(np.linalg.solve(np.eye(cells + 1) - p, np.ones(cells + 1))[0])


_COARSE_CELLS = 100  # a chain this coarse (64x cheaper to solve) starts the 400-cell secant


def _h_for_theta(steps: float, theta: float, cells: int = 400) -> float:
    """h with gaussian_cusum_arl(h, theta, cells) = steps (secant on ln ARL, which is near-linear
    in h), started from the same root on a coarse chain, itself started from Siegmund's corrected
    diffusion, ARL ~ (e^b - b - 1) / (theta^2 / 2) with b = h + 1.166 theta. Starting close matters:
    each 400-cell solve is most of the cost of a threshold."""
    target = math.log(steps)
    if cells > _COARSE_CELLS:
        h0 = _h_for_theta(steps, theta, _COARSE_CELLS)
        h1 = h0 + 0.02
    else:
        c = steps * theta * theta / 2.0
        b = math.log(c + 1.0) + 1.0
        for _ in range(20):  # Newton on e^b - b - 1 = c
            b -= (math.exp(b) - b - 1.0 - c) / (math.exp(b) - 1.0)
        h0 = max(b - 1.166 * theta, 0.5)
        h1 = h0 + 0.5
    g0 = math.log(gaussian_cusum_arl(h0, theta, cells)) - target
    g1 = math.log(gaussian_cusum_arl(h1, theta, cells)) - target
    for _ in range(30):
        if abs(g1) < 1e-6 or g1 == g0:
            break
        h0, g0, h1 = h1, g1, max(h1 - g1 * (h1 - h0) / (g1 - g0), 0.05)
        g1 = math.log(gaussian_cusum_arl(h1, theta, cells)) - target
    return h1


@lru_cache(maxsize=64)
def _worst_case_theta(steps: float) -> tuple[float, float]:
    """(theta*, h*) maximising _h_for_theta over theta (golden section on [0.5, 5]): h(theta) is
    unimodal with its peak near theta = 1.85. Small theta: many small steps per nat, a long run;
    large theta: the walk jumps far past h, so it needs less h for the same run length. The search
    runs on the coarse chain (h is flat at its peak, so theta* need not be exact); h* on the full one."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = 0.5, 5.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _h_for_theta(steps, c, _COARSE_CELLS), _h_for_theta(steps, d, _COARSE_CELLS)
    while b - a > 0.02:
        if fc > fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _h_for_theta(steps, c, _COARSE_CELLS)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _h_for_theta(steps, d, _COARSE_CELLS)
    theta = c if fc > fd else d
    return theta, _h_for_theta(steps, theta)


_THETA_GRID = 1.04


@lru_cache(maxsize=1024)
def _capped_threshold(steps: float, theta_max: float) -> float:
    theta_star, h_star = _worst_case_theta(steps)
    return h_star if theta_max >= theta_star else _h_for_theta(steps, theta_max)


def threshold_gaussian_arl(
    arl0_s: float, interval_s: float, sides: int = 1, family: int = 1, theta_max: float = math.inf
) -> float:
    """CUSUM threshold h (nats) whose in-control ARL is ``arl0_s`` (per family, as in
    threshold_for_arl) for LLR increments that are Gaussian with per-step information theta,
    taken at the worst theta <= ``theta_max`` (h(theta) rises up to theta ~ 1.85, then falls), so
    one threshold serves every load: with the default, any theta, about 1.58 nats below Lorden's
    bound. Falls back to Lorden's bound for degenerate input (few steps, a numerical failure)
    and is never above it."""
    lorden = threshold_for_arl(arl0_s, interval_s, sides, family)
    steps = arl0_s / interval_s * max(1, sides) * max(1, family)
    if not (math.isfinite(steps) and steps >= 20.0) or not (theta_max > 0.05):
        return lorden
    # theta_max rounded up (the safe side: h rises with theta below the worst case) to a 4 % geometric
    # grid, so the hourly jitter updates of every detector share a few dozen cached thresholds (each is
    # several 401-cell Markov-chain solves); h moves by < 0.07 nats across one grid step
    cap = (
        _THETA_GRID ** math.ceil(math.log(theta_max) / math.log(_THETA_GRID) - 1e-9)
        if math.isfinite(theta_max)
        else math.inf
    )
    try:
        h = _capped_threshold(float(f"{steps:.6g}"), cap)
    except (np.linalg.LinAlgError, ValueError, OverflowError, ZeroDivisionError):
        return lorden
    return h if math.isfinite(h) and 0.0 < h <= lorden else lorden


def max_interval_information(p0: float, q0: float, p1: float, tau2: float) -> float:
    """Upper bound, over every interval size n, of theta = the standard deviation of one
    interval's down-weighted LLR at the band edge q0: theta^2 = n v / phi(n) with
    v = q0 (1 - q0) ln(p1 (1 - q0) / (q0 (1 - p1)))^2 and phi(n) = 1 + n tau^2 / (p0 (1 - p0)),
    which rises with n to v p0 (1 - p0) / tau^2: with jitter, more traffic stops adding evidence
    per interval. Infinite without jitter."""
    if not tau2 > 0:
        return math.inf
    v = q0 * (1 - q0) * math.log(p1 * (1 - q0) / (q0 * (1 - p1))) ** 2
    return math.sqrt(v * p0 * (1 - p0) / tau2)


@lru_cache(maxsize=64)
def _window_threshold(steps: float, crossings: float) -> float:
    """z with z phi(z) * crossings * steps = 1 (bisection): see RateDriftParams.trend_threshold."""
    lo, hi = 1.0, 12.0
    for _ in range(60):
        z = 0.5 * (lo + hi)
        if z * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * crossings * steps > 1.0:
            lo = z
        else:
            hi = z
    return hi


@dataclass(frozen=True, slots=True)
class RateDriftParams:
    # the defaults the config's detectors.acceptance / prefix_hit share live in sla_guard.defaults
    interval_s: float = d.RATE_INTERVAL_S  # one CUSUM step
    warmup_s: float = d.RATE_WARMUP_S  # baseline learned over this span
    min_warmup_trials: int = 2000  # and at least this many trials (tokens) in it
    shift: float = d.RATE_SHIFT  # design shift (absolute rate) beyond the tolerance band
    tolerance: float = d.RATE_TOLERANCE  # indifference band: slow wander within +-tolerance is not drift
    sides: str = "both"  # "down" | "up" | "both"
    arl0_s: float = d.RATE_ARL0_S  # mean time between false alarms, per detector family
    family: int = 1  # detectors sharing the ARL0 budget (e.g. overall + per position)
    min_tau: float = 0.005  # floor on the between-interval jitter of the rate
    lr_lags: int = 10  # autocovariance lags of the long-run jitter variance (Bartlett weights):
    # the request mix outlives one interval, so adjacent intervals' excesses add up in the CUSUM
    resolve_s: float = 1800.0  # recent window whose rate must be back near baseline to resolve
    arl_rule: str = d.RATE_ARL_RULE  # "gaussian": the exact run length of a Gaussian-LLR CUSUM at the worst
    # per-interval information; "lorden": h = ln(steps), Lorden's bound ARL0 >= e^h (1.58 nats higher:
    # slack for a mis-learned baseline and jitter, which refine_s and jitter_blocks now shrink)
    jitter_blocks: int = d.RATE_JITTER_BLOCKS  # > 0: keep re-estimating tau after warm-up, as the mean of the long-run
    # estimates of this many recent alarm-free blocks of warmup_s, each around its own mean (0: warm-up only)
    refine_s: float = d.RATE_REFINE_S  # > 0: p0 keeps learning (expanding mean) from intervals up to this long after
    # the start, each once refine_hold_s passed with no alarm. Off by default (issue 16): a learning baseline absorbs a
    # slow decline; the reference is frozen at the end of warm-up and its own error widens the band (ref_margin)
    refine_hold_s: float = 1800.0
    slow: bool = True  # the slow-drift window test (ramps, trend_windows_s) beside the step CUSUMs
    ref_margin: float = 1.0  # bands widen by this many standard errors of the frozen reference (2 lost 7 points
    # of 0.10 steps within 10 min and 8 of ramps on the tuning seeds, with no false alarm at either; 0.5 raised 3)
    trend_windows_s: tuple[float, ...] = (600.0, 1200.0, 2400.0, 4800.0)  # slow-drift test: mean rate over each of
    # these trailing windows against the reference, in standard errors
    trend_wander: float = 0.003  # s.d. of a slow wander of the workload mix between the reference and now (prior)
    measured_wander_blocks: int = 0  # > 0: once this many jitter blocks exist, the wander is at least what their
    # means (hours) show around the reference beyond their own noise (a prefix-hit rate moves with the mix by
    # several points over hours, where a 0.003 prior reads every afternoon as a drift)
    wander_corr_s: float = 3600.0  # its correlation time: a reference spanning S carries ~2 T / S of its variance
    trend_tau_margin: float = 0.5  # relative s.d. of one block's jitter estimate: the window test takes it 1 s.d. high
    trend_z: float = 0.0  # > 0: the window test's threshold (standard errors); 0: from ARL0 (trend_threshold)
    ref_hold_s: float = 7200.0  # > 0: intervals this old join the reference while no test sees a change
    ref_clear_z: float = 2.0  # ... i.e. every window within this many standard errors, no alarm open
    reset_hold_s: float = 0.0  # > 0: after a counter reset (an engine restart) intervals this long are not judged
    # nor learned: a restarted engine's prefix cache is empty and refills as sessions come back (0: acceptance,
    # which a restart does not move)
    load_hold_ratio: float = 0.0  # > 0: while the trials per interval over the last load_window_s exceed this
    # many times the reference's, intervals are neither judged nor learned: a prefix cache evicts at a load it was
    # not seen at, and that fall is capacity, not a drift of the workload (0: acceptance, which load does not move)
    load_window_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.arl_rule not in ("gaussian", "lorden"):
            raise ValueError(f"arl_rule must be 'gaussian' or 'lorden', not {self.arl_rule!r}")
        if self.jitter_blocks < 0:
            raise ValueError(f"jitter_blocks must be >= 0 (0 = jitter from warm-up only), not {self.jitter_blocks}")
        if self.refine_s < 0 or self.refine_hold_s < 0:
            raise ValueError("refine_s and refine_hold_s must be >= 0 s (refine_s 0: baseline from warm-up only)")

    @property
    def n_sides(self) -> int:
        return 2 if self.sides == "both" else 1

    @property
    def n_family(self) -> int:
        """Detectors sharing the ARL0 budget: the family, times the step pair plus each slow test."""
        return self.family * (1 + (self.slow and self.trend))

    @property
    def trend(self) -> bool:
        return bool(self.trend_windows_s)

    @property
    def trend_threshold(self) -> float:
        """z at which the window test's one-sided false-alarm rate is one per ARL0 (its share of the
        budget). A moving mean over m intervals is a Gaussian process with correlation 1 - k/m; its
        up-crossings of z come at about z phi(z) / m per interval (Pickands' constant 1; sampling
        once per interval only makes them rarer), summed over the windows."""
        if self.trend_z > 0:
            return self.trend_z
        steps = self.arl0_s / self.interval_s * self.n_sides * self.n_family
        return _window_threshold(steps, sum(self.interval_s / w for w in self.trend_windows_s))

    @property
    def threshold(self) -> float:
        rule = threshold_for_arl if self.arl_rule == "lorden" else threshold_gaussian_arl
        return rule(self.arl0_s, self.interval_s, self.n_sides, self.n_family)


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


def _rate(x: float, n: float) -> float:
    """x / n kept off 0 and 1, where the log-likelihood ratios are infinite."""
    return min(max(float(x) / float(n), 1e-4), 1 - 1e-4)


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
    threshold: float = math.nan  # the h the statistic crossed
    test: str = "cusum"  # "cusum" (statistic and threshold in nats) or "window" (in standard errors: the window
    # test's |z| and z threshold)


@dataclass(slots=True)
class RateCusum:
    """Two one-sided binomial CUSUMs with a warm-up baseline. Feed ``update(t, n, x)`` with
    the trials and successes of each interval (already differenced from counters)."""

    params: RateDriftParams = field(default_factory=RateDriftParams)
    started: float | None = None
    base_n: float = 0.0  # trials and successes behind p0: the warm-up's, then refined (refine_s)
    base_x: float = 0.0
    warm_rates: list[tuple[float, float]] = field(default_factory=list)  # (n, x), warm-up only
    p0: float | None = None
    tau2: float = 0.0
    h: float | None = None  # threshold for the learned jitter (params.threshold until then)
    block: list[tuple[float, float]] = field(default_factory=list)  # (n, x) of the current jitter block
    block_start: float = 0.0
    tau2_blocks: list[float] = field(default_factory=list)  # warm-up's and recent blocks' estimates
    block_means: list[tuple[float, float]] = field(default_factory=list)  # (rate, variance of it) per recent block
    s_down: float = 0.0
    s_up: float = 0.0
    since_down: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (t of last zero, n, x) since then
    since_up: tuple[float, float, float] = (0.0, 0.0, 0.0)
    recent: list[tuple[float, float, float]] = field(default_factory=list)  # (t, n, x) for resolve
    pending: list[tuple[float, float, float]] = field(default_factory=list)  # (t, n, x) on hold for p0
    alarm: Alarm | None = None  # the open alarm, if any
    alarms: int = 0
    skipped: int = 0
    ref_se: float = 0.0  # standard error of the frozen reference p0 (long-run jitter and binomial)
    base_n2: float = 0.0  # sum of squared interval trials behind p0 (its long-run jitter error)
    base_m: int = 0  # intervals behind p0
    trend_rows: list[tuple[float, float, float]] = field(default_factory=list)  # (t, n, x) since warm-up, trimmed
    trend_sums: list[list[float]] = field(default_factory=list)  # per window: [first row index, N, X, N2]
    trend_zs: list[float] = field(default_factory=list)  # last z per window (nan until the window is full)
    held: list[tuple[float, float, float]] = field(default_factory=list)  # (t, n, x) waiting to join p0
    trend_start: float = 0.0  # end of warm-up: windows are judged once full
    cold_until: float | None = None  # intervals up to this time follow a restart (reset_hold_s) and are skipped
    cold: int = 0  # intervals skipped so far after restarts
    loads: list[tuple[float, float]] = field(default_factory=list)  # (t, n) over load_window_s
    loaded: int = 0  # intervals not judged at a load above the reference's

    @property
    def ready(self) -> bool:
        return self.p0 is not None

    def restarted(self, t: float) -> None:
        """An engine behind these counters restarted at ``t`` (a counter reset). With reset_hold_s the
        intervals until t + reset_hold_s are neither judged nor learned, and the step CUSUMs and the
        jitter block start over: a cold prefix cache is not a drift."""
        p = self.params
        if p.reset_hold_s <= 0:
            return
        self.cold_until = max(self.cold_until or -math.inf, t + p.reset_hold_s)
        self.s_down = self.s_up = 0.0
        self.since_down = self.since_up = (t, 0.0, 0.0)
        self.block.clear()
        self.block_start = self.cold_until

    @property
    def threshold(self) -> float:
        return self.h if self.h is not None else self.params.threshold

    def _band(self, direction: str) -> tuple[float, float]:
        """(q0, p1): the band edge and the design rate beyond it, on one side of p0. The band is
        widened by the frozen reference's own error (ref_margin standard errors)."""
        p, p0 = self.params, float(self.p0)
        tol = p.tolerance + p.ref_margin * self.ref_se
        excess = self._wander2() - p.trend_wander**2  # a measured wander beyond the prior widens the band by 2 s.d.
        if excess > 0:
            tol += 2.0 * math.sqrt(excess)
        shift = p.shift
        if direction == "down":
            q0 = max(p0 - tol, 2e-4)
            return q0, max(q0 - shift, 1e-4)
        q0 = min(p0 + tol, 1 - 2e-4)
        return q0, min(q0 + shift, 1 - 1e-4)

    def _learn(self) -> None:
        p = self.params
        p0 = _rate(self.base_x, self.base_n)
        # method of moments for the extra-binomial variance of interval rates
        rows = np.array([(n, x) for n, x in self.warm_rates if n > 0], dtype=float).reshape(-1, 2)
        tau2 = long_run_tau2(rows[:, 0], rows[:, 1], p0, p.lr_lags) if len(rows) else 0.0
        self.p0 = p0
        self.base_m = len(rows)
        self.base_n2 = float((rows[:, 0] ** 2).sum()) if len(rows) else 0.0
        self.trend_sums = [[0, 0.0, 0.0, 0.0] for _ in p.trend_windows_s]
        self.trend_zs = [math.nan for _ in p.trend_windows_s]
        self.ref_se = self._ref_se(tau2)
        self.warm_rates.clear()
        self.tau2_blocks = [tau2]
        self._set_jitter(tau2)

    def _ref_se(self, tau2: float) -> float:
        """Standard error of the reference: long-run jitter of its intervals (count-weighted) plus
        binomial noise."""
        p0, nb = float(self.p0), max(self.base_n, 1.0)
        if self.base_n2 > 0:
            jit = max(tau2, self.params.min_tau**2) * self.base_n2 / nb**2
        else:
            jit = max(tau2, self.params.min_tau**2) / max(self.base_m, 1)
        return math.sqrt(jit + p0 * (1 - p0) / nb)

    def _trend(self, t: float, n: float, x: float) -> tuple[int, float, float, float] | None:
        """Slow-drift test: over each trailing window (once full), the count-weighted mean rate
        against the reference, in standard errors of the difference: the window's long-run jitter
        and binomial noise, the reference's own error and a slow wander of the mix (trend_wander).
        Returns (window index, z, N, X) of the most extreme window beyond the threshold, if any."""
        p, p0 = self.params, float(self.p0)
        if len(self.trend_sums) != len(p.trend_windows_s):  # state saved before the window test, or new windows
            self.trend_rows, self.trend_start = [], t - p.interval_s
            self.trend_sums = [[0, 0.0, 0.0, 0.0] for _ in p.trend_windows_s]
            self.trend_zs = [math.nan for _ in p.trend_windows_s]
        rows = self.trend_rows
        rows.append((t, n, x))
        var_ref = self.ref_se**2 + self._wander_var()
        tau2 = self._tau2_high()
        best = None
        zt = p.trend_threshold
        for k, w in enumerate(p.trend_windows_s):
            acc = self.trend_sums[k]  # [first row in the window, N, X, sum of n^2]
            acc[1] += n
            acc[2] += x
            acc[3] += n * n
            i = int(acc[0])
            while rows[i][0] <= t - w:
                acc[1] -= rows[i][1]
                acc[2] -= rows[i][2]
                acc[3] -= rows[i][1] ** 2
                i += 1
            acc[0] = i
            if t - self.trend_start < w - 0.5 * p.interval_s or not acc[1] > 0:
                self.trend_zs[k] = math.nan
                continue
            big_n = acc[1]
            var = tau2 * acc[3] / big_n**2 + p0 * (1 - p0) / big_n + var_ref
            z = (acc[2] / big_n - p0) / math.sqrt(var)
            self.trend_zs[k] = z
            side_ok = p.sides in ("both", "down" if z < 0 else "up")
            if side_ok and abs(z) > zt and (best is None or abs(z) > abs(best[1])):
                best = (k, z, big_n, acc[2])
        first = min(int(a[0]) for a in self.trend_sums)
        if first > 32:
            del rows[:first]
            for a in self.trend_sums:
                a[0] -= first
        return best

    def _tau2_high(self) -> float:
        """The jitter variance one standard deviation high: a block's long-run estimate has a relative
        s.d. near trend_tau_margin (60 intervals, 10 lags), the mean of K blocks 1/sqrt(K) of that. An
        estimate too low inflates every window's z; the threshold has no slack for it."""
        k = max(len(self.tau2_blocks), 1)
        return self.tau2 * (1.0 + self.params.trend_tau_margin / math.sqrt(k))

    def _wander_var(self) -> float:
        """Variance a slow wander of the mix adds to (window mean - reference): the wander of now
        (trend_wander^2) plus the reference's own share, which a reference spanning S averages down
        to about 2 T / S of it (T = wander_corr_s; at most all of it while S <= 2 T)."""
        p = self.params
        span = max(self.base_m, 1) * p.interval_s
        return self._wander2() * (1.0 + min(1.0, 2.0 * p.wander_corr_s / span))

    def _wander2(self) -> float:
        """The wander's variance: the prior, or what the recent blocks' means show around the
        reference beyond their own noise (measured_wander_blocks), whichever is larger."""
        p = self.params
        prior = p.trend_wander**2
        k = p.measured_wander_blocks
        if k <= 0 or len(self.block_means) < k or self.p0 is None:
            return prior
        dev = np.array([m - float(self.p0) for m, _ in self.block_means])
        noise = float(np.mean([v for _, v in self.block_means]))
        return max(prior, float(np.mean(dev * dev)) - noise - self.ref_se**2)

    def _hold(self, t: float, n: float, x: float) -> None:
        """The reference grows only under a test that no change is present: an interval joins it
        once ref_hold_s old if no alarm was open since it came and every trend window is then within
        ref_clear_z standard errors of the reference; otherwise it is dropped."""
        p = self.params
        if self.alarm is not None:  # an alarm drops what is on hold: a change never joins its own reference
            self.held.clear()
            return
        self.held.append((t, n, x))
        calm = all(not (abs(z) >= p.ref_clear_z) for z in self.trend_zs)
        changed = False
        while self.held and self.held[0][0] <= t - p.ref_hold_s:
            _, n0, x0 = self.held.pop(0)
            if calm:
                self.base_n += n0
                self.base_x += x0
                self.base_n2 += n0 * n0
                self.base_m += 1
                changed = True
        if changed:
            self.p0 = _rate(self.base_x, self.base_n)
            self.ref_se = self._ref_se(self.tau2)

    def _set_jitter(self, tau2: float) -> None:
        """Jitter variance and the threshold that goes with it: under the gaussian rule, jitter
        caps what one interval can carry at any load (max_interval_information), and h is taken
        at the worst theta up to that cap."""
        p, p0 = self.params, float(self.p0)
        self.tau2 = max(tau2, p.min_tau**2)
        self.h = p.threshold
        if p.arl_rule == "gaussian":
            sides = [d for d in ("down", "up") if p.sides in (d, "both")]
            theta = max(max_interval_information(p0, *self._band(d), self.tau2) for d in sides)
            self.h = threshold_gaussian_arl(p.arl0_s, p.interval_s, p.n_sides, p.n_family, theta)

    def _jitter_block(self, t: float, n: float, x: float, fired: bool) -> None:
        """Refine tau from blocks of warmup_s after warm-up (a 1 h warm-up has ~60 intervals: its
        long-run estimate has a relative s.d. near 50 %, and an underestimate overweights every
        interval). Each block is centred on its own mean, so slow wander and a level change
        between blocks do not count as jitter; a block in which an alarm fired or was open is
        dropped, so a drift the CUSUM has seen does not blunt it."""
        p = self.params
        self.block.append((n, x))
        if fired or self.alarm is not None:
            self.block.clear()
            self.block_start = t
            return
        if t - self.block_start < p.warmup_s:
            return
        rows = np.array(self.block, dtype=float)
        pb = _rate(rows[:, 1].sum(), rows[:, 0].sum())
        self.tau2_blocks = [*self.tau2_blocks, long_run_tau2(rows[:, 0], rows[:, 1], pb, p.lr_lags)]
        del self.tau2_blocks[: -p.jitter_blocks]
        nb = float(rows[:, 0].sum())
        var_mean = self.tau2_blocks[-1] * float((rows[:, 0] ** 2).sum()) / nb**2 + pb * (1 - pb) / nb
        self.block_means = [*self.block_means, (pb, var_mean)][-p.jitter_blocks:]
        self._set_jitter(float(np.mean(self.tau2_blocks)))
        self.block.clear()
        self.block_start = t

    def _refine(self, t: float, n: float, x: float, fired: bool) -> None:
        """Expanding-mean baseline after warm-up. Under slow wander of the workload mix a 1 h mean
        is off by most of the wander itself (an hour holds about one correlation time), and that
        error adds to every later deviation; each further hour shrinks it. An interval joins only
        once refine_hold_s passed without an alarm (an alarm drops the ones on hold), so a change
        the CUSUM finds within that time never moves the baseline it is judged against."""
        p = self.params
        if fired or self.alarm is not None:
            self.pending.clear()
            return
        self.pending.append((t, n, x))
        while self.pending and self.pending[0][0] <= t - p.refine_hold_s:
            t0, n0, x0 = self.pending.pop(0)
            if t0 - float(self.started) <= p.refine_s:
                self.base_n += n0
                self.base_x += x0
                self.p0 = _rate(self.base_x, self.base_n)

    def update(self, t: float, n: float, x: float) -> Alarm | None:
        """One interval; returns a new Alarm when a CUSUM crosses its threshold."""
        p = self.params
        if not (n > 0) or not (0 <= x <= n) or not math.isfinite(n + x):
            self.skipped += 1
            return None
        if self.cold_until is not None and t <= self.cold_until:
            self.cold += 1
            return None
        if self.started is None:
            self.started = t
        if self.p0 is None:
            self.base_n += n
            self.base_x += x
            self.warm_rates.append((n, x))
            if t - self.started >= p.warmup_s and self.base_n >= p.min_warmup_trials:
                self._learn()
                self.since_down = self.since_up = (t, 0.0, 0.0)
                self.block_start = self.trend_start = t
            return None
        if p.load_hold_ratio > 0 and self.base_m > 0:
            self.loads.append((t, n))
            while self.loads and self.loads[0][0] <= t - p.load_window_s:
                self.loads.pop(0)
            if sum(v for _, v in self.loads) / len(self.loads) > p.load_hold_ratio * self.base_n / self.base_m:
                self.loaded += 1
                return None
        p0 = self.p0
        phi = 1.0 + n * self.tau2 / (p0 * (1 - p0))
        self.recent.append((t, n, x))
        while self.recent and self.recent[0][0] <= t - p.resolve_s:
            self.recent.pop(0)
        new: Alarm | None = None
        if p.sides in ("down", "both"):
            h0, p1 = self._band("down")
            self.s_down, self.since_down = self._step(
                self.s_down, self.since_down, t, n, x, binomial_llr(x, n, h0, p1) / phi
            )
            if self.s_down > self.threshold:
                new = self._fire(t, "down", self.s_down, self.since_down)
                self.s_down, self.since_down = 0.0, (t, 0.0, 0.0)
        if p.sides in ("up", "both"):
            h0, p1 = self._band("up")
            self.s_up, self.since_up = self._step(self.s_up, self.since_up, t, n, x, binomial_llr(x, n, h0, p1) / phi)
            if self.s_up > self.threshold:
                new = self._fire(t, "up", self.s_up, self.since_up)
                self.s_up, self.since_up = 0.0, (t, 0.0, 0.0)
        if p.slow and p.trend:
            hit = self._trend(t, n, x)
            if hit is not None:
                k, z, big_n, big_x = hit
                direction = "down" if z < 0 else "up"
                since = (t - p.trend_windows_s[k], big_n, big_x)
                new = self._fire(t, direction, abs(z), since, p.trend_threshold, "window") or new
        if p.jitter_blocks > 0:
            self._jitter_block(t, n, x, new is not None)
        if p.refine_s > 0:
            self._refine(t, n, x, new is not None)
        elif p.ref_hold_s > 0 and p.slow and p.trend:  # grows only under the window test
            self._hold(t, n, x)
        if new is None and self.alarm is not None and t - self.alarm.at >= p.resolve_s and self._back_to_baseline():
            self.alarm = None
            self.trend_start = t  # windows that still hold the change would fire again: judge them once refilled
        return new

    @staticmethod
    def _step(s, since, t, n, x, llr):
        s = s + llr
        if s <= 0:
            return 0.0, (t, 0.0, 0.0)
        return s, (since[0], since[1] + n, since[2] + x)

    def _fire(self, t, direction, stat, since, h: float | None = None, test: str = "cusum") -> Alarm | None:
        """A crossing opens an alarm; while the same alarm is open it only refreshes it."""
        after = since[2] / since[1] if since[1] > 0 else float("nan")
        h = self.threshold if h is None else h
        if self.alarm is not None and self.alarm.direction == direction:
            self.alarm.after, self.alarm.statistic, self.alarm.threshold, self.alarm.test = after, stat, h, test
            return None
        self.alarm = Alarm(t, direction, float(self.p0), after, since[0], stat, h, test)
        self.alarms += 1
        return self.alarm

    def recent_rate(self) -> float | None:
        n = sum(r[1] for r in self.recent)
        return sum(r[2] for r in self.recent) / n if n > 0 else None

    def _back_to_baseline(self) -> bool:
        """The rate over the last resolve_s is within tol + shift/2 of the reference and, with the
        window test, within ref_clear_z of its standard errors (else a slow drift would resolve and
        fire again)."""
        p, p0 = self.params, float(self.p0)
        rate = self.recent_rate()
        if rate is None or not abs(rate - p0) < p.tolerance + p.shift / 2:
            return False
        if not (p.slow and p.trend):
            return True
        big_n = sum(r[1] for r in self.recent)
        n2 = sum(r[1] ** 2 for r in self.recent)
        var = self._tau2_high() * n2 / big_n**2 + p0 * (1 - p0) / big_n + self.ref_se**2 + self._wander_var()
        return abs(rate - p0) < p.ref_clear_z * math.sqrt(var)

    def snapshot(self) -> dict:
        return {
            "baseline": self.p0,
            "tau": math.sqrt(self.tau2) if self.p0 is not None else None,
            "cusum_down": self.s_down,
            "cusum_up": self.s_up,
            "threshold": self.threshold,
            "reference_se": self.ref_se,
            "trend_z": {
                f"{w:g}": (z if math.isfinite(z) else None)
                for w, z in zip(self.params.trend_windows_s, self.trend_zs, strict=False)
            },
            "trend_threshold": self.params.trend_threshold,
            "recent_rate": self.recent_rate(),
            "alarms": self.alarms,
            "skipped_intervals": self.skipped,
            "intervals_after_restarts_not_judged": self.cold,
            "intervals_at_high_load_not_judged": self.loaded,
            "open": self.alarm is not None,
        }


def counter_increments(t: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample increments of a cumulative counter (a fall means a reset: the new value is the
    increment, as in Prometheus' increase())."""
    d = np.diff(c)
    d = np.where(d < 0, c[1:], d)
    return t[1:], d


def bin_counts(
    t: np.ndarray, n: np.ndarray, x: np.ndarray, interval_s: float
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


def scan_rate(
    t: np.ndarray, trials: np.ndarray, successes: np.ndarray, params: RateDriftParams = RateDriftParams()
) -> tuple[list[Alarm], RateCusum]:
    """Replay a recorded pair of cumulative counters through the CUSUM."""
    t = np.asarray(t, float)
    order = np.argsort(t, kind="stable")
    t, trials, successes = t[order], np.asarray(trials, float)[order], np.asarray(successes, float)[order]
    ti, dn = counter_increments(t, trials)
    _, dx = counter_increments(t, successes)
    resets = list(ti[(np.diff(trials) < 0) | (np.diff(successes) < 0)])
    ok = (dn >= 0) & (dx >= 0) & (dx <= dn)
    te, nn, xx = bin_counts(ti[ok], dn[ok], dx[ok], params.interval_s)
    cus = RateCusum(params)
    alarms = []
    for a, b, c in zip(te, nn, xx, strict=True):
        while resets and resets[0] <= a:  # the restart is seen with the interval that holds it
            cus.restarted(float(resets.pop(0)))
        fired = cus.update(float(a), float(b), float(c))
        if fired is not None:
            alarms.append(fired)
    return alarms, cus


# --- latency at comparable load ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LatencyDriftParams:
    interval_s: float = 60.0
    warmup_s: float = 3600.0
    min_warmup_intervals: int = 20  # intervals with finished requests before the reference exists
    arl0_s: float = 30 * DAY
    family: int = 1
    min_cv: float = 0.02  # floor on the relative noise of one interval
    resolve_s: float = 1800.0  # a finding resolves once the residuals of this long are back within ref_clear_z
    bin_width: float = 0.5  # reference points every this many doublings of the running batch
    min_bin_intervals: int = 10  # a bin becomes a reference point with this many intervals (5 raised false alarms:
    # its point's error, shared by every interval near it, is not noise the windows average away)
    windows_s: tuple[float, ...] = (600.0, 1200.0, 2400.0, 4800.0)  # trailing windows of the test
    wander: float = 0.02  # relative s.d. of a slow wander of the mix (context lengths, acceptance) (a prior)
    extrapolation_error: float = 0.2  # bound on the error of log TPOT per doubling of the batch beyond the
    # reference's range, extended with its edge slope (a slope that changes by 0.2 per doubling)
    max_slope: float = 1.2 * math.log(2.0)  # steepest edge slope (log TPOT per doubling): a little above proportional
    lr_lags: int = 20  # autocovariance lags measured (the mix of a minute outlives it)
    ref_hold_warmups: float = 2.0  # intervals this many warm-ups old (2 h) join the reference while no test sees a
    # slowdown; scaled with the warm-up so a shortened one (the demo's 15 min) re-measures its noise within the run
    new_load_hold_warmups: float = 0.5  # ... and this old at a batch beyond the reference's range, where the windows
    # see only changes beyond the extrapolation's error: learning the load sooner buys more than it risks
    ref_clear_z: float = 2.0  # ... i.e. no window beyond this many standard errors and no alarm open
    jitter_blocks: int = 24  # noise re-estimated from this many recent blocks of warmup_s that joined the reference

    @property
    def ref_hold_s(self) -> float:
        return self.ref_hold_warmups * self.warmup_s

    @property
    def new_load_hold_s(self) -> float:
        return self.new_load_hold_warmups * self.warmup_s

    @property
    def threshold(self) -> float:
        """z at which the window test's false-alarm rate is one per ARL0 (Pickands: a moving mean
        over m intervals up-crosses z about z phi(z) / m per interval, summed over the windows)."""
        steps = self.arl0_s / self.interval_s * self.family
        return _window_threshold(steps, sum(self.interval_s / w for w in self.windows_s))


def load_bin(running: float, width: float = 1.0) -> int:
    """Bins of the running batch, ``width`` doublings wide (1: 1, 2-3, 4-7, 8-15, ...)."""
    return math.floor(math.log2(max(running, 1.0)) / width)


MAX_REQUEST_VAR = 0.5**2  # per-request variance of log TPOT: the requests of a batch share its steps


def noise_model(e: np.ndarray, k: np.ndarray, lags: int,
                max_request_var: float = MAX_REQUEST_VAR) -> tuple[list[float], float]:
    """(autocovariances of the mix at lags 0..``lags``, per-request variance) of log-TPOT residuals.
    E[e^2] = mix + req / k, by least squares on 1 / k (an interval's mean over k requests carries
    their dispersion / k; the mix of contexts and batches moves every request together), both >= 0,
    req at most ``max_request_var`` (a start-up's few-request intervals far off the curve made it a
    log s.d. of 3.2 in the demo, and every window's noise with it);
    the residuals' autocovariances at lags >= 1 are the mix's alone (requests are independent
    between intervals). The tests sum intervals, so these, not the lag-0 variance, set their noise."""
    e, k = np.asarray(e, float), np.maximum(np.asarray(k, float), 1.0)
    if len(e) < 3:
        return [float(np.mean(e * e)) if len(e) else 0.0], 0.0
    # winsorised at 4 robust s.d.: a few odd intervals (a start-up's first requests, a stall) would
    # otherwise set the noise of every window; the windows' means are not that heavy-tailed
    med = float(np.median(e))
    mad = 1.4826 * float(np.median(np.abs(e - med)))
    if mad > 0:
        e = np.clip(e, med - 4 * mad, med + 4 * mad)
    x, y = 1.0 / k, e * e
    if np.ptp(x) > 1e-12:
        slope, icpt = np.polyfit(x, y, 1)
        if icpt < 0:
            icpt, slope = 0.0, float(np.dot(x, y) / np.dot(x, x))
        elif slope < 0:
            icpt, slope = float(np.mean(y)), 0.0
    else:
        icpt, slope = float(np.mean(y)), 0.0
    if slope > max_request_var:  # requests of one batch share its steps: what is left is the mix's
        slope = max_request_var
        icpt = max(float(np.mean(y - slope * x)), 0.0)
    ec = e - e.mean()
    acov = [max(float(icpt), 0.0)]
    for lag in range(1, min(lags, len(e) - 1) + 1):
        acov.append(float(np.dot(ec[:-lag], ec[lag:])) / len(e))
    return acov, max(float(slope), 0.0)


def change_point(t: np.ndarray, e: np.ndarray) -> tuple[float, float]:
    """(time, level after it) of the likeliest single shift of the mean of ``e`` (the split that
    maximises the between-segment difference scaled by sqrt(k (n - k) / n)): what a finding reports,
    rather than a window's mean that still holds part of the time before the change."""
    n = len(e)
    if n < 2:
        return (float(t[0]) if n else math.nan), (float(e[0]) if n else 0.0)
    c = np.cumsum(e)
    k = np.arange(1, n)
    score = (c[-1] - c[k - 1]) / (n - k) - c[k - 1] / k
    score = score * np.sqrt(k * (n - k) / n)
    j = int(np.argmax(score)) + 1
    return float(t[j]), float(e[j:].mean())


def mean_variance(acov: list[float], n: int) -> float:
    """Variance of the mean of ``n`` consecutive intervals of a series with these autocovariances
    (beyond the last lag taken as 0), never below the independent case's acov[0] / n."""
    n = max(int(n), 1)
    v = acov[0] + 2.0 * sum((1.0 - j / n) * g for j, g in enumerate(acov[1:n], start=1))
    return max(v, acov[0]) / n


@dataclass(slots=True)
class LatencyDrift:
    """Interval-mean TPOT against a reference curve of TPOT over the running batch, judged by the
    mean log ratio over trailing windows of 10-80 min, in standard errors from the measured
    autocovariances of the mix, per-request dispersion, the reference's own error and a slow wander.

    The reference is the mean log TPOT of each ``bin_width``-doubling bin of the batch, joined by
    straight lines (in log TPOT over log batch) and extended past its range with the edge slope
    plus a bound on the model error that grows per doubling: a load the warm-up never saw is judged
    (with that bound taken off on the safe side) instead of staying unknown. The reference is
    learned in the warm-up and grows afterwards only under a test that no change is present
    (``ref_hold_s``, ``ref_clear_z``), as the rate detectors' reference does: a reference that keeps
    learning absorbs a slow drift. Until issue 16 this was a CUSUM against per-bin means of the
    warm-up only; docs/detectors.md has what it missed."""

    params: LatencyDriftParams = field(default_factory=LatencyDriftParams)
    started: float | None = None
    warm_rows: list[tuple[float, float, float, float]] = field(default_factory=list)  # (t, log tpot, log2 batch, k)
    bins: dict[int, list[float]] | None = None  # bin -> [intervals, sum of log2 batch, sum of log tpot]
    mix_acov: list[float] = field(default_factory=lambda: [0.0])  # autocovariances of the mix in log TPOT, lags 0..
    req_var: float = 0.0  # per-request variance (an interval of k requests carries req_var / k)
    noise_blocks: list[tuple[list[float], float]] = field(default_factory=list)  # (acov, req) per block
    warm_dropped: bool = False  # the warm-up's noise estimate has been replaced by measured blocks
    block: list[tuple[float, float]] = field(default_factory=list)  # (residual, k) joined since the last block
    rows: list[tuple[float, ...]] = field(default_factory=list)  # (t, residual, reference variance, model error
    # bound, requests) over the longest window
    held: list[tuple[float, float, float, float]] = field(default_factory=list)  # (due, log tpot, log2 batch, k)
    window_z: list[float] = field(default_factory=list)  # per window: (mean - bound) / s.e., the test's z
    alarm: Alarm | None = None
    alarms: int = 0
    unknown: int = 0

    @property
    def ready(self) -> bool:
        return self.bins is not None

    @property
    def mix_var(self) -> float:
        """Long-run variance of the mix (Bartlett weights over the measured lags): one interval's
        share of a long sum, as the reference's points are."""
        a, lags = self.mix_acov, len(self.mix_acov) - 1
        return max(a[0] + 2.0 * sum((1.0 - j / (lags + 1.0)) * g for j, g in enumerate(a[1:], start=1)), a[0])

    def update(self, t: float, mean_tpot: float, running: float, requests: float = 1.0) -> Alarm | None:
        """One interval: the mean TPOT of the ``requests`` that finished in it, at ``running`` per
        engine (the mean over the interval). Returns a new alarm, else None."""
        p = self.params
        if not (mean_tpot > 0 and math.isfinite(mean_tpot) and running >= 0 and math.isfinite(running)):
            self.unknown += 1
            return None
        if self.started is None:
            self.started = t
        y, u, k = math.log(mean_tpot), math.log2(max(running, 1.0)), max(float(requests), 1.0)
        if self.bins is None:
            self.warm_rows.append((t, y, u, k))
            if t - self.started >= p.warmup_s and len(self.warm_rows) >= p.min_warmup_intervals:
                self._learn()
            return None
        pred = self._predict(u)
        if pred is None:
            self.unknown += 1
            return None
        mu, ref_var, bound = pred
        self.rows.append((t, y - mu, ref_var, bound, k))
        self._hold(t, y, u, k)
        fired = self._window(t)
        if fired is not None:
            if self.alarm is None:
                self.alarm = fired
                self.alarms += 1
                self.held.clear()
                return fired
            self.alarm.after, self.alarm.statistic = fired.after, fired.statistic
            return None
        if self.alarm is not None and t - self.alarm.at >= p.resolve_s and self._calm_since(t - p.resolve_s):
            self.alarm = None
        return None

    def _learn(self) -> None:
        p = self.params
        self.bins = {}
        for _, y, u, _k in self.warm_rows:
            self._add(y, u)
        e, k, spent = self._warm_residuals()
        # in-sample residuals are smaller than the true noise by the parameters they spend
        inflate = len(e) / max(len(e) - spent, 1)
        # an hour holds few independent stretches: lags up to a sixth of it
        acov, req = noise_model(e, k, min(p.lr_lags, len(e) // 6))
        self.noise_blocks = [([g * inflate for g in acov], req * inflate)]
        self.mix_acov, self.req_var = self.noise_blocks[0]
        self.window_z = [math.nan for _ in p.windows_s]
        self.warm_rows = []

    def _warm_residuals(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(residuals in time order, requests, parameters spent) of the warm-up around its bins'
        means plus one slope within the bins shared by all of them. The noise is measured on these,
        not on residuals from the reference: a warm-up spread thin over the batch sizes leaves bins
        under ``min_bin_intervals`` that the reference extrapolates to, and that extrapolation's
        error is the model-error bound's business, not noise (the demo's 15-min warm-up over a
        batch of 6-16 read a mix s.d. of 23 % for a TPOT within 2 %, and hid a 60 % slowdown)."""
        w = self.params.bin_width
        rows = self.warm_rows
        y = np.array([r[1] for r in rows])
        u = np.array([r[2] for r in rows])
        k = np.array([r[3] for r in rows])
        b = np.array([load_bin(2.0**v, w) for v in u])
        dy, du = y.copy(), u.copy()
        for g in np.unique(b):
            m = b == g
            dy[m] -= y[m].mean()
            du[m] -= u[m].mean()
        sxx = float(du @ du)
        slope = min(max(float(du @ dy) / sxx, 0.0), self.params.max_slope) if sxx > 1e-12 else 0.0
        return dy - slope * du, k, len(np.unique(b)) + (1 if sxx > 1e-12 else 0)

    def _add(self, y: float, u: float) -> None:
        b = self.bins.setdefault(load_bin(2.0**u, self.params.bin_width), [0.0, 0.0, 0.0])
        b[0] += 1
        b[1] += u
        b[2] += y

    def _points(self) -> list[tuple[float, float, float]]:
        """(mean log2 batch, mean log TPOT, intervals) of each bin with enough intervals, by batch."""
        m = self.params.min_bin_intervals
        pts = [(b[1] / b[0], b[2] / b[0], b[0]) for b in self.bins.values() if b[0] >= m]
        if not pts and self.bins:  # a warm-up spread thin: the best-filled bin alone
            b = max(self.bins.values(), key=lambda v: v[0])
            pts = [(b[1] / b[0], b[2] / b[0], b[0])]
        return sorted(pts)

    def _predict(self, u: float) -> tuple[float, float, float] | None:
        """(reference log TPOT, its variance, a bound on its model error) at log2 batch ``u``:
        interpolated between the two neighbouring points, or extended from the edge with the edge
        slope and a model error that grows per doubling beyond it. The bound is a bias, not noise:
        the test takes it off on the safe side."""
        pts = self._points()
        if not pts:
            return None
        p = self.params
        point_var = self.mix_var + self.req_var / 8.0  # one interval's variance, ~8 requests (conservative)
        us = [q[0] for q in pts]
        i = int(np.searchsorted(us, u))
        if 0 < i < len(pts):
            (ua, ya, na), (ub, yb, nb) = pts[i - 1], pts[i]
            w = (u - ua) / (ub - ua) if ub > ua else 0.5
            return ya + w * (yb - ya), point_var * ((1 - w) ** 2 / na + w * w / nb), 0.0
        edge_u, edge_y, edge_n = pts[0] if i == 0 else pts[-1]
        # the edge slope from the farthest point within two doublings; points closer than one doubling
        # say little about it: then it is somewhere between flat and proportional (half, +- half)
        near = [q for q in pts if 1.0 <= abs(q[0] - edge_u) <= 2.0]
        d = abs(u - edge_u)
        if not near:
            half = 0.5 * math.log(2.0)
            return edge_y + half * (u - edge_u), point_var / edge_n, half * d
        ou, oy, _ = max(near, key=lambda q: abs(q[0] - edge_u))
        slope = min(max((edge_y - oy) / (edge_u - ou), 0.0), p.max_slope)
        return edge_y + slope * (u - edge_u), point_var / edge_n, p.extrapolation_error * d

    def _window(self, t: float) -> Alarm | None:
        """The mean residual over each trailing window (once judging has lasted that long), less the
        model-error bound, in standard errors (``_z``). The most extreme window beyond the
        threshold, if any."""
        p = self.params
        keep = t - max(p.windows_s, default=0.0)
        while self.rows and self.rows[0][0] <= keep:
            self.rows.pop(0)
        if not p.windows_s:
            return None
        arr = np.array(self.rows, dtype=float).reshape(-1, 5)
        zt = p.threshold
        best = None
        for j, w in enumerate(p.windows_s):
            sel = arr[arr[:, 0] > t - w]
            if t - self._judged_since() < w - 0.5 * p.interval_s or len(sel) == 0:
                self.window_z[j] = math.nan
                continue
            z = self._z(sel)
            self.window_z[j] = z
            if z > zt and (best is None or z > best[1]):
                best = (w, z)
        if best is None:
            return None
        sel = arr[arr[:, 0] > t - best[0]]  # the change point inside the window that fired
        change_at, level = change_point(sel[:, 0], sel[:, 1])
        return Alarm(t, "up", 1.0, math.exp(level), change_at, best[1], zt, test="window")

    def _judged_since(self) -> float:
        """When judging began: the warm-up's end (windows are judged once full)."""
        return self.started + self.params.warmup_s if self.started is not None else math.inf

    def _calm_since(self, t0: float) -> bool:
        """The residuals since ``t0`` are within ref_clear_z standard errors of the reference."""
        sel = np.array([r for r in self.rows if r[0] > t0], dtype=float).reshape(-1, 5)
        return bool(len(sel)) and self._z(sel) < self.params.ref_clear_z

    def _z(self, sel: np.ndarray) -> float:
        """(mean residual - mean model-error bound) / standard error of consecutive rows: the mix's
        autocovariances over their length, each interval's per-request noise, the reference's error
        (shared by the rows: not averaged down) and the wander."""
        n = len(sel)
        noise = mean_variance(self.mix_acov, n) + self.req_var * float((1.0 / sel[:, 4]).sum()) / n**2
        noise = max(noise, self.params.min_cv**2 / n)
        se = math.sqrt(noise + float(sel[:, 2].mean()) + self.params.wander**2)
        return (float(sel[:, 1].mean()) - float(sel[:, 3].mean())) / se

    def _hold(self, t: float, y: float, u: float, k: float) -> None:
        """An interval joins the reference once ref_hold_s old if no alarm was open since it came and
        no window then sees a slowdown beyond ref_clear_z standard errors; otherwise it is dropped.
        Joined intervals also re-estimate the noise, a block of warmup_s at a time."""
        p = self.params
        if self.alarm is not None:
            self.held.clear()
            return
        pred = self._predict(u)
        outside = pred is not None and pred[2] > 0.0
        self.held.append((t + (p.new_load_hold_s if outside else p.ref_hold_s), y, u, k))
        # calm: no window sees a slowdown beyond the model's own uncertainty. A speed-up joins: the
        # test is one-sided, and a reference that stays above a faster TPOT (a warm-up during the
        # engines' fill-up, an upgrade) hides the next slowdown instead
        calm = all(not (z >= p.ref_clear_z) for z in self.window_z)
        due = [h for h in self.held if h[0] <= t]
        if not due:
            return
        self.held = [h for h in self.held if h[0] > t]
        for _, y0, u0, k0 in due:
            if not calm:
                continue
            pred = self._predict(u0)
            if pred is not None and pred[2] == 0.0:  # noise is learned inside the reference's range only
                self.block.append((y0 - pred[0], k0))
            self._add(y0, u0)
        if p.jitter_blocks > 0 and len(self.block) * p.interval_s >= p.warmup_s:
            e = np.array([r for r, _ in self.block])
            kk = np.array([q for _, q in self.block])
            fresh = noise_model(e, kk, min(p.lr_lags, len(e) // 3))
            # the warm-up's estimate (the first block) is kept only until two measured blocks replace it
            kept = self.noise_blocks[1:] if len(self.noise_blocks) == 2 and not self.warm_dropped else self.noise_blocks
            self.warm_dropped = self.warm_dropped or kept is not self.noise_blocks
            self.noise_blocks = [*kept, fresh][-p.jitter_blocks:]
            self.block = []
            lags = min(len(a) for a, _ in self.noise_blocks)
            acov = np.mean([a[:lags] for a, _ in self.noise_blocks], axis=0)
            req = float(np.mean([r for _, r in self.noise_blocks]))
            # the mean of K block estimates is itself uncertain: taken one s.d. high (~0.5 / sqrt K)
            high = 1.0 + 0.5 / math.sqrt(len(self.noise_blocks))
            self.mix_acov, self.req_var = [float(g) * high for g in acov], req * high

    def snapshot(self) -> dict:
        pts = self._points() if self.bins is not None else []
        return {
            "reference": [{"running": round(2.0**u, 2), "tpot_s": math.exp(y), "intervals": int(n)} for u, y, n in pts]
            or None,
            "noise": {"mix_sd": math.sqrt(self.mix_acov[0]), "mix_long_run_sd": math.sqrt(self.mix_var),
                      "per_request_sd": math.sqrt(self.req_var)},
            "threshold": self.params.threshold,
            "window_z": [None if math.isnan(z) else round(z, 2) for z in self.window_z],
            "alarms": self.alarms,
            "unknown_intervals": self.unknown,
            "open": self.alarm is not None,
        }


def scan_latency(t: np.ndarray, tpot_sum: np.ndarray, tpot_count: np.ndarray, running: np.ndarray,
                 params: LatencyDriftParams = LatencyDriftParams()) -> tuple[list[Alarm], LatencyDrift]:
    """Replay recorded TPOT histogram counters (``_sum``, ``_count``) and the running-requests
    gauge as the guard reads them: every ``interval_s`` the mean TPOT of the requests that finished
    in it and the mean of the running requests sampled in it; an interval with a counter reset is
    skipped."""
    t = np.asarray(t, float)
    order = np.argsort(t, kind="stable")
    t, tpot_sum, tpot_count, running = (t[order], np.asarray(tpot_sum, float)[order],
                                        np.asarray(tpot_count, float)[order], np.asarray(running, float)[order])
    cus = LatencyDrift(params)
    alarms: list[Alarm] = []
    if len(t) < 2:
        return alarms, cus
    ends = np.arange(t[0] + params.interval_s, t[-1] + 1e-9, params.interval_s)
    idx = np.searchsorted(t, ends, side="right") - 1
    prev = int(np.searchsorted(t, t[0], side="right") - 1)
    for te, i in zip(ends, idx, strict=True):
        ds, dc = tpot_sum[i] - tpot_sum[prev], tpot_count[i] - tpot_count[prev]
        run = float(np.mean(running[prev + 1:i + 1])) if i > prev else float(running[i])
        prev = int(i)
        if dc > 0 and ds >= 0:
            a = cus.update(float(te), float(ds / dc), run, float(dc))
            if a is not None:
                alarms.append(a)
    return alarms, cus
