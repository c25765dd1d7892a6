"""Window math that matches PromQL (Prometheus 2.42, the version CI runs), as pure functions.

Why reimplement it: the embedded guard must give the same numbers a Prometheus would on the
same samples, so alerts, dashboards and the guard never disagree. Each function here mirrors
one Go function of ``promql/functions.go`` / ``promql/quantile.go``; the comments name it.

Conventions: times are float unix seconds, rounded to milliseconds by the store (Prometheus
keeps int64 ms). Range selectors are closed ``[at - range, at]`` as in Prometheus 2.x (3.x made
them left-open). Vectorised functions take ``(S, K)`` arrays -- S series, K samples in
chronological order -- with NaN marking "no sample" so series with gaps share one matrix.
No I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "bucket_quantile",
    "counter_delta",
    "extrapolated_rate",
    "extrapolated_rate_matrix",
    "mean_from_sum_count",
    "weighted_ratio",
]


def extrapolated_rate_matrix(t: np.ndarray, v: np.ndarray, range_start: float | np.ndarray, range_end: float,
                             *, is_counter: bool = True, is_rate: bool = False) -> np.ndarray:
    """``increase`` / ``rate`` / ``delta`` for each row: Prometheus's ``extrapolatedRate``.

    ``t`` and ``v`` are ``(S, K)``; a cell with NaN ``v`` (or NaN ``t``) is no sample. Samples
    outside ``[range_start, range_end]`` are ignored. Rows with fewer than two samples give NaN
    (Prometheus drops them from the result). Counter resets add the value before the drop, and
    the result is extrapolated towards the range boundaries: fully if the first/last sample is
    within 1.1 average sample intervals of the boundary, else by half an interval; a counter is
    never extrapolated below zero.

    ``range_start`` may also be one start per row (the store's histogram buckets compared from
    a later point than the window's start, ``SeriesStore._comparable``).
    """
    t = np.asarray(t, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if t.ndim == 1:
        t = t[None, :]
        v = v[None, :]
    s, k = v.shape
    out = np.full(s, np.nan)
    if s == 0 or k == 0:
        return out
    per_row = np.ndim(range_start) > 0
    starts = np.asarray(range_start, dtype=np.float64)
    valid = ~np.isnan(v) & ~np.isnan(t) & (t >= (starts[:, None] if per_row else range_start)) & (t <= range_end)
    n = valid.sum(axis=1)
    rows = n >= 2
    if not rows.any():
        return out
    t, v, valid, n = t[rows], v[rows], valid[rows], n[rows]
    if per_row:
        starts = starts[rows]
    pos = np.arange(k)
    first_i = np.argmax(valid, axis=1)
    last_i = k - 1 - np.argmax(valid[:, ::-1], axis=1)
    r = np.arange(len(n))
    first_v, last_v = v[r, first_i], v[r, last_i]
    first_t, last_t = t[r, first_i], t[r, last_i]
    result = last_v - first_v
    if is_counter and bool((last_i - first_i + 1 == n).all()):
        # no gaps inside any row (the usual case): consecutive cells are consecutive samples
        pair = valid[:, 1:] & valid[:, :-1]
        with np.errstate(invalid="ignore"):
            drop = pair & (v[:, 1:] < v[:, :-1])
        result = result + np.where(drop, v[:, :-1], 0.0).sum(axis=1)
    elif is_counter:
        # previous valid sample of every cell (forward fill of valid positions)
        idx = np.where(valid, pos[None, :], -1)
        ffill = np.maximum.accumulate(idx, axis=1)
        prev_i = np.empty_like(ffill)
        prev_i[:, 0] = -1
        prev_i[:, 1:] = ffill[:, :-1]
        pair = valid & (prev_i >= 0)
        prev_v = np.take_along_axis(v, np.clip(prev_i, 0, None), axis=1)
        drop = pair & (v < prev_v)
        result = result + np.where(drop, prev_v, 0.0).sum(axis=1)
    # Prometheus does this arithmetic on int64 milliseconds, then divides by 1000.
    first_ms, last_ms = np.round(first_t * 1000), np.round(last_t * 1000)
    start_ms = np.round(starts * 1000) if per_row else round(range_start * 1000)
    end_ms = round(range_end * 1000)
    dur_start = (first_ms - start_ms) / 1000
    dur_end = (end_ms - last_ms) / 1000
    sampled = (last_ms - first_ms) / 1000
    avg = sampled / (n - 1)
    if is_counter:
        with np.errstate(divide="ignore", invalid="ignore"):
            to_zero = sampled * (first_v / result)
        clamp = (result > 0) & (first_v >= 0) & (to_zero < dur_start)
        dur_start = np.where(clamp, to_zero, dur_start)
    thr = avg * 1.1
    interval = sampled + np.where(dur_start < thr, dur_start, avg / 2) + np.where(dur_end < thr, dur_end, avg / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = interval / sampled
    if is_rate:
        factor = factor / (range_end - (starts if per_row else range_start))
    out[rows] = result * factor
    return out


def extrapolated_rate(t: Sequence[float], v: Sequence[float], range_start: float, range_end: float,
                      *, is_counter: bool = True, is_rate: bool = False) -> float:
    """One series' ``increase`` (``is_rate`` for ``rate``, ``is_counter=False`` for ``delta``);
    NaN with fewer than two samples in the range."""
    res = extrapolated_rate_matrix(np.asarray(t, float)[None, :], np.asarray(v, float)[None, :],
                                   range_start, range_end, is_counter=is_counter, is_rate=is_rate)
    return float(res[0])


def counter_delta(t: np.ndarray, v: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """Reset-aware, non-extrapolated counter growth per row between the last sample at or
    before ``t0`` and the last sample at or before ``t1``.

    Unlike ``increase`` this telescopes: deltas over consecutive intervals add up exactly to
    the delta over their union, which is what a request-weighted long-window ledger needs.
    A row with no sample at or before ``t0`` starts from its first sample in ``(t0, t1]``
    (a series born inside the interval counts from its first scrape, as Prometheus would).
    """
    t = np.asarray(t, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if t.ndim == 1:
        t, v = t[None, :], v[None, :]
    s, k = v.shape
    out = np.full(s, np.nan)
    if s == 0 or k == 0:
        return out
    present = ~np.isnan(v) & ~np.isnan(t)
    upto1 = present & (t <= t1)
    before0 = present & (t <= t0)
    # base index: last sample <= t0, else first sample in (t0, t1]
    pos = np.arange(k)[None, :]
    last_before0 = np.where(before0, pos, -1).max(axis=1)
    first_in = np.where(upto1 & ~before0, pos, k).min(axis=1)
    base = np.where(last_before0 >= 0, last_before0, first_in)
    end = np.where(upto1, pos, -1).max(axis=1)
    ok = (end >= 0) & (base < k) & (end >= base)
    seg = upto1 & (pos >= base[:, None]) & (pos <= end[:, None])
    idx = np.where(seg, pos, -1)
    ffill = np.maximum.accumulate(idx, axis=1)
    prev_i = np.empty_like(ffill)
    prev_i[:, 0] = -1
    prev_i[:, 1:] = ffill[:, :-1]
    pair = seg & (prev_i >= 0)
    prev_v = np.take_along_axis(v, np.clip(prev_i, 0, None), axis=1)
    step = np.where(v >= prev_v, v - prev_v, v)  # after a reset the counter restarted from 0
    total = np.where(pair, step, 0.0).sum(axis=1)
    out[ok] = total[ok]
    return out


class _Bucket:
    __slots__ = ("count", "upper")

    def __init__(self, upper: float, count: float) -> None:
        self.upper = upper
        self.count = count


def bucket_quantile(q: float, uppers: Sequence[float], counts: Sequence[float]) -> float:
    """Prometheus's ``bucketQuantile``: the q-quantile of a classic histogram given cumulative
    bucket counts (any order; ``inf`` for the +Inf bucket).

    Edge cases as in Prometheus: q<0 -> -Inf, q>1 -> +Inf, NaN q -> NaN; no +Inf bucket, fewer
    than two buckets or zero observations -> NaN; a rank in the +Inf bucket returns the
    largest finite upper bound; a first bucket with upper bound <= 0 returns that bound.
    Duplicate bounds are merged and non-monotonic counts (from rate noise) are fixed upwards.
    Linear interpolation inside the bucket, from 0 for the first bucket.
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    bs = sorted((_Bucket(float(u), float(c)) for u, c in zip(uppers, counts, strict=True)), key=lambda b: b.upper)
    if not bs or not math.isinf(bs[-1].upper) or bs[-1].upper < 0:
        return math.nan
    merged: list[_Bucket] = []  # coalesceBuckets
    for b in bs:
        if merged and merged[-1].upper == b.upper:
            merged[-1].count += b.count
        else:
            merged.append(b)
    top = -math.inf  # ensureMonotonic
    for b in merged:
        if b.count > top:
            top = b.count
        elif b.count < top:
            b.count = top
    if len(merged) < 2:
        return math.nan
    observations = merged[-1].count
    if observations == 0 or math.isnan(observations):
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(merged) - 1) if merged[i].count >= rank), len(merged) - 1)
    if b == len(merged) - 1:
        return merged[-2].upper
    if b == 0 and merged[0].upper <= 0:
        return merged[0].upper
    start, end, count = 0.0, merged[b].upper, merged[b].count
    if b > 0:
        start = merged[b - 1].upper
        count -= merged[b - 1].count
        rank -= merged[b - 1].count
    return start + (end - start) * (rank / count)


def mean_from_sum_count(sum_increase: float, count_increase: float) -> float:
    """``increase(x_sum) / increase(x_count)``; NaN when no observation fell in the window."""
    if not count_increase or math.isnan(count_increase) or math.isnan(sum_increase):
        return math.nan
    return sum_increase / count_increase


def weighted_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Request-weighted ratio over sub-windows: sum(num) / sum(den), never the mean of the
    per-window ratios (kubernetes-mixin's 0.0625-vs-0.3049 lesson). NaN when nothing counted."""
    num = float(np.nansum(np.asarray(numerators, float)))
    den = float(np.nansum(np.asarray(denominators, float)))
    return num / den if den > 0 else math.nan


LabelKey = tuple[tuple[str, str], ...]


def bucket_series(metric: str) -> str:
    """The ``_bucket`` sample name of a histogram named with or without the suffix: every view's
    ``bucket_increase`` / ``histogram_quantile`` accepts both, through this one spelling."""
    return metric if metric.endswith("_bucket") else metric + "_bucket"


def split_le(by_le: Mapping[LabelKey, float]) -> dict[LabelKey, dict[float, float]]:
    """Regroup ``sum by (le, ...)`` results into {labels without le: {upper bound: value}};
    series without a numeric ``le`` are ignored, as histogram_quantile ignores them, and
    spellings of one bound ("1", "1.0") are added together."""
    out: dict[LabelKey, dict[float, float]] = {}
    for labels, v in by_le.items():
        d = dict(labels)
        try:
            le = float(d.pop("le"))
        except (KeyError, ValueError):
            continue
        b = out.setdefault(tuple(sorted(d.items())), {})
        b[le] = b.get(le, 0.0) + v
    return out


def group_quantiles(q: float, grouped: Mapping[LabelKey, Mapping[float, float]]) -> dict[LabelKey, float]:
    """bucket_quantile per group; groups without observations (NaN) are left out: PromQL
    returns NaN there, the guard reports absence."""
    out = {}
    for key, buckets in grouped.items():
        v = bucket_quantile(q, list(buckets), list(buckets.values()))
        if not math.isnan(v):
            out[key] = v
    return out
