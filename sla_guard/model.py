"""Shared types between ingestion, evaluators (SLOs, detectors, advisor) and outputs.

``MetricsView`` is the one query interface both ingestion modes implement (the embedded
scrape store and a Prometheus server); evaluators only ever see it, so they run unchanged on
a laptop, against a fleet's Prometheus, or in the simulator's offline replay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, hashable


def labels_of(d: Mapping[str, str]) -> Labels:
    return tuple(sorted(d.items()))


class Status(StrEnum):
    OK = "ok"
    AT_RISK = "at_risk"
    VIOLATED = "violated"
    UNKNOWN = "unknown"  # stale, missing, too few samples or unreachable: never "ok"


@dataclass(frozen=True, slots=True)
class Series:
    labels: Labels
    t: np.ndarray  # float64 unix seconds, ascending
    v: np.ndarray  # float64

    def label(self, name: str, default: str = "") -> str:
        return dict(self.labels).get(name, default)


class MetricsView(Protocol):
    """PromQL-equivalent queries. ``matchers`` are exact label matches; ``by`` groups
    (sum by) the result. Every method returns an empty mapping when there is no data, never
    zero-filled values; evaluators turn absence into Status.UNKNOWN.

    Implemented by ``SeriesStore`` (the embedded store), ``PrometheusView`` and ``LifetimeView``
    (one-shot ``check``); evaluators read nothing else and probe nothing, except that the leak
    evaluator reads a subset of the series where the view can (``SeriesStore.last_times`` and
    ``range(..., where=)``; ``evaluators.reads_subsets``)."""

    # True when ``increase`` answers any window up to an SLO period itself (Prometheus's
    # retention; a lifetime view's "since start"); False for the bounded embedded store, whose
    # long windows the SLO evaluator keeps in its own ledger fed by ``counter_delta``
    serves_long_windows: bool
    # what a window means when it is not the configured one (e.g. "since engine start"), else None
    window_label: str | None
    # the source's last failure, said in reasons when data is missing; None when it answers
    last_error: str | None

    def instant(self, metric: str, matchers: Mapping[str, str], at: float) -> dict[Labels, float]:
        """Latest sample of each series within the staleness window before ``at``."""
        ...

    def increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                 by: tuple[str, ...]) -> dict[Labels, float]:
        """sum by (by) (increase(metric[window])) with counter resets and extrapolation."""
        ...

    def range(self, metric: str, matchers: Mapping[str, str], start: float, end: float) -> list[Series]:
        """Raw samples of each matching series in [start, end]."""
        ...

    def histogram_quantile(self, q: float, metric: str, matchers: Mapping[str, str], window_s: float,
                           at: float, by: tuple[str, ...]) -> dict[Labels, float]:
        """histogram_quantile(q, sum by (le, by) (rate(metric_bucket[window])))."""
        ...

    def bucket_increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                        by: tuple[str, ...]) -> dict[Labels, dict[float, float]]:
        """sum by (le, by) (increase(metric_bucket[window])) as {group: {le: count}}."""
        ...

    def counter_delta(self, metric: str, matchers: Mapping[str, str], t0: float, t1: float,
                      by: tuple[str, ...]) -> dict[Labels, float]:
        """Summed growth between t0 and t1; exact (consecutive intervals add up, no
        extrapolation) where ``serves_long_windows`` is False, else ``increase`` over t1 - t0."""
        ...


@dataclass(slots=True)
class Finding:
    """Something a detector found. ``key`` deduplicates: the same key updates one finding."""

    detector: str  # "leak", "acceptance_drift", "prefix_hit_drift", "tpot_drift", ...
    key: str
    severity: str  # "warning" | "critical"
    summary: str
    labels: dict[str, str]  # model, pool, instance, process, ...
    details: dict[str, float | str | None] = field(default_factory=dict)
    opened_at: float = 0.0
    updated_at: float = 0.0
    resolved_at: float | None = None

    @property
    def open(self) -> bool:
        return self.resolved_at is None


@dataclass(slots=True)
class PoolRecommendation:
    model: str
    pool: str
    current: int
    desired: int
    reasons: list[str]
    confidence: float
    numbers: dict[str, float] = field(default_factory=dict)
    action: str = "scale"  # "scale" | "hold" | "rolling_restart"
    # the replica (engine, else instance, else process) a rolling_restart is for; None otherwise
    replica: str | None = None


class Evaluator(Protocol):
    """One thing the guard runs every evaluation tick (SLO evaluator, a detector, the advisor).

    ``evaluate`` must not raise for bad or missing data (it reports UNKNOWN / holds instead);
    the guard still catches, counts and logs anything that escapes, and goes on."""

    name: str

    def evaluate(self, view: MetricsView, now: float) -> None: ...

    def snapshot(self) -> dict:
        """JSON-able current state, served by the API and used by `check`/`demo`."""
        ...
