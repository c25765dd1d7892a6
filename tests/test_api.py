"""The HTTP API served by a real uvicorn on 127.0.0.1, spoken to with httpx."""

from __future__ import annotations

import httpx
import pytest
from fastapi import APIRouter, Request
from guard_support import Engine, UvicornThread, drive

from exporters import contract as c
from sla_guard.api import create_app
from sla_guard.config import ConfigError, parse_config
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


_MEAN_ONLY = {"evaluation_interval_s": 15, "staleness_s": 60, "slos": [{"model": "*", "pool": "*", "objectives": [
    {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "window": "5m"}]}]}


def test_pools_beyond_max_pools_make_the_verdict_unknown_not_ok():
    """The SLO evaluator judges at most max_pools (model, pool) pairs. A pool seen once the cap
    was reached (a label bomb filled it, or a model deployed later) was dropped without a word,
    and the overall verdict stayed the judged pools' "ok" while the dropped pool was violated."""
    cfg = parse_config(_MEAN_ONLY)
    ev = SLOEvaluator(cfg, max_pools=2)
    engines = [Engine(model="a"), Engine(model="b")]
    store, ev, t = drive(engines, 300, lambda rng, e: [(0.2, 0.01)] * 3, ev=ev, cfg=cfg)
    engines.append(Engine(model="c"))  # violated, and beyond the cap
    store, ev, t = drive(engines, 300, lambda rng, e: [(9.0 if e.model == "c" else 0.2, 0.01)] * 3,
                         ev=ev, cfg=cfg, store=store, t0=t + 5)
    guard = Guard(cfg, StoreSource(store), [ev], clock=lambda: t)
    srv = UvicornThread(create_app(guard, token=TOKEN))
    try:
        body = httpx.get(f"{srv.url}/v1/slo", headers=_auth()).json()
        assert [(p["model"], p["status"]) for p in body["pools"]] == [("a", "ok"), ("b", "ok")]
        assert body["status"] == "unknown" and body["pools_over_limit"] == 1
        assert "max_pools=2" in body["reason"]
        # a filter may match the unjudged pool too; one pool named exactly and judged is known
        assert httpx.get(f"{srv.url}/v1/slo", headers=_auth(), params={"pool": "decode"}).json()["status"] == "unknown"
        exact = httpx.get(f"{srv.url}/v1/slo", headers=_auth(), params={"model": "a", "pool": "decode"}).json()
        assert exact["status"] == "ok"
    finally:
        srv.stop()


def test_a_forgotten_pool_leaves_metrics():
    """A pool whose data is gone is reported unknown for forget_after_s, then forgotten by the
    API; its series stayed on /metrics for good (guard_slo_status{status="unknown"} 1 for a pool
    the API no longer knows), one set per model ever seen."""
    cfg = parse_config(_MEAN_ONLY)
    ev = SLOEvaluator(cfg, forget_after_s=600)
    store, ev, t = drive([Engine(model="old")], 300, lambda rng, e: [(0.2, 0.01)] * 3, ev=ev, cfg=cfg)
    guard = Guard(cfg, StoreSource(store), [ev], clock=lambda: t)
    srv = UvicornThread(create_app(guard, token=TOKEN))
    try:
        guard.tick(t)
        assert 'model="old"' in httpx.get(f"{srv.url}/metrics").text
        guard.tick(t + 700)  # no data since t, past forget_after_s
        assert httpx.get(f"{srv.url}/v1/slo", headers=_auth()).json()["pools"] == []
        assert 'model="old"' not in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()


@pytest.mark.parametrize("value", ["tok\n", "  tok \r\n"])
def test_a_token_env_with_a_trailing_newline_is_the_token(monkeypatch, value):
    """A Secret written with ``echo`` carries a trailing newline into the variable; no client can
    send a line break in a header, so /v1 answered 401 to everyone. token_file already strips it."""
    monkeypatch.setenv("SLA_GUARD_TEST_API_TOKEN", value)
    cfg = parse_config({"api": {"token_env": "SLA_GUARD_TEST_API_TOKEN"}})
    guard = Guard(cfg, StoreSource(drive([Engine()], 30, lambda rng, e: [(0.2, 0.01)])[0]), [])
    srv = UvicornThread(create_app(guard, token=cfg.api.token()))
    try:
        assert httpx.get(f"{srv.url}/v1/status", headers=_auth("tok")).status_code == 200
        assert httpx.get(f"{srv.url}/v1/status").status_code == 401
    finally:
        srv.stop()


def test_a_token_env_holding_two_lines_is_refused(monkeypatch):
    monkeypatch.setenv("SLA_GUARD_TEST_API_TOKEN", "tok\nother")
    cfg = parse_config({"api": {"token_env": "SLA_GUARD_TEST_API_TOKEN"}})
    with pytest.raises(ConfigError, match=r"api.token_env: \$SLA_GUARD_TEST_API_TOKEN holds more than one line"):
        cfg.api.token()


def test_a_broken_targets_file_shows_in_status_and_metrics(tmp_path):
    """A targets file that cannot be parsed kept the last good list and counted
    ``TargetDiscovery.errors``, but the count and the reason were only logged: ``/v1/status`` and
    ``/metrics`` looked healthy while the guard scraped a stale list. Both carry it now."""
    import asyncio

    from sla_guard.config import ScrapeSource
    from sla_guard.ingest.scrape import Scraper
    from sla_guard.store import SeriesStore

    f = tmp_path / "targets.yaml"
    f.write_text("- targets: '127.0.0.1:1'\n")  # a string, not a list
    scr = Scraper(ScrapeSource(targets_file=f, timeout_s=2), SeriesStore())
    guard = Guard(parse_config({}), scr, [])
    scr.bind_metrics(guard.metrics)
    loop = asyncio.new_event_loop()
    srv = UvicornThread(create_app(guard, token=TOKEN))
    try:
        loop.run_until_complete(scr.collect())
        loop.run_until_complete(scr.collect())  # still broken: read again, counted again
        status = httpx.get(f"{srv.url}/v1/status", headers=_auth()).json()
        disc = status["discovery"]
        assert disc["targets_file"] == str(f) and disc["errors"] == 2 and disc["targets"] == 0
        assert "expected a list" in disc["last_error"]
        text = httpx.get(f"{srv.url}/metrics").text
        assert 'slaguard_guard_scrape_errors_total{kind="discovery",target="targets_file"} 2.0' in text
    finally:
        srv.stop()
        loop.run_until_complete(scr.aclose())
        loop.close()
