"""The advisor's autoscaler interfaces over real HTTP: the guard's own FastAPI app
(``sla_guard.api.create_app``) with the advisor mounted by its ``serve`` extension, served by
uvicorn on a loopback port with bearer auth, polled with httpx the way KEDA's metrics-api scaler
polls it; plus the desired-replicas gauges on the guard's ``/metrics`` (what prometheus-adapter
scrapes for HPA External metrics). The KEDA manifest's ``valueLocation`` is read from
deploy/k8s and resolved against the live response, so docs and code cannot drift apart."""

from __future__ import annotations

import asyncio
import math
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


class KedaHpa:
    """What KEDA and the HPA it creates do with one ScaledObject of deploy/k8s, poll by poll, as
    their sources say: the metrics-api scaler (pkg/scalers/metrics_api_scaler.go,
    ``getMetricValueFromURL``: a status other than 200 is an error; ``getValueFromJSONResponse``:
    nothing numeric at ``valueLocation`` is an error), KEDA's fallback (pkg/fallback/fallback.go:
    failures counted per metric, reset by a success; past ``failureThreshold`` the HPA is fed
    ``replicas x target``, ``replicas`` per ``behavior``: static (the default) ``fallback.replicas``,
    currentReplicas, currentReplicasIfHigher, currentReplicasIfLower), and the HPA's External
    AverageValue rule (replica_calculator.go ``GetExternalPerPodMetricReplicas``: ceil(value /
    target), unless within the 10% tolerance of the current count; a metric error changes nothing),
    clamped to min/max. The scale-down window is 0 in the manifests, so each poll acts."""

    def __init__(self, so: dict, replicas: int) -> None:
        trig = so["spec"]["triggers"][0]
        assert trig["type"] == "metrics-api" and trig["metricType"] == "AverageValue"
        self.location = trig["metadata"]["valueLocation"]
        self.target = float(trig["metadata"]["targetValue"])
        self.min, self.max = so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]
        self.fallback = so["spec"].get("fallback")
        self.failures = 0
        self.replicas = replicas

    def poll(self, resp: httpx.Response) -> int:
        value = None
        if resp.status_code == 200:
            try:
                got = gjson_get(resp.json(), self.location)
            except KeyError:
                got = None
            value = float(got) if isinstance(got, int | float) and not isinstance(got, bool) else None
        if value is None:  # an error: counted, then the fallback past the threshold
            if self.fallback is None:
                return self.replicas
            self.failures += 1
            if self.failures <= self.fallback["failureThreshold"]:
                return self.replicas
            fb, cur = self.fallback["replicas"], self.replicas
            value = self.target * {"static": fb, "currentReplicas": cur, "currentReplicasIfHigher": max(cur, fb),
                                   "currentReplicasIfLower": min(cur, fb)}[self.fallback.get("behavior", "static")]
        else:
            self.failures = 0
        if abs(1.0 - value / (self.target * self.replicas)) > 0.1:
            self.replicas = math.ceil(value / self.target)
        self.replicas = min(max(self.replicas, self.min), self.max)
        return self.replicas


def manifest_scaled_objects() -> dict[str, dict]:
    docs = yaml.safe_load_all((Path(__file__).parent.parent / "deploy/k8s/keda-scaledobject.yaml").read_text())
    return {d["metadata"]["name"]: d for d in docs if d and d.get("kind") == "ScaledObject"}


def test_keda_from_the_manifest_never_scales_below_the_pool_on_an_unknown_answer(served):
    """KEDA follows the advisor's number exactly (targetValue 1), and while the guard has no number
    (stale, frozen, targets down: a 503, or the pool left out) KEDA must keep the pool. The
    manifest's fallback had no ``behavior``, so KEDA's default ``static`` applied: after
    failureThreshold failed polls it fed the HPA fallback.replicas, and a prefill pool the
    advisor had grown to 4 was cut to 2 by an unknown answer. ``currentReplicasIfHigher`` keeps
    the pool (and never goes below fallback.replicas)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    keda = {name: KedaHpa(so, replicas=1) for name, so in manifest_scaled_objects().items()}
    _evaluate_under_prefill_pressure(served)
    with httpx.Client(base_url=served.url, timeout=5) as h:
        url = "/v1/scale/keda"
        doc = h.get(url, headers=auth).json()
        for _ in range(3):
            got = {name: k.poll(h.get(url, headers=auth)) for name, k in keda.items()}
        pools = doc["pools"]
        assert got == {"glm-prefill": pools["prefill"]["desired"], "glm-decode": pools["decode"]["desired"]}
        assert got["glm-prefill"] == 4  # grown from 1 on the advisor's number, exactly
        assert served.guard.expire_if_stale(1060 + served.guard.config.staleness_s + 1)
        for k in keda.values():
            for _ in range(k.fallback["failureThreshold"] + 3):
                resp = h.get(url, headers=auth)
                assert resp.status_code == 503
                before = k.replicas
                assert k.poll(resp) >= before, f"an unknown answer scaled {k.location} {before} -> {k.replicas}"
        assert {name: k.replicas for name, k in keda.items()} == got


def test_keda_follows_every_advised_count_of_the_manifests_range():
    """ceil(desired / 1) is the advice exactly only where a one-replica step leaves the HPA's 10%
    tolerance: up to 10 replicas (10 -> 9 is within it, so is 11 -> 12). The manifests' ranges
    stay below; docs/scaling.md says what to do above."""
    for so in manifest_scaled_objects().values():
        lo, hi = so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]
        assert hi <= 10
        for cur in range(lo, hi + 1):
            for want in range(lo, hi + 1):
                k = KedaHpa(so, replicas=cur)
                assert k.poll(httpx.Response(200, json={"pools": {"prefill": {"desired": want},
                                                              "decode": {"desired": want}}})) == want
    k = KedaHpa(manifest_scaled_objects()["glm-prefill"], replicas=10)
    k.max = 16
    assert k.poll(httpx.Response(200, json={"pools": {"prefill": {"desired": 9}}})) == 10  # the tolerance


def test_a_pool_held_without_data_says_why_not_that_its_targets_are_down():
    """A lightly loaded prefill pool and no ``advisor.profile``: its capacity per replica is
    learned only from windows in which a replica is at least half busy, so the pool holds with
    ``hold_missing_data`` while every target is up. ``/v1/scale/keda/prefill`` answered "(its
    targets down or stale)", sending the operator to look for an outage that was not there; it
    now says the pool's reasons and the field that gives a starting capacity."""
    config = parse_config({"advisor": {"model": MODEL}})
    store = _store()
    root = compose(config, source=StoreSource(store), slo=False, detectors=False)
    light = {"running": 0, "waiting": 0, "computed": 2_000, "prefills": 1, "ttft": 0.3}
    _run([Engine("prefill", "p0"), Engine("decode", "d0")], store, 1000, 1300, p0=light,
         d0={"running": 10, "waiting": 0, "steps": 400})
    assert not root.guard.tick(1300).errors
    pre = next(r for r in root.guard.evaluator("advisor").recommendations()[0] if r.pool == "prefill")
    assert pre.reasons == ["hold_missing_data", "prefill_capacity_not_learned"]
    with uvicorn_server(create_app(root.guard, token=TOKEN, extra_routers=root.routers)) as url:
        r = httpx.get(url + "/v1/scale/keda/prefill", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 503 and "down or stale" not in r.text, r.text
    assert "hold_missing_data" in r.text and "advisor.profile.prefill_tokens_per_s" in r.text, r.text


def test_a_pool_with_targets_down_gets_no_number_below_its_size():
    """Four busy prefill replicas, three of whose scrapes start failing (HTTP 500: a network
    policy, an overloaded metrics port) while they go on serving. The view then held one replica
    and its load, and two minutes later the KEDA answer was prefill desired 2 ("scale", up from
    the 1 replica seen): KEDA would have cut the 5 replicas it ran to 2 on a partial view. Now a
    pool with targets down gets a number only at or above its real size (ready + down): the
    pool is left out of the answer (KEDA holds), its per-pool endpoint answers 503 with why."""
    from guard_support import Served as Page
    from prometheus_client import generate_latest

    from sla_guard.ingest.source import UP

    engines = [Engine("prefill", f"p{i}") for i in range(4)] + [Engine("decode", "d0")]
    pages = {e.name: Page(lambda e=e: generate_latest(e.registry).decode()) for e in engines}
    targets = [{"url": pages[e.name].url, "model": MODEL, "pool": "decode" if e.name == "d0" else "prefill",
                "name": e.name} for e in engines]
    config = parse_config({"source": {"mode": "scrape", "interval_s": 5, "timeout_s": 2, "targets": targets},
                           "advisor": {"model": MODEL, "profile": {"prefill_tokens_per_s": 10_000,
                                                                   "decode_step_base_s": 0.01,
                                                                   "decode_step_per_request_s": 0.0002}}})
    root = compose(config, slo=False, detectors=False)
    guard, scraper = root.guard, root.guard.source
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def scrape(t: float) -> None:
        for target in scraper.discovery.targets():
            await scraper.scrape_target(target, t)

    def run_for(t0: float, steps: int, down: set[str], h: httpx.Client) -> list[httpx.Response]:
        answers = []
        for i in range(steps):
            t = t0 + 5 * i
            for e in engines:
                e.tick(**({"running": 10, "waiting": 0, "steps": 400} if e.name == "d0" else
                          {"running": 2, "waiting": 0, "computed": 20_000, "prefills": 4, "ttft": 0.5}))
                pages[e.name].mode = "error" if e.name in down else "ok"
            asyncio.run(scrape(t))
            if i % 3 == 2:
                assert not guard.tick(t).errors
                answers.append(h.get("/v1/scale/keda", headers=auth))
        return answers

    try:
        with uvicorn_server(create_app(guard, token=TOKEN, extra_routers=root.routers)) as url, \
                httpx.Client(base_url=url, timeout=5) as h:
            before = run_for(1000, 80, set(), h)[-1].json()["pools"]["prefill"]
            assert before["current"] == 4 and before["desired"] >= 4
            answers = run_for(1400, 120, {"p1", "p2", "p3"}, h)
            assert {k for k, v in scraper.store.instant(UP, {"pool": "prefill"}, 1995).items() if v == 0}
            assert all(r.status_code == 200 for r in answers)
            served = [r.json()["pools"].get("prefill") for r in answers]
            assert all(p is None or p["desired"] >= 4 for p in served), served
            assert served[-1] is None  # the one replica seen would not need 4
            r = h.get("/v1/scale/keda/prefill", headers=auth)
            assert r.status_code == 503, r.text
            recs = h.get("/v1/recommendations", headers=auth).json()["models"][0]["recommendations"]
            pre = next(x for x in recs if x["pool"] == "prefill")
            assert pre["reasons"][0] == "hold_missing_data" and "3 of 4 targets of the pool down" in pre["reasons"][1]
            assert isinstance(answers[-1].json()["pools"]["decode"]["desired"], int)  # decode is whole
            back = run_for(2000, 30, set(), h)[-1].json()["pools"]
            assert back["prefill"]["current"] == 4 and back["prefill"]["desired"] >= 4
    finally:
        for p in pages.values():
            p.stop()


def test_a_mistyped_model_on_a_wildcard_advisor_is_a_404_naming_the_known_ones():
    """``advisor.model: '*'`` with models a and b: ``?model=typo`` answered 503 "no recommendation
    yet", which KEDA, HPA and whoever is paged read as an outage, and /v1/recommendations and
    /v1/decisions answered it (and ``?model=a``) with every model's advice. A model never seen is now
    a 404 naming the known ones; a known model whose targets went down is still a 503."""
    config = parse_config({"advisor": {"model": "*", "profile": {
        "prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01, "decode_step_per_request_s": 0.0002}}})
    store = _store()
    root = compose(config, source=StoreSource(store), slo=False, detectors=False)
    app = create_app(root.guard, token=TOKEN, extra_routers=root.routers)
    busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
    dec = {"running": 10, "waiting": 0, "steps": 400}
    engines = {m: [Engine("prefill", f"{m}-p0", model=m), Engine("decode", f"{m}-d0", model=m)] for m in "ab"}
    with uvicorn_server(app) as url, httpx.Client(base_url=url, timeout=5,
                                                  headers={"Authorization": f"Bearer {TOKEN}"}) as h:
        # before the first evaluation nothing is known: 503 (a was a 404 "known: ['default']")
        assert [h.get("/v1/scale/keda", params={"model": m}).status_code for m in ("a", "typo")] == [503, 503]
        _run([*engines["a"], *engines["b"]], store, 1000, 1060, **{f"{m}-p0": busy for m in "ab"},
             **{f"{m}-d0": dec for m in "ab"})
        assert not root.guard.tick(1060).errors
        for path in ("/v1/scale/keda", "/v1/scale/keda/prefill", "/v1/recommendations", "/v1/decisions"):
            r = h.get(path, params={"model": "typo"})
            assert r.status_code == 404 and "unknown model 'typo'; known: ['a', 'b']" in r.text, (path, r.text)
        assert h.get("/v1/scale/keda/prefill", params={"model": "a"}).json()["desired"] > 1
        recs = h.get("/v1/recommendations", params={"model": "a"}).json()["models"]
        assert [r["model"] for r in recs] == ["a"] and {r["model"] for r in recs[0]["recommendations"]} == {"a"}
        decisions = h.get("/v1/decisions", params={"model": "b"}).json()
        assert decisions["model"] == "b" and {d["model"] for d in decisions["decisions"]} == {"b"}
        # a's engines gone, b's still reporting: a is known, without data (an outage, not a typo)
        _run(engines["b"], store, 1065, 1060 + 900, **{"b-p0": busy, "b-d0": dec})
        assert not root.guard.tick(1060 + 900).errors
        r = h.get("/v1/scale/keda/prefill", params={"model": "a"})
        assert r.status_code == 503 and "no recommendation for model 'a'" in r.text, r.text
        assert h.get("/v1/scale/keda/prefill", params={"model": "b"}).status_code == 200
        assert h.get("/v1/scale/keda", params={"model": "typo"}).status_code == 404
