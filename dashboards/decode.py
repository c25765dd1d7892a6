"""Decode pool: inter-token latency, batch, KV usage next to GPU utilization, preemptions, spec decode."""

from __future__ import annotations

from dashboards.common import DCGM_GPU_UTIL, RATE, Panels, dashboard, q, sel, slo_thresholds
from dashboards.latency import mean_and_percentiles
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig, Indicator

UID = "sla-guard-decode"
POOLS = "decode|mixed"


def build(config: GuardConfig) -> dict:
    s = sel()
    inst = ["instance", "engine"]

    def panels(p: Panels) -> None:
        p.row("Token latency")
        p.ts("Inter-token latency", "Latency between consecutive output tokens: p50, p90, p99 per pool.",
             mean_and_percentiles(c.INTER_TOKEN_LATENCY, ["pool"], s, mean=False), "s",
             sla=slo_thresholds(config, Indicator.TPOT))
        p.ts("TPOT per engine", "Mean time per output token per engine: spots one slow replica.",
             [q(pq.mean(c.REQUEST_TPOT, RATE, inst, s), "{{instance}} e{{engine}}")], "s",
             sla=slo_thresholds(config, Indicator.TPOT))
        p.row("Batch and KV cache")
        p.ts("Running batch", "Requests in the running batch per engine.",
             [q(pq.sum_by(inst, pq.series(c.REQUESTS_RUNNING, matchers=s)), "{{instance}} e{{engine}}")], w=8)
        p.ts("KV-cache usage and GPU utilization",
             "KV-cache blocks in use per engine, next to GPU utilization from the DCGM exporter when present.",
             [q(pq.sum_by(inst, pq.series(c.KV_CACHE_USAGE, matchers=s)), "KV {{instance}} e{{engine}}"),
              q(f'avg by (instance) ({DCGM_GPU_UTIL}{{instance=~"$instance"}}) / 100', "GPU {{instance}}")],
             "percentunit", w=8)
        p.ts("Preemptions", "Requests preempted per second (KV cache full).",
             [q(pq.sum_by(inst, pq.rate(c.PREEMPTIONS, RATE, matchers=s)), "{{instance}} e{{engine}}")],
             "reqps", w=8)
        p.row("Speculative decoding")
        p.ts("Acceptance rate", "Accepted draft tokens / proposed draft tokens per pool.",
             [q(pq.ratio(pq.sum_by(["pool"], pq.rate(c.SPEC_ACCEPTED_TOKENS, RATE, matchers=s)),
                         pq.sum_by(["pool"], pq.rate(c.SPEC_DRAFT_TOKENS, RATE, matchers=s))), "{{pool}}")],
             "percentunit", w=8)
        p.ts("Mean accepted length", "Tokens emitted per draft: 1 + accepted tokens / drafts.",
             [q("1 + " + pq.ratio(pq.sum_by(["pool"], pq.rate(c.SPEC_ACCEPTED_TOKENS, RATE, matchers=s)),
                                  pq.sum_by(["pool"], pq.rate(c.SPEC_DRAFTS, RATE, matchers=s))), "{{pool}}")],
             "short", w=8, min0=False)
        p.ts("Per-position acceptance", "Acceptance rate of the k-th draft position; later positions "
             "accept less, a drop at position 0 means the draft model diverged.",
             [q(pq.ratio(pq.sum_by(["position"], pq.rate(c.SPEC_ACCEPTED_TOKENS_POS, RATE, matchers=s)),
                         pq.sum_by(["position"], pq.rate(c.SPEC_DRAFT_TOKENS_POS, RATE, matchers=s))),
                "position {{position}}")],
             "percentunit", w=8)

    return dashboard(UID, "sla-guard / Decode", "Decode pool engines: token latency, batch, KV, spec decode.",
                     panels, pools=POOLS)
