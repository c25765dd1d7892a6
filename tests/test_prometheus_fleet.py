"""Prometheus mode at fleet scale: the leak detector's long reads against a REAL Prometheus.

Each tick the leak detector reads ``lookback_s`` (12 h) of every process's RSS. At a 15 s scrape
interval that is ~76 KB of answer per process: at a thousand processes the answer passed the
default ``source.max_body_bytes`` (64 MiB) at every tick and leak detection never ran (measured:
76 MB, ``too_large``), and at five hundred it cost 38 MB and seconds of each tick's budget, plus
two queries per process whenever the floors moved. Here the fleet is scaled down with the limit:
20 processes' 12.5 h (1.8 MB of answer) backfilled into Prometheus's storage with promtool,
against ``max_body_bytes`` of 256 KiB, the same ratio as 1000 processes to 64 MiB.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from guard_support import Served
from prometheus_support import PrometheusProcess, Recording, backfilled, prometheus_binary

from exporters import contract as c
from sla_guard.detect.evaluators import LeakEvaluator
from sla_guard.detect.findings import FindingsBook
from sla_guard.ingest import prometheus as prom_mode
from sla_guard.ingest.prometheus import PrometheusView
from sla_guard.settings.detectors import LeakConfig

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]

PROCESSES = 20  # two engines of ten processes (API server, EngineCore, eight TP workers)
STEP_S = 15
SPAN_S = int(12.5 * 3600)
MAX_BODY = 256 * 1024


def _engine(e: int) -> str:
    return f'model="m",pool="decode",engine="0",instance="10.0.0.{e}:8000",job="vllm"'


def _fleet(end: int) -> tuple[str, dict[str, np.ndarray]]:
    """OpenMetrics text of the fleet's RSS, process info and running requests up to ``end``,
    and each process's RSS values (on the times ``end - SPAN_S .. end`` every ``STEP_S``)."""
    rng = random.Random(7)
    times = range(end - SPAN_S, end + 1, STEP_S)
    rss, info, lines = {}, [], [f"# TYPE {c.PROCESS_RSS.name} gauge"]
    for i in range(PROCESSES):
        e, k = divmod(i, 10)
        lab = f'{_engine(e)},role="worker",process="worker_{k}"'
        base = rng.randint(4_000_000_000, 9_000_000_000)
        rss[f"worker_{k}@{e}"] = np.array([base + rng.randint(0, 50_000_000) for _ in times], dtype=float)
        lines += [
            f"{c.PROCESS_RSS.name}{{{lab}}} {v:.0f} {t}" for t, v in zip(times, rss[f"worker_{k}@{e}"], strict=True)
        ]
        info.append(f'{lab},process_pid="{100 + k}",start_time="{end - SPAN_S - 600}"')
    lines.append(f"# TYPE {c.PROCESS_INFO.name} gauge")
    lines += [f"{c.PROCESS_INFO.name}{{{lab}}} 1 {t}" for lab in info for t in times]
    lines.append(f"# TYPE {c.REQUESTS_RUNNING.name} gauge")
    lines += [f"{c.REQUESTS_RUNNING.name}{{{_engine(e)}}} {rng.randint(0, 64)} {t}" for e in range(2) for t in times]
    return "\n".join([*lines, "# EOF", ""]), rss


@pytest.fixture(scope="module")
def fleet():
    end = int(time.time()) - 60
    history, rss = _fleet(end)
    with backfilled(history) as prom:
        yield prom, float(end), rss


def test_leak_detection_reads_a_fleet_within_the_body_limit(fleet):
    prom, end, rss = fleet
    sent = Recording()
    view = PrometheusView(prom.url, timeout_s=30, max_body_bytes=MAX_BODY, transport=sent)
    ev = LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9))
    try:
        ev.evaluate(view, end)
        assert view.errors == {}, view.last_error  # was {'too_large': 1}: no process judged, every tick
        assert len(ev.verdicts) == PROCESSES
        # one query for all processes' load and start times, not two per process
        assert not any('process="' in q for q in sent.sent), [q for q in sent.sent if 'process="' in q][:2]

        # what the detector saw is exactly Prometheus's samples: 12 h 10 min of every process
        got = view.range(c.PROCESS_RSS.name, {}, end - ev.lookback_s, end)
        times = np.arange(end - SPAN_S, end + 1, STEP_S)
        inside = times >= end - ev.lookback_s
        assert len(got) == PROCESSES
        for s in got:
            want = rss[f"{s.label('process')}@{s.label('instance')[len('10.0.0.')]}"]
            np.testing.assert_array_equal(s.t, times[inside])
            np.testing.assert_array_equal(s.v, want[inside])

        # the next tick reads only the last 5 min again (one query), and still holds the whole window
        sent.sent.clear()
        got = view.range(c.PROCESS_RSS.name, {}, end + STEP_S - ev.lookback_s, end + STEP_S)
        assert sent.sent == [f"{c.PROCESS_RSS.name}[300000ms]"], sent.sent
        assert {len(s.t) for s in got} == {int(inside.sum()) - 1}  # the oldest sample left the window
        assert view.errors == {}
    finally:
        view.close()


def test_failed_load_read_leaves_the_fleet_unjudged_not_judged_without_it(fleet):
    """A process judged without its engine's load (or its start time) when that query failed:
    the tick's verdicts came from other inputs than the detector's. They wait for the next tick."""
    prom, end, _ = fleet
    view = PrometheusView(prom.url, timeout_s=30, transport=Recording(fail=c.PROCESS_INFO.name))
    ev = LeakEvaluator(FindingsBook(), LeakConfig(limit_bytes=64e9))
    try:
        ev.evaluate(view, end)
        assert view.errors.get("connect", 0) >= 1
        assert ev.verdicts == {}
    finally:
        view.close()


def test_incremental_range_equals_a_full_read_while_samples_arrive(monkeypatch):
    """A live Prometheus scraping every second while the guard reads a window incrementally
    (``RANGE_REREAD_S`` shrunk to 3 s, ticks 1 s apart): samples that land after a read (the
    scrape in progress) are picked up by the next, nothing is doubled or lost. Each tick's
    answer equals the server's own full read of the part surely ingested (2 s back)."""
    monkeypatch.setattr(prom_mode, "RANGE_REREAD_S", 3.0)
    state = {"n": 0}

    def page() -> str:
        state["n"] += 1
        return f'# TYPE g gauge\ng{{model="m"}} {state["n"]}\n'

    served = Served(page)
    prom = PrometheusProcess([f"127.0.0.1:{served.port}"], interval_s=1.0)
    view = PrometheusView(prom.url, timeout_s=5)
    try:
        prom.wait_ready()
        prom.wait_up(1, samples=10)
        for _ in range(8):
            at = time.time()
            got = view.range("g", {}, at - 8, at)
            time.sleep(1.0)
            want = prom.query("g[6000ms]", at - 2)  # long ingested by now
            assert len(got) == 1 and len(want) == 1
            kept = got[0].t <= at - 2
            np.testing.assert_allclose(got[0].t[kept], [float(t) for t, _ in want[0]["values"]], rtol=0, atol=1e-3)
            np.testing.assert_array_equal(got[0].v[kept], [float(v) for _, v in want[0]["values"]])
        assert view.errors == {}
    finally:
        view.close()
        prom.stop()
        served.stop()


def test_an_engine_scraped_by_two_jobs_is_named_with_the_fix(caplog):
    """One engine scraped by two Prometheus jobs (a ServiceMonitor beside a static job): its
    series differ only in ``job``. Every sum counts its requests twice, in the guard as in PromQL
    (measured: 12 requests read as 26.3, so ``min_requests: 20`` judged the pool "ok"). The guard
    says what the dashboards on the same server say, so it does not deduplicate: it names the
    copies and the fix (``source.selector``), and with the selector set it counts each request once."""
    import asyncio
    import logging

    from guard_support import Engine

    from sla_guard.config import PrometheusSource
    from sla_guard.ingest.prometheus import PrometheusSourceImpl

    engine = Engine(pool="decode")
    info = (
        f'{c.PROCESS_INFO.name}{{model="m",pool="decode",engine="0",role="engine_core",process="EngineCore_DP0",'
        f'process_pid="4242",start_time="1712345678.25"}} 1\n'
    )
    served = Served(lambda: engine.exposition() + info)
    target = f"127.0.0.1:{served.port}"
    jobs = [
        {"job_name": job, "scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
        for job in ("vllm", "vllm-pods")
    ]
    prom = PrometheusProcess([target], extra={"scrape_configs": jobs})
    ttft = c.REQUEST_TTFT.series("_count")
    sources = []
    try:
        prom.wait_ready()
        prom.wait_up(2)
        for _ in range(12):
            engine.request(0.5, 0.01)
        time.sleep(2.5)  # two scrapes of each job since
        at = time.time()
        counted = {}
        for selector in ("", 'job="vllm"'):
            src = PrometheusSourceImpl(
                PrometheusSource(mode="prometheus", url=prom.url, timeout_s=5, selector=selector)
            )
            sources.append(src)
            with caplog.at_level(logging.WARNING, logger="sla_guard.ingest.prometheus"):
                caplog.clear()
                asyncio.run(src.collect(at))
            counted[selector] = src.view.instant(ttft, {}, at)
            warned = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
            if selector:
                assert src.duplicates == [] and warned == [] and "duplicate" not in src.view.errors
            else:
                assert src.duplicates == [
                    f"m/decode engine 0 process EngineCore_DP0 as job=vllm instance={target} "
                    f"and job=vllm-pods instance={target}"
                ], src.duplicates
                assert len(warned) == 1 and "source.selector" in warned[0], warned
                assert src.view.errors.get("duplicate") == 1
        assert sorted(counted[""].values()) == [12.0, 12.0]  # the pool's requests, once per copy
        assert list(counted['job="vllm"'].values()) == [12.0]
    finally:
        for src in sources:
            asyncio.run(src.aclose())
        prom.stop()
        served.stop()
