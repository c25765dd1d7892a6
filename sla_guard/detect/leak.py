"""Host-memory leak detection on one process's RSS series: pure functions, no I/O, no clocks.

Why this shape (see docs/detectors.md): a slow leak (tens of MiB/h on a multi-GiB process) is
invisible to ``predict_linear`` over an hour because RSS is dominated by garbage-collection
sawtooth, allocator plateaus and load-driven swings. So we

1. split the series at restarts and drop a warm-up after each start,
2. build a *floor* series (minimum over a window longer than the GC sawtooth period, sampled per
   bucket): the sawtooth disappears, a leak (which raises the floor) stays,
3. optionally remove the part of the floor explained by load (running requests): over half a
   day jointly with time; before that, in the shortest window, with a coefficient taken from
   the co-movement of differences (which a slow trend cannot confound),
4. on windows of several lengths (short: fast leaks soon; long: slow leaks surely) fit a robust
   Theil-Sen slope and test it with Mann-Kendall (variance corrected for autocorrelation,
   Hamed & Rao 1998, around the better of a line and a flat-then-rising hinge: a window that
   holds the onset is hinge-shaped),
5. refuse shapes that are not leaks: one or two steps explain the window better than a line or
   a hinge (allocator step, one-off cache fill), or the growth stopped in the recent third
   (plateau, saturating warm-up),
6. report a leak only when two consecutive buckets say so (transients last one).

A positive verdict carries slope, confidence, an onset estimate (hinge fit) and the projected
time until the memory limit.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

MIB = 1024.0 * 1024.0
HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class LeakParams:
    """Production parameters. ``scaled(k)`` compresses time by ``k`` (durations / k, slopes * k)
    so a short test can run the same detector on a k-times faster leak."""

    bucket_s: float = 300.0  # one floor point per bucket
    floor_window_s: float = 900.0  # min over this span: longer than the GC sawtooth period
    warmup_s: float = 1800.0  # ignored after each (re)start: caches fill, arenas grow
    long_warmup_s: float = 7200.0  # windows longer than the shortest start this late: a warm-up
    # tail is small next to a 2 h window's rise but not next to an 8 h window's
    windows_s: tuple[float, ...] = (2 * HOUR, 8 * HOUR, 24 * HOUR)
    min_coverage: float = 0.7  # a window needs this share of its span in post-warm-up data
    min_points: int = 12
    z_crit: float = 4.0  # one-sided Mann-Kendall z (autocorrelation-corrected)
    min_slope_bps: float = 4.0 * MIB / HOUR  # below this growth is not worth a page
    min_rise_bytes: float = 64 * MIB  # and a window must have grown at least this much: load
    # swings and cache fills move the floor by tens of MiB without leaking
    unconditioned_rise_bytes: float = 128 * MIB  # long windows must rise more than a diurnal
    # load swing of the floor
    step_ratio: float = 1.0  # a one-step fit with SSE < ratio * line SSE -> a step, not a leak
    persistence: float = 0.6  # last-third slope must be >= this share of the window slope
    restart_drop: float = 0.25  # a fall by more than this fraction between samples = restart
    max_gap_s: float = 1800.0  # a hole longer than this also starts a new segment
    hinge: bool = True  # a short window holding the onset is flat-then-rising: its step test
    # and Mann-Kendall's serial correlation use the better of a line and a hinge (not a line
    # only). Long windows keep the line: a day holds several allocator steps, which two
    # breaks cannot fit and a hinge can
    short_load: bool = True  # before the long-span load fit applies (12 h), the shortest window
    # removes load with a coefficient from the co-movement of differences (diff_load_coef)
    load_lag: int = 0  # buckets between diff_load_coef's differences; 0: one floor window
    # (consecutive floor points share most of their window, so their difference is mostly
    # which sample held the minimum, not a change of load)
    confirm: int = 2  # a leak needs this many consecutive buckets whose verdict is "leak": a
    # one-bucket verdict is what a transient makes, a leak persists
    step_trend: bool = True  # in the shortest window, given a load series, a trend the step test
    # rejects gets a second test with up to two upward steps removed (a leak under an allocator
    # step is both)
    min_step_segment: int = 3  # points per level in that fit (one odd point is not a level)

    def scaled(self, k: float) -> LeakParams:
        if k <= 0:
            raise ValueError("time scale must be > 0")
        return replace(
            self,
            bucket_s=self.bucket_s / k,
            floor_window_s=self.floor_window_s / k,
            warmup_s=self.warmup_s / k,
            long_warmup_s=self.long_warmup_s / k,
            windows_s=tuple(w / k for w in self.windows_s),
            min_slope_bps=self.min_slope_bps * k,
            max_gap_s=self.max_gap_s / k,
        )


@dataclass(frozen=True, slots=True)
class WindowResult:
    """The leak test on one window of floor points (``window_test``); JSON-able through
    ``dataclasses.asdict`` (``LeakVerdict.as_dict`` keeps one per window)."""

    slope_bps: float  # Theil-Sen slope of the floor, bytes/s
    z: float  # Mann-Kendall statistic
    n: int  # floor points in the window
    leak: bool
    reason: str  # "trend" / "trend_with_step" when a leak, else why not
    window_s: float | None = None  # the window's length (None: the span of the points)


@dataclass(slots=True)
class LeakVerdict:
    """The state of one process series at its last sample. ``status`` is "leak", "ok" or
    "unknown" (too little post-warm-up data: never reported as ok)."""

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

def segments(t: np.ndarray, v: np.ndarray, drop: float = 0.25, max_gap_s: float = math.inf) -> list[slice]:
    """Index ranges between restarts: a sudden fall of RSS by more than ``drop`` (a new process
    starts small) or a hole longer than ``max_gap_s``."""
    if len(t) == 0:
        return []
    prev = v[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        fell = (v[1:] < prev * (1.0 - drop)) & (prev > 0)
    gap = np.diff(t) > max_gap_s
    cuts = np.flatnonzero(fell | gap) + 1
    bounds = [0, *cuts.tolist(), len(t)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def floor_series(t: np.ndarray, v: np.ndarray, bucket_s: float, floor_window_s: float,
                 origin: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Minimum of ``v`` over the trailing ``floor_window_s``, one point per non-empty bucket
    (stamped at the bucket end). Removes sawtooth whose period is below the floor window."""
    if len(t) == 0:
        return np.empty(0), np.empty(0)
    t0 = t[0] if origin is None else origin
    idx = np.floor((t - t0) / bucket_s).astype(np.int64)
    nb = int(idx[-1]) + 1
    mins = np.full(nb, np.inf)
    np.minimum.at(mins, idx, v)
    k = max(1, math.ceil(floor_window_s / bucket_s))
    # rolling min over k buckets (missing buckets are +inf and so ignored)
    roll = mins.copy()
    for j in range(1, k):
        roll[j:] = np.minimum(roll[j:], mins[:-j])
    present = np.isfinite(mins)
    ends = t0 + (np.arange(nb) + 1.0) * bucket_s
    return ends[present], roll[present]


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
        return 0.0, float(np.median(y)) if len(y) else 0.0
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return slope, float(np.median(y - slope * x))


def _acf(r: np.ndarray, nlags: int) -> np.ndarray:
    r = r - r.mean()
    den = float(np.dot(r, r))
    if den == 0:
        return np.zeros(nlags)
    return np.array([float(np.dot(r[:-k], r[k:])) / den for k in range(1, nlags + 1)])


def mann_kendall(x: np.ndarray, y: np.ndarray, slope: float | None = None,
                 fitted: np.ndarray | None = None) -> tuple[float, float]:
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
    corr = 1.0 + 2.0 / (n * (n - 1) * (n - 2)) * float(
        np.sum(((n - k) * (n - k - 1) * (n - k - 2) * rho)[sig]))
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


def steps_line_fit(x: np.ndarray, y: np.ndarray, breaks: int = 2, min_seg: int = 3
                   ) -> tuple[float, float, np.ndarray, tuple[int, ...]] | None:
    """Least-squares fit of a common slope plus a level per segment, with up to ``breaks``
    breaks, each segment at least ``min_seg`` points: (SSE, slope, level offset of each point
    from the first segment's level, segment edges). A leak with an allocator step in its window
    has this shape; removing the offsets leaves the leak."""
    n = len(y)
    if n < 2 * min_seg:
        return None
    cs = {k: np.concatenate([[0.0], np.cumsum(v)])
          for k, v in (("n", np.ones(n)), ("x", x), ("y", y), ("xx", x * x), ("xy", x * y), ("yy", y * y))}

    def moments(a, b):  # centred (Sxx, Sxy, Syy) of segments [a, b), vectorized over index arrays
        m = {k: c[b] - c[a] for k, c in cs.items()}
        return (m["xx"] - m["x"] ** 2 / m["n"], m["xy"] - m["x"] * m["y"] / m["n"],
                m["yy"] - m["y"] ** 2 / m["n"])

    cands: list[tuple[np.ndarray, ...]] = []
    m1 = np.arange(min_seg, n - min_seg + 1)
    if len(m1):
        cands.append((m1,))
    if breaks >= 2:
        i, j = _pairs(n + 1)
        ok = (i >= min_seg) & (j - i >= min_seg) & (n - j >= min_seg)
        if ok.any():
            cands.append((i[ok], j[ok]))
    best: tuple[float, float, tuple[int, ...]] | None = None
    for cut in cands:
        edges = [np.zeros_like(cut[0]), *cut, np.full_like(cut[0], n)]
        parts = [moments(a, b) for a, b in itertools.pairwise(edges)]
        sxx = sum(q[0] for q in parts)
        sxy = sum(q[1] for q in parts)
        syy = sum(q[2] for q in parts)
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = np.where(sxx > 0, sxy / sxx, 0.0)
        sse = syy - slope * sxy
        k = int(np.argmin(sse))
        if best is None or sse[k] < best[0]:
            best = (float(sse[k]), float(slope[k]), tuple(int(c[k]) for c in cut))
    if best is None:
        return None
    sse, slope, cuts = best
    edges = (0, *cuts, n)
    level = np.empty(n)
    for a, b in itertools.pairwise(edges):
        level[a:b] = y[a:b].mean() - slope * x[a:b].mean()
    return sse, slope, level - level[0], edges


def _hinge_fits(x: np.ndarray, y: np.ndarray, knots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares flat-then-rising fits, one per knot: (SSE per knot, fitted values per knot).
    Knots whose best slope is not positive get an infinite SSE."""
    h = np.maximum(0.0, x[None, :] - knots[:, None])  # knots x points
    hm = h.mean(axis=1, keepdims=True)
    ym = y.mean()
    var = ((h - hm) ** 2).sum(axis=1)
    cov = ((h - hm) * (y - ym)[None, :]).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(var > 0, cov / var, 0.0)
    fitted = ym + s[:, None] * (h - hm)
    sse = ((y[None, :] - fitted) ** 2).sum(axis=1)
    sse[s <= 0] = np.inf
    return sse, fitted


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


def diff_load_coef(y: np.ndarray, lf: np.ndarray, min_points: int = 12, lag: int = 1) -> float | None:
    """Bytes per unit of load from co-movement: Theil-Sen slope (with intercept) of the floor's
    ``lag``-bucket differences on the load floor's. Differencing turns a linear trend (a leak)
    into a constant and shrinks a diurnal cycle, so time cannot confound the load the way it
    does in one short window's regression; the median ignores the few differences that hold an
    allocator step. A warm-up tail is not linear: fit past it. None when the load does not move
    enough to say."""
    dy, dl = y[lag:] - y[:-lag], lf[lag:] - lf[:-lag]
    if len(dy) < min_points or np.count_nonzero(dl) < min_points:
        return None
    c, _ = theil_sen(dl, dy)
    return c if c > 0 else None


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


def load_floor(tf: np.ndarray, t_load: np.ndarray, load: np.ndarray, p: LeakParams) -> np.ndarray | None:
    """The load's own floor (same window and buckets as the RSS floor) at the floor times."""
    if len(t_load) < 3:
        return None
    order = np.argsort(t_load, kind="stable")
    t_load, load = t_load[order], load[order]
    lt, lv = floor_series(t_load, load, p.bucket_s, p.floor_window_s, origin=tf[0] - p.bucket_s
                          if t_load[0] >= tf[0] - p.bucket_s else None)
    if len(lt) < 3:
        return None
    return np.interp(tf, lt, lv)


def remove_load(tf: np.ndarray, yf: np.ndarray, t_load: np.ndarray, load: np.ndarray,
                p: LeakParams, fit_from: float | None = None) -> np.ndarray:
    """Floor minus the part explained by load (ordinary least squares of the floor on time and
    the load's own floor over the same windows, jointly, so a leak does not leak into the load
    coefficient). The fit uses points from ``fit_from`` on (past any warm-up tail, which is
    neither linear in time nor in load)."""
    fit = tf >= (tf[0] if fit_from is None else fit_from)
    if len(t_load) < 3 or fit.sum() < 6 or tf[-1] - tf[fit][0] < 12 * HOUR * (p.bucket_s / 300.0):
        return yf  # under half a day, load and time are too confounded to separate
    lf = load_floor(tf, t_load, load, p)
    if lf is None or float(np.std(lf)) == 0.0:
        return yf
    a = np.column_stack([np.ones_like(tf), tf - tf[0], lf])
    coef, *_ = np.linalg.lstsq(a[fit], yf[fit], rcond=None)
    c = float(coef[2])
    if c <= 0:
        return yf
    return yf - c * (lf - lf.mean())


def work_rate(t_work: np.ndarray, work: np.ndarray, start: float, end: float) -> float | None:
    """Average rate of a cumulative work counter in [start, end] (resets tolerated)."""
    m = (t_work >= start) & (t_work <= end)
    if m.sum() < 2:
        return None
    d = np.diff(work[m])
    d = np.where(d < 0, work[m][1:], d)  # a reset restarts the counter from zero
    span = float(t_work[m][-1] - t_work[m][0])
    return float(d.sum() / span) if span > 0 else None


# --- the test on one window -----------------------------------------------------------------

def window_test(x: np.ndarray, y: np.ndarray, p: LeakParams, window_s: float | None = None,
                min_rise: float | None = None, hinge: bool = False, steps: bool = False) -> WindowResult:
    """Leak test of one window of floor points: a ``WindowResult`` with ``leak`` and ``reason``.
    ``hinge``: the shape tests also consider a flat-then-rising fit. ``steps``: a window the step
    test rejects is tested again with its upward steps removed."""
    slope, icpt = theil_sen(x, y)
    resid = y - (icpt + slope * x)
    line = float(np.dot(resid, resid))
    hinge_f = hinge_fit(x, y) if hinge else None
    if hinge_f is not None and hinge_f[0] < line:  # judge the noise around the shape that fits
        line = hinge_f[0]
        _, z = mann_kendall(x, y, fitted=hinge_f[1])
    else:
        _, z = mann_kendall(x, y, slope)
    span = window_s if window_s is not None else float(x[-1] - x[0])
    rise = p.min_rise_bytes if min_rise is None else min_rise
    leak, reason = False, "ok"
    if z < p.z_crit:
        reason = "not_significant"
    elif slope < p.min_slope_bps or slope * span < rise:
        reason = "slope_below_min"
    elif step_sse(y) < p.step_ratio * line:
        out = WindowResult(slope, z, len(x), False, "step_not_trend", window_s)
        # an allocator step may hide a leak: the trend with the steps removed
        return (_trend_beyond_steps(x, y, p, span, rise, window_s) if steps else None) or out
    elif not _persists(x, y, slope, p):
        reason = "growth_stopped"
    else:
        leak, reason = True, "trend"
    return WindowResult(slope, z, len(x), leak, reason, window_s)


def _persists(x: np.ndarray, y: np.ndarray, slope: float, p: LeakParams) -> bool:
    """The last third still grows (a plateau or a saturating warm-up does not)."""
    last = x >= x[0] + (x[-1] - x[0]) * 2 / 3
    first = x <= x[0] + (x[-1] - x[0]) / 3
    if last.sum() < 3 or first.sum() < 3:
        return True
    recent, _ = theil_sen(x[last], y[last])
    early, _ = theil_sen(x[first], y[first])
    return recent >= p.persistence * max(slope, early)


def _trend_beyond_steps(x: np.ndarray, y: np.ndarray, p: LeakParams, span: float, rise: float,
                        window_s: float | None = None) -> WindowResult | None:
    """The window's trend once up to two upward steps are removed (steps_line_fit): a leak
    under an allocator step. The steps themselves are not counted in the rise; a window with
    a downward level change (memory returned) is not judged this way."""
    fit = steps_line_fit(x, y, 2, p.min_step_segment)
    if fit is None:
        return None
    noise = math.sqrt(max(fit[0], 0.0) / max(len(y) - len(fit[3]), 1))
    if np.any(np.diff(fit[2]) < -3 * noise):  # a fall beyond the noise: not an allocator step
        return None
    yt = y - fit[2]
    slope, _ = theil_sen(x, yt)
    _, z = mann_kendall(x, yt, slope)
    if z < p.z_crit or slope < p.min_slope_bps or slope * span < rise or not _persists(x, yt, slope, p):
        return None
    # a leak grows between the steps too; a staircase of allocator ramps is flat between them
    for a, b in itertools.pairwise(fit[3]):
        if b - a >= 2 * p.min_step_segment and theil_sen(x[a:b], y[a:b])[0] < p.persistence * slope:
            return None
    return WindowResult(slope, z, len(x), True, "trend_with_step", window_s)


# --- whole-series verdicts ------------------------------------------------------------------

def _clean(t, v) -> tuple[np.ndarray, np.ndarray]:
    """Finite, non-negative samples in time order (scrapes can arrive with NaN or out of order)."""
    t = np.asarray(t, dtype=float)
    v = np.asarray(v, dtype=float)
    ok = np.isfinite(t) & np.isfinite(v) & (v >= 0)
    t, v = t[ok], v[ok]
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def _prepare(t: np.ndarray, v: np.ndarray, p: LeakParams, start_time: float | None):
    t, v = _clean(t, v)
    segs = segments(t, v, p.restart_drop, p.max_gap_s)
    if not segs:
        return None
    seg = segs[-1]
    ts, vs = t[seg], v[seg]
    seg_start = float(ts[0])
    if start_time is not None and start_time <= ts[0] and len(segs) == 1:
        seg_start = float(start_time)  # the process started before our data began
    return ts, vs, seg_start


def assess(t: np.ndarray, v: np.ndarray, p: LeakParams = LeakParams(), *, limit_bytes: float | None = None,
           load: tuple[np.ndarray, np.ndarray] | None = None, work: tuple[np.ndarray, np.ndarray] | None = None,
           start_time: float | None = None) -> LeakVerdict:
    """Leak verdict at the last sample of ``(t, v)`` (seconds, bytes). ``load`` (t, running
    requests) removes load-driven swings; ``work`` (t, cumulative requests) adds bytes per
    request; ``start_time`` (process start) places the warm-up when data starts later."""
    prep = _prepare(t, v, p, start_time)
    if prep is None:
        return LeakVerdict("unknown", "no_data")
    ts, vs, seg_start = prep
    tf, yf = floor_series(ts, vs, p.bucket_s, p.floor_window_s, origin=seg_start)
    return _assess_floor(tf, yf, float(ts[-1]), seg_start, p, limit_bytes, load, work)


def _assess_floor(tf, yf, now, seg_start, p, limit_bytes, load, work) -> LeakVerdict:
    tf0, yf0 = tf, yf
    post = tf >= seg_start + p.warmup_s
    tf, yf = tf[post], yf[post]
    verdict = LeakVerdict("unknown", "warming_up", at=now, limit_bytes=limit_bytes, segment_start=seg_start)
    if len(tf) < p.min_points:
        return verdict
    longest = max(p.windows_s)
    keep = tf > now - longest
    tf, yf = tf[keep], yf[keep]
    short_load = None  # load part of the floor, for the shortest window only
    if load is not None:
        t_load, v_load = np.asarray(load[0], float), np.asarray(load[1], float)
        yf_raw = yf
        yf = remove_load(tf, yf, t_load, v_load, p, fit_from=seg_start + max(p.warmup_s, p.long_warmup_s))
        if p.short_load and yf is yf_raw:  # not removed over the long span
            lf = load_floor(tf, t_load, v_load, p)
            lag = p.load_lag or max(1, math.ceil(p.floor_window_s / p.bucket_s))
            # past the warm-up tail, which is slow but not linear: with a load that trends too,
            # its differences would pass for load
            fit = tf >= seg_start + max(p.warmup_s, p.long_warmup_s)
            c = None if lf is None else diff_load_coef(yf[fit], lf[fit], lag=lag)
            short_load = None if c is None else c * lf
    verdict.floor_bytes = float(yf[-1])
    best: WindowResult | None = None
    tested = False
    shortest = min(p.windows_s)
    for w in p.windows_s:
        m = tf > now - w
        if w > shortest:
            m &= tf >= seg_start + max(p.warmup_s, p.long_warmup_s)
        span = float(tf[m][-1] - tf[m][0]) + p.bucket_s if m.any() else 0.0
        if m.sum() < p.min_points or span < p.min_coverage * w:
            continue
        tested = True
        x = tf[m] - tf[m][0]
        # load removal is approximate (memory follows load non-linearly): long windows keep the
        # larger rise either way; measured in bench/detectors (relaxing it doubled false alarms)
        rise = p.min_rise_bytes if w == shortest else max(p.min_rise_bytes, p.unconditioned_rise_bytes)
        yw = yf[m]
        if w == shortest and short_load is not None:
            yw = yw - (short_load[m] - short_load[m].mean())
        # the step-removed retest only with a load series: without one, a load shift is a level
        # change too, and not an allocator's
        res = window_test(x, yw, p, w, rise, hinge=p.hinge and w == shortest,
                          steps=p.step_trend and w == shortest and load is not None)
        verdict.windows.append(res)
        if res.leak and (best is None or res.z > best.z):
            best = res
    if not tested:
        return verdict
    if best is None:
        last = verdict.windows[0]
        verdict.status, verdict.reason = "ok", last.reason
        verdict.slope_bps, verdict.z = last.slope_bps, last.z
        verdict.p_value = one_sided_p(last.z)
        verdict.window_s = last.window_s or 0.0
        return verdict
    if p.confirm > 1 and len(tf) > 1:
        # pure function of the same arrays: the verdict one bucket earlier must agree
        prev = _assess_floor(tf0[:-1], yf0[:-1], float(tf0[-2]), seg_start, replace(p, confirm=p.confirm - 1),
                             None, load, None)
        if not prev.detected:
            verdict.status, verdict.reason = "ok", "unconfirmed"
            verdict.slope_bps, verdict.z, verdict.window_s = best.slope_bps, best.z, best.window_s or 0.0
            verdict.p_value = one_sided_p(best.z)
            return verdict
    verdict.status, verdict.reason = "leak", best.reason
    verdict.slope_bps, verdict.z, verdict.window_s = best.slope_bps, best.z, best.window_s or 0.0
    verdict.p_value = one_sided_p(best.z)
    verdict.onset = hinge_onset(tf, yf)
    if limit_bytes and verdict.slope_bps > 0:
        verdict.eta_s = max(0.0, (limit_bytes - verdict.floor_bytes) / verdict.slope_bps)
    if work is not None:
        rate = work_rate(np.asarray(work[0], float), np.asarray(work[1], float), now - verdict.window_s, now)
        if rate:
            verdict.bytes_per_work = verdict.slope_bps / rate
    return verdict


def scan(t: np.ndarray, v: np.ndarray, p: LeakParams = LeakParams(), *, every_s: float | None = None,
         limit_bytes: float | None = None, load: tuple[np.ndarray, np.ndarray] | None = None,
         ) -> list[tuple[float, LeakVerdict]]:
    """Replay the detector over a whole recorded series, as the guard would have run it live
    (causal: each verdict only sees data up to its time). One verdict per floor bucket (or per
    ``every_s``), restarts included. Used by ``sla-guard analyze leak`` and the benchmark."""
    t, v = _clean(t, v)
    out: list[tuple[float, LeakVerdict]] = []
    step = every_s or p.bucket_s
    for seg in segments(t, v, p.restart_drop, p.max_gap_s):
        ts, vs = t[seg], v[seg]
        seg_start = float(ts[0])
        tf, yf = floor_series(ts, vs, p.bucket_s, p.floor_window_s, origin=seg_start)
        next_t = -math.inf
        for k in range(len(tf)):
            now = float(tf[k])
            if now < next_t:
                continue
            next_t = now + step
            out.append((now, _assess_floor(tf[: k + 1], yf[: k + 1], now, seg_start, p, limit_bytes, load, None)))
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
