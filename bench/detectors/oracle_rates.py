"""How many of families.py's acceptance changes any detector could flag in time (issue 16).

    .venv/bin/python bench/detectors/oracle_rates.py [--set tuning|sealed|both]

An information bound, not a detector: for each series of ``run.py``'s 0.10-step and ramp cohorts
it takes the generator's own parameters (base rate, draft rate, overdispersion and its
correlation time, slow wander) and asks how far above the noise a test that *knows the onset
and the shape of the change* stands at the deadline (10 min after a step; the moment a ramp is
0.04 below its start). It uses the Gaussian long-run approximation of the series: variance of a
mean over T seconds = (p(1-p) / drafts per s + 2 x overdispersion^2 x correlation time) / T, plus
the slow wander's variance. The statistic is the matched filter (the window mean for a step,
the ramp-weighted sum for a ramp), whose z at the deadline is compared with the z a scan over
one-minute onsets needs for a 30-day ARL0 (one-sided Bonferroni: 4.07); the chance of flagging
in time is Phi(z - 4.07). Two references: (a) the true rate before the change, known exactly;
(b) the rate measured over everything before the onset, as a detector must.

Real detectors do worse than (b): they do not know the onset or the change's shape, and their
band must tolerate the mix's wander. A target above (b) is out of reach on these series.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import families as fam
from run import SETS, SIZES

Z_ARL0 = 4.07  # one-sided, P = 60 s / 30 d per minute of onsets scanned
STEP_S = 600.0
RAMP_DOWN = 0.04


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _noise(c: fam.RateSeries) -> tuple[float, float]:
    """(long-run variance density in rate^2 x s, slow wander variance) of the series."""
    f = c.family
    p = min(max(c.base, 0.01), 0.99)
    density = p * (1 - p) / f["drafts_s"] + 2.0 * f["overdispersion"] ** 2 * f["corr_s"]
    return density, 0.004**2  # the generator's slow wander is at most 0.004 (1 h memory)


def step_chance(c: fam.RateSeries, known_ref: bool) -> float:
    density, wander = _noise(c)
    var = density / STEP_S + wander + (0.0 if known_ref else density / max(c.onset, 1.0))
    return _phi(abs(c.change) / math.sqrt(var) - Z_ARL0)


def ramp_chance(c: fam.RateSeries, known_ref: bool) -> float:
    density, wander = _noise(c)
    s = abs(c.per_hour) / fam.HOUR  # rate per second
    t = RAMP_DOWN / s  # seconds from onset to 0.04 down
    a = s * s * t**3 / 3.0 / density  # E[S] = Var[S] of the matched filter on white noise
    ref = 0.0 if known_ref else density / max(c.onset, 1.0)
    var = a + (s * t * t / 2.0) ** 2 * (ref + wander) / density**2
    return _phi(a / math.sqrt(var) - Z_ARL0)


def bound(base: int) -> dict[str, tuple[float, int]]:
    n = SIZES["step10"][0]
    steps = [fam.rate_case(base + 10_000 + s, kind="step", change=-0.10 if s < n // 2 else 0.10) for s in range(n)]
    ramps = [fam.rate_case(base + 30_000 + s, kind="ramp") for s in range(SIZES["ramp"][0])]
    return {
        "0.10 step within 10 min, reference known": (sum(step_chance(c, True) for c in steps), len(steps)),
        "0.10 step within 10 min, reference from before the onset": (sum(step_chance(c, False) for c in steps),
                                                                      len(steps)),
        "ramp before 0.04 down, reference known": (sum(ramp_chance(c, True) for c in ramps), len(ramps)),
        "ramp before 0.04 down, reference from before the onset": (sum(ramp_chance(c, False) for c in ramps),
                                                                    len(ramps)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("tuning", "sealed", "both"), default="both")
    a = ap.parse_args(argv)
    sets = ("tuning", "sealed") if a.set == "both" else (a.set,)
    res = {s: bound(SETS[s]) for s in sets}
    print(f"{'expected share flagged in time by a detector that knows onset and shape':60s}" +
          "".join(f"{s:>10s}" for s in sets))
    for k in res[sets[0]]:
        print(f"{k:60s}" + "".join(f"{100 * res[s][k][0] / res[s][k][1]:9.1f}%" for s in sets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
