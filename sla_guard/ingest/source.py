"""The one interface the Guard reads data through, whatever the ingestion mode.

A ``Source`` owns a ``MetricsView`` (``.view``) and knows how to refresh it (``collect``): the
embedded scraper scrapes every target into its ``SeriesStore``; the Prometheus source has
nothing to collect (Prometheus scrapes) and only checks the server; ``StoreSource`` wraps a
store that someone else fills -- the simulator's offline replay, tests, benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from exporters.prometheus import ContractMetrics
from sla_guard.model import MetricsView
from sla_guard.store import SeriesStore

# Prometheus's synthetic per-target health series; the embedded scraper writes it too, with the
# target's model and pool labels, so evaluators judge target health the same way in both modes.
UP = "up"


@dataclass(slots=True)
class TargetState:
    """What /v1/targets shows about one target (JSON-able through ``dataclasses.asdict``)."""

    name: str
    url: str
    model: str
    pool: str
    up: bool = False
    last_scrape: float | None = None
    last_duration_s: float | None = None
    last_error: str | None = None
    samples: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Source(Protocol):
    view: MetricsView
    mode: str

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        """Called once by whoever builds the guard: export source health on the guard's metrics."""
        ...

    async def collect(self, now: float) -> None:
        """Refresh the view for time ``now`` (scrape all targets once); never raises for a
        target's failure (it is counted and shown in ``targets()``)."""
        ...

    def targets(self) -> list[TargetState]: ...

    def ready(self) -> bool:
        """True once the source has data to judge (first scrape round done / server reachable)."""
        ...

    async def aclose(self) -> None: ...


class StoreSource:
    """A store filled from outside (simulator replay, tests): collect() does nothing."""

    mode = "store"

    def __init__(self, store: SeriesStore) -> None:
        self.store = store
        self.view = store

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        return None  # nothing of its own to report: the store is filled from outside

    async def collect(self, now: float) -> None:
        return None

    def targets(self) -> list[TargetState]:
        return []

    def ready(self) -> bool:
        return self.store.series_count() > 0

    async def aclose(self) -> None:
        return None
