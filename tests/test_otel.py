"""OpenTelemetry mirror over OTLP/HTTP into a real loopback receiver (protobuf decoded)."""

from __future__ import annotations

import pytest
from fixtures.otlp_receiver import OtlpReceiver, attrs

from exporters import contract as c
from exporters.otel import OtelMirror
from exporters.prometheus import FinishedRequest


@pytest.fixture
def receiver():
    with OtlpReceiver() as r:
        yield r


def test_disabled_without_endpoint():
    assert OtelMirror.from_env({}) is None


def test_metrics_use_genai_names_and_sla_buckets(receiver):
    mirror = OtelMirror.from_env({"SLA_GUARD_OTLP_ENDPOINT": receiver.endpoint, "SLA_GUARD_OTLP_TIMEOUT_S": "2"})
    try:
        eng = mirror.engine("tiny", "decode", 1, {"kv_role": "kv_consumer"})
        eng.latencies([0.1, 3.0], [0.019, 0.021, 0.5])  # ITLs are not mirrored
        eng.scheduler(4, 2, 0.5)
        eng.finished(FinishedRequest(2.0, 0.1, 0.3, 1.6, 0.016, 200, 64, 101, "length", "req-A"), 1_800_000_000.0)
        mirror.force_flush()
        points = receiver.metric_points()  # one cumulative export (shutdown would send another)
    finally:
        mirror.shutdown()
    ttft = points[c.REQUEST_TTFT.otel_name]
    assert c.REQUEST_TTFT.otel_name == "gen_ai.server.time_to_first_token"
    assert sum(p.count for p in ttft) == 2
    assert 2.5 in list(ttft[0].explicit_bounds)
    a = attrs(ttft[0].attributes)
    assert a == {"gen_ai.request.model": "tiny", "sla_guard.pool": "decode", "sla_guard.engine": "1"}
    tpot = points[c.REQUEST_TPOT.otel_name]
    assert 0.02 in list(tpot[0].explicit_bounds) and tpot[0].count == 1
    bounds = list(tpot[0].explicit_bounds)
    assert sum(tpot[0].bucket_counts[: bounds.index(0.02) + 1]) == 1  # 16 ms is within the 20 ms threshold
    assert c.INTER_TOKEN_LATENCY.name not in points  # per-token ITL stays Prometheus-only
    usage = {attrs(p.attributes)["gen_ai.token.type"]: p.sum for p in points["gen_ai.client.token.usage"]}
    assert usage == {"input": 200, "output": 101}
    assert points[c.KV_CACHE_USAGE.name][0].as_double == 0.5
    assert sum(p.as_int for p in points[c.REQUESTS_FINISHED.name]) == 1



@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "delta"},
        {"OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "base2_exponential_bucket_histogram"},
    ],
)
def test_contract_shape_whatever_the_otel_env(receiver, monkeypatch, env):
    """The SDK's exporter reads OTEL_EXPORTER_OTLP_METRICS_* (set for another exporter in vLLM's
    process, or injected by an operator): "delta" exported the counters and histograms as delta
    (the finished-requests counter read 1 at its second export, not 2), the exponential setting
    exported histograms without the contract's bounds (no 20 ms TPOT bucket). The mirror pins
    cumulative temporality and the contract's explicit buckets."""
    from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    mirror = OtelMirror(receiver.endpoint, timeout_s=2, export_interval_s=3600)
    try:
        eng = mirror.engine("tiny", "decode", 0)
        for rid in ("r1", "r2"):  # two exports, one finished request each
            eng.latencies([0.1])
            eng.finished(FinishedRequest(2.0, 0.1, 0.3, 1.6, 0.016, 20, 0, 11, "stop", rid), 1_800_000_000.0)
            mirror.force_flush()
    finally:
        mirror.shutdown()
    second = receiver.metrics[1]  # the second export (shutdown sends a third)
    last = {m.name: m for rm in second.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    for metric in (c.REQUEST_TTFT, c.REQUEST_TPOT, c.REQUEST_E2E, c.REQUEST_QUEUE, c.REQUEST_PREFILL, c.REQUEST_DECODE):
        m = last[metric.otel_name or metric.name]
        assert m.WhichOneof("data") == "histogram", (m.name, m.WhichOneof("data"))
        assert m.histogram.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
        assert tuple(m.histogram.data_points[0].explicit_bounds) == c.bucket_override(metric)
        assert m.histogram.data_points[0].count == 2
    finished = last[c.REQUESTS_FINISHED.name].sum
    assert finished.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE and finished.is_monotonic
    assert finished.data_points[0].as_int == 2


def test_finished_request_span_with_phase_children(receiver):
    mirror = OtelMirror(receiver.endpoint, timeout_s=2)
    try:
        eng = mirror.engine("tiny", "prefill", 0)
        end = 1_800_000_000.0
        eng.finished(FinishedRequest(0.5, 0.1, 0.3, 0.0, 0.0, 300, 0, 1, "length", "cmpl-xyz-0"), end)
        mirror.force_flush()
    finally:
        mirror.shutdown()
    spans = {s.name: s for s in receiver.spans()}
    root = spans["sla_guard.request"]
    a = attrs(root.attributes)
    assert a["gen_ai.response.id"] == "cmpl-xyz-0" and a["sla_guard.pool"] == "prefill"
    assert a["gen_ai.usage.input_tokens"] == 300 and a["sla_guard.queue_s"] == pytest.approx(0.1)
    assert root.end_time_unix_nano == int(end * 1e9)
    assert root.end_time_unix_nano - root.start_time_unix_nano == pytest.approx(0.5e9, rel=1e-6)
    for phase, seconds in (("queue", 0.1), ("prefill", 0.3), ("decode", 0.0)):
        child = spans[phase]
        assert child.parent_span_id == root.span_id and child.trace_id == root.trace_id
        assert child.end_time_unix_nano - child.start_time_unix_nano == pytest.approx(seconds * 1e9, abs=1e3)


def test_dead_endpoint_does_not_raise():
    mirror = OtelMirror("http://127.0.0.1:9", timeout_s=0.5)  # discard port: connection refused
    eng = mirror.engine("tiny", "mixed", 0)
    eng.finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.01, 10, 0, 5), 1_800_000_000.0)
    mirror.force_flush(timeout_s=1)
    mirror.shutdown()


def test_nan_record_is_dropped_counted_and_flush_thread_survives(receiver, monkeypatch):
    """int(NaN * 1e9) in request_span killed the flush thread for good; nothing was exported again."""
    import time

    from exporters import otel

    monkeypatch.setattr(otel, "FLUSH_INTERVAL_S", 0.05)
    mirror = OtelMirror(receiver.endpoint, timeout_s=2)
    seen: list = []
    mirror.on_error = lambda kind, e: seen.append(kind)
    try:
        eng = mirror.engine("tiny", "decode", 0)
        eng.latencies([float("nan"), 0.2])
        eng.finished(FinishedRequest(1.0, float("nan"), 0.2, 0.7, 0.01, 5, 0, 10, "stop", "bad"), 1_800_000_000.0)
        eng.finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.01, 5, 0, 10, "stop", "good-1"), 1_800_000_000.0)
        deadline = time.monotonic() + 10
        while eng.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mirror._thread.is_alive() and not eng.pending
        real = mirror.request_span
        monkeypatch.setattr(mirror, "request_span", lambda *a: (_ for _ in ()).throw(RuntimeError("sdk bug")))
        eng.finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.01, 5, 0, 10, "stop", "boom"), 1_800_000_000.0)
        while eng.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        monkeypatch.setattr(mirror, "request_span", real)
        eng.finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.01, 5, 0, 10, "stop", "good-2"), 1_800_000_000.0)
        mirror.force_flush()
        assert mirror._thread.is_alive()
    finally:
        mirror.shutdown()
    ids = {attrs(s.attributes)["gen_ai.response.id"] for s in receiver.spans() if s.name == "sla_guard.request"}
    assert ids == {"good-1", "good-2"}
    assert mirror.errors == {"otel_dropped": 2, "otel_flush": 1}
    assert sorted(seen) == ["otel_dropped", "otel_dropped", "otel_flush"]
    assert eng.pending.maxlen is not None  # the queue stays bounded if the SDK falls behind


def test_shutdown_never_raises(monkeypatch):
    """shutdown runs from atexit inside vLLM: an SDK failure there must be counted, not raised."""
    mirror = OtelMirror("http://127.0.0.1:9", timeout_s=0.5)
    eng = mirror.engine("tiny", "mixed", 0)
    eng.finished(FinishedRequest(float("nan"), 0.1, 0.2, 0.7, 0.01, 10, 0, 5), 1_800_000_000.0)

    def broken(*a, **k):
        raise RuntimeError("exporter gone")

    monkeypatch.setattr(mirror.tracer_provider, "shutdown", broken)
    monkeypatch.setattr(mirror.tracer_provider, "force_flush", broken)
    mirror.force_flush(timeout_s=0.5)
    mirror.shutdown()
    assert mirror.errors == {"otel_dropped": 1, "otel_flush": 2}


def test_shutdown_is_bounded_when_the_collector_trickles_its_answer():
    """A collector that sends its response headers a byte at a time: the exporter's timeout bounds each
    read, not the request, and the SDK's span processor joins its export without a limit, so
    shutdown (atexit inside vLLM) and then the SDK's own atexit handlers held the process's exit for as
    long as the collector trickled. Now shutdown is abandoned after about twice the export timeout."""
    import socket
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    done = threading.Event()

    def trickle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            for ch in b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 10_000:
                if done.wait(0.2):
                    return
                conn.send(bytes([ch]))

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    child = f"""
import time
from exporters.otel import OtelMirror
from exporters.prometheus import FinishedRequest
m = OtelMirror("http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=1.0, export_interval_s=3600)
m.engine("tiny", "mixed", 0).finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.01, 10, 0, 5, "stop", "r"), time.time())
t = time.monotonic()
m.shutdown()
print("shutdown", round(time.monotonic() - t, 1), m.errors.get("otel_flush", 0), flush=True)
"""
    root = Path(__file__).resolve().parent.parent
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", child], cwd=root, capture_output=True, text=True, timeout=30)
        exit_s = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit within 30 s: shutdown waited on the trickling collector")
    finally:
        done.set()
        srv.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, seconds, abandoned = proc.stdout.split()
    assert float(seconds) <= 4.0 and int(abandoned) == 1  # 2 x 1 s + 1 s, then abandoned and counted
    assert exit_s < 15, f"exit took {exit_s:.1f}s: the SDK's own atexit shutdown waited on the stuck export"


@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_infinite_timeout_from_env_does_not_make_shutdown_raise(value):
    """SLA_GUARD_OTLP_TIMEOUT_S=inf: shutdown()'s bounded join got an infinite deadline and raised
    OverflowError from atexit inside vLLM. A non-finite value is ignored and a huge one cut."""
    mirror = OtelMirror.from_env({"SLA_GUARD_OTLP_ENDPOINT": "http://127.0.0.1:9", "SLA_GUARD_OTLP_TIMEOUT_S": value,
                                  "SLA_GUARD_OTLP_EXPORT_INTERVAL_S": value})
    assert 0 < mirror.timeout_s <= 60
    mirror.shutdown()


def test_same_engine_labels_give_the_same_otel_engine():
    """The stat logger is rebuilt in a process with one mirror: a new OtelEngine per build grew
    ``engines`` for ever and the old ones kept reporting their last running/waiting/KV state."""
    mirror = OtelMirror("http://127.0.0.1:9", timeout_s=0.5)
    try:
        first = mirror.engine("tiny", "decode", 0, {"kv_role": "kv_consumer"})
        assert mirror.engine("tiny", "decode", 0) is first and mirror.engine("tiny", "decode", "0") is first
        assert mirror.engine("tiny", "decode", 1) is not first and len(mirror.engines) == 2
    finally:
        mirror.shutdown()
