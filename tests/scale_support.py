"""Shared helpers for the scaling tests: hand-driven engines that record through the real
``EngineRecorder`` and are scraped (text exposition, parsed back) into the real ``SeriesStore``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest
from sla_guard.store import SeriesStore

MODEL = "m"


class Engine:
    """One engine's registry and recorder, plus the counters it has reached."""

    def __init__(self, pool: str, name: str, instance: str | None = None, model: str = MODEL) -> None:
        self.registry = CollectorRegistry()
        self.rec = EngineRecorder(ContractMetrics(self.registry, components=[Component.ENGINE]), model, pool, name)
        self.name = name
        self.instance = instance  # scrape target (one vLLM server; several DP engines share it)

    def tick(self, *, running: int, waiting: int, kv: float = 0.3, steps: int = 0, computed: int = 0,
             prefills: int = 0, tpot: float | list[float] | None = None, ttft: float | None = None, preempted: int = 0,
             drafts: int = 0, accepted: int = 0, hit: int = 0) -> None:
        self.rec.scheduler(running, waiting, kv)
        for _ in range(max(steps - 1, 0)):
            self.rec.steps.inc()
        if computed or hit:
            self.rec.tokens(0, computed=computed, local_hit=hit)
        for _ in range(prefills):
            self.rec.finished(FinishedRequest(e2e_s=0.5, queue_s=0.1, prefill_s=0.4, decode_s=0.0, tpot_s=0.0,
                                              prompt_tokens=computed // max(prefills, 1), cached_tokens=0,
                                              generated_tokens=1))
        if tpot is not None:  # one value: 5 requests at it; a list: one request at each
            for v in [tpot] * 5 if isinstance(tpot, int | float) else tpot:
                self.rec.finished(FinishedRequest(e2e_s=5, queue_s=0, prefill_s=0, decode_s=5, tpot_s=v,
                                                  prompt_tokens=1000, cached_tokens=0, generated_tokens=300))
        if ttft is not None:
            self.rec.observe_ttfts([ttft] * 5)
        self.rec.preempted(preempted)
        if drafts:
            self.rec.spec_decode(drafts, drafts * 3, accepted)

    def scrape(self, store: SeriesStore, t: float) -> None:
        # the exposition text a scrape would read, parsed back through prometheus_client's parser
        from prometheus_client.parser import text_string_to_metric_families

        text = generate_latest(self.registry).decode()
        extra = {"instance": self.instance} if self.instance else {}
        samples = [(s.name, {**s.labels, **extra}, s.value) for fam in text_string_to_metric_families(text)
                   for s in fam.samples]
        store.ingest_samples(samples, t, group=self.instance or self.name)


def run(engines: list[Engine], store: SeriesStore, t0: float, t1: float, dt: float = 5.0, **tick) -> None:
    t = t0
    while t <= t1:
        for e in engines:
            e.tick(**tick.get(e.name, {}))
            e.scrape(store, t)
        t += dt


def store() -> SeriesStore:
    return SeriesStore(lookback_s=60.0)
