"""Ingestion: where samples come from. ``parse`` (exposition text), ``scrape`` (embedded mode:
asyncio + httpx against the engines' /metrics), ``discovery`` (static targets and a re-read
targets file), ``prometheus`` (a Prometheus/Thanos/Mimir HTTP API as a MetricsView)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sla_guard.config import GuardConfig
    from sla_guard.ingest.source import Source


def build_store(config: GuardConfig):
    """The embedded store sized from ``config.retention``."""
    from sla_guard.config import parse_duration
    from sla_guard.store import SeriesStore

    r = config.retention
    return SeriesStore(retention_s=parse_duration(r.duration), slots=r.slots, max_series=r.max_series,
                       max_series_per_group=r.max_series_per_target, max_labels=r.max_labels_per_series,
                       lookback_s=config.staleness_s)


def build_source(config: GuardConfig) -> Source:
    """The configured source: the embedded scraper (default) or a Prometheus server."""
    if config.source.mode == "prometheus":
        from sla_guard.ingest.prometheus import PrometheusSourceImpl

        return PrometheusSourceImpl(config.source)
    from sla_guard.ingest.scrape import Scraper

    return Scraper(config.source, build_store(config))
