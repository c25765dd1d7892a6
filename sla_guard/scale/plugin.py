"""`sla-guard serve` extension: adds the scaling advisor to the guard and returns its router
(``/v1/recommendations``, ``/v1/scale/keda``, ``/v1/decisions``), mounted behind the API's bearer auth.

Advisory mode (the default) only recommends: gauges, API, decision log. Active mode also calls
the configured actuator (webhook or Kubernetes scale subresource).
"""

from __future__ import annotations

import os

from sla_guard.config import ConfigError, Indicator
from sla_guard.scale.actuators import Actuator, KubernetesActuator, WebhookActuator
from sla_guard.scale.api import advisor_router
from sla_guard.scale.config import AdvisorConfig, parse_advisor
from sla_guard.scale.evaluator import AdvisorEvaluator


def slo_thresholds(config, model: str) -> tuple[float, float]:
    """TTFT and TPOT thresholds the advisor sizes for: the tightest objective of each indicator
    in the guard's SLO spec (for this model's prefill and decode pools), else the seeds' 2.5 s / 20 ms."""
    ttft, tpot = [], []
    for pool in ("prefill", "decode"):
        for slo in config.slos_for(model, pool):
            (ttft if slo.indicator is Indicator.TTFT else tpot).append(slo.threshold_s)
    return (min(ttft) if ttft else 2.5), (min(tpot) if tpot else 0.020)


def build_actuator(cfg: AdvisorConfig) -> Actuator | None:
    if cfg.mode != "active":
        return None
    a = cfg.actuation
    if a.kubernetes:
        try:
            return KubernetesActuator(a.kubernetes, kubeconfig=a.kubeconfig)
        except ImportError:
            raise ConfigError("advisor.actuation.kubernetes needs the 'kubernetes' package: "
                              "pip install 'sla-guard[kubernetes]'") from None
    if a.webhook is not None:
        token = os.environ.get(a.webhook.bearer_token_env) if a.webhook.bearer_token_env else None
        return WebhookActuator(a.webhook, token=token)
    return None


def extend(config, guard, token=None) -> list:
    cfg = parse_advisor(config.advisor, "advisor")
    model = cfg.model if cfg.model != "*" else "*"
    ttft, tpot = slo_thresholds(config, model)
    book = getattr(guard, "findings", None)
    findings = book.open_findings if book is not None and hasattr(book, "open_findings") else None
    ev = AdvisorEvaluator(cfg, model=None if model == "*" else model, slo_ttft_s=ttft, slo_tpot_s=tpot,
                          actuator=build_actuator(cfg), findings=findings)
    guard.add_evaluator(ev)
    guard.advisor = ev
    return [advisor_router(ev)]
