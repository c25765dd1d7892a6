"""Prometheus mode: a ``MetricsView`` answered by PromQL over Prometheus's HTTP API.

For fleets already scraped by Prometheus, Thanos or Mimir: no second scraper, and long windows
(3d, 30d) come straight from the server's retention. Each view method is the PromQL query it
documents, evaluated with ``&time=`` at the evaluation timestamp, so the guard and a dashboard
on the same server see the same numbers.

Failures (unreachable, timeout, 4xx/5xx, a body that is not a Prometheus answer) never raise
into an evaluator: the query returns no data (evaluators then say "unknown"), the error is
counted in ``guard_scrape_errors{target="prometheus",kind}``, and the next query tries again.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx
import numpy as np

from exporters import contract as c
from exporters import promql as contract_promql
from exporters.label_text import any_of_literal, le_spellings, string_literal
from exporters.prometheus import ContractMetrics
from exporters.redact import peer_text, redact_text, strip_userinfo
from sla_guard import promql
from sla_guard.config import PrometheusSource as PrometheusConfig
from sla_guard.ingest.source import TargetState
from sla_guard.model import Labels, Series
from sla_guard.outbound import env_value

log = logging.getLogger("sla_guard.ingest.prometheus")


def selector(metric: str, matchers: Mapping[str, str], extra: str = "") -> str:
    """``metric{a="x",...}`` with values escaped; ``extra`` is raw matcher text from config."""
    parts = [f"{k}={string_literal(v)}" for k, v in sorted(matchers.items())]
    if extra:
        parts.append(extra)
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def duration(seconds: float) -> str:
    """A PromQL duration in whole milliseconds (``300000ms``), exact for any window."""
    return f"{round(seconds * 1000)}ms"


# the most distinct queries remembered for the next tick's prefetch (a tick makes ~75)
MAX_PREFETCH = 2000
# ``range`` over a longer window than this reads incrementally: each call re-reads only the last
# RANGE_REREAD_S (samples that reach the server late land there) and keeps the rest
RANGE_REREAD_S = 300.0
RANGE_CACHE_MAX = 4096  # selectors whose samples ``range`` keeps (least recently read dropped)
# ``increase`` over a window this long or longer is summed from hour slices, each asked once
# (``_sliced_increase``): over 30 days Prometheus reads every sample of the period at each tick
SLICED_FROM_S = 86_400.0
SLICE_S = 3600.0
SLICES_MAX = 256  # selectors whose slices are kept (least recently used dropped)
# ``bucket_covered_since`` asks its slices this many a query, each piece kept once settled
COVER_PIECE_SLICES = 24
# the most slices one query asks for: a restarted guard's first read of a 30-day period is 30 of
# them, each kept as it arrives, so a fleet whose whole period passes the query deadline is read
# over a few ticks (unknown meanwhile) instead of never
SLICES_PER_QUERY = 24
# a matrix sample ``[1712345678.123,"8123456789"],`` is ~31 bytes: a read is split into pieces of
# at most a quarter of ``max_body_bytes`` at this size per sample
RANGE_BYTES_PER_SAMPLE = 48
# labels that name one process whatever job or instance exported it (``check_duplicates``)
DUPLICATE_IDENTITY = ("model", "pool", "engine", "role", "process", "process_pid", "start_time")
# the label ``uncovered_buckets`` tells its windows apart by in its one answer
WINDOW_LABEL = "sla_guard_window_s"


LOG_EVERY_S = 60.0  # a failed query's kind is logged at most this often (``PrometheusView._log_error``)


@dataclass(slots=True)
class _RangeCache:
    """Samples of one selector already read, in the server's time: complete over [since, through]."""

    since: float
    through: float
    series: dict[Labels, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def samples(self) -> int:
        return sum(len(t) for t, _ in self.series.values())

    def merge(self, got: list[tuple[Labels, np.ndarray, np.ndarray]], lo: float, hi: float, with_lo: bool) -> None:
        """Replace what was held over [lo, hi] (or (lo, hi]) by the samples just read for it."""
        for labels, (t, v) in list(self.series.items()):
            keep = t < lo if with_lo else t <= lo
            if not keep.all():
                self.series[labels] = (t[keep], v[keep])
        for labels, t, v in got:
            inside = ((t >= lo) if with_lo else (t > lo)) & (t <= hi)
            old_t, old_v = self.series.get(labels, (np.empty(0), np.empty(0)))
            self.series[labels] = (np.concatenate([old_t, t[inside]]), np.concatenate([old_v, v[inside]]))
        self.through = hi

    def trim(self, since: float) -> None:
        """Forget samples before ``since`` (and series left without any)."""
        for labels, (t, v) in list(self.series.items()):
            keep = t >= since
            if not keep.any():
                del self.series[labels]
            elif not keep.all():
                self.series[labels] = (t[keep], v[keep])
        self.since = max(self.since, since)


class PrometheusError(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


def _result(data: dict | None, kind: str) -> list[dict]:
    """The result items of a ``kind`` answer; [] for another kind or a malformed one. A wrong
    shape (``result: null``, an item that is not an object) reads as no data, hence unknown: it
    raised into the evaluator before, which then kept serving the previous tick's verdicts."""
    if data is None or data.get("resultType") != kind or not isinstance(data.get("result"), list):
        return []
    return [item for item in data["result"] if isinstance(item, dict)]


def _labels(item: dict) -> Labels | None:
    """An item's labels without ``__name__``; None when ``metric`` is not an object of strings."""
    metric = item.get("metric", {})
    if not isinstance(metric, dict) or not all(isinstance(v, str) for v in metric.values()):
        return None
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def _matrix(data: dict | None) -> list[tuple[Labels, np.ndarray, np.ndarray]]:
    """The series of a matrix answer as (labels, times, values); items of the wrong shape are left out."""
    out = []
    for item in _result(data, "matrix"):
        labels, vals = _labels(item), item.get("values")
        points = [q for q in map(_point, vals) if q is not None] if isinstance(vals, list) else []
        if labels is None or not points:
            continue
        out.append((labels, np.array([q[0] for q in points]), np.array([q[1] for q in points])))
    return out


@dataclass
class _Slices:
    """One selector's hour slices (``PrometheusView._sliced_increase``): a row of values per slice
    end, a column per group (NaN where the group had none). Kept as arrays: a 30-day period is
    720 slices of every group, which as dicts of label tuples took 352 bytes a value (10 as arrays;
    120 groups: 30.4 vs 0.84 MB a selector)."""

    columns: dict[Labels, int] = field(default_factory=dict)
    rows: dict[float, np.ndarray] = field(default_factory=dict)
    span_s: float = 0.0  # the longest window the selector is asked for

    def put(self, end: float, values: dict[Labels, float]) -> None:
        for labels in values:
            self.columns.setdefault(labels, len(self.columns))
        row = np.full(len(self.columns), np.nan)
        for labels, v in values.items():
            row[self.columns[labels]] = v
        self.rows[end] = row

    def total(self, ends: list[float]) -> dict[Labels, float]:
        """Each group's sum over the slices ``ends``; a group with no value in any left out."""
        grid = np.full((len(ends), len(self.columns)), np.nan)
        for i, e in enumerate(ends):
            row = self.rows[e]
            grid[i, :len(row)] = row
        present = ~np.isnan(grid).all(axis=0)
        sums = np.nansum(grid, axis=0)
        return {labels: float(sums[i]) for labels, i in self.columns.items() if present[i]}


def uncovered_query(metric: c.Metric, threshold: float, windows_s: Iterable[float],
                    matchers: tuple[str, ...] = ()) -> str:
    """One query for the histogram children with requests in each window whose ``le=threshold``
    bucket does not cover it (``exporters.promql.bucket_covered``), told apart by ``WINDOW_LABEL``."""
    parts = []
    for w in windows_s:
        d = duration(w)
        uncovered = (f"({contract_promql.increase(metric, d, '_count', matchers)} > 0) "
                     f"unless ({contract_promql.bucket_covered(metric, threshold, d, matchers)})")
        parts.append(f'label_replace({uncovered}, "{WINDOW_LABEL}", "{float(w)!r}", "", "")')
    return " or ".join(parts)


def _values(data: dict | None) -> dict[Labels, float]:
    """A vector answer as {labels: value}; NaN values and items of the wrong shape are left out."""
    out: dict[Labels, float] = {}
    for item in _result(data, "vector"):
        labels, point = _labels(item), _point(item.get("value"))
        if labels is not None and point is not None and not math.isnan(point[1]):
            out[labels] = point[1]
    return out


def _point(p: object) -> tuple[float, float] | None:
    """``[time, "value"]`` as floats; None when it is not such a pair."""
    if not isinstance(p, list | tuple) or len(p) != 2:
        return None
    try:
        return float(p[0]), float(p[1])
    except (TypeError, ValueError):
        return None


class PrometheusView:
    """MetricsView over one Prometheus-compatible server (synchronous httpx; the guard runs
    evaluators off its event loop)."""

    serves_long_windows = True  # the server's retention answers 3d and 30d windows
    window_label = None

    def __init__(self, url: str, *, timeout_s: float = 10.0, token: str | None = None, extra_selector: str = "",
                 transport: httpx.BaseTransport | None = None, concurrency: int = 8,
                 max_body_bytes: int = 64 * 1024 * 1024, accept_partial: bool = False,
                 headers: Mapping[str, str] | None = None) -> None:
        """Credentials never stay in ``self.url`` (logged with each request, shown in
        /v1/targets): ``user:pw@`` becomes explicit Basic auth, or is dropped when a bearer
        ``token`` is given (explicit wins; httpx would otherwise replace the bearer with the
        URL's Basic auth), and query parameters go to the client (sent, never shown).
        ``headers`` (a tenant's ``X-Scope-OrgID``, an API key) go with every query, never shown."""
        from urllib.parse import parse_qsl, urlsplit, urlunsplit

        url, userinfo = strip_userinfo(url)
        params: list[tuple[str, str]] = []
        try:
            p = urlsplit(url)
            if p.query:
                params = parse_qsl(p.query, keep_blank_values=True)
                url = urlunsplit((p.scheme, p.netloc, p.path, "", ""))
        except ValueError:
            pass  # httpx rejects it at the first query, with a redacted error
        headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        auth = httpx.BasicAuth(*userinfo) if userinfo is not None and not token else None
        if userinfo is not None and token:
            log.warning("Prometheus URL has credentials and a bearer token is configured: using the bearer token")
        self.url = url.rstrip("/")
        self.extra = extra_selector
        self._client = httpx.Client(timeout=timeout_s, headers=headers, auth=auth, params=params or None,
                                    transport=transport)
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.accept_partial = accept_partial
        self.deadline: float | None = None
        self.last_error_at: float | None = None
        # prefetch: the queries of one tick are the next tick's too (same pools, same windows);
        # ``prefetch`` runs last tick's set concurrently, the evaluators' calls then hit the cache
        self.concurrency = concurrency
        self._used: dict[str, None] = {}
        self._cache: dict[tuple[str, float], dict | None] = {}
        self._stalls: tuple[float, list[dict[str, str | float]]] | None = None  # (at, answer): ``hook_stalls``
        # (selector, by) -> its hour slices, by end on the server's clock: ``_sliced_increase``
        self._slices: OrderedDict[tuple[str, tuple[str, ...]], _Slices] = OrderedDict()
        self._newest: dict[tuple[str, tuple[str, ...], float], dict[Labels, float]] = {}  # this tick's
        # (histogram, threshold, window, step) -> (at, answer): ``bucket_covered_since``
        self._covered: dict[tuple[str, float, float, float], tuple[float, dict[Labels, float]]] = {}
        # (histogram, threshold, window, step) -> {piece end on the server's clock: child -> its last
        # uncovered slice's end}: the settled pieces of ``bucket_covered_since``
        self._cover_pieces: dict[tuple[str, float, float, float], dict[float, dict[Labels, float]]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._io: concurrent.futures.ThreadPoolExecutor | None = None  # requests, each within its deadline
        self._metrics: ContractMetrics | None = None
        self.errors: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # error kind -> (last logged, errors since)
        self.last_error: str | None = None
        self.last_ok: float | None = None  # wall clock, shown as the target's last scrape
        self.last_ok_mono: float | None = None  # ``time.monotonic``: for how long since (``ready``)
        self.queries = 0
        # answers that were no data because the query failed (cached or not): an evaluator that
        # reads "no series" as "gone" compares it around its queries (``failed_queries``)
        self.failed_queries = 0
        # Prometheus's clock minus the guard's (``sync_clock``): queries are sent at ``at`` plus it
        self.clock_offset_s = 0.0
        # ``range`` over long windows: what was read, per selector (``_RangeCache``)
        self._ranges: OrderedDict[str, _RangeCache] = OrderedDict()

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self._metrics = metrics

    def count_error(self, kind: str) -> None:
        """Count a problem found in answers (not a failed query) where failed queries are counted."""
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self._metrics is not None:
            self._metrics[c.GUARD_SCRAPE_ERRORS].labels("prometheus", kind).inc()

    # -- transport -----------------------------------------------------------------------------
    def set_deadline(self, deadline: float | None) -> None:
        """Every query until the next call must finish by ``deadline`` (``time.monotonic``);
        the guard sets one per tick so a slow server cannot stretch a tick past its budget."""
        self.deadline = deadline

    def _budget(self, deadline: float | None) -> float:
        """Seconds this query may take in total: the per-query timeout, cut to the tick's budget."""
        deadline = self.deadline if deadline is None else deadline
        if deadline is None:
            return self.timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError("deadline", "the tick's query budget was spent before this query")
        return min(self.timeout_s, left)

    def _get(self, params: dict[str, str], deadline: float | None) -> tuple[int, bytes]:
        """GET /api/v1/query within a total deadline over connect, headers and body. httpx's
        timeout bounds each read only, so a server trickling its headers a byte at a time held a
        query for minutes; the request runs on an I/O thread and is abandoned at the deadline
        (the thread ends at httpx's own timeouts; a request still queued is cancelled)."""
        budget = self._budget(deadline)
        if self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(2 * self.concurrency,
                                                             thread_name_prefix="sla-guard-promql-io")
        fut = self._io.submit(self._fetch, params, budget, time.monotonic() + budget)
        try:
            return fut.result(timeout=budget)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise PrometheusError("timeout", f"Prometheus answer not complete within {budget:.3g}s") from None

    def _fetch(self, params: dict[str, str], budget: float, end: float) -> tuple[int, bytes]:
        """The request itself: the body streamed and bounded by ``max_body_bytes``; an abandoned
        one stops at its next chunk past ``end`` rather than reading the rest."""
        chunks: list[bytes] = []
        size, limit = 0, self.max_body_bytes
        with self._client.stream("GET", f"{self.url}/api/v1/query", params=params, timeout=budget) as r:
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise PrometheusError("too_large", f"answer of {declared} bytes > source.max_body_bytes {limit}")
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > limit:  # never buffered beyond the limit
                    raise PrometheusError("too_large", f"answer over source.max_body_bytes {limit}")
                chunks.append(chunk)
                if time.monotonic() > end:
                    raise PrometheusError("timeout", f"Prometheus answer not complete within {budget:.3g}s")
            return r.status_code, b"".join(chunks)

    def _refused(self, status: int, raw: bytes) -> str:
        """One line for a 401/403/404 that says which field to set: a Mimir or Cortex without a
        tenant answers 401 "no org id" as text, which read "HTTP 401, body is not JSON"."""
        said = raw[:500].decode("utf-8", "replace").strip()
        try:  # Prometheus's own JSON error, if it is one
            body = json.loads(said)
            said = str(body.get("error") or said) if isinstance(body, dict) else said
        except ValueError:
            pass
        said = f" ({peer_text(said.splitlines()[0], 120)})" if said else ""
        if status == 404:
            return (f"Prometheus answered HTTP 404{said} for {self.url}/api/v1/query: no query API at that path; "
                    f"set source.url to the server's base URL with its path prefix if it has one (e.g. "
                    f"http://host:9090/prom for --web.route-prefix=/prom, or the Ingress path), without /api/v1")
        if "org id" in said.lower():
            return (f"Prometheus answered HTTP {status}{said}: a multi-tenant server (Mimir, Cortex) needs the "
                    f"tenant: set source.headers: {{X-Scope-OrgID: <tenant>}}")
        return (f"Prometheus answered HTTP {status}{said}: the server wants credentials: set source.bearer_token_env, "
                f"user:password@ in source.url, or the header it expects in source.headers / source.headers_env")

    def prefetch(self, at: float) -> int:
        """Run the queries the previous tick asked for, now at time ``at``, ``concurrency`` at a
        time within the tick's deadline, and keep their answers for this tick's calls: a tick
        costs about (queries / concurrency) round trips instead of one per query. Returns how many."""
        queries = list(self._used)
        self._used = {}
        self._cache = {}
        if not queries:
            return 0
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="sla-guard-promql")
        answers = list(self._pool.map(lambda q: self._query_now(q, at, None), queries))
        self._cache = {(q, at): a for q, a in zip(queries, answers, strict=True)}
        return len(queries)

    def query(self, promql: str, at: float, *, deadline: float | None = None, prefetch: bool = True) -> dict | None:
        """``/api/v1/query`` at time ``at``; the ``data`` object, or None after counting why.
        ``deadline`` (``time.monotonic``) overrides the tick's. Served from the prefetched
        answers when this tick's prefetch already ran it; ``prefetch=False``: a one-off query
        the next tick will not ask again, so not sent ahead for it."""
        if prefetch and len(self._used) < MAX_PREFETCH:
            self._used[promql] = None
        key = (promql, at)
        data = self._cache.pop(key) if key in self._cache else self._query_now(promql, at, deadline)
        if data is None:
            self.failed_queries += 1
        return data

    def _query_now(self, promql: str, at: float, deadline: float | None) -> dict | None:
        self.queries += 1
        try:
            try:
                status, raw = self._get({"query": promql, "time": f"{at + self.clock_offset_s:.3f}"}, deadline)
            except httpx.TimeoutException as err:
                raise PrometheusError("timeout", f"Prometheus did not answer in time: {err}") from err
            except httpx.HTTPError as err:
                raise PrometheusError("connect", f"Prometheus unreachable: {type(err).__name__}: {err}") from err
            if status >= 500:
                raise PrometheusError("http_status", f"Prometheus answered HTTP {status}")
            if status in (401, 403, 404):
                raise PrometheusError("auth" if status != 404 else "http_status", self._refused(status, raw))
            try:
                body = json.loads(raw)
            except ValueError as err:
                raise PrometheusError("bad_response", f"HTTP {status}, body is not JSON") from err
            if not isinstance(body, dict) or body.get("status") != "success" or not isinstance(body.get("data"), dict):
                err = body.get("error") if isinstance(body, dict) else None
                said = peer_text(err) if err else "unexpected answer"
                raise PrometheusError("query" if status in (400, 422) else "bad_response",
                                      f"HTTP {status}: {said} for {promql}")
            warnings = body.get("warnings")
            if warnings and not self.accept_partial:
                # a remote-read endpoint or a store that failed (Prometheus, Thanos, Mimir): the
                # data are partial, and a mean over part of the requests is not the SLA's
                first = warnings[0] if isinstance(warnings, list) else warnings
                raise PrometheusError("partial", f"Prometheus answered with warnings (partial data; "
                                                 f"source.accept_partial: true uses them): {peer_text(first)}")
        except PrometheusError as err:
            self.errors[err.kind] = self.errors.get(err.kind, 0) + 1
            msg = redact_text(str(err))  # httpx's messages can quote the request URL
            self.last_error = f"{err.kind}: {msg}"
            self.last_error_at = time.time()
            if self._metrics is not None:
                self._metrics[c.GUARD_SCRAPE_ERRORS].labels("prometheus", err.kind).inc()
            self._log_error(err.kind, msg)
            return None
        self.last_ok = time.time()
        self.last_ok_mono = time.monotonic()
        self.last_error = None
        return body["data"]

    def _log_error(self, kind: str, msg: str) -> None:
        """Log a failed query once per kind a minute, with how many more there were: a tick sends
        tens of queries, and a server that refuses them all (no tenant, down) wrote the same line
        20 times a tick, burying what came before it. Every error is still counted and shown."""
        now = time.monotonic()
        last, since = self._logged.get(kind, (-math.inf, 0))
        if now - last < LOG_EVERY_S:
            self._logged[kind] = (last, since + 1)
            return
        self._logged[kind] = (now, 0)
        log.warning("%s%s", msg, f" (and {since} more {kind} errors since the last such line)" if since else "")

    def _vector(self, promql: str, at: float) -> dict[Labels, float]:
        return _values(self.query(promql, at))

    # -- MetricsView ---------------------------------------------------------------------------
    def instant(self, metric: str, matchers: Mapping[str, str], at: float) -> dict[Labels, float]:
        """``metric{matchers}`` at ``at``."""
        return self._vector(selector(metric, matchers, self.extra), at)

    def increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                 by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (increase(metric{matchers}[window]))``; from hour slices over a day or
        more (``_sliced_increase``)."""
        return self._increase(selector(metric, matchers, self.extra), by, window_s, at)

    def _increase(self, sel: str, by: tuple[str, ...], window_s: float, at: float) -> dict[Labels, float]:
        if window_s >= SLICED_FROM_S:
            return self._sliced_increase(sel, by, window_s, at) or {}
        return self._vector(f"sum by ({','.join(by)}) (increase({sel}[{duration(window_s)}]))", at)

    def _sliced_increase(self, sel: str, by: tuple[str, ...], window_s: float, at: float
                         ) -> dict[Labels, float] | None:
        """``sum by (by) (increase(sel[window]))`` at ``at`` as the sum of three parts: the hour
        slices wholly inside the window that ended ``RANGE_REREAD_S`` or more ago (late samples land
        before that), each asked once (a subquery for those missing, aligned to whole hours, at most
        ``SLICES_PER_QUERY`` a query) and kept; the newest part since the last such slice, asked
        each tick (once for every window of the selector); and the oldest part before the first
        slice. A 30-day ``increase`` read every sample of the period at every tick (10 engines' 30
        days: 35 ms a tick with two buckets; a thousand engines scraped every 15 s: ~14 s, past the
        query deadline, so the period read unknown); the parts read at most an hour each. Each part
        extrapolates to its own edges, as ``increase`` does to the window's: a steady counter sums
        to the window's increase. None when a query failed (the pieces of slices answered before
        it are kept, nothing of the parts)."""
        off = self.clock_offset_s
        now = at + off  # the server's clock: subquery steps align to it
        last = math.floor((now - RANGE_REREAD_S) / SLICE_S) * SLICE_S  # the newest settled slice's end
        first = math.ceil((now - window_s) / SLICE_S) * SLICE_S + SLICE_S  # the oldest slice wholly inside
        if first > last:
            return self._vector(f"sum by ({','.join(by)}) (increase({sel}[{duration(window_s)}]))", at)
        key = (sel, by)
        slices = self._slices.pop(key, None) or _Slices()
        self._slices[key] = slices  # most recently used last
        while len(self._slices) > SLICES_MAX:
            self._slices.popitem(last=False)
        slices.span_s = max(slices.span_s, window_s)
        ends = [first + i * SLICE_S for i in range(round((last - first) / SLICE_S) + 1)]
        missing = [e for e in ends if e not in slices.rows]
        while missing:  # newest first: each answered piece is kept, whatever happens to the next
            piece, missing = missing[-SLICES_PER_QUERY:], missing[:-SLICES_PER_QUERY]
            span = piece[-1] - piece[0] + SLICE_S
            data = self.query(f"(sum by ({','.join(by)}) (increase({sel}[{duration(SLICE_S)}])))"
                              f"[{duration(span)}:{duration(SLICE_S)}]", piece[-1] - off, prefetch=False)
            if data is None:
                return None
            got: dict[float, dict[Labels, float]] = {e: {} for e in piece}
            for labels, times, values in _matrix(data):
                for t, v in zip(times, values, strict=True):
                    if t in got and not math.isnan(v):
                        got[t][labels] = float(v)
            for e, values in got.items():
                slices.put(e, values)
        for e in [e for e in slices.rows if e < now - slices.span_s]:
            del slices.rows[e]  # older than any window this selector is asked for
        if any(k[2] != now for k in self._newest):
            self._newest = {}  # another tick's
        newest = self._newest.get((sel, by, now))
        if newest is None:
            newest = self._part(sel, by, now - last, now)
            if newest is None:
                return None
            self._newest[(sel, by, now)] = newest
        oldest = {} if first - SLICE_S - (now - window_s) < 1.0 else self._part(
            sel, by, first - SLICE_S - (now - window_s), first - SLICE_S)
        if oldest is None:
            return None
        out = slices.total(ends)
        for part in (oldest, newest):
            for labels, v in part.items():
                out[labels] = out.get(labels, 0.0) + v
        return out

    def _part(self, sel: str, by: tuple[str, ...], length_s: float, end: float) -> dict[Labels, float] | None:
        """``sum by (by) (increase(sel[length]))`` ending at ``end`` on the server's clock; None when
        the query failed."""
        data = self.query(f"sum by ({','.join(by)}) (increase({sel}[{duration(length_s)}]))",
                          end - self.clock_offset_s, prefetch=False)
        return None if data is None else _values(data)

    def rate(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
             by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``sum by (by) (rate(metric{matchers}[window]))``."""
        sel = selector(metric, matchers, self.extra)
        return self._vector(f"sum by ({','.join(by)}) (rate({sel}[{duration(window_s)}]))", at)

    def range(self, metric: str, matchers: Mapping[str, str], start: float, end: float) -> list[Series]:
        """Raw samples: the range selector ``metric{matchers}[end-start]`` evaluated at ``end``.

        A window longer than ``RANGE_REREAD_S`` is read incrementally: the leak detector reads
        12 h of every process's RSS each tick, ~76 KB per process at a 15 s scrape interval,
        and at a thousand processes the answer passed ``max_body_bytes`` at every tick (leak
        detection never ran) or took seconds of each tick's budget to read. The samples read
        are kept per selector; each call reads only the last ``RANGE_REREAD_S`` again, and a
        first (or resumed) read goes in pieces of at most a quarter of ``max_body_bytes``, each
        kept as it arrives, so a read cut short by the tick's deadline goes on at the next call.
        Any failed piece makes this call no data (counted in ``failed_queries``)."""
        sel = selector(metric, matchers, self.extra)
        off = self.clock_offset_s
        if end - start <= RANGE_REREAD_S:  # a short window: one read, nothing kept
            got = _matrix(self.query(f"{sel}[{duration(end - start)}]", end))
            return [Series(labels, t - off, v) for labels, t, v in got]
        s_start, s_end = start + off, end + off  # the server's time, in which samples are kept
        cache = self._ranges.pop(sel, None)
        fresh = cache is None or cache.since > s_start or not s_start <= cache.through <= s_end
        if fresh:  # nothing usable kept (a first read, a longer window, a gap past the window)
            cache = _RangeCache(s_start, s_start)
        self._ranges[sel] = cache
        while len(self._ranges) > RANGE_CACHE_MAX:
            self._ranges.popitem(last=False)
        if not fresh and s_end - cache.through <= RANGE_REREAD_S / 2:
            # the steady read (ticks shortly apart): the same text every tick, so the next tick
            # sends it ahead with its other queries, and it overlaps what was read by half of it
            data = self.query(f"{sel}[{duration(RANGE_REREAD_S)}]", end)
            if data is None:
                return []
            # (lo, hi]: a range selector is left-open since Prometheus 3, so a sample exactly at lo
            # stays as kept
            cache.merge(_matrix(data), s_end - RANGE_REREAD_S, s_end, with_lo=False)
        elif cache.through < s_end:
            lo = s_start if fresh else max(s_start, cache.through - RANGE_REREAD_S)
            if not self._read_pieces(sel, cache, lo, s_end, off):
                return []
        cache.trim(s_start)
        return [Series(labels, t - off, v) for labels, (t, v) in cache.series.items()]

    def _read_pieces(self, sel: str, cache: _RangeCache, lo: float, hi: float, off: float) -> bool:
        """Read [lo, hi] (the server's time) of ``sel`` into ``cache`` in pieces whose answers stay
        well within ``max_body_bytes``, oldest first; False when a piece (or the count) failed."""
        span = hi - lo
        per_s = cache.samples() / (cache.through - cache.since) if cache.through > cache.since else None
        if per_s is None:  # nothing read yet: ask how many samples there are (a one-number answer)
            data = self.query(f"sum(count_over_time({sel}[{duration(span)}]))", hi - off, prefetch=False)
            if data is None:
                return False
            counted = [p for item in _result(data, "vector") if (p := _point(item.get("value"))) is not None]
            per_s = counted[0][1] / span if counted and math.isfinite(counted[0][1]) else 0.0
        piece_bytes = self.max_body_bytes / 4
        pieces = max(1, math.ceil(per_s * span * RANGE_BYTES_PER_SAMPLE / piece_bytes))
        step = span / pieces
        a = lo
        for i in range(pieces):
            # bounds on whole milliseconds, as the server's timestamps and the query's ``time``
            b = hi if i == pieces - 1 else round(lo + (i + 1) * step, 3)
            data = self.query(f"{sel}[{duration(b - a)}]", b - off, prefetch=False)
            if data is None:
                return False
            # (a, b], as above; from the window's start on a first read (closed before Prometheus 3)
            cache.merge(_matrix(data), a, b, with_lo=i == 0 and lo <= cache.since)
            a = b
        return True

    def sync_clock(self, now: float, read_at: float | None = None, deadline: float | None = None) -> float | None:
        """Measure Prometheus's clock against the guard's (``now``: the guard's clock, read at
        ``time.monotonic()`` ``read_at``, default this call) with ``time()`` evaluated at the
        server's own now, and send later queries at Prometheus's time. With the clocks minutes
        apart, ``&time=<guard now>`` landed in the server's past (a violation of the last minutes
        read "ok", judged on old data) or its future (pools "stale or missing"). Offsets within
        the round trip's uncertainty (or 1 s) are taken as none. Returns the offset applied,
        None when the server did not answer."""
        start = time.monotonic()
        read_at = start if read_at is None else read_at
        try:
            status, raw = self._get({"query": "time()"}, deadline)
            body = json.loads(raw)
            server = float(body["data"]["result"][1])
        except (PrometheusError, httpx.HTTPError, ValueError, TypeError, KeyError, IndexError):
            return None
        end = time.monotonic()
        half_rtt = (end - start) / 2
        offset = server - (now + (start + half_rtt - read_at))
        if status != 200 or not math.isfinite(offset):
            return None
        offset = offset if abs(offset) > max(1.0, half_rtt) else 0.0
        if abs(offset - self.clock_offset_s) > 1.0:
            log.warning("Prometheus's clock is %+.1fs from the guard's: queries are sent at Prometheus's time "
                        "(synchronise the clocks, e.g. with NTP)", offset)
        self.clock_offset_s = offset
        return offset

    def histogram_quantile(self, q: float, metric: str, matchers: Mapping[str, str], window_s: float,
                           at: float, by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``histogram_quantile(q, sum by (le, by) (rate(metric_bucket{matchers}[window])))``."""
        name = promql.bucket_series(metric)
        sel = selector(name, matchers, self.extra)
        return self._vector(f"histogram_quantile({q!r}, sum by ({','.join(('le', *by))}) "
                            f"(rate({sel}[{duration(window_s)}])))", at)

    def counter_delta(self, metric: str, matchers: Mapping[str, str], t0: float, t1: float,
                      by: tuple[str, ...] = ()) -> dict[Labels, float]:
        """``increase`` over t1 - t0 at t1 (Prometheus holds the history: no ledger needed)."""
        return self.increase(metric, matchers, t1 - t0, t1, by)

    def bucket_increase(self, metric: str, matchers: Mapping[str, str], window_s: float, at: float,
                        by: tuple[str, ...] = (), les: tuple[float, ...] = ()) -> dict[Labels, dict[float, float]]:
        """``sum by (le, by) (increase(metric_bucket[window]))`` as {group: {le: count}}; ``les``:
        only the buckets of those bounds (every spelling exporters write) and +Inf. Prometheus reads
        every sample of each bucket it selects: a 30-day attainment that read all of a histogram's
        buckets cost ~20x the two it uses (bench/bench_prometheus_long_windows.py)."""
        name = promql.bucket_series(metric)
        if not les:
            return promql.split_le(self.increase(name, matchers, window_s, at, ("le", *by)))
        bounds = any_of_literal({s for b in les for s in le_spellings(b)} | le_spellings(math.inf))
        sel = selector(name, matchers, ",".join(m for m in (self.extra, f"le=~{bounds}") if m))
        return promql.split_le(self._increase(sel, ("le", *by), window_s, at))

    def bucket_covered_since(self, metric: c.Metric, threshold: float, window_s: float, step_s: float,
                             at: float) -> dict[Labels, float] | None:
        """{histogram child: the time (the guard's clock) from which its ``le=threshold`` bucket
        covers it} for the children of histogram ``metric`` that the bucket did not cover all of
        ``window_s`` (``exporters.promql.bucket_uncovered_until``, in slices of ``step_s``; read late
        by at most ``step_s``, never early); the others are left out. None when a query failed.

        Asked whole, the subquery read every sample of the bucket and ``_count`` over the period
        (10 engines' 30 days: 47-57 ms; a thousand engines scraped every 15 s: ~20 s, past the
        query deadline). It is asked in pieces of ``COVER_PIECE_SLICES`` slices, newest first, each
        kept once it ended ``RANGE_REREAD_S`` ago (its slices' coverage is then fixed), plus the
        newest part since; and the answer is used again for ``step_s``, since a change after it
        shows in the ``step_s`` burn window the caller checks every tick (``slo._covered_spans``,
        ``uncovered_buckets``)."""
        key = (metric.name, threshold, window_s, step_s)
        last = self._covered.get(key)
        if last is not None and 0 <= at - last[0] < step_s:
            return last[1]
        off = self.clock_offset_s
        now = at + off  # the server's clock: subquery steps align to it
        length = step_s * COVER_PIECE_SLICES
        settled = math.floor((now - RANGE_REREAD_S) / length) * length  # the newest settled piece's end
        ends = [settled - i * length for i in range(math.ceil(window_s / length) + 1)]
        ends = [e for e in ends if e > now - window_s]  # a piece ending before the window has none of it
        pieces = self._cover_pieces.setdefault(key, {})
        for e in [e for e in pieces if e <= now - window_s]:
            del pieces[e]
        for e in ends:  # newest first; each answered piece is kept, whatever happens to the next
            if e not in pieces:
                got = self._uncovered_until(metric, threshold, length, step_s, e)
                if got is None:
                    return None
                pieces[e] = got
        newest = self._uncovered_until(metric, threshold, now - settled, step_s, now) if now > settled else {}
        if newest is None:
            return None
        out: dict[Labels, float] = {}
        for part in (*(pieces[e] for e in ends), newest):
            for labels, t in part.items():
                if t > now - window_s and t - off > out.get(labels, -math.inf):
                    out[labels] = t - off  # on the guard's clock
        self._covered[key] = (at, out)
        return out

    def _uncovered_until(self, metric: c.Metric, threshold: float, length_s: float, step_s: float,
                         end: float) -> dict[Labels, float] | None:
        """``exporters.promql.bucket_uncovered_until`` over the ``length_s`` ending at ``end`` (the
        server's clock): child -> its last uncovered slice's end there; None when the query failed."""
        m = (self.extra,) if self.extra else ()
        data = self.query(contract_promql.bucket_uncovered_until(metric, threshold, duration(length_s),
                                                                 duration(step_s), m),
                          end - self.clock_offset_s, prefetch=False)
        return None if data is None else _values(data)

    def uncovered_buckets(self, metric: c.Metric, threshold: float, windows_s: tuple[float, ...],
                          at: float) -> dict[float, set[Labels] | None] | None:
        """{window_s: histogram children} of histogram ``metric`` whose ``le=threshold`` bucket does
        not cover the window (``exporters.promql.bucket_covered``, which the attainment rules use
        too): the bucket appeared or vanished inside it (an engine upgraded to another bucket set),
        or never was there. ``increase`` of such a bucket counts only part of the window while
        ``_count`` counts all of it: every request of the rest read as over the threshold (5 %
        attainment, "violated", every request in time). A window without such a child is left out;
        None for a window whose query failed, or for the whole answer when the short windows' did.

        Windows under a day: the children with requests in the window, one query for all of them.
        A day or more: the children whose bucket missed an hour slice of the window in which
        ``_count`` had samples (``bucket_covered_since``, asked once an hour), plus those the last
        2 h miss (asked with the short windows: they reach past the newest slice that answer saw).
        Reading ``count_over_time`` of the bucket and ``_count`` over 30 days cost every sample of
        the period at every tick (10 engines' 30 days: 57-64 ms of a 100 ms tick). An idle child
        missing the bucket counts here too: its pool's long windows read unknown, never wrong."""
        long = [w for w in windows_s if w >= SLICED_FROM_S]
        recent = 2 * SLICE_S
        short = tuple(sorted({*(w for w in windows_s if w < SLICED_FROM_S), *((recent,) if long else ())}))
        now = self._uncovered_now(metric, threshold, short, at) if short else {}
        if now is None:
            return None
        out: dict[float, set[Labels] | None] = dict(now)
        if long:
            since = self.bucket_covered_since(metric, threshold, max(long), SLICE_S, at)
            lately = set().union(*(now.get(w, set()) for w in short))
            for w in long:
                got = None if since is None else lately | {lab for lab, t in since.items() if t > at - w}
                if got is None or got:
                    out[w] = got
            if recent not in windows_s:
                out.pop(recent, None)
        return out

    def _uncovered_now(self, metric: c.Metric, threshold: float, windows_s: tuple[float, ...],
                       at: float) -> dict[float, set[Labels]] | None:
        """``uncovered_buckets`` for windows read whole: one query for all of them."""
        data = self.query(uncovered_query(metric, threshold, windows_s, (self.extra,) if self.extra else ()), at)
        if data is None:
            return None
        out: dict[float, set[Labels]] = {}
        for item in _result(data, "vector"):
            labels, point = _labels(item), _point(item.get("value"))
            if labels is None or point is None or not point[1] > 0:
                continue
            d = dict(labels)
            try:
                w = float(d.pop(WINDOW_LABEL))
            except (KeyError, ValueError):
                continue
            out.setdefault(w, set()).add(tuple(sorted(d.items())))
        return out

    def hook_stalls(self, at: float) -> list[dict[str, str | float]] | None:
        """The engines whose sla-guard hook stopped recording (``exporters.promql.hook_stalled``, the
        ``SlaGuardHookStalled`` rule's expression): vLLM's own token counter rose, at least
        ``HOOK_STALL_SETTLE_S`` ago, after a counter of the hook's on the same page last moved, and
        that counter has stood still since, held until it moves. Each as its labels (job, instance,
        engine, model, pool) and ``since`` (the Unix time since when the hook's counter has not moved;
        the lookback's start where it did not move within it); one query for the whole fleet; None
        when the query failed. A subquery over the lookback (500 engines: 0.25 s for 1 h, 1.2 s for 6 h), so an
        answer is used again for ``HOOK_STALL_STEP_S``, the step it places moves to, instead of
        asked every tick."""
        last = self._stalls
        if last is not None and 0 <= at - last[0] < c.HOOK_STALL_STEP_S:
            if last[1]:
                self.count_error("hook_stalled")
            return last[1]
        expr = contract_promql.hook_stalled(c.HOOK_STALL_WINDOW_S, c.HOOK_STALL_SETTLE_S, c.HOOK_STALL_LOOKBACK_S,
                                            c.HOOK_STALL_STEP_S, (self.extra,) if self.extra else ())
        data = self.query(expr, at, prefetch=False)  # the next tick uses this answer: not sent ahead for it
        if data is None:
            return None
        out: list[dict[str, str | float]] = []
        for item in _result(data, "vector"):
            labels, point = _labels(item), _point(item.get("value"))
            if labels is not None and point is not None:
                out.append({**dict(labels), "since": point[1] - self.clock_offset_s})  # on the guard's clock
        if out:
            self.count_error("hook_stalled")
        self._stalls = (at, out)
        return out

    def close(self) -> None:
        for pool in (self._pool, self._io):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


class PrometheusSourceImpl:
    """``Source`` for the prometheus mode: nothing to collect; ``collect`` checks the server."""

    mode = "prometheus"

    def __init__(self, cfg: PrometheusConfig, *, transport: httpx.BaseTransport | None = None,
                 stale_after_s: float | None = None) -> None:
        token = env_value("source.bearer_token_env", cfg.bearer_token_env, "querying Prometheus without a bearer token")
        headers = dict(cfg.headers)
        for name, var in cfg.headers_env.items():
            value = env_value(f"source.headers_env.{name}", var, f"querying Prometheus without the {name} header")
            if value is not None:
                headers[name] = value
        self.cfg = cfg
        self.view = PrometheusView(cfg.url, timeout_s=cfg.timeout_s, token=token, extra_selector=cfg.selector,
                                   transport=transport, concurrency=cfg.concurrency,
                                   max_body_bytes=cfg.max_body_bytes, accept_partial=cfg.accept_partial,
                                   headers=headers)
        self._checked = False
        self.stale_after_s = stale_after_s
        self.duplicates: list[str] = []  # processes Prometheus holds more than once (``check_duplicates``)

    def bind_metrics(self, metrics: ContractMetrics) -> None:
        self.view.bind_metrics(metrics)

    def begin_tick(self, budget_s: float, at: float) -> None:
        """Queries of the tick about to run (at time ``at``) share ``budget_s`` seconds in total;
        last tick's queries are sent at once, concurrently."""
        self.view.set_deadline(time.monotonic() + budget_s)
        self.view.prefetch(at)

    async def collect(self, now: float) -> None:
        import asyncio

        # the server check and the clock's measure share one budget (beside a tick, not inside one)
        read_at = time.monotonic()
        deadline = read_at + self.cfg.timeout_s
        if await asyncio.to_thread(self.view.query, "vector(1)", now, deadline=deadline) is not None:
            await asyncio.to_thread(self.view.sync_clock, now, read_at, deadline)
            await asyncio.to_thread(self.check_duplicates, now, deadline)
        self._checked = True

    def check_duplicates(self, now: float, deadline: float | None = None) -> list[str]:
        """Processes Prometheus holds more than once: the same process (model, pool, engine,
        process, PID and start time) exported under several ``job``/``instance`` pairs (two scrape
        jobs of one target, a ServiceMonitor beside a static job). Every ``sum`` then counts their
        requests twice, in the guard as in PromQL itself: means, ratios and quantiles are unchanged,
        request counts (``min_requests``) and rates (the advisor's demand) double. They are not
        deduplicated (the guard keeps saying what the dashboards and rules on the same server say):
        a change of the set is logged with the copies and the fix, and each check that finds any
        counts ``guard_scrape_errors{target="prometheus",kind="duplicate"}``. Returns them."""
        ident = ", ".join(DUPLICATE_IDENTITY)
        sel = selector(c.PROCESS_INFO.name, {}, self.view.extra)
        data = self.view.query(f"{sel} and on ({ident}) (count by ({ident}) ({sel}) > 1)", now, deadline=deadline,
                               prefetch=False)
        if data is None:  # not answered: what was found stands
            return self.duplicates
        copies: dict[tuple[str, ...], list[str]] = {}
        for item in _result(data, "vector"):
            lab = dict(_labels(item) or ())
            where = " ".join(f"{k}={lab[k]}" for k in ("job", "instance") if k in lab) or "?"
            copies.setdefault(tuple(lab.get(k, "") for k in DUPLICATE_IDENTITY), []).append(where)
        found = sorted(f"{k[0]}/{k[1]} engine {k[2]} process {k[4]} as {' and '.join(sorted(w))}"
                       for k, w in copies.items())
        if found:
            self.view.count_error("duplicate")
        if found != self.duplicates and found:
            log.warning("Prometheus holds %d process(es) more than once (e.g. %s): every sum counts their requests "
                        "once per copy, so request counts (min_requests) and rates (the advisor's demand) are "
                        "multiplied; scrape each engine once, or keep one copy with source.selector, e.g. "
                        "'job=\"<one of them>\"'", len(found), found[0])
        self.duplicates = found
        return found

    def targets(self) -> list[TargetState]:
        v = self.view
        return [TargetState("prometheus", v.url, "*", "*", up=v.last_error is None and v.last_ok is not None,
                            last_scrape=v.last_ok, last_error=v.last_error, errors=dict(v.errors))]

    def ready(self) -> bool:
        """The server answered within the staleness bound (a server that stopped answering
        makes the guard unready, as a stale verdict does). Elapsed time on the monotonic clock: on
        the wall clock a step back (NTP, a resumed VM) kept a server that stopped answering ready
        for as long as the step."""
        last = self.view.last_ok_mono
        return last is not None and (self.stale_after_s is None or time.monotonic() - last <= self.stale_after_s)

    async def aclose(self) -> None:
        self.view.close()
