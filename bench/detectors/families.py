"""An independent series generator for the out-of-sample validation protocol (issue 16).

Written apart from ``sla_guard/detect/synthetic.py`` (no shared code, different shapes, ranges
and sampling) so that a detector tuned on one generator is judged on another. Each case is
drawn from a seed; ``TUNING_SEEDS`` and ``SEALED_SEEDS`` are disjoint ranges: tune on the first,
report the second once per change, never tune to it.

Leak families (``leak_case``), one engine process exported as a post-mortem would be
(timestamp, rss_bytes, limit_bytes; a running-requests series is generated too, for the
load-aware mode):

* sampling every 15, 30 or 60 s; base RSS 3..12 GiB, limit 1.4..2.5 x base;
* start-up growth after every (re)start: 100..1200 MiB, time constant 5..60 min, one phase, or a
  fast phase plus a slow one (the slow one <= 30 % of it), or an S-shaped (logistic) fill
  centred on the time constant;
* allocator/GC sawtooth: 20..300 MiB, period 1..30 min (log-uniform), each period jittered
  +-25 %, linear or front-loaded rise, full or partial collection;
* a daily swing (half-amplitude 0..40 MiB) and an hourly one (0..15 MiB), random phases;
* sampling noise 1..8 MiB, and big-batch spikes (0..1 per hour, 30..400 MiB for 0.5..3 min);
* plateaus and steps, up (64..256 MiB, reached over 0..20 min) and down (32..192 MiB,
  memory returned), 0..4 per day;
* restarts every 4..16 h in about a third of the series (RSS falls to the model-loading level
  and grows again), before the leak's onset and after it;
* RSS coupled to load (running requests, with a daily cycle and 1..3 h bursts) by 10..80 MiB in
  half of the series, not at all in the others;
* leaks of 10..200 MiB/h (log-uniform; fixed 24 and 48 MiB/h cohorts for the targets), linear,
  in proportion to load, or in 4..16 MiB chunks; onset anywhere from 1 h after a (re)start, a
  third of them in the first 3 h after one. A restart after the onset ends the leaking process;
  the new one leaks again from 1..3 h after its start.

Acceptance families (``rate_case``): counters draft_tokens / accepted_tokens sampled every
10..30 s; draft rate 5..500 per second (log-uniform) with a daily load cycle (x0.3..1.7) and
bursts; acceptance 0.35..0.85 with overdispersion (an AR(1) request-mix term, s.d. 0..0.04,
correlation 10..120 s) and a slow wander (s.d. 0..0.004, 1 h); 0..3 counter resets per series;
changes: steps of +-0.05..0.2 (fixed -0.10 / +0.10 cohorts) and ramps of 0.02..0.1 per hour
lasting until 0.06..0.15, starting anywhere from 1 h in (a third in the first 3 h).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIB = float(2**20)
GIB = float(2**30)
MINUTE = 60.0
HOUR = 3600.0
DAY = 86400.0

TUNING_SEEDS = range(0, 100_000)  # the seeds a developer may look at
SEALED_SEEDS = range(900_000, 1_000_000)  # reported, never tuned to


def _loguniform(rng, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


@dataclass
class LeakSeries:
    name: str
    t: np.ndarray
    rss: np.ndarray
    limit_bytes: float
    running: np.ndarray
    leak_mib_h: float = 0.0
    onset: float | None = None  # first leak onset (s), None: no leak
    starts: list[float] = field(default_factory=list)  # process starts (s), first is 0
    family: dict = field(default_factory=dict)  # what was drawn, for per-family tables

    @property
    def leaking(self) -> bool:
        return self.onset is not None


def _running(rng, t: np.ndarray) -> np.ndarray:
    """Running requests: a daily cycle, 1..3 h bursts, short-term noise (AR(1), ~3 min)."""
    mean = rng.uniform(4, 48)
    day = 1 + rng.uniform(0.2, 0.7) * np.sin(2 * np.pi * t / DAY + rng.uniform(0, 2 * np.pi))
    for _ in range(int(rng.poisson((t[-1] - t[0]) / (10 * HOUR))) + 1):
        s, d = rng.uniform(t[0], t[-1]), rng.uniform(1, 3) * HOUR
        day = day + rng.uniform(0.3, 0.9) * ((t >= s) & (t < s + d))
    dt = t[1] - t[0]
    a = np.exp(-dt / 180.0)
    e = rng.normal(0, 0.2 * np.sqrt(1 - a * a), len(t))
    ar = np.empty(len(t))
    acc = 0.0
    for i, x in enumerate(e):
        acc = a * acc + x
        ar[i] = acc
    return np.maximum(0.0, mean * (day + ar))


def _startup(rng, since: np.ndarray) -> np.ndarray:
    """Start-up growth as a function of time since the process start (s)."""
    amp = rng.uniform(100, 1200) * MIB
    tau = rng.uniform(5, 60) * MINUTE
    shape = rng.choice(["one", "two", "logistic"])
    if shape == "one":
        return amp * (1 - np.exp(-since / tau))
    if shape == "two":
        slow = rng.uniform(0.1, 0.3)
        tau2 = rng.uniform(1.0, 2.0) * tau  # slow phase still inside the 5..60 min family
        return amp * ((1 - slow) * (1 - np.exp(-since / (tau / 3))) + slow * (1 - np.exp(-since / min(tau2, 3600))))
    mid, scale = tau, tau / 4  # an S-shaped fill: 10..90 % between 0.45 and 1.55 tau
    return amp * (1 / (1 + np.exp(-(since - mid) / scale)) - 1 / (1 + np.exp(mid / scale)))


def _sawtooth(rng, t: np.ndarray) -> np.ndarray:
    amp = rng.uniform(20, 300) * MIB
    period = _loguniform(rng, 1 * MINUTE, 30 * MINUTE)
    n = int((t[-1] - t[0]) / (0.75 * period)) + 3
    gaps = period * rng.uniform(0.75, 1.25, n)
    marks = t[0] - rng.uniform(0, period) + np.cumsum(gaps)
    k = np.searchsorted(marks, t, side="right") - 1
    prev = np.where(k >= 0, marks[np.clip(k, 0, None)], marks[0] - gaps[0])
    nxt = marks[np.clip(k + 1, 0, n - 1)]
    frac = np.clip((t - prev) / np.maximum(nxt - prev, 1.0), 0.0, 1.0)
    if rng.random() < 0.5:
        frac = np.sqrt(frac)  # front-loaded: most allocation early in the cycle
    keep = rng.uniform(0.0, 0.3) if rng.random() < 0.3 else 0.0  # partial collections
    return amp * ((1 - keep) * frac + keep * (frac > 0))


def _steps(rng, t: np.ndarray) -> np.ndarray:
    out = np.zeros(len(t))
    for _ in range(int(rng.poisson(rng.uniform(0, 4) * (t[-1] - t[0]) / DAY))):
        s = rng.uniform(t[0], t[-1])
        up = rng.random() < 0.6
        size = rng.uniform(64, 256) * MIB if up else -rng.uniform(32, 192) * MIB
        ramp = rng.uniform(0, 20) * MINUTE if up else rng.uniform(0, 2) * MINUTE
        out += size * np.clip((t - s) / max(ramp, 1.0), 0.0, 1.0)
    return out


def _spikes(rng, t: np.ndarray) -> np.ndarray:
    out = np.zeros(len(t))
    rate = rng.uniform(0, 1)
    for _ in range(int(rng.poisson(rate * (t[-1] - t[0]) / HOUR))):
        s = rng.uniform(t[0], t[-1])
        out += rng.uniform(30, 400) * MIB * ((t >= s) & (t < s + rng.uniform(30, 180)))
    return out


LEAK_PARTS = ("startup", "sawtooth", "spikes", "steps", "daily", "hourly", "coupling")


def leak_case(seed: int, *, leak_mib_h: float | None = 0.0, hours: float | None = None,
              restarts: bool | None = None, early_onset: bool | None = None,
              without: frozenset[str] = frozenset()) -> LeakSeries:
    """One process's RSS. ``leak_mib_h``: 0 = no leak, None = a random rate of 10..200 MiB/h,
    else that rate. ``hours``: length (default 48 h without a leak, onset + 6 h with one).
    ``restarts`` / ``early_onset``: force the family (None: drawn). ``without``: parts of
    ``LEAK_PARTS`` left out (drawn all the same, so the rest of the series is unchanged), for
    ``leak_ablation.py``'s question of which part costs a detector what."""
    if unknown := set(without) - set(LEAK_PARTS):
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {LEAK_PARTS}")

    def part(name: str, x):
        return 0.0 * x if name in without else x

    rng = np.random.default_rng([16, seed, 0 if leak_mib_h == 0 else 1])
    dt = float(rng.choice([15.0, 30.0, 60.0]))
    rate = _loguniform(rng, 10, 200) if leak_mib_h is None else float(leak_mib_h)
    restarting = bool(rng.random() < 1 / 3) if restarts is None else restarts
    early = bool(rng.random() < 1 / 3) if early_onset is None else early_onset
    # process starts first: a leak's onset is placed relative to the last start before it
    span_guess = 48 * HOUR if hours is None else hours * HOUR
    starts = [0.0]
    if restarting:
        s = 0.0
        while True:
            s += rng.uniform(4, 16) * HOUR
            if s >= span_guess + 24 * HOUR:
                break
            starts.append(s)
    onset = None
    if rate > 0:
        # onset after a start: early ones 1..3 h after it, others 1..(gap-1) h, or anywhere in 3..30 h
        if early:
            st = float(rng.choice(starts[: max(1, len(starts) - 1)]))
            onset = st + rng.uniform(1, 3) * HOUR
        else:
            onset = rng.uniform(3, 30) * HOUR
            k = np.searchsorted(starts, onset, side="right") - 1
            if onset - starts[k] < HOUR:
                onset = starts[k] + HOUR + rng.uniform(0, 1) * HOUR
        end = onset + 6 * HOUR if hours is None else hours * HOUR
        # restarts between onset and onset + 4 h would end the leak before it can be judged: move them
        starts = [s for s in starts if not (onset - HOUR < s < onset + 4 * HOUR)]
    else:
        end = span_guess
    starts = [s for s in starts if s < end - 0.5 * HOUR]
    t = np.arange(0.0, end, dt)
    running = _running(rng, t)
    base = rng.uniform(3, 12) * GIB
    k = np.searchsorted(starts, t, side="right") - 1
    since = t - np.asarray(starts)[k]
    v = base + part("startup", _startup(rng, since))
    v += part("sawtooth", _sawtooth(rng, t)) + part("spikes", _spikes(rng, t)) + part("steps", _steps(rng, t))
    v += part("daily", rng.uniform(0, 40) * MIB * np.sin(2 * np.pi * t / DAY + rng.uniform(0, 2 * np.pi)))
    v += part("hourly", rng.uniform(0, 15) * MIB * np.sin(2 * np.pi * t / HOUR + rng.uniform(0, 2 * np.pi)))
    coupled = bool(rng.random() < 0.5)
    if coupled:
        rm = running.mean()
        v += part("coupling", rng.uniform(10, 80) * MIB * (running - rm)
                  / max(float(np.percentile(running, 95)) - rm, 1e-9))
    v += rng.normal(0, rng.uniform(1, 8) * MIB, len(t))
    shape = "none"
    if rate > 0:
        shape = str(rng.choice(["linear", "linear", "work", "chunks"]))
        slope = rate * MIB / HOUR
        # the leak grows in each process from its own onset: the first one, and 1..3 h after
        # every later start
        leak = np.zeros(len(t))
        onsets = [onset] + [s + rng.uniform(1, 3) * HOUR for s in starts if s > onset]
        for i, on in enumerate(onsets):
            stop = next((s for s in starts if s > on), np.inf)
            m = (t >= on) & (t < stop)
            if shape == "work":
                w = np.cumsum(running) * dt / max(running.mean(), 1e-9)
                grow = (w - np.interp(on, t, w)) * slope
            else:
                grow = (t - on) * slope
            if shape == "chunks":
                chunk = rng.uniform(4, 16) * MIB
                grow = np.floor(grow / chunk) * chunk
            leak[m] = np.maximum(grow[m], 0.0)
            del i
        v += leak
    # a restart: the new process loads its model (~1..3 min) from a small RSS
    for s in starts[1:]:
        load_s = rng.uniform(60, 180)
        m = (t >= s) & (t < s + load_s)
        low = 0.4 * GIB
        v[m] = low + (v[m] - low) * (t[m] - s) / load_s
    limit = base * rng.uniform(1.4, 2.5)
    fam = {"restarts": restarting and len(starts) > 1, "early_onset": early and rate > 0,
           "coupled": coupled, "shape": shape, "dt": dt}
    name = f"leak{seed}" + (f"-{rate:.0f}" if rate > 0 else "")
    return LeakSeries(name, t, v, float(limit), running, rate if rate > 0 else 0.0, onset, starts, fam)


@dataclass
class RateSeries:
    name: str
    t: np.ndarray
    drafts: np.ndarray  # cumulative, with resets
    accepted: np.ndarray
    kind: str  # "none" | "step" | "ramp"
    change: float = 0.0  # total change of acceptance
    per_hour: float = 0.0  # ramp speed (absolute per hour)
    onset: float | None = None
    base: float = 0.0
    family: dict = field(default_factory=dict)

    def deviation_time(self, amount: float) -> float | None:
        """When the change first reaches ``amount`` (absolute) below/above its start."""
        if self.onset is None:
            return None
        if self.kind == "step":
            return self.onset
        return self.onset + amount / abs(self.per_hour) * HOUR


def _ar1(rng, n: int, dt: float, sd: float, corr_s: float) -> np.ndarray:
    if sd <= 0:
        return np.zeros(n)
    a = np.exp(-dt / corr_s)
    e = rng.normal(0, sd * np.sqrt(1 - a * a), n)
    out = np.empty(n)
    acc = rng.normal(0, sd)
    for i, x in enumerate(e):
        acc = a * acc + x
        out[i] = acc
    return out


def daily_load(rng, t: np.ndarray, span: float) -> np.ndarray:
    """Relative load: a daily cycle (x 1 +- 0.3..0.7) with 0.5..2 h bursts or lulls (x 0.4..2, one
    per 8 h on average)."""
    load = 1 + rng.uniform(0.3, 0.7) * np.sin(2 * np.pi * t / DAY + rng.uniform(0, 2 * np.pi))
    for _ in range(int(rng.poisson(span / (8 * HOUR)))):
        s, d = rng.uniform(0, span), rng.uniform(0.5, 2) * HOUR
        load = load * np.where((t >= s) & (t < s + d), rng.uniform(0.4, 2.0), 1.0)
    return load


def rate_case(seed: int, *, kind: str = "none", change: float | None = None, per_hour: float | None = None,
              hours: float | None = None, early_onset: bool | None = None) -> RateSeries:
    """Acceptance counters. ``kind``: "none", "step" (``change``, default +-0.05..0.2), "ramp"
    (``per_hour`` down or up, default 0.02..0.1 down, lasting until 0.06..0.15 total)."""
    rng = np.random.default_rng([16, seed, {"none": 2, "step": 3, "ramp": 4}[kind]])
    dt = float(rng.choice([10.0, 15.0, 30.0]))
    span = (hours or (36.0 if kind == "none" else 0.0)) * HOUR
    base = rng.uniform(0.35, 0.85)
    early = bool(rng.random() < 1 / 3) if early_onset is None else early_onset
    onset = None
    total = 0.0
    speed = 0.0
    if kind != "none":
        onset = (rng.uniform(1, 3) if early else rng.uniform(3, 24)) * HOUR
        if kind == "step":
            total = change if change is not None else float(rng.choice([-1, 1]) * rng.uniform(0.05, 0.2))
            dur = 0.0
        else:
            speed = per_hour if per_hour is not None else -rng.uniform(0.02, 0.1)
            total = float(np.sign(speed)) * rng.uniform(0.06, 0.15)
            dur = abs(total / speed) * HOUR
        if not span:
            span = onset + dur + 3 * HOUR
    t = np.arange(dt, span + dt, dt)
    drafts_s = _loguniform(rng, 5, 500)
    load = daily_load(rng, t, span)
    od = rng.uniform(0, 0.04)
    corr_s = rng.uniform(10, 120)
    p = base + _ar1(rng, len(t), dt, od, corr_s) + _ar1(rng, len(t), dt, rng.uniform(0, 0.004), HOUR)
    if onset is not None:
        if kind == "step":
            p = p + total * (t >= onset)
        else:
            p = p + np.clip((t - onset) * speed / HOUR, min(total, 0), max(total, 0))
    p = np.clip(p, 0.01, 0.99)
    n = rng.poisson(drafts_s * load * dt)
    x = rng.binomial(n, p)
    cn, cx = np.cumsum(n).astype(float), np.cumsum(x).astype(float)
    resets = sorted(rng.uniform(0.5 * HOUR, span, int(rng.integers(0, 4))))
    for r in resets:  # the engine restarted: counters start over (and miss the scrape in between)
        i = int(np.searchsorted(t, r))
        if 0 < i < len(t):
            cn[i:] -= cn[i - 1]
            cx[i:] -= cx[i - 1]
    fam = {"drafts_s": drafts_s, "overdispersion": od, "corr_s": corr_s, "early_onset": early and kind != "none",
           "dt": dt, "resets": len(resets)}
    name = f"acc{seed}-{kind}" + (f"{total:+.2f}" if kind != "none" else "")
    return RateSeries(name, t, cn, cx, kind, total, speed, onset, base, fam)
