"""The guard's composition root: the one place that turns a ``GuardConfig`` into running parts.

``compose`` builds, in data-flow order, the source (embedded scraper or Prometheus), the SLO
evaluator, the detectors with their findings book (and the Alertmanager publisher when one is
configured), and the scaling advisor with its actuator and leader election; it hands the
advisor the findings book explicitly and returns the API routers of those parts
(``/v1/findings``, ``/v1/ttft-breakdown``, ``/v1/recommendations``, ``/v1/scale/keda``, ``/v1/decisions``) next to the
guard. Every part always ships: nothing here is looked up by name or tolerated as missing.

``serve`` composes everything; ``check`` only the source and the SLOs (a one-shot judgement:
the detectors need history, and the advisor must not actuate from it); tests and benchmarks
pass their own ``source`` (a ``StoreSource`` over a store they fill) and pick the parts.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter
from prometheus_client import CollectorRegistry

from sla_guard import defaults
from sla_guard.config import ConfigError, GuardConfig, Indicator
from sla_guard.detect.alertmanager import AlertPublisher
from sla_guard.detect.census import CensusEvaluator
from sla_guard.detect.evaluators import build_evaluators
from sla_guard.detect.evaluators import router as findings_router
from sla_guard.detect.findings import FindingsBook
from sla_guard.detect.stages import StageBreakdownEvaluator
from sla_guard.detect.stages import router as stages_router
from sla_guard.ingest import build_source
from sla_guard.ingest.source import Source
from sla_guard.leader import Elector, FileLockElector, LeaseElector
from sla_guard.model import Evaluator
from sla_guard.outbound import env_value
from sla_guard.scale.actuators import Actuator, KubernetesActuator, LeaderGatedActuator, WebhookActuator
from sla_guard.scale.api import advisor_router
from sla_guard.scale.evaluator import AdvisorEvaluator
from sla_guard.service import Guard
from sla_guard.settings.advisor import AdvisorConfig, LeaderElection
from sla_guard.slo import SLOEvaluator
from sla_guard.state import StateStore


@dataclass(frozen=True, slots=True)
class Composition:
    """What ``compose`` built: the guard, the routers to mount behind the API's bearer auth, and
    the parts the API and tests reach directly (None where that part was not composed)."""

    guard: Guard
    routers: tuple[APIRouter, ...]
    findings: FindingsBook | None
    advisor: AdvisorEvaluator | None
    alerts: AlertPublisher | None


def compose(config: GuardConfig, *, source: Source | None = None, state: StateStore | None = None,
            registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.time,
            extra_evaluators: Sequence[Evaluator] = (), slo: bool = True, detectors: bool = True,
            advisor: bool = True) -> Composition:
    """The guard for ``config``. ``source``: the configured one when None. ``state``: the
    crash-safe state file (``serve`` passes ``open_state(config)``; ``check`` none, so a one-shot
    check never writes over a running guard's state). ``extra_evaluators`` run right after the
    SLO evaluator; ``slo`` / ``detectors`` / ``advisor`` choose the parts."""
    src = build_source(config) if source is None else source
    guard = Guard(config, src, [], registry, clock=clock, state=state)
    src.bind_metrics(guard.metrics)
    if slo:
        guard.add_evaluator(SLOEvaluator(config, targets=src.targets))  # a down pool says why
    for ev in extra_evaluators:
        guard.add_evaluator(ev)
    routers: list[APIRouter] = []
    book = publisher = None
    if detectors:
        book = FindingsBook(guard.metrics)
        guard.add_state("findings", book)  # open findings survive a restart (sla_guard.state)
        for ev in build_evaluators(book, config.detectors):
            guard.add_evaluator(ev)
        # after the leak evaluator: the engines' object census onto the open leak findings
        guard.add_evaluator(CensusEvaluator(book, request_file=os.environ.get("SLA_GUARD_CENSUS_REQUEST_FILE")))
        stages = StageBreakdownEvaluator(config, book)  # where the client TTFT went; stage growth
        guard.add_evaluator(stages)
        publisher = AlertPublisher.from_settings(book, config.alertmanager, guard.metrics, config.api.listen)
        if publisher is not None:
            guard.add_state("alertmanager", publisher)  # what it sent, resolved after a restart
            publisher.start()
        routers += [findings_router(book), stages_router(stages)]
    adv = None
    if advisor:
        cfg = config.advisor
        ttft, tpot = slo_thresholds(config, cfg.model)
        # the advisor reads open findings (leak -> rolling restart) from the book built above
        adv = AdvisorEvaluator(cfg, model=None if cfg.model == "*" else cfg.model, slo_ttft_s=ttft,
                               slo_tpot_s=tpot, actuator=build_actuator(cfg),
                               findings=book.open_findings if book is not None else None)
        guard.add_evaluator(adv)
        routers.append(advisor_router(adv))
    return Composition(guard, tuple(routers), book, adv, publisher)


def slo_thresholds(config: GuardConfig, model: str) -> tuple[float, float]:
    """TTFT and TPOT thresholds the advisor sizes for: the tightest objective of each indicator
    in the guard's SLO spec (for this model's prefill and decode pools), else the contract's
    default SLAs (``sla_guard.defaults``)."""
    ttft, tpot = [], []
    for pool in ("prefill", "decode"):
        for s in config.slos_for(model, pool):
            (ttft if s.indicator is Indicator.TTFT else tpot).append(s.threshold_s)
    return (min(ttft) if ttft else defaults.TTFT_SLO_S), (min(tpot) if tpot else defaults.TPOT_SLO_S)


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
        token = env_value("advisor.actuation.webhook.bearer_token_env", a.webhook.bearer_token_env,
                          "calling the scaling webhook without a bearer token")
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
