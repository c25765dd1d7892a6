"""Prefill pool: queue, TTFT, prompt throughput, local and external prefix-cache hit rate."""

from __future__ import annotations

from dashboards.common import RATE, Panels, dashboard, q, sel, slo_thresholds
from dashboards.latency import mean_and_percentiles
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig, Indicator

UID = "sla-guard-prefill"
POOLS = "prefill|mixed"


def build(config: GuardConfig) -> dict:
    s = sel()
    inst = ["instance", "engine"]

    def panels(p: Panels) -> None:
        p.row("Queue")
        p.ts("Waiting requests", "Requests waiting to be scheduled per engine.",
             [q(pq.sum_by(inst, pq.series(c.REQUESTS_WAITING, matchers=s)), "{{instance}} e{{engine}}")])
        p.ts("Queue time", "Time finished requests waited in the scheduler queue: p50, p90, p99 per pool.",
             mean_and_percentiles(c.REQUEST_QUEUE, ["pool"], s, mean=False), "s")
        p.row("Latency and throughput")
        p.ts("TTFT per pool", "Time to first token: mean, p50, p90, p99; dashed lines are the SLAs.",
             mean_and_percentiles(c.REQUEST_TTFT, ["pool"], s), "s", sla=slo_thresholds(config, Indicator.TTFT))
        p.ts("Prefill time", "Prefill phase time of finished requests: p50, p90, p99 per pool.",
             mean_and_percentiles(c.REQUEST_PREFILL, ["pool"], s, mean=False), "s")
        p.ts("Prompt throughput", "Prompt tokens per second by source: computed here, local prefix-cache hit, "
             "external KV transfer.",
             [q(pq.sum_by(["pool", "source"], pq.rate(c.PROMPT_TOKENS, RATE, matchers=s)), "{{pool}} {{source}}")],
             "tokens/s", stack=True)
        p.ts("Prefix-cache hit rate", "Prompt tokens found / looked up, for the local prefix cache and the "
             "external (connector) cache.",
             [q(pq.ratio(pq.sum_by(["pool", "cache"], pq.rate(c.PREFIX_CACHE_HITS, RATE, matchers=s)),
                         pq.sum_by(["pool", "cache"], pq.rate(c.PREFIX_CACHE_QUERIES, RATE, matchers=s))),
                "{{pool}} {{cache}}")],
             "percentunit")

    return dashboard(UID, "sla-guard / Prefill", "Prefill pool engines: queue, TTFT, throughput, prefix cache.",
                     panels, pools=POOLS)
