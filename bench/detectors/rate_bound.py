"""How many of families.py's acceptance changes could any detector flag in time? (issue 16)

    .venv/bin/python bench/detectors/rate_bound.py

**Steps** (session 13): an estimate, per step series, of the best detection probability at the
10-minute deadline for a detector that knows the noise model (binomial counts plus the AR(1)
request-mix term each series was drawn with) and looks at the 10 minutes after the step with one
test. Its mean over a cohort is the share such a detector could reach. Three idealisations are
printed, each less kind than the one before:

* ``oracle``: the pre-step rate known exactly, and the 10-minute windows treated as independent
  tests (30 days / 10 min of them, two-sided: z = 3.68);
* ``sliding``: the same, but the window slides every minute, as a live detector's does; by
  Pickands' rule a moving mean over m intervals crosses z about z phi(z) / m times per interval,
  so the 30-day budget needs z = 4.2;
* ``1 h reference``: the sliding test against a rate learned over the first hour, with its own
  error (the step can come 1 h after the start).

**Ramps** (session 18): the same question for ``run.py``'s ramp cohort, flagged before the ramp
is 0.04 from its start, by a test that knows the onset and the slope: the matched filter (the
deviation weighted by the ramp itself) from the onset to that moment, on the series' long-run
noise (variance of a mean over T s = (p(1-p) / drafts per s + 2 x overdispersion^2 x correlation
time) / T, plus the slow wander's 0.004^2), at the sliding z of 4.2: ``sliding`` (reference
known), ``1 h reference`` (learned over the first hour) and ``reference before onset`` (learned
over everything before the onset, as the detector's growing reference at best).

The production detector spends half its budget on the window test and half on a CUSUM (z* 4.69
for its windows). Nothing here is tuned: it reads the generator's parameters, so both sets are
printed.
"""

from __future__ import annotations

import sys
from math import erf, exp, sqrt
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import families as fam

DEADLINE_S = 600.0
REFERENCE_S = 3600.0
Z = {"oracle": 3.68, "sliding": 4.2, "1 h reference": 4.2}


def _phi(x: float) -> float:
    return 0.5 * (1.0 + erf(x / sqrt(2.0)))


def _mean_var(sd: float, corr_s: float, dt: float, span_s: float) -> float:
    """Variance of the mean of an AR(1) term (s.d. ``sd``, correlation time ``corr_s``) over
    ``span_s`` sampled every ``dt``."""
    m = max(1, int(span_s / dt))
    a = exp(-dt / corr_s)
    k = np.arange(1, m)
    return sd * sd / (m * m) * (m + 2.0 * float(np.sum((m - k) * a**k)))


def step_se(c: fam.RateSeries, span_s: float, start: float) -> float:
    """Standard error of the rate measured over ``span_s`` from ``start``."""
    f = c.family
    i, j = np.searchsorted(c.t, [start, start + span_s])
    drafts = float(np.sum(np.clip(np.diff(c.drafts[max(i - 1, 0): j + 1]), 0, None)))  # resets: counters restart
    p = min(max(c.base, c.base + c.change), 0.99)
    return sqrt(_mean_var(f["overdispersion"], f["corr_s"], f["dt"], span_s) + p * (1 - p) / max(drafts, 1.0))


def detectable(c: fam.RateSeries, idealisation: str) -> float:
    se = step_se(c, DEADLINE_S, float(c.onset))
    if idealisation == "1 h reference":
        se = sqrt(se * se + step_se(c, REFERENCE_S, float(c.t[0])) ** 2)
    return _phi(abs(c.change) / se - Z[idealisation])


RAMP_DOWN = 0.04
RAMP_Z = Z["sliding"]
RAMP_REFERENCES = ("sliding", "1 h reference", "reference before onset")


def long_run_density(c: fam.RateSeries) -> float:
    """Variance x seconds of the series' rate noise over spans much longer than its memory."""
    f = c.family
    p = min(max(c.base, 0.01), 0.99)
    return p * (1 - p) / f["drafts_s"] + 2.0 * f["overdispersion"] ** 2 * f["corr_s"]


def ramp_detectable(c: fam.RateSeries, reference: str) -> float:
    """Chance that the matched filter from the onset reaches RAMP_Z before the ramp is RAMP_DOWN
    from its start. Its statistic S = sum of w(u) (reference - x(u)) / density with w = slope x u
    has mean A = slope^2 T^3 / (3 density) and variance A plus the reference's error carried by
    the filter's weights (slope T^2 / 2)^2 x (reference variance + wander) / density^2."""
    density = long_run_density(c)
    s = abs(c.per_hour) / fam.HOUR
    t = RAMP_DOWN / s
    a = s * s * t**3 / 3.0 / density
    ref = {"sliding": 0.0, "1 h reference": density / REFERENCE_S,
           "reference before onset": density / max(float(c.onset) - float(c.t[0]), 1.0)}[reference]
    var = a + (s * t * t / 2.0) ** 2 * (ref + 0.004**2) / density**2
    return _phi(a / sqrt(var) - RAMP_Z)


def main() -> int:
    cohorts = (("0.10 steps (down and up)", [(s, -0.10) for s in range(10_000, 10_050)]
                + [(s, 0.10) for s in range(10_050, 10_100)]),
               ("+-0.05..0.2 steps", [(s, None) for s in range(20_000, 20_060)]))
    print(f"{'cohort':26s} {'set':7s} " + " ".join(f"{k:>14s}" for k in Z))
    for name, seeds in cohorts:
        for label, base in (("tuning", fam.TUNING_SEEDS.start), ("sealed", fam.SEALED_SEEDS.start)):
            cases = [fam.rate_case(base + s, kind="step", change=ch) for s, ch in seeds]
            shares = [100.0 * float(np.mean([detectable(c, k) for c in cases])) for k in Z]
            print(f"{name:26s} {label:7s} " + " ".join(f"{x:13.1f}%" for x in shares))
    print(f"\n{'cohort':26s} {'set':7s} " + " ".join(f"{k:>23s}" for k in RAMP_REFERENCES))
    for label, base in (("tuning", fam.TUNING_SEEDS.start), ("sealed", fam.SEALED_SEEDS.start)):
        cases = [fam.rate_case(base + 30_000 + s, kind="ramp") for s in range(100)]
        shares = [100.0 * float(np.mean([ramp_detectable(c, k) for c in cases])) for k in RAMP_REFERENCES]
        print(f"{'ramps before 0.04 down':26s} {label:7s} " + " ".join(f"{x:22.1f}%" for x in shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
