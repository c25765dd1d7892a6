"""Prometheus exposition of the contract.

``ContractMetrics`` turns contract definitions into prometheus_client families on a registry;
``EngineRecorder`` binds them to one engine (model, pool, engine) and is what the vLLM hook,
the sidecar and the simulator call, so all three emit through the same code path. Children are
bound once: ``.labels()`` is too slow for vLLM's per-step hot path.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from exporters import contract as c
from exporters.contract import Component, Kind, Metric

_CLASSES = {Kind.COUNTER: Counter, Kind.GAUGE: Gauge, Kind.HISTOGRAM: Histogram}
_INF = float("inf")
log = logging.getLogger("sla_guard.recorder")

# slaguard_hook_errors_total kinds for values refused rather than exported (fixed set: bounded labels).
BAD_OBSERVATION = "bad_observation"  # NaN, +-inf, negative or non-number duration/size: would poison _sum
BAD_INCREMENT = "bad_increment"  # negative, NaN, inf or non-number counter step: would rewind the counter
_logged_kinds: set[str] = set()


class ContractMetrics:
    """prometheus_client families for (a subset of) the contract, registered once per registry."""

    def __init__(
        self,
        registry: CollectorRegistry | None = REGISTRY,
        components: Iterable[Component] = tuple(Component),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry
        self.families: dict[str, Counter | Gauge | Histogram] = {}
        wanted = set(components)
        for m in c.ALL:
            if m.component in wanted:
                self.families[m.name] = _family(m, registry, env)

    def __getitem__(self, metric: Metric) -> Counter | Gauge | Histogram:
        return self.families[metric.name]


def _family(m: Metric, registry: CollectorRegistry | None, env: Mapping[str, str] | None):
    kw: dict = {"registry": registry}
    if m.kind is Kind.HISTOGRAM:
        kw["buckets"] = c.bucket_override(m, dict(env) if env is not None else None)
    if m.kind is Kind.GAUGE:
        kw["multiprocess_mode"] = m.multiprocess_mode
    # prometheus_client appends _total to counters itself.
    return _CLASSES[m.kind](m.name, m.help, list(m.labels), **kw)


class FastHistogram:
    """Batched observation into one bound histogram child: a bisect per value and one locked
    increment per touched bucket, instead of ``observe()``'s linear bucket scan and two locked
    increments per value. Uses the child's value cells (prometheus_client internals, stable since
    0.4 and multiprocess-aware); falls back to ``observe()`` if they are absent.

    Only finite values >= 0 are observed: bisect puts NaN and negatives in the lowest bucket, NaN
    makes ``_sum`` NaN for good and a negative lowers it, which rate() reads as a counter reset.
    Refused values go to ``bad(n)`` (hook_errors{kind="bad_observation"}) instead."""

    __slots__ = ("bad", "bounds", "buckets", "child", "total")

    def __init__(self, child, bad: Callable[[int], None] | None = None) -> None:
        self.child = child
        self.bad = bad
        try:
            self.bounds: list[float] | None = list(child._upper_bounds)
            self.buckets = child._buckets
            self.total = child._sum
        except AttributeError:  # pragma: no cover - a prometheus_client without these internals
            self.bounds = None

    def _refuse(self, n: int) -> None:
        if self.bad is not None:
            self.bad(n)

    def observe(self, v: float) -> None:
        try:
            ok = 0.0 <= v < _INF  # False for NaN, negatives, +inf
        except TypeError:  # None or a non-number
            ok = False
        if not ok:
            self._refuse(1)
            return
        if self.bounds is None:
            self.child.observe(v)
            return
        self.buckets[bisect_left(self.bounds, v)].inc(1)
        self.total.inc(v)

    def observe_many(self, values: Iterable[float]) -> None:
        b = self.bounds
        counts: dict[int, int] = {}
        s = 0.0
        bad = 0
        it = iter(values)
        while True:
            try:  # free until a non-number raises; then go on after it, on the same iterator
                for v in it:
                    if 0.0 <= v < _INF:  # the one per-value check: refuses NaN, negatives, inf
                        s += v
                        if b is None:
                            self.child.observe(v)
                            continue
                        i = bisect_left(b, v)
                        counts[i] = counts.get(i, 0) + 1
                    else:
                        bad += 1
                break
            except TypeError:
                bad += 1
        if counts:
            buckets = self.buckets
            for i, n in counts.items():
                buckets[i].inc(n)
            self.total.inc(s)
        if bad:
            self._refuse(bad)


def fast_inc(child) -> Callable[[float], None]:
    """A counter child's increment without the per-call checks (callers check the amount first:
    ``EngineRecorder._count``)."""
    value = getattr(child, "_value", None)
    return value.inc if value is not None and hasattr(value, "inc") else child.inc


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """The per-request timings both vLLM's FinishedRequestStats and the simulator provide."""

    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    tpot_s: float  # 0 when only one token was generated (every request on a prefill engine)
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    reason: str = "stop"
    request_id: str = ""


class EngineRecorder:
    """All contract metrics of one engine, children bound once at construction."""

    def __init__(self, metrics: ContractMetrics, model: str, pool: str, engine: str | int) -> None:
        self.metrics = metrics
        self.labels = (model, str(pool), str(engine))
        b = self._bind
        self.ttft = b(c.REQUEST_TTFT)
        self.tpot = b(c.REQUEST_TPOT)
        self.e2e = b(c.REQUEST_E2E)
        self.queue = b(c.REQUEST_QUEUE)
        self.prefill = b(c.REQUEST_PREFILL)
        self.decode = b(c.REQUEST_DECODE)
        self.itl = b(c.INTER_TOKEN_LATENCY)
        self.generation_tokens = b(c.GENERATION_TOKENS)
        self.running = b(c.REQUESTS_RUNNING)
        self.waiting = b(c.REQUESTS_WAITING)
        self.kv_usage = b(c.KV_CACHE_USAGE)
        self.preemptions = b(c.PREEMPTIONS)
        self.steps = b(c.ENGINE_STEPS)
        self.spec_drafts = b(c.SPEC_DRAFTS)
        self.spec_draft_tokens = b(c.SPEC_DRAFT_TOKENS)
        self.spec_accepted = b(c.SPEC_ACCEPTED_TOKENS)
        self.prompt_by_source = {s: b(c.PROMPT_TOKENS, s) for s in
                                 ("computed", "local_cache_hit", "external_kv_transfer")}
        self.cache_queries = {k: b(c.PREFIX_CACHE_QUERIES, k) for k in ("local", "external")}
        self.cache_hits = {k: b(c.PREFIX_CACHE_HITS, k) for k in ("local", "external")}
        self._finished: dict[str, object] = {}
        self._kv_fetch: dict[str, object] = {}
        self._pos_draft: list = []
        self._pos_accepted: list = []
        self._kv_xfer: dict[str, Any] | None = None  # bound at start on KV-connector engines (prebind_kv_transfer)
        self._errors: dict[str, object] = {}  # hook_errors children by kind, bound on first error
        # Hot-path handles (record() runs every engine step on vLLM's event loop).
        h = self._histogram
        self._h_ttft, self._h_tpot, self._h_itl = h(self.ttft), h(self.tpot), h(self.itl)
        self._h_e2e, self._h_queue = h(self.e2e), h(self.queue)
        self._h_prefill, self._h_decode = h(self.prefill), h(self.decode)
        self._inc_steps = fast_inc(self.steps)
        self._inc_gen = fast_inc(self.generation_tokens)
        self._inc_prompt = {k: fast_inc(v) for k, v in self.prompt_by_source.items()}
        self._inc_queries = {k: fast_inc(v) for k, v in self.cache_queries.items()}
        self._inc_hits = {k: fast_inc(v) for k, v in self.cache_hits.items()}
        self._inc_spec = (fast_inc(self.spec_drafts), fast_inc(self.spec_draft_tokens), fast_inc(self.spec_accepted))
        self._inc_finished: dict[str, Callable[[float], None]] = {}

    def _bind(self, metric: Metric, *extra: str):
        return self.metrics[metric].labels(*self.labels, *extra)

    def _histogram(self, child) -> FastHistogram:
        return FastHistogram(child, self._bad_observations)

    def _bad_observations(self, n: int) -> None:
        self.count_error(BAD_OBSERVATION, n)

    def count_error(self, kind: str, n: int = 1, exc: BaseException | None = None) -> None:
        """Count ``n`` in slaguard_hook_errors_total{kind} and log the first one of each kind per
        process: a refused value must be visible, not silently gone. A registry without the hooks
        component (simulator) only logs. Never raises (it runs inside vLLM)."""
        try:
            child = self._errors.get(kind)
            if child is None:
                fam = self.metrics.families.get(c.HOOK_ERRORS.name)
                if fam is not None:
                    child = self._errors[kind] = fam.labels(self.labels[0], self.labels[1], kind)
            if child is not None:
                child.inc(n)
            if kind not in _logged_kinds:
                _logged_kinds.add(kind)
                log.warning("sla-guard refused %d value(s) (kind=%s, engine=%s), counted in hook_errors and "
                            "ignored from now on: %r", n, kind, self.labels[2], exc, exc_info=exc)
        except Exception:  # accounting must not raise either
            pass

    def _count(self, inc: Callable[[float], None], n) -> None:
        """Increment by ``n`` if it is a finite number > 0; 0 is a no-op; anything else (negative,
        NaN, inf, None) is refused and counted: a counter never goes backwards or turns NaN."""
        try:
            if 0 < n < _INF:
                inc(n)
                return
            if n == 0:
                return
        except TypeError:
            pass
        self.count_error(BAD_INCREMENT)

    def prebind_kv_fetch_stages(self, stages: Iterable[str]) -> None:
        """Expose the remote-KV wait gauge at 0 for every stage from the start (consumers)."""
        self.kv_fetch_by_stage({s: 0 for s in stages})

    # -- per request ---------------------------------------------------------------------------
    def observe_ttfts(self, values: Iterable[float]) -> None:
        self._h_ttft.observe_many(values)

    def observe_itls(self, values: Iterable[float]) -> None:
        self._h_itl.observe_many(values)

    def finished(self, r: FinishedRequest) -> None:
        self.request_done(r.e2e_s, r.queue_s, r.prefill_s, r.decode_s, r.tpot_s, r.generated_tokens, r.reason)

    def request_done(self, e2e_s: float, queue_s: float, prefill_s: float, decode_s: float, tpot_s: float,
                     generated_tokens: int, reason: str) -> None:
        """``finished()`` without building a FinishedRequest (the per-step hot path)."""
        self._h_e2e.observe(e2e_s)
        self._h_queue.observe(queue_s)
        self._h_prefill.observe(prefill_s)
        self._h_decode.observe(decode_s)
        try:
            multi = generated_tokens > 1
        except TypeError:  # a malformed count: still a finished request, TPOT unknown
            multi = False
            self.count_error(BAD_OBSERVATION)
        if multi:
            self._h_tpot.observe(tpot_s)
        inc = self._inc_finished.get(reason)
        if inc is None:
            child = self._finished[reason] = self._bind(c.REQUESTS_FINISHED, reason)
            inc = self._inc_finished[reason] = fast_inc(child)
        inc(1)

    def tokens(self, generated: int, computed: int = 0, local_hit: int = 0, external: int = 0) -> None:
        count, p = self._count, self._inc_prompt
        if generated != 0:
            count(self._inc_gen, generated)
        if computed != 0:
            count(p["computed"], computed)
        if local_hit != 0:
            count(p["local_cache_hit"], local_hit)
        if external != 0:
            count(p["external_kv_transfer"], external)

    # -- scheduler state -----------------------------------------------------------------------
    def scheduler(self, running: int, waiting: int, kv_usage: float, steps: int = 1) -> None:
        """Latest scheduler state; ``steps`` engine steps since the last call (batched callers)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if steps != 0:
            self._count(self._inc_steps, steps)

    def kv_fetch_by_stage(self, by_stage: Mapping[str, int]) -> None:
        for stage, child in self._kv_fetch.items():  # stages that vanished read 0, not stale
            if stage not in by_stage:
                child.set(0)
        for stage, n in by_stage.items():
            child = self._kv_fetch.get(stage)
            if child is None:
                child = self._kv_fetch[stage] = self._bind(c.REQUESTS_KV_FETCH, str(stage))
            child.set(n)

    def prefix_cache(self, cache: str, queries: int, hits: int) -> None:
        if queries != 0:
            self._count(self._inc_queries[cache], queries)
        if hits != 0:
            self._count(self._inc_hits[cache], hits)

    def preempted(self, n: int) -> None:
        if n != 0:
            self._count(self.preemptions.inc, n)

    # -- speculative decoding ------------------------------------------------------------------
    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int,
                    accepted_per_pos: Iterable[int] = (), draft_per_pos: Iterable[int] = ()) -> None:
        count = self._count
        inc_drafts, inc_draft_tokens, inc_accepted = self._inc_spec
        if drafts != 0:
            count(inc_drafts, drafts)
        if draft_tokens != 0:
            count(inc_draft_tokens, draft_tokens)
        if accepted != 0:
            count(inc_accepted, accepted)
        for incs, values, metric in ((self._pos_accepted, accepted_per_pos, c.SPEC_ACCEPTED_TOKENS_POS),
                                     (self._pos_draft, draft_per_pos, c.SPEC_DRAFT_TOKENS_POS)):
            for i, v in enumerate(values):
                if len(incs) <= i:
                    while len(incs) <= i:
                        incs.append(fast_inc(self._bind(metric, str(len(incs)))))
                if v != 0:
                    count(incs[i], v)

    # -- KV transfer (connector stats) ---------------------------------------------------------
    def prebind_kv_transfer(self) -> dict[str, Any]:
        """The KV-transfer series, at 0 from now on: an engine with a KV connector binds them at start,
        so a failure in its first stats batch is an increase from 0. Bound with it, the counter's
        first sample was already 1, and increase() (Prometheus's and the guard's) never counted it."""
        k = self._kv_xfer
        if k is None:
            b = self._bind
            k = self._kv_xfer = {
                "duration": b(c.KV_XFER_DURATION), "post": b(c.KV_XFER_POST_DURATION),
                "bytes": b(c.KV_XFER_BYTES), "descriptors": b(c.KV_XFER_DESCRIPTORS),
                "expired": b(c.KV_XFER_EXPIRED), "late": b(c.KV_XFER_LATE_NOTIFICATIONS),
                **{f"fail_{kind}": b(c.KV_XFER_FAILURES, kind)
                   for kind in ("transfer", "notification", "handshake")},
            }
        return k

    def kv_transfer(self, durations: Iterable[float] = (), post_durations: Iterable[float] = (),
                    nbytes: Iterable[float] = (), descriptors: Iterable[float] = (),
                    failures: Mapping[str, int] | None = None, expired: int = 0,
                    late_notifications: int = 0) -> None:
        """One batch of per-transfer observations (NIXL's kv_connector_stats lists)."""
        k = self.prebind_kv_transfer()
        for key, values in (("duration", durations), ("post", post_durations), ("bytes", nbytes),
                            ("descriptors", descriptors)):
            self._histogram(k[key]).observe_many(values)
        count = self._count
        for kind, n in (failures or {}).items():
            child = k.get(f"fail_{kind}")
            if n != 0 and child is not None:
                count(child.inc, n)
        if expired != 0:
            count(k["expired"].inc, expired)
        if late_notifications != 0:
            count(k["late"].inc, late_notifications)

    def engine_info(self, **info: str) -> None:
        """Set the per-engine info gauge (labels beyond model/pool/engine, as the contract lists)."""
        extra = c.ENGINE_INFO.labels[len(self.labels):]
        self.metrics[c.ENGINE_INFO].labels(*self.labels, *(str(info.get(n, "")) for n in extra)).set(1)
