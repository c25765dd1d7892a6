"""The advisor's autoscaler interfaces over real HTTP: a uvicorn server on a loopback port serving
the FastAPI app with the advisor router (bearer auth), polled with httpx the way KEDA's
metrics-api scaler polls it, plus the desired-replicas gauges on ``/metrics`` (what
prometheus-adapter would scrape for HPA External metrics)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.parser import text_string_to_metric_families
from scale_support import MODEL, Engine
from scale_support import run as _run
from scale_support import store as _store

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics
from sla_guard.scale.api import advisor_router
from sla_guard.scale.config import parse_advisor
from sla_guard.scale.evaluator import AdvisorEvaluator

TOKEN = "t0ken"


def gjson_get(doc: dict, path: str):
    """The subset of GJSON KEDA's ``valueLocation`` uses here: dot-separated keys."""
    cur = doc
    for part in path.split("."):
        cur = cur[part]
    return cur


@contextmanager
def uvicorn_server(app) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(10)


@pytest.fixture()
def served():
    reg = CollectorRegistry()
    cfg = parse_advisor({"profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01,
                                     "decode_step_per_request_s": 0.0002}})
    ev = AdvisorEvaluator(cfg, model=MODEL, metrics=ContractMetrics(reg, components=[Component.GUARD]))
    app = FastAPI()
    app.include_router(advisor_router(ev, token=lambda: TOKEN))
    app.mount("/metrics", make_asgi_app(registry=reg))
    with uvicorn_server(app) as url:
        yield url, ev


def _evaluate_under_prefill_pressure(ev: AdvisorEvaluator) -> None:
    store = _store()
    engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    _run(engines, store, 1000, 1060, p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})
    ev.evaluate(store, 1060)


def test_keda_metrics_api_endpoint(served):
    url, ev = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=5) as h:
        assert h.get("/v1/scale/keda").status_code == 401
        assert h.get("/v1/scale/keda", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # before the first evaluation: 503, so KEDA keeps the current size instead of acting on nothing
        assert h.get("/v1/scale/keda", headers=auth).status_code == 503
        _evaluate_under_prefill_pressure(ev)
        doc = h.get("/v1/scale/keda", headers=auth).json()
        desired = gjson_get(doc, "pools.prefill.desired")  # the documented valueLocation
        assert isinstance(desired, int) and desired > gjson_get(doc, "pools.prefill.current")
        flat = h.get("/v1/scale/keda/prefill", headers=auth).json()
        assert gjson_get(flat, "desired") == desired
        assert h.get("/v1/scale/keda/nope", headers=auth).status_code == 404
        recs = h.get("/v1/recommendations", headers=auth).json()["models"][0]
        pre = next(r for r in recs["recommendations"] if r["pool"] == "prefill")
        assert pre["desired"] == desired and pre["reasons"] and 0 <= pre["confidence"] <= 1
        assert "demand_uncached_tokens_per_s" in pre["numbers"]


def test_desired_replicas_gauges_on_metrics(served):
    url, ev = served
    _evaluate_under_prefill_pressure(ev)
    text = httpx.get(url + "/metrics/", timeout=5).text
    values = {(s.name, s.labels.get("pool")): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.labels.get("model") == MODEL}
    desired = values[(c.GUARD_DESIRED_REPLICAS.series(), "prefill")]
    current = values[(c.GUARD_CURRENT_REPLICAS.series(), "prefill")]
    assert desired > current == 1
    assert (c.GUARD_DESIRED_REPLICAS.series(), "decode") in values
