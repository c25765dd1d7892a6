"""What a leak check costs, without changing what it says. At 1,000 processes with 12-13 h of RSS
each the checks took ~12 s of CPU per 5-min bucket, most of it in loops over every bucket or
sample (a robust s.d. of a day of floor differences per bucket, a trailing-minimum deque per
sample, a Python step per bucket for the floor). Each faster piece is held here to the plain
version it replaced, which stays in this file as the oracle (the verdicts on the detector
benchmark's series were diffed before and after: identical). No timings are asserted; the work
is counted instead (bench/bench_leak_scale.py prints the times)."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from sla_guard.detect import leak

MIB = 2.0**20
HOUR = 3600.0


def _under_floor_deque(t, v, cut, below: float, window_s: float) -> np.ndarray:
    """The replaced ``leak._under_floor``: a trailing-minimum deque restarted at every cut."""
    out = np.zeros(len(t), dtype=bool)
    q: deque[int] = deque()  # indices of increasing values: q[0] is the window's minimum
    for i in range(len(t)):
        if cut[i]:
            q.clear()
        while q and t[q[0]] < t[i] - window_s:
            q.popleft()
        if q and v[i] < v[q[0]] - below:
            out[i] = True
            q.clear()
        while q and v[q[-1]] >= v[i]:
            q.pop()
        q.append(i)
    return out


def _bucket_floors_loop(mins, when, windows, sub: float, per: int, ends):
    """The replaced per-bucket loop of ``leak.segment_floor``."""
    nb = len(windows)
    raw, prev, at = np.full(nb, np.nan), np.full(nb, np.nan), ends.copy()
    last = -1
    for j in range(nb):
        e = (j + 1) * per
        if not np.isfinite(mins[e - per : e]).any():
            continue
        span = math.ceil(windows[j] / sub)
        s = max(0, e - span)
        i = s + int(np.argmin(mins[s:e]))
        raw[j], at[j] = mins[i], when[i]
        if last >= 0:
            e0 = (last + 1) * per
            prev[j] = raw[last] if windows[last] == windows[j] else float(np.min(mins[max(0, e0 - span) : e0]))
        last = j
    return raw, prev, at


def test_under_floor_finds_the_samples_the_trailing_minimum_deque_found():
    """Restarts under the floor: random series with cuts, holes, ties in time and value, and
    several finds per series (each restarts the window), against the deque."""
    rng = np.random.default_rng(1)
    finds = 0
    for trial in range(1500):
        n = int(rng.integers(0, 300))
        t = np.cumsum(rng.choice([15.0, 30.0, 60.0, 900.0, 2000.0], size=n, p=[0.6, 0.2, 0.1, 0.07, 0.03]))
        if trial % 3 == 0:
            t = np.round(t / 60.0) * 60.0
        v = rng.normal(5e9, 1e8, n)
        if trial % 2:
            v = np.round(v / 2e8) * 2e8
        cut = rng.random(n) < 0.02
        cut[:1] = False
        below, window_s = float(rng.choice([0.0, 1e8, 256 * MIB])), float(rng.choice([0.0, 100.0, 1800.0, 1e9]))
        want = _under_floor_deque(t, v, cut, below, window_s)
        assert np.array_equal(leak._under_floor(t, v, cut, below, window_s), want), trial
        finds += int(want.sum())
    assert finds > 1000  # the cases exercise the finds, not only the misses


def test_bucket_floors_are_the_per_bucket_loops():
    """Floors, their sample times and the previous bucket's floor over each window, with empty
    buckets, equal minima (the first one wins), windows that change between buckets, windows
    shorter than a bucket, and a NaN, against the loop."""
    rng = np.random.default_rng(3)
    per, sub = 5, 60.0
    for trial in range(1500):
        nb = int(rng.integers(1, 150))
        mins = rng.normal(5e9, 1e7, nb * per)
        if trial % 2:
            mins = np.round(mins / 5e6) * 5e6
        mins[rng.random(nb * per) < rng.choice([0.0, 0.3, 0.9])] = np.inf
        if trial % 11 == 0:
            mins[int(rng.integers(0, nb * per))] = np.nan
        when = np.arange(nb * per) * sub + rng.random(nb * per)
        choices = [600.0, 900.0, 1234.5, 2400.0, 120.0, 30.0]
        windows = rng.choice(choices, size=nb, p=[0.6, 0.1, 0.1, 0.1, 0.05, 0.05]) if trial % 3 else np.full(nb, 600.0)
        ends = (np.arange(nb) + 1.0) * 300.0
        got = leak._bucket_floors(mins, when, windows, sub, per, ends)
        want = _bucket_floors_loop(mins, when, windows, sub, per, ends)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w, equal_nan=True), trial


@pytest.mark.parametrize("seed", range(4))
def test_median_and_75th_percentile_are_numpys(seed: int):
    """``_median`` and ``_p75`` return numpy's values bit for bit (odd and even sizes, ties, a NaN)."""
    rng = np.random.default_rng(seed)
    for trial in range(3000):
        a = rng.normal(0, 1e7, int(rng.integers(1, 400))) * rng.choice([1.0, 1e-3, 1e6])
        if trial % 3 == 0:
            a = np.round(a / 1e6)
        assert leak._median(a) == float(np.median(a))
        assert leak._p75(a) == float(np.percentile(a, 75))
        assert leak._mad_sd(a) == 1.4826 * float(np.median(np.abs(a - np.median(a))))
    a[len(a) // 3] = np.nan
    assert math.isnan(leak._median(a))


def _rss_12h(seed: int, sawtooth_mib: float) -> tuple[np.ndarray, np.ndarray]:
    """12.5 h of 15 s RSS: 1 MiB noise, a 5-min sawtooth, one 200 MiB allocator step at 7 h."""
    rng = np.random.default_rng(seed)
    t = 1.7e9 + np.arange(0.0, 12.5 * HOUR, 15.0)
    v = 6e9 + rng.normal(0, MIB, len(t)) + sawtooth_mib * MIB * ((t % 300.0) / 300.0)
    v += np.where(t - t[0] >= 7 * HOUR, 200 * MIB, 0.0)
    return t, v


@pytest.mark.parametrize("sawtooth_mib", [0.0, 60.0])
def test_a_check_takes_a_robust_sd_only_where_it_can_change_the_floor(monkeypatch, sawtooth_mib: float):
    """The robust s.d. of the recent floor differences decides a level step only for a jump
    beyond ``step_bytes`` (the threshold is the larger of the two), and that of the sample
    differences finds sawtooth drops only where 4 falls beyond 8 MiB exist: a 12 h check took one
    per bucket (150) plus one per sawtooth window (50) whatever the series, now one per
    candidate. The floor is unchanged: its step still found, its sawtooth window still measured."""
    calls = []
    real = leak._mad_sd

    def counted(d: np.ndarray) -> float:
        calls.append(len(d))
        return real(d)

    monkeypatch.setattr(leak, "_mad_sd", counted)
    t, v = _rss_12h(7, sawtooth_mib)
    p = leak.LeakParams()
    f = leak.segment_floor(t, v, p)
    nb = len(f.t)
    steps = np.flatnonzero(np.abs(np.diff(f.y - f.raw)) > 100 * MIB)
    assert len(steps) == 1 and abs(f.t[steps[0] + 1] - (t[0] + 7 * HOUR)) <= 2 * p.bucket_s  # the step, taken out
    if sawtooth_mib:  # a 5-min sawtooth: every window with 20 differences measures its period
        assert 0.8 * nb / 3 <= len(calls) <= nb / 3 + 3
    else:  # no drop beyond 8 MiB, one jump beyond 80 MiB
        assert len(calls) <= 2, calls
    assert leak.assess(t, v, p).status in ("ok", "unknown")
