"""`sla-guard serve` extension: adds the scaling advisor to the guard and returns its router
(``/v1/recommendations``, ``/v1/scale/keda``, ``/v1/decisions``), mounted behind the API's bearer auth.

Advisory mode (the default) only recommends: gauges, API, decision log. Active mode also calls
the configured actuator (webhook or Kubernetes scale subresource).
"""

from __future__ import annotations

import atexit
import os

from sla_guard.config import ConfigError, Indicator
from sla_guard.leader import Elector, FileLockElector, LeaseElector
from sla_guard.scale.actuators import Actuator, KubernetesActuator, LeaderGatedActuator, WebhookActuator
from sla_guard.scale.api import advisor_router
from sla_guard.scale.config import AdvisorConfig, LeaderElection, parse_advisor
from sla_guard.scale.evaluator import AdvisorEvaluator


def slo_thresholds(config, model: str) -> tuple[float, float]:
    """TTFT and TPOT thresholds the advisor sizes for: the tightest objective of each indicator
    in the guard's SLO spec (for this model's prefill and decode pools), else the default 2.5 s / 20 ms."""
    ttft, tpot = [], []
    for pool in ("prefill", "decode"):
        for slo in config.slos_for(model, pool):
            (ttft if slo.indicator is Indicator.TTFT else tpot).append(slo.threshold_s)
    return (min(ttft) if ttft else 2.5), (min(tpot) if tpot else 0.020)


def build_actuator(cfg: AdvisorConfig) -> Actuator | None:
    """The active-mode actuator; wrapped in a ``LeaderGatedActuator`` (elector started here,
    stopped at exit so a Lease is released) when ``actuation.leader_election.mode`` is set."""
    if cfg.mode != "active":
        return None
    a = cfg.actuation
    inner: Actuator | None = None
    if a.kubernetes:
        try:
            inner = KubernetesActuator(a.kubernetes, kubeconfig=a.kubeconfig)
        except ImportError:
            raise ConfigError("advisor.actuation.kubernetes needs the 'kubernetes' package: "
                              "pip install 'sla-guard[kubernetes]'") from None
    elif a.webhook is not None:
        token = os.environ.get(a.webhook.bearer_token_env) if a.webhook.bearer_token_env else None
        inner = WebhookActuator(a.webhook, token=token)
    if inner is None or a.leader_election.mode == "none":
        return inner
    elector = build_elector(a.leader_election, kubeconfig=a.kubeconfig)
    elector.start()
    atexit.register(elector.stop)
    return LeaderGatedActuator(inner, elector)


def build_elector(le: LeaderElection, kubeconfig: str | None = None) -> Elector:
    """The elector ``advisor.actuation.leader_election`` names (not started)."""
    if le.mode == "file":
        assert le.lock_file is not None  # the config validator requires it
        return FileLockElector(le.lock_file, identity=le.identity, retry_s=le.retry_s)
    if le.mode == "kubernetes":
        try:
            return LeaseElector(le.lease_name, le.namespace, le.identity, lease_duration_s=le.lease_duration_s,
                                renew_deadline_s=le.renew_deadline_s, renew_s=le.renew_s, retry_s=le.retry_s,
                                kubeconfig=kubeconfig)
        except ImportError:
            raise ConfigError("advisor.actuation.leader_election.mode 'kubernetes' needs the 'kubernetes' "
                              "package: pip install 'sla-guard[kubernetes]'") from None
        except Exception as err:  # no in-cluster service account, unreadable kubeconfig
            raise ConfigError(f"advisor.actuation.leader_election: cannot reach Kubernetes "
                              f"({type(err).__name__}: {err}); set advisor.actuation.kubeconfig or run in-cluster"
                              ) from None
    raise ConfigError(f"advisor.actuation.leader_election.mode: {le.mode!r} has no elector")


def extend(config, guard, token=None) -> list:
    cfg = parse_advisor(config.advisor, "advisor")
    model = cfg.model
    ttft, tpot = slo_thresholds(config, model)
    book = getattr(guard, "findings", None)
    findings = book.open_findings if book is not None and hasattr(book, "open_findings") else None
    ev = AdvisorEvaluator(cfg, model=None if model == "*" else model, slo_ttft_s=ttft, slo_tpot_s=tpot,
                          actuator=build_actuator(cfg), findings=findings)
    guard.add_evaluator(ev)
    guard.advisor = ev
    return [advisor_router(ev)]
