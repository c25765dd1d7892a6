"""Ingestion: where samples come from. ``parse`` (exposition text), ``scrape`` (embedded mode:
asyncio + httpx against the engines' /metrics), ``discovery`` (static targets and a re-read
targets file), ``prometheus`` (a Prometheus/Thanos/Mimir HTTP API as a MetricsView)."""
