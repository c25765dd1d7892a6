"""A REAL Prometheus that answers with partial data: its ``remote_read`` endpoint is down.

Prometheus (as Thanos and Mimir with a failed store) still answers ``status: success`` with the
local samples and a ``warnings`` list. The guard read such answers as whole: a mean over part of
the requests was judged as the SLA's. By default such an answer counts ``partial`` and the
pool reads unknown, the warning in its reason; ``source.accept_partial: true`` uses it.
"""

from __future__ import annotations

import math
import socket
import time

import pytest
from guard_support import Engine, Served
from prometheus_support import PrometheusProcess, prometheus_binary

from sla_guard.config import parse_config
from sla_guard.ingest.prometheus import PrometheusView
from sla_guard.model import Status
from sla_guard.slo import SLOEvaluator

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed (scripts/setup.sh --full)"),
]


def _closed_port() -> int:
    """A loopback port nothing listens on: the remote-read endpoint refuses at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_partial_answer_reads_unknown_unless_accepted():
    engine = Engine(pool="decode")
    served = Served(engine.exposition)
    dead = f"http://127.0.0.1:{_closed_port()}/api/v1/read"
    prom = PrometheusProcess([f"127.0.0.1:{served.port}"], interval_s=1.0,
                             extra={"remote_read": [{"url": dead, "read_recent": True, "remote_timeout": "1s"}]})
    cfg = parse_config({"slos": [{"model": "m", "pool": "decode", "objectives": [
        {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "window": "30s",
         "min_requests": 3}]}]})
    try:
        prom.wait_ready()
        deadline = time.time() + 60
        while True:  # samples in the local TSDB (the answer already carries the warning)
            raw = prom.client.get(f"{prom.url}/api/v1/query", params={"query": "up", "time": f"{time.time():.3f}"})
            body = raw.json()
            if body["data"]["result"]:
                break
            assert time.time() < deadline, body
            time.sleep(0.5)
        assert body["status"] == "success" and "remote_read" in body["warnings"][0], body
        for _ in range(30):  # requests across a few scrapes: an increase within the window
            engine.request(0.5, 0.01)
            time.sleep(0.1)
        time.sleep(1.5)
        at = time.time()

        views = {accept: PrometheusView(prom.url, timeout_s=5, accept_partial=accept) for accept in (False, True)}
        verdicts = {}
        for accept, view in views.items():
            ev = SLOEvaluator(cfg)
            ev.known.add(("m", "decode"))  # seen before (the guard's state): no data is unknown, not absent
            ev.evaluate(view, at)
            verdicts[accept] = ev.pools[("m", "decode")]
            view.close()
        strict, lenient = verdicts[False], verdicts[True]
        assert views[False].errors.get("partial", 0) >= 1
        assert strict.status is Status.UNKNOWN, (strict.status, strict.reason)
        assert "partial" in (views[False].last_error or ""), views[False].last_error
        assert views[True].errors == {}
        assert lenient.status is Status.OK, (lenient.status, lenient.reason)
    finally:
        prom.stop()
        served.stop()


def test_bucket_counter_jumping_to_inf_is_unknown_not_ok():
    """An exporter whose TTFT histogram counters jump to +Inf (a broken engine's page). A REAL
    Prometheus answers ``increase()`` over a window holding the jump as ``+Inf`` (NaN within
    it): every burn rate and the error budget read None, no burn row fired, and the attainment
    objective was "ok". Counts that are not finite numbers read unknown."""
    from exporters import contract as c

    name = c.latency_metric("ttft", None).name
    state = {"n": 0.0}

    def page() -> str:
        n = state["n"]
        v = "+Inf" if math.isinf(n) else repr(n)
        lab = 'model="m",pool="decode"'
        return (f"# TYPE {name} histogram\n{name}_bucket{{{lab},le=\"0.5\"}} {v}\n"
                f"{name}_bucket{{{lab},le=\"+Inf\"}} {v}\n{name}_sum{{{lab}}} 1.0\n{name}_count{{{lab}}} {v}\n")

    served = Served(page)
    prom = PrometheusProcess([f"127.0.0.1:{served.port}"], interval_s=1.0)
    cfg = parse_config({"slos": [{"model": "m", "pool": "decode", "objectives": [
        {"name": "ttft_att", "indicator": "ttft", "objective": "attainment", "threshold_s": 0.5, "target": 0.99,
         "window": "5m", "period": "1h", "min_requests": 3}]}]})
    try:
        prom.wait_ready()
        prom.wait_up(1)
        for _ in range(5):
            state["n"] += 10
            time.sleep(1)
        state["n"] = math.inf
        time.sleep(2.5)
        view = PrometheusView(prom.url, timeout_s=5)
        ev = SLOEvaluator(cfg)
        ev.evaluate(view, time.time())
        view.close()
        slo = ev.pools[("m", "decode")].slos[0]
        assert slo.status is Status.UNKNOWN, (slo.status, slo.reason, slo.burn_rates)
        assert "not finite" in slo.reason, slo.reason
    finally:
        prom.stop()
        served.stop()
