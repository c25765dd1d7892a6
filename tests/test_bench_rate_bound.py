"""The ramp bound of bench/detectors/rate_bound.py (issue 16): its matched-filter z is the one
simulated binomial series give, and its chance moves with the noise the generator draws. Series
built here, no detector."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "detectors"))
import families as fam
import rate_bound as rb


def _ramp(drafts_s: float, od: float = 0.0, per_hour: float = -0.05, onset: float = 7200.0) -> fam.RateSeries:
    family = {"drafts_s": drafts_s, "overdispersion": od, "corr_s": 120.0}
    return fam.RateSeries("x", np.zeros(1), np.zeros(1), np.zeros(1), "ramp", -0.1, per_hour, onset, 0.6, family)


def test_a_ramp_far_above_the_noise_is_flagged_in_time_and_one_inside_it_rarely():
    quiet, noisy = _ramp(500.0), _ramp(5.0, 0.04)
    assert rb.ramp_detectable(quiet, "sliding") > 0.99
    assert rb.ramp_detectable(noisy, "sliding") < 0.2
    # a reference measured over an hour costs what its own error carries
    assert rb.ramp_detectable(_ramp(20.0, 0.01), "1 h reference") < rb.ramp_detectable(_ramp(20.0, 0.01), "sliding")


def test_the_ramp_filter_z_matches_simulated_binomial_series():
    """White binomial noise (no overdispersion): the matched filter's z at the deadline, simulated
    on 2000 series at one-second resolution, is the formula's (within 6 %)."""
    rng = np.random.default_rng(5)
    c = _ramp(20.0)
    s = 0.05 / fam.HOUR
    t_end = rb.RAMP_DOWN / s
    w = s * np.arange(1.0, t_end + 1.0)
    zs = [float(np.sum(w * (0.6 - rng.binomial(20, 0.6 - w) / 20.0))) for _ in range(2000)]
    z_sim = np.mean(zs) / np.std(zs)
    z_formula = math.sqrt(s * s * t_end**3 / 3.0 / rb.long_run_density(c))
    assert abs(z_sim / z_formula - 1.0) < 0.06
