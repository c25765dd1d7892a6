"""The benchmark's simple baseline (bench/detectors/simple.py: the plain methods issue 16 names)
does what its docstring says, so the figures it prints against the production detectors are its
own and not a broken baseline's. Series built here, not from the benchmark's generators."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "detectors"))
import simple

MIB = float(2**20)
H = 3600.0


def _rss(hours: float, seed: int, leak_mib_h: float = 0.0, onset_h: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, hours * H, 30.0)
    v = 6 * 1024 * MIB + 500 * MIB * (1 - np.exp(-t / 1800.0))  # start-up growth, tau 30 min
    v += 80 * MIB * ((t % 300.0) / 300.0)  # a 5-minute allocator sawtooth
    v += rng.normal(0, 3 * MIB, t.size)
    v += np.where(t >= onset_h * H, leak_mib_h * MIB * (t - onset_h * H) / H, 0.0)
    return t, v


def _first(t, v):
    return next(((at, ver) for at, ver in simple.leak_scan(t, v) if ver.detected), None)


def test_simple_leak_finds_48_mib_per_hour_within_two_hours_and_its_onset():
    t, v = _rss(14, seed=1, leak_mib_h=48, onset_h=6)
    first = _first(t, v)
    assert first is not None
    at, ver = first
    assert 6 * H <= at <= 8 * H
    assert abs(ver.onset - 6 * H) <= 1800


def test_simple_leak_is_quiet_on_start_up_growth_and_a_warm_restart():
    t, v = _rss(30, seed=2)
    assert _first(t, v) is None
    # a warm restart at hour 12 whose first sample already holds the model: RSS falls by its
    # start-up growth only, and refills along a start-up curve; that refill is not a leak
    since = np.where(t >= 12 * H, t - 12 * H, t)
    v2 = v - 500 * MIB * (1 - np.exp(-t / 1800.0)) + 500 * MIB * (1 - np.exp(-since / 1800.0))
    assert _first(t, v2) is None


def test_simple_cusum_flags_a_step_against_the_first_hour():
    rng = np.random.default_rng(3)
    t = np.arange(0.0, 10 * H, 15.0)
    n = rng.poisson(100 * 15.0, t.size)
    p = np.where(t >= 6 * H, 0.6, 0.7)
    x = rng.binomial(n, p)
    alarms = simple.rate_scan(t, np.cumsum(n), np.cumsum(x))
    assert alarms and alarms[0].direction == "down"
    assert 6 * H <= alarms[0].at <= 6 * H + 600
