"""The advisor's autoscaler interfaces over real HTTP: the guard's own FastAPI app
(``sla_guard.api.create_app``) with the advisor mounted by its ``serve`` extension, served by
uvicorn on a loopback port with bearer auth, polled with httpx the way KEDA's metrics-api scaler
polls it; plus the desired-replicas gauges on the guard's ``/metrics`` (what prometheus-adapter
scrapes for HPA External metrics). The KEDA manifest's ``valueLocation`` is read from
deploy/k8s and resolved against the live response, so docs and code cannot drift apart."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from prometheus_client.parser import text_string_to_metric_families
from scale_support import MODEL, Engine
from scale_support import run as _run
from scale_support import store as _store

from exporters import contract as c
from sla_guard.api import create_app
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.ingest.source import StoreSource

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


class Served:
    def __init__(self, url: str, guard, store) -> None:
        self.url, self.guard, self.store = url, guard, store


@pytest.fixture()
def served():
    config = parse_config({"advisor": {"model": MODEL, "profile": {
        "prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01, "decode_step_per_request_s": 0.0002}}})
    store = _store()
    root = compose(config, source=StoreSource(store), slo=False, detectors=False)
    guard = root.guard
    app = create_app(guard, token=TOKEN, extra_routers=root.routers)
    with uvicorn_server(app) as url:
        yield Served(url, guard, store)


def _evaluate_under_prefill_pressure(s: Served) -> None:
    engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    _run(engines, s.store, 1000, 1060, p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})
    tick = s.guard.tick(1060)
    assert not tick.errors


def manifest_value_locations() -> dict[str, str]:
    docs = yaml.safe_load_all((Path(__file__).parent.parent / "deploy/k8s/keda-scaledobject.yaml").read_text())
    out = {}
    for d in docs:
        if d and d.get("kind") == "ScaledObject":
            for trig in d["spec"]["triggers"]:
                assert trig["type"] == "metrics-api" and trig["metadata"]["targetValue"] == "1"
                out[d["metadata"]["name"]] = trig["metadata"]["valueLocation"]
    return out


def test_keda_metrics_api_endpoint(served):
    url = served.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=5) as h:
        assert h.get("/v1/scale/keda").status_code == 401
        assert h.get("/v1/scale/keda", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # before the first evaluation: 503, so KEDA keeps the current size instead of acting on nothing
        assert h.get("/v1/scale/keda", headers=auth).status_code == 503
        _evaluate_under_prefill_pressure(served)
        doc = h.get("/v1/scale/keda", headers=auth).json()
        locations = manifest_value_locations()
        desired = gjson_get(doc, locations["glm-prefill"])  # the valueLocation the manifest documents
        assert locations["glm-prefill"] == "pools.prefill.desired"
        assert isinstance(desired, int) and desired > gjson_get(doc, "pools.prefill.current")
        assert isinstance(gjson_get(doc, locations["glm-decode"]), int)
        flat = h.get("/v1/scale/keda/prefill", headers=auth).json()
        assert gjson_get(flat, "desired") == desired
        assert h.get("/v1/scale/keda/nope", headers=auth).status_code == 404
        recs = h.get("/v1/recommendations", headers=auth).json()["models"][0]
        pre = next(r for r in recs["recommendations"] if r["pool"] == "prefill")
        assert pre["desired"] == desired and pre["reasons"] and 0 <= pre["confidence"] <= 1
        assert "demand_uncached_tokens_per_s" in pre["numbers"]


def test_desired_replicas_gauges_on_metrics(served):
    _evaluate_under_prefill_pressure(served)
    text = httpx.get(served.url + "/metrics", timeout=5).text
    values = {(s.name, s.labels.get("pool")): s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.labels.get("model") == MODEL}
    desired = values[(c.GUARD_DESIRED_REPLICAS.series(), "prefill")]
    current = values[(c.GUARD_CURRENT_REPLICAS.series(), "prefill")]
    assert desired > current == 1
    assert (c.GUARD_DESIRED_REPLICAS.series(), "decode") in values
    # the HPA manifest selects exactly this contract metric
    hpa = [d for d in yaml.safe_load_all((Path(__file__).parent.parent / "deploy/k8s/hpa-external.yaml").read_text())]
    assert {d["spec"]["metrics"][0]["external"]["metric"]["name"] for d in hpa} == {c.GUARD_DESIRED_REPLICAS.name}


def test_a_pool_without_data_gets_no_number_keda_or_hpa_could_follow(served):
    """Once the engines stop answering, the advisor has nothing to size on and holds; its hold
    counts the replicas the view still shows, 0 once every series is gone. Served as a number,
    KEDA (targetValue 1) and HPA (AverageValue 1) would scale both pools to their minimum on a
    network partition. So the KEDA answer is a 503 (KEDA keeps the size, or its fallback) and the
    replica gauges leave /metrics (HPA holds without a metric) until data comes back."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _evaluate_under_prefill_pressure(served)
    assert not served.guard.tick(1060 + 900).errors  # nothing scraped for 15 minutes
    recs = served.guard.evaluator("advisor").recommendations()[0]
    assert recs and all(r.reasons[0] in ("hold_missing_data", "hold_stale_data") for r in recs)
    with httpx.Client(base_url=served.url, timeout=5) as h:
        r = h.get("/v1/scale/keda", headers=auth)
        assert r.status_code == 503 and "no data" in r.text
        assert h.get("/v1/scale/keda/prefill", headers=auth).status_code == 503
        assert h.get("/v1/scale/keda/nope", headers=auth).status_code == 404
        text = h.get("/metrics").text
    names = {(s.name, s.labels.get("model")) for f in text_string_to_metric_families(text) for s in f.samples}
    assert (c.GUARD_DESIRED_REPLICAS.series(), MODEL) not in names
    assert (c.GUARD_CURRENT_REPLICAS.series(), MODEL) not in names
    # data back: the number is back
    _run([Engine("prefill", "p0"), Engine("decode", "d0")], served.store, 1060 + 905, 1060 + 965,
         p0={"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0},
         d0={"running": 10, "waiting": 0, "steps": 400})
    assert not served.guard.tick(1060 + 965).errors
    with httpx.Client(base_url=served.url, timeout=5) as h:
        assert isinstance(h.get("/v1/scale/keda/prefill", headers=auth).json()["desired"], int)
        assert c.GUARD_DESIRED_REPLICAS.series() in h.get("/metrics").text


def test_a_frozen_guard_stops_serving_its_last_number(served):
    """The watchdog turned the SLO verdicts unknown once no tick completed within staleness_s,
    but the advisor kept its last recommendation: KEDA (polling /v1/scale/keda) and HPA (the
    desired-replicas gauge through prometheus-adapter) followed a frozen guard's number for as
    long as it stayed frozen. Now every pool is a stale hold: 503 to KEDA, no gauge for HPA, the
    reason in /v1/recommendations; the next completed tick brings the number back."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _evaluate_under_prefill_pressure(served)
    with httpx.Client(base_url=served.url, timeout=5) as h:
        assert h.get("/v1/scale/keda/prefill", headers=auth).status_code == 200
        staleness = served.guard.config.staleness_s
        assert not served.guard.expire_if_stale(1060 + staleness / 2)  # fresh: nothing changes
        assert h.get("/v1/scale/keda/prefill", headers=auth).status_code == 200
        assert served.guard.expire_if_stale(1060 + staleness + 1)  # what the watchdog does
        r = h.get("/v1/scale/keda", headers=auth)
        assert r.status_code == 503 and "hold_stale_data" in r.text, r.text
        assert h.get("/v1/scale/keda/decode", headers=auth).status_code == 503
        recs = h.get("/v1/recommendations", headers=auth).json()["models"][0]["recommendations"]
        assert {r["pool"] for r in recs} == {"prefill", "decode"}
        for rec in recs:
            assert rec["action"] == "hold" and rec["desired"] == rec["current"] and rec["confidence"] == 0
            assert rec["reasons"][0] == "hold_stale_data" and "verdict is stale" in rec["reasons"][1]
        samples = {s.name for f in text_string_to_metric_families(h.get("/metrics").text) for s in f.samples}
        assert c.GUARD_DESIRED_REPLICAS.series() not in samples and c.GUARD_CURRENT_REPLICAS.series() not in samples
        _run([Engine("prefill", "p0"), Engine("decode", "d0")], served.store, 1060 + 905, 1060 + 965,
             p0={"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0},
             d0={"running": 10, "waiting": 0, "steps": 400})
        assert not served.guard.tick(1060 + 965).errors
        assert isinstance(h.get("/v1/scale/keda/prefill", headers=auth).json()["desired"], int)
        assert c.GUARD_DESIRED_REPLICAS.series() in h.get("/metrics").text


def test_a_failing_advisor_stops_serving_its_last_number(served, monkeypatch):
    """An advisor that raised on every tick (an +Inf running-requests gauge did, see below) kept its
    last advice: the guard isolates the failure and its ticks complete, so the staleness watchdog
    never fired, and KEDA (and HPA, through the gauge) followed the number of the last tick that
    worked for as long as the advisor failed. A failed evaluation now expires the advice: 503, no
    gauge, the error in /v1/recommendations; the next good tick brings the number back. The
    failure is injected (a raising evaluate), since every failure the test found is fixed."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _evaluate_under_prefill_pressure(served)
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    adv = served.guard.evaluator("advisor")
    with httpx.Client(base_url=served.url, timeout=5) as h:
        assert h.get("/v1/scale/keda/prefill", headers=auth).status_code == 200
        _run([Engine("prefill", "p0"), Engine("decode", "d0")], served.store, 1065, 1120,
             p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})

        def boom(view, now):
            raise OverflowError("cannot convert float infinity to integer")

        monkeypatch.setattr(adv, "evaluate", boom)
        assert "advisor" in served.guard.tick(1120).errors
        r = h.get("/v1/scale/keda/prefill", headers=auth)
        assert r.status_code == 503, r.text
        recs = h.get("/v1/recommendations", headers=auth).json()["models"][0]["recommendations"]
        assert all(r["reasons"][0] == "hold_stale_data" and "evaluator advisor failed" in r["reasons"][1]
                   for r in recs)
        samples = {s.name for f in text_string_to_metric_families(h.get("/metrics").text) for s in f.samples}
        assert c.GUARD_DESIRED_REPLICAS.series() not in samples
        monkeypatch.undo()
        _run([Engine("prefill", "p0"), Engine("decode", "d0")], served.store, 1125, 1185,
             p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})
        assert not served.guard.tick(1185).errors
        assert isinstance(h.get("/v1/scale/keda/prefill", headers=auth).json()["desired"], int)


def test_an_infinite_running_gauge_is_no_reading_not_an_advisor_failure(served):
    """An engine reporting +Inf running requests made the advisor raise OverflowError on every
    tick (math.ceil of an infinite demand). Such a gauge is now no reading, as a missing sample is:
    the advisor goes on, and the prefill pool's advice still comes from prefill's own data."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _evaluate_under_prefill_pressure(served)
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    _run([Engine("prefill", "p0"), Engine("decode", "d0")], served.store, 1065, 1120,
         p0=busy, d0={"running": float("inf"), "waiting": 0, "steps": 400})
    assert not served.guard.tick(1120).errors
    r = httpx.get(served.url + "/v1/scale/keda/prefill", headers=auth, timeout=5)
    assert r.status_code == 200 and isinstance(r.json()["desired"], int)


@pytest.mark.parametrize(("limit", "says"), [("-5", "greater than or equal to 1"), ("0", "greater than or equal to 1"),
                                              ("1000", "less than or equal to 256"), ("x", "valid integer")])
def test_decisions_limit_out_of_range_is_an_error_naming_it(served, limit, says):
    """limit was clamped silently: -5 and 0 answered one decision, 1000 answered 256."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _evaluate_under_prefill_pressure(served)
    r = httpx.get(served.url + "/v1/decisions", headers=auth, params={"limit": limit}, timeout=5)
    assert r.status_code == 422 and "query.limit" in r.json()["error"]["message"] and says in r.text, r.text
    ok = httpx.get(served.url + "/v1/decisions", headers=auth, params={"limit": "1"}, timeout=5).json()
    assert len(ok["decisions"]) == 1
