"""Prometheus exposition of the contract.

``ContractMetrics`` turns contract definitions into prometheus_client families on a registry;
``EngineRecorder`` binds them to one engine (model, pool, engine) and is what the vLLM hook,
the sidecar and the simulator call, so all three emit through the same code path. Children are
bound once: ``.labels()`` is too slow for vLLM's per-step hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from exporters import contract as c
from exporters.contract import Component, Kind, Metric

_CLASSES = {Kind.COUNTER: Counter, Kind.GAUGE: Gauge, Kind.HISTOGRAM: Histogram}


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
        self._kv_xfer: dict[str, object] | None = None  # bound on first KV-transfer stats

    def _bind(self, metric: Metric, *extra: str):
        return self.metrics[metric].labels(*self.labels, *extra)

    def prebind_kv_fetch_stages(self, stages: Iterable[str]) -> None:
        """Expose the remote-KV wait gauge at 0 for every stage from the start (consumers)."""
        self.kv_fetch_by_stage({s: 0 for s in stages})

    # -- per request ---------------------------------------------------------------------------
    def observe_ttfts(self, values: Iterable[float]) -> None:
        obs = self.ttft.observe
        for v in values:
            obs(v)

    def observe_itls(self, values: Iterable[float]) -> None:
        obs = self.itl.observe
        for v in values:
            obs(v)

    def finished(self, r: FinishedRequest) -> None:
        self.e2e.observe(r.e2e_s)
        self.queue.observe(r.queue_s)
        self.prefill.observe(r.prefill_s)
        self.decode.observe(r.decode_s)
        if r.generated_tokens > 1:
            self.tpot.observe(r.tpot_s)
        child = self._finished.get(r.reason)
        if child is None:
            child = self._finished[r.reason] = self._bind(c.REQUESTS_FINISHED, r.reason)
        child.inc()

    def tokens(self, generated: int, computed: int = 0, local_hit: int = 0, external: int = 0) -> None:
        if generated:
            self.generation_tokens.inc(generated)
        p = self.prompt_by_source
        if computed:
            p["computed"].inc(computed)
        if local_hit:
            p["local_cache_hit"].inc(local_hit)
        if external:
            p["external_kv_transfer"].inc(external)

    # -- scheduler state -----------------------------------------------------------------------
    def scheduler(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.steps.inc()

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
        if queries:
            self.cache_queries[cache].inc(queries)
        if hits:
            self.cache_hits[cache].inc(hits)

    def preempted(self, n: int) -> None:
        if n:
            self.preemptions.inc(n)

    # -- speculative decoding ------------------------------------------------------------------
    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int,
                    accepted_per_pos: Iterable[int] = (), draft_per_pos: Iterable[int] = ()) -> None:
        if drafts:
            self.spec_drafts.inc(drafts)
        if draft_tokens:
            self.spec_draft_tokens.inc(draft_tokens)
        if accepted:
            self.spec_accepted.inc(accepted)
        for children, values, metric in ((self._pos_accepted, accepted_per_pos, c.SPEC_ACCEPTED_TOKENS_POS),
                                         (self._pos_draft, draft_per_pos, c.SPEC_DRAFT_TOKENS_POS)):
            for i, v in enumerate(values):
                while len(children) <= i:
                    children.append(self._bind(metric, str(len(children))))
                if v:
                    children[i].inc(v)

    # -- KV transfer (connector stats) ---------------------------------------------------------
    def kv_transfer(self, durations: Iterable[float] = (), post_durations: Iterable[float] = (),
                    nbytes: Iterable[float] = (), descriptors: Iterable[float] = (),
                    failures: Mapping[str, int] | None = None, expired: int = 0,
                    late_notifications: int = 0) -> None:
        """One batch of per-transfer observations (NIXL's kv_connector_stats lists)."""
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
        for key, values in (("duration", durations), ("post", post_durations), ("bytes", nbytes),
                            ("descriptors", descriptors)):
            obs = k[key].observe
            for v in values:
                obs(v)
        for kind, n in (failures or {}).items():
            child = k.get(f"fail_{kind}")
            if n and child is not None:
                child.inc(n)
        if expired:
            k["expired"].inc(expired)
        if late_notifications:
            k["late"].inc(late_notifications)

    def engine_info(self, **info: str) -> None:
        """Set the per-engine info gauge (labels beyond model/pool/engine, as the contract lists)."""
        extra = c.ENGINE_INFO.labels[len(self.labels):]
        self.metrics[c.ENGINE_INFO].labels(*self.labels, *(str(info.get(n, "")) for n in extra)).set(1)
