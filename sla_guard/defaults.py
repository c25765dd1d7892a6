"""Default values that more than one part reads: kept here, once, so the config models, the
pure sizing/detection code and the tools cannot drift apart (as Dynamo's planner keeps its
``defaults.py``). The SLA thresholds are the contract's (``exporters.contract``
``DEFAULT_TTFT_SLO_S`` / ``DEFAULT_TPOT_SLO_S``): they must be histogram bucket boundaries, so
the contract owns them and this module re-exports them under the names the guard uses.
"""

from __future__ import annotations

from typing import Final

from exporters.contract import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S

DAY: Final = 86400.0

# --- SLA thresholds (mean TTFT <= 2.5 s, mean TPOT <= 20 ms; "From Day 0 to Production SLAs") ---
TTFT_SLO_S: Final = DEFAULT_TTFT_SLO_S
TPOT_SLO_S: Final = DEFAULT_TPOT_SLO_S

# --- scaling advisor (settings.advisor.AdvisorConfig and the knobs of scale.core) --------------
# busy share a prefill replica is sized for (the starting point; learned from TTFT outcomes):
# queueing delay, not compute, is what breaks TTFT
PREFILL_TARGET_UTILIZATION: Final = 0.5
DRAIN_HORIZON_S: Final = 30.0  # time to drain a prefill backlog
FORECAST_HORIZON_S: Final = 120.0  # trend look-ahead (~ replica start time)
SCALE_DOWN_MARGIN: Final = 0.2  # N-1 must fit with this extra headroom
DECODE_TPOT_HEADROOM: Final = 0.85  # size decode so predicted TPOT <= headroom x SLA
KV_TARGET_USAGE: Final = 0.85
LEARN_QUANTILE: Final = 0.95  # TTFT quantile the utilisation target is learned from (5% miss budget)
KUBERNETES_CALL_TIMEOUT_S: Final = 5.0  # each call of the Kubernetes actuator, whole

# --- rate-drift detector (settings.detectors.RateConfig and detect.drift.RateDriftParams) --------
RATE_INTERVAL_S: Final = 60.0  # one CUSUM step
RATE_WARMUP_S: Final = 3600.0  # baseline learned over this span
# design shift (absolute rate) beyond the tolerance band: p1 = p0 - 0.07, a 0.10 drop less the
# wander a baseline can be off by
RATE_SHIFT: Final = 0.05
RATE_TOLERANCE: Final = 0.02  # indifference band: slow wander within +-tolerance is not drift
RATE_ARL0_S: Final = 30 * DAY  # mean time between false alarms, per detector family
RATE_ARL_RULE: Final = "gaussian"
RATE_JITTER_BLOCKS: Final = 24
# 0: the reference rate is frozen at the end of warm-up (issue 16: an expanding mean learned for a day
# absorbed a slow decline); > 0 keeps learning from alarm-free intervals until this long after the start
RATE_REFINE_S: Final = 0.0
