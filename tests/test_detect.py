"""Pure-math tests of the leak and drift detectors (small synthetic data, no I/O)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import numpy as np
import pytest

from sla_guard.detect import drift, leak
from sla_guard.detect import synthetic as sy

MIB, HOUR = leak.MIB, leak.HOUR


def test_theil_sen_ignores_outliers():
    x = np.arange(30.0)
    y = 3.0 * x + 7
    y[[3, 17, 25]] += 1000
    slope, icpt = leak.theil_sen(x, y)
    assert slope == pytest.approx(3.0)
    assert icpt == pytest.approx(7.0)


def test_mann_kendall_trend_vs_noise_and_autocorrelation_correction():
    rng = np.random.default_rng(0)
    x = np.arange(40.0)
    _, z_up = leak.mann_kendall(x, x + rng.normal(0, 2, 40))
    _, z_noise = leak.mann_kendall(x, rng.normal(0, 1, 40))
    assert z_up > 5 and abs(z_noise) < 3
    # a random walk has a spurious trend: the corrected z is smaller than the naive one
    walk = np.cumsum(rng.normal(0, 1, 40))
    s, z = leak.mann_kendall(x, walk)
    naive = (s - np.sign(s)) / math.sqrt(40 * 39 * 85 / 18)
    assert abs(z) <= abs(naive) + 1e-12


def test_floor_removes_gc_sawtooth_but_keeps_slope():
    t = np.arange(0, 6 * HOUR, 15.0)
    saw = 100 * MIB * ((t / 420.0) % 1.0)  # 7-minute GC sawtooth, 100 MiB tall
    v = 6 * 2**30 + saw + t * 48 * MIB / HOUR
    tf, yf = leak.floor_series(t, v, 300, 900)
    slope, _ = leak.theil_sen(tf, yf)
    assert slope * HOUR / MIB == pytest.approx(48, rel=0.05)
    resid = yf - (yf[0] + slope * (tf - tf[0]))
    assert np.ptp(resid[3:]) < 10 * MIB  # sawtooth gone (raw series swings 100 MiB)


def test_step_sse_prefers_steps():
    y = np.r_[np.zeros(20), np.ones(20) * 5, np.ones(20) * 9]
    assert leak.step_sse(y) == pytest.approx(0.0, abs=1e-9)
    line = np.arange(60.0)
    assert leak.step_sse(line) > 100


def test_hinge_fit_beats_line_and_steps_on_an_onset():
    x = np.arange(24.0)
    y = np.maximum(0.0, x - 8.0) * 4.0  # flat, then a leak starts
    sse, fitted = leak.hinge_fit(x, y)
    assert sse == pytest.approx(0.0, abs=1e-9) and fitted == pytest.approx(y)
    slope, icpt = leak.theil_sen(x, y)
    assert sse < leak.step_sse(y) < float(np.sum((y - icpt - slope * x) ** 2))
    assert leak.hinge_fit(x, -y) is None  # only rising hinges


def test_sample_load_coef_ignores_trend_step_sawtooth_and_warmup():
    rng = np.random.default_rng(3)
    n = 4000  # 15 s samples
    load = np.maximum(0.0, 20 + np.cumsum(rng.normal(0, 1.5, n)))  # running requests, wandering
    i = np.arange(n)
    y = 3.0 * MIB * load + i * 0.2 * MIB  # load part + a leak (48 MiB/h)
    y += np.where(i >= 1200, 128 * MIB, 0.0)  # an allocator step
    y += 400 * MIB * (1 - np.exp(-i / 200.0))  # a warm-up tail
    y += 60 * MIB * ((i % 17) / 17.0)  # a sawtooth: slow fills, sudden collections
    assert leak.sample_load_coef(y + rng.normal(0, 2 * MIB, n), load) == pytest.approx(3.0 * MIB, rel=0.1)
    assert leak.sample_load_coef(y, np.full(n, 20.0)) is None  # load does not move: cannot say
    assert leak.sample_load_coef(-y, load) is None  # RSS falling as load rises is not load's part
    # a smooth load says nothing at the samples' scale: a leak's onset (its differences step up)
    # while the load swings slowly must not pass for co-movement
    onset = np.maximum(i - 2000, 0) * 0.5 * MIB + 60 * MIB * ((i % 12) / 12.0) + rng.normal(0, 3 * MIB, n)
    assert leak.sample_load_coef(onset, 8 + 2 * np.sin(i / 170.0)) is None


def test_sample_load_coef_is_not_biased_by_collections_as_large_as_the_loads_moves():
    """The first fit leaves out RSS differences beyond 4 robust s.d.: a collection of about that
    size stays in when the load rose in the same sample and is cut when it fell, which tilts the
    fit low (0.78-0.82 of the truth here, 10th percentile 0.82 on families.py's tuning series).
    The refit cuts on the fit's residuals instead."""
    rng = np.random.default_rng(0)
    n = 5760  # a day at 15 s
    a = np.exp(-15 / 180.0)
    ar = np.zeros(n)
    for k in range(1, n):
        ar[k] = a * ar[k - 1] + rng.normal(0, 0.2 * np.sqrt(1 - a * a))
    load = 12.0 * (1.0 + ar)  # running requests, a 3-min memory
    # a 90 s allocator sawtooth whose collections (20..60 MiB) are as large as the load's moves
    amp = np.repeat(rng.uniform(20, 60, n // 6 + 1), 6)[:n] * MIB
    y = 8 * 1024 * MIB + 7.0 * MIB * load + amp * (np.arange(n) % 6) / 6.0 + rng.normal(0, MIB, n)
    assert leak.sample_load_coef(y, load) == pytest.approx(7.0 * MIB, rel=0.05)


def test_a_ramped_step_is_not_a_trend_but_a_rise_that_goes_on_is():
    """A floor that rises 150 MiB over 50 min and then stays flat for 20 min (an allocator plateau
    reached over minutes, a load burst seen through the floor window) is a step: the two-break
    step fit reads the ramp as a staircase and let Mann-Kendall call it a trend. A rise from the
    same start that goes on is still a leak."""
    x = np.arange(24) * 300.0  # 2 h of 5-min floor points
    p, off = leak.LeakParams(), leak.LeakParams(ramp_step_ratio=0.0)
    steps = before = rises = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        y = np.clip((x - 3000.0) / 3000.0, 0.0, 1.0) * 150 * MIB + rng.normal(0, 6 * MIB, len(x))
        steps += leak.window_test(x, y, p, 2 * HOUR).leak
        before += leak.window_test(x, y, off, 2 * HOUR).leak
        rising = np.maximum(0.0, x - 3000.0) * 100 * MIB / HOUR + rng.normal(0, 6 * MIB, len(x))
        rises += leak.window_test(x, rising, p, 2 * HOUR).leak
    assert steps == 0 and before >= 8
    assert rises >= 14


def _coupled(leak_mib_h: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """14 h at 15 s: RSS = model + start-up + a 4-min sawtooth + 4 MiB per running request; the
    load doubles over 6-7.5 h and falls back at 9.5-10 h; a leak, if any, starts at 6 h, with it."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, 14 * HOUR, 15.0)
    a = math.exp(-15 / 180)
    e = rng.normal(0, 0.2 * math.sqrt(1 - a * a), len(t))
    ar = np.zeros(len(t))
    for j in range(1, len(t)):
        ar[j] = a * ar[j - 1] + e[j]
    rise = np.clip((t - 6 * HOUR) / (1.5 * HOUR), 0, 1) - np.clip((t - 9.5 * HOUR) / (0.5 * HOUR), 0, 1)
    load = np.maximum(0.0, 20 * (1 + ar + rise))
    v = 6 * 2**30 + 400 * MIB * (1 - np.exp(-t / 1200)) + 60 * MIB * ((t % 240) / 240) + 4 * MIB * (load - 20)
    v += rng.normal(0, 3 * MIB, len(t)) + leak_mib_h * MIB / HOUR * np.maximum(t - 6 * HOUR, 0.0)
    return t, v, load


def test_load_aware_removes_load_per_sample_and_finds_a_leak_that_starts_with_a_load_rise():
    """The running requests' part of RSS is removed sample by sample before the floor is taken:
    a load that doubles over 1.5 h is no leak, and a 48 MiB/h leak that starts with it is found
    within 1.5 h. (Removing the load's floor from RSS's floor, the method before, left part of
    the load in, since the minimum of a sum is not the sum of the minima: 1.67-2.08 h here.)"""
    rss_only_alarms = 0
    for seed in range(3):
        t, v, load = _coupled(0.0, seed)
        rss_only_alarms += len(leak.episodes(leak.scan(t, v), 2 * HOUR))
        assert leak.episodes(leak.scan(t, v, load=(t, load)), 2 * HOUR) == []
        t, v, load = _coupled(48.0, seed)
        first = leak.first_detection(leak.scan(t, v, load=(t, load)))
        assert first is not None and 6 * HOUR < first[0] < 7.5 * HOUR, first
    assert rss_only_alarms >= 1  # from RSS alone the load rise reads as a leak


def test_confirmation_needs_consecutive_leak_buckets():
    t, v = _series(48.0, onset_h=3.0, hours=6.0)
    one = leak.first_detection(leak.scan(t, v, leak.LeakParams(confirm=1)))
    two = leak.first_detection(leak.scan(t, v, leak.LeakParams(confirm=2)))
    assert one is not None and two is not None
    assert two[0] - one[0] >= leak.LeakParams().bucket_s  # at least one bucket later
    assert two[1].detected and leak.assess(t[t <= two[0]], v[t <= two[0]]).status in ("leak", "ok")


def _series(rate_mib_h=0.0, onset_h=3.0, hours=8.0, seed=0, step_at_h=None):
    rng = np.random.default_rng(seed)
    t = np.arange(0, hours * HOUR, 30.0)
    v = 6 * 2**30 + rng.normal(0, 3 * MIB, len(t)) + 60 * MIB * ((t / 300.0) % 1.0)
    v += np.maximum(0, t - onset_h * HOUR) * rate_mib_h * MIB / HOUR
    if step_at_h is not None:
        v += np.where(t >= step_at_h * HOUR, 300 * MIB, 0.0)
    return t, v


def test_leak_48_mib_h_detected_with_slope_eta_and_onset():
    t, v = _series(48.0, onset_h=3.0, hours=6.0)
    verdict = leak.assess(t, v, limit_bytes=8 * 2**30)
    assert verdict.detected
    assert verdict.slope_mib_per_h == pytest.approx(48, rel=0.2)
    assert verdict.confidence > 0.999
    assert verdict.eta_s == pytest.approx((8 * 2**30 - verdict.floor_bytes) / verdict.slope_bps)
    assert abs(verdict.onset - 3 * HOUR) < 0.75 * HOUR
    first = leak.first_detection(leak.scan(t, v))
    assert first is not None and 3 * HOUR < first[0] <= 5 * HOUR


def test_the_onset_is_searched_near_the_window_that_found_the_leak():
    """An allocator plateau reached over 20 min, 3.5 h before a 48 MiB/h leak's onset: the onset
    fit over the 6 h before the detection read plateau and leak as one rise and put the onset at
    the plateau, 4 h early, on 3 of these 6 seeds. The search now spans the window that found the
    trend plus 2 h."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        t = np.arange(0.0, 13 * HOUR, 30.0)
        v = 6 * 2**30 + rng.normal(0, 3 * MIB, len(t)) + 60 * MIB * ((t / 300.0) % 1.0)
        v += 120 * MIB * np.clip((t - 5.5 * HOUR) / 1200.0, 0.0, 1.0)
        v += np.maximum(0.0, t - 9 * HOUR) * 48 * MIB / HOUR
        first = leak.first_detection(leak.scan(t, v))
        assert first is not None and first[1].window_s == 2 * HOUR
        assert abs(first[1].onset - 9 * HOUR) <= 0.25 * HOUR, (seed, first[1].onset / HOUR)


def test_the_onset_is_placed_where_the_floors_minimum_was_sampled():
    """Under a 20-min sawtooth the floor is a minimum over 30 min, and while RSS rises that
    minimum is the window's oldest sample: the floor lags its bucket by up to the window. Taking
    the whole window off the knot (before) put onsets 5-25 min early (mean 10 min on these
    seeds); each floor point now carries the time its minimum was sampled."""
    errors = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        t = np.arange(0.0, 12 * HOUR, 30.0)
        v = 6 * 2**30 + rng.normal(0, 3 * MIB, len(t)) + 150 * MIB * ((t / 1200.0) % 1.0)
        v += np.maximum(0.0, t - 8 * HOUR) * 48 * MIB / HOUR
        first = leak.first_detection(leak.scan(t, v))
        assert first is not None
        errors.append(abs(first[1].onset - 8 * HOUR))
    assert np.mean(errors) < 360.0, errors


def _ratchet(seed: int, leak_mib_h: float = 0.0, onset_h: float = 12.0, hours: float = 24.0):
    """An 80 MiB sawtooth every 4-6 min whose collections each leave 25 MiB behind until a full
    collection every 8th cycle: the floor climbs 175 MiB over ~40 min and falls back at once."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, hours * HOUR, 30.0)
    marks = np.cumsum(rng.uniform(240, 360, int(hours * HOUR / 200)))
    k = np.searchsorted(marks, t, side="right")
    since = t - np.concatenate([[0.0], marks])[k]
    v = 6 * 2**30 + 400 * MIB * (1 - np.exp(-t / 1200)) + rng.normal(0, 3 * MIB, len(t))
    v += 80 * MIB * since / 300.0 + 25 * MIB * (k % 8)
    return t, v + np.maximum(0.0, t - onset_h * HOUR) * leak_mib_h * MIB / HOUR


def test_a_floor_that_climbs_and_falls_back_is_an_excursion_not_a_staircase():
    """Found on blind.py's series (session 21; 35 false alarms on 84 of its tuning series): the
    level-step rule took each full collection's fall out of the floor and kept the climb before
    it, so a flat process's floor rose 175 MiB per excursion and alarmed within hours. A fall back
    to a level the floor held in the last 6 h now ends the excursion instead."""
    old = leak.LeakParams(return_memory_s=0.0)
    old_alarms = 0
    for seed in range(4):
        t, v = _ratchet(seed)
        assert leak.episodes(leak.scan(t, v), 2 * HOUR) == []
        old_alarms += len(leak.episodes(leak.scan(t, v, old), 2 * HOUR))
        t, v = _ratchet(seed, leak_mib_h=48.0)
        first = leak.first_detection(leak.scan(t, v))
        assert first is not None and first[0] > 12 * HOUR  # found after the onset (test below: how soon)
    assert old_alarms >= 4


def test_a_leak_under_repeated_excursions_is_read_from_the_levels_they_fall_back_to():
    """Found on blind.py's series (session 22; 4 of its 48 tuning-more leaks never found, others
    10-18 h late): the floor climbs and falls back with each excursion, so a leak under them shows
    only in the levels it falls back to. After two excursions in 6 h the 4 h window reads the
    floor's running minimum over the longest of them (at most 2 h)."""
    off = leak.LeakParams(excursion_envelope_s=0.0)
    for seed in range(4):
        t, v = _ratchet(seed, leak_mib_h=48.0)
        first = leak.first_detection(leak.scan(t, v))
        before = leak.first_detection(leak.scan(t, v, off))
        assert first is not None and 12 * HOUR < first[0] < 15.5 * HOUR, first and first[0] / HOUR
        assert before is not None and before[0] > 16 * HOUR, before and before[0] / HOUR


def test_a_slow_leak_under_repeated_excursions_is_read_from_the_line_through_its_fall_backs():
    """Session 38, on blind.py's tuning-more seeds (24 MiB/h leaks within 4 h: 8 -> 11 of 12): the
    running minimum over the excursions' length lags by its span and holds plateaus, whose pairwise
    slopes of 0 pull the Theil-Sen slope down. Up to the last fall-back the 4 h window now reads the
    floor capped by the line through the levels it fell back to (3.0-3.6 h after the onset before)."""
    for seed in range(4):
        t, v = _ratchet(seed, leak_mib_h=24.0, hours=30.0)
        first = leak.first_detection(leak.scan(t, v))
        assert first is not None and 12 * HOUR < first[0] < 14.95 * HOUR, first and first[0] / HOUR - 12
        t, v = _ratchet(seed, hours=30.0)
        assert leak.episodes(leak.scan(t, v), 2 * HOUR) == []


def test_a_floor_window_that_changes_is_not_a_move_of_the_floor():
    """Found in the demo (session 22): the floor window grew from 10 to 30 min when a sawtooth's
    drops were first counted and shrank back later. Under a fast leak the minimum over the longer
    window lies 20 min back, so the floor fell 107 MiB and later jumped; the fall was kept (an
    excursion's end), the jump taken out as a level step, and the 200 MiB/h leak read 26 MiB/h
    for an hour. A bucket's change is now measured over one window, and the window's own change
    goes into the offset."""
    t = np.arange(0, 5 * HOUR, 30.0)
    rng = np.random.default_rng(3)
    v = 6e9 + 300 * MIB * t / HOUR + rng.normal(0, 2 * MIB, t.size)
    saw = (t > 1.5 * HOUR) & (t < 3 * HOUR)  # a 20-min, 60 MiB sawtooth for 1.5 h only
    v[saw] += 60 * MIB * ((t[saw] % 1200.0) / 1200.0)
    f = leak.segment_floor(t, v, leak.LeakParams(), 0.0)
    assert f.window.max() >= 1800 > f.window.min()  # the window did grow (the case under test)
    late = f.t > HOUR
    assert np.diff(f.y[late]).min() > -40 * MIB  # no fall from the window's growth
    slope = np.polyfit(f.t[late], f.y[late], 1)[0] * HOUR / MIB
    assert 250 < slope < 350, slope  # the leak's 300 MiB/h, not less the windows' jumps


def test_no_leak_flat_step_and_warmup():
    t, v = _series(0.0, hours=10.0)
    assert leak.assess(t, v).status == "ok"
    t, v = _series(0.0, hours=10.0, step_at_h=5.0)  # one allocator step of 300 MiB
    assert not any(ver.detected for _, ver in leak.scan(t, v))
    t, v = _series(48.0, onset_h=0.0, hours=0.4)
    assert leak.assess(t, v).status == "unknown"  # still warming up: never "ok"


def _hourly_swing(seed: int, leak_mib_h: float = 48.0, onset_h: float = 8.0, hours: float = 12.0):
    """A sawtooth (3-7 min, 90 MiB) over a 10 MiB hourly swing: the swing moves the floor by up
    to 63 MiB/h, as much as the leak."""
    rng = np.random.default_rng(seed)
    t = np.arange(0, hours * HOUR, 30.0)
    v = 6e9 + 500 * MIB * (1 - np.exp(-t / 1200.0))
    saw, last, nxt = np.zeros_like(t), 0.0, 300.0
    for i, x in enumerate(t):
        if x >= nxt:
            last, nxt = x, x + rng.uniform(180, 420)
        saw[i] = 90 * MIB * (x - last) / 300.0
    v += saw + 10 * MIB * np.sin(2 * np.pi * t / HOUR + rng.uniform(0, 6.3)) + rng.normal(0, 4 * MIB, t.size)
    v += np.where(t >= onset_h * HOUR, leak_mib_h * MIB * (t - onset_h * HOUR) / HOUR, 0.0)
    return t, v


def test_seasonal_removed_takes_out_an_hourly_swing_and_leaves_noise_alone():
    rng = np.random.default_rng(0)
    t = np.arange(0, 12 * HOUR, 300.0)
    trend = 3e6 * (t / HOUR) ** 1.5  # a slow, bending trend stays
    swing = 10 * MIB * np.sin(2 * np.pi * t / HOUR + 1.0)
    y = 6e9 + trend + swing + rng.normal(0, 2 * MIB, t.size)
    p = leak.LeakParams()
    out, amp = leak.seasonal_removed(t, y, 0.0, p)
    left = out - (y - swing)
    assert np.abs(left).max() < 2 * MIB  # the swing is gone, the trend and noise are not touched
    assert amp == pytest.approx(10 * MIB, rel=0.1)
    noise = 6e9 + trend + rng.normal(0, 2 * MIB, t.size)
    out, amp = leak.seasonal_removed(t, noise, 0.0, p)
    assert out is noise and amp == 0.0  # no significant swing: unchanged
    short = y[t < 2 * HOUR]
    assert leak.seasonal_removed(t[t < 2 * HOUR], short, 0.0, p)[0] is short


def test_leak_under_an_hourly_swing_found_sooner_with_the_swing_taken_out():
    off = replace(leak.LeakParams(), seasonal_period_s=0.0)
    on_delays, off_delays = [], []
    for seed in range(4):
        t, v = _hourly_swing(seed)
        for p, out in ((leak.LeakParams(), on_delays), (off, off_delays)):
            first = leak.first_detection(leak.scan(t, v, p))
            assert first is not None
            out.append((first[0] - 8 * HOUR) / HOUR)
        t0, v0 = _hourly_swing(seed, leak_mib_h=0.0, hours=30.0)
        assert leak.first_detection(leak.scan(t0, v0)) is None  # the swing alone is no leak
    assert max(on_delays) <= 1.5
    assert sum(off_delays) - sum(on_delays) > 4 * 0.25  # a quarter of an hour sooner on average


def test_restart_starts_a_new_segment():
    t, v = _series(200.0, onset_h=0.5, hours=8.0)
    v[t >= 7 * HOUR] = 2 * 2**30  # restarted process: RSS falls, warm-up again
    verdict = leak.assess(t, v)
    assert verdict.segment_start == pytest.approx(7 * HOUR)
    assert verdict.status == "unknown"


def test_scaled_params_compress_time_only():
    p = leak.LeakParams()
    q = p.scaled(60)
    assert q.windows_s[0] == p.windows_s[0] / 60 and q.min_slope_bps == p.min_slope_bps * 60
    assert q.min_rise_bytes == p.min_rise_bytes and q.z_crit == p.z_crit
    assert q.excursion_envelope_s == p.excursion_envelope_s / 60  # added after scaled() was written
    for name, v in asdict(p).items():  # every duration scales, nothing else does
        if name.endswith("_s") or name.endswith("_bps"):
            assert getattr(q, name) != v, name
        else:
            assert getattr(q, name) == v, name


def test_synthetic_leak_case_detected_and_sawtooth_case_quiet():
    c = sy.rss_case("sawtooth", 1000, leak_mib_h=48.0, days=0.6, onset_h=4.0)
    first = leak.first_detection(leak.scan(c.t, c.v, load=(c.t, c.load)))
    assert first is not None and first[0] - c.onset < 2.5 * HOUR


# --- drift ------------------------------------------------------------------------------------

def test_threshold_from_arl0():
    p = drift.RateDriftParams(arl0_s=30 * 86400, interval_s=60, sides="both", family=1, arl_rule="lorden")
    assert p.threshold == pytest.approx(math.log(30 * 1440 * 2 * 2))  # x2: the slow pair shares the budget
    assert drift.threshold_for_arl(86400, 60, 1, 5) == pytest.approx(math.log(1440 * 5))
    g = drift.RateDriftParams()  # default rule: the exact Gaussian run length
    assert g.arl_rule == "gaussian" and g.slow and g.n_family == 2  # step and slow pairs share the budget
    assert math.log(30 * 1440 * 2 * 2) - 1.7 < g.threshold < math.log(30 * 1440 * 2 * 2) - 1.45
    # jitter that caps an interval's information below the worst case (theta ~ 1.85) lowers h
    assert drift.threshold_gaussian_arl(30 * 86400, 60, 2, 2, theta_max=1.0) < g.threshold - 0.2
    assert drift.threshold_gaussian_arl(600, 60) == drift.threshold_for_arl(600, 60)  # degenerate: Lorden
    with pytest.raises(ValueError, match="arl_rule"):
        drift.RateDriftParams(arl_rule="siegmund")
    with pytest.raises(ValueError, match="jitter_blocks"):
        drift.RateDriftParams(jitter_blocks=-1)
    with pytest.raises(ValueError, match="refine_s"):
        drift.RateDriftParams(refine_s=-1)


def test_gaussian_cusum_arl_against_siegmund_and_simulation():
    """The Markov-chain run length agrees with Siegmund's corrected diffusion where that is
    accurate (small theta), and with a direct simulation where it is not (theta = 4: the
    diffusion is off by ~1.6x there)."""
    for theta in (0.5, 1.0):
        b = 9.0 + 1.166 * theta
        assert drift.gaussian_cusum_arl(9.0, theta) == pytest.approx((math.exp(b) - b - 1) / (theta**2 / 2),
                                                                     rel=0.02)
    theta, h, steps = 4.0, 2.0, 100_000
    arl = drift.gaussian_cusum_arl(h, theta)
    b = h + 1.166 * theta
    assert abs(arl / ((math.exp(b) - b - 1) / (theta**2 / 2)) - 1) > 0.3
    s, alarms = 0.0, 0
    for v in np.random.default_rng(5).normal(-theta**2 / 2, theta, steps):
        s = max(0.0, s + v)
        if s > h:
            alarms, s = alarms + 1, 0.0
    assert alarms == pytest.approx(steps / arl, rel=0.12)


def _binomial_counters(p_before, p_after, onset_s, total_s, rate=50.0, dt=10.0, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(dt, total_s + dt, dt)
    p = np.where(t >= onset_s, p_after, p_before)
    n = rng.poisson(rate * dt, len(t))
    x = rng.binomial(n, p)
    return t, np.cumsum(n).astype(float), np.cumsum(x).astype(float)


def test_acceptance_drop_060_to_050_at_50_per_s_within_10_minutes():
    onset = 3 * HOUR
    t, n, x = _binomial_counters(0.6, 0.5, onset, 5 * HOUR)
    alarms, cus = drift.scan_rate(t, n, x)
    assert alarms and alarms[0].direction == "down"
    assert 0 < alarms[0].at - onset <= 600
    assert cus.p0 == pytest.approx(0.6, abs=0.01)
    assert alarms[0].after == pytest.approx(0.5, abs=0.03)


def test_no_alarm_without_change_and_counter_reset_tolerated():
    t, n, x = _binomial_counters(0.6, 0.6, 0, 12 * HOUR, seed=3)
    half = len(t) // 2
    n[half:] -= n[half - 1]  # engine restart: counters start over
    x[half:] -= x[half - 1]
    alarms, cus = drift.scan_rate(t, n, x)
    assert alarms == []
    assert cus.p0 is not None


def test_false_alarm_rate_respects_lorden_bound():
    """With ARL0 = 6 h, 5 simulated days of a stationary binomial rate at the band edge
    (worst case, p = p0 - tolerance) should give about <= 20 alarms (Lorden: ARL0 >= e^h)."""
    params = drift.RateDriftParams(arl0_s=6 * HOUR, sides="down", tolerance=0.0, min_tau=0.0, warmup_s=600,
                                   slow=False, ref_margin=0.0)
    rng = np.random.default_rng(7)
    cus = drift.RateCusum(params)
    alarms = 0
    for i in range(5 * 1440):
        n = rng.poisson(3000)
        if cus.update(60.0 * (i + 1), n, rng.binomial(n, 0.6)) is not None:
            alarms += 1
        if cus.alarm is not None:
            cus.alarm = None  # count every crossing
    assert cus.p0 == pytest.approx(0.6, abs=0.01)
    assert alarms <= 20 * 1.5


def test_band_edge_false_alarms_match_the_gaussian_arl():
    """arl_rule="gaussian" at its worst case: a binomial rate exactly at the band edge, with
    n = 340 per interval so that the LLR's per-interval s.d. theta is ~1.85, where the threshold
    is exact rather than a bound. ARL0 = 6 h over 10 days: ~40 alarms expected from the chain;
    Lorden's threshold would give ~8, an error in the chain or the solve far more or fewer.
    The warm-up is fed an exact rate (x = 0.6 n) so tau is learned as 0 and phi = 1."""
    params = drift.RateDriftParams(arl0_s=6 * HOUR, sides="down", tolerance=0.0, min_tau=0.0, warmup_s=600,
                                   arl_rule="gaussian", slow=False, ref_margin=0.0)
    rng = np.random.default_rng(7)
    cus, n, t, alarms, steps = drift.RateCusum(params), 340, 0.0, 0, 10 * 1440
    while not cus.ready:
        t += 60
        cus.update(t, n, 0.6 * n)
    assert cus.p0 == pytest.approx(0.6) and cus.tau2 == 0.0
    for _ in range(steps):
        t += 60
        if cus.update(t, n, rng.binomial(n, 0.6)) is not None:
            alarms += 1
        cus.alarm = None  # count every crossing
    q0, p1 = cus._band("down")
    theta = math.sqrt(n * q0 * (1 - q0) * math.log(p1 * (1 - q0) / (q0 * (1 - p1))) ** 2)
    assert 1.7 < theta < 2.0
    expected = steps / drift.gaussian_cusum_arl(cus.threshold, theta)
    assert 30 < expected < 50
    assert 0.6 * expected <= alarms <= 1.5 * expected


def test_jitter_reestimated_from_alarm_free_blocks():
    """jitter_blocks: a warm-up with binomial noise only learns about the floor; 10 h of
    request-mix jitter (s.d. 0.03 per interval) then raise tau to ~0.03 (the first hours' false
    alarms, from the underestimate, drop their blocks), and only the last 6 blocks count; once a
    drop has opened an alarm, blocks are dropped and tau stays put. Without jitter_blocks tau
    keeps its warm-up value."""
    rng = np.random.default_rng(3)
    t = 0.0
    p = np.r_[np.full(60, 0.6), 0.6 + rng.normal(0, 0.03, 10 * 60), np.full(3 * 60, 0.45)]
    n = rng.poisson(3000, len(p))
    x = rng.binomial(n, np.clip(p, 0, 1))
    kw = dict(arl_rule="lorden", refine_s=0, slow=False, ref_margin=0.0)
    on = drift.RateCusum(drift.RateDriftParams(jitter_blocks=6, **kw))
    off = drift.RateCusum(drift.RateDriftParams(jitter_blocks=0, **kw))
    before_drop = warm = None
    for i in range(len(p)):
        t += 60
        on.update(t, n[i], x[i])
        off.update(t, n[i], x[i])
        if i == 60:
            warm = off.tau2
        if i == 60 + 10 * 60 - 1:
            before_drop = on.tau2
    assert warm < 0.01**2 and off.tau2 == warm
    assert 0.02**2 < before_drop < 0.04**2
    assert len(on.tau2_blocks) == 6
    assert on.alarm is not None and on.alarm.direction == "down"
    assert on.tau2 == before_drop


def test_baseline_refined_after_warmup_and_never_from_a_change():
    """refine_s: a warm-up hour that the workload's wander put at 0.57 learns p0 = 0.57; 8 h at
    the long-run 0.60 pull the refined p0 to within 0.005 of 0.60, so a drop to 0.52 (0.08
    below the long-run rate, only 0.05 below the warm-up's) is caught within 10 min, and faster
    than with the warm-up baseline. The drop's own intervals are dropped from the hold queue by
    the alarm, so p0 does not follow the change; after refine_s p0 stops learning."""
    rng = np.random.default_rng(5)
    p = np.r_[np.full(60, 0.57), np.full(8 * 60, 0.60), np.full(2 * 60, 0.52)]
    n = rng.poisson(3000, len(p))
    x = rng.binomial(n, p)
    kw = dict(jitter_blocks=0, arl_rule="lorden", slow=False, ref_margin=0.0)
    on = drift.RateCusum(drift.RateDriftParams(refine_s=86400, **kw))
    off = drift.RateCusum(drift.RateDriftParams(refine_s=0, **kw))
    first: dict[str, float] = {}
    at_alarm = None
    for i in range(len(p)):
        t = 60.0 * (i + 1)
        for name, cus in (("on", on), ("off", off)):
            if cus.update(t, n[i], x[i]) is not None:
                first.setdefault(name, t)
                at_alarm = cus.p0 if name == "on" and at_alarm is None else at_alarm
        if i == 60 + 8 * 60 - 1:
            refined = on.p0
    onset = 60.0 * (60 + 8 * 60)
    assert abs(off.p0 - 0.57) < 0.005 and abs(refined - 0.60) < 0.005
    assert first["on"] - onset <= 600 and first["on"] < first.get("off", math.inf)
    assert on.p0 == at_alarm  # nothing joins while the alarm is open
    joined = int((first["on"] - 60 - 1800) // 60)  # held 30 min; the alarm dropped the rest
    assert joined * 60 < onset  # so no interval of the change is in p0
    assert at_alarm == pytest.approx(x[:joined].sum() / n[:joined].sum(), rel=1e-12)
    frozen = drift.RateCusum(drift.RateDriftParams(refine_s=2 * 3600, **kw))
    for i in range(60 + 8 * 60):
        frozen.update(60.0 * (i + 1), n[i], x[i])
    # only intervals up to 2 h after the start joined: p0 sits between warm-up and long run
    assert 0.575 < frozen.p0 < 0.595


def test_long_run_jitter_variance_counts_correlation_across_intervals():
    """A request-mix jitter that outlives one interval (AR(1), correlation 0.6 between adjacent
    intervals) adds up in the CUSUM's sum: the long-run estimate must be about
    (1 + 2*0.6/(1-0.6)) = 4x the lag-0 one, while for independent jitter the two agree."""
    rng = np.random.default_rng(11)
    m, p0, tau, a = 4000, 0.6, 0.02, 0.6
    e = rng.normal(0, tau * math.sqrt(1 - a * a), m)
    ar = np.zeros(m)
    for i in range(1, m):
        ar[i] = a * ar[i - 1] + e[i]
    n = np.full(m, 3000.0)
    for jitter, lo, hi in ((ar, 2.5, 5.0), (rng.normal(0, tau, m), 0.8, 1.25)):
        x = rng.binomial(3000, np.clip(p0 + jitter, 0, 1)).astype(float)
        lag0 = drift.long_run_tau2(n, x, p0, 0)
        assert lag0 == pytest.approx(tau**2, rel=0.2)
        assert lo <= drift.long_run_tau2(n, x, p0, 10) / lag0 <= hi


def _tpot(running: float) -> float:
    """A decode step that grows with the batch (the affine law the detector does not assume)."""
    return 0.010 + 0.0005 * running


def _ar1(rng, n: int, sd: float, corr_intervals: float) -> np.ndarray:
    a = math.exp(-1.0 / corr_intervals)
    out, acc = np.empty(n), rng.normal(0, sd)
    for i, e in enumerate(rng.normal(0, sd * math.sqrt(1 - a * a), n)):
        acc = a * acc + e
        out[i] = acc
    return out


def test_latency_drift_conditioned_on_load():
    cus = drift.LatencyDrift(drift.LatencyDriftParams(warmup_s=1800))
    rng = np.random.default_rng(1)
    t = 0.0
    for i in range(120):  # warm-up over two load levels
        t += 60
        r = 4 if i % 2 else 16
        cus.update(t, _tpot(r) * rng.normal(1, 0.03), r, 40)
    alarms = []
    for _ in range(240):  # load shifts to the high bin only: no drift
        t += 60
        alarms.append(cus.update(t, _tpot(16) * rng.normal(1, 0.03), 16, 40))
    assert not any(alarms)
    fired = None
    for i in range(60):  # same load, 30 % slower: drift
        t += 60
        if cus.update(t, 1.3 * _tpot(16) * rng.normal(1, 0.03), 16, 40) is not None:
            fired = i
            break
    assert fired is not None and fired < 10
    assert cus.alarm.after == pytest.approx(1.3, abs=0.08) and cus.alarm.test == "window"


def test_latency_drift_judges_and_learns_a_load_the_warm_up_never_saw():
    """Warm-up at a batch of 4 only, then the day's load at 32: judged from the first interval
    (the reference extended with a model-error bound; before issue 16 such a bin stayed unknown for
    good), no alarm for the busier batch, learned after new_load_hold_s, and a 25 % slowdown there
    is found within 15 min."""
    p = drift.LatencyDriftParams()
    cus = drift.LatencyDrift(p)
    rng = np.random.default_rng(3)
    t = 0.0
    for _ in range(70):
        t += 60
        cus.update(t, _tpot(4) * rng.normal(1, 0.02), 4, 30)
    assert cus.ready
    alarms = []
    for _ in range(240):
        t += 60
        r = 32 * rng.uniform(0.9, 1.1)
        alarms.append(cus.update(t, _tpot(r) * rng.normal(1, 0.02), r, 30))
    assert cus.unknown == 0 and not any(alarms)
    assert max(q[0] for q in cus._points()) > math.log2(20)  # the new load is part of the reference
    fired = None
    for i in range(60):
        t += 60
        r = 32 * rng.uniform(0.9, 1.1)
        if cus.update(t, 1.25 * _tpot(r) * rng.normal(1, 0.02), r, 30) is not None:
            fired = i
            break
    assert fired is not None and fired < 15


def test_latency_drift_correlated_mix_is_not_a_drift_but_a_step_on_it_is():
    """Two days of a request mix that moves TPOT by 5 % (s.d.) with a 5-minute memory, under a
    daily load cycle: the windows' standard errors come from the measured autocovariances, so no
    alarm (the per-bin CUSUM before issue 16 read such runs as drift within hours); then +25 %."""
    rng = np.random.default_rng(7)
    cus = drift.LatencyDrift()
    n = 2 * 1440
    mix = _ar1(rng, n + 120, 0.05, 5.0)
    alarms = []
    for i in range(n):
        t = 60.0 * (i + 1)
        r = 16 * (1 + 0.5 * math.sin(2 * math.pi * t / 86400))
        alarms.append(cus.update(t, _tpot(r) * math.exp(mix[i]), r, 50))
    assert not any(alarms), [a.at / 3600 for a in alarms if a]
    fired = None
    for j in range(60):
        t = 60.0 * (n + j + 1)
        r = 16 * (1 + 0.5 * math.sin(2 * math.pi * t / 86400))
        if cus.update(t, 1.25 * _tpot(r) * math.exp(mix[n + j]), r, 50) is not None:
            fired = j
            break
    assert fired is not None and fired < 20


def test_latency_drift_learns_a_speed_up_so_the_next_slowdown_shows():
    """TPOT 20 % faster after the warm-up (an upgrade; or a warm-up during the engines' fill-up)
    joins the reference; a slowdown back to 96 % of the warm-up's level is then a drift. A
    reference that refused the speed-up would keep that slowdown under it."""
    rng = np.random.default_rng(11)
    cus = drift.LatencyDrift()
    t = 0.0
    for _ in range(60):
        t += 60
        cus.update(t, _tpot(8) * rng.normal(1, 0.02), 8, 30)
    for _ in range(8 * 60):  # the reference is a mean of what joined: the new level outweighs the old in hours
        t += 60
        assert cus.update(t, 0.8 * _tpot(8) * rng.normal(1, 0.02), 8, 30) is None
    fired = None
    for i in range(60):
        t += 60
        if cus.update(t, 0.96 * _tpot(8) * rng.normal(1, 0.02), 8, 30) is not None:
            fired = i
            break
    # 30 min: the hours that carried the reference down also widened the noise estimate
    assert fired is not None and fired < 30


def test_latency_drift_noise_from_a_thin_warm_up_is_not_the_extrapolations_error():
    """A 15-min warm-up whose batch wanders over 6-16 leaves every half-doubling bin under
    min_bin_intervals: the reference is one bin, extended with a half slope where TPOT is in fact
    flat. The noise is the mix's (1 %), not that extrapolation's error: before session 16 the
    warm-up read a mix s.d. of ~20 % (the demo's 23 %) and a 15 % slowdown stayed under the
    threshold for the whole hour after it."""
    rng = np.random.default_rng(4)
    cus = drift.LatencyDrift(drift.LatencyDriftParams(warmup_s=900))
    t = 0.0
    for _ in range(20):
        t += 60
        cus.update(t, 0.013 * rng.normal(1, 0.01), rng.uniform(6, 16), 180)
    assert cus.ready and math.sqrt(cus.mix_acov[0]) < 0.03
    for _ in range(30):
        t += 60
        assert cus.update(t, 0.013 * rng.normal(1, 0.01), rng.uniform(6, 16), 180) is None
    fired = None
    for i in range(60):
        t += 60
        if cus.update(t, 1.15 * 0.013 * rng.normal(1, 0.01), rng.uniform(6, 16), 180) is not None:
            fired = i
            break
    assert fired is not None and fired < 20


def test_scan_latency_skips_a_counter_reset_and_reads_the_mean_batch():
    """Counters as the guard scrapes them (15 s), an engine restart at 5 h, a 30 % slowdown at
    6 h: the reset interval is skipped (no negative TPOT, no alarm), the slowdown is found."""
    rng = np.random.default_rng(5)
    t = np.arange(15.0, 8 * 3600.0, 15.0)
    running = 20 + 5 * np.sin(2 * np.pi * t / 7200)
    k = rng.poisson(10, len(t)).astype(float)
    tpot = np.array([_tpot(r) for r in running]) * rng.normal(1, 0.02, len(t)) * np.where(t >= 6 * 3600, 1.3, 1.0)
    cs, cc = np.cumsum(k * tpot), np.cumsum(k)
    i = int(np.searchsorted(t, 5 * 3600))
    cs[i:] -= cs[i - 1] - 0.01
    cc[i:] -= cc[i - 1] - 1
    alarms, cus = drift.scan_latency(t, cs, cc, running)
    assert alarms and all(a.at >= 6 * 3600 for a in alarms)
    assert alarms[0].at <= 6 * 3600 + 900 and cus.unknown == 0


def test_latency_drift_state_survives_a_restart():
    """The detector's state through the guard's encoder: the copy says what the original says."""
    from sla_guard.detect.evaluators import _DRIFT_CLASSES
    from sla_guard.state import decode, encode

    rng = np.random.default_rng(2)
    a = drift.LatencyDrift()
    for i in range(200):
        a.update(60.0 * (i + 1), _tpot(8) * rng.normal(1, 0.03), 8, 20)
    b = decode(json.loads(json.dumps(encode(a))), _DRIFT_CLASSES, {"params": a.params})
    out = []
    for i in range(200, 260):
        x = _tpot(8) * rng.normal(1, 0.03) * (1.3 if i >= 230 else 1.0)
        out.append((a.update(60.0 * (i + 1), x, 8, 20), b.update(60.0 * (i + 1), x, 8, 20)))
    assert [x is None for x, _ in out] == [y is None for _, y in out] and any(x for x, _ in out)


# --- issue 16: start-up growth after a restart, a slow decline in the first day ---------------

def _restarted(leak_mib_h: float = 0.0, leak_after_h: float = 2.0, seed: int = 2):
    """10 h of a 6 GiB process with a 90 MiB / 5 min GC sawtooth, restarted at 4 h; the new
    process grows 900 MiB at start-up (S-shaped, 45 min time constant), as the issue's series did.
    Optionally a leak from ``leak_after_h`` after the restart."""
    rng = np.random.default_rng(seed)
    t = np.arange(0, 10 * HOUR, 30.0)
    restart = 4 * HOUR
    since = np.where(t >= restart, t - restart, t)
    tau = 45 * 60.0
    startup = 900 * MIB * (1 / (1 + np.exp(-(since - tau) / (tau / 4))))
    v = 6 * 2**30 + startup + 90 * MIB * ((t / 300.0) % 1.0) + rng.normal(0, 3 * MIB, len(t))
    onset = restart + leak_after_h * HOUR
    v += np.maximum(0.0, t - onset) * leak_mib_h * MIB / HOUR
    v[(t >= restart) & (t < restart + 120)] = 0.4 * 2**30  # the model loads
    return t, v, onset


def test_restart_followed_by_startup_growth_raises_no_finding():
    """Issue 16's false alarm: start-up growth after a restart read as a leak. Start-up growth
    is excluded (90 min) and its decelerating tail removed before the trend test; the 2 h window
    would see ~500 MiB/h of growth right after the exclusion without that."""
    t, v, _ = _restarted()
    verdicts = leak.scan(t, v)
    assert not [at for at, ver in verdicts if ver.detected]
    assert any(ver.status == "ok" and ver.segment_start == pytest.approx(4 * HOUR) for _, ver in verdicts)
    # a 10 min warm-up, no curve and the z of round 1 (4): found
    no_curve = leak.LeakParams(long_warmup_s=0.0, warmup_s=600.0, z_crit=4.0)
    assert any(ver.detected for _, ver in leak.scan(t, v, no_curve))


def test_leak_two_hours_after_a_restart_found_with_its_onset():
    t, v, onset = _restarted(48.0, leak_after_h=2.0)
    first = leak.first_detection(leak.scan(t, v))
    assert first is not None and 0 < first[0] - onset <= 2.5 * HOUR
    assert first[1].onset is not None and abs(first[1].onset - onset) <= 0.75 * HOUR


def test_slow_acceptance_decline_in_first_day_flagged_before_004():
    """Issue 16: 0.06 over 3 h, starting 5 h into the first day, at 50 drafts/s. A learning
    baseline absorbed it; the frozen reference and the slow CUSUM pair flag it before the rate
    is 0.04 below its start (2 h into the ramp). Without the slow pair it is not flagged by then."""
    rng = np.random.default_rng(16)
    dt, onset = 10.0, 5 * HOUR
    t = np.arange(dt, 12 * HOUR, dt)
    p = 0.62 - 0.06 * np.clip((t - onset) / (3 * HOUR), 0, 1)
    n = rng.poisson(50 * dt, len(t))
    x = rng.binomial(n, p)
    cn, cx = np.cumsum(n).astype(float), np.cumsum(x).astype(float)
    alarms, cus = drift.scan_rate(t, cn, cx)
    first = next(a for a in alarms if a.direction == "down")
    assert onset < first.at < onset + 2 * HOUR
    assert cus.p0 == pytest.approx(0.62, abs=0.01)  # frozen: the decline never moved it
    fast_only, _ = drift.scan_rate(t, cn, cx, drift.RateDriftParams(slow=False))
    assert not [a for a in fast_only if a.at < onset + 2 * HOUR]
    learning, _ = drift.scan_rate(t, cn, cx, drift.RateDriftParams(slow=False, refine_s=86400, ref_margin=0.0))
    assert not [a for a in learning if a.at < onset + 2 * HOUR]
