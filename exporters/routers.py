"""Router adapters: the client scope from the metrics routers already export, without our proxy.

NVIDIA Dynamo's frontend, the llm-d router's endpoint picker (EPP, formerly the Gateway API
Inference Extension's) and the vLLM production-stack router each measure what their clients see.
One ``Adapter`` per router lists, per contract client-scope metric, the router's own families that
carry it (``RouterMapping``: family, labels, where it was read in the router's source). The same
table drives both modes:

* scrape mode: ``translate`` (pure) turns one page of a router's exposition into contract samples
  (``pool="client"``, ``route``, ``router=<adapter name>``, ``model`` from the router's model
  label), which the guard's scraper stores for targets with ``adapter:`` set;
* Prometheus mode: ``alerts/router_rules.py`` renders the same table as recording rules.

Rules of the translation (docs/routers.md has the tables and what cannot be mapped):
* histograms keep the router's OWN bucket boundaries (the guard reads ``le`` from the page;
  re-bucketing cannot be exact). A threshold that is not a boundary there is "unknown";
* series are summed over the router's other labels (endpoint, target model, priority, ...) per
  model: sums of counters and of histogram buckets with equal boundaries are exact;
* where a router exposes the same quantity under an old and a new name (llm-d renamed its EPP
  families twice), the first mapping in the table that has samples for a model wins, so a page
  carrying both the deprecated and the new family is not counted twice;
* counters become ``outcome``-labelled only where the router's own labels say how a request ended;
  a counter that is not monotonic after the mapping is not mapped (see llm-d below).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from exporters import contract as c

# (label, "=" | "!=" | "=~" | "!~", value); a missing label reads as ""; a regex is anchored, as
# in PromQL, and is written into the recording rules as it stands (no quotes or backslashes)
Matcher = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class RouterMapping:
    """One router family -> one contract client-scope metric.

    ``native``: for a histogram the family's base name (``_bucket``/``_sum``/``_count`` follow);
    for a counter or gauge the exact sample name (counters with ``_total``; a histogram's
    ``_count`` may feed a counter). ``labels``: the family's labels as the router's source declares
    them (summed away, except the model label). ``where``: only samples matching all of these.
    ``outcomes``: for ``CLIENT_REQUESTS``, ``(matchers, outcome)`` pairs with disjoint matchers; a
    sample matching none is dropped. ``source``: repository, commit and path (or docs URL) where
    the name, type, labels and unit were read."""

    native: str
    metric: c.Metric
    model_label: str
    labels: tuple[str, ...]
    source: str
    where: tuple[Matcher, ...] = ()
    outcomes: tuple[tuple[tuple[Matcher, ...], c.Outcome], ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class Adapter:
    """A router: its mappings (per contract metric, in order of preference), the route its
    measured requests took, and what it exports that cannot be mapped faithfully (and why)."""

    name: str
    route: c.Route
    mappings: tuple[RouterMapping, ...]
    unmapped: tuple[tuple[str, str], ...] = ()

    def for_metric(self, metric: c.Metric) -> tuple[RouterMapping, ...]:
        return tuple(m for m in self.mappings if m.metric is metric)

    @property
    def metrics(self) -> tuple[c.Metric, ...]:
        return tuple(dict.fromkeys(m.metric for m in self.mappings))


M = RouterMapping
OK, ERROR, CLIENT_ERROR, ABORTED = c.Outcome.OK, c.Outcome.ERROR, c.Outcome.CLIENT_ERROR, c.Outcome.ABORTED

# --- NVIDIA Dynamo frontend ----------------------------------------------------------------------
# ai-dynamo/dynamo lib/llm/src/http/service/metrics.rs (Metrics::new, InflightGuard,
# ResponseMetricCollector; read at 79a21ca4f5200e76a2bcc19580eb6176298c7e59 and at a later
# revision that added the error_type label) and lib/runtime/src/metrics/prometheus_names.rs
# (04070c75b52f33346a2d5723eed93a0093e77bad: prefix "dynamo_frontend", status success|error,
# error_type ""|validation|not_found|overload|cancelled|internal|not_implemented). Rust
# `prometheus` crate; the model label is lower-cased by the frontend. Docs:
# https://docs.nvidia.com/dynamo/v1.7.0/reference/observability/metrics-catalog
_DYN = "ai-dynamo/dynamo@79a21ca4f5200e76a2bcc19580eb6176298c7e59:lib/llm/src/http/service/metrics.rs"
_DYN_CLIENT = "validation|not_found"  # error_type values of a 4xx answer (prometheus_names.rs)
# error_type values set only from an HTTP error answer, given before any SSE stream exists (openai.rs
# extract_error_type_from_response: 429/529 overload, 503 overload or, later, unavailable); once a stream
# runs, disconnect.rs monitor_for_disconnects marks only internal, backend_error, truncated_stream, the
# timeouts and cancelled. error_type values: prometheus_names.rs at 4415465e; ResponseMetricCollector in
# metrics.rs at 0014908a25aecc8e9ce7455bbbaddf9f1521a1b4; openai.rs and disconnect.rs at the newest revision
# the search index held (its commit not named there)
_DYN_REFUSED = "overload|unavailable"
_DYN_NOW = "ai-dynamo/dynamo@4415465e3e0d30b12163c3c3f15d49ed78b300a8:lib/runtime/src/metrics/prometheus_names.rs"
DYNAMO = Adapter("dynamo", c.Route.PD, (
    # observed once per request at the first chunk with tokens: handler entry -> first token
    M("dynamo_frontend_time_to_first_token_seconds", c.CLIENT_TTFT, "model", ("model",), _DYN),
    # observed once PER TOKEN (chunk gap / tokens in chunk), not once per request: its mean is
    # token-weighted. The only decode-speed histogram Dynamo exports; mapped with that caveat.
    M("dynamo_frontend_inter_token_latency_seconds", c.CLIENT_TPOT, "model", ("model",), _DYN,
      note="per-token observations (token-weighted), not one per request"),
    # InflightGuard: handler entry -> guard dropped (response finished or failed)
    M("dynamo_frontend_request_duration_seconds", c.CLIENT_E2E, "model", ("model",), _DYN),
    M("dynamo_frontend_requests_total", c.CLIENT_REQUESTS, "model",
      ("model", "endpoint", "request_type", "status", "error_type"), _DYN,
      outcomes=(((("status", "=", "success"),), OK),
                ((("status", "=", "error"), ("error_type", "=", "cancelled")), ABORTED),
                # the client's own 4xx ("Validation:" answers, 404 no such model), as the proxy
                # counts them (contract.outcome_of_status); overload is a 503
                ((("status", "=", "error"), ("error_type", "=~", _DYN_CLIENT)), CLIENT_ERROR),
                ((("status", "=", "error"), ("error_type", "!~", f"cancelled|{_DYN_CLIENT}")), ERROR))),
    # streamed requests refused with an HTTP error: no stream, so no chunk with tokens and no TTFT
    # observation, by construction; the other errors may fall before or after the first token
    M("dynamo_frontend_requests_total", c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, "model",
      ("model", "endpoint", "request_type", "status", "error_type"), _DYN_NOW,
      where=(("request_type", "=", "stream"), ("status", "=", "error"), ("error_type", "=~", _DYN_REFUSED)),
      note="a lower bound: internal, backend_error, truncated_stream and the timeouts are not counted"),
    M("dynamo_frontend_inflight_requests", c.CLIENT_IN_FLIGHT, "model", ("model",), _DYN),
), unmapped=(
    ("requests_total{request_type=\"stream\",status=\"error\"} (other error_type values)",
     "internal, backend_error, truncated_stream, response_timeout, first_token_timeout (the request plane's "
     "timer on a worker's stream) and intra_token_timeout are set while a stream runs, before or after its "
     "first token as it happens: no exact failed_before/after_first_token"),
    ("failed after the first token", "the frontend's TPOT is per token (inter_token_latency), and a stream "
                                      "cut mid-way already has its gaps in it: no per-request TPOT to miss"),
    ("dynamo_frontend_queued_requests", "requests before their first token: a subset of in-flight, no contract metric"),
    ("dynamo_frontend_disconnected_clients", "a process-wide gauge without model; aborted requests come from "
                                             "requests_total{error_type=\"cancelled\"} instead"),
    ("dynamo_frontend_worker_last_time_to_first_token_seconds", "last value per worker: a gauge, not a distribution"),
    ("route", "the frontend does not label whether a request was served disaggregated: route is \"pd\""),
))

# --- llm-d router endpoint picker (EPP; formerly the Gateway API Inference Extension's) -----------
# New names: llm-d/llm-d-router@ebab687927f5331c1b39defcb579a07951bce56c
#   pkg/epp/metrics/llm_d_router_metrics.go (subsystem "llm_d_epp") and pkg/epp/metrics/metrics.go
#   (RecordRequestTTFT / RecordRequestTPOT: TTFT labelled streaming=true|false, TPOT streaming only,
#   (e2e - TTFT) / (output tokens - 1)); the deprecated inference_objective_* are exposed next to them.
# inference_objective_*: kubernetes-sigs/gateway-api-inference-extension@a70292c1e00905bcd3412f498df0d5cca6679c33^
#   pkg/epp/metrics/metrics.go (TTFT/TPOT only from the predicted-latency plugin,
#   pkg/epp/framework/plugins/requestcontrol/dataproducer/predictedlatency/requestcontrol_hooks.go:
#   at its default streamingMode=false the "TTFT" is taken at end of stream, i.e. the whole duration,
#   so it is not mapped; TPOT is recorded in streaming mode only, (e2e - TTFT) is 0 otherwise).
# inference_model_*: the same repository at 1457f63620cc45d6dcf3fe1b9b6dca191c90307e (the parent of
#   7108536e "rename inference_model metrics to inference_objective"), pkg/epp/metrics/metrics.go.
# Go client_golang; HELP texts carry "[ALPHA] ". model_name is the model the client asked for.
_LLMD = "llm-d/llm-d-router@ebab687927f5331c1b39defcb579a07951bce56c:pkg/epp/metrics/llm_d_router_metrics.go"
_GIE = ("kubernetes-sigs/gateway-api-inference-extension@a70292c1e00905bcd3412f498df0d5cca6679c33^:"
        "pkg/epp/metrics/metrics.go")
_GIE0 = ("kubernetes-sigs/gateway-api-inference-extension@1457f63620cc45d6dcf3fe1b9b6dca191c90307e:"
         "pkg/epp/metrics/metrics.go")
_NEW = ("model_name", "target_model_name", "fairness_id", "priority")
_OLD = ("model_name", "target_model_name")
LLM_D = Adapter("llm-d", c.Route.PD, (
    M("llm_d_epp_request_ttft_seconds", c.CLIENT_TTFT, "model_name", (*_NEW, "streaming"), _LLMD,
      where=(("streaming", "=", "true"),),
      note="streamed requests only: for non-streamed ones the EPP records the whole duration as TTFT"),
    M("llm_d_epp_request_streaming_tpot_seconds", c.CLIENT_TPOT, "model_name", _NEW, _LLMD),
    M("inference_objective_request_tpot_seconds", c.CLIENT_TPOT, "model_name", _OLD, _GIE,
      note="only with the predicted-latency plugin"),
    M("llm_d_epp_request_duration_seconds", c.CLIENT_E2E, "model_name", _NEW, _LLMD),
    M("inference_objective_request_duration_seconds", c.CLIENT_E2E, "model_name", _OLD, _GIE),
    M("inference_model_request_duration_seconds", c.CLIENT_E2E, "model_name", _OLD, _GIE0),
    M("llm_d_epp_request_running", c.CLIENT_IN_FLIGHT, "model_name", _NEW, _LLMD),
    M("inference_objective_running_requests", c.CLIENT_IN_FLIGHT, "model_name", ("model_name",), _GIE),
    M("inference_model_running_requests", c.CLIENT_IN_FLIGHT, "model_name", ("model_name",), _GIE0),
), unmapped=(
    ("llm_d_epp_request_total / llm_d_epp_request_error_total (and the inference_objective_*, inference_model_* "
     "pairs)", "requests are counted on arrival and errors at the end, so ok = total - errors falls whenever an "
     "in-flight request fails, which rate() reads as a counter reset; errors alone would make every ratio 1. "
     "Alert on rate(..._error_total) / rate(..._request_total) directly"),
    ("inference_objective_request_ttft_seconds", "recorded by the predicted-latency plugin, which at its default "
     "streamingMode=false records it at the end of the response: the whole duration, streamed or not "
     "(requestcontrol_hooks.go). The page does not say which mode, and an end-to-end time read as TTFT "
     "violates a TTFT SLO that clients met; llm_d_epp_request_ttft_seconds{streaming=\"true\"} is the TTFT"),
    ("llm_d_epp_request_ntpot_seconds / inference_objective_normalized_time_per_output_token_seconds",
     "end-to-end time / output tokens includes the TTFT: not TPOT"),
    ("llm_d_epp_request_streaming_itl_seconds", "gaps between response body chunks, not per request"),
    ("route", "the EPP does not label whether a request was disaggregated: route is \"pd\""),
))

# --- vLLM production-stack router ------------------------------------------------------------------
# vllm-project/production-stack@a6c01db05f65f556235413ba8dbcfb0c01132fff
#   src/vllm_router/services/metrics_service/__init__.py (families; prometheus_client) and
#   src/vllm_router/services/request_service/request.py (process_request observes
#   vllm:request_latency_seconds{server,model,status=success|error} in its `finally`, from routing
#   to the last byte). Only route_general_request's non-disaggregated path calls process_request:
#   the disaggregated-prefill routers record nothing, hence route="aggregated".
_PS = ("vllm-project/production-stack@a6c01db05f65f556235413ba8dbcfb0c01132fff:"
       "src/vllm_router/services/request_service/request.py")
PRODUCTION_STACK = Adapter("production-stack", c.Route.AGGREGATED, (
    M("vllm:request_latency_seconds", c.CLIENT_E2E, "model", ("server", "model", "status"), _PS),
    M("vllm:request_latency_seconds_count", c.CLIENT_REQUESTS, "model", ("server", "model", "status"), _PS,
      outcomes=(((("status", "=", "success"),), OK), ((("status", "=", "error"),), ERROR)),
      note="a client that disconnects mid-stream ends the generator without an exception: counted ok"),
), unmapped=(
    ("TTFT", "not exported: the router keeps a sliding-window mean internally (RequestStatsMonitor) only"),
    ("vllm:avg_latency / vllm:avg_itl", "sliding-window means per backend server: a mean gauge is not a histogram"),
    ("vllm:num_requests_running (router)", "per backend server, no model label, and the same name as the "
                                           "engine's gauge"),
    ("vllm:request_errors_total", "counts exceptions, which request_latency_seconds{status=\"error\"} counts too"),
    ("disaggregated-prefill routing", "route_disaggregated_prefill_request records no latency metric"),
))
del M

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (DYNAMO, LLM_D, PRODUCTION_STACK)}

Sample = tuple[str, dict[str, str], float]
_SUFFIXES = ("_bucket", "_sum", "_count")


def _matches(labels: Mapping[str, str], matchers: Iterable[Matcher]) -> bool:
    return all(((re.fullmatch(value, labels.get(name, "")) is not None) if op in ("=~", "!~")
                else labels.get(name, "") == value) == (op in ("=", "=~")) for name, op, value in matchers)


def _series(mp: RouterMapping, name: str) -> str | None:
    """The contract series a sample named ``name`` feeds through ``mp``, or None."""
    m = mp.metric
    if m.kind is c.Kind.HISTOGRAM:
        if name.startswith(mp.native):
            suffix = name[len(mp.native):]
            if suffix in _SUFFIXES:
                return m.series(suffix)
        return None
    return m.series() if name == mp.native else None


def translate(samples: Iterable[tuple[str, Mapping[str, str], float]], adapter: Adapter | str, *,
              default_model: str = "default") -> list[Sample]:
    """A router page's samples ``(name, labels, value)`` -> contract client-scope samples. Pure.

    Each output carries ``model`` (the router's model label; ``default_model`` where it has
    none), ``pool="client"``, ``route`` and ``router=<adapter name>``, plus ``le`` (as the router
    wrote it) for buckets and ``outcome`` for ``CLIENT_REQUESTS``; values are summed over the
    router's other labels. Sorted by name and labels."""
    ad = ADAPTERS[adapter] if isinstance(adapter, str) else adapter
    by_name: dict[str, list[tuple[int, RouterMapping]]] = {}
    for i, mp in enumerate(ad.mappings):
        names = [mp.native + s for s in _SUFFIXES] if mp.metric.kind is c.Kind.HISTOGRAM else [mp.native]
        for n in names:
            by_name.setdefault(n, []).append((i, mp))
    # (metric, model) -> index of the preferred mapping with samples there; then the sums
    chosen: dict[tuple[str, str], int] = {}
    staged: list[tuple[int, str, str, tuple[tuple[str, str], ...], float]] = []
    for name, labels, value in samples:
        for i, mp in by_name.get(name, ()):
            if mp.where and not _matches(labels, mp.where):
                continue
            series = _series(mp, name)
            if series is None:
                continue
            extra: list[tuple[str, str]] = []
            if mp.outcomes:
                outcome = next((o for ms, o in mp.outcomes if _matches(labels, ms)), None)
                if outcome is None:
                    continue
                extra.append(("outcome", outcome.value))
            if name.endswith("_bucket") and mp.metric.kind is c.Kind.HISTOGRAM:
                le = labels.get("le")
                if le is None:
                    continue
                extra.append(("le", le))
            model = labels.get(mp.model_label) or default_model
            key = (mp.metric.name, model)
            chosen[key] = min(chosen.get(key, i), i)
            staged.append((i, series, model, tuple(extra), float(value)))
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    metric_of = {mp.metric.series(s): mp.metric.name for mp in ad.mappings
                 for s in (_SUFFIXES if mp.metric.kind is c.Kind.HISTOGRAM else ("",))}
    for i, series, model, extra, value in staged:
        if chosen[(metric_of[series], model)] != i:
            continue  # a less preferred (older) name of a quantity this page already has
        labels = (("model", model), ("pool", c.Pool.CLIENT.value), ("route", ad.route.value),
                  ("router", ad.name), *extra)
        k = (series, labels)
        sums[k] = sums.get(k, 0.0) + value
    return [(n, dict(lab), v) for (n, lab), v in sorted(sums.items())]


def translate_text(text: str, adapter: Adapter | str, *, default_model: str = "default") -> list[Sample]:
    """``translate`` over a text exposition, read with prometheus_client's reference parser
    (the guard's scraper parses with its own fast parser and calls ``translate``)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    return translate(samples, adapter, default_model=default_model)
