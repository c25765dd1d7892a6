"""Series for the TPOT-at-same-load drift detector (issue 16: "the same applies to ... the
TPOT-at-same-load drifts"), written apart from the detector (no shared code or constants).

Each case is one decode pool as the guard scrapes it: the cumulative ``_sum`` and ``_count`` of
the per-request TPOT histogram and the running-requests gauge, sampled every 15 or 30 s.

* load: running requests per engine 2..96 at the daily mean (log-uniform), a daily cycle
  (x 1 +- 0.2..0.8), 0.5..2 h bursts or lulls (x 0.4..2.5, one per 8 h on average), short-term
  noise (s.d. 10 %, ~3 min); in a third of the series a quiet start (the first 1.5..4 h at
  0.15..0.4 of the load), so the warm-up sees only small batches and the busy hours come later;
* step time: TPOT = a (1 + c r^g) for a batch of r, a 6..30 ms, the batch part 0.2..3 x the
  base at the mean load, g 0.8..1.2 (not the affine law: a detector that assumes one is off
  when the load moves);
* noise: a request-mix term in log TPOT (AR(1), s.d. 0..6 %, correlation 1..10 min), a slow
  wander (s.d. 0..2 %, 1..3 h), per-request dispersion (log s.d. 0.1..0.4) averaged over the
  requests that finished in the sample (0.2..20 per second at the mean load), and preemption
  stalls (one sample in 1000 at 1.5..3 x);
* counter resets: 0..2 per series (an engine restart);
* changes (relative to what the load would give): steps of +10..40 % (a fixed +20 % cohort) and
  ramps of +3..15 % per hour until +15..40 %, starting 1..3 h in (a third) or 3..24 h in.

Seeds follow families.py's split (``TUNING_SEEDS``, ``SEALED_SEEDS``): tune on the first, report the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from families import DAY, HOUR, _ar1, _loguniform  # the issue-16 generator's helpers (this file's directory)


@dataclass
class TpotSeries:
    name: str
    t: np.ndarray
    tpot_sum: np.ndarray  # cumulative seconds (histogram _sum)
    tpot_count: np.ndarray  # cumulative requests (histogram _count)
    running: np.ndarray  # gauge, mean per engine
    kind: str  # "none" | "step" | "ramp"
    change: float  # relative: +0.2 = 20 % slower
    per_hour: float
    onset: float | None
    family: dict = field(default_factory=dict)

    def factor_at(self, t: float) -> float:
        """The change's multiplier on TPOT at time ``t`` (1 before the onset)."""
        if self.onset is None or t < self.onset:
            return 1.0
        if self.kind == "step":
            return 1.0 + self.change
        return 1.0 + min(self.change, (t - self.onset) / HOUR * self.per_hour)


def tpot_case(seed: int, *, kind: str = "none", change: float | None = None, per_hour: float | None = None,
              hours: float | None = None) -> TpotSeries:
    rng = np.random.default_rng([17, seed, {"none": 1, "step": 2, "ramp": 3}[kind]])
    dt = float(rng.choice([15.0, 30.0]))
    early = bool(rng.random() < 1 / 3)
    onset, total, speed = None, 0.0, 0.0
    span = (hours or 36.0) * HOUR
    if kind != "none":
        onset = (rng.uniform(1, 3) if early else rng.uniform(3, 24)) * HOUR
        if kind == "step":
            total = change if change is not None else rng.uniform(0.10, 0.40)
            dur = 0.0
        else:
            speed = per_hour if per_hour is not None else rng.uniform(0.03, 0.15)
            total = rng.uniform(0.15, 0.40)
            dur = total / speed * HOUR
        span = hours * HOUR if hours else onset + dur + 3 * HOUR
    t = np.arange(dt, span + dt, dt)
    n = len(t)
    mean_r = _loguniform(rng, 2, 96)
    load = 1 + rng.uniform(0.2, 0.8) * np.sin(2 * np.pi * t / DAY + rng.uniform(0, 2 * np.pi))
    for _ in range(int(rng.poisson(span / (8 * HOUR)))):
        s, d = rng.uniform(0, span), rng.uniform(0.5, 2) * HOUR
        load = load * np.where((t >= s) & (t < s + d), rng.uniform(0.4, 2.5), 1.0)
    quiet = bool(rng.random() < 1 / 3)
    if quiet:
        load = load * np.where(t < rng.uniform(1.5, 4) * HOUR, rng.uniform(0.15, 0.4), 1.0)
    running = np.maximum(1.0, mean_r * load * np.exp(_ar1(rng, n, dt, 0.10, 180.0)))
    a = rng.uniform(0.006, 0.030)
    g = rng.uniform(0.8, 1.2)
    c = rng.uniform(0.2, 3.0) / mean_r**g
    mix_sd, mix_corr = rng.uniform(0, 0.06), rng.uniform(60, 600)
    wander_sd, wander_corr = rng.uniform(0, 0.02), rng.uniform(1, 3) * HOUR
    log_noise = _ar1(rng, n, dt, mix_sd, mix_corr) + _ar1(rng, n, dt, wander_sd, wander_corr)
    tpot = a * (1 + c * running**g) * np.exp(log_noise)
    if onset is not None:
        rel = (t - onset) / HOUR * speed if kind == "ramp" else np.full(n, total)
        tpot = tpot * np.where(t >= onset, 1 + np.minimum(rel, total), 1.0)
    stall = rng.random(n) < 0.001
    tpot = tpot * np.where(stall, rng.uniform(1.5, 3.0, n), 1.0)
    fin_s = _loguniform(rng, 0.2, 20)
    k = rng.poisson(fin_s * running / mean_r * dt)
    disp = rng.uniform(0.1, 0.4)
    # the mean of k lognormal request TPOTs around the sample's TPOT (unit mean): CLT for k >= 1
    mean_k = np.where(k > 0, np.exp(rng.normal(0, disp / np.sqrt(np.maximum(k, 1))) - disp**2 / (2 * np.maximum(k, 1))),
                      0.0)
    s_inc = k * tpot * mean_k
    cs, cc = np.cumsum(s_inc), np.cumsum(k).astype(float)
    resets = sorted(rng.uniform(0.5 * HOUR, span, int(rng.integers(0, 3))))
    for r in resets:  # an engine restart: the histogram starts over
        i = int(np.searchsorted(t, r))
        if 0 < i < n:
            cs[i:] -= cs[i - 1]
            cc[i:] -= cc[i - 1]
    fam = {"dt": dt, "quiet_start": quiet, "early_onset": early and kind != "none", "mix_sd": round(mix_sd, 3),
           "mix_corr_s": round(mix_corr), "wander_sd": round(wander_sd, 3), "finished_per_s": round(fin_s, 2),
           "mean_running": round(mean_r, 1), "exponent": round(g, 2), "resets": len(resets)}
    name = f"tpot{seed}-{kind}" + (f"{total:+.2f}" if kind != "none" else "")
    return TpotSeries(name, t, cs, cc, running, kind, float(total), float(speed), onset, fam)
