"""Recording rules and SLA alerts generated from the SLO spec the guard reads (``GuardConfig.slos``).

Per SLO and (model, pool) the rules record, over every window an alert needs:

- ``model_pool_slo:sli_requests:rate<w>``        requests per second (the zero-traffic guard);
- ``model_pool_slo:sli_error:ratio_rate<w>``     attainment SLOs: share of requests over the
  threshold, counted from the histogram bucket whose ``le`` is the threshold; for availability
  (client scope), share of requests the service failed (``contract.AVAILABILITY_*`` outcomes);
- ``model_pool_slo:sli_latency_seconds:mean<w>`` / ``:quantile<w>`` mean and percentile SLOs.

Each series and alert carries ``slo`` (the objective's name) and ``slo_set`` (``<model>/<pool>``
of the SLO set it comes from, ``*`` for any): one name can be an objective of several sets, and
without ``slo_set`` their rules would be duplicates to ``promtool check rules --lint``.

Every ratio is request-weighted: sums of rates over all engines of a pool, divided once, over the
whole window (never an average of shorter-window ratios). An attainment's windows of a day or more
are sums of its 5-min slice records (``model_pool_slo:sli_errors:rate5m`` and ``...:sli_judged:rate5m``):
read raw, every sample of every engine cost Prometheus a 3d read at each evaluation.

Attainment SLOs get the SRE-workbook multi-window multi-burn-rate alerts from the table the guard evaluates too
(``sla_guard.burn_windows.burn_rules``): fixed windows, factors scaled by the SLO's own period.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from alerts.params import RuleParams, fmt_duration
from exporters import contract as c
from exporters import promql as q
from exporters.contract import Metric
from exporters.label_text import any_of_literal, string_literal
from sla_guard.burn_windows import burn_rules
from sla_guard.config import SLO, GuardConfig, Indicator, Objective, SLOSet, parse_duration

LABELS = ("model", "pool")
SLO_LABELS = ("model", "pool", "slo")
CLIENT = c.Pool.CLIENT.value
# availability's requests: the outcomes it counts (the client's own 4xx and aborts are in neither part)
COUNTED = f"outcome=~{any_of_literal(c.AVAILABILITY_COUNTED)}"
# an attainment's windows of a day or more are read from its 5-min records (errors and judged
# requests per second), summed: Prometheus reads every sample a range selects, at each evaluation
SLICE = "5m"
SLICED_FROM_S = 86_400.0


def scoped(slo: SLO, pool: str, matchers: list[str], build: Callable[[Metric, list[str]], str]) -> str:
    """``build(metric, matchers)`` over the families an SLO set of ``pool`` reads: the engine
    histograms for an engine pool, the client histograms for ``client``, and for ``*`` both,
    joined with ``or`` (each family held to its own pools, so nothing counts twice). Availability
    reads the client scope's outcome counter (its sets are client sets)."""
    if slo.indicator is Indicator.AVAILABILITY:
        return build(c.CLIENT_REQUESTS, matchers)
    engine, client = c.latency_metric(slo.indicator.value, None), c.latency_metric(slo.indicator.value, CLIENT)
    if pool == CLIENT:
        return build(client, matchers)
    if pool != "*":
        return build(engine, matchers)
    not_client, only_client = [*matchers, f'pool!="{CLIENT}"'], [*matchers, f'pool="{CLIENT}"']
    return f"({build(engine, not_client)})\nor ({build(client, only_client)})"


class GenerationError(ValueError):
    """An SLO spec the rule generator cannot express; the message says how to change it."""


def _covers(u: SLOSet, t: SLOSet) -> bool:
    return u.model in ("*", t.model) and u.pool in ("*", t.pool)


def _score(s: SLOSet) -> int:
    return (s.model != "*") * 2 + (s.pool != "*")  # as GuardConfig.slos_for ranks sets


def _overlap(s: SLOSet, t: SLOSet) -> bool:
    return all("*" in (a, b) or a == b for a, b in ((s.model, t.model), (s.pool, t.pool)))


def set_matchers(sets: Sequence[SLOSet], i: int) -> list[str]:
    """Label matchers that select exactly the series SLO set ``i`` governs: its own model/pool,
    minus the series an overlapping, more specific set claims (ranked as ``GuardConfig.slos_for``)."""
    s = sets[i]
    pos = [f"{lab}={string_literal(v)}" for lab, v in (("model", s.model), ("pool", s.pool)) if v != "*"]
    neg: dict[str, list[str]] = {"model": [], "pool": []}
    for j, t in enumerate(sets):
        if j == i or not _overlap(s, t) or _score(t) <= _score(s):
            continue
        extra = [lab for lab, mine, theirs in (("model", s.model, t.model), ("pool", s.pool, t.pool))
                 if mine == "*" and theirs != "*"]
        if len(extra) == 2:
            if any(k not in (i, j) and _covers(u, t) and _score(u) > _score(s) and _score(u) in (1, 2)
                   for k, u in enumerate(sets)):
                continue  # already excluded through a one-label set that contains it
            raise GenerationError(
                f"slos[{j}] (model={t.model!r}, pool={t.pool!r}) overrides part of slos[{i}] (model='*', pool='*');"
                " label matchers cannot express that exclusion. Add a set for model "
                f"{t.model!r} with pool '*' or split slos[{i}] by pool.")
        lab = extra[0]
        neg[lab].append(t.model if lab == "model" else t.pool)
    for lab, values in neg.items():
        if values:
            pos.append(f"{lab}!~{any_of_literal(values)}")
    return pos


def window_name(window: str) -> str:
    """A window as recording-rule names and PromQL ranges can spell it: the config accepts
    '1.5h', but ``...:rate1.5h`` is no metric name and ``[1.5h]`` no range (Prometheus refused
    the whole rule file); '90m' is both."""
    return fmt_duration(parse_duration(window))


def _windows(slo: SLO) -> list[str]:
    if slo.objective is Objective.ATTAINMENT:
        out: list[str] = []
        for row in burn_rules(parse_duration(slo.period)):
            out += [row.long, row.short]
        return sorted(set(out), key=parse_duration)
    return [window_name(slo.window)]


def set_label(s: SLOSet) -> str:
    """``slo_set`` value: the set's own ``model/pool`` as written in the config, so a user sees
    which set's objective a series or alert measures (pool never holds a ``/``; a model may)."""
    return f"{s.model}/{s.pool}"


def own_labels(slo: SLO, sset: SLOSet) -> dict[str, str]:
    """Static labels of every rule for ``slo`` in ``sset``: unique per (set, objective), since the
    config allows one set per (model, pool) and one objective name per set."""
    return {"slo": slo.name, "slo_set": set_label(sset)}


def _rec(name: str, expr: str, own: dict[str, str]) -> dict:
    return {"record": name, "expr": expr, "labels": dict(own)}


def _refused(slo: SLO, metric: Metric) -> Metric | None:
    """The counter whose requests count as attainment misses of ``metric``, errors and requests both."""
    return c.UNOBSERVED_MISSES.get(metric) if slo.objective is Objective.ATTAINMENT else None


def _requests(slo: SLO, metric: Metric, window: str, matchers: list[str]) -> str:
    if metric is c.CLIENT_REQUESTS:
        return q.sum_by(LABELS, q.rate(metric, window, matchers=[*matchers, COUNTED]))
    served = q.sum_by(LABELS, q.rate(metric, window, "_count", matchers))
    refused = _refused(slo, metric)
    return served if refused is None else q.plus_or_zero(served, q.sum_by(LABELS, q.rate(refused, window,
                                                                                          matchers=matchers)))


def _slice_records(slo: SLO, own: dict[str, str], pool: str, matchers: list[str], window: str) -> list[dict]:
    """An attainment or availability SLO's 5-min slice: errors and judged requests per second
    (attainment: over the threshold, and all, where the threshold bucket covered the slice;
    availability: failed by the service, and counted), and their ratio read from the two. The
    windows of a day or more sum these records."""
    if slo.indicator is Indicator.AVAILABILITY:
        def parts(m: Metric, ms: list[str]) -> tuple[str, str]:
            return q.outcome_parts(m, "outcome", c.AVAILABILITY_FAILED, c.AVAILABILITY_COUNTED, window, LABELS, ms)
    else:
        def parts(m: Metric, ms: list[str]) -> tuple[str, str]:
            good, judged = q.share_parts(m, slo.threshold_s or 0.0, window, LABELS, ms, refused=_refused(slo, m))
            return f"({judged})\n- ({good})", judged
    errors, judged = (f"model_pool_slo:sli_{part}:rate{SLICE}" for part in ("errors", "judged"))
    return [_rec(errors, scoped(slo, pool, matchers, lambda m, ms: parts(m, ms)[0]), own),
            _rec(judged, scoped(slo, pool, matchers, lambda m, ms: parts(m, ms)[1]), own),
            _rec(f"model_pool_slo:sli_error:ratio_rate{SLICE}", q.ratio(_sel(errors, own, []), _sel(judged, own, [])),
                 own)]


def _summed(own: dict[str, str], window: str, sw: str) -> list[dict]:
    """A window of a day or more from the slices' records: every raw sample of every engine read at
    each evaluation instead cost ~120 M samples a minute for a 3d ratio on 1,000 engines scraped
    every 15 s. The ratio is still errors over judged requests summed over the whole window (not an
    average of slice ratios); each slice counts an engine once its threshold bucket covered that
    slice (the raw window left it out until the whole window was covered). The window reads the
    slices ending in it: its edges lag by up to a slice."""
    errors, judged, requests = (_sel(f"model_pool_slo:sli_{part}:rate{SLICE}", own, [])
                                for part in ("errors", "judged", "requests"))
    return [_rec(f"model_pool_slo:sli_requests:rate{window}", f"avg_over_time({requests}[{sw}])", own),
            _rec(f"model_pool_slo:sli_error:ratio_rate{window}",
                 q.ratio(f"sum_over_time({errors}[{sw}])", f"sum_over_time({judged}[{sw}])"), own)]


def slo_recording_rules(slo: SLO, own: dict[str, str], matchers: list[str], p: RuleParams,
                        pool: str = "*") -> list[dict]:
    rules = []
    windows = _windows(slo)
    sliced = slo.objective is Objective.ATTAINMENT and SLICE in windows
    for w in windows:
        sw = p.window(w)
        if sliced and parse_duration(w) >= SLICED_FROM_S:
            rules += _summed(own, w, sw)
            continue
        rules.append(_rec(f"model_pool_slo:sli_requests:rate{w}", scoped(
            slo, pool, matchers, lambda m, ms, sw=sw: _requests(slo, m, sw, ms)), own))
        if sliced and w == SLICE:
            rules += _slice_records(slo, own, pool, matchers, sw)
        elif slo.indicator is Indicator.AVAILABILITY:
            rules.append(_rec(f"model_pool_slo:sli_error:ratio_rate{w}", scoped(
                slo, pool, matchers, lambda m, ms, sw=sw: q.outcome_ratio(
                    m, "outcome", c.AVAILABILITY_FAILED, c.AVAILABILITY_COUNTED, sw, LABELS, ms)), own))
        elif slo.objective is Objective.ATTAINMENT:
            good = scoped(slo, pool, matchers, lambda m, ms, sw=sw: q.share_at_or_below(
                m, slo.threshold_s, sw, LABELS, ms, refused=_refused(slo, m)))
            rules.append(_rec(f"model_pool_slo:sli_error:ratio_rate{w}", f"1 - ({good})", own))
        elif slo.objective is Objective.MEAN:
            rules.append(_rec(f"model_pool_slo:sli_latency_seconds:mean{w}", scoped(
                slo, pool, matchers, lambda m, ms, sw=sw: q.mean(m, sw, LABELS, ms)), own))
        else:
            rules.append(_rec(f"model_pool_slo:sli_latency_seconds:quantile{w}", scoped(
                slo, pool, matchers, lambda m, ms, sw=sw: q.quantile(slo.percentile or 0.5, m, sw, LABELS, ms)), own))
    return rules


def _sel(name: str, own: dict[str, str], matchers: list[str]) -> str:
    inner = ", ".join([*(f"{k}={string_literal(v)}" for k, v in own.items()), *matchers])
    return f"{name}{{{inner}}}"


def _traffic_guard(slo: SLO, own: dict[str, str], window: str, matchers: list[str], p: RuleParams) -> str:
    secs = parse_duration(p.window(window))
    return (f"and on (model, pool, slo) {_sel(f'model_pool_slo:sli_requests:rate{window}', own, matchers)}"
            f" * {secs:g} >= {slo.min_requests}")


def slo_alert_rules(slo: SLO, own: dict[str, str], matchers: list[str], p: RuleParams) -> list[dict]:
    avail = slo.indicator is Indicator.AVAILABILITY
    ind = "Availability" if avail else slo.indicator.value.upper()
    thr = "" if avail else f"{slo.threshold_s:g}s"
    missed = f"requests failed (outcome={c.AVAILABILITY_FAILED})" if avail else f"{ind} requests exceeded {thr}"
    scope = "{{ $labels.model }}/{{ $labels.pool }}"
    if slo.objective is Objective.ATTAINMENT:
        budget = round(1 - (slo.target or 0), 10)
        out = []
        for row in burn_rules(parse_duration(slo.period)):
            factor = row.factor
            limit = f"{round(factor * budget, 10):g}"
            expr = "\n".join([
                f"{_sel(f'model_pool_slo:sli_error:ratio_rate{row.long}', own, matchers)} > {limit}",
                f"and on (model, pool, slo) {_sel(f'model_pool_slo:sli_error:ratio_rate{row.short}', own, matchers)}"
                f" > {limit}",
                _traffic_guard(slo, own, row.short, matchers, p),
            ])
            out.append(p.alert(
                "SlaGuardErrorBudgetBurn", expr, row.severity, for_="0s",
                labels={**own, "long_window": row.long, "short_window": row.short},
                summary=f"{scope}: {ind} error budget of SLO {slo.name} burning {factor:g}x too fast",
                description=(f"{{{{ $value | humanizePercentage }}}} of {missed} over the "
                             f"last {row.long} (and the last {row.short}); target {slo.target:g} over "
                             f"{slo.period}. At this rate {row.budget_fraction:.0%} of the {slo.period} error "
                             f"budget is gone in {row.long}."),
                runbook="slaguarderrorbudgetburn"))
        return out
    w = window_name(slo.window)
    if slo.objective is Objective.MEAN:
        name, rec, sev, what = f"SlaGuard{ind}MeanHigh", f"model_pool_slo:sli_latency_seconds:mean{w}", \
            "critical", f"Mean {ind}"
    else:
        pct = f"p{round((slo.percentile or 0) * 100):g}"
        name, rec, sev, what = f"SlaGuard{ind}PercentileHigh", \
            f"model_pool_slo:sli_latency_seconds:quantile{w}", "warning", f"{pct} {ind}"
    expr = f"{_sel(rec, own, matchers)} > {slo.threshold_s:g}\n{_traffic_guard(slo, own, w, matchers, p)}"
    return [p.alert(
        name, expr, sev, for_=p.slo_for, labels=dict(own),
        summary=f"{scope}: {what} {{{{ $value | humanizeDuration }}}} breaches the SLA of {thr}",
        description=(f"{what} of {scope} over the last {slo.window} is {{{{ $value | humanizeDuration }}}}, "
                     f"above the {thr} objective '{slo.name}' (at least {slo.min_requests} requests in the window)."),
        runbook=name.lower())]


def data_stale_alert(slo: SLO, own: dict[str, str], matchers: list[str], p: RuleParams, pool: str = "*") -> dict:
    """The guard reads an SLO as unknown although Prometheus sees the engines serve enough requests
    for it: the guard, not the pool, lacks data. A pool that serves nothing for an indicator (TPOT
    on prefill engines) is unknown by design and stays quiet."""
    status = q.series(c.GUARD_SLO_STATUS, matchers=[f'slo="{slo.name}"', 'status="unknown"', *matchers])
    served = scoped(slo, pool, matchers, lambda m, ms: q.sum_by(LABELS, (
        q.increase(m, p.window(slo.window), matchers=[*ms, COUNTED]) if m is c.CLIENT_REQUESTS
        else q.increase(m, p.window(slo.window), "_count", ms))))
    # parenthesised: '*' joins engine and client counts with `or`, which binds looser than `and`
    # and `>=` (the client half alone fired, the guard's status and the bound left out)
    return p.alert(
        "SlaGuardDataStale", f"{status} == 1\nand on (model, pool) ({served}) >= {slo.min_requests}", "warning",
        for_="15m", labels=dict(own),
        summary="{{ $labels.model }}/{{ $labels.pool }}: the guard reads SLO {{ $labels.slo }} as unknown while "
                "the pool serves traffic",
        description=(f"For 15m the guard has had no usable data for '{slo.name}' (stale, missing or reset series, "
                     f"failed scrapes), while Prometheus counts at least {slo.min_requests} requests per "
                     f"{slo.window} on the pool's engines. Why: the pool's reason in the guard's /v1/slo "
                     f"(down targets with their failure kind and the field to fix, or the failing source)."),
        runbook="slaguarddatastale")


def pool_absent_alert(sset: SLOSet, p: RuleParams) -> dict | None:
    """A pool of the set that had SLI series within ``pool_absent_window`` and has none now. Every
    SLA alert of the set reads ratios of those series: with all of a pool's engines gone (the
    deployment deleted or relabelled, every scrape failing) they evaluate to nothing, no alert,
    as if the pool met its SLA. Read from the set's own request-rate records (one series per
    pool and objective, cheap over a day), the shortest window of each objective; None when no
    objective records one (an attainment period too short for any burn window)."""
    sel = f"{{slo_set={string_literal(set_label(sset))}}}"
    names = sorted({f"model_pool_slo:sli_requests:rate{w[0]}" for slo in sset.objectives_for(sset.pool)
                    if (w := _windows(slo))})
    if not names:
        return None
    seen = " or ".join(f"last_over_time({n}{sel}[{p.window(p.pool_absent_window)}])" for n in names)
    now = " or ".join(f"{n}{sel}" for n in names)
    expr = f"group by (model, pool) ({seen})\nunless on (model, pool) group by (model, pool) ({now})"
    return p.alert(
        "SlaGuardPoolAbsent", expr, "warning", for_=p.pool_absent_for, labels={"slo_set": set_label(sset)},
        summary="{{ $labels.model }}/{{ $labels.pool }}: no SLI series; its SLOs cannot be judged",
        description=(f"Prometheus had request series of {{{{ $labels.model }}}}/{{{{ $labels.pool }}}} (SLO set "
                     f"{set_label(sset)}) within the last {p.pool_absent_window} and has none for "
                     f"{p.pool_absent_for}: every engine of the pool is gone (deployment deleted or relabelled, "
                     "every scrape failing). Its SLA alerts read nothing and cannot fire. Resolves when the "
                     f"series return, or {p.pool_absent_window} after they vanished."),
        runbook="slaguardpoolabsent")


def engine_buckets(config: GuardConfig, slo: SLO) -> list[float]:
    """Bucket bounds the config declares the engines (and the proxy) were started with for the
    SLO's indicator: the guard accepts an attainment threshold there, so the rules must too."""
    return list(getattr(config.engine_buckets, slo.indicator.value))


def slo_groups(config: GuardConfig, p: RuleParams) -> list[dict]:
    """One group per SLO set: its recording rules first, then the alerts that read them. Rules
    of one group run in order at each evaluation; separate groups run in no fixed order (in
    Prometheus and in promtool's unit tests), so alerts could read the previous step's ratios."""
    groups = []
    for i, sset in enumerate(config.slos):
        matchers = set_matchers(config.slos, i)
        suffix = "" if (sset.model, sset.pool) == ("*", "*") else f"-{sset.model}-{sset.pool}".replace("*", "all")
        records, alerts = [], []
        for slo in sset.objectives_for(sset.pool):  # the guard's objectives (default SLAs: prefill TTFT only)
            metric = None if slo.threshold_s is None else c.latency_metric(slo.indicator.value, sset.pool)
            if metric is not None and slo.objective is Objective.ATTAINMENT \
                    and not q.has_bucket(metric, slo.threshold_s, engine_buckets(config, slo)):
                raise GenerationError(
                    f"slos[{i}] objective {slo.name!r}: threshold_s {slo.threshold_s} is not a bucket of "
                    f"{metric.name}; start the engines with {metric.slo_threshold_env}={slo.threshold_s} and declare "
                    f"it as engine_buckets: {{{slo.indicator.value}: [{slo.threshold_s:g}]}}, or pick one of "
                    + ", ".join(f"{b:g}" for b in metric.buckets))
            own = own_labels(slo, sset)
            records += slo_recording_rules(slo, own, matchers, p, sset.pool)
            alerts += slo_alert_rules(slo, own, matchers, p)
            alerts.append(data_stale_alert(slo, own, matchers, p, sset.pool))
        if absent := pool_absent_alert(sset, p):
            alerts.append(absent)
        groups.append({"name": f"sla-guard-slo{suffix}", "rules": records + alerts})
    return groups


__all__ = ["GenerationError", "fmt_duration", "own_labels", "set_label", "set_matchers", "slo_groups", "window_name"]
