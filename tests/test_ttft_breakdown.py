"""Where the client's TTFT goes (issue 14, item 4): the stage breakdown from a router's client
scope and the engines' own histograms, the "estimated" mark when no router reports, and the
``ttft_stage`` finding when one stage grows against its frozen baseline.

Engines and the router emit the contract with prometheus_client (``guard_support``); every
expected value is computed from what the test sent."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from guard_support import T0, Engine, Router, scrape_into

from exporters.contract import Component
from exporters.prometheus import FinishedRequest
from sla_guard.config import parse_config
from sla_guard.detect.alertmanager import to_alert
from sla_guard.detect.findings import FindingsBook
from sla_guard.detect.stages import StageBreakdownEvaluator, router
from sla_guard.store import SeriesStore


class PdPair:
    """A prefill and a decode engine behind a router; each request's stages drawn at random."""

    def __init__(self, with_router: bool = True, kv: bool = False) -> None:
        self.prefill = Engine(pool="prefill")
        self.decode = Engine(pool="decode", components=(Component.ENGINE, Component.KV_TRANSFER))
        self.router = Router() if with_router else None
        self.kv = kv
        self.sent: dict[str, list[float]] = {}
        self.rng = np.random.default_rng(11)

    def _keep(self, k: str, v: float) -> float:
        self.sent.setdefault(k, []).append(v)
        return v

    def request(self, decode_queue_s: float = 0.02) -> None:
        u = self.rng.uniform
        pq, pc = self._keep("prefill_queue", u(0.0, 0.1)), self._keep("prefill_compute", u(0.05, 0.15))
        kv = self._keep("kv", u(0.01, 0.03)) if self.kv else 0.0
        dq_total = self._keep("decode_queue_total", decode_queue_s * u(0.5, 1.5) + kv)
        step = self._keep("first_decode_step", u(0.01, 0.03))
        self.prefill.rec.finished(FinishedRequest(pq + pc, pq, pc, 0.0, 0.0, 64, 0, 1))
        self.decode.rec.finished(FinishedRequest(dq_total + step + 0.2, dq_total, step, 0.2, 0.01, 64, 64, 21))
        if self.kv:
            self.decode.rec.kv_transfer(durations=[kv])
        if self.router is not None:
            p_leg = self._keep("prefill_leg", pq + pc + u(0.02, 0.06))  # + the API server around it
            d_leg = self._keep("decode_first_leg", dq_total + step + u(0.01, 0.02))
            ttft = self._keep("ttft", p_leg + d_leg + u(0.001, 0.005))
            self.router.request(ttft, 0.01, prefill_leg=p_leg, decode_first_leg=d_leg)

    def parts(self):
        return [p for p in (self.prefill, self.decode, self.router) if p is not None]


def _run(pair: PdPair, ev: StageBreakdownEvaluator, store: SeriesStore, t0: float, minutes: int, **kw) -> float:
    t, steps = t0, minutes * 12
    for step in range(steps):
        t = t0 + 5 * step
        for _ in range(2):
            pair.request(**kw)
        scrape_into(store, pair.parts(), t)
        if step % 3 == 0 or step == steps - 1:
            ev.evaluate(store, t)
    return t


def _stages(b) -> dict[str, float]:
    return {s.stage: s.seconds for s in b.stages}


def test_stages_are_the_measured_means_and_sum_to_the_client_ttft():
    cfg = parse_config({})
    pair, store = PdPair(), SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    ev = StageBreakdownEvaluator(cfg)
    _run(pair, ev, store, T0, 6)
    b = ev.latest["m"]
    assert not b.estimated and b.sla_s == 2.5
    n = 2 * 60  # the 5 m window: the requests of the last 60 scrape intervals
    last = {k: np.array(v[-n:]) for k, v in pair.sent.items()}
    st = _stages(b)
    assert b.client_ttft_s == pytest.approx(last["ttft"].mean(), rel=1e-6)
    assert st["prefill_queue"] == pytest.approx(last["prefill_queue"].mean(), rel=1e-6)
    assert st["prefill_compute"] == pytest.approx(last["prefill_compute"].mean(), rel=1e-6)
    assert st["decode_queue"] == pytest.approx(last["decode_queue_total"].mean(), rel=1e-6)
    assert st["first_decode_step"] == pytest.approx(last["first_decode_step"].mean(), rel=1e-6)
    # the API servers around the engines: derived from the router's legs, and positive here
    assert st["prefill_server"] == pytest.approx(
        last["prefill_leg"].mean() - last["prefill_queue"].mean() - last["prefill_compute"].mean(), rel=1e-6)
    assert 0.02 <= st["prefill_server"] <= 0.06 and 0.01 <= st["decode_server"] <= 0.02
    assert b.sum_of_stages_s == pytest.approx(b.client_ttft_s, rel=1e-6)
    assert "kv_handoff" not in st and any("synchronous connector" in n for n in b.notes)
    assert {s.source for s in b.stages} == {"router", "engine", "derived"}
    assert sum(s.share for s in b.stages) == pytest.approx(1.0, rel=1e-6)


def test_nixl_transfers_become_the_kv_handoff_and_leave_the_decode_queue():
    cfg = parse_config({})
    pair, store = PdPair(kv=True), SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    ev = StageBreakdownEvaluator(cfg)
    _run(pair, ev, store, T0, 6)
    st = _stages(ev.latest["m"])
    last = {k: np.array(v[-120:]) for k, v in pair.sent.items()}
    assert st["kv_handoff"] == pytest.approx(last["kv"].mean(), rel=1e-6)
    assert st["decode_queue"] == pytest.approx(last["decode_queue_total"].mean() - last["kv"].mean(), rel=1e-6)
    assert ev.latest["m"].sum_of_stages_s == pytest.approx(ev.latest["m"].client_ttft_s, rel=1e-6)


def test_without_a_router_the_ttft_is_marked_estimated():
    cfg = parse_config({})
    pair, store = PdPair(with_router=False), SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    ev = StageBreakdownEvaluator(cfg)
    _run(pair, ev, store, T0, 6)
    b = ev.latest["m"]
    assert b.estimated and b.client_ttft_s is None
    assert b.ttft_s == pytest.approx(sum(s.seconds for s in b.stages))
    assert {s.source for s in b.stages} == {"engine"}
    assert any("ESTIMATED" in n for n in b.notes)


def test_a_stage_that_grows_opens_a_finding_naming_it_then_resolves():
    cfg = parse_config({})
    pair, store = PdPair(), SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    book = FindingsBook()
    ev = StageBreakdownEvaluator(cfg, book)
    t = _run(pair, ev, store, T0, 10)
    assert book.open_findings() == []
    assert ev.baseline["m"]["decode_queue"] == pytest.approx(0.02, rel=0.25)
    t = _run(pair, ev, store, t + 5, 10, decode_queue_s=0.2)  # the decode side now waits 10x longer
    open_ = book.open_findings()
    assert [f.labels["stage"] for f in open_] == ["decode_queue"], [f.summary for f in open_]
    assert "decode queue mean" in open_[0].summary and "x its baseline" in open_[0].summary
    assert open_[0].details["ratio"] > 5
    alert = to_alert(open_[0], "https://example.invalid/runbooks.md")
    assert alert["labels"]["alertname"] == "SlaGuardTTFTStageGrowth" and alert["labels"]["stage"] == "decode_queue"
    assert alert["annotations"]["runbook_url"].endswith("#ttft-stage-growth")
    assert "decode_queue stage" in alert["annotations"]["description"]
    app = FastAPI()
    app.include_router(router(ev))
    body = TestClient(app).get("/v1/ttft-breakdown", params={"model": "m"}).json()
    assert body["models"][0]["stages"] and body["models"][0]["client_ttft_s"] > 0.2
    assert TestClient(app).get("/v1/ttft-breakdown", params={"model": "nope"}).status_code == 404
    _run(pair, ev, store, t + 5, 10)
    assert book.open_findings() == []
