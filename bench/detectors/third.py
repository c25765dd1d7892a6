"""Third synthetic series generator for leak and drift detectors (written blind from the issue 16 specification).

Leak series model one vLLM process's RSS: start-up growth (weights staging, CUDA pinned pools that grow in
power-of-two steps, tokenizer/prefix caches), glibc arena fragmentation creeping to a plateau, hourly and daily
load swings, bursts of large requests, periodic jobs, THP/page-cache-like jitter, irregular scrapes with gaps,
and warm/cold restarts. Acceptance series model cumulative speculative-decoding draft/accepted counters with
daily load, over-dispersed bursts, request-mix acceptance variation and engine-restart counter resets.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np

MIB = 1024 * 1024
GIB = 1024 * MIB
T0 = 1_800_000_000
SALT = 0x7E1D3
LEAKS = {  # name: (rate MiB/h, onset hour, restart hour)
    "leak48_h8": (48.0, 8.0, None), "leak48_h6": (48.0, 6.0, None), "leak24_h5": (24.0, 5.0, None),
    "leak48_8h_after_restart": (48.0, 18.0, 10.0), "none_step": (0.0, None, None),
    "none_restart": (0.0, None, "rand"), "none_plain": (0.0, None, None),
}
DRIFTS = {  # name: (change hour, ramp)
    "step_h10": (10.0, False), "step_day2": (30.0, False), "none_rate": (None, False),
    "ramp_h4": (4.0, True), "ramp_h12": (12.0, True), "ramp_h20": (20.0, True),
}
NAMES = list(LEAKS) + list(DRIFTS)


def _times(rng: np.random.Generator, hours: float, lo: int, hi: int) -> np.ndarray:
    """Irregular scrape times: fixed period, jitter, a few short holes."""
    period = int(rng.integers(lo, hi + 1))
    n = int(hours * 3600 / period)
    t = T0 + int(rng.integers(0, 3600)) + np.arange(n) * period + rng.normal(0, 0.15 * period, n)
    keep = np.ones(n, bool)
    for _ in range(int(rng.integers(2, 6))):
        a = int(rng.integers(0, n))
        keep[a:a + int(rng.integers(2, max(3, 1200 // period)))] = False
    return np.unique(np.round(t[keep]).astype(np.int64))


def _leak_series(rng: np.random.Generator, name: str) -> tuple[np.ndarray, np.ndarray, float | None, float]:
    rate, onset_h, restart = LEAKS[name]
    hours = float(rng.uniform(30, 36))
    t = _times(rng, hours, 10, 60)
    h = (t - t[0]) / 3600.0
    if restart == "rand":
        restart = float(rng.uniform(10, 14))
    base = float(rng.uniform(3, 14)) * GIB
    tau = float(rng.uniform(5, 60)) / 60.0
    load = 0.5 + 0.3 * np.sin(2 * np.pi * (h + rng.uniform(0, 24)) / 24) + 0.05 * np.sin(2 * np.pi * h)
    starts = [0.0] + ([restart] if restart is not None else [])
    warm = bool(rng.random() < 0.5)
    rss = np.zeros_like(h)
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else np.inf
        m = (h >= s) & (h < end)
        age = h[m] - s
        ktau = tau * (0.4 if (k and warm) else 1.0)
        warmup = float(rng.uniform(0.6, 2.5)) * GIB * (1 - np.exp(-age / ktau))
        pinned = np.zeros_like(age)  # pinned host pool doubles at a few random ages
        size = float(2 ** rng.integers(5, 8)) * MIB
        for a in np.sort(rng.uniform(0, 6, int(rng.integers(1, 4)))):
            pinned += size * (age >= a)
            size *= 2
        frag = float(rng.uniform(50, 400)) * MIB * (1 - np.exp(-age / rng.uniform(3, 10)))
        rss[m] = base + warmup + pinned + frag
    rss += float(rng.uniform(100, 500)) * MIB * load
    gc = float(rng.uniform(8, 40)) * MIB * ((h * 60 / rng.uniform(3, 15)) % 1.0)  # GC / cache sawtooth
    rss += gc
    burst = np.zeros_like(h)
    for c in rng.uniform(0, hours, int(rng.integers(3, 10))):
        decay = np.exp(-np.clip(h - c, 0, None) / rng.uniform(0.05, 0.4))
        burst += float(rng.uniform(100, 800)) * MIB * decay * (h >= c)
    job_p = float(rng.choice([1.0, 2.0, 4.0, 6.0]))
    rss += burst + float(rng.uniform(50, 300)) * MIB * ((h % job_p) < 0.1)
    rss += rng.normal(0, rng.uniform(2, 12) * MIB, h.size) + 2 * MIB * rng.integers(0, 4, h.size)  # THP jitter
    if name == "none_step":
        rss += float(rng.uniform(150, 600)) * MIB * (h >= rng.uniform(10, 20))
    change = None
    if onset_h is not None:
        x = np.clip(h - onset_h, 0, None)
        chunk = float(rng.choice([0.0, 0.25, 0.5]))  # leak in chunks or smooth
        leak_h = np.floor(x / chunk) * chunk if chunk else x
        rss += rate * MIB * leak_h
        change = float(t[0] + onset_h * 3600)
    limit = int((rss.max() * rng.uniform(1.3, 1.8)) // MIB * MIB)
    return t, rss.astype(np.int64), change, limit


def _drift_series(rng: np.random.Generator, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, float | None]:
    ch, ramp = DRIFTS[name]
    t = _times(rng, 40.0, 10, 30)
    h = (t - t[0]) / 3600.0
    dt = np.diff(t, prepend=t[0] - 15).astype(float)
    peak = float(rng.uniform(50, 500))
    load = 0.1 + 0.9 * (0.5 + 0.5 * np.sin(2 * np.pi * (h + rng.uniform(0, 24)) / 24)) ** 1.5
    lam = np.maximum(peak * load * rng.gamma(4.0, 0.25, h.size), 5.0)
    for c in rng.uniform(0, 40, int(rng.integers(3, 12))):
        lam += peak * rng.uniform(0.3, 1.0) * ((h >= c) & (h < c + rng.uniform(0.05, 0.5)))
    lam = np.clip(lam, 5, 500)
    drafts = rng.poisson(lam * dt)
    p0 = float(rng.uniform(0.62, 0.79))
    mix = 0.02 * np.sin(2 * np.pi * h / rng.uniform(3, 9)) + np.cumsum(rng.normal(0, 0.0008, h.size))
    mix = np.clip(mix - mix.mean(), -0.03, 0.03)
    p = p0 + mix
    change = None
    if ch is not None:
        change = float(t[0] + ch * 3600)
        p = p - (0.06 * np.clip((h - ch) / 3.0, 0, 1) if ramp else 0.10 * (h >= ch))
    p = np.clip(p, 0.45, 0.85)
    k = 30.0  # beta-binomial over-dispersion
    acc = rng.binomial(drafts, rng.beta(p * k, (1 - p) * k))
    d, a = np.cumsum(drafts), np.cumsum(acc)
    for r in np.sort(rng.uniform(2, 38, int(rng.integers(0, 3)))):
        i = int(np.searchsorted(h, r))
        d[i:] -= d[i - 1]
        a[i:] -= a[i - 1]
    return t, d, a, change


def cases(out: pathlib.Path, seed: int) -> list[dict]:
    """Write one CSV per case into `out` (file name f"{name}.csv", header line first) and return their ground truth."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    truth = []
    for i, name in enumerate(NAMES):
        rng = np.random.default_rng([seed, SALT, i])
        if name in LEAKS:
            t, rss, change, limit = _leak_series(rng, name)
            rows = "".join(f"{a},{b},{limit}\n" for a, b in zip(t, rss, strict=True))
            (out / f"{name}.csv").write_text("timestamp,rss_bytes,limit_bytes\n" + rows)
            truth.append({"kind": "leak", "name": name, "rate": LEAKS[name][0], "change": change})
        else:
            t, d, a, change = _drift_series(rng, name)
            rows = "".join(f"{x},{y},{z}\n" for x, y, z in zip(t, d, a, strict=True))
            (out / f"{name}.csv").write_text("timestamp,draft_tokens,accepted_tokens\n" + rows)
            ramp = DRIFTS[name][1]
            truth.append({"kind": "drift", "name": name, "change": change, "ramp": 0.06 if ramp else None,
                          "ramp_h": 3.0 if ramp else 0.0})
    return truth


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for g in cases(pathlib.Path(tmp), 0):
            x = np.loadtxt(pathlib.Path(tmp) / f"{g['name']}.csv", delimiter=",", skiprows=1, dtype=np.int64)
            span = (x[-1, 0] - x[0, 0]) / 3600
            extra = (f"rss {x[:, 1].min() / GIB:.2f}-{x[:, 1].max() / GIB:.2f} GiB" if g["kind"] == "leak"
                     else f"acc {x[-1, 2] / max(x[-1, 1], 1):.3f} (last segment)")
            print(f"{g['name']:26s} rows={len(x):5d} span={span:5.1f}h {extra} change={g['change']}")
