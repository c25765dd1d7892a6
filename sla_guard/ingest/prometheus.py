"""Prometheus mode: a ``MetricsView`` answered by PromQL over Prometheus's HTTP API.

For fleets already scraped by Prometheus, Thanos or Mimir: no second scraper, and long windows
(3d, 30d) come straight from the server's retention. Each view method is the PromQL query it
documents, evaluated with ``&time=`` at the evaluation timestamp, so the guard and a dashboard
on the same server see the same numbers.

Failures (unreachable, timeout, 4xx/5xx, a body that is not a Prometheus answer) never raise
into an evaluator: the query returns no data (evaluators then say "unknown"), the error is
counted in ``guard_scrape_errors{target="prometheus",kind}``, and the next query tries again.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping

import httpx
import numpy as np

from exporters import contract as c
from exporters.prometheus import ContractMetrics
from sla_guard import promql
from sla_guard.config import PrometheusSource as PrometheusConfig
from sla_guard.ingest.source import TargetState
from sla_guard.model import Labels, Series

log = logging.getLogger("sla_guard.ingest.prometheus")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(metric: str, matchers: Mapping[str, str], extra: str = "") -> str:
    """``metric{a="x",...}`` with values escaped; ``extra`` is raw matcher text from config."""
    parts = [f'{k}="{_escape(v)}"' for k, v in sorted(matchers.items())]
    if extra:
        parts.append(extra)
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def duration(seconds: float) -> str:
    """A PromQL duration in whole milliseconds (``300000ms``), exact for any window."""
    return f"{round(seconds * 1000)}ms"


class PrometheusError(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


class PrometheusView:
    """MetricsView over one Prometheus-compatible server (synchronous httpx; the guard runs
    evaluators off its event loop)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, token: str | None = None, extra_selector: str = "",
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.extra = extra_selector
        self._client = httpx.Client(timeout=timeout_s, headers=headers, transport=transport)
        self._metrics: ContractMetrics | None = None
        self.errors: dict[str, int] = {}
        self.last_error: str | None = None
        self.last_ok: float | None = None
        self.queries = 0

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self._metrics = metrics

    # -- transport -----------------------------------------------------------------------------
    def query(self, promql: str, at: float) -> dict | None:
        """``/api/v1/query`` at time ``at``; the ``data`` object, or None after counting why."""
        self.queries += 1
        try:
            try:
                r = self._client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
            except httpx.TimeoutException as err:
                raise PrometheusError("timeout", f"Prometheus did not answer in time: {err}") from err
            except httpx.HTTPError as err:
                raise PrometheusError("connect", f"Prometheus unreachable: {type(err).__name__}: {err}") from err
            if r.status_code >= 500:
                raise PrometheusError("http_status", f"Prometheus answered HTTP {r.status_code}")
            try:
                body = r.json()
            except ValueError as err:
                raise PrometheusError("bad_response", f"HTTP {r.status_code}, body is not JSON") from err
            if not isinstance(body, dict) or body.get("status") != "success" or not isinstance(body.get("data"), dict):
                err = body.get("error") if isinstance(body, dict) else None
                raise PrometheusError("query" if r.status_code in (400, 422) else "bad_response",
                                      f"HTTP {r.status_code}: {err or 'unexpected answer'} for {promql}")
        except PrometheusError as err:
            self.errors[err.kind] = self.errors.get(err.kind, 0) + 1
            self.last_error = f"{err.kind}: {err}"
            if self._metrics is not None:
                self._metrics[c.GUARD_SCRAPE_ERRORS].labels("prometheus", err.kind).inc()
            log.warning("%s", err)
            return None
        import time

        self.last_ok = time.time()
        self.last_error = None
        return body["data"]

    def _vector(self, promql: str, at: float) -> dict[Labels, float]:
        data = self.query(promql, at)
        if data is None or data.get("resultType") != "vector":
            return {}
        out: dict[Labels, float] = {}
        for item in data.get("result", []):
            try:
                v = float(item["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if math.isnan(v):
                continue
            metric = {k: x for k, x in item.get("metric", {}).items() if k != "__name__"}
            out[tuple(sorted(metric.items()))] = v
        return out

    # -- MetricsView ---------------------------------------------------------------------------
    def instant(self, metric: str, matchers: Mapping[str, str], at: float) -> dict[Labels, float]:
        """``metric{matchers}`` at ``at``."""
        return self._vector(selector(metric, matchers, self.extra), at)

    def increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                 by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (increase(metric{matchers}[window]))``."""
        sel = selector(metric, matchers, self.extra)
        return self._vector(f"sum by ({','.join(by)}) (increase({sel}[{duration(window_s)}]))", at)

    def rate(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
             by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (rate(metric{matchers}[window]))``."""
        sel = selector(metric, matchers, self.extra)
        return self._vector(f"sum by ({','.join(by)}) (rate({sel}[{duration(window_s)}]))", at)

    def range(self, metric: str, matchers: Mapping[str, str], start: float, end: float) -> list[Series]:
        """Raw samples: the range selector ``metric{matchers}[end-start]`` evaluated at ``end``."""
        data = self.query(f"{selector(metric, matchers, self.extra)}[{duration(end - start)}]", end)
        if data is None or data.get("resultType") != "matrix":
            return []
        out = []
        for item in data.get("result", []):
            vals = item.get("values") or []
            if not vals:
                continue
            metric_l = {k: x for k, x in item.get("metric", {}).items() if k != "__name__"}
            t = np.array([float(p[0]) for p in vals])
            v = np.array([float(p[1]) for p in vals])
            out.append(Series(tuple(sorted(metric_l.items())), t, v))
        return out

    def histogram_quantile(self, q: float, metric: str, matchers: Mapping[str, str], window_s: float,
                           at: float, by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``histogram_quantile(q, sum by (le, by) (rate(metric_bucket{matchers}[window])))``."""
        name = metric if metric.endswith("_bucket") else metric + "_bucket"
        sel = selector(name, matchers, self.extra)
        return self._vector(f"histogram_quantile({q!r}, sum by ({','.join(('le', *by))}) "
                            f"(rate({sel}[{duration(window_s)}])))", at)

    def bucket_increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                        by: tuple[str, ...] = ()) -> dict[Labels, dict[float, float]]:
        """``sum by (le, by) (increase(metric_bucket[window]))`` as {group: {le: count}}."""
        name = metric if metric.endswith("_bucket") else metric + "_bucket"
        return promql.split_le(self.increase(name, matchers, window_s, at, ("le", *by)))

    def close(self) -> None:
        self._client.close()


class PrometheusSourceImpl:
    """``Source`` for the prometheus mode: nothing to collect; ``collect`` checks the server."""

    mode = "prometheus"

    def __init__(self, cfg: PrometheusConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        token = os.environ.get(cfg.bearer_token_env) if cfg.bearer_token_env else None
        self.cfg = cfg
        self.view = PrometheusView(cfg.url, timeout_s=cfg.timeout_s, token=token, extra_selector=cfg.selector,
                                   transport=transport)
        self._checked = False

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self.view.bind_metrics(metrics)

    async def collect(self, now: float) -> None:
        import asyncio

        await asyncio.to_thread(self.view.query, "vector(1)", now)
        self._checked = True

    def targets(self) -> list[TargetState]:
        v = self.view
        return [TargetState("prometheus", v.url, "*", "*", up=v.last_error is None and v.last_ok is not None,
                            last_scrape=v.last_ok, last_error=v.last_error, errors=dict(v.errors))]

    def ready(self) -> bool:
        return self.view.last_ok is not None

    async def aclose(self) -> None:
        self.view.close()
