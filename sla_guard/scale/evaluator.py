"""The advisor as a guard ``Evaluator``: runs every tick, publishes recommendations.

Outputs, all from the same decision: the contract gauges ``guard_desired_replicas`` /
``guard_current_replicas`` (for HPA External metrics through prometheus-adapter), the
``guard_scaling_decisions`` counter, one JSONL line per pool per tick in the decision log, the
state the ``/v1/recommendations`` and KEDA endpoints serve, and, in active mode only, a call to
the actuator. Nothing here raises into the guard: bad data holds, actuator failures are counted.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from exporters import contract as c
from exporters.prometheus import ContractMetrics
from sla_guard.model import Finding, MetricsView, PoolRecommendation
from sla_guard.scale.actuators import ActuationError, Actuator, idempotency_key
from sla_guard.scale.advisor import Advisor, to_recommendation
from sla_guard.scale.config import AdvisorConfig

log = logging.getLogger(__name__)


class DecisionLog:
    """Append-only JSONL file; one line per decision. Write errors are logged, never raised."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.errors = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict) -> None:
        if self.path is None:
            return
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True, default=float) + "\n")
        except OSError as err:
            self.errors += 1
            log.warning("decision log %s: %s", self.path, err)


class AdvisorEvaluator:
    """Evaluator protocol: ``evaluate(view, now)`` and ``snapshot()``."""

    name = "advisor"

    def __init__(self, cfg: AdvisorConfig, *, model: str | None = None, slo_ttft_s: float = 2.5,
                 slo_tpot_s: float = 0.020, metrics: ContractMetrics | None = None,
                 actuator: Actuator | None = None,
                 findings: Callable[[], Iterable[Finding]] | None = None) -> None:
        self.cfg = cfg
        self.model = model or (cfg.model if cfg.model != "*" else "default")
        # advisor.model "*" sizes whatever the pools serve; label the advice with the model the
        # engines report when there is exactly one, so dashboards join it with engine series
        self._label_from_data = model is None and cfg.model == "*"
        self.advisor = Advisor(cfg, model=cfg.model if model is None else model, slo_ttft_s=slo_ttft_s,
                               slo_tpot_s=slo_tpot_s)
        self.metrics = metrics
        self.actuator = actuator if cfg.mode == "active" else None
        self.findings = findings
        self.log = DecisionLog(cfg.decision_log)
        self.history: deque[dict] = deque(maxlen=256)
        self.actuation_errors = 0
        self._lock = threading.Lock()
        self._recs: list[PoolRecommendation] = []
        self._restarts: list[PoolRecommendation] = []
        self.updated_at: float | None = None

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        """Called once by the Guard: publish on the guard's own /metrics."""
        self.metrics = metrics

    # -- Evaluator protocol --------------------------------------------------------------------
    def evaluate(self, view: MetricsView, now: float) -> None:
        if self._label_from_data:
            models = {dict(lab).get("model", "") for lab in view.instant(c.REQUESTS_RUNNING.name, {}, now)}
            if len(models) == 1 and "" not in models:
                self.model = models.pop()
        try:
            found = tuple(self.findings()) if self.findings else ()
        except Exception:  # a detector's problem must not stop scaling advice
            log.exception("advisor: findings source failed")
            found = ()
        decisions, restarts = self.advisor.step(view, now, {}, found)
        recs = []
        for pool, d in decisions.items():
            rec = to_recommendation(self.model, d)
            recs.append(rec)
            actuated: str | bool = False
            if self.actuator is not None and d.direction != "none":
                key = idempotency_key(self.model, pool, d.desired, now)
                try:
                    self.actuator.set_replicas(self.model, pool, d.desired, key)
                    self.advisor.expect(pool, d.desired, now)
                    actuated = True
                except ActuationError as err:
                    actuated = f"error: {err}"
                    self.actuation_errors += 1
                    self._inc(c.GUARD_ACTUATION_ERRORS, self.model, pool, self.actuator.name)
                    log.warning("advisor: %s", err)
            self._publish(rec, d.direction)
            record = {"t": now, "model": self.model, "pool": pool, "mode": self.cfg.mode, "current": d.current,
                      "desired": d.desired, "direction": d.direction, "action": d.action, "reasons": d.reasons,
                      "confidence": d.confidence, "numbers": d.numbers, "actuated": actuated}
            self.log.append(record)
            self.history.append(record)
        for r in restarts:
            record = {"t": now, "model": r.model, "pool": r.pool, "mode": self.cfg.mode, "action": r.action,
                      "reasons": r.reasons, "confidence": r.confidence, "numbers": r.numbers}
            self.log.append(record)
            self._inc(c.GUARD_SCALING_DECISIONS, r.model, r.pool or "unknown", "none", "leak_rolling_restart")
        with self._lock:
            self._recs, self._restarts, self.updated_at = recs, restarts, now

    def _inc(self, metric, *labels: str) -> None:
        if self.metrics is not None:
            self.metrics[metric].labels(*labels).inc()

    def _publish(self, rec: PoolRecommendation, direction: str) -> None:
        if self.metrics is None:
            return
        self.metrics[c.GUARD_DESIRED_REPLICAS].labels(rec.model, rec.pool).set(rec.desired)
        self.metrics[c.GUARD_CURRENT_REPLICAS].labels(rec.model, rec.pool).set(rec.current)
        reason = rec.reasons[0] if rec.reasons else "none"
        self.metrics[c.GUARD_SCALING_DECISIONS].labels(rec.model, rec.pool, direction, reason).inc()

    def recommendations(self) -> tuple[list[PoolRecommendation], list[PoolRecommendation], float | None]:
        with self._lock:
            return list(self._recs), list(self._restarts), self.updated_at

    def snapshot(self) -> dict:
        recs, restarts, at = self.recommendations()
        return {"mode": self.cfg.mode, "updated_at": at, "actuation_errors": self.actuation_errors,
                "recommendations": [rec_json(r) for r in recs],
                "restarts": [rec_json(r) for r in restarts]}


def rec_json(r: PoolRecommendation) -> dict:
    return {"model": r.model, "pool": r.pool, "current": r.current, "desired": r.desired, "action": r.action,
            "reasons": list(r.reasons), "confidence": r.confidence, "numbers": dict(r.numbers)}
