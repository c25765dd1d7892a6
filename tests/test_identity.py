"""A target's identity is its configuration, not what its page claims (issue 13, item 5).

A target configured as model ``evil``, pool ``prefill`` that serves a page labelled
``model="m1",pool="decode"`` must not feed m1/decode's SLOs or spend its error budget: the
configured model and pool win, the page's differing values are kept as ``exported_model`` /
``exported_pool`` (Prometheus's ``honor_labels: false``). ``honor_labels: true`` on a target
restores page-wins for sidecars and aggregators that speak for several pools. Everything is
scraped over real loopback HTTP by the real Scraper and judged by the real SLOEvaluator.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from guard_support import T0, Engine, GuardProcess, Served, free_port

from exporters import contract as c
from sla_guard.config import ScrapeSource, Target, parse_config
from sla_guard.ingest.scrape import Scraper
from sla_guard.model import Status
from sla_guard.slo import SLOEvaluator
from sla_guard.store import SeriesStore

ROOT = Path(__file__).resolve().parent.parent
TTFT_COUNT = c.REQUEST_TTFT.series("_count")
# vLLM's own histogram, as a page would carry it next to the contract
VLLM_LINES = "".join(
    f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model="m1",pool="decode"}} {n}\n'
    for le, n in (("0.5", 1), ("1.0", 2), ("+Inf", 3))
) + ('vllm:time_to_first_token_seconds_sum{model="m1",pool="decode"} 2.5\n'
     'vllm:time_to_first_token_seconds_count{model="m1",pool="decode"} 3\n')


def _cfg(targets: list[dict]) -> object:
    return parse_config({
        "source": {"mode": "scrape", "timeout_s": 2, "targets": targets},
        "staleness_s": 60,
        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                  "threshold_s": 2.5, "window": "1m", "min_requests": 3}]}],
    })


def _labels_of(store: SeriesStore, name: str, at: float) -> list[dict[str, str]]:
    return [dict(lab) for lab in store.instant(name, {}, at)]


async def _rounds(cfg, engines: dict[str, tuple[Engine, float]], n: int) -> tuple[SeriesStore, SLOEvaluator]:
    """``n`` scrapes 5 s apart of every configured target through the real Scraper; before each,
    every engine serves 4 requests at its TTFT; the evaluator judges every third round."""
    store = SeriesStore(slots=64, lookback_s=cfg.staleness_s)
    scraper = Scraper(cfg.source, store)
    ev = SLOEvaluator(cfg)
    try:
        for step in range(n):
            t = T0 + 5 * step
            for e, ttft in engines.values():
                for _ in range(4):
                    e.request(ttft, 0.01)
            for target in cfg.source.targets:
                st = await scraper.scrape_target(target, t)
                assert st.up, st.last_error
            if step % 3 == 2:
                ev.evaluate(store, t)
    finally:
        await scraper.aclose()
    return store, ev


@pytest.fixture
def engines():
    """A real m1/decode engine (fast) and an impostor whose page says m1/decode (slow)."""
    good, bad = Engine(model="m1", pool="decode", engine="0"), Engine(model="m1", pool="decode", engine="0")
    servers = [Served(good.exposition), Served(lambda: bad.exposition() + VLLM_LINES)]
    yield {"good": (good, 0.2), "bad": (bad, 9.0)}, servers
    for s in servers:
        s.stop()


def _targets(servers, honor: bool) -> list[dict]:
    return [{"url": servers[0].url, "model": "m1", "pool": "decode", "name": "m1-decode-0"},
            {"url": servers[1].url, "model": "evil", "pool": "prefill", "name": "evil-0", "honor_labels": honor}]


def test_configured_model_and_pool_win_page_values_are_exported(engines):
    eng, servers = engines
    store, ev = asyncio.run(_rounds(_cfg(_targets(servers, honor=False)), eng, 9))
    at = T0 + 5 * 8
    evil = [d for d in _labels_of(store, TTFT_COUNT, at) if d["instance"] == "evil-0"]
    assert evil and all(d["model"] == "evil" and d["pool"] == "prefill" for d in evil)
    assert all(d["exported_model"] == "m1" and d["exported_pool"] == "decode" for d in evil)
    # vLLM's own families are relabelled the same way
    (vllm,) = _labels_of(store, "vllm:time_to_first_token_seconds_count", at)
    assert (vllm["model"], vllm["pool"], vllm["exported_model"], vllm["exported_pool"]) == (
        "evil", "prefill", "m1", "decode")
    # the honest target agrees with its page: no exported_ labels, the same series as before
    good = [d for d in _labels_of(store, TTFT_COUNT, at) if d["instance"] == "m1-decode-0"]
    assert good and not any(k.startswith("exported_") for d in good for k in d)
    # m1/decode is judged on the honest engine alone: ok, at its own TTFT
    m1 = ev.pools[("m1", "decode")]
    assert m1.status is Status.OK, m1
    assert m1.slos[0].value == pytest.approx(0.2)
    assert m1.targets_total == 1
    # the impostor's slow requests count against its own configured pool, nobody else's
    bad = ev.pools[("evil", "prefill")]
    assert bad.status is Status.VIOLATED and bad.slos[0].value == pytest.approx(9.0)


def test_honor_labels_true_lets_the_page_speak_for_its_pools(engines):
    """The escape hatch for sidecars/aggregators: the page's labels win, so the impostor's slow
    requests land in m1/decode (which is exactly why it is off by default)."""
    eng, servers = engines
    store, ev = asyncio.run(_rounds(_cfg(_targets(servers, honor=True)), eng, 9))
    at = T0 + 5 * 8
    evil = [d for d in _labels_of(store, TTFT_COUNT, at) if d["instance"] == "evil-0"]
    assert evil and all(d["model"] == "m1" and d["pool"] == "decode" for d in evil)
    assert not any(k.startswith("exported_") for d in evil for k in d)
    m1 = ev.pools[("m1", "decode")]
    assert m1.status is Status.VIOLATED, m1
    assert m1.slos[0].value == pytest.approx((0.2 + 9.0) / 2)


def test_store_exported_labels_rules():
    """The merge itself, on both ingest paths (the raw-text fast path and parsed samples)."""
    page = ('a_total{model="m1",pool="decode"} 1\n'
            'b_total{model="evil"} 2\n'  # equal value: no exported_ label
            'c_total{model="m1",exported_model="x"} 3\n'  # exported_ name taken: prefix again
            'd_total{model=""} 4\n'  # empty = absent, as in Prometheus
            'e_total{other="o"} 5\n')
    extra = {"instance": "t", "model": "evil", "pool": "prefill"}
    want = {
        "a_total": {"instance": "t", "model": "evil", "pool": "prefill", "exported_model": "m1",
                    "exported_pool": "decode"},
        "b_total": {"instance": "t", "model": "evil", "pool": "prefill"},
        "c_total": {"instance": "t", "model": "evil", "pool": "prefill", "exported_model": "x",
                    "exported_exported_model": "m1"},
        "d_total": {"instance": "t", "model": "evil", "pool": "prefill"},
        "e_total": {"instance": "t", "model": "evil", "pool": "prefill", "other": "o"},
    }
    fast = SeriesStore()
    assert fast.ingest_text(page, 1.0, extra, group="t", honor_labels=False).samples == 5
    from sla_guard.exposition import parse_exposition

    slow = SeriesStore()
    samples, _ = parse_exposition(page)
    assert slow.ingest_samples(samples, 1.0, extra, group="t", honor_labels=False).samples == 5
    for st in (fast, slow):
        for name, labels in want.items():
            assert _labels_of(st, name, 1.0) == [labels], name


def test_switching_honor_labels_invalidates_the_scrape_cache():
    """The per-target cache maps raw series text to a stored row; flipping honor_labels (a
    config reload) must re-key the series, not keep writing to the old identity."""
    st = SeriesStore()
    extra = {"instance": "t", "model": "evil", "pool": "prefill"}
    page = 'x_total{model="m1",pool="decode"} 1\n'
    st.ingest_text(page, 1.0, extra, group="t", honor_labels=True)
    st.ingest_text(page.replace(" 1\n", " 2\n"), 2.0, extra, group="t", honor_labels=False)
    assert list(st.instant("x_total", {"model": "evil"}, 2.0).values()) == [2.0]
    assert st.instant("x_total", {"model": "m1"}, 2.0) == {}


def test_target_default_is_honor_labels_false():
    assert Target(url="http://127.0.0.1:1/metrics").honor_labels is False
    assert ScrapeSource(targets=[{"url": "http://127.0.0.1:1/metrics", "honor_labels": True}]).targets[0].honor_labels


# -- an aggregator: its page speaks for its pools, its configured model/pool is no pool of its own --
def _agg_cfg(url: str) -> dict:
    """A guard whose one target is an aggregator (``honor_labels``, no ``model:``/``pool:``: the
    defaults default/mixed)."""
    return {"source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.25,
                       "targets": [{"url": url, "name": "agg", "honor_labels": True}]},
            "staleness_s": 2, "evaluation_interval_s": 0.25,
            "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                      "threshold_s": 2.5, "window": "3s", "min_requests": 3}]}]}


def _aggregator(port: int | None = None) -> Served:
    """A page carrying a prefill and a decode engine's own labels; each scrape sees 4 more requests."""
    engines = [Engine(model="m", pool="prefill"), Engine(model="m", pool="decode")]

    def page() -> str:
        for e in engines:
            for _ in range(4):
                e.request(0.2, 0.01)
        return "".join(e.exposition() for e in engines)

    return Served(page, port=port)


def _surfaces(g) -> tuple[dict, dict, str]:
    return g.get("/v1/slo").json(), g.get("/v1/status").json(), g.get("/metrics", auth=False).text


def test_a_healthy_aggregator_reads_ok_with_no_pool_of_its_own(tmp_path):
    """A healthy ``honor_labels`` target without ``model:``/``pool:`` kept a pool default/mixed
    at "no current ttft data" for ever (its configured identity was a pool, with the target's
    up=1 and no data): the overall verdict never left unknown. Its pools are those its page
    carries: m/prefill and m/decode, ok; default/mixed is nowhere (/v1/slo, /v1/status, /metrics,
    ``check``)."""
    agg = _aggregator()
    g = GuardProcess(tmp_path, _agg_cfg(agg.url), log_level="info")
    try:
        slo = g.wait_for("both pools judged", lambda: (b := g.get("/v1/slo").json())
                         and {(p["model"], p["pool"]) for p in b["pools"] if p["status"] == "ok"}
                         >= {("m", "prefill"), ("m", "decode")} and b)
        g.wait_for("overall ok", lambda: g.get("/v1/slo").json()["status"] == "ok")
        slo, status, metrics = _surfaces(g)
        assert {(p["model"], p["pool"]) for p in slo["pools"]} == {("m", "prefill"), ("m", "decode")}, slo
        assert status["evaluators"]["slo"]["status"] == "ok"
        assert 'pool="mixed"' not in metrics and 'model="default"' not in metrics
        assert 'slaguard_guard_target_up{model="m",pool="decode",target="agg"} 1.0' in metrics
        assert 'slaguard_guard_target_up{model="m",pool="prefill",target="agg"} 1.0' in metrics
    finally:
        g.stop()
    cfg = tmp_path / "check.yaml"
    cfg.write_text(yaml.safe_dump(_agg_cfg(agg.url)))
    try:
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        agg.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mixed" not in r.stdout and "\noverall: ok\n" in r.stdout, r.stdout


def test_an_aggregator_down_makes_its_pools_unknown_naming_it(tmp_path):
    """What must stay: an aggregator that never answered has told no pools, so its configured pool
    stands for them, unknown, naming the target and the cause: never ok. Once it answers, its
    page's pools replace that stand-in; down again, each of those pools is unknown, naming it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    cfg = tmp_path / "check.yaml"
    cfg.write_text(yaml.safe_dump(_agg_cfg(url)))
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "overall: unknown" in r.stdout, r.stdout + r.stderr
    assert "1 of 1 targets down (agg: connect" in r.stdout, r.stdout
    g = GuardProcess(tmp_path, _agg_cfg(url), log_level="info")
    agg = None
    try:
        slo = g.wait_for("the stand-in pool down", lambda: (b := g.get("/v1/slo").json())["pools"] and b)
        (pool,) = slo["pools"]
        assert (pool["model"], pool["pool"], pool["status"]) == ("default", "mixed", "unknown"), pool
        assert pool["reason"].startswith("1 of 1 targets down (agg: connect"), pool
        assert slo["status"] == "unknown"
        metrics = g.get("/metrics", auth=False).text
        assert 'slaguard_guard_target_up{model="default",pool="mixed",target="agg"} 0.0' in metrics
        agg = _aggregator(port)
        # the tick that first sees its page's pools no longer has the stand-in (it lingered as "no
        # target left for this pool" for 2 x staleness_s, unknown)
        slo = g.wait_for("its page's pools", lambda: (b := g.get("/v1/slo").json())
                         and any(p["pool"] == "decode" for p in b["pools"]) and b)
        assert ("default", "mixed") not in {(p["model"], p["pool"]) for p in slo["pools"]}, slo
        g.wait_for("overall ok", lambda: g.get("/v1/slo").json()["status"] == "ok")
        slo, status, metrics = _surfaces(g)
        assert {(p["model"], p["pool"]) for p in slo["pools"]} == {("m", "prefill"), ("m", "decode")}, slo
        assert status["evaluators"]["slo"]["status"] == "ok" and 'pool="mixed"' not in metrics, metrics
        agg.stop()
        agg = None
        slo = g.wait_for("its pools down", lambda: (b := g.get("/v1/slo").json())["status"] == "unknown" and b)
        assert {(p["model"], p["pool"]) for p in slo["pools"]} == {("m", "prefill"), ("m", "decode")}, slo
        assert all(p["status"] == "unknown" and p["reason"].startswith("1 of 1 targets down (agg: ")
                   for p in slo["pools"]), [p["reason"] for p in slo["pools"]]
        metrics = g.get("/metrics", auth=False).text
        assert 'slaguard_guard_target_up{model="m",pool="decode",target="agg"} 0.0' in metrics
        assert 'slaguard_guard_slo_status{model="m",pool="decode",slo="ttft_mean",status="unknown"} 1.0' in metrics
    finally:
        g.stop()
        if agg is not None:
            agg.stop()
