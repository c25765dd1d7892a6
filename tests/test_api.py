"""The HTTP API served by a real uvicorn on 127.0.0.1, spoken to with httpx."""

from __future__ import annotations

import httpx
import pytest
from fastapi import APIRouter, Request
from guard_support import Engine, UvicornThread, drive

from exporters import contract as c
from sla_guard.api import create_app
from sla_guard.config import parse_config
from sla_guard.ingest.source import StoreSource
from sla_guard.service import Guard
from sla_guard.slo import SLOEvaluator

TOKEN = "s3cret-token"


@pytest.fixture
def api():
    cfg = parse_config({})
    engines = [Engine(pool="prefill"), Engine(pool="decode")]
    store, _ev, t = drive(engines, 300, lambda rng, e: [(3.5 if e.pool == "prefill" else 0.2, 0.01)] * 2)
    guard = Guard(cfg, StoreSource(store), [], clock=lambda: t)  # simulated time: verdicts are fresh
    guard.add_evaluator(SLOEvaluator(cfg))
    extra = APIRouter(prefix="/v1")

    @extra.get("/findings")
    def findings():
        return {"findings": []}

    @extra.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    app = create_app(guard, token=TOKEN, extra_routers=[extra], max_body_bytes=2048)
    srv = UvicornThread(app)
    yield guard, srv.url, t
    srv.stop()


def _auth(tok=TOKEN):
    return {"Authorization": f"Bearer {tok}"}


def test_probes_and_metrics_are_open(api):
    guard, url, t = api
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    r = httpx.get(f"{url}/readyz")
    assert r.status_code == 503 and r.json()["error"]["status"] == 503
    guard.tick(t)
    assert httpx.get(f"{url}/readyz").status_code == 200
    m = httpx.get(f"{url}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert c.GUARD_EVAL_DURATION.name in m.text
    assert f'{c.GUARD_SLO_STATUS.name}{{model="m",pool="prefill",slo="ttft_mean",status="violated"}} 1.0' in m.text


@pytest.mark.parametrize("path", ["/v1/status", "/v1/slo", "/v1/targets", "/v1/findings"])
def test_v1_routes_need_the_bearer_token(api, path):
    _, url, _ = api
    for headers in ({}, _auth("wrong"), {"Authorization": f"Basic {TOKEN}"}):
        r = httpx.get(url + path, headers=headers)
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["message"] == "missing or wrong bearer token" or r.json()["error"]["status"] == 401
    assert httpx.get(url + path, headers=_auth()).status_code == 200


def test_slo_status_and_targets_content(api):
    guard, url, t = api
    guard.tick(t)
    body = httpx.get(f"{url}/v1/slo", headers=_auth(), params={"pool": "prefill"}).json()
    assert body["status"] == "violated"
    assert [p["pool"] for p in body["pools"]] == ["prefill"]
    slo = {s["slo"]: s for s in body["pools"][0]["slos"]}
    assert slo["ttft_mean"]["status"] == "violated" and slo["ttft_mean"]["value"] == pytest.approx(3.5)
    # a filter's status is the status of what it selected: decode alone is not prefill's
    # "violated", and a misspelt model (nothing judged) is "unknown", never the others' status
    decode = httpx.get(f"{url}/v1/slo", headers=_auth(), params={"pool": "decode"}).json()
    assert decode["status"] == decode["pools"][0]["status"] != "violated"
    typo = httpx.get(f"{url}/v1/slo", headers=_auth(), params={"model": "typo"}).json()
    assert typo == {**typo, "status": "unknown", "pools": []}
    assert httpx.get(f"{url}/v1/slo", headers=_auth()).json()["status"] == "violated"
    status = httpx.get(f"{url}/v1/status", headers=_auth()).json()
    assert status["ticks"] == 1 and status["store"]["series"] > 0
    assert status["evaluators"]["slo"]["status"] == "violated"
    assert httpx.get(f"{url}/v1/targets", headers=_auth()).json() == {"source": "store", "targets": []}


def test_errors_are_json_and_bodies_are_limited(api):
    _, url, _ = api
    r = httpx.get(f"{url}/v1/nope", headers=_auth())
    assert r.status_code == 404 and r.json()["error"]["status"] == 404
    assert httpx.post(f"{url}/v1/echo", headers=_auth(), content=b"x" * 100).json() == {"bytes": 100}
    r = httpx.post(f"{url}/v1/echo", headers=_auth(), content=b"x" * 5000)
    assert r.status_code == 413 and "2048" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: limited while streaming
        for _ in range(10):
            yield b"y" * 1000

    r = httpx.post(f"{url}/v1/echo", headers=_auth(), content=chunks())
    assert r.status_code == 413


def test_openapi_docs_served(api):
    _, url, _ = api
    spec = httpx.get(f"{url}/openapi.json").json()
    for p in ("/healthz", "/readyz", "/metrics", "/v1/status", "/v1/slo", "/v1/targets", "/v1/findings"):
        assert p in spec["paths"]
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    assert httpx.get(f"{url}/docs").status_code == 200


def test_a_non_ascii_token_sent_as_utf8_is_accepted():
    """api.token_file is read as UTF-8 and clients (curl) send the token's UTF-8 bytes; Starlette
    decodes headers as latin-1, so comparing the decoded text re-encoded as UTF-8 refused the
    right token forever."""
    token = "pässwort-ü"
    guard = Guard(parse_config({}), StoreSource(drive([Engine()], 30, lambda rng, e: [(0.2, 0.01)])[0]), [])
    srv = UvicornThread(create_app(guard, token=token))
    try:
        r = httpx.get(f"{srv.url}/v1/status", headers=[(b"Authorization", b"Bearer " + token.encode())])
        assert r.status_code == 200, r.text
        wrong = "pässwort-x".encode()
        assert httpx.get(f"{srv.url}/v1/status", headers=[(b"Authorization", b"Bearer " + wrong)]).status_code == 401
    finally:
        srv.stop()
