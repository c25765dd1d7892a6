"""Host-memory leak detection on one process's RSS series: pure functions, no I/O, no clocks.

The method (docs/detectors.md, "Host-memory leak"), chosen on an independent generator's tuning
seeds and reported on its sealed seeds (bench/detectors):

1. **Segments.** A fall of RSS by more than 25 % between samples, a sample more than 256 MiB
   under its segment's 30-minute floor (a new process that starts with the model loaded), or a
   hole over 30 min, is a restart; each segment is judged on its own, and only the latest one live.
2. **Floor.** The minimum of RSS over a trailing window, one point per 5 min bucket. The window
   is 10 min, or 1.5 x the allocator/GC sawtooth period measured from the series' own drops
   (up to 40 min), so the sawtooth vanishes whatever its period; a leak raises the floor.
3. **Steps.** A jump of the floor between two buckets beyond 80 MiB and 5 robust s.d. of the
   bucket differences (an allocator step, memory returned, a plateau reached quickly) is taken
   out of the floor: the level after it is shifted by the jump, the trend is kept.
4. **Start-up growth is never a leak.** Nothing is judged in the first 90 min of a process;
   a window that starts within 6 h of the start has the best saturating curve
   ``a (1 - exp(-(t - start) / tau))`` (tau 5..90 min, a >= 0) fitted jointly with a line and
   removed before it is tested, so what remains is the part of the growth that does not slow down;
   if the curve alone (tau <= 60 min, no line) fits about as well (``startup_only_slack``), the
   window is start-up and nothing is left to test (a line would otherwise carry the tail's slope).
   A level step down (step 3: memory given back, a warm restart too shallow for step 1) counts as
   a start for this curve: what follows it may be a refill.
5. **Load** (optional): the RSS that moves with the running requests is removed sample by
   sample, before the floor is taken (``sample_load_coef``: bytes per request from the
   sample-to-sample co-movement, so a trend cannot confound it; the minimum of a sum is not the
   sum of the minima, so removing it from the floor afterwards left part of it in).
6. **Trend test** on the last 2 h and 4 h: Theil-Sen slope, Mann-Kendall z (variance
   inflated for serial correlation) >= 5, slope and rise over thresholds, still growing in the
   last half, not better explained by one or two level steps than by a line or a hinge; two
   consecutive buckets must agree (a transient says "leak" once).
7. **Onset**: the knot of the best flat-then-rising fit of the floor since the exclusion, over
   the window that found the trend plus 2 h (at most 6 h), each floor point placed at the time
   its minimum was sampled (while RSS rises that is the floor window's oldest sample).

A positive verdict carries slope, confidence, onset and the projected time to the memory limit.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

MIB = 1024.0 * 1024.0
HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class LeakParams:
    """Production parameters. ``scaled(k)`` compresses time by ``k`` (durations / k, slopes * k)
    so a short test can run the same detector on a k-times faster leak."""

    bucket_s: float = 300.0  # one floor point per bucket
    floor_window_s: float = 600.0  # shortest floor window (min of RSS over it)
    max_floor_window_s: float = 2400.0  # longest one (a 30 min sawtooth needs ~40 min)
    sawtooth_factor: float = 1.5  # floor window = this x the sawtooth period (75th percentile)
    warmup_s: float = 5400.0  # nothing judged this long after each (re)start: an S-shaped fill with
    # a 60 min time constant is over by then; its decelerating tail is removed as start-up growth
    long_warmup_s: float = 6 * HOUR  # windows starting this soon after a start remove start-up growth
    startup_taus_s: tuple[float, ...] = (300.0, 600.0, 1200.0, 1800.0, 2700.0, 3600.0, 5400.0)
    # a window whose rise the start-up curve explains on its own (no line, tau <= 60 min: the
    # issue's start-up family) within this share of the error of curve + line is start-up, not a
    # leak: the line of a joint fit otherwise takes the tail's slope (a tau = 60 min tail read
    # as a 23 MiB/h leak 4.3 h after a start). < 0 turns it off.
    startup_only_slack: float = 0.5
    startup_only_max_tau_s: float = 3600.0
    release_refill: bool = True  # after a level step down, growth is tested against a refill curve
    # the onset's knot is searched over the window that found the trend plus ``onset_margin_s``, at
    # most ``onset_lookback_s`` (24 h, round 2, let daily swings place it hours off: 54 -> 69 %
    # within 30 min on the tuning seeds; a flat 6 h until session 21 let a plateau 3-4 h before
    # the onset pull the knot to it: 67.8 -> 75.6 % with the minimum's sample times)
    onset_lookback_s: float = 6 * HOUR
    onset_margin_s: float = 2 * HOUR
    windows_s: tuple[float, ...] = (2 * HOUR, 4 * HOUR)  # an 8 h window (for ~10 MiB/h) read the daily swing
    # and start-up tails as leaks: 1.6 more false alarms per 30 process-days on the tuning seeds
    min_rise_bytes: tuple[float, ...] = (48 * MIB, 64 * MIB)  # per window
    min_coverage: float = 0.7  # a window needs this share of its span in judged data
    short_coverage: float = 0.5  # the shortest window: 1 h of data after the exclusion is a test
    min_points: int = 12
    z_crit: float = 5.0  # one-sided Mann-Kendall z (autocorrelation-corrected); 4 raised false alarms 2x
    min_slope_bps: float = 8.0 * MIB / HOUR  # below this growth is not worth a page
    step_bytes: float = 80 * MIB  # a floor jump beyond this (and step_sd robust s.d.) is a step; 40 MiB also
    # took out the floor's own jumps under a leak (a sawtooth floor rises in stairs)
    step_sd: float = 5.0
    persistence: float = 0.5  # last-half slope must be >= this share of the window slope
    restart_drop: float = 0.25  # a fall by more than this fraction between samples = restart
    # ... or below the trailing floor by more than this: a new process whose first sample already
    # holds the model (a fall of only its start-up growth, 5-10 % of the RSS) is a restart too;
    # GC drops and the end of a spike return to the floor, memory returned (<= 192 MiB) stays above
    restart_below_floor_bytes: float = 256 * MIB
    restart_floor_window_s: float = 1800.0
    max_gap_s: float = 1800.0  # a hole longer than this also starts a new segment
    confirm: int = 2  # consecutive buckets whose verdict must be "leak"
    # periodic swings (an hourly job, a cache flush) taken out of the floor before the tests when
    # a harmonic fit over the last ``seasonal_lookback_s`` of judged floor finds them
    seasonal_period_s: float = HOUR  # 0: off
    seasonal_lookback_s: float = 12 * HOUR
    seasonal_min_span_s: float = 3 * HOUR
    seasonal_p: float = 1e-6
    # a rise over at most ``ramp_max_s`` followed by a flat floor of at least ``ramp_min_flat_s`` is
    # a ramped step (an allocator plateau reached over minutes, a load burst's edge through the
    # floor window), not a trend, when it fits the window within this share of the line's or
    # hinge's error (session 20; 0 turns it off). The one- or two-break step fit reads such a
    # ramp as a staircase and keeps its error high.
    ramp_step_ratio: float = 1.0
    ramp_min_flat_s: float = 1200.0
    ramp_max_s: float = HOUR
    return_memory_s: float = 6 * HOUR  # a fall back to a level held this recently ends an excursion
    excursion_envelope_s: float = 2 * HOUR  # longest running minimum over repeated excursions (0: off)
    excursion_lookback_s: float = 6 * HOUR
    excursion_min_count: int = 2

    def scaled(self, k: float) -> LeakParams:
        """Every duration (a field named ``*_s``) divided by ``k`` and every slope (``*_bps``)
        multiplied by it; bytes, z and shape thresholds unchanged. By the names, so a new
        duration cannot be left on the real clock."""
        if k <= 0:
            raise ValueError("time scale must be > 0")
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s"):
                out[f.name] = tuple(x / k for x in v) if isinstance(v, tuple) else v / k
            elif f.name.endswith("_bps"):
                out[f.name] = v * k
        return replace(self, **out)

    def rise_for(self, i: int) -> float:
        r = self.min_rise_bytes
        return r[min(i, len(r) - 1)]


@dataclass(frozen=True, slots=True)
class WindowResult:
    """The leak test on one window of floor points (``window_test``); JSON-able through
    ``dataclasses.asdict`` (``LeakVerdict.as_dict`` keeps one per window)."""

    slope_bps: float  # Theil-Sen slope of the floor, bytes/s
    z: float  # Mann-Kendall statistic
    n: int  # floor points in the window
    leak: bool
    reason: str  # "trend" when a leak, else why not
    window_s: float | None = None  # the window's length (None: the span of the points)


@dataclass(slots=True)
class LeakVerdict:
    """The state of one process series at its last sample. ``status`` is "leak", "ok" or
    "unknown" (too little judged data: never reported as ok)."""

    status: str
    reason: str
    at: float | None = None
    slope_bps: float = 0.0
    z: float = 0.0
    p_value: float = 1.0
    window_s: float = 0.0
    floor_bytes: float | None = None
    onset: float | None = None
    limit_bytes: float | None = None
    eta_s: float | None = None
    bytes_per_work: float | None = None
    segment_start: float | None = None
    hourly_swing_bytes: float = 0.0  # half-amplitude of the periodic swing taken out of the floor (0: none found)
    # the 4 h window read the levels the floor fell back to, then its minimum over this span (0: the floor)
    excursion_envelope_s: float = 0.0
    windows: list[WindowResult] = field(default_factory=list)

    @property
    def detected(self) -> bool:
        return self.status == "leak"

    @property
    def slope_mib_per_h(self) -> float:
        return self.slope_bps * HOUR / MIB

    @property
    def confidence(self) -> float:
        return 1.0 - self.p_value

    def as_dict(self) -> dict:
        d = asdict(self)
        d["detected"] = self.detected
        d["slope_mib_per_h"] = round(self.slope_mib_per_h, 3)
        d["confidence"] = self.confidence
        return d


# --- building blocks ------------------------------------------------------------------------


def segments(
    t: np.ndarray,
    v: np.ndarray,
    drop: float = 0.25,
    max_gap_s: float = math.inf,
    below_floor_bytes: float = math.inf,
    floor_window_s: float = 1800.0,
) -> list[slice]:
    """Index ranges between restarts: a sudden fall of RSS by more than ``drop`` (a new process
    starts small), a sample more than ``below_floor_bytes`` under the minimum of its segment's
    last ``floor_window_s`` (a new process that starts where the model is loaded, below the old
    one's floor by its start-up growth), or a hole longer than ``max_gap_s``."""
    if len(t) == 0:
        return []
    prev = v[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        fell = (v[1:] < prev * (1.0 - drop)) & (prev > 0)
    gap = np.diff(t) > max_gap_s
    cut = np.concatenate(([False], fell | gap))
    if math.isfinite(below_floor_bytes):
        cut |= _under_floor(t, v, cut, below_floor_bytes, floor_window_s)
    bounds = [0, *np.flatnonzero(cut).tolist(), len(t)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _under_floor(t: np.ndarray, v: np.ndarray, cut: np.ndarray, below: float, window_s: float) -> np.ndarray:
    """Samples under the minimum of the samples before them (in their segment, over the trailing
    ``window_s``) by more than ``below``; a sample found starts a new segment. Range minima from a
    sparse table, O(n log n) in numpy: the trailing-minimum deque it replaces (restarted at every
    cut, tests/test_leak_cost.py keeps it) was a Python step per sample, a sixth of a 12 h check."""
    n = len(t)
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    table = [v]  # table[k][i]: the minimum of v[i : i + 2**k]
    while 2 ** len(table) <= n:
        h = 2 ** (len(table) - 1)
        table.append(np.minimum(table[-1][:-h], table[-1][h:]))
    idx = np.arange(n)
    by_time = np.searchsorted(t, t - window_s, side="left")  # the oldest sample in each one's window
    seg = np.maximum.accumulate(np.where(cut, idx, 0))  # where each one's segment (so far) starts
    start = 1
    while start < n:
        lo = np.maximum(by_time[start:], seg[start:])
        hi = idx[start:]  # exclusive: the minimum is over v[lo:hi]
        has = lo < hi
        lo, hi = lo[has], hi[has]
        k = np.frexp((hi - lo).astype(float))[1] - 1  # floor(log2(length)), exact
        m = np.full(len(lo), np.inf)
        for level in np.unique(k):
            sel = k == level
            rows = table[level]
            m[sel] = np.minimum(rows[lo[sel]], rows[hi[sel] - 2**level])
        hit = np.flatnonzero(v[start:][has] < m - below)
        if not len(hit):
            break
        i = int(hi[hit[0]])
        out[i] = True
        seg[i:] = np.maximum(seg[i:], i)  # the window restarts at the sample found
        start = i + 1
    return out


def floor_series(
    t: np.ndarray, v: np.ndarray, bucket_s: float, floor_window_s: float, origin: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Minimum of ``v`` over the trailing ``floor_window_s``, one point per non-empty bucket
    (stamped at the bucket end). Removes sawtooth whose period is below the floor window."""
    if len(t) == 0:
        return np.empty(0), np.empty(0)
    t0 = t[0] if origin is None else origin
    idx = np.floor((t - t0) / bucket_s).astype(np.int64)
    nb = int(idx[-1]) + 1
    mins = np.full(nb, np.inf)
    np.minimum.at(mins, idx, v)
    # rolling min over the window's buckets (missing buckets are +inf and so ignored)
    roll = _trailing_min(mins, max(1, math.ceil(floor_window_s / bucket_s)))
    present = np.isfinite(mins)
    ends = t0 + (np.arange(nb) + 1.0) * bucket_s
    return ends[present], roll[present]


def _trailing_min(a: np.ndarray, n: int) -> np.ndarray:
    """The minimum of each point and the ``n - 1`` before it (fewer at the start)."""
    out = a.copy()
    for j in range(1, min(n, len(a))):
        out[j:] = np.minimum(out[j:], a[:-j])
    return out


@functools.lru_cache(maxsize=512)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(n, k=1)``, cached: ``scan`` asks for the same few sizes thousands of
    times (read-only arrays, bounded cache)."""
    i, j = np.triu_indices(n, k=1)
    i.flags.writeable = False
    j.flags.writeable = False
    return i, j


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Median of pairwise slopes (robust to a minority of outliers) and the median intercept."""
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        return 0.0, _median(y) if len(y) else 0.0
    slope = _median((y[j] - y[i])[ok] / dx[ok])
    return slope, _median(y - slope * x)


def _acf(r: np.ndarray, nlags: int) -> np.ndarray:
    r = r - r.mean()
    den = float(np.dot(r, r))
    if den == 0:
        return np.zeros(nlags)
    return np.array([float(np.dot(r[:-k], r[k:])) / den for k in range(1, nlags + 1)])


def mann_kendall(
    x: np.ndarray, y: np.ndarray, slope: float | None = None, fitted: np.ndarray | None = None
) -> tuple[float, float]:
    """Mann-Kendall trend statistic S and a z-score whose variance is inflated for serial
    correlation (Hamed & Rao 1998, on ranks of the Theil-Sen-detrended series; only lags with
    significant autocorrelation count, and the factor is never below 1)."""
    n = len(y)
    if n < 3:
        return 0.0, 0.0
    i, j = _pairs(n)
    s = float(np.sign(y[j] - y[i]).sum())
    _, counts = np.unique(y, return_counts=True)
    var = (n * (n - 1) * (2 * n + 5) - float(np.sum(counts * (counts - 1) * (2 * counts + 5)))) / 18.0
    if fitted is not None:
        detr = y - fitted
    else:
        if slope is None:
            slope, _ = theil_sen(x, y)
        detr = y - slope * x
    ranks = np.argsort(np.argsort(detr)).astype(float)
    nlags = max(1, n // 3)
    rho = _acf(ranks, nlags)
    k = np.arange(1, nlags + 1)
    sig = np.abs(rho) > 1.96 / math.sqrt(n)
    corr = 1.0 + 2.0 / (n * (n - 1) * (n - 2)) * float(np.sum(((n - k) * (n - k - 1) * (n - k - 2) * rho)[sig]))
    var *= max(1.0, corr)
    if var <= 0:
        return s, 0.0
    z = (s - np.sign(s)) / math.sqrt(var)
    return s, float(z)


def one_sided_p(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def step_sse(y: np.ndarray, breaks: int = 2) -> float:
    """Least-squares error of the best piecewise-constant fit with up to two breaks (one or two
    allocator steps in a window look like a trend to Mann-Kendall, not to this)."""
    n = len(y)
    if n < 3:
        return 0.0
    c1 = np.concatenate([[0.0], np.cumsum(y)])
    c2 = np.concatenate([[0.0], np.cumsum(y * y)])

    def seg(a, b):  # SSE of y[a:b] around its mean, vectorized over index arrays
        return c2[b] - c2[a] - (c1[b] - c1[a]) ** 2 / (b - a)

    m = np.arange(1, n)
    best = float(np.min(seg(0, m) + seg(m, n)))
    if breaks >= 2 and n >= 3:
        i, j = _pairs(n - 1)
        i, j = i + 1, j + 1  # 1 <= i < j <= n-1
        best = min(best, float(np.min(seg(0, i) + seg(i, j) + seg(j, n))))
    return best


def ramp_step_sse(x: np.ndarray, y: np.ndarray, min_flat_s: float, max_ramp_s: float) -> float:
    """Least-squares error of the best ramped step: flat, rising linearly for at most ``max_ramp_s``,
    then flat again for at least ``min_flat_s`` up to the window's end (inf: no such fit)."""
    n = len(x)
    if n < 4:
        return math.inf
    i, j = _pairs(n)  # knot indices, i < j
    k1, k2 = x[i], x[j]
    ok = (k2 <= x[-1] - min_flat_s) & (k2 - k1 <= max_ramp_s)
    if not ok.any():
        return math.inf
    k1, k2 = k1[ok], k2[ok]
    sse, _ = _rising_fits(np.clip(x[None, :], k1[:, None], k2[:, None]) - k1[:, None], y)
    return float(sse.min())


def _rising_fits(g: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares of ``y`` on a + b x g for each row of ``g`` (one shape per row): (SSE per row,
    fitted values per row). Rows whose best b is not positive get an infinite SSE."""
    gm = g.mean(axis=1, keepdims=True)
    ym = y.mean()
    var = ((g - gm) ** 2).sum(axis=1)
    cov = ((g - gm) * (y - ym)[None, :]).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(var > 0, cov / var, 0.0)
    fitted = ym + b[:, None] * (g - gm)
    sse = ((y[None, :] - fitted) ** 2).sum(axis=1)
    sse[b <= 0] = np.inf
    return sse, fitted


def _hinge_fits(x: np.ndarray, y: np.ndarray, knots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares flat-then-rising fits, one per knot: (SSE per knot, fitted values per knot).
    Knots whose best slope is not positive get an infinite SSE."""
    return _rising_fits(np.maximum(0.0, x[None, :] - knots[:, None]), y)  # knots x points


def hinge_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray] | None:
    """Least-squares flat-then-rising fit (knot at a sample, slope > 0): (SSE, fitted values).
    A window that holds a leak's onset has this shape, not a line's."""
    n = len(x)
    if n < 4:
        return None
    sse, fitted = _hinge_fits(x, y, x[: n - 2])
    if not np.isfinite(sse).any():
        return None
    k = int(np.argmin(sse))
    return float(sse[k]), fitted[k]


def sample_load_coef(
    v: np.ndarray, load: np.ndarray, min_points: int = 60, span: int = 60, z_min: float = 5.0
) -> float | None:
    """Bytes per running request: least squares of RSS's sample-to-sample differences on the
    load's, each less its local mean (over ``span`` differences). Differencing turns a linear
    trend into a constant; the local means also take out a leak's onset (its differences step up)
    and a slow load swing, which would otherwise pass for co-movement: the coefficient is
    identified by the load's fast moves only. Differences beyond 4 robust s.d. (sawtooth
    collections, spikes, allocator steps) are left out for the first fit, which decides whether
    there is a coefficient at all: None when the load does not move enough to say (under
    ``z_min`` standard errors: a smooth load leaves almost nothing once its local mean is out), or
    moves RSS the wrong way. The value is then refitted with that cut on the fit's residuals
    instead (session 20): a strong coupling's own moves, a load burst's edges, are beyond 4 s.d.
    of RSS's differences, and cutting on them biased the coefficient low (10th percentile 0.82 of
    the true one on families.py's tuning series, 0.94 refitted)."""
    dv, dl = np.diff(v), np.diff(load)
    if len(dv) < min_points:
        return None
    dv0, dl0 = dv, dl
    keep = np.abs(dv - _median(dv)) <= 4.0 * max(_mad_sd(dv), 1.0)
    dv, dl = dv[keep], dl[keep]
    if len(dv) < max(min_points, span) or np.count_nonzero(dl) < min_points:
        return None
    box = np.ones(span) / span

    def local(a: np.ndarray) -> np.ndarray:  # less its local mean
        return a - np.convolve(a, box, mode="same")

    x, y = local(dl), local(dv)
    sxx = float(x @ x)
    if sxx <= 0:
        return None
    c = float(x @ y) / sxx
    resid = y - c * x
    se = math.sqrt(float(resid @ resid) / (len(y) - 1) / sxx)
    if c <= z_min * se:
        return None
    x0, y0 = local(dl0), local(dv0)  # the refit: the cut on the fit's residuals (see above)
    for _ in range(3):
        r0 = y0 - c * x0
        k2 = np.abs(r0 - _median(r0)) <= 4.0 * max(_mad_sd(r0), 1.0)
        sxx = float(x0[k2] @ x0[k2])
        if sxx <= 0:
            break
        c = float(x0[k2] @ y0[k2]) / sxx
    return c if c > 0 else None


def _load_at(ts: np.ndarray, load: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """The load series at the RSS sample times (the guard scrapes both; a CSV has one row each)."""
    if load is None:
        return None
    lt, lv = _clean(*load)
    if len(lt) < 3:
        return None
    return np.interp(ts, lt, lv)


def _without_load(ts: np.ndarray, vs: np.ndarray, r: np.ndarray | None, now: float, p: LeakParams):
    """RSS less its load-following part, with the coefficient learned from the last day up to
    ``now`` (causal); and the coefficient (None without a load or a co-movement)."""
    if r is None:
        return vs, None
    m = (ts <= now) & (ts > now - 24 * HOUR * p.bucket_s / 300.0)
    coef = sample_load_coef(vs[m], r[m])
    return (vs - coef * r if coef else vs), coef


def hinge_onset(x: np.ndarray, y: np.ndarray, max_candidates: int = 200) -> float | None:
    """Start of growth: the knot of the best flat-then-linear fit."""
    n = len(x)
    if n < 4:
        return None
    cand = x[np.unique(np.linspace(0, n - 2, min(max_candidates, n - 1)).astype(int))]
    sse, _ = _hinge_fits(x, y, cand)
    if not np.isfinite(sse).any():
        return None
    return float(cand[int(np.argmin(sse))])


def work_rate(t_work: np.ndarray, work: np.ndarray, start: float, end: float) -> float | None:
    """Average rate of a cumulative work counter in [start, end] (resets tolerated)."""
    m = (t_work >= start) & (t_work <= end)
    if m.sum() < 2:
        return None
    d = np.diff(work[m])
    d = np.where(d < 0, work[m][1:], d)  # a reset restarts the counter from zero
    span = float(t_work[m][-1] - t_work[m][0])
    return float(d.sum() / span) if span > 0 else None


# --- the floor of one segment ---------------------------------------------------------------


def _clean(t, v) -> tuple[np.ndarray, np.ndarray]:
    """Finite, non-negative samples in time order (scrapes can arrive with NaN or out of order)."""
    t = np.asarray(t, dtype=float)
    v = np.asarray(v, dtype=float)
    ok = np.isfinite(t) & np.isfinite(v) & (v >= 0)
    t, v = t[ok], v[ok]
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def _median(a: np.ndarray) -> float:
    """``float(np.median(a))`` of a 1-D float array, the same value (the same order statistics and
    the same mean of the middle two, NaN if any is NaN) without ``np.median``'s generic wrapper,
    which costs 2-4x the partition itself on the hundreds of points the floor's loops pass it."""
    n = len(a)
    if n == 0:
        return float(np.median(a))
    h = n // 2
    if n % 2:
        part = np.partition(a, (h, n - 1))
        m = float(part[h])
    else:
        part = np.partition(a, (h - 1, h, n - 1))
        m = (float(part[h - 1]) + float(part[h])) / 2.0
    return math.nan if math.isnan(part[-1]) else m


def _p75(a: np.ndarray) -> float:
    """``float(np.percentile(a, 75))`` of a 1-D float array without NaN (numpy's default linear
    method: the same order statistics and the same interpolation, ``numpy.lib``'s ``_lerp``), at
    a tenth of its cost."""
    n = len(a)
    vi = (n - 1) * 0.75
    lo = math.floor(vi)
    hi = min(lo + 1, n - 1)
    part = np.partition(a, (lo, hi) if hi != lo else (lo,))
    x0, x1, g = float(part[lo]), float(part[hi]), vi - lo
    diff = x1 - x0
    return x1 - diff * (1.0 - g) if g >= 0.5 else x0 + diff * g


def _mad_sd(d: np.ndarray) -> float:
    if len(d) == 0:
        return 0.0
    return 1.4826 * _median(np.abs(d - _median(d)))


@dataclass(slots=True)
class SegmentFloor:
    """One segment's floor, built causally (each bucket only from the samples up to its end):
    bucket ends ``t``, the floor ``raw``, the floor with level steps taken out ``y``, the floor
    window used at each bucket ``window``, and when each bucket's minimum was sampled ``at`` (a
    rising series' minimum is the window's oldest sample: the floor lags the bucket end by up
    to the window, and the onset is placed by these times)."""

    start: float
    t: np.ndarray
    raw: np.ndarray
    y: np.ndarray
    window: np.ndarray
    at: np.ndarray
    releases: np.ndarray = field(default_factory=lambda: np.empty(0))  # bucket ends of level steps DOWN
    excursions: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))  # (start, end) of each excursion


def _sub_minima(
    t: np.ndarray, v: np.ndarray, origin: float, sub: float, nsub: int
) -> tuple[np.ndarray, np.ndarray]:
    """The minimum of ``v`` in each sub-bucket and the time of its first sample at that minimum."""
    idx = np.floor((t - origin) / sub).astype(np.int64)
    ok = (idx >= 0) & (idx < nsub)
    out = np.full(nsub, np.inf)
    np.minimum.at(out, idx[ok], v[ok])
    when = origin + (np.arange(nsub) + 1.0) * sub
    i, ti = idx[ok], t[ok]
    first = np.flatnonzero(v[ok] == out[i])
    first = first[np.unique(i[first], return_index=True)[1]]  # samples are in time order
    when[i[first]] = ti[first]
    return out, when


def _bucket_floors(
    mins: np.ndarray, when: np.ndarray, windows: np.ndarray, sub: float, per: int, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each bucket's floor (the minimum of the sub-bucket minima ``mins`` over its window), when
    that minimum was sampled, and the previous bucket's floor over this bucket's window (NaN for
    buckets without a sample and for the first). One sliding-window pass per distinct window
    length instead of a Python step per bucket (~0.5 ms of a 12 h check); the minimum is the
    first one, as ``np.argmin`` finds it."""
    nb = len(windows)
    raw = np.full(nb, np.nan)
    prev = np.full(nb, np.nan)  # the previous bucket's floor over this bucket's window
    at = ends.copy()
    present = np.flatnonzero(np.isfinite(mins.reshape(nb, per)).any(axis=1))
    if not len(present):
        return raw, prev, at
    spans = np.ceil(windows / sub).astype(np.int64)
    last = np.concatenate(([-1], present[:-1]))  # the previous bucket with a sample
    e = (present + 1) * per  # each bucket's minima end here (exclusive)
    for span in np.unique(spans[present]).tolist():
        pad = np.concatenate((np.full(span, np.inf), mins))  # mins[e - span : e] is pad[e : e + span]
        view = np.lib.stride_tricks.sliding_window_view(pad, span)
        sel = spans[present] == span
        js, es = present[sel], e[sel]
        i = np.maximum(es - span + np.argmin(view[es], axis=1), 0)  # in the pad only if all are inf
        raw[js], at[js] = mins[i], when[i]
        lj = last[sel]
        other = (lj >= 0) & (windows[np.maximum(lj, 0)] != windows[js])
        prev[js[other]] = view[(lj[other] + 1) * per].min(axis=1)  # the previous bucket's, over this window
    lp = last >= 0
    js, lj = present[lp], last[lp]
    eq = windows[lj] == windows[js]
    prev[js[eq]] = raw[lj[eq]]
    return raw, prev, at


def segment_floor(
    ts: np.ndarray,
    vs: np.ndarray,
    p: LeakParams,
    start: float | None = None,
) -> SegmentFloor:
    """The floor of one segment (samples ``ts``, ``vs`` between two restarts)."""
    start = float(ts[0]) if start is None else float(start)
    per = 5
    sub = p.bucket_s / per
    nb = math.floor((ts[-1] - start) / p.bucket_s) + 1
    mins, when = _sub_minima(ts, vs, start, sub, nb * per)
    # sawtooth drops: falls beyond 4 robust s.d. of the sample differences (and 8 MiB)
    dv = np.diff(vs)
    dt = np.diff(ts)
    lookback = 6 * HOUR * p.bucket_s / 300.0
    ends = start + (np.arange(nb) + 1.0) * p.bucket_s
    windows = np.full(nb, p.floor_window_s)
    k_at = np.searchsorted(ts[1:], ends, side="right")  # diffs up to each bucket end
    lo_at = np.searchsorted(ts[1:], ends - lookback, side="left")
    med_dt = _median(dt) if len(dt) else p.bucket_s
    # falls by more than 8 MiB so far: a window with fewer than 4 of them has no drops, whatever
    # its spread (the drop threshold is at least 8 MiB), and its robust s.d. is not needed
    big = np.concatenate(([0], np.cumsum(dv < -8 * MIB)))
    for j in range(0, nb, 3):  # every 15 min is often enough for a period
        a, b = lo_at[j], k_at[j]
        if b - a < 20 or big[b] - big[a] < 4:
            continue
        d = dv[a:b]
        thr = max(8 * MIB, 4.0 * _mad_sd(d))
        drops = ts[1:][a:b][d < -thr]
        if len(drops) < 4:
            continue
        gaps = np.diff(drops)
        gaps = gaps[gaps > 1.5 * med_dt]
        if len(gaps) < 3:
            continue
        w = p.sawtooth_factor * _p75(gaps)
        windows[j : j + 3] = min(max(w, p.floor_window_s), p.max_floor_window_s)
    raw, prev, at = _bucket_floors(mins, when, windows, sub, per, ends)
    keep = np.isfinite(raw)
    t, raw, prev, windows, at = ends[keep], raw[keep], prev[keep], windows[keep], at[keep]
    # level steps: jumps beyond step_bytes and step_sd robust s.d. of the recent differences. Each
    # bucket's change is measured over one window: when the window grows (shrinks), a rising
    # floor falls (jumps) by the slope x the difference, which is the floor's definition moving,
    # not memory; it goes into the offset (a demo leak lost its trend to such a pair)
    y = raw.copy()
    offset = 0.0
    offsets = np.zeros(len(raw))
    releases = []
    excursions = []
    d = raw[1:] - prev[1:]
    day = 24 * HOUR * p.bucket_s / 300.0
    los = np.searchsorted(t, t - day)
    for j in range(1, len(raw)):
        offset += prev[j] - raw[j - 1]
        # the robust s.d. only matters for a jump beyond step_bytes (the threshold is the larger of
        # the two): computed for every bucket it was half of a check's CPU (a day of differences each)
        if abs(d[j - 1]) <= p.step_bytes:
            offsets[j] = offset
            y[j] = raw[j] - offset
            continue
        recent = d[max(int(los[j]) - 1, 0) : j - 1]
        sd = _mad_sd(recent) if len(recent) >= 6 else 0.0
        if abs(d[j - 1]) > max(p.step_bytes, p.step_sd * sd):
            typical = _median(recent) if len(recent) >= 6 else 0.0
            back = (_returned_to(raw, t, j, -d[j - 1], p.return_memory_s)
                    if d[j - 1] < 0 and p.return_memory_s > 0 else None)
            offset = offsets[back] if back is not None else offset + d[j - 1] - typical
            if back is not None:
                excursions.append((t[back], t[j]))
            if d[j - 1] < 0:
                releases.append(t[j])
        offsets[j] = offset
        y[j] = raw[j] - offset
    # a floor window that grew may reach back before the last bucket's minimum: times never go back
    return SegmentFloor(start, t, raw, y, windows, np.maximum.accumulate(at), np.asarray(releases, float),
                        np.asarray(excursions, float).reshape(-1, 2))


def _returned_to(raw: np.ndarray, t: np.ndarray, j: int, fall: float, memory_s: float) -> int | None:
    """The bucket whose level a fall at ``j`` returns the floor to, if it undoes a rise since then.
    A floor that climbs over many buckets (survivors of partial collections piling up, a step
    reached over minutes) and falls back at once is one excursion, not a level step: taking the
    fall out alone would keep the climb and, excursion after excursion, build a staircase."""
    a = int(np.searchsorted(t, t[j] - memory_s))
    low = np.flatnonzero(raw[a : j - 1] <= raw[j] + 0.5 * fall)  # the floor last stood this low
    return a + int(low[-1]) if len(low) else None


def _startup_removed(
    x: np.ndarray,
    y: np.ndarray,
    since: np.ndarray,
    taus: tuple[float, ...],
    only_slack: float = -1.0,
    only_max_tau: float = math.inf,
) -> np.ndarray:
    """``y`` less the best saturating start-up curve a (1 - exp(-since / tau)), a >= 0, fitted
    jointly with a line (so a steady trend stays in what is returned). Closed form, all taus at
    once: the curve's regressor and ``y`` are residualised on the line, whose columns (1, centred
    x) are orthogonal.

    With ``only_slack >= 0`` the curve is first fitted alone (a constant, no line, tau up to
    ``only_max_tau``): if its squared error is within (1 + only_slack) x that of curve + line,
    the window is start-up growth and ``y`` less that curve is returned (nothing of the rise is
    left to test). Over a few hours of a start-up tail a line plus a fast curve fits about as
    well as the slow curve alone, and the line then carries the tail's slope into the test; a
    leak during start-up keeps rising where a curve of tau <= 60 min has flattened, so the line
    is needed and the joint fit is kept."""
    if len(x) < 3:
        return y
    xc = x - x.mean()
    sxx = float(xc @ xc)
    ry0 = y - y.mean()
    ry = ry0
    if sxx > 0:
        ry = ry0 - (float(xc @ ry0) / sxx) * xc
    tau = np.asarray(taus, float)
    g = np.exp(-since[None, :] / tau[:, None])  # taus x points
    moves = g.max(axis=1) - g.min(axis=1) >= 1e-3
    rg0 = g - g.mean(axis=1, keepdims=True)
    rg = rg0
    if sxx > 0:
        rg = rg0 - np.outer(rg0 @ xc / sxx, xc)
    gg = np.einsum("ij,ij->i", rg, rg)
    gy = rg @ ry
    ok = moves & (gg > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(ok, gy / gg, 0.0)
        gain = np.where(ok & (c < 0), gy * gy / gg, 0.0)  # only growth that slows down (a >= 0)
    if only_slack >= 0:
        gg0 = np.einsum("ij,ij->i", rg0, rg0)
        gy0 = rg0 @ ry0
        ok0 = moves & (gg0 > 0) & (tau <= only_max_tau)
        with np.errstate(divide="ignore", invalid="ignore"):
            c0 = np.where(ok0, gy0 / gg0, 0.0)
            gain0 = np.where(ok0 & (c0 < 0), gy0 * gy0 / gg0, 0.0)
        k0 = int(np.argmax(gain0))
        sse_alone = float(ry0 @ ry0) - float(gain0[k0])
        sse_joint = max(float(ry @ ry) - float(np.max(gain)), 0.0)
        if gain0[k0] > 0 and sse_alone <= (1.0 + only_slack) * sse_joint:
            return y - c0[k0] * g[k0]
    k = int(np.argmax(gain))
    if gain[k] <= 0:
        return y
    return y - c[k] * g[k]


# --- the test on one window -----------------------------------------------------------------


def window_test(
    x: np.ndarray, y: np.ndarray, p: LeakParams, window_s: float | None = None, min_rise: float | None = None
) -> WindowResult:
    """Leak test of one window of floor points: a ``WindowResult`` with ``leak`` and ``reason``."""
    span = window_s if window_s is not None else float(x[-1] - x[0])
    rise = p.min_rise_bytes[0] if min_rise is None else min_rise
    slope, icpt = theil_sen(x, y)
    n = len(x)
    if slope < p.min_slope_bps or slope * span < rise:
        return WindowResult(slope, 0.0, n, False, "slope_below_min", window_s)
    resid = y - (icpt + slope * x)
    line = float(resid @ resid)
    hinge_f = hinge_fit(x, y)
    if hinge_f is not None and hinge_f[0] < line:  # judge the noise around the shape that fits
        line = hinge_f[0]
        _, z = mann_kendall(x, y, fitted=hinge_f[1])
    else:
        _, z = mann_kendall(x, y, slope)
    if z < p.z_crit:
        return WindowResult(slope, z, n, False, "not_significant", window_s)
    if step_sse(y) < line:
        return WindowResult(slope, z, n, False, "step_not_trend", window_s)
    if p.ramp_step_ratio > 0 and ramp_step_sse(x, y, p.ramp_min_flat_s, p.ramp_max_s) < p.ramp_step_ratio * line:
        return WindowResult(slope, z, n, False, "ramped_step_not_trend", window_s)
    half = x >= x[0] + (x[-1] - x[0]) / 2
    if half.sum() >= 4 and theil_sen(x[half], y[half])[0] < p.persistence * slope:
        return WindowResult(slope, z, n, False, "growth_stopped", window_s)
    return WindowResult(slope, z, n, True, "trend", window_s)


# --- whole-series verdicts ------------------------------------------------------------------


def seasonal_removed(t: np.ndarray, y: np.ndarray, since: float, p: LeakParams) -> tuple[np.ndarray, float]:
    """``y`` less its periodic swing (``p.seasonal_period_s``) and the swing's half-amplitude (0: none
    found). The swing is fitted by least squares with a cubic trend over the judged floor of the last
    ``seasonal_lookback_s`` and taken out only when significant (F-test at ``p.seasonal_p``). An
    hourly swing of 10 MiB moves the floor by up to 63 MiB/h: a leak's floor rises in stairs that a
    step fit follows, and a flat floor rises for half an hour."""
    if p.seasonal_period_s <= 0:
        return y, 0.0
    now = float(t[-1])
    m = (t >= since) & (t > now - p.seasonal_lookback_s)
    if m.sum() < 24 or float(t[m][-1] - t[m][0]) < p.seasonal_min_span_s:
        return y, 0.0
    tm, ym = t[m], y[m]
    u = (tm - tm.mean()) / max(float(np.ptp(tm)), 1.0)
    trend = np.column_stack([np.ones_like(u), u, u * u, u * u * u])
    w = 2 * np.pi / p.seasonal_period_s
    waves = np.column_stack([np.sin(w * tm), np.cos(w * tm)])
    full = np.hstack([trend, waves])
    beta, *_ = np.linalg.lstsq(full, ym, rcond=None)
    r_full = ym - full @ beta
    b0, *_ = np.linalg.lstsq(trend, ym, rcond=None)
    r0 = ym - trend @ b0
    sse1, sse0 = float(r_full @ r_full), float(r0 @ r0)
    df2 = len(ym) - full.shape[1]
    # sse0 == 0: the floor is exactly a cubic (a flat RSS, e.g. a float32 coarse tier of an idle
    # process): nothing is left for a swing to explain, and the ratio below divided by zero
    if sse1 <= 0 or sse0 <= 0 or df2 <= 0:
        return y, 0.0
    # F(2, df2) upper tail in closed form: (1 + 2F/df2)^(-df2/2) = (sse1 / sse0)^(df2/2)
    if (sse1 / sse0) ** (df2 / 2.0) > p.seasonal_p:
        return y, 0.0
    ab = beta[trend.shape[1]:]
    return y - np.column_stack([np.sin(w * t), np.cos(w * t)]) @ ab, float(np.hypot(ab[0], ab[1]))


def _judge(f: SegmentFloor, k: int, p: LeakParams) -> LeakVerdict:
    """The verdict at bucket ``k`` of a segment floor (no confirmation, no limit)."""
    now = float(f.t[k])
    v = LeakVerdict("unknown", "warming_up", at=now, segment_start=f.start)
    t, y = f.t[: k + 1], f.y[: k + 1]
    judged = t >= f.start + p.warmup_s
    v.floor_bytes = float(f.raw[k])
    if judged.sum() < p.min_points:
        return v
    y, v.hourly_swing_bytes = seasonal_removed(t, y, f.start + p.warmup_s, p)
    env, v.excursion_envelope_s = _excursion_envelope(f, t, y, now, p)
    best: WindowResult | None = None
    tested = False
    origin = _refill_origin(f, now, p)
    for i, w in enumerate(p.windows_s):
        m = judged & (t > now - w)
        cnt = int(m.sum())
        if cnt < p.min_points:
            continue
        tw = t[m]
        if float(tw[-1] - tw[0]) + p.bucket_s < (p.short_coverage if i == 0 else p.min_coverage) * w:
            continue
        tested = True
        x, yw = tw - tw[0], (env if env is not None and i == len(p.windows_s) - 1 else y)[m]
        if tw[0] - origin < p.long_warmup_s:
            yw = _startup_removed(x, yw, np.maximum(tw - origin, 0.0), p.startup_taus_s, p.startup_only_slack,
                                  p.startup_only_max_tau_s)
        res = window_test(x, yw, p, w, p.rise_for(i))
        v.windows.append(res)
        if res.leak and (best is None or res.z > best.z):
            best = res
    if not tested:
        return v
    shown = best or max(v.windows, key=lambda r: r.z)
    v.status, v.reason = ("leak", best.reason) if best else ("ok", v.windows[0].reason)
    v.slope_bps, v.z, v.window_s = shown.slope_bps, shown.z, shown.window_s or 0.0
    v.p_value = one_sided_p(shown.z) if shown.z > 0 else 1.0
    return v


def _excursion_envelope(
    f: SegmentFloor, t: np.ndarray, y: np.ndarray, now: float, p: LeakParams
) -> tuple[np.ndarray | None, float]:
    """The floor's lower envelope over its recent excursions' length, and that length; (None, 0)
    without repeated excursions. Survivors of partial collections pile up for 30-90 min until a
    full collection: the floor climbs and falls back each time, and a leak under it shows only in
    the levels it falls back to. The longest window's test reads those: up to the last fall back,
    the floor capped by the line through the levels it fell back to (each known once its fall is
    seen, so causal); after it, a running minimum over the excursions' length (the climb in
    progress may be one more excursion). A running minimum alone lagged by its span and held
    plateaus (Theil-Sen slopes of exactly 0): blind.py's 24 MiB/h leaks found within 4 h 8 -> 11
    of 12 on the tuning-more seeds, no false alarm more (session 38)."""
    if p.excursion_envelope_s <= 0:
        return None, 0.0
    done = f.excursions[f.excursions[:, 1] <= now]
    e = done[done[:, 1] > now - p.excursion_lookback_s]
    if len(e) < p.excursion_min_count:
        return None, 0.0
    span = min(float((e[:, 1] - e[:, 0]).max()), p.excursion_envelope_s)
    k = max(1, math.ceil(span / p.bucket_s))
    lo = max(0, int(np.searchsorted(t, now - max(p.windows_s))) - k)  # only the tail a window reads
    out = y.copy()
    back = np.unique(np.searchsorted(t, done[:, 1]))  # the buckets where the floor fell back
    back = back[back < len(t)]
    if len(back) >= 2 and back[-1] > lo:  # the line through the fall-backs, then the minimum after the last
        first, last = max(int(back[0]), lo), int(back[-1])
        out[first:last + 1] = np.minimum(y[first:last + 1], np.interp(t[first:last + 1], t[back], y[back]))
        lo = last
    out[lo:] = _trailing_min(y[lo:], k + 1)
    return out, span


def _refill_origin(f: SegmentFloor, now: float, p: LeakParams) -> float:
    """Where start-up-like growth may begin: the segment's start, or a later level step down
    within ``long_warmup_s`` (memory given back, or a warm restart too shallow for the restart
    rule, is refilled along a start-up curve, not a leak)."""
    if p.release_refill:
        r = f.releases[f.releases <= now]
        if len(r) and now - r[-1] < p.long_warmup_s:
            return float(max(r[-1], f.start))
    return f.start


def _onset(f: SegmentFloor, k: int, p: LeakParams, window_s: float = math.inf) -> float | None:
    now = float(f.t[k])
    lookback = min(p.onset_lookback_s, window_s + p.onset_margin_s)
    t, y = f.at[: k + 1], f.y[: k + 1]  # each floor point where its minimum was sampled
    y, _ = seasonal_removed(t, y, f.start + p.warmup_s, p)
    m = (f.t[: k + 1] >= f.start + p.warmup_s) & (t > now - lookback)
    if m.sum() < 6:
        return None
    tm, ym = t[m], y[m]
    x = tm - tm[0]
    if tm[0] - f.start < p.long_warmup_s:
        ym = _startup_removed(x, ym, tm - f.start, p.startup_taus_s)
    knot = hinge_onset(x, ym)
    if knot is None:
        return None
    return max(f.start, float(tm[0] + knot))


def _finish(v: LeakVerdict, f: SegmentFloor, k: int, p: LeakParams, limit_bytes, work) -> LeakVerdict:
    v.limit_bytes = limit_bytes
    if v.detected:
        v.onset = _onset(f, k, p, v.window_s)
        if limit_bytes and v.slope_bps > 0:
            v.eta_s = max(0.0, (limit_bytes - float(v.floor_bytes)) / v.slope_bps)
        if work is not None:
            rate = work_rate(
                np.asarray(work[0], float), np.asarray(work[1], float), float(v.at) - v.window_s, float(v.at)
            )
            if rate:
                v.bytes_per_work = v.slope_bps / rate
    return v


def _bounded_start(start: float, first: float, p: LeakParams) -> float:
    """A process start long before the data moved forward by whole buckets to just outside the
    start-up windows (``long_warmup_s``), the furthest it is read. The floor's buckets are counted
    from the start: a ``start_time`` of 0 or 12345 (not a Unix time) cost ~11 s of CPU a check, and
    -1e12 raised MemoryError. The verdict is the same (every window begins after the start-up ones),
    and the buckets keep their phase."""
    horizon = max(p.long_warmup_s, p.warmup_s) + p.bucket_s
    lag = first - start
    if lag <= horizon:
        return start
    return first - horizon - math.fmod(lag - horizon, p.bucket_s)


def _segments(t, v, p: LeakParams, start_time: float | None = None):
    t, v = _clean(t, v)
    segs = segments(t, v, p.restart_drop, p.max_gap_s, p.restart_below_floor_bytes, p.restart_floor_window_s)
    out = []
    for i, seg in enumerate(segs):
        ts, vs = t[seg], v[seg]
        st = float(ts[0])
        if i == 0 and start_time is not None and math.isfinite(start_time) and start_time <= st:
            st = _bounded_start(float(start_time), st, p)  # the process started before our data began
        out.append((ts, vs, st))
    return out


def assess(
    t: np.ndarray,
    v: np.ndarray,
    p: LeakParams = LeakParams(),
    *,
    limit_bytes: float | None = None,
    load: tuple[np.ndarray, np.ndarray] | None = None,
    work: tuple[np.ndarray, np.ndarray] | None = None,
    start_time: float | None = None,
) -> LeakVerdict:
    """Leak verdict at the last sample of ``(t, v)`` (seconds, bytes). ``load`` (t, running
    requests) removes load-driven swings; ``work`` (t, cumulative requests) adds bytes per
    request; ``start_time`` (process start) places the warm-up when data starts later."""
    segs = _segments(t, v, p, start_time)
    if not segs:
        return LeakVerdict("unknown", "no_data")
    ts, vs, st = segs[-1]
    vs, _ = _without_load(ts, vs, _load_at(ts, load), float(ts[-1]), p)
    f = segment_floor(ts, vs, p, st)
    k = len(f.t) - 1
    ver = _judge(f, k, p)
    ver.at = float(ts[-1])
    if ver.detected and p.confirm > 1:
        for back in range(1, p.confirm):
            if k - back < 0 or not _judge(f, k - back, p).detected:
                ver.status, ver.reason = "ok", "unconfirmed"
                break
    return _finish(ver, f, k, p, limit_bytes, work)


def scan(
    t: np.ndarray,
    v: np.ndarray,
    p: LeakParams = LeakParams(),
    *,
    every_s: float | None = None,
    limit_bytes: float | None = None,
    load: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[tuple[float, LeakVerdict]]:
    """Replay the detector over a whole recorded series, as the guard would have run it live
    (causal: each verdict only sees data up to its time). One verdict per floor bucket (or per
    ``every_s``), restarts included. Used by ``sla-guard analyze leak`` and the benchmark."""
    out: list[tuple[float, LeakVerdict]] = []
    step = every_s or p.bucket_s
    for ts, vs, st in _segments(t, v, p):
        r = _load_at(ts, load)
        f = segment_floor(ts, vs, p, st)
        next_t = -math.inf
        run = 0  # consecutive unconfirmed leak verdicts
        coef_at, coef = -math.inf, None
        onset = None
        for k in range(len(f.t)):
            now = float(f.t[k])
            if r is not None and now - coef_at >= HOUR * p.bucket_s / 300.0:
                # the coefficient is refreshed hourly; the floor is rebuilt from RSS less it when
                # it moved by more than 2 % (the live guard builds the floor at every bucket)
                coef_at = now
                less, c = _without_load(ts, vs, r, now, p)
                if (c is None) != (coef is None) or (c and abs(c - coef) > 0.02 * coef):
                    f, coef = segment_floor(ts, less, p, st), c
            ver = _judge(f, k, p)
            run = run + 1 if ver.detected else 0
            if ver.detected and run < p.confirm:
                ver.status, ver.reason = "ok", "unconfirmed"
            if ver.detected:
                if onset is None:  # the onset of an episode is estimated once, when it opens
                    onset = _onset(f, k, p, ver.window_s)
                ver.onset = onset
                ver.limit_bytes = limit_bytes
                if limit_bytes and ver.slope_bps > 0:
                    ver.eta_s = max(0.0, (limit_bytes - float(ver.floor_bytes)) / ver.slope_bps)
            elif ver.status == "ok":
                onset = None
            if now < next_t:
                continue
            next_t = now + step
            out.append((now, ver))
    return out


def first_detection(verdicts: list[tuple[float, LeakVerdict]]) -> tuple[float, LeakVerdict] | None:
    for at, ver in verdicts:
        if ver.detected:
            return at, ver
    return None


def episodes(verdicts: list[tuple[float, LeakVerdict]], hold_s: float) -> list[tuple[float, float | None]]:
    """Alarm episodes (start, end or None) with the guard's hysteresis: an open leak ends only
    after ``hold_s`` of "ok" verdicts, or at a restart (a new segment)."""
    out: list[tuple[float, float | None]] = []
    start = ok_since = seg = None
    for at, v in verdicts:
        if start is not None and v.segment_start != seg:
            out.append((start, at))
            start = ok_since = None
        if v.detected:
            ok_since = None
            if start is None:
                start, seg = at, v.segment_start
        elif start is not None and v.status == "ok":
            ok_since = at if ok_since is None else ok_since
            if at - ok_since >= hold_s:
                out.append((start, at))
                start = ok_since = None
        else:
            ok_since = None
    if start is not None:
        out.append((start, None))
    return out
