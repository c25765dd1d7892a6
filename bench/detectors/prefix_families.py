"""Series for the prefix-cache hit-rate drift detector (issue 16: "the same applies to the
prefix-hit ... drifts"), written apart from the detector (no shared code or constants).

Each case is one pool's pair of cumulative counters as vLLM exports them
(``prefix_cache_queries`` and ``prefix_cache_hits``, in tokens), sampled every 10, 15 or 30 s,
built request by request, because that is what makes a hit rate different from an acceptance
rate: a token is not a trial. Every token of a request shares its fate (a 40k-token follow-up
of a conversation hits its whole history, a fresh prompt only the system prompt), so the
interval's rate moves with which requests happened to arrive, and long prompts weigh most.

* load: 0.2..10 requests/s at the daily mean (log-uniform), a daily cycle (x 1 +- 0.3..0.7),
  0.5..2 h bursts or lulls (x 0.4..2, one per 8 h on average);
* requests: prompt lengths log-normal (median 1k..8k tokens, log s.d. 0.6..1.2, at most 128k);
  a share of them (0.2..0.8, wandering by 0..0.06 with a 1..3 h memory) continue a session and
  hit 60..95 % of their prompt on average (Beta), the rest hit only a shared system prompt
  (2..30 % on average); hits are whole blocks of 16 tokens;
* cache pressure: in half the series the sessions' hits fall with load above the daily mean
  (by up to 0..30 % at twice the load), so the rate has a daily cycle of its own;
* restarts: 0..3 per series; the counters start over and the cache is empty: sessions' hits
  come back as their next turns arrive (time constant 2..20 min), the system prompt's at once;
* changes, downward only (the detector's side): steps of -0.05..-0.3 of the hit rate (a router
  that lost prefix affinity, a smaller cache) with a fixed -0.10 cohort, and ramps of
  0.02..0.1 per hour until 0.06..0.15 down, starting 1..3 h in (a third) or 3..24 h in; a change
  scales every request's hit fraction, so its size is absolute on the token-weighted rate.

Seeds follow families.py's split (``TUNING_SEEDS``, ``SEALED_SEEDS``): tune on the first, report the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from families import HOUR, RateSeries, _ar1, _loguniform, daily_load  # the issue-16 generator's helpers

BLOCK = 16


@dataclass
class PrefixSeries:
    name: str
    t: np.ndarray
    queries: np.ndarray  # cumulative tokens, with resets
    hits: np.ndarray
    kind: str  # "none" | "step" | "ramp"
    change: float = 0.0  # absolute change of the hit rate (negative: down)
    per_hour: float = 0.0
    onset: float | None = None
    base: float = 0.0  # the token-weighted hit rate before the change
    restarts: list[float] = field(default_factory=list)
    family: dict = field(default_factory=dict)

    deviation_time = RateSeries.deviation_time  # when the change first reaches ``amount`` below its start


def prefix_case(seed: int, *, kind: str = "none", change: float | None = None, hours: float | None = None,
                early_onset: bool | None = None) -> PrefixSeries:
    rng = np.random.default_rng([17, seed, {"none": 2, "step": 3, "ramp": 4}[kind]])
    dt = float(rng.choice([10.0, 15.0, 30.0]))
    early = bool(rng.random() < 1 / 3) if early_onset is None else early_onset
    onset, total, speed, dur = None, 0.0, 0.0, 0.0
    if kind != "none":
        onset = (rng.uniform(1, 3) if early else rng.uniform(3, 24)) * HOUR
        if kind == "step":
            total = change if change is not None else -float(rng.uniform(0.05, 0.3))
        else:
            speed = -float(rng.uniform(0.02, 0.1))
            total = -float(rng.uniform(0.06, 0.15))
            dur = abs(total / speed) * HOUR
    span = (hours * HOUR) if hours else (36 * HOUR if kind == "none" else onset + dur + 3 * HOUR)
    t = np.arange(dt, span + dt, dt)

    rps = _loguniform(rng, 0.2, 10.0)
    load = daily_load(rng, t, span)
    share = np.clip(rng.uniform(0.2, 0.8) + _ar1(rng, len(t), dt, rng.uniform(0, 0.06), rng.uniform(1, 3) * HOUR),
                    0.02, 0.98)
    session_hit = rng.uniform(0.6, 0.95)
    system_hit = rng.uniform(0.02, 0.3)
    pressure = rng.uniform(0, 0.3) if rng.random() < 0.5 else 0.0
    median_len, len_sd = _loguniform(rng, 1000, 8000), rng.uniform(0.6, 1.2)
    restarts = sorted(float(x) for x in rng.uniform(0.5 * HOUR, span, int(rng.integers(0, 4))))
    warm_tau = _loguniform(rng, 120, 1200)

    # requests, all at once: their interval, length, kind and hit fraction
    k = rng.poisson(rps * load * dt)
    idx = np.repeat(np.arange(len(t)), k)
    length = np.minimum(np.exp(rng.normal(np.log(median_len), len_sd, len(idx))), 131072.0).astype(np.int64) + 1
    in_session = rng.random(len(idx)) < share[idx]
    conc = 8.0
    frac = np.where(in_session, rng.beta(session_hit * conc, (1 - session_hit) * conc, len(idx)),
                    rng.beta(system_hit * conc, (1 - system_hit) * conc, len(idx)))
    ts = t[idx]
    if pressure:
        frac = np.where(in_session, frac * (1 - pressure * np.clip(load[idx] - 1, 0, 1)), frac)
    if restarts:  # an empty cache: a session's history is back once its next turn has run
        since = np.full(len(idx), np.inf)
        for r in restarts:
            since = np.where(ts >= r, ts - r, since)
        frac = np.where(in_session, frac * (1 - np.exp(-since / warm_tau)), frac)
    hit_tokens = (np.floor(frac * length / BLOCK) * BLOCK).astype(np.int64)
    q = np.bincount(idx, weights=length, minlength=len(t))
    h = np.bincount(idx, weights=hit_tokens, minlength=len(t))
    pre = t < (onset if onset is not None else np.inf)
    base = float(h[pre].sum() / max(q[pre].sum(), 1.0))
    if onset is not None:  # scale every request's hit fraction so the token-weighted rate moves by `total`
        if kind == "step":
            drop = np.where(ts >= onset, -total, 0.0)
        else:
            drop = np.clip((ts - onset) * -speed / HOUR, 0.0, -total)
        scale = np.clip(1.0 - drop / max(base, 1e-6), 0.0, 1.0)
        hit_tokens = (np.floor(frac * scale * length / BLOCK) * BLOCK).astype(np.int64)
        h = np.bincount(idx, weights=hit_tokens, minlength=len(t))
    cq, ch = np.cumsum(q), np.cumsum(h)
    for r in restarts:  # the engine restarted: counters start over (and miss the scrape in between)
        i = int(np.searchsorted(t, r))
        if 0 < i < len(t):
            cq[i:] -= cq[i - 1]
            ch[i:] -= ch[i - 1]
    fam = {"rps": round(rps, 2), "median_len": round(median_len), "session_share": round(float(share.mean()), 2),
           "session_hit": round(session_hit, 2), "system_hit": round(system_hit, 2), "pressure": round(pressure, 2),
           "base": round(base, 3), "dt": dt, "restarts": len(restarts), "warm_tau_s": round(warm_tau),
           "early_onset": early and kind != "none"}
    name = f"pfx{seed}-{kind}" + (f"{total:+.2f}" if kind != "none" else "")
    return PrefixSeries(name, t, cq, ch, kind, total, speed, onset, base, restarts, fam)
