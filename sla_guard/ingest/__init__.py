"""Ingestion: where samples come from. ``scrape`` (embedded mode:
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
    step = parse_duration(r.coarse_step) if r.coarse_step.strip() not in ("0", "0s") else 0.0
    span = parse_duration(r.coarse_duration) if r.coarse_duration.strip() not in ("0", "0s") else 0.0
    return SeriesStore(retention_s=parse_duration(r.duration), slots=r.slots, max_series=r.max_series,
                       max_series_per_group=r.max_series_per_target, max_labels=r.max_labels_per_series,
                       lookback_s=config.staleness_s, coarse_names=long_range_names(),
                       coarse_step_s=step or 60.0, coarse_slots=int(span // step) + 1 if step and span else 0)


def long_range_names() -> frozenset[str]:
    """Sample names worth keeping for many hours at low resolution: process memory (leak
    detection reads RSS over 6-24 h) and the per-engine load gauges it and the advisor set it
    against. ~20 series per engine: 26 h at 5 min is ~50 KB per engine."""
    from exporters import contract as c

    wanted = [c.PROCESS_RSS, c.PROCESS_MEMORY, c.REQUESTS_RUNNING, c.REQUESTS_WAITING, c.KV_CACHE_USAGE]
    return frozenset(m.series() for m in wanted)


def build_source(config: GuardConfig) -> Source:
    """The configured source: the embedded scraper (default) or a Prometheus server."""
    if config.source.mode == "prometheus":
        from sla_guard.ingest.prometheus import PrometheusSourceImpl

        return PrometheusSourceImpl(config.source, stale_after_s=config.staleness_s)
    from sla_guard.ingest.scrape import Scraper

    return Scraper(config.source, build_store(config))
