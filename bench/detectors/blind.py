"""Blind synthetic series for checking the leak and drift detectors on data they were never tuned on.

This generator was written blind, from a specification only (issue 16's text), without reading the project's
detectors, their tests or the other bench generators. ``prose.py --generator blind`` scores it on prose.py's
seed sets: the sealed seeds are only ever reported, never tuned to (a detector that fails on one must be fixed
on other seeds, or the failure reported, not the seed changed); session 21 diagnosed on the tuning-more seeds.

Two families, 13 cases in all (``cases`` writes one CSV per case and returns its ground truth):

* Leak series, one engine process's resident memory as exported in a post-mortem (30-36 h, a 10-60 s sample
  interval with a few short holes): base RSS 4-14 GiB; a start-up fill of 200-900 MiB after each (re)start
  (exponential, two-phase or S-shaped, time constants 5-60 min); an allocator/GC sawtooth of 60-120 MiB every
  3-7 min with jittered cycles, linear or concave rises and collections that may release only part of the
  growth; hourly and daily swings; heavy-ish measurement noise; occasional big-batch spikes. Cases: 48 MiB/h
  leaks from hour 8 and 6, 24 MiB/h from hour 5, a 48 MiB/h leak 8 h after a warm restart at hour 10, and three
  leak-free series (a plateau step, a warm restart, plain).
* Acceptance series, speculative-decoding draft/accepted token counters (cumulative, 40 h, 10-30 s samples,
  0-2 counter resets): a draft rate of 20-300/s with a daily load cycle and bursts, over-dispersed drafts, a
  true acceptance of 0.45-0.85 with an autocorrelated request-mix term, binomial acceptances. Cases: a 0.10
  step drop at hour 10 and at hour 30, no change, and linear 0.06 declines over 3 h from hours 4, 12 and 20.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np

T0 = 1_800_000_000
MIB = float(2**20)
HOUR = 3600.0
PAGE = 4096
_SALT = 160_416

# name, leak rate (MiB/h), onset hour, restart hour (fixed, range or None), plateau step
_LEAK_CASES: list[tuple[str, float, float | None, tuple[float, float] | None, bool]] = [
    ("leak48_h8", 48.0, 8.0, None, False),
    ("leak48_h6", 48.0, 6.0, None, False),
    ("leak24_h5", 24.0, 5.0, None, False),
    ("leak48_8h_after_restart", 48.0, 18.0, (10.0, 10.0), False),
    ("none_step", 0.0, None, None, True),
    ("none_restart", 0.0, None, (10.0, 14.0), False),
    ("none_plain", 0.0, None, None, False),
]

# name, change kind ("step", "ramp" or None), change hour
_DRIFT_CASES: list[tuple[str, str | None, float | None]] = [
    ("step_h10", "step", 10.0),
    ("step_day2", "step", 30.0),
    ("none_rate", None, None),
    ("ramp_h4", "ramp", 4.0),
    ("ramp_h12", "ramp", 12.0),
    ("ramp_h20", "ramp", 20.0),
]

NAMES = [c[0] for c in _LEAK_CASES] + [c[0] for c in _DRIFT_CASES]


# ---------------------------------------------------------------------------------------------------------------
# shared helpers


def _ar1(rng: np.random.Generator, n: int, dt: float, tau: float, sd: float) -> np.ndarray:
    """Stationary AR(1) series with time constant ``tau`` seconds and marginal s.d. ``sd``."""
    phi = float(np.exp(-dt / tau))
    e = rng.normal(0.0, sd * np.sqrt(1.0 - phi * phi), n)
    x = np.empty(n)
    prev = rng.normal(0.0, sd)
    for i in range(n):
        prev = phi * prev + e[i]
        x[i] = prev
    return x


def _holes(rng: np.random.Generator, t: np.ndarray, n_max: int, lo: float, hi: float,
           protect: list[float]) -> np.ndarray:
    """Boolean mask keeping samples outside 0..n_max random holes of lo..hi seconds (first/last always kept)."""
    keep = np.ones(t.size, bool)
    n = int(rng.integers(0, n_max + 1))
    for _ in range(n):
        for _try in range(50):
            length = rng.uniform(lo, hi)
            start = rng.uniform(HOUR, t[-1] - HOUR - length)
            if all(not (start - 120.0 <= p <= start + length + 120.0) for p in protect):
                keep &= ~((t >= start) & (t < start + length))
                break
    keep[0] = keep[-1] = True
    return keep


def _write(path: pathlib.Path, header: str, cols: list[np.ndarray]) -> None:
    """Write integer columns as a CSV with an exact header line."""
    data = np.column_stack([np.asarray(c, dtype=np.int64) for c in cols])
    np.savetxt(path, data, fmt="%d", delimiter=",", header=header, comments="")


# ---------------------------------------------------------------------------------------------------------------
# leak family


def _startup(rng: np.random.Generator, tau: np.ndarray, amp: float, f0: float) -> np.ndarray:
    """Start-up fill (MiB) as a function of process age ``tau`` seconds, starting at fraction ``f0``."""
    shape = rng.choice(["exp", "two", "s"])
    x = np.maximum(tau, 0.0)
    if shape == "exp":
        g = 1.0 - np.exp(-x / rng.uniform(300.0, 3600.0))
    elif shape == "two":
        w = rng.uniform(0.3, 0.8)
        g = w * (1.0 - np.exp(-x / rng.uniform(300.0, 900.0))) + (1.0 - w) * (
            1.0 - np.exp(-x / rng.uniform(1200.0, 3600.0)))
    else:
        k = rng.uniform(1.5, 3.0)
        g = 1.0 - np.exp(-((x / rng.uniform(600.0, 3600.0)) ** k))
    return amp * (f0 + (1.0 - f0) * g)


def _sawtooth(rng: np.random.Generator, tau: np.ndarray, period: float, amp: float, partial: bool,
              rise: str) -> np.ndarray:
    """Allocator/GC sawtooth (MiB) over process age ``tau``: jittered cycles, partial collections, shaped rises."""
    end = float(tau.max()) + 2.0 * period
    starts, lens, amps, carries, ks = [], [], [], [], []
    s = -rng.uniform(0.0, period)
    carry = rng.uniform(0.0, 0.3 * amp) if partial else 0.0
    p_full = rng.uniform(0.12, 0.35)
    k_series = rng.uniform(1.4, 2.6)
    while s < end:
        p = float(np.clip(period * np.exp(rng.normal(0.0, 0.15)), 170.0, 430.0))
        a = float(np.clip(amp * np.exp(rng.normal(0.0, 0.15)), 0.6 * amp, 1.4 * amp))
        if rise == "linear":
            k = 1.0
        elif rise == "concave":
            k = k_series * np.exp(rng.normal(0.0, 0.1))
        else:
            k = 1.0 if rng.random() < 0.5 else rng.uniform(1.3, 2.8)
        starts.append(s)
        lens.append(p)
        amps.append(a)
        carries.append(carry)
        ks.append(k)
        if partial:
            carry = min(carry + a * (1.0 - rng.uniform(0.55, 0.95)), 2.0 * amp)
            if rng.random() < p_full:
                carry = rng.uniform(0.0, 5.0)
        s += p
    st = np.asarray(starts)
    idx = np.clip(np.searchsorted(st, tau, side="right") - 1, 0, st.size - 1)
    u = np.clip((tau - st[idx]) / np.asarray(lens)[idx], 0.0, 1.0)
    f = 1.0 - (1.0 - u) ** np.asarray(ks)[idx]
    return np.asarray(carries)[idx] + np.asarray(amps)[idx] * f


def _leak_case(rng: np.random.Generator, out: pathlib.Path, name: str, rate: float, onset_h: float | None,
               restart: tuple[float, float] | None, step: bool) -> dict:
    """Generate one RSS series, write it, and return its ground truth."""
    dt = int(rng.choice([10, 20, 30, 45, 60]))
    dur_h = 36.0 if restart is not None and onset_h is not None else rng.uniform(30.0, 36.0)
    t = np.arange(0.0, dur_h * HOUR + 1.0, dt)

    restart_s = None if restart is None else rng.uniform(*restart) * HOUR
    protect = [] if restart_s is None else [restart_s]
    keep = _holes(rng, t, 3, 60.0, 480.0, protect)
    if restart_s is not None:  # the process is down for a little while
        keep &= ~((t >= restart_s - rng.uniform(0.0, 120.0)) & (t < restart_s))
    t = t[keep]
    n = t.size

    base = rng.uniform(4.0, 14.0) * 1024.0
    period = rng.uniform(180.0, 420.0)
    saw_amp = rng.uniform(60.0, 120.0)
    partial = bool(rng.random() < 0.6)
    rise = str(rng.choice(["linear", "concave", "mixed"]))
    fill = rng.uniform(200.0, 900.0)

    rss = np.empty(n)
    segs = [(0.0, np.inf if restart_s is None else restart_s)]
    if restart_s is not None:
        segs.append((restart_s, np.inf))
    for i, (a, b) in enumerate(segs):
        m = (t >= a) & (t < b)
        if i == 0:
            tau = t[m] + rng.uniform(0.0, 600.0)  # the export begins a little after the process started
            seg_base, f0, amp = base, 0.0, fill
        else:
            tau = t[m] - a  # warm restart: the model is already mapped; only the start-up fill is redone
            seg_base = base + rng.normal(0.0, 10.0)
            f0 = rng.uniform(0.0, 0.15)
            amp = float(np.clip(fill * rng.uniform(0.8, 1.2), 200.0, 900.0))
        rss[m] = (seg_base + _startup(rng, tau, amp, f0)
                  + _sawtooth(rng, tau, period * rng.uniform(0.9, 1.1), saw_amp, partial, rise))

    # hourly and daily swings, on wall-clock time, each with a little second harmonic
    ta = T0 + t
    h_amp, d_amp = rng.uniform(2.0, 12.0), rng.uniform(5.0, 35.0)
    ph = rng.uniform(0.0, 2 * np.pi, 4)
    rss += h_amp * (np.sin(2 * np.pi * ta / HOUR + ph[0]) + 0.25 * np.sin(4 * np.pi * ta / HOUR + ph[1])) / 1.1
    rss += d_amp * (np.sin(2 * np.pi * ta / 86400.0 + ph[2]) + 0.3 * np.sin(4 * np.pi * ta / 86400.0 + ph[3])) / 1.15

    # measurement noise: Student t (df 5), scaled to the chosen s.d.
    rss += rng.standard_t(5.0, n) * rng.uniform(2.0, 6.0) * np.sqrt(3.0 / 5.0)

    # big batches: at most one per hour
    p_spike = rng.uniform(0.0, 0.6)
    for h in range(int(np.ceil(dur_h))):
        if rng.random() < p_spike:
            s0 = (h + rng.random()) * HOUR
            d = rng.uniform(20.0, 120.0)
            height = rng.uniform(50.0, 300.0)
            tail = rng.uniform(5.0, 20.0)
            x = t - s0
            prof = np.where((x >= 0) & (x < d), 1.0, 0.0)
            prof += np.where((x >= d) & (x < d + 5 * tail), np.exp(-np.clip(x - d, 0.0, None) / tail), 0.0)
            rss += height * prof

    if step:  # a plateau step (a new adapter, a bigger cache) reached within 0-5 minutes
        ts = rng.uniform(12.0, 16.0) * HOUR
        ramp = rng.uniform(0.0, 300.0)
        frac = (t >= ts).astype(float) if ramp < 1.0 else np.clip((t - ts) / ramp, 0.0, 1.0)
        if ramp >= 1.0 and rng.random() < 0.5:
            frac = frac * frac * (3.0 - 2.0 * frac)
        rss += rng.uniform(100.0, 200.0) * frac

    change = None
    if onset_h is not None and rate > 0:
        onset = onset_h * HOUR
        lk = np.maximum(t - onset, 0.0) * rate / HOUR
        if rng.random() < 0.4:  # the leak arrives in small chunks; the mean slope is still ``rate``
            c = rng.uniform(2.0, 8.0)
            lk = np.where(t >= onset, c * np.floor(lk / c + rng.random()), 0.0)
        rss += lk
        change = float(T0 + onset)

    rss_b = np.round(rss * MIB / PAGE).astype(np.int64) * PAGE
    factor = rng.uniform(max(1.5, 1.1 * float(rss_b.max()) / (base * MIB)), 3.0)
    limit = round(base * MIB * factor)
    _write(out / f"{name}.csv", "timestamp,rss_bytes,limit_bytes",
           [T0 + t.astype(np.int64), rss_b, np.full(n, limit, np.int64)])
    return {"kind": "leak", "name": name, "rate": float(rate), "change": change}


# ---------------------------------------------------------------------------------------------------------------
# acceptance (drift) family


def _reset_times(rng: np.random.Generator, end: float, avoid: list[float]) -> list[float]:
    """0-2 counter-reset times, 30 min from the ends and the change points and an hour apart."""
    n = int(rng.integers(0, 3))
    out: list[float] = []
    for _ in range(n):
        for _try in range(1000):
            x = rng.uniform(1800.0, end - 1800.0)
            if all(abs(x - a) >= 1800.0 for a in avoid) and all(abs(x - r) >= HOUR for r in out):
                out.append(x)
                break
    return sorted(out)


def _drift_case(rng: np.random.Generator, out: pathlib.Path, name: str, kind: str | None,
                change_h: float | None) -> dict:
    """Generate one pair of cumulative draft/accepted counters, write it, and return its ground truth."""
    dt = int(rng.choice([10, 15, 20, 30]))
    end = 40.0 * HOUR
    t = np.arange(0.0, end + 1.0, dt)
    n = t.size
    mid = t - dt / 2.0
    ta = T0 + mid

    # draft rate: daily load cycle (kept within x0.4..1.6), 1-2 h bursts, short-term wobble
    r0 = float(np.exp(rng.uniform(np.log(20.0), np.log(300.0))))
    ph = rng.uniform(0.0, 2 * np.pi, 2)
    load = 1.0 + rng.uniform(0.25, 0.5) * np.sin(2 * np.pi * ta / 86400.0 + ph[0])
    load += rng.uniform(0.0, 0.15) * np.sin(4 * np.pi * ta / 86400.0 + ph[1])
    load = np.clip(load, 0.4, 1.6)
    for _ in range(int(rng.integers(0, 4))):
        b0 = rng.uniform(0.0, end)
        blen = rng.uniform(1.0, 2.0) * HOUR
        edge = rng.uniform(300.0, 900.0)
        w = np.clip(np.minimum((mid - b0) / edge, (b0 + blen - mid) / edge), 0.0, 1.0)
        load *= 1.0 + rng.uniform(0.3, 1.0) * w
    load *= np.exp(_ar1(rng, n, dt, rng.uniform(120.0, 900.0), rng.uniform(0.03, 0.12)))
    lam = r0 * load * dt
    if rng.random() < 0.6:  # over-dispersed (gamma-Poisson) drafts
        k = rng.uniform(5.0, 60.0)
        lam = lam * rng.gamma(k, 1.0 / k, n)
    drafts = rng.poisson(lam).astype(np.int64)
    drafts[0] = 0

    # acceptance: level, request-mix term, the change
    p0 = rng.uniform(0.45, 0.85)
    p = p0 + _ar1(rng, n, dt, rng.uniform(60.0, 180.0), rng.uniform(0.01, 0.025))
    avoid: list[float] = []
    change = None
    if kind is not None and change_h is not None:
        c = change_h * HOUR
        change = float(T0 + c)
        if kind == "step":
            p = p - 0.10 * (mid >= c)
            avoid = [c]
        else:
            p = p - 0.06 * np.clip((mid - c) / (3.0 * HOUR), 0.0, 1.0)
            avoid = [c, c + 3.0 * HOUR]
    p = np.clip(p, 0.01, 0.99)
    acc = rng.binomial(drafts, p).astype(np.int64)

    # counter resets: both counters restart at the same sample, which holds only part of its interval
    resets = [int(np.searchsorted(t, x)) for x in _reset_times(rng, end, avoid)]
    for j in resets:
        drafts[j] = rng.binomial(drafts[j], rng.uniform(0.1, 1.0))
        acc[j] = rng.binomial(drafts[j], p[j])
    d0 = int(r0 * rng.uniform(0.0, 3.0 * 86400.0))
    a0 = int(d0 * float(np.clip(p0 + rng.normal(0.0, 0.02), 0.0, 1.0)))
    cum_d, cum_a = np.empty(n, np.int64), np.empty(n, np.int64)
    bounds = [0, *resets, n]
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        cum_d[a:b] = np.cumsum(drafts[a:b]) + (d0 if i == 0 else 0)
        cum_a[a:b] = np.cumsum(acc[a:b]) + (a0 if i == 0 else 0)

    # a couple of missed scrapes (never the samples around a reset)
    keep = _holes(rng, t, 2, 60.0, 300.0, [float(t[j]) for j in resets])
    for j in resets:
        keep[max(j - 1, 0):j + 1] = True
    _write(out / f"{name}.csv", "timestamp,draft_tokens,accepted_tokens",
           [T0 + t[keep].astype(np.int64), cum_d[keep], cum_a[keep]])
    is_ramp = kind == "ramp"
    return {"kind": "drift", "name": name, "ramp": 0.06 if is_ramp else None, "ramp_h": 3.0 if is_ramp else 0.0,
            "change": change}


# ---------------------------------------------------------------------------------------------------------------


def cases(out: pathlib.Path, seed: int) -> list[dict]:
    """Write the 13 blind cases for ``seed`` into ``out`` and return their ground truth, in ``NAMES`` order."""
    out = pathlib.Path(out)
    res: list[dict] = []
    for i, (name, rate, onset_h, restart, step) in enumerate(_LEAK_CASES):
        rng = np.random.default_rng([_SALT, seed, i])
        res.append(_leak_case(rng, out, name, rate, onset_h, restart, step))
    for j, (name, kind, change_h) in enumerate(_DRIFT_CASES):
        i = len(_LEAK_CASES) + j
        rng = np.random.default_rng([_SALT, seed, i])
        res.append(_drift_case(rng, out, name, kind, change_h))
    return res


def _smoke(seed: int) -> None:
    """Write one seed's cases to a temporary directory and print a line per case."""
    with tempfile.TemporaryDirectory() as d:
        for c in cases(pathlib.Path(d), seed):
            data = np.loadtxt(pathlib.Path(d) / f"{c['name']}.csv", delimiter=",", skiprows=1, dtype=np.int64)
            ch = c["change"]
            rel = "-" if ch is None else f"+{(ch - T0) / HOUR:.1f}h"
            extra = ""
            if c["kind"] == "leak":
                t, r = (data[:, 0] - T0) / HOUR, data[:, 1] / MIB
                m = t >= (t[-1] - 10.0 if ch is None else (ch - T0) / HOUR + 1.0)
                slope = np.polyfit(t[m], r[m], 1)[0]
                extra = f"slope_after={slope:6.1f} MiB/h"
            else:
                dd, da = np.diff(data[:, 1]), np.diff(data[:, 2])
                ok = (dd >= 0) & (da >= 0)
                extra = f"resets={int((~ok).sum())} acc={da[ok].sum() / max(dd[ok].sum(), 1):.3f}"
            print(f"{c['name']:26s} rows={data.shape[0]:6d} change={rel:7s} {extra}")


if __name__ == "__main__":
    _smoke(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
