"""The HTTP API served by a real uvicorn on 127.0.0.1, spoken to with httpx."""

from __future__ import annotations

import httpx
import pytest
from fastapi import APIRouter, Request
from guard_support import Engine, UvicornThread, drive

from exporters import contract as c
from sla_guard.api import create_app
from sla_guard.config import ConfigError, parse_config
from sla_guard.ingest.source import StoreSource, TargetState
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


# --- bounded answers at fleet scale ----------------------------------------------------------------

class _Fleet(StoreSource):
    """The store source with ``n`` scrape targets' states, as a scraper of ``n`` engines shows."""

    def __init__(self, n: int) -> None:
        from sla_guard.store import SeriesStore

        super().__init__(SeriesStore())
        self._t = [TargetState(f"engine-{i:04d}", f"http://10.0.0.{i % 250}:{8000 + i}/metrics", "m", "decode", up=True)
                   for i in range(n)]

    def targets(self) -> list[TargetState]:
        return list(self._t)


@pytest.fixture
def fleet():
    """A guard composed as ``serve`` composes it, whose state is a big deployment's, built in the
    real evaluators and book: 1,100 targets, 1,200 open findings, 150 processes' leak verdicts."""
    from sla_guard.compose import compose
    from sla_guard.detect import leak

    comp = compose(parse_config({}), source=_Fleet(1100), clock=lambda: 1e9)
    for i in range(1200):
        comp.findings.raise_("leak", f"leak/e{i:04d}", "warning", "RSS grows", {"model": "m", "pool": "decode"},
                             {"slope_mib_per_h": 12.0}, 1e9)
    lk = comp.guard.evaluator("leak")
    for i in range(150):
        lk.verdicts[f"m/decode/e{i:03d}/worker/1"] = leak.LeakVerdict("ok", "no growth")
    srv = UvicornThread(create_app(comp.guard, token=TOKEN, extra_routers=comp.routers))
    yield srv.url
    srv.stop()


def _pages(url: str, path: str, field: str, params: dict) -> list:
    """Every page of ``path`` by its ``next`` cursor: the ``field`` list (or map) of each."""
    out = []
    while True:
        r = httpx.get(url + path, headers=_auth(), params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        out.append(body)
        if "next" not in body:
            return out
        params = {**params, "after": body["next"]}


def test_findings_are_paged_and_every_one_is_reached(fleet):
    """``/v1/findings`` answered every matching finding at once: 5,000 open findings were a 2 MB
    answer (50 clients asking held hundreds of MiB). A page is at most 1,000 now; ``count``
    is all that match, ``next`` the cursor to the rest, and a limit past the maximum is a 422."""
    pages = _pages(fleet, "/v1/findings", "findings", {})
    assert [len(p["findings"]) for p in pages] == [1000, 200]
    assert all(p["count"] == 1200 for p in pages)
    keys = [f["key"] for p in pages for f in p["findings"]]
    assert len(set(keys)) == 1200 and keys == sorted(keys)
    small = _pages(fleet, "/v1/findings", "findings", {"limit": 500})
    assert [len(p["findings"]) for p in small] == [500, 500, 200]
    r = httpx.get(f"{fleet}/v1/findings", headers=_auth(), params={"limit": 10**9})
    assert r.status_code == 422 and "query.limit" in r.json()["error"]["message"]
    # a filter that fits one page is answered as before: no cursor
    one = httpx.get(f"{fleet}/v1/findings", headers=_auth(), params={"detector": "leak", "limit": 1000,
                                                                      "after": keys[-5]}).json()
    assert one["count"] == 1200 and len(one["findings"]) == 4 and "next" not in one


def test_status_and_targets_are_bounded(fleet):
    """``/v1/status`` held every evaluator's per-process and per-group map whole (1,000 engines:
    3 MB, half a second of the event loop per request) and ``/v1/targets`` every target. Each map
    of ``/v1/status`` is 100 entries by default now (``processes_total`` and ``next`` say when
    more; ``evaluator=&after=`` pages one), ``/v1/targets`` 1,000 a page."""
    st = httpx.get(f"{fleet}/v1/status", headers=_auth()).json()
    leak_snap = st["evaluators"]["leak"]
    assert len(leak_snap["processes"]) == 100 and leak_snap["processes_total"] == 150
    pages = _pages(fleet, "/v1/status", "evaluators", {"evaluator": "leak", "limit": 60})
    assert all(list(p["evaluators"]) == ["leak"] for p in pages)
    procs = [k for p in pages for k in p["evaluators"]["leak"]["processes"]]
    assert [len(p["evaluators"]["leak"]["processes"]) for p in pages] == [60, 60, 30]
    assert len(set(procs)) == 150
    r = httpx.get(f"{fleet}/v1/status", headers=_auth(), params={"evaluator": "nope"})
    assert r.status_code == 404 and "'leak'" in r.json()["error"]["message"]
    assert httpx.get(f"{fleet}/v1/status", headers=_auth(), params={"after": "x"}).status_code == 400
    assert httpx.get(f"{fleet}/v1/status", headers=_auth(), params={"limit": 10**9}).status_code == 422
    tp = _pages(fleet, "/v1/targets", "targets", {})
    assert [len(p["targets"]) for p in tp] == [1000, 100] and tp[0]["count"] == 1100
    assert len({t["name"] for p in tp for t in p["targets"]}) == 1100


def test_slo_is_paged_and_its_status_is_every_pools():
    """``/v1/slo`` was the one /v1 snapshot without pages (every judged pool, up to ``max_pools``:
    about 1 MB). It is paged by ``model/pool`` now (``limit``, ``after``; ``pools_total`` and
    ``next``); ``status`` stays the verdict of every pool selected, a violated one on another page
    included, and an answer that fits one page is as before."""
    from sla_guard.model import Status
    from sla_guard.slo import PoolResult, SLOResult

    def judged(model: str, pool: str, status: Status) -> PoolResult:
        return PoolResult(model, pool, status, slos=[SLOResult(model, pool, "ttft_mean", "ttft", "mean", 1.0, status)])

    guard = Guard(parse_config({}), _Fleet(0), [])
    ev = SLOEvaluator(parse_config({}))
    guard.add_evaluator(ev)
    ev.evaluated_at = 1e9
    ev.pools = {(f"m{i:02d}", pool): judged(f"m{i:02d}", pool, Status.VIOLATED if i == 24 else Status.OK)
                for i in range(25) for pool in ("decode", "prefill")}
    srv = UvicornThread(create_app(guard, token=TOKEN))
    try:
        pages = _pages(srv.url, "/v1/slo", "pools", {"limit": 20})
        assert [len(p["pools"]) for p in pages] == [20, 20, 10]
        assert all(p["pools_total"] == 50 and p["status"] == "violated" for p in pages)
        keys = [f"{x['model']}/{x['pool']}" for p in pages for x in p["pools"]]
        assert len(set(keys)) == 50 and keys == sorted(keys) and pages[0]["next"] == keys[19]
        decode = _pages(srv.url, "/v1/slo", "pools", {"pool": "decode", "limit": 10})
        assert [len(p["pools"]) for p in decode] == [10, 10, 5] and decode[0]["pools_total"] == 25
        assert {x["pool"] for p in decode for x in p["pools"]} == {"decode"}
        whole = httpx.get(f"{srv.url}/v1/slo", headers=_auth()).json()
        assert len(whole["pools"]) == 50 and "next" not in whole and "pools_total" not in whole
        r = httpx.get(f"{srv.url}/v1/slo", headers=_auth(), params={"limit": 0})
        assert r.status_code == 422 and "query.limit" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_advisors_rolling_restarts_are_paged_and_every_one_is_reached(monkeypatch):
    """The advisor's snapshot held its last decision whole: one rolling restart per open leak
    finding (3,272 at 1,000 engines) was 0.8 MB of ``/v1/status`` and 0.75 MB of
    ``/v1/recommendations``, an autoscaler read meant to stay small. Its restarts are one more
    paged map now, by ``model/finding`` (``/v1/status``: ``limit`` a map, 100 by default,
    ``evaluator=advisor&after=``; ``/v1/recommendations``: ``limit``/``after``, 1,000 a page),
    ``?model=`` pages that model's; the pool decisions stay whole, KEDA's answers carry no restart,
    and an answer that fits one page is as before. Every page is rendered in its worker thread,
    not on the event loop the scrapes share (a dict returned was encoded there)."""
    from scale_support import Engine as ScaledEngine
    from scale_support import run
    from scale_support import store as scale_store

    from sla_guard.compose import compose

    config = parse_config({"advisor": {"model": "*", "profile": {
        "prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01, "decode_step_per_request_s": 0.0002}}})
    store = scale_store()
    root = compose(config, source=StoreSource(store), slo=False)
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    engines = [ScaledEngine(pool, f"{m}-{pool[0]}0", model=m) for m in "ab" for pool in ("prefill", "decode")]
    run(engines, store, 1000, 1060, **{f"{m}-p0": busy for m in "ab"},
        **{f"{m}-d0": {"running": 10, "waiting": 0, "steps": 400} for m in "ab"})
    raised = []
    for i in range(3000):  # 2,400 leaking processes of model a, 600 of b
        m = "a" if i < 2400 else "b"
        raised.append(f"{m}/leak/{m}/decode/e{i:04d}/worker")
        root.findings.raise_("leak", raised[-1][2:], "warning", "RSS grows",
                             {"model": m, "pool": "decode", "engine": f"e{i:04d}"}, {"slope_mib_per_h": 12.0}, 1060)
    assert not root.guard.tick(1060).errors
    assert len(root.advisor.recommendations()[1]) == 3000
    on_loop = _where_answers_render(monkeypatch, "restarts")
    srv = UvicornThread(create_app(root.guard, token=TOKEN, extra_routers=root.routers))
    try:
        snap = httpx.get(f"{srv.url}/v1/status", headers=_auth()).json()["evaluators"]["advisor"]
        assert len(snap["restarts"]) == 100 and snap["restarts_total"] == 3000 and "next" in snap
        assert len(snap["recommendations"]) == 4  # two pools of each model, whole
        pages = _pages(srv.url, "/v1/status", "evaluators", {"evaluator": "advisor", "limit": 1000})
        assert [len(p["evaluators"]["advisor"]["restarts"]) for p in pages] == [1000, 1000, 1000]
        keys = [f"{r['model']}/{r['finding']}" for p in pages for r in p["evaluators"]["advisor"]["restarts"]]
        assert keys == sorted(raised)  # each once, in key order
        recs = _pages(srv.url, "/v1/recommendations", "models", {"limit": 700})
        assert [len(p["models"][0]["restarts"]) for p in recs] == [700, 700, 700, 700, 200]
        assert [f"{r['model']}/{r['finding']}" for p in recs for r in p["models"][0]["restarts"]] == keys
        assert all(p["models"][0]["restarts_total"] == 3000 and len(p["models"][0]["recommendations"]) == 4
                   for p in recs)
        whole = httpx.get(f"{srv.url}/v1/recommendations", headers=_auth()).json()
        assert len(whole["models"][0]["restarts"]) == 1000 and whole["next"] == keys[999]
        a = _pages(srv.url, "/v1/recommendations", "models", {"model": "a"})  # one model's: unbounded too
        assert [len(p["models"][0]["restarts"]) for p in a] == [1000, 1000, 400]
        assert {r["model"] for p in a for r in p["models"][0]["restarts"]} == {"a"}
        b = httpx.get(f"{srv.url}/v1/recommendations", headers=_auth(), params={"model": "b"}).json()
        assert list(b) == ["models"] and set(b["models"][0]) == {  # fits one page: as before paging
            "model", "mode", "updated_at", "actuation_errors", "recommendations", "restarts"}
        assert len(b["models"][0]["restarts"]) == 600 and {r["model"] for r in b["models"][0]["recommendations"]} \
            == {"b"}
        r = httpx.get(f"{srv.url}/v1/recommendations", headers=_auth(), params={"limit": 1001})
        assert r.status_code == 422 and "query.limit" in r.json()["error"]["message"]
        for path in ("/v1/scale/keda", "/v1/scale/keda/prefill"):  # KEDA's flat answers: no restart
            r = httpx.get(srv.url + path, headers=_auth(), params={"model": "a"})
            assert r.status_code == 200 and "restart" not in r.text and len(r.content) < 400, r.text
        assert len(on_loop) == 4 + 10 and not any(on_loop), on_loop  # /v1/status pages, /v1/recommendations
    finally:
        srv.stop()


def _where_answers_render(monkeypatch, marker: str) -> list[bool]:
    """For each answer whose body holds ``marker``, whether it was rendered on an event loop
    (True) or in a worker thread: a large answer rendered on the loop holds every scrape. Every
    response sets its headers once its body is rendered, whichever path FastAPI took."""
    import asyncio

    from starlette.responses import Response

    seen: list[bool] = []
    init_headers = Response.init_headers

    def recorded(self, headers=None) -> None:
        if marker.encode() in bytes(getattr(self, "body", b""))[:100_000]:
            try:
                asyncio.get_running_loop()
                seen.append(True)
            except RuntimeError:
                seen.append(False)
        init_headers(self, headers)

    monkeypatch.setattr(Response, "init_headers", recorded)
    return seen


def test_probes_answer_while_every_worker_thread_is_busy():
    """The probes were sync routes, run on the worker threads (40): with 50 clients asking
    ``/v1/status`` of a big guard they queued behind them and a kubelet's liveness probe failed.
    They answer on the event loop now, even with every worker thread held."""
    import threading
    import time

    from anyio import to_thread

    release = threading.Event()

    def hold() -> dict:  # a sync route outside /v1 (no V1Limit): one worker thread each
        release.wait(60)
        return {}

    async def threads() -> dict:  # on the event loop, without the bearer check (a sync dependency)
        lim = to_thread.current_default_thread_limiter()
        return {"total": lim.total_tokens, "busy": lim.borrowed_tokens}

    guard = Guard(parse_config({}), _Fleet(0), [])
    app = create_app(guard, token=TOKEN)
    app.get("/threads")(threads)
    app.get("/block")(hold)
    srv = UvicornThread(app)
    total = httpx.get(f"{srv.url}/threads").json()["total"]
    holders = [threading.Thread(target=httpx.get, args=(f"{srv.url}/block",), kwargs={"timeout": 90})
               for _ in range(int(total) + 5)]
    try:
        for t in holders:
            t.start()
        for _ in range(600):  # every worker thread held (polled, not timed)
            if httpx.get(f"{srv.url}/threads").json()["busy"] >= total:
                break
            time.sleep(0.05)
        assert httpx.get(f"{srv.url}/threads").json()["busy"] >= total
        assert httpx.get(f"{srv.url}/healthz", timeout=30).json() == {"status": "ok"}
        assert httpx.get(f"{srv.url}/readyz", timeout=30).status_code == 503
    finally:
        release.set()
        for t in holders:
            t.join(90)
        srv.stop()


def _held_route(path: str):
    """A /v1 route whose requests are held until ``release`` is set, and ``running``: [held now, most at once]."""
    import threading

    release, lock = threading.Event(), threading.Lock()
    running = [0, 0]
    router = APIRouter(prefix="/v1")

    @router.get(path)
    def hold() -> dict:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        release.wait(60)
        with lock:
            running[0] -= 1
        return {}

    return router, release, running


def test_v1_requests_are_answered_a_few_at_a_time():
    """Every /v1 request ran at once on one of 40 worker threads: 50 clients asking /v1/status
    of a big guard meant 40 threads contending for the GIL with the event loop and the tick, and
    /healthz waited seconds. At most ``V1_CONCURRENCY`` run now; the others wait on the loop."""
    import threading
    import time

    from sla_guard.api import V1_CONCURRENCY

    block, release, running = _held_route("/block")
    srv = UvicornThread(create_app(Guard(parse_config({}), _Fleet(0), []), token=TOKEN, extra_routers=[block]))
    clients = [threading.Thread(target=httpx.get, args=(f"{srv.url}/v1/block",),
                                kwargs={"headers": _auth(), "timeout": 90}) for _ in range(3 * V1_CONCURRENCY)]
    try:
        for t in clients:
            t.start()
        for _ in range(600):  # polled until the first ones are in, then room for the rest to arrive
            if running[0] >= V1_CONCURRENCY:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        assert running[1] == V1_CONCURRENCY
    finally:
        release.set()
        for t in clients:
            t.join(90)
        srv.stop()
    assert running == [0, V1_CONCURRENCY]


def test_autoscaler_reads_are_answered_while_heavy_v1_requests_hold_every_turn():
    """KEDA's poll of /v1/scale/keda (and a custom autoscaler's /v1/recommendations) waited in
    V1Limit's one queue behind every heavy /v1 request: with 50 clients on /v1/status of a big
    guard it waited seconds, past KEDA's HTTP timeout (3 s), and KEDA held the pool or took its
    fallback. The autoscaler reads have a lane of their own: with every /v1 turn held by requests
    that do not finish, and more queued behind them, they are answered with the advisor's number."""
    import threading
    import time

    from scale_support import MODEL, run
    from scale_support import Engine as ScaledEngine
    from scale_support import store as scale_store

    from sla_guard.api import V1_CONCURRENCY
    from sla_guard.compose import compose

    config = parse_config({"advisor": {"model": MODEL, "profile": {
        "prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01, "decode_step_per_request_s": 0.0002}}})
    store = scale_store()
    root = compose(config, source=StoreSource(store), slo=False, detectors=False)
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    run([ScaledEngine("prefill", "p0"), ScaledEngine("decode", "d0")], store, 1000, 1060,
        p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})
    assert not root.guard.tick(1060).errors

    heavy, release, running = _held_route("/heavy")  # a /v1/status that does not finish until the test says so
    srv = UvicornThread(create_app(root.guard, token=TOKEN, extra_routers=[heavy, *root.routers]))
    clients = [threading.Thread(target=httpx.get, args=(f"{srv.url}/v1/heavy",),
                                kwargs={"headers": _auth(), "timeout": 90}) for _ in range(2 * V1_CONCURRENCY)]
    try:
        for t in clients:
            t.start()
        for _ in range(600):  # every heavy turn held (polled, not timed)
            if running[0] >= V1_CONCURRENCY:
                break
            time.sleep(0.05)
        assert running[0] == V1_CONCURRENCY
        # before the fix these waited for a turn until the heavy requests were released: never here
        with httpx.Client(base_url=srv.url, headers=_auth(), timeout=30) as h:
            keda, flat, recs = h.get("/v1/scale/keda"), h.get("/v1/scale/keda/prefill"), h.get("/v1/recommendations")
        assert not release.is_set() and running[0] == V1_CONCURRENCY  # answered while the heavy ones hold
        assert keda.status_code == flat.status_code == recs.status_code == 200, (keda.text, flat.text, recs.text)
        desired = keda.json()["pools"]["prefill"]["desired"]
        assert desired > keda.json()["pools"]["prefill"]["current"] and flat.json()["desired"] == desired
        assert recs.json()["models"][0]["model"] == MODEL
    finally:
        release.set()
        for t in clients:
            t.join(90)
        srv.stop()
    assert running == [0, V1_CONCURRENCY]  # the heavy requests kept their limit
