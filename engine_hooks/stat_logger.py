"""``vllm.stat_logger_plugins`` entry point: vLLM's per-step stats -> the metric contract.

Runs in each API-server process, on its event loop, beside vLLM's own PrometheusStatLogger.
It is an ``AggregateStatLoggerBase``: vLLM builds it once per API server with all DP engine
indexes; it keeps one ``EngineRecorder`` (children bound once) per engine index. ``record()`` only
folds the step into a per-engine ``StepBatch`` (engine_hooks/batch.py); a flush thread applies it
every SLA_GUARD_FLUSH_INTERVAL_S (0.5 s). With several API servers each one gets a share of the
steps; prometheus_client's multiprocess mode (which vLLM turns on then) sums counters and
histograms over API servers and keeps the most recent gauge value, so the union is exact.

``record_admission_rejection(reason)`` (vLLM >= 0.32 calls it on aggregate loggers when the API server
refuses a request at a queue limit) counts slaguard_admission_rejections_total at once.

Every public method catches everything: an error is counted in slaguard_hook_errors_total{kind},
logged once per kind, and never raised into vLLM.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from engine_hooks import process_plugin
from engine_hooks.batch import StepBatch, apply
from exporters import contract as c
from exporters.contract import Component
from exporters.process_collector import MultiprocessMirror, SnapshotCollector
from exporters.process_sampler import interval_from_env, mark_api_server, seconds_from_env
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest

try:  # vLLM is optional for the package; the plugin only loads where it is installed.
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase
except ImportError:  # pragma: no cover - exercised in the project venv without vLLM
    AggregateStatLoggerBase = object  # type: ignore[assignment,misc]
try:  # vLLM >= 0.32 (frontend admission control); the series exist at 0 from start, so increase() sees the first
    from vllm.v1.metrics.loggers import ADMISSION_REASONS
except ImportError:
    ADMISSION_REASONS = c.ADMISSION_REASONS

log = logging.getLogger("sla_guard.stat_logger")

KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
_REASONS: dict[Any, str] = {}  # FinishReason -> label (str() of an IntEnum is not free)
ENV_FLUSH = "SLA_GUARD_FLUSH_INTERVAL_S"
DEFAULT_FLUSH_S = 0.5
MAX_FLUSH_S = 60.0  # longer is cut to this: Event.wait() past ~1e9 s raised and ended the flush thread
MAX_BATCH = 50_000  # queued observations per engine before record() flushes inline


def _flush_interval() -> float:
    return seconds_from_env(ENV_FLUSH, DEFAULT_FLUSH_S, MAX_FLUSH_S)


# One set of families per process: vLLM may build several loggers (tests, engine restarts),
# and registering the same names twice in REGISTRY raises.
_process_lock = threading.Lock()
_metrics: ContractMetrics | None = None
_process_exporters: dict[str, Any] = {}


def process_metrics() -> ContractMetrics:
    global _metrics
    with _process_lock:
        if _metrics is None:
            _metrics = ContractMetrics(REGISTRY, (Component.ENGINE, Component.KV_TRANSFER, Component.HOOKS))
        return _metrics


# One flush thread and one atexit hook per process for every live logger, held weakly. Each logger
# used to start its own thread and atexit.register(self.flush): both kept it alive for ever, so a
# process that builds AsyncLLM again and again (notebooks, RL loops, tests) gained a thread waking
# every flush interval, and a logger with all its recorders, per construction.
_live_loggers: weakref.WeakSet[SlaGuardStatLogger] = weakref.WeakSet()
_flusher_pid: int | None = None


def _flush_all() -> None:
    for lg in list(_live_loggers):
        lg.flush()


def _flush_forever(interval: float) -> None:
    while True:
        time.sleep(interval)
        with contextlib.suppress(Exception):  # flush() counts its own errors; this only keeps the thread alive
            _flush_all()


def _watch(lg: SlaGuardStatLogger) -> None:
    """Add ``lg`` to the process's flush thread (started once per process, again after a fork)."""
    global _flusher_pid
    with _process_lock:
        _live_loggers.add(lg)
        if _flusher_pid != os.getpid():
            _flusher_pid = os.getpid()
            threading.Thread(target=_flush_forever, args=(lg.flush_interval,), name="sla-guard-flush",
                             daemon=True).start()
            atexit.register(_flush_all)


_otel_mirror: Any = None
_otel_pid: int | None = None


def _process_otel(on_error: Any) -> Any:
    """The process's OTel mirror (None unless SLA_GUARD_OTLP_ENDPOINT is set), built once per process
    (a forked child builds its own: the parent's threads are not there): each mirror owns SDK
    providers, three threads and an atexit hook, which one per logger leaked. Its errors are counted
    by the newest logger."""
    global _otel_mirror, _otel_pid
    with _process_lock:
        if _otel_mirror is None or _otel_pid != os.getpid():
            _otel_pid = os.getpid()
            from exporters.otel import OtelMirror  # lazy: the OTel SDK is an optional extra

            _otel_mirror = OtelMirror.from_env()
            if _otel_mirror is None:
                return None
            atexit.register(_otel_mirror.shutdown)
        _otel_mirror.on_error = on_error
        return _otel_mirror


def _multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _export_process_samples(model: str, pool: str, dp_size: int, on_error=None) -> None:
    """Make the run directory's snapshots reach /metrics (once per process, see process_collector)."""
    with _process_lock:
        if _process_exporters:
            return
        run_dir = process_plugin.run_dir()
        if run_dir is None:
            return
        interval = interval_from_env()
        stale = max(30.0, 6 * interval)
        if _multiprocess_mode():
            mp_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
            _process_exporters["mirror"] = MultiprocessMirror(run_dir, mp_dir, model, pool, dp_size, interval,
                                                              stale, on_error).start()
        else:
            collector = SnapshotCollector(run_dir, model, pool, dp_size, stale, on_error)
            REGISTRY.register(collector)
            _process_exporters["collector"] = collector


def _served_model(vllm_config: Any) -> str:
    name = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    if isinstance(name, list | tuple):
        name = name[0] if name else ""
    return str(name)


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:
        return "unknown"


class _Engine:
    """Per-engine state: the bound recorder, the pending batch, what the config says."""

    __slots__ = ("batch", "dirty", "kv_consumer", "lock", "otel", "rec")

    def __init__(self, rec: EngineRecorder, kv_consumer: bool, otel: Any) -> None:
        self.rec = rec
        self.kv_consumer = kv_consumer
        self.otel = otel
        self.batch = StepBatch()
        self.dirty = False
        self.lock = threading.Lock()


class SlaGuardStatLogger(AggregateStatLoggerBase):
    """Emits the sla-guard contract from vLLM's SchedulerStats / IterationStats."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None, **later_args: Any) -> None:
        # later_args: what a newer vLLM may pass its stat-logger factories; a TypeError here would stop
        # vLLM's start, and hooks never raise into vLLM
        self._errors_logged: set[str] = set()
        self._error_children: dict[str, Any] = {}
        self._rejections: dict[str, Any] = {}
        self._engines: dict[int, _Engine] = {}
        self.model, self.pool = "unknown", c.Pool.MIXED.value
        self.metrics: ContractMetrics | None = None
        self.otel = None
        self.flush_interval = _flush_interval()
        self._flush_lock = threading.Lock()
        try:
            self._init(vllm_config, list(engine_indexes or [0]))
        except Exception as e:
            self._error("init", e)
        if later_args:
            log.info("sla-guard stat logger: vLLM passed arguments it does not read: %s", sorted(later_args))

    def _init(self, vllm_config: Any, engine_indexes: list[int]) -> None:
        mark_api_server()
        process_plugin.register()  # idempotent; covers API servers the general plugin missed
        self.metrics = process_metrics()
        kv = vllm_config.kv_transfer_config
        kv_role = getattr(kv, "kv_role", None) if kv is not None else None
        self.model = _served_model(vllm_config)
        self.pool = c.pool_from_kv_role(kv_role).value
        spec = vllm_config.speculative_config
        dp_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        info = {
            "kv_connector": (getattr(kv, "kv_connector", None) or "") if kv is not None else "",
            "kv_role": kv_role or "",
            "spec_method": (getattr(spec, "method", None) or "") if spec is not None else "",
            "num_spec_tokens": str(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else "0",
            "vllm_version": _vllm_version(),
            "dp_size": str(dp_size),
        }
        kv_consumer = bool(kv is not None and getattr(kv, "is_kv_consumer", False))
        self._hook_errors = self.metrics[c.HOOK_ERRORS]
        for reason in ADMISSION_REASONS:
            self._rejection(reason)
        try:
            own = weakref.WeakMethod(self._error)  # weak: the process's mirror must not keep self alive
            self.otel = _process_otel(lambda kind, exc: (own() or (lambda *_: None))(kind, exc))
        except Exception as e:  # OTel is a mirror: without it the Prometheus side still works
            self._error("otel", e)
        for idx in engine_indexes:
            rec = EngineRecorder(self.metrics, self.model, self.pool, idx)
            rec.engine_info(**info)
            if kv_consumer:
                rec.prebind_kv_fetch_stages(KV_FETCH_STAGES)
            if kv is not None:
                rec.prebind_kv_transfer()
            otel = self.otel.engine(self.model, self.pool, idx, info) if self.otel is not None else None
            self._engines[idx] = _Engine(rec, kv_consumer, otel)
        _export_process_samples(self.model, self.pool, dp_size, lambda e: self._error("process_samples", e))
        _watch(self)

    # -- error accounting --------------------------------------------------------------------------
    def _error(self, kind: str, exc: BaseException) -> None:
        try:
            child = self._error_children.get(kind)
            if child is None and self.metrics is not None:
                child = self._error_children[kind] = self.metrics[c.HOOK_ERRORS].labels(self.model, self.pool, kind)
            if child is not None:
                child.inc()
            if kind not in self._errors_logged:
                self._errors_logged.add(kind)
                log.warning("sla-guard hook error (kind=%s), counted and ignored from now on: %r", kind, exc,
                            exc_info=exc)
        except Exception:  # even accounting must not raise into vLLM
            pass

    def _engine(self, engine_idx: int) -> _Engine | None:
        eng = self._engines.get(engine_idx)
        if eng is None and self.metrics is not None:  # an index vLLM did not announce: still record it
            eng = self._engines[engine_idx] = _Engine(
                EngineRecorder(self.metrics, self.model, self.pool, engine_idx), False, None)
        return eng

    # -- StatLoggerBase ----------------------------------------------------------------------------
    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        """Fold one step into the engine's batch (cheap); the flush thread exports it."""
        eng = self._engines.get(engine_idx)
        if eng is None:
            try:
                eng = self._engine(engine_idx)
            except Exception as e:
                self._error("engine", e)
            if eng is None:
                return
        with eng.lock:
            b = eng.batch
            eng.dirty = True
            if scheduler_stats is not None:
                try:
                    b.add_scheduler(scheduler_stats, eng.kv_consumer)
                    sd = scheduler_stats.spec_decoding_stats
                    kvs = scheduler_stats.kv_connector_stats
                except Exception as e:
                    self._error("scheduler", e)
                    sd = kvs = None
                if sd is not None:
                    try:
                        b.add_spec(sd)
                    except Exception as e:
                        self._error("spec_decode", e)
                if kvs:
                    try:
                        b.add_kv_connector(kvs)
                    except Exception as e:
                        self._error("kv_connector", e)
            if iteration_stats is not None:
                try:
                    b.add_iteration(iteration_stats, _REASONS)
                except Exception as e:
                    self._error("iteration", e)
            big = b.size > MAX_BATCH
        if eng.otel is not None:
            self._otel(eng, scheduler_stats, iteration_stats)
        if big:  # the flush thread fell behind: bound memory by flushing here
            self.flush()

    def _otel(self, eng: _Engine, s: Any, it: Any) -> None:
        otel = eng.otel
        try:
            if s is not None:
                otel.scheduler(s.num_running_reqs, s.num_waiting_reqs + s.num_skipped_waiting_reqs, s.kv_cache_usage)
            if it is not None:
                if it.time_to_first_tokens_iter:
                    otel.latencies(it.time_to_first_tokens_iter)
                for f in it.finished_requests:
                    otel.finished(FinishedRequest(
                        e2e_s=f.e2e_latency, queue_s=f.queued_time, prefill_s=f.prefill_time,
                        decode_s=f.decode_time, tpot_s=f.mean_time_per_output_token,
                        prompt_tokens=f.num_prompt_tokens, cached_tokens=f.num_cached_tokens,
                        generated_tokens=f.num_generation_tokens, reason=_REASONS.get(f.finish_reason) or
                        str(f.finish_reason), request_id=f.request_id or ""), it.iteration_timestamp)
        except Exception as e:
            self._error("otel", e)

    def flush(self) -> None:
        """Apply every engine's pending batch to its Prometheus children (flush thread, log())."""
        with self._flush_lock:
            for eng in list(self._engines.values()):
                if not eng.dirty:
                    continue
                with eng.lock:
                    b, eng.batch, eng.dirty = eng.batch, StepBatch(), False
                try:
                    apply(eng.rec, b, self._error)  # per part: one bad value costs only itself
                except Exception as e:
                    self._error("flush", e)

    def _rejection(self, reason: str) -> Any:
        child = self._rejections.get(reason)
        if child is None and self.metrics is not None:
            child = self._rejections[reason] = self.metrics[c.ADMISSION_REJECTIONS].labels(self.model, self.pool,
                                                                                             reason)
        return child

    def record_admission_rejection(self, reason: str) -> None:
        """One request the API server refused at a queue limit (vLLM >= 0.32 ``check_admission``,
        HTTP 503): no engine saw it, so no latency histogram has it, and without this count the
        engine-scope SLOs read "ok" while clients are refused. vLLM calls it on aggregate loggers
        only (``PerEngineStatLoggerAdapter`` drops it), which this is; older vLLM never calls it.
        Counted at once, not batched (one increment, off the per-step path)."""
        try:
            child = self._rejection(reason if isinstance(reason, str) else str(reason))
            if child is not None:
                child.inc()
        except Exception as e:
            self._error("admission", e)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        self.flush()
