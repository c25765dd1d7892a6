"""Failure modes, each against real loopback HTTP servers: the guard keeps running, marks what it
cannot judge as unknown, counts the error by kind, and recovers by itself."""

from __future__ import annotations

import asyncio
import math
import os

import httpx
import pytest
from guard_support import T0, Engine, ScrapeRig, Served, UvicornThread, free_port
from prometheus_client import generate_latest

from exporters import contract as c
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.ingest import build_store
from sla_guard.ingest.prometheus import PrometheusSourceImpl
from sla_guard.ingest.scrape import Scraper
from sla_guard.model import Status

WINDOW = "3s"


def _cfg(servers, **source):
    src = {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.5,
           "targets": [{"url": s.url, "model": f"m{i}", "pool": "decode", "name": f"e{i}"}
                       for i, s in enumerate(servers)]}
    src.update(source)
    return parse_config({
        "source": src, "staleness_s": 2, "evaluation_interval_s": 0.25,
        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                                  "window": WINDOW, "min_requests": 3}]}],
    })


class Rig:
    """Engines behind real HTTP servers, a guard scraping them; ``step`` = traffic + scrape + tick."""

    def __init__(self, n=2, **source):
        self.engines = [Engine(model=f"m{i}") for i in range(n)]
        self.servers = [Served(e.exposition) for e in self.engines]
        self.guard = compose(_cfg(self.servers, **source), detectors=False, advisor=False).guard
        self.loop = asyncio.new_event_loop()

    def step(self, n=4, ttft=0.2, pause=0.25):
        for e in self.engines:
            for _ in range(n):
                e.request(ttft, 0.01)
        self.loop.run_until_complete(self.guard.collect())
        self.loop.run_until_complete(asyncio.sleep(pause))
        return self.guard.tick()

    def steps(self, k, **kw):
        for _ in range(k):
            self.step(**kw)

    def pool(self, i):
        return self.guard.evaluator("slo").pools[(f"m{i}", "decode")]

    def errors(self, target):
        return {k: v for k, v in self.guard.source._state[target].errors.items()}

    def metric_text(self):
        return generate_latest(self.guard.registry).decode()

    def close(self):
        self.loop.run_until_complete(self.guard.source.aclose())
        self.loop.close()
        for s in self.servers:
            s.stop()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_target_down_is_unknown_counted_and_recovers(rig):
    rig.steps(6)
    assert rig.pool(0).status is Status.OK and rig.pool(1).status is Status.OK
    port = rig.servers[1].port
    rig.servers[1].stop()
    rig.steps(2)
    assert rig.pool(1).status is Status.UNKNOWN and "1 of 1 targets down" in rig.pool(1).reason
    assert rig.pool(0).status is Status.OK  # the other pool is unaffected
    assert rig.errors("e1")["connect"] >= 2
    assert f'{c.GUARD_SCRAPE_ERRORS.exposed}{{kind="connect",target="e1"}}' in rig.metric_text()
    assert f'{c.GUARD_TARGET_UP.name}{{model="m1",pool="decode",target="e1"}} 0.0' in rig.metric_text()
    rig.servers[1] = Served(rig.engines[1].exposition, port=port)  # back on the same address
    rig.steps(6)
    assert rig.pool(1).status is Status.OK


def test_timeout_is_unknown_and_recovers(rig):
    rig.steps(6)
    rig.servers[0].mode, rig.servers[0].slow_s = "slow", 1.5
    rig.steps(2)
    assert rig.errors("e0")["timeout"] >= 1
    assert rig.pool(0).status is Status.UNKNOWN
    rig.servers[0].mode = "ok"
    rig.steps(8)
    assert rig.pool(0).status is Status.OK


def test_engine_restart_mid_window(rig):
    rig.steps(6, ttft=0.4)
    rig.engines[0].restart()  # all counters back to 0, like a restarted vLLM
    rig.steps(6, ttft=0.4)
    s = rig.pool(0).slos[0]
    assert s.status is Status.OK
    assert s.value == pytest.approx(0.4, rel=1e-6)  # a reset would otherwise give a negative/huge mean
    assert s.requests > 0


def test_malformed_exposition_is_a_failed_scrape(rig):
    rig.steps(6)
    rig.servers[0].body = lambda: "slaguard_x{a=\"1\" 3\nnot even { close\n"
    rig.steps(3)
    assert rig.errors("e0")["parse"] >= 3
    assert rig.pool(0).status is Status.UNKNOWN
    assert rig.pool(1).status is Status.OK
    rig.servers[0].body = rig.engines[0].exposition
    rig.steps(8)
    assert rig.pool(0).status is Status.OK


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_exposition_is_abandoned(chunked):
    r = Rig(max_body_bytes=64 * 1024)
    try:
        r.steps(6)
        pad = "".join(f'pad_total{{i="{i}"}} {i}\n' for i in range(10_000))  # ~200 KB
        r.servers[0].mode = "chunked" if chunked else "ok"
        r.servers[0].body = lambda: r.engines[0].exposition() + pad
        r.steps(2)
        assert r.errors("e0")["too_large"] >= 2
        assert r.pool(0).status is Status.UNKNOWN
        # the limit and the field that raises it (it said only "body over 65536 bytes")
        assert "source.max_body_bytes" in r.guard.source._state["e0"].last_error
        assert r.guard.source.store.range("pad_total", {}, 0, 1e12) == []
    finally:
        r.close()


def test_nan_and_inf_samples_never_give_ok(rig):
    """A NaN or +Inf in the SLOs' histograms refuses the page (``non_finite``, the target down with
    the series named); elsewhere it is counted and the page kept."""
    rig.steps(6)
    ttft_sum = c.REQUEST_TTFT.series("_sum")

    def poisoned():
        text = rig.engines[0].exposition()
        lines = [ln if not ln.startswith(ttft_sum) else ln.rsplit(" ", 1)[0] + " NaN" for ln in text.split("\n")]
        return "\n".join(lines) + 'odd_gauge{k="inf"} +Inf\n'

    rig.servers[0].body = poisoned
    rig.steps(3)
    assert rig.errors("e0")["non_finite"] >= 3
    assert ttft_sum in rig.guard.source._state["e0"].last_error
    s = rig.pool(0).slos[0]
    assert s.status is Status.UNKNOWN, s
    assert s.reason and rig.pool(0).reason == s.reason  # the pool says why, not ""
    rig.servers[0].body = lambda: rig.engines[0].exposition() + 'odd_gauge{k="inf"} +Inf\nodd_gauge{k="nan"} NaN\n'
    rig.steps(14)
    now = rig.guard.last_tick.at
    assert rig.errors("e0")["nan"] >= 1
    assert math.isinf(rig.guard.source.store.instant("odd_gauge", {"k": "inf"}, now)[
        (("instance", "e0"), ("k", "inf"), ("model", "m0"), ("pool", "decode"))])  # +Inf stored
    assert rig.pool(0).slos[0].status is Status.OK


def test_duplicate_series_counted_first_wins(rig):
    rig.steps(3)
    rig.servers[0].body = lambda: rig.engines[0].exposition() + 'dup_g{a="1"} 1\ndup_g{a="1"} 2\n'
    rig.steps(2)
    assert rig.errors("e0")["duplicate"] >= 2
    assert list(rig.guard.source.store.instant("dup_g", {}, rig.guard.last_tick.at).values()) == [1.0]
    assert rig.pool(0).status is Status.OK


def test_label_cardinality_bomb_is_bounded(rig):
    rig.guard.source.store.max_series_per_group = 2_000
    rig.steps(3)
    n = iter(range(10**9))

    def bomb():  # every scrape brings 3000 brand-new series
        base = next(n) * 3000
        return rig.engines[1].exposition() + "".join(f'bomb_total{{id="{base + i}"}} 1\n' for i in range(3000))

    rig.servers[1].body = bomb
    rig.steps(6)
    st = rig.guard.source.store
    assert rig.errors("e1")["series_limit"] > 0
    # its page's 2,000 plus at most 2,000 series it no longer serves (kept for windows spanning a restart)
    assert st.series_count() < 2 * 2_000 + 1_000
    assert rig.pool(0).status is Status.OK  # the well-behaved target is unaffected
    assert rig.guard.source._state["e1"].up  # only a family no SLO reads was refused: still judged
    assert rig.guard.last_tick.errors == {}


def test_a_target_whose_slo_series_do_not_fit_the_store_is_down_not_left_out(tmp_path):
    """A full store (max_series: many engines, label churn elsewhere) refused the series of an
    engine added later from where it filled, its ``up`` too: the target read up in /v1/targets,
    its TTFT _count was stored without its _sum, and the pool's mean (0.2 s and 9 s engines) read
    ~0.1 s, "ok". A page whose limits refused series an SLO reads now fails the scrape (as
    Prometheus's sample_limit does) and ``up`` always fits: the pool is unknown, the target says
    why."""
    import time

    fast, slow = Engine(model="m", engine="0"), Engine(model="m", engine="1")
    servers = [Served(fast.exposition), Served(slow.exposition)]
    f = tmp_path / "targets.yaml"
    f.write_text(f"- {{url: '{servers[0].url}', model: m, pool: decode, name: e0}}\n")
    guard = compose(_cfg([], targets=[], targets_file=str(f)), detectors=False, advisor=False).guard
    slo, store = guard.evaluator("slo"), guard.source.store
    loop = asyncio.new_event_loop()

    def step():
        for _ in range(4):
            fast.request(0.2, 0.01)
            slow.request(9.0, 0.01)
        loop.run_until_complete(guard.collect())
        time.sleep(0.25)
        guard.tick()

    try:
        for _ in range(4):
            step()
        # room for e1's page up to its TTFT _count: its _sum and its up do not fit
        page = [x for x in slow.exposition().splitlines() if x and x[0] != "#" and "_created" not in x]
        store.max_series = store.series_count() + 1 + next(
            i for i, x in enumerate(page) if x.startswith(c.REQUEST_TTFT.series("_count")))
        f.write_text(f"- {{url: '{servers[0].url}', model: m, pool: decode, name: e0}}\n"
                     f"- {{url: '{servers[1].url}', model: m, pool: decode, name: e1}}\n")
        for _ in range(6):
            step()
        e1 = guard.source._state["e1"]
        pool = slo.pools[("m", "decode")]
        assert pool.status is Status.UNKNOWN, (pool.status, pool.reason)
        assert pool.reason.startswith("1 of 2 targets down (e1: series_limit: ") and "retention.max_series " \
            in pool.reason, pool.reason  # the cause and its fix where the operator looks first
        assert slo.overall() is Status.UNKNOWN
        assert not e1.up and e1.errors["series_limit"] >= 1
        assert "retention.max_series " in e1.last_error and "slaguard_request_t" in e1.last_error
        assert "max_series_per_target" not in e1.last_error  # the limit that was hit, not both
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        for s in servers:
            s.stop()


def test_a_label_limit_on_the_slo_series_names_the_field_that_raises_it(rig):
    """Series of the TTFT/TPOT histograms with more labels than ``max_labels_per_series`` (an
    aggregator adding its own: namespace, pod, node...) refuse the page; the reason said only
    "shorten label values (2048 characters at most) or drop labels", not the limit that was hit
    nor the field that raises it."""
    extra = ",".join(f'k8s_{i}="v{i}"' for i in range(12))
    rig.servers[0].body = lambda: rig.engines[0].exposition().replace('model="m0"', f'model="m0",{extra}')
    rig.steps(2)
    st = rig.guard.source._state["e0"]
    assert not st.up and st.errors["label_limit"] >= 1
    assert "retention.max_labels_per_series" in st.last_error and "16" in st.last_error, st.last_error
    assert rig.pool(0).status is Status.UNKNOWN


@pytest.mark.parametrize("own_instance", [False, True])
def test_a_multi_pool_target_over_its_series_limit_is_down_in_every_pool_it_speaks_for(own_instance):
    """An aggregator (``honor_labels``, configured as m/prefill) speaks for a slow decode engine
    beside a plain fast decode target. When its page outgrew ``max_series_per_target`` (an engine
    added to it) the scrape failed, but its up=0 was written for m/prefill only: m/decode was
    judged on the fast target alone and read "ok" (0.2 s against 2.5 s) while the slow engine
    served 9 s. ``up`` is now written for every pool the page carried at its last good scrape
    (and each ``instance`` a federating page labels its engines with)."""
    slow, slow2, fast = (Engine(model="m", engine=e) for e in ("0", "1", "2"))
    grown = [False]

    def agg():
        text = slow.exposition() + (slow2.exposition() if grown[0] else "")
        return text.replace('model="m"', 'instance="pod-0",model="m"') if own_instance else text

    servers = [Served(agg), Served(fast.exposition)]
    cfg = parse_config({"source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 2, "targets": [
        {"url": servers[0].url, "model": "m", "pool": "prefill", "name": "agg", "honor_labels": True},
        {"url": servers[1].url, "model": "m", "pool": "decode", "name": "e1"}]},
        "staleness_s": 1, "retention": {"slots": 32},
        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                  "threshold_s": 2.5, "window": "2s", "min_requests": 3}]}]})
    rig = ScrapeRig(cfg)

    def step():
        for e in (slow, slow2, fast):
            for _ in range(4):
                e.request(9.0 if e is not fast else 0.2, 0.01)
        rig.collect(0.25)
        return rig.judge("m", "decode")

    try:
        for _ in range(6):
            pool = step()
        assert pool.status is Status.VIOLATED, (pool.status, pool.reason)
        rig.store.max_series_per_group = rig.store.series_count() // 2 + 10  # room for one engine's page
        grown[0] = True
        seen = [step() for _ in range(16)]  # 4 s: the 2 s window holds only the fast engine's data
        assert all(p.status is Status.UNKNOWN and p.reason.startswith("1 of 2 targets down") for p in seen), \
            [(p.status, p.reason) for p in seen]
        st = rig.scraper._state["agg"]
        assert not st.up and "retention.max_series_per_target" in st.last_error, st.last_error
    finally:
        rig.close()
        for s in servers:
            s.stop()


def test_series_of_removed_targets_go_stale_and_are_freed(tmp_path):
    """A pod replaced under a new name (file_sd names targets by address) left its series in the
    store for the whole retention (26 h) and its ``up`` current: a churning deployment filled
    ``max_series``, the new pod's series were refused and its pool read "ok" on the other engine
    while the new pod served 9 s TTFTs. A removed target's series go stale at once and are freed
    once no window reads them (``slots`` x ``interval_s``, here 2 s)."""
    fast, slow = Engine(model="m", engine="0"), Engine(model="m", engine="1")
    servers = [Served(fast.exposition), Served(slow.exposition)]
    f = tmp_path / "targets.yaml"
    cfg = parse_config({"source": {"mode": "scrape", "targets_file": str(f), "interval_s": 0.25, "timeout_s": 0.25},
                        "staleness_s": 1, "retention": {"slots": 8},
                        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                                  "threshold_s": 2.5, "window": "2s", "min_requests": 3}]}]})
    rig = ScrapeRig(cfg)
    store = rig.store
    counts, statuses = [], []
    try:
        for gen in range(12):  # the slow engine's pod replaced every second, under a new name
            f.write_text(f"- {{url: '{servers[0].url}', model: m, pool: decode, name: stable}}\n"
                         f"- {{url: '{servers[1].url}', model: m, pool: decode, name: pod-{gen}}}\n")
            os.utime(f, (T0 + gen, T0 + gen))
            for _ in range(4):
                for _ in range(4):
                    fast.request(0.2, 0.01)
                    slow.request(9.0, 0.01)
                rig.collect(0.25)
                if gen == 0:
                    store.max_series = 6 * store.series_count() // 2  # room for six targets
            if gen:
                assert {dict(k)["instance"] for k in store.instant("up", {}, rig.now)} == {"stable", f"pod-{gen}"}
            statuses.append(rig.judge("m", "decode").status)
            store.collect_garbage()
            counts.append(store.series_count())
        # never "ok" on the fast engine alone; a scrape past its 0.25 s deadline on a loaded machine
        # reads unknown (honest), so a round or two may be unknown rather than violated
        assert Status.OK not in statuses[1:] and statuses[1:].count(Status.VIOLATED) >= len(statuses) - 3, statuses
        assert store.dropped["series_limit"] == 0 and max(counts[4:]) <= 5 * counts[0] // 2, counts
        assert not store.instant(c.REQUEST_TTFT.series("_count"), {"instance": "pod-0"}, rig.now)
    finally:
        rig.close()
        for s in servers:
            s.stop()


def test_prometheus_unreachable_or_failing_is_unknown_and_counted():
    cfg = parse_config({"source": {"mode": "prometheus", "url": f"http://127.0.0.1:{free_port()}",
                                   "timeout_s": 0.5}})
    guard = compose(cfg, detectors=False, advisor=False).guard
    src = guard.source
    assert isinstance(src, PrometheusSourceImpl)
    asyncio.run(guard.collect())
    res = guard.tick()
    assert res.errors == {}
    assert src.view.errors["connect"] >= 2
    assert not guard.ready() and guard.evaluator("slo").overall() is Status.UNKNOWN
    # a server answering 500, then one answering garbage
    bad = Served(lambda: b"")
    bad.mode = "error"
    try:
        src.view.url = f"http://127.0.0.1:{bad.port}"
        guard.tick()
        assert src.view.errors["http_status"] >= 1
        bad.mode = "ok"
        bad.body = lambda: "<html>not prometheus</html>"
        guard.tick()
        assert src.view.errors["bad_response"] >= 1
        assert src.targets()[0].up is False
    finally:
        bad.stop()
    text = generate_latest(guard.registry).decode()
    assert f'{c.GUARD_SCRAPE_ERRORS.exposed}{{kind="connect",target="prometheus"}}' in text


class _SteppedClock:
    """The ``time`` module with its wall clock and monotonic clock set by the test (a real clock
    cannot be stepped in a test); everything else is the real module."""

    def __init__(self, wall: float, mono: float) -> None:
        import time

        self._real, self.wall, self.mono = time, wall, mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_a_prometheus_that_stopped_answering_is_unready_after_a_wall_clock_step_back(monkeypatch):
    """Readiness compared the wall clock with the last answer: a Prometheus that stopped answering
    60 s ago (staleness 30 s) read ready after the clock was stepped back an hour (NTP, a resumed
    VM), and would have for the hour. Elapsed time is now measured on the monotonic clock."""
    import json

    from sla_guard.ingest import prometheus as prom

    clock = _SteppedClock(T0, 1000.0)
    monkeypatch.setattr(prom, "time", clock)
    srv = Served(lambda: json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [T0, "1"]}]}}))
    cfg = parse_config({"source": {"mode": "prometheus", "url": srv.url, "timeout_s": 2}, "staleness_s": 30})
    src = PrometheusSourceImpl(cfg.source, stale_after_s=cfg.staleness_s)
    try:
        assert src.view.query("vector(1)", T0) is not None and src.ready()
        srv.mode = "error"  # stopped answering
        clock.wall, clock.mono = T0 + 20, 1020.0
        assert src.view.query("vector(1)", T0 + 20) is None and src.ready()  # within the bound
        clock.wall, clock.mono = T0 + 60 - 3600, 1060.0  # 60 s on, and the wall clock stepped back 1 h
        assert not src.ready()
    finally:
        src.view.close()
        srv.stop()


def test_targets_file_discovery_reloads(tmp_path):
    engines = [Engine(pool="prefill"), Engine(pool="decode")]
    servers = [Served(e.exposition) for e in engines]
    f = tmp_path / "targets.yaml"
    f.write_text(f"- url: {servers[0].url}\n  model: m\n  pool: prefill\n  name: e0\n")
    cfg = parse_config({"source": {"mode": "scrape", "targets_file": str(f), "timeout_s": 0.5}})
    guard = compose(cfg, detectors=False, advisor=False).guard
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(guard.collect())
        assert [t.name for t in guard.source.targets()] == ["e0"]
        import os
        import time

        # Prometheus file_sd format works too
        f.write_text(f'[{{"targets": ["127.0.0.1:{servers[1].port}"], "labels": {{"model": "m", "pool": "decode"}}}}]')
        os.utime(f, (time.time() + 5, time.time() + 5))
        loop.run_until_complete(guard.collect())
        assert [t.pool for t in guard.source.targets()] == ["decode"]
        text = generate_latest(guard.registry).decode()
        assert 'target="e0"' not in text and c.GUARD_TARGET_UP.name in text  # removed target's gauge gone
        # a broken file keeps the last good list and counts the error
        f.write_text("- url: ftp://nope\n")
        os.utime(f, (time.time() + 10, time.time() + 10))
        loop.run_until_complete(guard.collect())
        assert [t.pool for t in guard.source.targets()] == ["decode"]
        assert guard.source.discovery.errors == 1 and "http" in guard.source.discovery.last_error
        assert all(t.up for t in guard.source.targets())
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        for s in servers:
            s.stop()


def test_api_keeps_answering_while_targets_fail():
    """The guard process stays up: /healthz answers during failures."""
    from sla_guard.api import create_app

    r = Rig()
    try:
        r.servers[0].mode = "error"
        r.steps(3)
        srv = UvicornThread(create_app(r.guard))
        try:
            assert httpx.get(f"{srv.url}/healthz").status_code == 200
            body = httpx.get(f"{srv.url}/v1/targets").json()
        finally:
            srv.stop()
        e0 = next(t for t in body["targets"] if t["name"] == "e0")
        assert e0["up"] is False and e0["errors"]["http_status"] >= 3
    finally:
        r.close()


def test_httpx_is_real_loopback():
    """Sanity: the servers used above are real sockets on 127.0.0.1."""
    s = Served(lambda: "x 1\n")
    try:
        assert httpx.get(s.url).text == "x 1\n"
    finally:
        s.stop()


def test_pool_whose_targets_were_removed_says_so_then_is_forgotten(tmp_path):
    """A pool removed from discovery stayed "unknown" with an empty reason for an hour, holding
    the overall verdict; now it says why and is forgotten once its data is stale."""
    import time

    engines = [Engine(model="keep"), Engine(model="gone")]
    servers = [Served(e.exposition) for e in engines]
    f = tmp_path / "targets.yaml"
    f.write_text("".join(f"- url: {s.url}\n  model: {e.model}\n  pool: decode\n  name: {e.model}\n"
                         for e, s in zip(engines, servers, strict=True)))
    cfg = parse_config({"source": {"mode": "scrape", "targets_file": str(f), "interval_s": 0.25, "timeout_s": 0.25},
                        "staleness_s": 1, "evaluation_interval_s": 0.25,
                        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                                  "threshold_s": 2.5, "window": "3s", "min_requests": 3}]}]})
    guard = compose(cfg, detectors=False, advisor=False).guard
    slo = guard.evaluator("slo")
    loop = asyncio.new_event_loop()

    def step():
        for e in engines:
            for _ in range(4):
                e.request(0.2, 0.01)
        loop.run_until_complete(guard.collect())
        time.sleep(0.25)
        guard.tick()

    try:
        for _ in range(8):
            step()
        assert slo.overall() is Status.OK
        f.write_text(f"- url: {servers[0].url}\n  model: keep\n  pool: decode\n  name: keep\n")
        os.utime(f, (time.time() + 5, time.time() + 5))
        reasons = []
        for _ in range(20):
            step()
            gone = slo.pools.get(("gone", "decode"))
            if gone is None:
                break
            if gone.status is not Status.OK:
                reasons.append(gone.reason)
        assert ("gone", "decode") not in slo.pools, "a targetless pool must be forgotten once stale"
        assert reasons and all(reasons), f"every unknown verdict gives its reason: {reasons}"
        assert slo.overall() is Status.OK
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        for s in servers:
            s.stop()


def test_failing_prometheus_is_named_in_the_reason():
    """Prometheus answering 500 was reported as "no current data"; the reason names the failure."""
    bad = Served(lambda: b"")
    bad.mode = "error"
    try:
        cfg = parse_config({"source": {"mode": "prometheus", "url": f"http://127.0.0.1:{bad.port}", "timeout_s": 1},
                            "slos": [{"model": "m", "pool": "decode", "objectives": [
                                {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5}]}]})
        guard = compose(cfg, detectors=False, advisor=False).guard
        guard.evaluator("slo").known.add(("m", "decode"))
        guard.tick()
        pool = guard.evaluator("slo").pools[("m", "decode")]
        assert pool.status is Status.UNKNOWN
        assert "source failing" in pool.reason and "HTTP 500" in pool.reason, pool.reason
    finally:
        bad.stop()


def test_a_prometheus_unreachable_from_the_start_is_named_in_the_verdict():
    """With Prometheus unreachable from the first tick no pool was ever seen: /v1/slo and /v1/status
    said "unknown" with no pools and no reason at all, the cause only in /v1/targets. The snapshot
    says why, and ``check``'s table after its overall verdict."""
    from sla_guard.commands.check import render_table

    cfg = parse_config({"source": {"mode": "prometheus", "url": f"http://127.0.0.1:{free_port()}", "timeout_s": 0.5}})
    guard = compose(cfg, detectors=False, advisor=False).guard
    asyncio.run(guard.collect())
    guard.tick()
    snap = guard.evaluator("slo").snapshot()
    assert snap["status"] == "unknown" and snap["pools"] == [], snap
    assert "no pool seen yet" in snap["reason"] and "source failing: connect: " in snap["reason"], snap
    assert render_table(snap).endswith(f"overall: unknown ({snap['reason']})")


@pytest.mark.parametrize("chunked", [False, True])
def test_prometheus_answer_over_the_body_limit_is_too_large_and_unknown(chunked):
    """A Prometheus answer had no size bound: one huge answer was buffered whole. Past
    ``source.max_body_bytes`` (declared or counted while streaming) it is ``too_large``."""
    import json

    big = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"model": "m", "pool": "decode", "i": str(i)}, "value": [1.0, "1"]} for i in range(200)]}})
    srv = Served(lambda: big)
    srv.mode = "chunked" if chunked else "ok"
    try:
        cfg = parse_config({"source": {"mode": "prometheus", "url": f"http://127.0.0.1:{srv.port}", "timeout_s": 2,
                                       "max_body_bytes": 4096}})
        guard = compose(cfg, detectors=False, advisor=False).guard
        guard.tick()
        assert guard.source.view.errors.get("too_large", 0) >= 1
        assert guard.evaluator("slo").overall() is Status.UNKNOWN
        assert guard.source.view.instant("x", {}, 1.0) == {}
    finally:
        srv.stop()


BAD_SHAPES = [
    {"resultType": "vector", "result": None},
    {"resultType": "vector", "result": 7},
    {"resultType": "vector", "result": ["not an object", 3, None]},
    {"resultType": "vector", "result": [{"metric": None, "value": [1, "2"]}]},
    {"resultType": "vector", "result": [{"metric": {"pool": 5}, "value": [1, "2"]}]},
    {"resultType": "vector", "result": [{"metric": {}, "value": "2"}]},
    {"resultType": "matrix", "result": [{"metric": {}, "values": [[1, "a"], "x", None, [2]]}]},
    {"resultType": "matrix", "result": [{"metric": {}, "values": {"1": "2"}}]},
]


@pytest.mark.parametrize("data", BAD_SHAPES)
def test_prometheus_answers_of_the_wrong_shape_read_as_no_data_never_raise(data):
    """``result: null``, items that are not objects, ``metric: null``: these raised TypeError or
    AttributeError into the evaluator, which then stopped before replacing its verdicts (the
    previous tick's "ok" stood). Each reads as no data now, on every MetricsView call."""
    import json

    from sla_guard.ingest.prometheus import PrometheusView

    srv = Served(lambda: json.dumps({"status": "success", "data": data}))
    try:
        view = PrometheusView(f"http://127.0.0.1:{srv.port}", timeout_s=2)
        assert view.instant("x", {}, 1.0) == {}
        assert view.increase("x", {}, 60, 1.0) == {}
        assert view.range("x", {}, 0.0, 60.0) == []
        assert srv.hits >= 3
    finally:
        srv.stop()


def test_histogram_whose_threshold_bucket_exceeds_inf_is_unknown_not_ok():
    """A page whose le=<threshold> bucket counts more than its +Inf bucket (buckets not
    cumulative: a broken exporter) read as an attainment over 100 % with a growing error budget,
    i.e. "ok". Now the objective is unknown and says why; the sane engine beside it is judged."""
    engines = [Engine(model=f"m{i}") for i in range(2)]
    bucket = c.REQUEST_TTFT.series("_bucket")

    def broken():  # the +Inf bucket of the TTFT histogram at a quarter of the real count
        out = []
        for ln in engines[0].exposition().split("\n"):
            if ln.startswith(bucket) and 'le="+Inf"' in ln:
                head, value = ln.rsplit(" ", 1)
                ln = f"{head} {float(value) / 4}"
            out.append(ln)
        return "\n".join(out)

    servers = [Served(broken), Served(engines[1].exposition)]
    cfg = parse_config({
        "source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.5,
                   "targets": [{"url": s.url, "model": f"m{i}", "pool": "decode", "name": f"e{i}"}
                               for i, s in enumerate(servers)]},
        "staleness_s": 2, "evaluation_interval_s": 0.25,
        "slos": [{"objectives": [{"name": "ttft_att", "indicator": "ttft", "objective": "attainment",
                                  "threshold_s": 0.5, "target": 0.9, "window": WINDOW, "period": "1h",
                                  "min_requests": 3}]}],
    })
    guard = compose(cfg, detectors=False, advisor=False).guard
    loop = asyncio.new_event_loop()
    try:
        for _ in range(8):
            for e in engines:
                for _ in range(4):
                    e.request(0.2, 0.01)
            loop.run_until_complete(guard.collect())
            loop.run_until_complete(asyncio.sleep(0.25))
            guard.tick()
        pools = guard.evaluator("slo").pools
        bad, good = pools[("m0", "decode")].slos[0], pools[("m1", "decode")].slos[0]
        assert good.status is Status.OK and good.value == pytest.approx(1.0)
        assert bad.status is Status.UNKNOWN, bad
        assert "malformed histogram" in bad.reason and bad.budget_remaining is None
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        for s in servers:
            s.stop()


class FakePrometheus:
    """A loopback server answering ``/api/v1/query`` with ``answer(query, time) -> (status, body)``
    (Thanos or Mimir failing one query among many: a store timing out, a 503)."""

    def __init__(self, answer) -> None:
        import http.server
        import json
        import threading
        import urllib.parse

        outer = self
        self.queries: list[str] = []

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                outer.queries.append(q["query"][0])
                status, body = answer(q["query"][0], float(q["time"][0]) if "time" in q else None)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


UNAVAILABLE = (503, {"status": "error", "errorType": "unavailable", "error": "store unavailable"})


def _vector(items: list[tuple[dict, float]], at: float) -> tuple[int, dict]:
    return 200, {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": m, "value": [at, str(v)]} for m, v in items]}}


@pytest.mark.parametrize("failing", [None, "1h", "5m"])
def test_failed_burn_window_query_is_unknown_not_ok(failing):
    """A pool burning 16x its budget over the last hour (only the 1h&5m page row fires). With the
    1h (or 5m) ``increase`` query failing and every other query answered, the row read as not
    firing and the pool as "ok"; a burn window without an answer is unknown."""
    import re

    base = {"model": "m", "pool": "decode", "instance": "i0"}
    fail_ms = {"1h": 3_600_000, "5m": 300_000}.get(failing)

    now = 2_000_000_000.0

    def counts(a: float, b: float, query: str) -> dict[str, float]:
        """Requests from a to b: 10 a second, 16 % of them slow within the last hour before now."""
        total = 10 * (b - a)
        slow = 1.6 * max(0.0, min(b, now) - max(a, now - 3600))
        got = {"0.5": total - slow, "+Inf": total}
        m = re.search(r'le="([^"]*)"', query)
        return {m.group(1): got.get(m.group(1), 0.0)} if m else got

    def series(a: float, b: float, query: str) -> list[tuple[dict, float]]:
        by = re.search(r"sum by \(([^)]*)\)", query).group(1).split(",")
        if "_bucket" in query:
            return [({k: v for k, v in {**base, "le": le}.items() if k in by}, n)
                    for le, n in counts(a, b, query).items()]
        total = counts(a, b, query)["+Inf"]
        return [({k: base[k] for k in by if k in base}, total * (0.3 if "_sum" in query else 1))]

    def answer(query: str, at: float):
        if query == "up":
            return _vector([({"__name__": "up", **base}, 1.0)], at)
        if "ttft" not in query or "client" in query:
            return _vector([], at)
        if query.startswith(("label_replace(", "max_over_time(")):  # bucket coverage: no bucket changed
            return _vector([], at)
        if "increase(" not in query:  # the current-sample check
            return _vector([({"__name__": "x_count", **base}, 1000.0)], at)
        w_ms = int(re.search(r"\[(\d+)ms\]", query).group(1))
        sub = re.search(r"\[(\d+)ms:(\d+)ms\]$", query)
        if sub:  # a day's hour slices of a long window (a subquery): a matrix, one point a slice
            span, step = int(sub.group(1)) / 1000, int(sub.group(2)) / 1000
            ends = [e for e in (at - k * step for k in range(int(span // step) + 1)) if e > at - span]
            points: dict[tuple, list] = {}
            for e in sorted(ends):
                for labels, v in series(e - w_ms / 1000, e, query):
                    points.setdefault(tuple(sorted(labels.items())), []).append([e, str(v)])
            return 200, {"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": dict(k), "values": v} for k, v in points.items()]}}
        if w_ms == fail_ms:
            return UNAVAILABLE
        return _vector(series(at - w_ms / 1000, at, query), at)

    srv = FakePrometheus(answer)
    try:
        cfg = parse_config({"source": {"mode": "prometheus", "url": srv.url, "timeout_s": 2},
                            "slos": [{"model": "m", "pool": "decode", "objectives": [
                                {"name": "ttft_att", "indicator": "ttft", "objective": "attainment",
                                 "threshold_s": 0.5, "target": 0.99, "window": "5m", "period": "30d",
                                 "min_requests": 10}]}]})
        guard = compose(cfg, detectors=False, advisor=False).guard
        guard.tick(now)
        slo = guard.evaluator("slo").pools[("m", "decode")].slos[0]
        if failing is None:
            assert slo.status is Status.VIOLATED and "1h&5m" in slo.reason, (slo.status, slo.reason)
        else:
            assert guard.source.view.errors.get("http_status", 0) >= 1
            assert slo.status is Status.UNKNOWN, (slo.status, slo.reason)
            assert f"no data for the {failing} burn window" in slo.reason, slo.reason
    finally:
        srv.stop()


def test_failing_prometheus_keeps_open_leak_findings():
    """A leak finding open on a process's RSS (a Prometheus source). One tick where Prometheus
    answered 503 read as "every process gone": each open leak finding was resolved
    ``series_gone`` (and reopened, re-notified, at the next answer). Failed data are unknown."""
    from sla_guard.detect.evaluators import LeakEvaluator
    from sla_guard.detect.findings import FindingsBook
    from sla_guard.ingest.prometheus import PrometheusView
    from sla_guard.settings.detectors import LeakConfig

    now = 2_000_000_000.0
    lab = {"instance": "d0", "model": "m", "pool": "decode", "engine": "0", "process": "EngineCore_DP0"}
    state = {"fail": False}

    def answer(query: str, at: float):
        if state["fail"]:
            return UNAVAILABLE
        if query.startswith(c.PROCESS_RSS.name + "["):
            pts = [[at - 60 * i, str(8e9 + 1e6 * (1800 - i))] for i in range(1800, -1, -1)]
            return 200, {"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"__name__": c.PROCESS_RSS.name, **lab}, "values": pts}]}}
        if query == "up":
            return _vector([({"__name__": "up", **{k: lab[k] for k in ("instance", "model", "pool")}}, 1.0)], at)
        return _vector([], at)

    srv = FakePrometheus(answer)
    view = PrometheusView(srv.url, timeout_s=2)
    try:
        book = FindingsBook()
        ev = LeakEvaluator(book, LeakConfig(limit_bytes=64e9, warmup_s=60))
        ev.evaluate(view, now)
        key = "leak/d0/m/decode/0/EngineCore_DP0"
        assert key in ev.verdicts
        book.raise_("leak", key, "warning", "grows", lab, {"slope_mib_per_h": 3.4}, now)
        state["fail"] = True
        ev.evaluate(view, now + 60)
        assert view.errors.get("http_status", 0) >= 1
        assert [f.key for f in book.open_findings()] == [key]
        assert key in ev.verdicts
    finally:
        view.close()
        srv.stop()


@pytest.mark.parametrize("skew_s", [-600.0, 600.0])
def test_prometheus_clock_minutes_apart_is_queried_at_its_own_time(skew_s):
    """The guard's clock ``skew_s`` off Prometheus's (no NTP on one host). Queries went out at
    the guard's now: 10 min behind, they read Prometheus's past (requests fast then, slow now:
    "ok" for a pool in violation); 10 min ahead, its future (no samples: "stale or missing").
    The guard measures the offset with ``time()`` and queries at Prometheus's time."""
    import time

    base = {"model": "m", "pool": "decode", "instance": "i0"}

    def answer(query: str, at: float | None):
        server_now = time.time()
        if at is None:  # time() at the server's own now
            return 200, {"status": "success", "data": {"resultType": "scalar", "result": [server_now, str(server_now)]}}
        if at - server_now > 300 or server_now - at > 1800:
            return _vector([], at)  # no sample within the 5 min lookback of a time in its future
        slow = abs(at - server_now) < 30  # the pool's requests got slow in the last minutes
        if query == "up":
            return _vector([({"__name__": "up", **base}, 1.0)], at)
        if "ttft" not in query or "client" in query:
            return _vector([], at)
        if "increase(" not in query:
            return _vector([({"__name__": "x_count", **base}, 1000.0)], at)
        if "_count" in query:
            return _vector([({"model": "m", "pool": "decode"}, 100.0)], at)
        if "_sum" in query:
            return _vector([({"model": "m", "pool": "decode"}, 100.0 * (4.0 if slow else 0.3))], at)
        return _vector([], at)

    srv = FakePrometheus(answer)
    cfg = parse_config({"source": {"mode": "prometheus", "url": srv.url, "timeout_s": 2},
                        "slos": [{"model": "m", "pool": "decode", "objectives": [
                            {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                             "window": "5m", "min_requests": 3}]}]})
    guard = compose(cfg, detectors=False, advisor=False).guard
    guard.clock = lambda: time.time() + skew_s
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(guard.check_once())
        pool = guard.evaluator("slo").pools[("m", "decode")]
        assert pool.status is Status.VIOLATED, (pool.status, pool.reason)
        assert pool.slos[0].value == pytest.approx(4.0)
        assert guard.source.view.clock_offset_s == pytest.approx(-skew_s, abs=2)
    finally:
        loop.run_until_complete(guard.source.aclose())
        loop.close()
        srv.stop()


def test_a_pool_with_targets_down_says_why_in_its_reason():
    """A pool whose targets failed read "1 of 1 targets down" in /v1/status, /v1/slo and the check
    table, while the cause and the field to fix (a timeout, a malformed line, a series limit, a
    hook that stopped recording) were only in /v1/targets. The reason names each down target's
    failure kind and the first one's cause, bounded, its fix kept."""
    now = [T0]
    eng = {k: Engine(model=k) for k in ("m", "p", "s", "h")}
    vllm_tokens = [0]

    def hooked() -> str:  # vLLM's own counter beside the hook's, as on a plugin page
        return eng["h"].exposition() + ('# TYPE vllm:generation_tokens counter\n'
                                        f'{c.VLLM_GENERATION_TOKENS}{{engine="0"}} {vllm_tokens[0]}\n')

    srv = {"d0": Served(eng["m"].exposition), "d1": Served(eng["m"].exposition), "p0": Served(eng["p"].exposition),
           "s0": Served(eng["s"].exposition), "h0": Served(hooked)}
    targets = [{"url": s.url, "model": "m" if n[0] == "d" else n[0], "pool": "decode", "name": n}
               for n, s in srv.items()]
    targets.append({"url": f"http://127.0.0.1:{free_port()}/metrics", "model": "m", "pool": "decode", "name": "d2"})
    cfg = parse_config({"source": {"mode": "scrape", "interval_s": 5, "timeout_s": 0.3, "targets": targets},
                        "staleness_s": 60, "slos": [{"objectives": [
                            {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                             "window": "1m", "min_requests": 1}]}]})
    store = build_store(cfg)
    scraper = Scraper(cfg.source, store, clock=lambda: now[0])
    guard = compose(cfg, source=scraper, detectors=False, advisor=False, clock=lambda: now[0]).guard
    loop = asyncio.new_event_loop()

    def step(hook_records: bool = True) -> dict:
        for k, e in eng.items():
            for _ in range(4 if hook_records or k != "h" else 0):
                e.request(0.2, 0.01)
        vllm_tokens[0] += 32
        now[0] += 5
        loop.run_until_complete(guard.collect())
        guard.tick()
        return {p["model"]: p for p in guard.evaluator("slo").snapshot()["pools"]}

    try:
        for _ in range(3):
            pools = step()
        assert {m: p["status"] for m, p in pools.items()} == {**dict.fromkeys("psh", "ok"), "m": "unknown"}, pools
        assert pools["m"]["reason"].startswith("1 of 3 targets down (d2: connect: "), pools
        srv["d1"].mode, srv["d1"].slow_s = "slow", 1.0
        srv["p0"].body = lambda: eng["p"].exposition() + "slaguard_oops{{{ 1\n"
        store.max_series_per_group = 1  # no room for the series of a new engine label
        srv["s0"].body = Engine(model="s", engine="1").exposition
        for _ in range(3):
            pools = step(hook_records=False)
        reasons = {m: p["reason"] for m, p in pools.items()}
        assert all(p["status"] == "unknown" for p in pools.values()), reasons
        assert reasons["m"] == "2 of 3 targets down (d1: timeout: no complete answer within 0.3s; d2: connect)"
        assert reasons["p"].startswith("1 of 1 targets down (p0: parse: malformed exposition"), reasons
        assert "slaguard_oops{{{" in reasons["p"] and "fix the exporter's /metrics" in reasons["p"], reasons
        assert reasons["s"].startswith("1 of 1 targets down (s0: series_limit: series limit reached"), reasons
        assert "raise it" in reasons["s"] and "retention.max_series_per_target (1)" in reasons["s"], reasons
        assert reasons["h"].startswith("1 of 1 targets down (h0: hook_stalled: the hook stopped recording"), reasons
        assert max(len(r) for r in reasons.values()) <= 300, reasons
        # every objective of the pool says it too (the check table's NOTE column)
        assert all(s["reason"] == p["reason"] for p in pools.values() for s in p["slos"]), pools
    finally:
        loop.run_until_complete(scraper.aclose())
        loop.close()
        for s in srv.values():
            s.stop()


@pytest.mark.parametrize("limit", ["max_series_per_target", "max_series"])
def test_an_engine_restarted_with_new_labels_near_its_series_limit_is_judged_at_once(limit):
    """An engine restarted under a new ``engine`` label (a rolling update, a crash loop) while its
    target held 90 % of ``max_series_per_target``: its old incarnation's series, no longer on the
    page, still counted against the limit until the ring let them go (``slots`` scrapes and the next
    collection: 123 scrapes here, 1,531 (2.1 h) at the defaults), so the new incarnation's TTFT/TPOT
    series were refused (``series_limit``) and the target read down, its pool unknown, for that long.
    The limit now counts the series of the page being stored; series no longer on it stay readable by
    the windows that span the restart. With the whole store at 90 % of ``max_series`` the first page
    after the restart is still refused, and frees the target's old series: the next one fits."""
    slots = 64
    eng = Engine(model="m", pool="decode", engine="0")
    srv = Served(lambda: eng.exposition())
    cfg = parse_config({"source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 2, "targets": [
        {"url": srv.url, "model": "m", "pool": "decode", "name": "e0"}]},
        "staleness_s": 1, "retention": {"slots": slots},
        "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                  "threshold_s": 2.5, "window": "2s", "min_requests": 1}]}]})
    rig = ScrapeRig(cfg)
    store, state = rig.store, rig.scraper._state

    def step() -> tuple[str | None, int, Status]:
        """One request, one scrape, one evaluation: (the target's error, series refused, verdict)."""
        eng.request(0.2, 0.01)
        was = state["e0"].errors.get("series_limit", 0) if "e0" in state else 0
        st = rig.scrape(0.25)
        refused = st.errors.get("series_limit", 0) - was
        return st.last_error, refused, rig.judge("m", "decode").status

    try:
        err, _, _ = step()
        assert err is None, err
        if limit == "max_series":
            store.max_series = int(store.series_count() / 0.9)  # the store holds 90 % of its limit
        else:
            store.max_series_per_group = int(store.series_count() / 0.9)  # the target holds 90 % of its limit
        before = [step() for _ in range(8)]
        assert before[-1] == (None, 0, Status.OK), before[-1]
        restart_at = rig.now
        eng.engine = "1"  # restarted: the same page under a new engine label
        eng.restart()
        after = [step()]
        if limit == "max_series":  # the store full: this page refused, the target's old series freed
            assert after.pop()[1] > 0
        else:  # the old incarnation's series are kept for the windows that span the restart
            ttft = c.latency_metric("ttft", None).series("_count")
            assert "0" in {dict(k).get("engine") for k in store.instant(ttft, {}, restart_at)}
        after += [step() for _ in range(2 * slots)]
        bad = [i for i, (err, refused, status) in enumerate(after) if err or refused or status is not Status.OK]
        assert not bad, (f"{len(bad)} of {len(after)} scrapes after the restart refused series or read "
                         f"{after[bad[0]][2].value}: {after[bad[0]][:2]}")
    finally:
        rig.close()
        srv.stop()
