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

Latency: TPOT per interval is compared with a baseline for the same load bin (running requests,
log2 bins) learned during warm-up, through a Gaussian-mean CUSUM on the relative increase, so a
busier batch is not called a drift.
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
    wander_corr_s: float = 3600.0  # its correlation time: a reference spanning S carries ~2 T / S of its variance
    trend_tau_margin: float = 0.5  # relative s.d. of one block's jitter estimate: the window test takes it 1 s.d. high
    trend_z: float = 0.0  # > 0: the window test's threshold (standard errors); 0: from ARL0 (trend_threshold)
    ref_hold_s: float = 7200.0  # > 0: intervals this old join the reference while no test sees a change
    ref_clear_z: float = 2.0  # ... i.e. every window within this many standard errors, no alarm open

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

    @property
    def ready(self) -> bool:
        return self.p0 is not None

    @property
    def threshold(self) -> float:
        return self.h if self.h is not None else self.params.threshold

    def _band(self, direction: str) -> tuple[float, float]:
        """(q0, p1): the band edge and the design rate beyond it, on one side of p0. The band is
        widened by the frozen reference's own error (ref_margin standard errors)."""
        p, p0 = self.params, float(self.p0)
        tol = p.tolerance + p.ref_margin * self.ref_se
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
        return p.trend_wander**2 * (1.0 + min(1.0, 2.0 * p.wander_corr_s / span))

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
    ok = (dn >= 0) & (dx >= 0) & (dx <= dn)
    te, nn, xx = bin_counts(ti[ok], dn[ok], dx[ok], params.interval_s)
    cus = RateCusum(params)
    alarms = [
        a
        for a in (cus.update(float(a), float(b), float(c)) for a, b, c in zip(te, nn, xx, strict=True))
        if a is not None
    ]
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
                self.base = {
                    k: (float(np.mean(v)), float(np.std(v, ddof=1)))
                    for k, v in self.warm.items()
                    if len(v) >= p.min_warmup_intervals
                }
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
                self.alarm = Alarm(t, "up", 1.0, after, self.since[0], self.s, p.threshold)
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
        return {
            "baseline": (
                {str(2**k): {"mean_s": m, "sd_s": s} for k, (m, s) in self.base.items()}
                if self.base is not None
                else None
            ),
            "cusum": self.s,
            "threshold": self.params.threshold,
            "alarms": self.alarms,
            "unknown_intervals": self.unknown,
            "open": self.alarm is not None,
        }
