"""Online capacity learning as pure state-in / state-out functions.

Prefill: a replica's capacity is its throughput divided by the share of time it was busy (so a
half-idle replica is not mistaken for a slow one), and only warm, reasonably busy windows count.
Decode: step time is close to linear in the per-replica batch, so a recursive least-squares fit
with forgetting tracks ``step_time(batch) = a + b * batch``; TPOT is
then ``step_time / mean accepted length``, which makes speculative-decoding acceptance a first-class
input of decode capacity. No clocks, no I/O: the caller decides which samples are admissible
(cold-start replicas are excluded before calling).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True, slots=True)
class PrefillCapacity:
    """Uncached prompt tokens per second one warm replica sustains at the TTFT target."""

    tokens_per_s: float
    samples: int = 0
    prior: float = 0.0  # profile value (0 = none)


def update_prefill_capacity(cap: PrefillCapacity, observed_tps_per_replica: float, busy_share: float,
                            alpha_up: float = 0.2, alpha_down: float = 0.05, min_busy: float = 0.5
                            ) -> PrefillCapacity:
    """Blend one window of one warm replica into the estimate.

    A replica that computed ``tps`` uncached tokens/s while busy ``busy_share`` of the time
    (share of scrapes with a running batch) would do about ``tps / busy_share`` flat out. Lightly
    loaded windows (``busy_share < min_busy``) are skipped: a replica working on one prompt at a
    time batches poorly, so its throughput-while-busy understates capacity, and learning from it
    would make every added replica look slower (and ask for yet another one). The estimate rises
    faster than it falls for the same reason. The first admissible sample replaces the prior."""
    x = float(observed_tps_per_replica)
    if not (0 < x < math.inf and busy_share >= min_busy):  # an infinite sample would stay learned for good
        return cap
    est = x / min(busy_share, 1.0)
    if cap.samples == 0:
        new = est
    else:
        a = alpha_up if est > cap.tokens_per_s else alpha_down
        new = (1 - a) * cap.tokens_per_s + a * est
    return replace(cap, tokens_per_s=new, samples=cap.samples + 1)


@dataclass(frozen=True, slots=True)
class StepModel:
    """RLS state for ``step_time = a + b * batch`` (seconds per decode step vs running requests per
    replica). ``p`` is the 2x2 inverse-information matrix flattened (p00, p01, p11)."""

    a: float
    b: float
    p00: float = 1e3
    p01: float = 0.0
    p11: float = 1e3
    samples: int = 0

    def step_time(self, batch: float) -> float:
        return max(1e-6, self.a + self.b * max(batch, 0.0))

    def batch_for_step_time(self, step_s: float) -> float:
        """Largest per-replica batch whose predicted step time stays at or under ``step_s``."""
        if self.b <= 1e-12:
            return float("inf") if self.a <= step_s else 0.0
        return max(0.0, (step_s - self.a) / self.b)


def update_step_model(m: StepModel, batch: float, step_s: float, forget: float = 0.98,
                      min_slope: float = 1e-7) -> StepModel:
    """One recursive-least-squares update with exponential forgetting. Keeps the slope positive
    (a larger batch is never faster), which also guards against a degenerate fit when every sample
    sits at one batch size."""
    if not (0 < batch < math.inf and 0 < step_s < math.inf):  # one infinite sample: a NaN fit for good
        return m
    x0, x1 = 1.0, float(batch)
    # P x
    px0 = m.p00 * x0 + m.p01 * x1
    px1 = m.p01 * x0 + m.p11 * x1
    denom = forget + x0 * px0 + x1 * px1
    k0, k1 = px0 / denom, px1 / denom
    err = step_s - (m.a * x0 + m.b * x1)
    a, b = m.a + k0 * err, m.b + k1 * err
    # P = (P - k x^T P) / forget
    p00 = (m.p00 - k0 * px0) / forget
    p01 = (m.p01 - k0 * px1) / forget
    p11 = (m.p11 - k1 * px1) / forget
    # bound the covariance so a long quiet period cannot blow it up
    cap = 1e6
    p00, p11 = min(p00, cap), min(p11, cap)
    if b < min_slope:
        # the fit with the slope held at its bound: the intercept moves as the posterior says it
        # goes with the slope (a | b = a + p01/p11 (b_min - b)). Moving it to pass through this
        # sample instead let one slow step after an idle spell reset the intercept (agentic/s4
        # of the tuning suite: 36 -> 66 ms, a TPOT floor over the SLA, and decode grew at 14.5 ms)
        a = a + (p01 / p11) * (min_slope - b) if p11 > 0 else a
        b = min_slope
    return StepModel(a=max(a, 0.0), b=b, p00=p00, p01=p01, p11=p11, samples=m.samples + 1)


def adapt_target_utilization(u_target: float, u_obs: float | None, tail_s: float | None, slo_s: float,
                             lo: float = 0.15, hi: float = 0.9, gain: float = 0.05) -> float:
    """The prefill utilisation that still meets the TTFT SLA, learned from outcomes.

    If the TTFT tail broke the SLA at utilisation ``u_obs``, the pool must run below it: cut the
    target to 90% of ``u_obs`` at once. If the tail stayed well inside the SLA (< 70%) while
    running hotter than the target, creep the target up. Queueing delay depends on the workload
    (prompt-length spread, prefix hits), which a fixed utilisation target cannot know."""
    if u_obs is None or tail_s is None or u_obs < 0.05:
        return u_target
    if tail_s > slo_s:
        return max(lo, min(u_target, 0.9 * u_obs))
    if tail_s < 0.7 * slo_s and u_obs > u_target:
        return min(hi, u_target + gain * (u_obs - u_target))
    return u_target


def ewma(prev: float | None, x: float | None, alpha: float) -> float | None:
    """Exponentially weighted mean that tolerates missing values on either side."""
    if x is None:
        return prev
    if prev is None:
        return x
    return (1 - alpha) * prev + alpha * x


def record(hist, t: float, v: float, resolution_s: float, fold: Callable[[float, float], float] | None = None) -> None:
    """Append ``(t, v)`` to a bounded history, or fold it into the last point when the one
    before the last is under ``resolution_s`` old (``fold``: ``max`` for a peak, which then
    lingers at most ``resolution_s`` longer; None: the newer value). Every other point is then
    at least ``resolution_s`` apart, so N points cover at least N / 2 x resolution whatever the
    decision interval (callers pass 2 x span / N). With a plain bound of N ticks a 2 h memory
    covered 43 min at 5 s ticks, and a 5 min trend was never computed below 4.7 s."""
    if len(hist) >= 2 and t - hist[-2][0] < resolution_s:
        hist[-1] = (t, fold(hist[-1][1], v) if fold else v)
    else:
        hist.append((t, v))


def slope(ts: list[float], vs: list[float]) -> float | None:
    """Theil-Sen slope (units per second: median of pairwise slopes) of a short series; None
    with fewer than 4 points. Robust where least squares is not: one sample from before the
    traffic started (a fill from zero) drags a least-squares line for the whole window and turns
    a flat load into a "trend" that asks for replicas nobody needs."""
    n = len(ts)
    if n < 4 or n != len(vs):
        return None
    t = np.asarray(ts, dtype=float)
    v = np.asarray(vs, dtype=float)
    i, j = np.triu_indices(n, k=1)
    dt = t[j] - t[i]
    ok = dt > 0
    if not ok.any():
        return None
    return float(np.median((v[j] - v[i])[ok] / dt[ok]))


# ---- spread of per-request TPOT around its mean (decode headroom) ----

SPREAD_GRID = np.geomspace(0.01, 1.0, 81)  # sigma of log TPOT searched over
MIN_SPREAD_REQUESTS = 300  # requests before the learned spread replaces the configured headroom


@dataclass(frozen=True, slots=True)
class TpotSpread:
    """How far single requests' TPOT scatter around the window's mean, learned from the TPOT
    histogram: per-request TPOT as the mean times a lognormal factor of mean 1 and log-s.d. sigma
    (speculative acceptance and context length differ per request, multiplying its step time).

    Each window adds the log-likelihood of its bucket counts given its exact mean (_sum/_count)
    for every sigma of a grid; older windows fade (``forget`` per window). The histogram's
    bucket edges are exact (the SLA is one of them), so the share over the SLA constrains sigma
    without interpolation inside a bucket, which the histogram's quantile cannot do."""

    loglik: tuple[float, ...] = ()
    requests: float = 0.0

    def sigma(self) -> float | None:
        if self.requests < MIN_SPREAD_REQUESTS or not self.loglik:
            return None
        return float(SPREAD_GRID[int(np.argmax(self.loglik))])


_erf = np.vectorize(math.erf, otypes=[float])


def update_tpot_spread(sp: TpotSpread, buckets: dict[float, float], mean_s: float, forget: float = 0.97
                       ) -> TpotSpread:
    """Add one window: ``buckets`` maps each upper edge (``le``, +Inf included) to the cumulative
    count of requests in the window, ``mean_s`` is their mean TPOT."""
    edges = sorted(b for b in buckets if b > 0)
    if mean_s <= 0 or not edges:
        return sp
    counts, prev = [], 0.0
    for b in edges:
        c = max(0.0, buckets[b] - prev)
        counts.append(c)
        prev = max(prev, buckets[b])
    n = sum(counts)
    if n <= 0:
        return sp
    sig = SPREAD_GRID[:, None]
    finite = np.array([b for b in edges if np.isfinite(b)], dtype=float)
    z = (np.log(finite / mean_s)[None, :] + sig ** 2 / 2) / sig
    cdf = 0.5 * (1.0 + _erf(z / np.sqrt(2.0)))
    if len(finite) < len(edges):
        cdf = np.concatenate([cdf, np.ones((len(SPREAD_GRID), 1))], axis=1)
    p = np.diff(np.concatenate([np.zeros((len(SPREAD_GRID), 1)), cdf], axis=1), axis=1)
    ll = (np.log(np.maximum(p, 1e-12)) * np.array(counts)[None, :]).sum(axis=1)
    old = np.array(sp.loglik) if sp.loglik else np.zeros(len(SPREAD_GRID))
    return TpotSpread(tuple(float(v) for v in forget * old + ll), forget * sp.requests + n)


def tail_within_bucket(buckets: dict[float, float], mean_s: float, sigma: float, quantile: float) -> float | None:
    """The ``quantile`` of per-request TPOT: the spread model's (mean x lognormal factor of
    log-s.d. ``sigma``, as ``TpotSpread``), held within the histogram bucket that holds it.

    The histogram knows which bucket holds the quantile, exactly, and nothing about where in it:
    its quantile interpolates linearly, as if the bucket's requests were spread evenly over it.
    With the SLA an edge of a 5 ms bucket (15-20 ms) and most requests just above 15 ms, that reads
    a p90 of 19.4 ms where the spread model says 16-17 (ramp/s33 of the tuning suite, MTP
    acceptance at 0.7x): a tail the SLA allows read as one on its edge. Both lie on the same side of
    every bucket edge, the SLA included; None without buckets or requests."""
    edges = sorted(b for b in buckets if b > 0)
    if not edges or mean_s <= 0:
        return None
    total = max(buckets[b] for b in edges)
    if total <= 0:
        return None
    want = quantile * total
    hi_i = next((i for i, b in enumerate(edges) if buckets[b] >= want), len(edges) - 1)
    lo = edges[hi_i - 1] if hi_i > 0 else 0.0
    hi = edges[hi_i]
    z = NormalDist().inv_cdf(quantile)
    model = mean_s * math.exp(z * sigma - sigma ** 2 / 2)
    return min(max(model, lo), hi) if math.isfinite(hi) else max(model, lo)


def tpot_headroom(sigma: float, quantile: float) -> float:
    """Mean TPOT, as a share of the SLA, at which the ``quantile`` of requests meets the SLA."""
    z = NormalDist().inv_cdf(quantile)
    return float(np.exp(sigma ** 2 / 2 - z * sigma))
