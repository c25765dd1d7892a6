"""Labelled synthetic series for the detectors: engine-process RSS (leaking or not) and
spec-decode counters (drifting or not), generated from a seed. Used by the evaluation harness
(bench/detectors) and by tests; pure numpy.

The noise model is stated so the benchmark can be judged (docs/detectors.md):

RSS of a ~6 GiB EngineCore: a base; a warm-up rise after each start (caches, arenas:
W in 50..400 MiB, time constant 3..20 min; the "warmup" kind 300..1000 MiB over 10..40 min);
garbage-collection sawtooth (20..150 MiB, period 1..10 min, jittered); transient spikes of
big batches (0.5/h, 50..400 MiB for 0.5..3 min); a load-following part (10..60 MiB, the
"load_swings" kind 100..300 MiB with bursts); 2 MiB sampling noise. Non-leaking kinds add
allocator plateaus (2..4 ramps of 64..192 MiB over 1..30 min, then flat) or restarts every 4..12 h.
A leak grows at a constant rate in MiB/h from its onset, or (work_proportional) in proportion
to load with that mean rate, as a per-step leak does.

Spec-decode counters at 10 s: draft tokens ~ Poisson(rate), acceptance = baseline (0.5..0.75)
+ a request-mix jitter (AR(1), sd 0.03, correlation ~30 s) + a slow wander (sd 0.01).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIB = 1024.0 * 1024.0
GIB = 1024.0 * MIB
HOUR = 3600.0
DAY = 86400.0

RSS_KINDS = ("sawtooth", "plateaus", "warmup", "restarts", "load_swings")


@dataclass
class RssCase:
    name: str
    kind: str
    seed: int
    t: np.ndarray
    v: np.ndarray
    load: np.ndarray  # running requests at each sample
    limit_bytes: float
    leak_mib_h: float = 0.0
    onset: float | None = None  # leak start (s), None when not leaking

    @property
    def leaking(self) -> bool:
        return self.leak_mib_h > 0


def _load(rng, t: np.ndarray, bursts: bool) -> np.ndarray:
    mean = rng.uniform(8, 32)
    amp = rng.uniform(0.2, 0.6)
    phase = rng.uniform(0, 2 * np.pi)
    x = 1 + amp * np.sin(2 * np.pi * t / DAY + phase)
    if bursts:
        for _ in range(rng.poisson(len(t) * (t[1] - t[0]) / (8 * HOUR)) + 1):
            s = rng.uniform(t[0], t[-1])
            d = rng.uniform(1, 3) * HOUR
            x = x + np.where((t >= s) & (t < s + d), rng.uniform(0.5, 1.0), 0.0)
    # request-level noise, smoothed over ~5 min
    noise = rng.normal(0, 0.15, len(t))
    k = max(1, int(300 / (t[1] - t[0])))
    noise = np.convolve(noise, np.ones(k) / k, mode="same") * np.sqrt(k)
    return np.maximum(0.0, mean * (x + 0.3 * noise))


def _sawtooth(rng, t: np.ndarray) -> np.ndarray:
    amp = rng.uniform(20, 150) * MIB
    period = rng.uniform(60, 600)
    n = int((t[-1] - t[0]) / period * 1.5) + 2
    collections = t[0] + np.cumsum(period * rng.uniform(0.7, 1.3, n)) - rng.uniform(0, period)
    idx = np.searchsorted(collections, t, side="right") - 1
    last = np.where(idx >= 0, collections[np.clip(idx, 0, None)], t[0] - period)
    nxt = collections[np.clip(idx + 1, 0, len(collections) - 1)]
    frac = np.clip((t - last) / np.maximum(nxt - last, 1.0), 0, 1)
    return amp * frac


def _spikes(rng, t: np.ndarray) -> np.ndarray:
    out = np.zeros_like(t)
    for _ in range(rng.poisson((t[-1] - t[0]) / HOUR * 0.5)):
        s = rng.uniform(t[0], t[-1])
        out += np.where((t >= s) & (t < s + rng.uniform(30, 180)), rng.uniform(50, 400) * MIB, 0.0)
    return out


def _warmup(rng, t: np.ndarray, starts: list[float], strong: bool) -> np.ndarray:
    w = rng.uniform(300, 1000) * MIB if strong else rng.uniform(50, 400) * MIB
    tau = rng.uniform(600, 2400) if strong else rng.uniform(180, 1200)
    start_of = np.asarray(starts)[np.searchsorted(starts, t, side="right") - 1]
    return w * (1 - np.exp(-(t - start_of) / tau))


def rss_case(kind: str, seed: int, *, days: float = 2.0, dt: float = 30.0, leak_mib_h: float = 0.0,
             onset_h: float | None = None, work_proportional: bool = False) -> RssCase:
    """One labelled RSS series. ``kind`` is one of RSS_KINDS (its pattern is added to the common
    background); ``leak_mib_h`` > 0 adds a leak from ``onset_h`` hours (default: random 2..12 h),
    at a constant rate, or in proportion to load (mean rate ``leak_mib_h``)."""
    if kind not in RSS_KINDS:
        raise ValueError(f"kind must be one of {RSS_KINDS}")
    rng = np.random.default_rng([seed, RSS_KINDS.index(kind), int(leak_mib_h * 10)])
    t = np.arange(0.0, days * DAY, dt)
    load = _load(rng, t, bursts=kind == "load_swings")
    base = 6 * GIB * rng.uniform(0.97, 1.03)
    starts = [0.0]
    if kind == "restarts":
        s = 0.0
        while True:
            s += rng.uniform(4, 12) * HOUR
            if s >= t[-1]:
                break
            starts.append(s)
    v = base + _warmup(rng, t, starts, strong=kind == "warmup")
    v += _sawtooth(rng, t) + _spikes(rng, t) + rng.normal(0, 2 * MIB, len(t))
    swing = rng.uniform(100, 300) if kind == "load_swings" else rng.uniform(10, 60)
    lm = load.mean()
    v += swing * MIB * (load - lm) / max(load.max() - lm, 1e-9)
    if kind == "plateaus":
        for _ in range(int(rng.integers(2, 5))):  # bounded: an allocator settles
            s = rng.uniform(t[0], t[-1])
            d = rng.uniform(60, 1800)
            v += 64 * MIB * rng.choice([1, 1, 2, 3]) * np.clip((t - s) / d, 0, 1)  # glibc heaps: 64 MiB
    onset = None
    if leak_mib_h > 0:
        onset = (rng.uniform(2, 12) if onset_h is None else onset_h) * HOUR
        if work_proportional:  # grows per unit of work: slower at night, faster at peak
            work = np.cumsum(load) * dt / lm  # seconds of average work
            v += np.maximum(0.0, work - np.interp(onset, t, work)) * leak_mib_h * MIB / HOUR
        else:
            v += np.maximum(0.0, t - onset) * leak_mib_h * MIB / HOUR
    if kind == "restarts":  # a new process loads its model (~2 min) before serving again
        for st in starts[1:]:
            m = (t >= st) & (t < st + 120)
            v[m] = 0.5 * GIB + (v[m] - 0.5 * GIB) * (t[m] - st) / 120
    name = f"{kind}-{seed}" + (f"-leak{leak_mib_h:g}" if leak_mib_h else "") + ("w" if work_proportional else "")
    return RssCase(name, kind, seed, t, v, load, 8 * GIB, leak_mib_h, onset)


@dataclass
class RateCase:
    name: str
    kind: str
    seed: int
    t: np.ndarray
    drafts: np.ndarray  # cumulative draft tokens
    accepted: np.ndarray  # cumulative accepted tokens
    change: float = 0.0  # absolute change of acceptance (0 = none)
    onset: float | None = None

    @property
    def drifting(self) -> bool:
        return self.change != 0.0


RATE_KINDS = ("stationary", "load_change", "step", "gradual")


def rate_case(kind: str, seed: int, *, days: float = 1.0, dt: float = 10.0, change: float = 0.0,
              drafts_per_s: float = 50.0, baseline: float | None = None, onset_h: float | None = None) -> RateCase:
    """Cumulative draft/accepted token counters. "step"/"gradual" (1 h ramp) change acceptance by
    ``change`` at the onset; "load_change" multiplies the draft rate by 0.25..4 in steps."""
    if kind not in RATE_KINDS:
        raise ValueError(f"kind must be one of {RATE_KINDS}")
    rng = np.random.default_rng([seed, RATE_KINDS.index(kind), round(change * 1000) + 1000])
    t = np.arange(dt, days * DAY + dt, dt)
    p0 = rng.uniform(0.5, 0.75) if baseline is None else baseline
    rate = np.full(len(t), drafts_per_s)
    if kind == "load_change":
        s = 0.0
        while s < t[-1]:
            d = rng.uniform(0.5, 4) * HOUR
            rate[(t >= s) & (t < s + d)] = drafts_per_s * rng.choice([0.25, 0.5, 1, 2, 4])
            s += d
    # request-mix jitter: AR(1) at dt with ~30 s correlation time, sd 0.03; wander sd 0.01 (~1 h)
    a = np.exp(-dt / 30.0)
    e = rng.normal(0, 0.03 * np.sqrt(1 - a * a), len(t))
    mix = np.zeros(len(t))
    for i in range(1, len(t)):
        mix[i] = a * mix[i - 1] + e[i]
    b = np.exp(-dt / HOUR)
    e2 = rng.normal(0, 0.01 * np.sqrt(1 - b * b), len(t))
    wander = np.zeros(len(t))
    for i in range(1, len(t)):
        wander[i] = b * wander[i - 1] + e2[i]
    p = p0 + mix + wander
    onset = None
    if kind in ("step", "gradual") and change != 0.0:
        onset = (rng.uniform(3, 12) if onset_h is None else onset_h) * HOUR
        ramp = 1.0 if kind == "step" else HOUR
        p = p + change * np.clip((t - onset) / ramp, 0, 1) * (t >= onset)
    p = np.clip(p, 0.01, 0.99)
    n = rng.poisson(rate * dt)
    x = rng.binomial(n, p)
    name = f"{kind}-{seed}" + (f"-{change:+.2f}" if change else "")
    return RateCase(name, kind, seed, t, np.cumsum(n).astype(float), np.cumsum(x).astype(float), change, onset)
