"""P/D overview: SLA status per pool, TTFT and TPOT per pool against the SLA, throughput, goodput."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dm

from alerts.slo_rules import window_name
from dashboards.common import (
    GUARD_SEL,
    RATE,
    Panels,
    dashboard,
    engines_reporting,
    error_ratio_thresholds,
    guard_reporting,
    mean_slo,
    q,
    sel,
    slo_thresholds,
    special_map,
    value_map,
)
from dashboards.latency import mean_and_percentiles
from exporters import contract as c
from exporters import promql as pq
from sla_guard.config import GuardConfig, Indicator

UID = "sla-guard-pd-overview"
NO_VERDICT = "No verdict: the guard is not reporting, or no SLO covers this selection"


def client_panels(p: Panels, config: GuardConfig) -> None:
    """What the client sees at the P/D router (pool="client"), and where its TTFT goes."""
    cs = list(CLIENT_SEL)
    ttft_sla = [s.threshold_s for s in config.slos_for("*", c.Pool.CLIENT.value)
                if s.indicator is Indicator.TTFT and s.objective.value == "mean"]
    p.row("Client scope: what the client sees (router / proxy)")
    p.ts("Client TTFT", "Time to first token measured at the P/D router: arrival to first streamed token, "
         "across prefill, KV hand-off and decode. This is the TTFT the SLA is signed on.",
         mean_and_percentiles(c.CLIENT_TTFT, ["model"], cs), "s", sla=ttft_sla, w=8)
    p.ts("Client TPOT", "Time per output token after the first, measured at the router.",
         mean_and_percentiles(c.CLIENT_TPOT, ["model"], cs), "s", sla=slo_thresholds(config, Indicator.TPOT), w=8)
    p.ts("Client requests by outcome", "Requests per second the router finished: ok, error (the service "
         "failed it: 5xx, 429, a failed leg), client_error (a 4xx that was the client's own mistake), aborted "
         "(the client went away); and the streamed errors the guard counts as misses: before the first token "
         "(client TTFT attainment), after it (client TPOT attainment).",
         [q(pq.sum_by(["model", "outcome"], pq.rate(c.CLIENT_REQUESTS, RATE, matchers=cs)), "{{model}} {{outcome}}"),
          q(pq.sum_by(["model"], pq.rate(c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, RATE, matchers=cs)),
            "{{model}} error before the first token (TTFT miss)"),
          q(pq.sum_by(["model"], pq.rate(c.CLIENT_FAILED_AFTER_FIRST_TOKEN, RATE, matchers=cs)),
            "{{model}} error after the first token (TPOT miss)")],
         "reqps", w=8)
    # the availability SLI, one definition with the rules (model_pool_slo:sli_error:ratio_rate<w>)
    p.ts("Client error ratio", "Share of requests the service failed (outcome error) among those it "
         "answered or failed (ok + error), request-weighted per model: the availability objective's error "
         "ratio. client_error and aborted count in neither part. Dashed line: 1 - target of each "
         "availability objective, where one is configured. A gap for no traffic (0/0); a line that ends "
         "when the router's series are gone (it is down or not scraped), never 0 %.",
         [q(pq.outcome_ratio(c.CLIENT_REQUESTS, "outcome", c.AVAILABILITY_FAILED, c.AVAILABILITY_COUNTED, RATE,
                             ["model"], cs), "{{model}}")],
         "percentunit", sla=error_ratio_thresholds(config), w=8)
    p.ts("Client request duration", "Arrival at the router to the last byte sent: mean, p50, p90, p99.",
         mean_and_percentiles(c.CLIENT_E2E, ["model"], cs), "s", w=8)
    p.ts("Client requests in flight", "Requests the router is serving now.",
         [q(pq.sum_by(["model"], pq.series(c.CLIENT_IN_FLIGHT, matchers=cs)), "{{model}}")], "short", w=8)
    p.ts("Where the TTFT goes (stage means, stacked)",
         "Mean of each stage of a P/D request's TTFT, stacked against the SLA line. Router-measured: proxy; "
         "engine-measured: queues, prefill compute, KV hand-off (NIXL transfers; synchronous connectors load "
         "KV inside the first decode step), first decode step; derived: the API server around each engine "
         "(a router leg minus the engine stages in it). /v1/ttft-breakdown serves the same split.",
         stage_queries(), "s", sla=ttft_sla, w=24, stack=True)


def build(config: GuardConfig) -> dict:
    ttft_sla = slo_thresholds(config, Indicator.TTFT)
    tpot_sla = slo_thresholds(config, Indicator.TPOT)
    ttft_mean, tpot_mean = mean_slo(config, Indicator.TTFT), mean_slo(config, Indicator.TPOT)
    s = sel()

    def panels(p: Panels) -> None:
        p.row("SLA status")
        p.stat("SLO status (guard)", "Current status of every SLO per pool as the guard evaluates it "
               "(ok, at_risk, violated, unknown). Empty when the guard is not reporting: see Guard reporting.",
               [q(f"max by (pool, slo, status) ({pq.series(c.GUARD_SLO_STATUS, matchers=GUARD_SEL)} == 1)",
                  "{{pool}} {{slo}}: {{status}}", instant=True)],
               w=12, text_name=True, no_value=NO_VERDICT,
               colors=[(".*violated", "red"), (".*at_risk", "orange"), (".*unknown", "text"), (".*: ok", "green")])
        for slo, metric, title in ((ttft_mean, c.REQUEST_TTFT, "Mean TTFT"), (tpot_mean, c.REQUEST_TPOT, "Mean TPOT")):
            window = window_name(slo.window) if slo else "5m"  # '1.5h' is no PromQL range
            p.stat(f"{title} ({window}) per pool", f"Request-weighted mean over {window}; red above the SLA; "
                   "\"no requests\" for an idle pool (0/0). A pool whose engines are all silent is missing "
                   "here: see Engines reporting.",
                   [q(pq.mean(metric, window, ["pool"], s), "{{pool}}", instant=True)], "s",
                   thresholds=[slo.threshold_s] if slo else (), no_value="No engine reporting",
                   mappings=[special_map(dm.SpecialValueMatch.NULL_AND_NAN, "no requests", "blue")])
        p.stat("Engines reporting", "Engines with a current sample per pool; 0 (red) for a pool seen in the "
               "dashboard's time range whose engines are all down or not scraped: its latency panels are "
               "empty, which is not the same as an idle pool (\"no requests\").",
               [q(engines_reporting(s), "{{pool}}", instant=True)], w=16, h=4, up=True,
               no_value="No engine in the time range")
        p.stat("Guard reporting", "Guard processes with a current sample; 0 (red) when the guard is down or "
               "not scraped: the verdicts, findings and recommendations panels are then empty or stale.",
               [q(guard_reporting(), "guards", instant=True)], w=8, h=4, up=True,
               mappings=[value_map("0", "guard not reporting", "red")])
        client_panels(p, config)
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
        p.ts("Requests finished and refused", "Finished requests per second by pool and finish reason, and "
             "requests the API servers refused at a queue limit (HTTP 503, by reason): no latency histogram "
             "has those; the guard counts them as TTFT attainment misses.",
             [q(pq.sum_by(["pool", "reason"], pq.rate(c.REQUESTS_FINISHED, RATE, matchers=s)), "{{pool}} {{reason}}"),
              q(pq.sum_by(["pool", "reason"], pq.rate(c.ADMISSION_REJECTIONS, RATE, matchers=s)),
                "{{pool}} refused: {{reason}}")],
             "reqps", w=8)
        good = [q(pq.series(c.GUARD_GOODPUT, matchers=GUARD_SEL), "{{pool}} goodput (guard)")]
        for slo, metric in ((ttft_mean, c.REQUEST_TTFT), (tpot_mean, c.REQUEST_TPOT)):
            # a mean threshold need not be a bucket bound: le="1.8" matches no series, a line never drawn
            if slo and pq.has_bucket(metric, slo.threshold_s, getattr(config.engine_buckets, slo.indicator.value)):
                # refused requests (HTTP 503 at a queue limit) are TTFT misses, as the guard and the
                # rules count them: left out, a pool refusing half its requests read 100 %
                good.append(q(pq.share_at_or_below(metric, slo.threshold_s, RATE, ["pool"], s,
                                                   refused=c.UNOBSERVED_MISSES.get(metric)),
                              f"{{{{pool}}}} {slo.indicator.value.upper()} <= {slo.threshold_s:g}s"))
        p.ts("Goodput", "Share of requests meeting both TTFT and TPOT thresholds (guard), and the share "
             "within each threshold from the histogram buckets (requests the API servers refused count as "
             "TTFT misses, as the guard counts them; an engine whose threshold bucket appeared or went within "
             "the window is left out until the window has passed).", good, "percentunit", w=24)

    return dashboard(UID, "sla-guard / P/D overview",
                     "Per-pool SLA view of a prefill/decode-disaggregated vLLM deployment.", panels)


CLIENT_SEL = ('model=~"$model"', f'pool="{c.Pool.CLIENT.value}"')


def stage_queries() -> list:
    """Mean of each TTFT stage per model (as ``sla_guard.detect.stages`` computes it): the
    router's legs and own time, the engines' queue/compute/KV-transfer means, and the API
    server around each engine as a leg minus the engine stages inside it."""
    def m(metric: c.Metric, *matchers: str) -> str:
        return '(' + pq.mean(metric, RATE, ['model'], [CLIENT_SEL[0], *matchers]) + ')'

    pre, dec = 'pool="prefill"', 'pool="decode"'
    leg = {s: m(c.CLIENT_STAGE, *CLIENT_SEL[1:], f'stage="{s.value}"') for s in c.Stage}
    pq_, pc = m(c.REQUEST_QUEUE, pre), m(c.REQUEST_PREFILL, pre)
    kv, dq, step = m(c.KV_XFER_DURATION, dec), m(c.REQUEST_QUEUE, dec), m(c.REQUEST_PREFILL, dec)
    rows = [
        ("router / proxy", leg[c.Stage.PROXY]),
        ("prefill API server", f"{leg[c.Stage.PREFILL_LEG]} - {pq_} - {pc}"),
        ("prefill queue", pq_), ("prefill compute", pc),
        ("KV hand-off (NIXL)", kv),
        ("decode queue", f"{dq} - ({kv} or {dq} * 0)"),
        ("first decode step", step),
        ("decode API server", f"{leg[c.Stage.DECODE_FIRST_LEG]} - {dq} - {step}"),
    ]
    return [q(expr, f"{{{{model}}}} {name}", ref=chr(ord("A") + i)) for i, (name, expr) in enumerate(rows)]
