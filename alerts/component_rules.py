"""Alerts on the engines, KV transfer, host memory and the guard itself (everything not an SLO).

Each threshold is a ``RuleParams`` field; every expression starts from contract metrics.
"""

from __future__ import annotations

from alerts.params import RuleParams
from exporters import contract as c
from exporters import promql as q
from sla_guard.config import parse_duration

MP = ("model", "pool")
ENGINE_SERIES = ("model", "pool", "instance", "engine")
SCOPE = "{{ $labels.model }}/{{ $labels.pool }}"

ACCEPTANCE_1H = f"model_pool:{c.SPEC_ACCEPTED_TOKENS.name}:ratio_rate1h"
ACCEPTANCE_1D = f"model_pool:{c.SPEC_ACCEPTED_TOKENS.name}:ratio_rate1d"


def spec_decode_group(p: RuleParams) -> list[dict]:
    records = [
        {"record": name, "expr": q.ratio(q.sum_by(MP, q.rate(c.SPEC_ACCEPTED_TOKENS, p.window(w))),
                                         q.sum_by(MP, q.rate(c.SPEC_DRAFT_TOKENS, p.window(w))))}
        for name, w in ((ACCEPTANCE_1H, "1h"), (ACCEPTANCE_1D, "1d"))
    ]
    keep = round(1 - p.acceptance_drop, 6)
    expr = "\n".join([
        f"{ACCEPTANCE_1H} < {keep:g} * {ACCEPTANCE_1D}",
        f"and on (model, pool) {q.sum_by(MP, q.increase(c.SPEC_DRAFT_TOKENS, p.window('1h')))}"
        f" >= {p.acceptance_min_draft_tokens}",
    ])
    alert = p.alert(
        "SlaGuardSpecDecodeAcceptanceDrop", expr, "warning", for_="30m",
        summary=f"{SCOPE}: speculative-decoding acceptance fell {p.acceptance_drop:.0%}+ below its 1-day baseline",
        description=("Draft-token acceptance over the last hour is {{ $value | humanizePercentage }}, more than "
                     f"{p.acceptance_drop:.0%} below the same pool's 1-day acceptance. Decode TPOT rises as "
                     "fewer drafted tokens are kept."),
        runbook="slaguardspecdecodeacceptancedrop")
    return [{"name": "sla-guard-spec-decode", "rules": [*records, alert]}]


def kv_transfer_group(p: RuleParams) -> list[dict]:
    w = p.window("5m")
    slow = "\n".join([
        f"{q.quantile(0.99, c.KV_XFER_DURATION, w, MP)} > {p.kv_transfer_p99_s:g}",
        f"and on (model, pool) {q.sum_by(MP, q.increase(c.KV_XFER_DURATION, w, '_count'))}"
        f" >= {p.kv_transfer_min_transfers}",
    ])
    failures = f"{q.sum_by((*MP, 'kind'), q.increase(c.KV_XFER_FAILURES, w))} > 0"
    return [{"name": "sla-guard-kv-transfer", "rules": [
        p.alert("SlaGuardKVTransferSlow", slow, "warning", for_="10m",
                summary=f"{SCOPE}: p99 KV-transfer time {{{{ $value | humanizeDuration }}}} "
                        f"(limit {p.kv_transfer_p99_s:g}s)",
                description=("99th percentile of NIXL KV-transfer duration over 5m is {{ $value | "
                             f"humanizeDuration }}}}, above {p.kv_transfer_p99_s:g}s; decode requests wait for "
                             "remote KV and TTFT grows."),
                runbook="slaguardkvtransferslow"),
        p.alert("SlaGuardKVTransferFailures", failures, "warning", for_="1m",
                summary=f"{SCOPE}: KV transfers failing ({{{{ $labels.kind }}}})",
                description=("{{ $value | humanize }} KV-transfer {{ $labels.kind }} failures in the last 5m. "
                             "Failed transfers force the decode side to recompute or drop requests."),
                runbook="slaguardkvtransferfailures"),
    ]}]


def kv_saturation_group(p: RuleParams) -> list[dict]:
    expr = "\n".join([
        f"max by ({', '.join(ENGINE_SERIES)}) ({q.series(c.KV_CACHE_USAGE)}) > {p.kv_usage_high:g}",
        f"and on ({', '.join(ENGINE_SERIES)}) max by ({', '.join(ENGINE_SERIES)}) "
        f"({q.series(c.REQUESTS_WAITING)}) > 0",
    ])
    return [{"name": "sla-guard-kv-cache", "rules": [
        p.alert("SlaGuardKVCacheSaturated", expr, "warning", for_="5m",
                summary=f"{SCOPE}: KV cache {{{{ $value | humanizePercentage }}}} full on "
                        "{{ $labels.instance }} with requests queued",
                description=(f"KV-cache usage above {p.kv_usage_high:.0%} while requests wait to be scheduled: "
                             "the engine cannot admit more work; expect preemptions and TTFT growth."),
                runbook="slaguardkvcachesaturated"),
    ]}]


def hook_group(p: RuleParams) -> list[dict]:
    """vLLM counting tokens on an engine whose sla-guard hook stands still: that engine's contract
    series are frozen (they read as an idle engine, a frozen attainment as "ok"), so every other
    rule on them is blind. The expression is the guard's own (``exporters.promql.hook_stalled``): it
    holds until the hook's counter moves, so the alert does not resolve when the engine goes idle."""
    expr = q.hook_stalled(*(s * p.time_scale for s in (c.HOOK_STALL_WINDOW_S, c.HOOK_STALL_SETTLE_S,
                                                        c.HOOK_STALL_LOOKBACK_S, c.HOOK_STALL_STEP_S)))
    hooks = ", ".join(m.series() for m in c.HOOK_RECORDED)
    return [{"name": "sla-guard-hook", "rules": [
        p.alert("SlaGuardHookStalled", expr, "warning", for_="5m",
                summary=f"{SCOPE}: the sla-guard hook stopped recording on {{{{ $labels.instance }}}} "
                        "engine {{ $labels.engine }}",
                description=(f"vLLM's own token counter ({c.VLLM_GENERATION_TOKENS}) rose on this engine after a "
                             f"counter of the hook's ({hooks}) last moved; it has not moved since "
                             "{{ $value | humanizeTimestamp }} (looking back "
                             f"{q.duration(c.HOOK_STALL_LOOKBACK_S)}): its logger was dropped by an elastic-EP "
                             "scale-up, or record() fails (see "
                             f"{c.HOOK_ERRORS.series()}). The engine's SLA series are frozen, not idle, until the "
                             "hook records again. Restart its API server."),
                runbook="slaguardhookstalled"),
    ]}]


def host_memory_group(p: RuleParams) -> list[dict]:
    win, floor = p.rss_window, p.rss_floor_window
    offset = p.window(f"{int(parse_duration(win) - parse_duration(floor))}s")
    rss = q.series(c.PROCESS_RSS)
    expr = "\n".join([
        f"(min_over_time({rss}[{p.window(floor)}]) - min_over_time({rss}[{p.window(floor)}] offset {offset}))"
        f" > {p.rss_growth_bytes}",
        f"and deriv({rss}[{p.window(win)}]) > 0",
    ])
    return [{"name": "sla-guard-host-memory", "rules": [
        p.alert("SlaGuardProcessMemoryGrowth", expr, "warning", for_="30m",
                summary=f"{SCOPE}: {{{{ $labels.process }}}} RSS floor grew {{{{ $value | humanize1024 }}}}B "
                        f"in {win}",
                description=(f"The minimum RSS over {floor} of {{{{ $labels.role }}}} process "
                             "{{ $labels.process }} on {{ $labels.instance }} is {{ $value | humanize1024 }}B "
                             f"higher than {win} ago and still rising: a slow host-memory leak. Garbage-collection "
                             "sawtooth does not trigger this (floors are compared)."),
                runbook="leak"),
    ]}]


def guard_group(p: RuleParams) -> list[dict]:
    up = f'up{{job="{p.guard_job}"}}'
    evals = q.sum_by(("job", "instance"), q.rate(c.GUARD_EVAL_DURATION, p.window("5m"), "_count"))
    return [{"name": "sla-guard-guard", "rules": [
        p.alert("SlaGuardDown", f"{up} == 0 or absent({up})", "critical", for_="5m",
                summary="sla-guard is down or not scraped",
                description=(f"Prometheus has no successful scrape of job {p.guard_job!r}: SLA status, findings and "
                             "replica advice are not being produced."),
                runbook="slaguarddown"),
        p.alert("SlaGuardNotEvaluating", f"{evals} == 0", "warning", for_="5m",
                summary="sla-guard on {{ $labels.instance }} stopped evaluating",
                description="No evaluation tick completed in 5m although the service answers scrapes.",
                runbook="slaguardnotevaluating"),
        p.alert("SlaGuardTargetDown", f"{q.series(c.GUARD_TARGET_UP)} == 0", "warning", for_="5m",
                summary="sla-guard cannot scrape {{ $labels.target }} (" + SCOPE + ")",
                description=("The guard's last scrapes of {{ $labels.target }} failed for 5m; its SLOs read "
                             "unknown, never ok. Why (the failure kind and the field to fix): the pool's reason in "
                             "the guard's /v1/slo and `sla-guard check`, the target's last_error in /v1/targets."),
                runbook="slaguardtargetdown"),
    ]}]


def component_groups(p: RuleParams) -> dict[str, list[dict]]:
    """File stem -> groups."""
    return {
        "engine": [*spec_decode_group(p), *kv_transfer_group(p), *kv_saturation_group(p), *hook_group(p)],
        "host": host_memory_group(p),
        "guard": guard_group(p),
    }
