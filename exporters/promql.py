"""PromQL built from contract ``Metric`` objects, shared by the alert rules, the dashboards and the guard's
Prometheus mode (one definition of each query they share: bucket coverage, the hook stall).

Nothing here spells a metric name: every selector starts from a contract ``Metric``, and the
helpers refuse combinations that would be wrong PromQL semantics (``rate`` of a gauge, a
``_bucket`` suffix on a counter), so a contract change breaks generation, not production.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

from exporters import contract as c
from exporters.contract import Kind, Metric
from exporters.label_text import any_of_literal, le_spellings

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def le(threshold: float) -> str:
    """The ``le`` label value prometheus_client writes for a bucket bound (2.5 -> "2.5", 5 -> "5.0")."""
    return floatToGoString(float(threshold))


def le_matcher(threshold: float) -> str:
    """Matcher for the bucket whose bound is ``threshold``, in every spelling exporters write:
    prometheus_client "2.0", Go and Rust clients (the routers: llm-d, Dynamo) "2". Prometheus 2.x
    stores ``le`` as scraped, so ``le="2.0"`` never matched a router's bucket and its client-scope
    SLO recorded nothing and never alerted (the guard reads both spellings)."""
    spellings = le_spellings(threshold)
    return f'le="{le(threshold)}"' if len(spellings) == 1 else f"le=~{any_of_literal(spellings)}"


def series(metric: Metric, suffix: str = "", matchers: Sequence[str] = ()) -> str:
    """A selector: the series name of ``metric`` (plus ``suffix``) and optional label matchers."""
    if metric.kind is Kind.HISTOGRAM:
        if suffix not in HISTOGRAM_SUFFIXES:
            raise ValueError(f"{metric.name} is a histogram; use one of {HISTOGRAM_SUFFIXES}")
    elif suffix:
        raise ValueError(f"{metric.name} is a {metric.kind}; it has no {suffix!r} series")
    name = metric.series(suffix)
    return f"{name}{{{', '.join(matchers)}}}" if matchers else name


def _counting(metric: Metric, suffix: str) -> None:
    if metric.kind is Kind.GAUGE:
        raise ValueError(f"{metric.name} is a gauge; rate()/increase() need a counter or histogram part")


def rate(metric: Metric, window: str, suffix: str = "", matchers: Sequence[str] = ()) -> str:
    _counting(metric, suffix)
    return f"rate({series(metric, suffix, matchers)}[{window}])"


def increase(metric: Metric, window: str, suffix: str = "", matchers: Sequence[str] = ()) -> str:
    _counting(metric, suffix)
    return f"increase({series(metric, suffix, matchers)}[{window}])"


def by(labels: Sequence[str]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def sum_by(labels: Sequence[str], expr: str) -> str:
    return f"sum{by(labels)} ({expr})"


def ratio(num: str, den: str) -> str:
    return f"({num})\n/\n({den})" if "\n" in num + den else f"({num}) / ({den})"


def mean(metric: Metric, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Request-weighted mean of a histogram over ``window``: sum of rates of _sum over _count."""
    return ratio(sum_by(labels, rate(metric, window, "_sum", matchers)),
                 sum_by(labels, rate(metric, window, "_count", matchers)))


def quantile(q: float, metric: Metric, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    inner = sum_by((*labels, "le"), rate(metric, window, "_bucket", matchers))
    return f"histogram_quantile({q:g}, {inner})"


def share_parts(metric: Metric, threshold: float, window: str, labels: Sequence[str],
                matchers: Sequence[str] = (), refused: Metric | None = None) -> tuple[str, str]:
    """The good and the judged requests per second of an attainment SLI (observations <= threshold,
    and all of them): its share is good / judged. The threshold must be a bucket bound.

    Only series whose threshold bucket holds as many samples in the window as their ``_count``
    count, in the good ones and the total alike (``covered``): an engine started without the
    threshold bucket (mid rolling restart to new SLA buckets) would otherwise add its requests to
    the total and none to the good ones, every one of them an error (two engines, one without the
    bucket: 50 % errors and a page), as the guard keeps them out too; and an engine upgraded to a
    bucket set with the threshold (or without it any more) has the bucket for part of the window
    only, its ``rate`` counting since the bucket appeared while ``_count``'s counts all of it (5 %
    attainment and every burn alert on requests all in time). Such an engine is left out of the
    window until the window has passed since the change.

    ``refused``: a counter of requests refused before they were observed (admission rejections):
    added to the total, none of them good; a pool without that series counts none."""
    at = (*matchers, le_matcher(threshold))
    covered = bucket_covered(metric, threshold, window, matchers)
    good = sum_by(labels, f"{rate(metric, window, '_bucket', at)} and ignoring (le) ({covered})")
    total = sum_by(labels, f"{rate(metric, window, '_count', matchers)} and ({covered})")
    if refused is not None:
        total = plus_or_zero(total, sum_by(labels, rate(refused, window, matchers=matchers)))
    return good, total


def share_at_or_below(metric: Metric, threshold: float, window: str, labels: Sequence[str],
                      matchers: Sequence[str] = (), refused: Metric | None = None) -> str:
    """Share of observations <= threshold over ``window`` (``share_parts``' good / judged)."""
    return ratio(*share_parts(metric, threshold, window, labels, matchers, refused))


def outcome_parts(metric: Metric, label: str, failed: str, counted: Sequence[str], window: str,
                  labels: Sequence[str], matchers: Sequence[str] = ()) -> tuple[str, str]:
    """The failed and the counted requests per second of an availability SLI: requests whose
    ``label`` is ``failed``, 0 (not nothing) for a group that never failed one (no ``failed`` series
    yet), and those whose ``label`` is one of ``counted``."""
    total = sum_by(labels, rate(metric, window, matchers=[*matchers, f"{label}=~{any_of_literal(counted)}"]))
    failures = sum_by(labels, rate(metric, window, matchers=[*matchers, f'{label}="{failed}"']))
    return f"{failures} or {total} * 0", total


def outcome_ratio(metric: Metric, label: str, failed: str, counted: Sequence[str], window: str,
                  labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Share of requests whose ``label`` is ``failed`` among those whose ``label`` is one of
    ``counted`` (an availability SLI's error ratio), request-weighted over ``window``."""
    return ratio(*outcome_parts(metric, label, failed, counted, window, labels, matchers))


def bucket_covered(metric: Metric, threshold: float, window: str, matchers: Sequence[str] = ()) -> str:
    """The histogram children (labels without ``le``) whose ``le=threshold`` bucket holds as many
    samples over ``window`` as their ``_count``: the bucket was there all the window. One that
    appeared or vanished inside it (an engine restarted with another bucket set) counts part of the
    window while ``_count`` counts all of it. The rules (``share_at_or_below``) count a child in a
    window only once covered; the guard leaves the windows of the others unjudged
    (``PrometheusView.uncovered_buckets``), the period judged over the part covered
    (``bucket_uncovered_until``)."""
    at = (*matchers, le_matcher(threshold))
    return (f"max without (le) (count_over_time({series(metric, '_bucket', at)}[{window}])) "
            f">= count_over_time({series(metric, '_count', matchers)}[{window}])")


def bucket_uncovered_until(metric: Metric, threshold: float, window: str, step: str,
                           matchers: Sequence[str] = ()) -> str:
    """Per histogram child, the end of the last ``step``-long slice of ``window`` that its
    ``le=threshold`` bucket did not cover (``bucket_covered`` over the slice: ``_count`` has samples
    there the bucket has not): the bucket covers the child from that time on, up to the last slice's
    end. A child every slice of which is covered is left out. The slices tile the window (a subquery
    at ``step``), so a change inside one is never missed, and the span it gives reads short by at
    most ``step``, never long (reading long would count the requests before the bucket as misses).
    The guard judges an attainment period over that span after a bucket change
    (``PrometheusView.bucket_covered_since``)."""
    missing = (f"count_over_time({series(metric, '_count', matchers)}[{step}]) * 0 + time() "
               f"unless ({bucket_covered(metric, threshold, step, matchers)})")
    return f"max_over_time(({missing})[{window}:{step}])"


def plus_or_zero(base: str, extra: str) -> str:
    """``base + extra`` where a group of ``base`` without ``extra`` (a deployment whose engines do not
    export it) keeps its value: plain ``+`` drops it."""
    return f"{base} + ({extra} or {base} * 0)"


def has_bucket(metric: Metric, threshold: float, extra: Sequence[float] = ()) -> bool:
    """``threshold`` is a bucket bound of ``metric``: a contract bucket, or one of ``extra`` (the
    config's ``engine_buckets``, which the engines add through ``SLA_GUARD_*_SLO_S``)."""
    return any(abs(b - threshold) < 1e-12 for b in (*metric.buckets, *extra))


# the series that name one engine of one scraped page (vLLM's labels and the hook's share ``engine``)
HOOK_ENGINE = ("job", "instance", "engine")


def duration(seconds: float) -> str:
    """A PromQL duration, in the largest unit it is a whole number of (300 -> '5m', 1.5 -> '1500ms')."""
    ms = round(seconds * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def last_moved(selector: str, compare: str, lookback: str, step: str, offset: str = "") -> str:
    """Per engine (``HOOK_ENGINE``), the end of the last ``step`` within ``lookback`` (ending ``offset``
    ago) in which ``selector`` moved: stood ``compare`` to its value one ``step`` before (``>`` a rise;
    ``!=`` any move, a rise or a reset at a restart, and with ``!=`` a series that appeared counts
    too: a restarted target is back after its series went stale). A Unix time; nothing where it did
    not move. Instant values one step apart, not ``changes()`` over a range: a move between two
    steps' ranges would fall in neither."""
    moved = f"{selector} {compare} {selector} offset {step}"
    if compare == "!=":
        moved = f"({moved}) or ({selector} unless {selector} offset {step})"
    shift = f" offset {offset}" if offset else ""
    return f"max by ({', '.join(HOOK_ENGINE)}) (max_over_time(timestamp({moved})[{lookback}:{step}]{shift}))"


def hook_stalled(window_s: float, settle_s: float, lookback_s: float, step_s: float,
                 matchers: Sequence[str] = ()) -> str:
    """One series per engine whose sla-guard hook stopped recording, valued at the time since when a
    counter of the hook's (each of ``HOOK_RECORDED``) has not moved: vLLM's own generated-token
    counter rose, at least ``settle_s`` ago, after that counter last moved, and that counter has not
    moved for ``window_s + settle_s`` since, on a page (``job``, ``instance``) that exports that
    counter. Where it did not move within the ``lookback_s`` (an engine vLLM added after the hook
    stopped has none of its own), the lookback's start stands in. Held until the hook's counter
    moves again (a new process's starts from 0: a move) or vLLM's last rise is ``lookback_s`` old:
    judged over a 5-min window only, an engine that stopped generating after the stall read idle
    again 5 min later, and its next traffic went unseen for 5 min more. An idle engine moves
    neither; a page without vLLM's series (the sidecar) or without the hook's counter (an older
    plugin) is not evidence. The page's ``model`` and ``pool`` come from the hook's series; one
    series per engine, whichever counter stood still (``or`` keeps the first); one query for the
    whole fleet. Moves are placed to the end of their ``step_s``: a hook that lags vLLM by a scrape
    moves in the same step or a later one, so vLLM's rise must be a step after the hook's move."""
    ident = ", ".join(HOOK_ENGINE)
    lookback, step, settle = duration(lookback_s), duration(step_s), duration(settle_s)
    vllm = f"{c.VLLM_GENERATION_TOKENS}{{{', '.join(matchers)}}}" if matchers else c.VLLM_GENERATION_TOKENS
    rose = last_moved(vllm, ">", lookback, step, settle)
    parts = []
    for m in c.HOOK_RECORDED:
        moved = last_moved(series(m, matchers=matchers), "!=", duration(lookback_s + settle_s), step)
        since = f"{moved}\n    or on ({ident}) group by ({ident}) ({vllm}) * 0 + (time() - {lookback_s + settle_s:g})"
        page = (f"topk by (job, instance) (1, group by (job, instance, model, pool) "
                f"(last_over_time({series(m, matchers=matchers)}[{duration(window_s + settle_s)}])))")
        # since <= min(vLLM's last rise - half a step, now - window - settle): both are step ends, so
        # vLLM rose in a later step than the hook's last move, which stood still for window and settle
        still = f"clamp_max({rose} - {step_s / 2:g}, time() - {window_s + settle_s:g})"
        parts.append(f"(\n  (\n    {since}\n  )\n  <= on ({ident}) {still}\n)"
                     f"\n  * on (job, instance) group_left (model, pool) {page}")
    return "\nor\n".join(parts)
