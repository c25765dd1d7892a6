"""P/D overview: SLA status per pool, TTFT and TPOT per pool against the SLA, throughput, goodput."""

from __future__ import annotations

from alerts import promql as pq
from dashboards.common import GUARD_SEL, RATE, Panels, dashboard, mean_slo, q, sel, slo_thresholds
from dashboards.latency import mean_and_percentiles
from exporters import contract as c
from sla_guard.config import GuardConfig, Indicator

UID = "sla-guard-pd-overview"


def build(config: GuardConfig) -> dict:
    ttft_sla = slo_thresholds(config, Indicator.TTFT)
    tpot_sla = slo_thresholds(config, Indicator.TPOT)
    ttft_mean, tpot_mean = mean_slo(config, Indicator.TTFT), mean_slo(config, Indicator.TPOT)
    s = sel()

    def panels(p: Panels) -> None:
        p.row("SLA status")
        p.stat("SLO status (guard)", "Current status of every SLO per pool as the guard evaluates it "
               "(ok, at_risk, violated, unknown).",
               [q(f"max by (pool, slo, status) ({pq.series(c.GUARD_SLO_STATUS, matchers=GUARD_SEL)} == 1)",
                  "{{pool}} {{slo}}: {{status}}", instant=True)],
               w=12, text_name=True,
               colors=[(".*violated", "red"), (".*at_risk", "orange"), (".*unknown", "text"), (".*: ok", "green")])
        for slo, metric, title in ((ttft_mean, c.REQUEST_TTFT, "Mean TTFT"), (tpot_mean, c.REQUEST_TPOT, "Mean TPOT")):
            window = slo.window if slo else "5m"
            p.stat(f"{title} ({window}) per pool", f"Request-weighted mean over {window}; red above the SLA.",
                   [q(pq.mean(metric, window, ["pool"], s), "{{pool}}", instant=True)], "s",
                   thresholds=[slo.threshold_s] if slo else ())
        p.row("Latency per pool")
        p.ts("TTFT per pool", "Time to first token: mean, p50, p90, p99 per pool; dashed lines are the SLAs.",
             mean_and_percentiles(c.REQUEST_TTFT, ["pool"], s), "s", sla=ttft_sla)
        p.ts("TPOT per pool", "Time per output token after the first: mean, p50, p90, p99 per pool.",
             mean_and_percentiles(c.REQUEST_TPOT, ["pool"], s), "s", sla=tpot_sla)
        p.row("Throughput and goodput")
        p.ts("Input throughput", "Prompt tokens per second by pool and source (computed here, local "
             "prefix-cache hit, external KV transfer).",
             [q(pq.sum_by(["pool", "source"], pq.rate(c.PROMPT_TOKENS, RATE, matchers=s)), "{{pool}} {{source}}")],
             "tokens/s", w=8)
        p.ts("Output throughput", "Generated tokens per second by pool.",
             [q(pq.sum_by(["pool"], pq.rate(c.GENERATION_TOKENS, RATE, matchers=s)), "{{pool}}")], "tokens/s", w=8)
        p.ts("Requests finished", "Finished requests per second by pool and finish reason.",
             [q(pq.sum_by(["pool", "reason"], pq.rate(c.REQUESTS_FINISHED, RATE, matchers=s)), "{{pool}} {{reason}}")],
             "reqps", w=8)
        good = [q(pq.series(c.GUARD_GOODPUT, matchers=GUARD_SEL), "{{pool}} goodput (guard)")]
        if ttft_mean:
            good.append(q(pq.share_at_or_below(c.REQUEST_TTFT, ttft_mean.threshold_s, RATE, ["pool"], s),
                          f"{{{{pool}}}} TTFT <= {ttft_mean.threshold_s:g}s"))
        if tpot_mean:
            good.append(q(pq.share_at_or_below(c.REQUEST_TPOT, tpot_mean.threshold_s, RATE, ["pool"], s),
                          f"{{{{pool}}}} TPOT <= {tpot_mean.threshold_s:g}s"))
        p.ts("Goodput", "Share of requests meeting both TTFT and TPOT thresholds (guard), and the share "
             "within each threshold from the histogram buckets.", good, "percentunit", w=24)

    return dashboard(UID, "sla-guard / P/D overview",
                     "Per-pool SLA view of a prefill/decode-disaggregated vLLM deployment.", panels)
