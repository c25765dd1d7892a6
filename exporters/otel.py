"""OpenTelemetry mirror of the engine contract over OTLP/HTTP: metrics and per-request spans.

Enabled only when ``SLA_GUARD_OTLP_ENDPOINT`` (base URL, e.g. ``http://collector:4318``) is
set; ``/v1/metrics`` and ``/v1/traces`` are appended. Exports run on the SDK's background
threads with a short timeout (``SLA_GUARD_OTLP_TIMEOUT_S``, default 2 s) so a dead collector
never stalls vLLM, and its own providers are used (never the global ones vLLM may configure).

Names: a contract metric with ``otel_name`` (GenAI semantic conventions, e.g.
``gen_ai.server.time_to_first_token``) is exported under that name with the same buckets;
others keep the contract name. Per-token inter-token latency is not mirrored (one measurement
per token is too costly in the OTel SDK); TPOT per request is. Per the conventions the model is the attribute
``gen_ai.request.model``; pool and engine are ``sla_guard.pool`` / ``sla_guard.engine``.
``gen_ai.client.token.usage`` is a per-request histogram in the conventions, so it is recorded
per finished request with ``gen_ai.token.type`` input|output instead of as a counter.

Spans: one ``sla_guard.request`` span per finished request (start = arrival, end = last token)
with child spans queue / prefill / decode, the request id as ``gen_ai.response.id``, pool,
engine and token counts, so the prefill half and the decode half of a P/D request can be joined
by id and a client's TTFT split into prefill queue, prefill, KV transfer and first decode step.

Never raises into its caller: a record with a non-finite or negative timing is dropped and counted
(``on_error("otel_dropped", ...)``), an exception while exporting one item costs that item only
(``"otel_flush"``), and ``force_flush``/``shutdown`` (atexit, inside vLLM) swallow and count theirs.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from exporters import contract as c
from exporters.prometheus import FinishedRequest

ENV_ENDPOINT = "SLA_GUARD_OTLP_ENDPOINT"
ENV_TIMEOUT = "SLA_GUARD_OTLP_TIMEOUT_S"
ENV_INTERVAL = "SLA_GUARD_OTLP_EXPORT_INTERVAL_S"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_INTERVAL_S = 15.0
MAX_TIMEOUT_S = 60.0  # longer values are cut to these (_float_env)
MAX_INTERVAL_S = 3600.0
FLUSH_INTERVAL_S = 1.0
MAX_PENDING = 100_000  # per engine; bounded memory if the flush thread falls behind
ERR_DROPPED = "otel_dropped"  # hook_errors kinds (fixed set): a malformed record, not exported
ERR_FLUSH = "otel_flush"  # an exception while exporting one item, or in force_flush/shutdown
log = logging.getLogger("sla_guard.otel")

_REQUEST_HISTOGRAMS = (c.REQUEST_E2E, c.REQUEST_QUEUE, c.REQUEST_PREFILL, c.REQUEST_DECODE)
TOKEN_USAGE = "gen_ai.client.token.usage"
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def otel_name(m: c.Metric) -> str:
    return m.otel_name or m.name


def _finite(*values: Any) -> bool:
    """All finite numbers >= 0: a NaN would end up in int(x * 1e9) and in the SDK's sums."""
    try:
        return all(v >= 0 and math.isfinite(v) for v in values)
    except (TypeError, OverflowError):
        return False


def _float_env(env: Mapping[str, str], key: str, default: float, maximum: float) -> float:
    """Seconds from ``env[key]``: ``default`` unless a finite number > 0, at most ``maximum``. An
    infinite or huge timeout made ``shutdown()`` raise OverflowError (its thread join) from atexit."""
    try:
        v = float(env.get(key, default))
    except ValueError:
        return default
    return min(v, maximum) if math.isfinite(v) and v > 0 else default


class OtelEngine:
    """One engine's side of the mirror. Called on vLLM's event loop, so it only queues: the
    OTel SDK's record() costs ~10 us per measurement (attribute cleaning and hashing), which is
    paid on the mirror's flush thread instead. The queue is bounded; overflow drops the oldest."""

    def __init__(self, mirror: OtelMirror, model: str, pool: str, engine: str | int) -> None:
        self.m = mirror
        self.pool, self.engine = str(pool), str(engine)
        self.attrs = {"gen_ai.request.model": model, "sla_guard.pool": self.pool, "sla_guard.engine": self.engine}
        self._input = {**self.attrs, "gen_ai.token.type": "input"}
        self._output = {**self.attrs, "gen_ai.token.type": "output"}
        self._reasons: dict[str, dict[str, str]] = {}
        self.pending: deque = deque(maxlen=MAX_PENDING)
        self.state: tuple[int, int, float] | None = None  # running, waiting, kv usage (observed at export)

    # -- hot path (event loop) -------------------------------------------------------------------
    def latencies(self, ttfts: Iterable[float], itls: Iterable[float] = ()) -> None:
        """TTFTs are mirrored (one per request); per-token ITLs stay Prometheus-only (too many)."""
        if ttfts:
            self.pending.append((None, tuple(ttfts)))

    def scheduler(self, running: int, waiting: int, kv_usage: float) -> None:
        self.state = (running, waiting, kv_usage)

    def finished(self, r: FinishedRequest, end_wall_s: float) -> None:
        self.pending.append((r, end_wall_s))

    # -- flush thread ----------------------------------------------------------------------------
    def drain(self) -> None:
        """Export every queued item, each on its own: a bad one is dropped and counted."""
        pending = self.pending
        while pending:
            try:
                r, x = pending.popleft()
            except IndexError:
                return
            try:
                self._export(r, x)
            except Exception as e:
                self.m.error(ERR_FLUSH, e)

    def _export(self, r: FinishedRequest | None, x: Any) -> None:
        a, h = self.attrs, self.m.hist
        if r is None:
            ttft = h[c.REQUEST_TTFT.name]
            bad = 0
            for v in x:
                if _finite(v):
                    ttft.record(v, a)
                else:
                    bad += 1
            if bad:
                self.m.error(ERR_DROPPED, ValueError(f"{bad} malformed TTFT value(s)"), bad)
            return
        if not (_finite(r.e2e_s, r.queue_s, r.prefill_s, r.decode_s, r.tpot_s, r.prompt_tokens, r.generated_tokens,
                        r.cached_tokens, x) and isinstance(r.reason, str)):
            self.m.error(ERR_DROPPED, ValueError(f"malformed finished request {r!r}"))
            return
        for metric, v in zip(_REQUEST_HISTOGRAMS, (r.e2e_s, r.queue_s, r.prefill_s, r.decode_s), strict=True):
            h[metric.name].record(v, a)
        if r.generated_tokens > 1:
            h[c.REQUEST_TPOT.name].record(r.tpot_s, a)
        h[TOKEN_USAGE].record(r.prompt_tokens, self._input)
        h[TOKEN_USAGE].record(r.generated_tokens, self._output)
        ra = self._reasons.get(r.reason)
        if ra is None:
            ra = self._reasons[r.reason] = {**a, "sla_guard.reason": r.reason}
        self.m.finished_counter.add(1, ra)
        self.m.request_span(self, r, x)


class OtelMirror:
    """Own MeterProvider + TracerProvider exporting OTLP/HTTP (protobuf)."""

    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 export_interval_s: float = DEFAULT_INTERVAL_S, service_name: str = "sla-guard-engine") -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableGauge
        from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        base = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        resource = Resource.create({"service.name": service_name, "process.pid": os.getpid()})
        # the contract's shape whatever OTEL_EXPORTER_OTLP_METRICS_* the process has (set for another
        # exporter, or by an operator's injection): "delta" made the counters delta, and
        # "base2_exponential_bucket_histogram" dropped the SLA thresholds' bucket boundaries
        cumulative = AggregationTemporality.CUMULATIVE
        exporter = OTLPMetricExporter(
            endpoint=base + "/v1/metrics",
            timeout=timeout_s,
            preferred_temporality={Counter: cumulative, Histogram: cumulative, ObservableGauge: cumulative},
            preferred_aggregation={Histogram: ExplicitBucketHistogramAggregation()},
        )
        reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=export_interval_s * 1000, export_timeout_millis=timeout_s * 1000
        )
        # shutdown_on_exit=False: ``shutdown`` (atexit in the stat logger) bounds the SDK's own, which
        # waits on a stuck export without a limit
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
        self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=base + "/v1/traces", timeout=timeout_s),
            max_queue_size=4096, export_timeout_millis=timeout_s * 1000))  # bounded: drops when full
        self.tracer = self.tracer_provider.get_tracer("sla_guard")
        meter = self.meter_provider.get_meter("sla_guard")
        self.hist: dict[str, Any] = {}
        for m in (c.REQUEST_TTFT, c.REQUEST_TPOT, *_REQUEST_HISTOGRAMS):
            self.hist[m.name] = meter.create_histogram(otel_name(m), unit=m.unit, description=m.help,
                                                       explicit_bucket_boundaries_advisory=c.bucket_override(m))
        self.hist[TOKEN_USAGE] = meter.create_histogram(
            TOKEN_USAGE, unit="{token}", description="Tokens per finished request, by gen_ai.token.type.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.finished_counter = meter.create_counter(otel_name(c.REQUESTS_FINISHED), unit="{request}",
                                                     description=c.REQUESTS_FINISHED.help)
        self.engines: list[OtelEngine] = []
        for i, m in enumerate((c.REQUESTS_RUNNING, c.REQUESTS_WAITING, c.KV_CACHE_USAGE)):
            meter.create_observable_gauge(otel_name(m), callbacks=[self._observer(i)], unit=m.unit,
                                          description=m.help)
        self.info = meter.create_gauge(otel_name(c.ENGINE_INFO), description=c.ENGINE_INFO.help)
        self.on_error: Any = None  # (kind, exc) -> None; the stat logger counts into hook_errors
        self.errors: dict[str, int] = {}
        self._errors_logged: set[str] = set()
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sla-guard-otel-flush", daemon=True)
        self._thread.start()

    def _observer(self, index: int):
        from opentelemetry.metrics import Observation

        def observe(_options):
            return [Observation(e.state[index], e.attrs) for e in list(self.engines) if e.state is not None]

        return observe

    def error(self, kind: str, exc: BaseException, n: int = 1) -> None:
        """Count ``n`` errors of ``kind`` (and pass them to ``on_error``), log the first of each kind.
        Never raises: it runs on the flush thread and at exit."""
        try:
            self.errors[kind] = self.errors.get(kind, 0) + n
            if kind not in self._errors_logged:
                self._errors_logged.add(kind)
                log.warning("sla-guard OTel mirror error (kind=%s), counted and ignored from now on: %r", kind, exc,
                            exc_info=exc)
            if self.on_error is not None:
                for _ in range(n):
                    self.on_error(kind, exc)
        except Exception:
            pass

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            try:  # the thread must outlive any one failure, or the queue is never exported again
                self.drain()
            except Exception as e:
                self.error(ERR_FLUSH, e)

    def drain(self) -> None:
        """Move queued observations into the SDK (flush thread, or force_flush/shutdown)."""
        with self._flush_lock:
            for e in list(self.engines):
                try:
                    e.drain()
                except Exception as exc:
                    self.error(ERR_FLUSH, exc)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OtelMirror | None:
        """A mirror if ``SLA_GUARD_OTLP_ENDPOINT`` is set and the OTel SDK is installed, else None."""
        env = os.environ if env is None else env
        endpoint = env.get(ENV_ENDPOINT, "").strip()
        if not endpoint:
            return None
        try:
            return cls(endpoint, _float_env(env, ENV_TIMEOUT, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S),
                       _float_env(env, ENV_INTERVAL, DEFAULT_INTERVAL_S, MAX_INTERVAL_S))
        except ImportError as e:
            raise RuntimeError(f"{ENV_ENDPOINT} is set but the OpenTelemetry SDK is missing: "
                               "pip install 'sla-guard[otel]'") from e

    def engine(self, model: str, pool: str, engine: str | int, info: Mapping[str, str] | None = None) -> OtelEngine:
        """The engine's side of the mirror; the same labels give the same one (a process may build
        its stat logger again: a new one per build grew ``engines`` and observed stale state)."""
        e = next((x for x in self.engines if x.attrs["gen_ai.request.model"] == model and x.pool == str(pool)
                  and x.engine == str(engine)), None)
        if e is None:
            e = OtelEngine(self, model, pool, engine)
            self.engines.append(e)
        if info:
            self.info.set(1, {**e.attrs, **{f"sla_guard.{k}": str(v) for k, v in info.items()}})
        return e

    def request_span(self, e: OtelEngine, r: FinishedRequest, end_wall_s: float) -> None:
        end = int(end_wall_s * 1e9)
        decode_start = end - int(r.decode_s * 1e9)
        prefill_start = decode_start - int(r.prefill_s * 1e9)
        queue_start = prefill_start - int(r.queue_s * 1e9)
        start = min(end - int(r.e2e_s * 1e9), queue_start)
        attrs = {**e.attrs, "gen_ai.response.id": r.request_id, "sla_guard.request_id": r.request_id,
                 "sla_guard.queue_s": r.queue_s, "sla_guard.prefill_s": r.prefill_s,
                 "sla_guard.decode_s": r.decode_s, "sla_guard.e2e_s": r.e2e_s,
                 "sla_guard.ttft_s": max(r.e2e_s - r.decode_s, 0.0), "sla_guard.tpot_s": r.tpot_s,
                 "gen_ai.usage.input_tokens": r.prompt_tokens, "gen_ai.usage.output_tokens": r.generated_tokens,
                 "sla_guard.cached_tokens": r.cached_tokens, "gen_ai.response.finish_reasons": (r.reason,)}
        from opentelemetry import trace

        span = self.tracer.start_span("sla_guard.request", start_time=start, attributes=attrs)
        ctx = trace.set_span_in_context(span)
        for name, s, t in (("queue", queue_start, prefill_start), ("prefill", prefill_start, decode_start),
                           ("decode", decode_start, end)):
            self.tracer.start_span(name, context=ctx, start_time=s, attributes=e.attrs).end(end_time=t)
        span.end(end_time=end)

    def client_span(self, attrs: Mapping[str, Any], request_id: str, start_wall_s: float, e2e_s: float,
                    outcome: str, ttft_s: float | None = None, prefill_leg_s: float | None = None,
                    decode_first_leg_s: float | None = None) -> None:
        """One ``sla_guard.client_request`` span per client request at the P/D router, with child
        spans ``prefill_leg`` and ``decode_first_leg``. ``sla_guard.request_id`` is the client's
        X-Request-Id, which the router passes to both engines: their ``sla_guard.request`` spans
        carry it inside their request ids, so the three halves of one request can be joined."""
        start = int(start_wall_s * 1e9)
        a = {**attrs, "sla_guard.request_id": request_id, "sla_guard.e2e_s": e2e_s, "sla_guard.outcome": outcome}
        timings = {"ttft_s": ttft_s, "prefill_leg_s": prefill_leg_s, "decode_first_leg_s": decode_first_leg_s}
        a.update((f"sla_guard.{k}", v) for k, v in timings.items() if v is not None)
        from opentelemetry import trace

        span = self.tracer.start_span("sla_guard.client_request", start_time=start, attributes=a)
        if prefill_leg_s is not None and decode_first_leg_s is not None and ttft_s is not None:
            ctx = trace.set_span_in_context(span)
            p_start = start + int(max(ttft_s - prefill_leg_s - decode_first_leg_s, 0.0) / 3 * 1e9)
            p_end = p_start + int(prefill_leg_s * 1e9)
            d_end = start + int(ttft_s * 1e9)
            self.tracer.start_span("prefill_leg", context=ctx, start_time=p_start, attributes=attrs).end(end_time=p_end)
            self.tracer.start_span("decode_first_leg", context=ctx, start_time=d_end - int(decode_first_leg_s * 1e9),
                                   attributes=attrs).end(end_time=d_end)
        span.end(end_time=start + int(e2e_s * 1e9))

    def force_flush(self, timeout_s: float = 5.0) -> None:
        self._each(self.drain, lambda: self.tracer_provider.force_flush(int(timeout_s * 1000)),
                   lambda: self.meter_provider.force_flush(int(timeout_s * 1000)), deadline_s=2 * timeout_s + 1.0)

    def shutdown(self) -> None:
        """Never raises, and returns within about twice the export timeout: it runs from atexit inside vLLM."""
        self._stop.set()
        self._each(self.drain, self.tracer_provider.shutdown, self.meter_provider.shutdown,
                   deadline_s=2 * self.timeout_s + 1.0)

    def _each(self, *steps, deadline_s: float) -> None:
        """Run ``steps`` in order, each even if one before failed, on a daemon thread abandoned after
        ``deadline_s``: the SDK's span processor joins its export thread without a limit, and the
        exporter's timeout bounds each socket read, not the request, so a collector trickling its answer
        held vLLM's exit (this runs from atexit) for as long as it kept trickling."""

        def run() -> None:
            for step in steps:
                try:
                    step()
                except Exception as e:
                    self.error(ERR_FLUSH, e)

        t = threading.Thread(target=run, name="sla-guard-otel-shutdown", daemon=True)
        t.start()
        t.join(deadline_s)
        if t.is_alive():
            self.error(ERR_FLUSH, TimeoutError(f"OTLP flush/shutdown not done after {deadline_s:g}s; abandoned"))
