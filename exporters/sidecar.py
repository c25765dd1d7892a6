"""``sla-guard-sidecar``: the contract for vLLM deployments that cannot install the plugin.

At each scrape of its own /metrics it fetches vLLM's /metrics (httpx; ``--timeout`` is a total
deadline, ``--max-body-bytes`` a streamed size limit), maps vLLM's native families onto the
contract with the pool and model given on the command line and vLLM's ``engine`` label kept, and
samples the vLLM process tree (``--pid``, psutil).

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
flag; a dead vLLM is counted in slaguard_hook_errors_total{kind="scrape"} (a hung one ``timeout``,
an oversized page ``too_large``, an unparsable one ``parse``) and its engine series disappear
(absent, hence "unknown" for the guard), while the sidecar keeps serving. Problems inside a page
drop the affected family for that engine and are counted too (see ``map_exposition``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import socket
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import psutil
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from exporters import contract as c
from exporters.page_read import ACCEPT_ENCODING, PageNotText, PageTooLarge, read_page, run_bounded
from exporters.process_collector import families, snapshot_rows
from exporters.process_sampler import take_snapshot
from exporters.redact import install_log_redaction

log = logging.getLogger("sla_guard.sidecar")


@dataclass(frozen=True)
class Mapping:
    """One vLLM family -> one contract metric; ``label`` maps a vLLM label onto a contract label
    (``values`` renames its values; a value absent from a non-empty ``values`` is unmapped: the
    family is dropped for that engine and counted, see ``map_exposition``). Without ``values`` the
    label's values pass through as vLLM spells them, as the plugin passes them: finish reasons,
    KV-fetch stages and draft positions are open sets, and a reason new in vLLM is a new series,
    not a dropped family."""

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
    # vLLM >= 0.32, per API server (no engine label); older vLLM has no such family, the series is absent
    M("vllm:admission_rejections", c.ADMISSION_REJECTIONS, ("reason", "reason")),
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


@dataclass
class _Series:
    """One contract series being assembled, with the vLLM family and source labels it came from
    (two sources for one contract series is a collision, not a value to pick from)."""

    family: str
    src: tuple[tuple[str, str], ...]
    value: float | None = None
    buckets: dict[str, float] = field(default_factory=dict)
    sum: float | None = None
    count: float | None = None
    engine: str = "0"


def _histogram_ok(s: _Series) -> bool:
    """Exportable only as vLLM counted it: a +Inf bucket equal to _count (else the contract's
    _count would come from the last finite bucket and read e.g. 3/3 where vLLM counted 10), a
    _sum, and cumulative finite non-negative buckets."""
    try:
        les = sorted(s.buckets.items(), key=lambda b: float(b[0]))
    except ValueError:
        return False
    if "+Inf" not in s.buckets or s.sum is None or (s.count is not None and s.count != s.buckets["+Inf"]):
        return False
    values = [v for _, v in les]
    return all(math.isfinite(v) and v >= 0 for v in values) and values == sorted(values)


def map_exposition(text: str, model: str, pool: str) -> tuple[list[Metric], set[str], Counter[str]]:
    """vLLM exposition text -> (contract families, engine labels seen, problems by kind). Pure.

    A problem drops the whole vLLM family for that engine (absent reads "unknown" at the guard;
    a partial family would read as a wrong but plausible value) and is counted once per family
    and engine, so an operator sees the mapping broke:
    * ``unmapped_label``: a sample lacks the mapped label (vLLM renamed it), or has a value that a
      mapping with a ``values`` table (prompt-token sources) does not know;
    * ``label_collision``: two source series land on one contract series. The contract's
      ``model`` is ``--model`` (the guard overrides page labels too unless ``honor_labels``), so
      vLLM's ``model_name`` is not kept: two models on one engine cannot be told apart;
    * ``malformed_histogram``: see ``_histogram_ok``;
    * ``bad_value``: a negative or non-finite counter or gauge value;
    * ``no_vllm_families``: the page parsed but holds no family the sidecar maps (wrong URL).
    An unparsable page raises ``ValueError``.
    """
    series: dict[tuple[str, tuple[str, ...]], _Series] = {}
    engines: set[str] = set()
    problems: set[tuple[str, str, str]] = set()  # (kind, vLLM family, engine)
    seen_family = False
    for fam in text_string_to_metric_families(text):
        mp = BY_VLLM.get(fam.name)
        if mp is None:
            continue
        seen_family = True
        m = mp.metric
        hist = m.kind is c.Kind.HISTOGRAM
        renames = dict(mp.values)
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            engine = s.labels.get("engine", "0")
            per_engine = "engine" in m.labels  # admission rejections are per API server: no engine label
            if per_engine:
                engines.add(engine)
            extra: list[str] = []
            if mp.label is not None:
                raw = s.labels.get(mp.label[0])
                if raw is None or (renames and raw not in renames):
                    problems.add(("unmapped_label", fam.name, engine))
                    continue
                extra.append(renames.get(raw, raw))
            if mp.fixed is not None:
                extra.append(mp.fixed[1])
            labels = (model, pool, engine, *extra) if per_engine else (model, pool, *extra)
            src = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            ser = series.setdefault((m.name, labels), _Series(fam.name, src, engine=engine))
            if ser.family != fam.name or ser.src != src:
                problems.update({("label_collision", fam.name, engine), ("label_collision", ser.family, engine)})
                continue
            if not hist:
                if ser.value is not None:  # the same series twice
                    problems.add(("label_collision", fam.name, engine))
                if not (math.isfinite(s.value) and s.value >= 0):
                    # every mapped counter and gauge is a count, a ratio or a size: a negative or
                    # non-finite one would be read as a value (requests_running -5)
                    problems.add(("bad_value", fam.name, engine))
                ser.value = s.value
            elif s.name.endswith("_bucket"):
                le = s.labels.get("le", "")
                if le in ser.buckets:
                    problems.add(("malformed_histogram", fam.name, engine))
                ser.buckets[le] = s.value
            elif s.name.endswith("_sum"):
                ser.sum = s.value
            elif s.name.endswith("_count"):
                ser.count = s.value
    for ser in series.values():
        if BY_VLLM[ser.family].metric.kind is c.Kind.HISTOGRAM and not _histogram_ok(ser):
            problems.add(("malformed_histogram", ser.family, ser.engine))
    bad = {(fam, engine) for _, fam, engine in problems}
    out: dict[str, Metric] = {}
    for (name, labels), ser in series.items():
        if (ser.family, ser.engine) in bad or (ser.value is None and not ser.buckets):
            continue
        fam_out = out.setdefault(name, _family(BY_VLLM[ser.family].metric))
        if ser.buckets:
            buckets = sorted(ser.buckets.items(), key=lambda b: float(b[0]))
            fam_out.add_metric(list(labels), buckets, ser.sum)
        else:
            fam_out.add_metric(list(labels), ser.value)
    errors = Counter(kind for kind, _, _ in problems)
    if not seen_family:
        errors["no_vllm_families"] += 1
    return list(out.values()), engines, errors


def process_tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [root.pid, *(p.pid for p in root.children(recursive=True))]


ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"
MAX_BODY_BYTES = 8 * 1024 * 1024  # the guard's own scrape default
_SSL = httpx.create_ssl_context()  # built once: building one per fetch costs ~30 ms


class FetchFailed(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


async def _fetch_page(url: str, timeout_s: float, max_body_bytes: int) -> str:
    """vLLM's page, complete within ``timeout_s`` in total, or FetchFailed. As in
    ``sla_guard.ingest.scrape``: httpx's timeout bounds each read, so a page dripped a line a
    second would never time out; ``asyncio.timeout`` bounds the whole call. The body is streamed
    and abandoned past ``max_body_bytes`` (an endless page must not grow the sidecar)."""
    try:
        async with (asyncio.timeout(timeout_s),
                    httpx.AsyncClient(timeout=timeout_s, verify=_SSL,
                                      headers={"Accept": ACCEPT, "Accept-Encoding": ACCEPT_ENCODING}) as client,
                    client.stream("GET", url) as resp):
            if resp.status_code != 200:
                raise FetchFailed("scrape", f"HTTP {resp.status_code}")
            return await read_page(resp, max_body_bytes)
    except PageTooLarge as err:
        raise FetchFailed("too_large", str(err)) from err
    except PageNotText as err:
        raise FetchFailed("parse", str(err)) from err
    except (TimeoutError, httpx.TimeoutException) as err:
        raise FetchFailed("timeout", f"no complete answer within {timeout_s:g}s") from err
    except httpx.HTTPError as err:
        raise FetchFailed("scrape", f"{type(err).__name__}: {err}") from err


class SidecarCollector(Collector):
    """Scrape-time pass-through: vLLM /metrics + the process tree -> contract families.

    Each collect fetches on its own with a total deadline and holds no lock across the fetch, so
    concurrent scrapes of the sidecar each end by ``timeout_s`` instead of queueing behind a slow
    vLLM; any failure leaves the engine series absent (unknown) and is counted by kind."""

    def __init__(self, metrics_url: str, model: str, pool: str, pid: int | None, timeout_s: float = 3.0,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.url, self.model, self.pool, self.pid, self.timeout_s = metrics_url, model, pool, pid, timeout_s
        self.max_body_bytes = max_body_bytes
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()  # guards ``errors`` only
        self._root_start: float | None = None  # --pid's start time: a reused PID is not vLLM
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                self._root_start = psutil.Process(pid).create_time()

    def _error(self, kind: str, exc: BaseException | str, n: int = 1) -> None:
        with self._lock:
            first = kind not in self.errors
            self.errors[kind] = self.errors.get(kind, 0) + n
        if first:
            log.warning("sidecar %s error (logged once per kind): %s", kind, exc)

    def collect(self) -> Iterator[Metric]:
        fams: list[Metric] = []
        engines: set[str] = set()
        try:
            text = run_bounded(_fetch_page(self.url, self.timeout_s, self.max_body_bytes))
            fams, engines, problems = map_exposition(text, self.model, self.pool)
            for kind, n in problems.items():
                self._error(kind, f"{n} vLLM families dropped from {self.url}", n)
        except FetchFailed as e:
            self._error(e.kind, e)
        except Exception as e:  # unparsable page (prometheus_client's parser raises ValueError and others)
            self._error("parse", e)
        yield from fams
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
        with self._lock:
            counts = sorted(self.errors.items())
        for kind, n in counts:
            errors.add_metric([self.model, self.pool, kind], float(n))
        yield errors

    def _root_is_vllm(self) -> None:
        """Raise unless ``--pid`` is still the process it was at start (PID and start time): once vLLM
        exited, its PID can go to an unrelated process, which was exported as vLLM's API server
        (a fake RSS drop read as a restart, then a stranger's memory followed as vLLM's)."""
        start = psutil.Process(self.pid).create_time()
        if self._root_start is None:
            self._root_start = start
        elif abs(start - self._root_start) >= 1.0:
            raise psutil.NoSuchProcess(
                self.pid, msg=f"--pid {self.pid} exited; its PID now belongs to another process: pass vLLM's new PID"
            )

    def _processes(self, dp_size: int) -> Iterable[Metric]:
        self._root_is_vllm()
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
    ap.add_argument("--timeout", type=float, default=3.0,
                    help="total seconds for one fetch of vLLM's /metrics (connect, headers and body)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help="largest vLLM page read; a larger one is abandoned and counted (kind=too_large)")
    a = ap.parse_args(argv)
    if not a.metrics_url.startswith(("http://", "https://")):
        ap.error(f"--metrics-url must be an http(s) URL, got {a.metrics_url!r}")
    host, _, port = a.listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address, written as in a URL: [::1]:9400
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        ap.error(f"--listen must be HOST:PORT (e.g. 127.0.0.1:9400 or [::1]:9400), got {a.listen!r}")
    a.host, a.port = host, int(port)
    if a.pid is not None and not psutil.pid_exists(a.pid):
        ap.error(f"--pid {a.pid}: no such process (pass the vLLM server's PID)")
    if a.timeout <= 0:
        ap.error("--timeout must be > 0 seconds")
    if a.max_body_bytes < 1024:
        ap.error("--max-body-bytes must be >= 1024")
    return a


def build_registry(a: argparse.Namespace) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SidecarCollector(a.metrics_url, a.model, a.pool, a.pid, a.timeout, a.max_body_bytes))
    return reg


# the longest a connection to the sidecar may stay silent while sending its request or taking the answer
REQUEST_TIMEOUT_S = 10.0


def serve_metrics(host: str, port: int, registry: CollectorRegistry,
                  request_timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """prometheus_client's threaded /metrics server (``start_http_server``) with a socket timeout on
    every connection: there a half-open connection (a request never finished) held its thread
    forever, 300 of them 300 threads. OSError if ``host:port`` cannot be listened on."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

        def handle_error(self, request, client_address) -> None:
            if not isinstance(sys.exc_info()[1], TimeoutError):  # a silent client closed: not an error
                super().handle_error(request, client_address)

    class Handler(WSGIRequestHandler):
        timeout = request_timeout_s  # StreamRequestHandler: each read and write of the connection

        def log_message(self, format: str, *args: object) -> None:  # requests are not logged
            pass

    httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="sidecar-metrics")
    thread.start()
    return httpd, thread


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction(logging.INFO)  # --metrics-url may carry user:password@ or ?token=
    a = parse_args(argv)
    try:
        server, _thread = serve_metrics(a.host, a.port, build_registry(a))
    except OSError as err:  # port taken, host not resolvable or not local: say so, not a traceback
        print(f"sla-guard-sidecar: error: --listen {a.listen}: cannot listen there ({err.strerror or err}); "
              "pass a free local HOST:PORT", file=sys.stderr)
        return 2
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
