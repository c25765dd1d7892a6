"""Online capacity learning as pure state-in / state-out functions.

Prefill: a replica's capacity is only observable while it is saturated (requests waiting), so
only saturated, warm samples move the estimate; unsaturated throughput is a lower bound that can
raise it but never lower it. Decode: step time is close to linear in the per-replica batch, so a
recursive least-squares fit with forgetting tracks ``step_time(batch) = a + b * batch``; TPOT is
then ``step_time / mean accepted length``, which makes speculative-decoding acceptance a first-class
input of decode capacity. No clocks, no I/O: the caller decides which samples are admissible
(cold-start replicas are excluded before calling).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class PrefillCapacity:
    """Uncached prompt tokens per second one warm replica sustains at the TTFT target."""

    tokens_per_s: float
    samples: int = 0
    prior: float = 0.0  # profile value (0 = none)


def update_prefill_capacity(cap: PrefillCapacity, observed_tps_per_replica: float, saturated: bool,
                            alpha: float = 0.2) -> PrefillCapacity:
    """Blend one window's per-replica throughput into the estimate.

    Saturated windows measure capacity (EWMA towards them); unsaturated windows only prove the
    replica can do at least that much, so they can only raise the estimate."""
    x = float(observed_tps_per_replica)
    if not x > 0:
        return cap
    if saturated:
        est = x if cap.samples == 0 and cap.tokens_per_s <= 0 else (1 - alpha) * cap.tokens_per_s + alpha * x
        return replace(cap, tokens_per_s=est, samples=cap.samples + 1)
    if x > cap.tokens_per_s:
        return replace(cap, tokens_per_s=x, samples=cap.samples + 1)
    return cap


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
    if not (batch > 0 and step_s > 0):
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
        # move the intercept so the fit still passes through this sample
        b = min_slope
        a = step_s - b * x1
    return StepModel(a=max(a, 0.0), b=b, p00=p00, p01=p01, p11=p11, samples=m.samples + 1)


def ewma(prev: float | None, x: float | None, alpha: float) -> float | None:
    """Exponentially weighted mean that tolerates missing values on either side."""
    if x is None:
        return prev
    if prev is None:
        return x
    return (1 - alpha) * prev + alpha * x


def slope(ts: list[float], vs: list[float]) -> float | None:
    """Least-squares slope (units per second) of a short series; None with fewer than 3 points."""
    n = len(ts)
    if n < 3 or n != len(vs):
        return None
    mt = sum(ts) / n
    mv = sum(vs) / n
    den = sum((t - mt) ** 2 for t in ts)
    if den <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den
