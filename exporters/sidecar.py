"""``sla-guard-sidecar``: the contract for vLLM deployments that cannot install the plugin.

At each scrape of its own /metrics it fetches vLLM's /metrics (httpx, short timeout), maps
vLLM's native families onto the contract with the pool and model given on the command line and
vLLM's ``engine`` label kept, and samples the vLLM process tree (``--pid``, psutil).

What is mapped how (see docs/hooks.md for the full table):
* counters and gauges: passed through (absolute values, so vLLM restarts reset them as usual);
* histograms: passed through with vLLM's OWN bucket boundaries. Re-bucketing a histogram onto
  other boundaries cannot be exact, so the sidecar does not invent counts: where vLLM has no
  boundary at an SLA threshold (inter-token latency and TPOT have none at 0.020 s), the
  threshold's bucket is missing and the guard reports "unknown" for that SLI unless vLLM is
  started with ``--custom-histogram-buckets`` containing the threshold;
* vLLM's TPOT histogram also counts one-token requests (TPOT 0); the plugin does not;
* not available from outside vLLM: engine steps, draft tokens per position, GC of the vLLM
  processes, NIXL handshake failures (vLLM folds them into failed transfers).

Loopback by default (``--listen 127.0.0.1:9400``); bad arguments exit with a message naming the
flag; a dead vLLM is counted in slaguard_hook_errors_total{kind="scrape"} and its engine series
disappear (absent, hence "unknown" for the guard), while the sidecar keeps serving.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import httpx
import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from exporters import contract as c
from exporters.process_collector import families, snapshot_rows
from exporters.process_sampler import take_snapshot

log = logging.getLogger("sla_guard.sidecar")


@dataclass(frozen=True)
class Mapping:
    """One vLLM family -> one contract metric; ``label`` maps a vLLM label onto a contract label
    (``values`` renames its values; a value absent from a non-empty ``values`` is dropped)."""

    vllm: str  # family name as prometheus_client's parser reports it (no _total)
    metric: c.Metric
    label: tuple[str, str] | None = None
    values: tuple[tuple[str, str], ...] = ()
    fixed: tuple[str, str] | None = None  # a constant contract label (e.g. cache="external")


M = Mapping
MAPPINGS: tuple[Mapping, ...] = (
    M("vllm:time_to_first_token_seconds", c.REQUEST_TTFT),
    M("vllm:request_time_per_output_token_seconds", c.REQUEST_TPOT),
    M("vllm:inter_token_latency_seconds", c.INTER_TOKEN_LATENCY),
    M("vllm:e2e_request_latency_seconds", c.REQUEST_E2E),
    M("vllm:request_queue_time_seconds", c.REQUEST_QUEUE),
    M("vllm:request_prefill_time_seconds", c.REQUEST_PREFILL),
    M("vllm:request_decode_time_seconds", c.REQUEST_DECODE),
    M("vllm:request_success", c.REQUESTS_FINISHED, ("finished_reason", "reason")),
    M("vllm:prompt_tokens_by_source", c.PROMPT_TOKENS, ("source", "source"),
      (("local_compute", "computed"), ("local_cache_hit", "local_cache_hit"),
       ("external_kv_transfer", "external_kv_transfer"))),
    M("vllm:generation_tokens", c.GENERATION_TOKENS),
    M("vllm:num_requests_running", c.REQUESTS_RUNNING),
    M("vllm:num_requests_waiting", c.REQUESTS_WAITING),
    M("vllm:num_requests_kv_fetch_by_stage", c.REQUESTS_KV_FETCH, ("stage", "stage")),
    M("vllm:kv_cache_usage_perc", c.KV_CACHE_USAGE),
    M("vllm:prefix_cache_queries", c.PREFIX_CACHE_QUERIES, fixed=("cache", "local")),
    M("vllm:prefix_cache_hits", c.PREFIX_CACHE_HITS, fixed=("cache", "local")),
    M("vllm:external_prefix_cache_queries", c.PREFIX_CACHE_QUERIES, fixed=("cache", "external")),
    M("vllm:external_prefix_cache_hits", c.PREFIX_CACHE_HITS, fixed=("cache", "external")),
    M("vllm:num_preemptions", c.PREEMPTIONS),
    M("vllm:spec_decode_num_drafts", c.SPEC_DRAFTS),
    M("vllm:spec_decode_num_draft_tokens", c.SPEC_DRAFT_TOKENS),
    M("vllm:spec_decode_num_accepted_tokens", c.SPEC_ACCEPTED_TOKENS),
    M("vllm:spec_decode_num_accepted_tokens_per_pos", c.SPEC_ACCEPTED_TOKENS_POS, ("position", "position")),
    M("vllm:nixl_xfer_time_seconds", c.KV_XFER_DURATION),
    M("vllm:nixl_post_time_seconds", c.KV_XFER_POST_DURATION),
    M("vllm:nixl_bytes_transferred", c.KV_XFER_BYTES),
    M("vllm:nixl_num_descriptors", c.KV_XFER_DESCRIPTORS),
    M("vllm:nixl_num_failed_transfers", c.KV_XFER_FAILURES, fixed=("kind", "transfer")),
    M("vllm:nixl_num_failed_notifications", c.KV_XFER_FAILURES, fixed=("kind", "notification")),
    M("vllm:nixl_num_kv_expired_reqs", c.KV_XFER_EXPIRED),
    M("vllm:nixl_num_notifications_after_expiry", c.KV_XFER_LATE_NOTIFICATIONS),
)
del M
BY_VLLM = {m.vllm: m for m in MAPPINGS}


def _family(metric: c.Metric) -> Metric:
    cls = {c.Kind.COUNTER: CounterMetricFamily, c.Kind.GAUGE: GaugeMetricFamily,
           c.Kind.HISTOGRAM: HistogramMetricFamily}[metric.kind]
    return cls(metric.name, metric.help, labels=list(metric.labels))


def map_exposition(text: str, model: str, pool: str) -> tuple[list[Metric], set[str]]:
    """vLLM exposition text -> (contract families, engine labels seen). Pure function."""
    out: dict[str, Metric] = {}
    engines: set[str] = set()
    hist: dict[tuple[str, tuple[str, ...]], dict] = {}
    for fam in text_string_to_metric_families(text):
        mp = BY_VLLM.get(fam.name)
        if mp is None:
            continue
        m = mp.metric
        for s in fam.samples:
            engine = s.labels.get("engine", "0")
            extra: list[str] = []
            if mp.label is not None:
                raw = s.labels.get(mp.label[0])
                if raw is None:
                    continue
                renames = dict(mp.values)
                if renames and raw not in renames:
                    continue
                extra.append(renames.get(raw, raw))
            if mp.fixed is not None:
                extra.append(mp.fixed[1])
            labels = (model, pool, engine, *extra)
            engines.add(engine)
            if m.kind is c.Kind.HISTOGRAM:
                h = hist.setdefault((m.name, labels), {"metric": m, "buckets": [], "sum": 0.0})
                if s.name.endswith("_bucket"):
                    h["buckets"].append((s.labels["le"], s.value))
                elif s.name.endswith("_sum"):
                    h["sum"] = s.value
            elif m.kind is c.Kind.COUNTER:
                if s.name.endswith("_total"):
                    out.setdefault(m.name, _family(m)).add_metric(list(labels), s.value)
            else:
                out.setdefault(m.name, _family(m)).add_metric(list(labels), s.value)
    for (name, labels), h in hist.items():
        buckets = sorted(h["buckets"], key=lambda b: float(b[0]))
        out.setdefault(name, _family(h["metric"])).add_metric(list(labels), buckets, h["sum"])
    return list(out.values()), engines


def process_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [root.pid, *(p.pid for p in root.children(recursive=True))]


class SidecarCollector(Collector):
    """Scrape-time pass-through: vLLM /metrics + the process tree -> contract families."""

    def __init__(self, metrics_url: str, model: str, pool: str, pid: int | None, timeout_s: float = 3.0) -> None:
        self.url, self.model, self.pool, self.pid, self.timeout_s = metrics_url, model, pool, pid, timeout_s
        self.errors: dict[str, int] = {}
        self._client = httpx.Client(timeout=timeout_s)
        self._lock = threading.Lock()

    def _error(self, kind: str, exc: BaseException) -> None:
        n = self.errors.get(kind, 0)
        self.errors[kind] = n + 1
        if n == 0:
            log.warning("sidecar %s error (logged once per kind): %r", kind, exc)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._collect()

    def _collect(self) -> Iterable[Metric]:
        engines: set[str] = set()
        try:
            r = self._client.get(self.url)
            r.raise_for_status()
            families, engines = map_exposition(r.text, self.model, self.pool)
            yield from families
        except Exception as e:  # dead or broken target: engine series absent, counted
            self._error("scrape", e)
        info = _family(c.ENGINE_INFO)
        for e in sorted(engines):
            info.add_metric([self.model, self.pool, e, "", "", "", "", "", str(len(engines))], 1.0)
        yield info
        if self.pid is not None:
            try:
                yield from self._processes(max(len(engines), 1))
            except Exception as e:
                self._error("process", e)
        errors = _family(c.HOOK_ERRORS)
        for kind, n in sorted(self.errors.items()):
            errors.add_metric([self.model, self.pool, kind], float(n))
        yield errors

    def _processes(self, dp_size: int) -> Iterable[Metric]:
        snaps = []
        for pid in process_tree(self.pid):
            try:
                snap = take_snapshot(pid, api_server=(pid == self.pid))
            except psutil.Error:
                continue  # exited between listing and sampling
            if "resource_tracker" in snap.title:
                continue  # multiprocessing helper, not a vLLM process
            snaps.append(snap)
        return families(snapshot_rows(snaps, self.model, self.pool, dp_size))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="sla-guard-sidecar", description=__doc__.splitlines()[0])
    ap.add_argument("--metrics-url", required=True, help="vLLM /metrics URL, e.g. http://127.0.0.1:8000/metrics")
    ap.add_argument("--pool", required=True, choices=[p.value for p in c.ENGINE_POOLS], help="pool this vLLM serves")
    ap.add_argument("--model", required=True, help="model label (vLLM's served model name)")
    ap.add_argument("--pid", type=int, default=None, help="PID of the vLLM server; its process tree is sampled")
    ap.add_argument("--listen", default="127.0.0.1:9400", help="HOST:PORT for the sidecar's /metrics")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for vLLM's /metrics")
    a = ap.parse_args(argv)
    if not a.metrics_url.startswith(("http://", "https://")):
        ap.error(f"--metrics-url must be an http(s) URL, got {a.metrics_url!r}")
    host, _, port = a.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        ap.error(f"--listen must be HOST:PORT (e.g. 127.0.0.1:9400), got {a.listen!r}")
    a.host, a.port = host, int(port)
    if a.pid is not None and not psutil.pid_exists(a.pid):
        ap.error(f"--pid {a.pid}: no such process (pass the vLLM server's PID)")
    if a.timeout <= 0:
        ap.error("--timeout must be > 0 seconds")
    return a


def build_registry(a: argparse.Namespace) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SidecarCollector(a.metrics_url, a.model, a.pool, a.pid, a.timeout))
    return reg


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    server, _thread = start_http_server(a.port, addr=a.host, registry=build_registry(a))
    log.info("sla-guard-sidecar serving http://%s:%d/metrics for %s (pool=%s)", a.host, a.port, a.metrics_url,
             a.pool)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            stop.wait(1.0)
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
