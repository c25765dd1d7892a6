"""The information bound of bench/detectors/oracle_rates.py (issue 16): its z for a known-onset
matched filter is the one simulated binomial series give, and it moves with the noise the
generator draws. Series built here, no detector."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "detectors"))
import families as fam
import oracle_rates as orc


def _series(kind: str, drafts_s: float, od: float = 0.0, *, change: float = 0.0, per_hour: float = 0.0,
            onset: float = 7200.0) -> fam.RateSeries:
    family = {"drafts_s": drafts_s, "overdispersion": od, "corr_s": 120.0}
    return fam.RateSeries("x", np.zeros(1), np.zeros(1), np.zeros(1), kind, change, per_hour, onset, 0.6, family)


def test_a_step_far_above_the_noise_is_always_in_time_and_one_inside_it_never():
    assert orc.step_chance(_series("step", 500.0, change=0.10), True) > 0.999
    assert orc.step_chance(_series("step", 5.0, 0.04, change=0.10), True) < 0.5
    quiet, noisy = (orc.ramp_chance(_series("ramp", d, od, per_hour=-0.05), True) for d, od in ((500.0, 0.0),
                                                                                                 (5.0, 0.04)))
    assert quiet > 0.99 > 0.2 > noisy


def test_the_ramp_filter_z_matches_simulated_binomial_series():
    """White binomial noise (no overdispersion): the matched filter's z at the deadline, simulated
    on 2000 series at one-second resolution, is the formula's (within 6 %)."""
    rng = np.random.default_rng(5)
    c = _series("ramp", 20.0, per_hour=-0.05)
    s = 0.05 / fam.HOUR
    t_end = orc.RAMP_DOWN / s
    u = np.arange(1.0, t_end + 1.0)
    w = s * u
    p = 0.6 - w
    zs = []
    for _ in range(2000):
        x = rng.binomial(20, p) / 20.0
        zs.append(float(np.sum(w * (0.6 - x))))  # the filter against the known reference
    z_sim = np.mean(zs) / np.std(zs)
    density, _ = orc._noise(c)
    z_formula = math.sqrt(s * s * t_end**3 / 3.0 / density)
    assert abs(z_sim / z_formula - 1.0) < 0.06
