"""Shared types between ingestion, evaluators (SLOs, detectors, advisor) and outputs.

``MetricsView`` is the one query interface both ingestion modes implement (the embedded
scrape store and a Prometheus server); evaluators only ever see it, so they run unchanged on
a laptop, against a fleet's Prometheus, or in the simulator's offline replay.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

import numpy as np

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, hashable


def labels_of(d: Mapping[str, str]) -> Labels:
    return tuple(sorted(d.items()))


T = TypeVar("T")

PAGE_MAX = 1000  # the largest page the API gives: a bound on every answer's size and memory


def page(items: Iterable[T], limit: int, after: str | None = None, key: Callable[[T], str] = str
         ) -> tuple[list[T], str | None]:
    """The ``limit`` first of ``items`` by ``key`` past the key ``after``, and the cursor of the
    next page (the last key given; None when there is no more). A whole fleet's entries (4,000
    processes, 5,000 findings) in one answer were megabytes, and 50 clients asking at once held
    400 MiB; one page is bounded. ``items`` is read once (pass a copy of what the tick thread
    writes: ``list(d.items())`` is taken whole under the GIL)."""
    chosen = heapq.nsmallest(limit + 1, (x for x in items if after is None or key(x) > after), key=key)
    if len(chosen) <= limit:
        return chosen, None
    chosen = chosen[:limit]
    return chosen, key(chosen[-1])


def page_map(d: Mapping[str, T], limit: int | None, after: str | None, what: str) -> tuple[dict[str, T], dict]:
    """``page`` over a snapshot's per-process or per-group map: the page, and what to add to the
    snapshot when entries were left out (``<what>_total`` and ``next``); nothing is added when
    all fit, so a small deployment's answer is as before."""
    items = list(d.items())
    if limit is None and after is None:
        return dict(items), {}
    got, nxt = page(items, PAGE_MAX if limit is None else limit, after, key=lambda kv: kv[0])
    extra: dict = {}
    if nxt is not None or after is not None:
        extra[f"{what}_total"] = len(items)
    if nxt is not None:
        extra["next"] = nxt
    return dict(got), extra


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
                        by: tuple[str, ...], les: tuple[float, ...] = ()) -> dict[Labels, dict[float, float]]:
        """sum by (le, by) (increase(metric_bucket[window])) as {group: {le: count}}; ``les``: the
        bounds the caller needs besides +Inf, a hint a view may use to leave the others out (an
        attainment needs two of a histogram's ~20, and over 30 days Prometheus reads every sample
        of each bucket selected)."""
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
    # the key of the leak finding a rolling_restart comes from (its page key, with the model); None otherwise
    finding: str | None = None


class Evaluator(Protocol):
    """One thing the guard runs every evaluation tick (SLO evaluator, a detector, the advisor).

    ``evaluate`` must not raise for bad or missing data (it reports UNKNOWN / holds instead);
    the guard still catches, counts and logs anything that escapes, and goes on."""

    name: str

    def evaluate(self, view: MetricsView, now: float) -> None: ...

    def snapshot(self) -> dict:
        """JSON-able current state, served by the API and used by `check`/`demo`."""
        ...


def jsonable(obj):
    """Replace non-finite floats by None (JSON has no NaN) and enums by their values."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
