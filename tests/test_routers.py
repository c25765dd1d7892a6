"""Router adapters (exporters/routers.py): the client scope from Dynamo's, llm-d's and
production-stack's own metrics, in scrape mode (translation, then the guard's store and SLOs).

The pages in tests/fixtures/routers/ are REBUILT FROM THE ROUTERS' SOURCE, not recorded from
running routers (tests/fixtures/routers/rebuild.py writes them; every family's repository, commit
and path is next to its mapping in exporters/routers.py):
* dynamo.prom: ai-dynamo/dynamo lib/llm/src/http/service/metrics.rs (Rust prometheus crate);
* llm-d.prom: llm-d/llm-d-router pkg/epp/metrics/llm_d_router_metrics.go + metrics.go (new
  llm_d_epp_* next to the deprecated inference_objective_*, from the same requests);
* llm-d-gie-v0.prom: kubernetes-sigs/gateway-api-inference-extension pkg/epp/metrics/metrics.go
  before the rename (inference_model_*);
* production-stack.prom: vllm-project/production-stack
  src/vllm_router/services/metrics_service/__init__.py, written by prometheus_client itself.
Expected numbers below are worked out by hand from the observations listed in rebuild.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from guard_support import Engine, ScrapeRig, Served

from exporters import contract as c
from exporters.routers import ADAPTERS, translate, translate_text
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.exposition import parse_exposition
from sla_guard.ingest.scrape import Scraper
from sla_guard.ingest.source import UP
from sla_guard.model import Status
from sla_guard.store import SeriesStore

FIXTURES = Path(__file__).parent / "fixtures" / "routers"
QWEN, LLAMA = "qwen/qwen3-0.6b", "llama-3.1-8b"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def page(name: str) -> str:
    return (FIXTURES / f"{name}.prom").read_text()


def by_series(samples) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples}


def get(out, metric: c.Metric, suffix: str = "", **labels) -> float:
    """The one sample of ``metric`` whose labels include ``labels``."""
    hits = [v for n, lab, v in out if n == metric.series(suffix) and labels.items() <= lab.items()]
    assert len(hits) == 1, (metric.series(suffix), labels, hits)
    return hits[0]


def buckets(out, metric: c.Metric, **labels) -> dict[str, float]:
    return {lab["le"]: v for n, lab, v in out
            if n == metric.series("_bucket") and labels.items() <= lab.items()}


def scope(out) -> set[tuple[str, str, str]]:
    return {(lab["pool"], lab["route"], lab["router"]) for _, lab, _ in out}


# -- translation -------------------------------------------------------------------------------
def test_dynamo_frontend_page_maps_exactly():
    out = translate_text(page("dynamo"), "dynamo")
    assert scope(out) == {("client", "pd", "dynamo")}
    # TTFT: the frontend's own log-spaced boundaries, counts as observed (0.045 0.12 0.9 2.3 2.45 3.8)
    assert buckets(out, c.CLIENT_TTFT, model=QWEN) == {
        "0": 0, "0.0022": 0, "0.0047": 0, "0.01": 0, "0.022": 0, "0.047": 1, "0.1": 1, "0.22": 2, "0.47": 2,
        "1": 3, "2.2": 3, "4.7": 6, "10": 6, "22": 6, "48": 6, "100": 6, "220": 6, "480": 6, "+Inf": 6}
    assert get(out, c.CLIENT_TTFT, "_sum", model=QWEN) == pytest.approx(9.615)
    assert get(out, c.CLIENT_TTFT, "_count", model=QWEN) == 6
    assert get(out, c.CLIENT_TTFT, "_count", model=LLAMA) == 2
    assert get(out, c.CLIENT_TTFT, "_sum", model=LLAMA) == pytest.approx(0.9)
    # ITL (one observation per token: 40 x 8 ms, 10 x 18 ms, 5 x 30 ms)
    assert get(out, c.CLIENT_TPOT, "_count", model=QWEN) == 55
    assert get(out, c.CLIENT_TPOT, "_sum", model=QWEN) == pytest.approx(0.65)
    assert buckets(out, c.CLIENT_TPOT, model=QWEN)["0.024"] == 50
    assert get(out, c.CLIENT_E2E, "_count", model=QWEN) == 11
    assert get(out, c.CLIENT_E2E, "_sum", model=QWEN) == pytest.approx(47.7)
    # requests: success (4 chat stream + 1 completions) ok; cancelled aborted; internal, overload (2 streamed,
    # 1 unary) and unavailable error
    for outcome, n in (("ok", 5), ("aborted", 1), ("error", 5)):
        assert get(out, c.CLIENT_REQUESTS, model=QWEN, outcome=outcome) == n
    # the streams refused with an HTTP error (overload, unavailable) never had a first token
    assert get(out, c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, model=QWEN) == 3
    assert get(out, c.CLIENT_IN_FLIGHT, model=QWEN) == 2
    assert get(out, c.CLIENT_IN_FLIGHT, model=LLAMA) == 0
    # nothing else: queued, disconnected, per-worker gauges and token counters stay out
    assert {n for n, _, _ in out} == {m.series(s) for m in (c.CLIENT_TTFT, c.CLIENT_TPOT, c.CLIENT_E2E)
                                      for s in ("_bucket", "_sum", "_count")} | {
        c.CLIENT_REQUESTS.series(), c.CLIENT_IN_FLIGHT.series(), c.CLIENT_FAILED_BEFORE_FIRST_TOKEN.series()}


def test_dynamo_streams_refused_before_any_token_are_failed_before_first_token_and_nothing_else_is():
    """Dynamo's frontend observes TTFT at the first chunk with tokens (metrics.rs
    ResponseMetricCollector::observe_response), so a streamed request it fails before that is in no
    TTFT histogram. Only two error_type values say "before the first token" by construction: overload
    and unavailable are set from an HTTP error answer (openai.rs extract_error_type_from_response:
    429/529, 503), given before any SSE stream exists; once the stream runs, disconnect.rs
    monitor_for_disconnects marks only internal, backend_error, truncated_stream, the timeouts and
    cancelled (ai-dynamo/dynamo lib/runtime/src/metrics/prometheus_names.rs at 4415465e3e0d30b12163c3c3f15d49ed78b300a8,
    lib/llm/src/http/service/metrics.rs at 0014908a25aecc8e9ce7455bbbaddf9f1521a1b4; openai.rs and
    disconnect.rs at a recent revision whose commit the search index did not name). Those can
    fall on either side of the first token (first_token_timeout is the request plane's timer on a
    worker's stream, set while the client's stream runs), as can internal: not counted. Unary requests: no
    stream, not counted (as at the proxy); frontends before error_type: nothing says which, none."""
    counts = {"overload": 2, "unavailable": 3, "internal": 5, "backend_error": 7, "truncated_stream": 11,
              "response_timeout": 13, "first_token_timeout": 17, "intra_token_timeout": 19, "validation": 23,
              "not_found": 29, "cancelled": 31}
    text = ("# HELP dynamo_frontend_requests_total Total number of LLM requests processed\n"
            "# TYPE dynamo_frontend_requests_total counter\n")
    for et, n in counts.items():
        for rt, k in (("stream", 1), ("unary", 100)):
            text += (f'dynamo_frontend_requests_total{{endpoint="chat_completions",error_type="{et}",model="m",'
                     f'request_type="{rt}",status="error"}} {n * k}\n')
    out = translate_text(text, "dynamo")
    assert get(out, c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, model="m") == 2 + 3
    assert not [n for n, _, _ in out if n == c.CLIENT_FAILED_AFTER_FIRST_TOKEN.series()]
    old = ('dynamo_frontend_requests_total{endpoint="chat_completions",model="m",request_type="stream",'
           'status="error"} 3\n')
    assert not [n for n, _, _ in translate_text(old, "dynamo") if n == c.CLIENT_FAILED_BEFORE_FIRST_TOKEN.series()]


def test_dynamo_frontend_without_error_type_label():
    """Frontends before the error_type label (metrics.rs at 79a21ca4): status alone decides."""
    text = (
        "# HELP dynamo_frontend_requests_total Total number of LLM requests processed\n"
        "# TYPE dynamo_frontend_requests_total counter\n"
        'dynamo_frontend_requests_total{endpoint="chat_completions",model="m",request_type="stream",'
        'status="error"} 3\n'
        'dynamo_frontend_requests_total{endpoint="chat_completions",model="m",request_type="stream",'
        'status="success"} 9\n'
        'dynamo_frontend_requests_total{endpoint="completions",model="m",request_type="unary",status="success"} 2\n')
    out = translate_text(text, "dynamo")
    assert {lab["outcome"]: v for _, lab, v in out} == {"error": 3, "ok": 11}


def test_dynamo_client_mistakes_are_client_error_as_at_the_proxy():
    """Dynamo's error_type validation (a 4xx "Validation:" answer) and not_found (404, no such
    model) are the client's own mistakes: the proxy counts such 4xx ``client_error``
    (contract.outcome_of_status), so the Dynamo adapter must too, in scrape mode and in the
    recording rules; overload (503), internal, not_implemented stay ``error``."""
    counts = {"validation": 3, "not_found": 2, "overload": 5, "internal": 7, "not_implemented": 11, "cancelled": 13}
    text = ("# HELP dynamo_frontend_requests_total Total number of LLM requests processed\n"
            "# TYPE dynamo_frontend_requests_total counter\n"
            'dynamo_frontend_requests_total{endpoint="completions",error_type="",model="m",request_type="unary",'
            'status="success"} 17\n')
    for et, n in counts.items():
        text += (f'dynamo_frontend_requests_total{{endpoint="chat_completions",error_type="{et}",model="m",'
                 f'request_type="stream",status="error"}} {n}\n')
    out = [s for s in translate_text(text, "dynamo") if s[0] == c.CLIENT_REQUESTS.series()]
    assert {lab["outcome"]: v for _, lab, v in out} == {"ok": 17, "client_error": 3 + 2, "error": 5 + 7 + 11,
                                                        "aborted": 13}
    # the recording rules use the same table: one rule per outcome, a sum, never an `or` of parts
    from alerts.router_rules import adapter_rules

    rules = [r for r in adapter_rules(ADAPTERS["dynamo"])[0]["rules"] if r["record"] == c.CLIENT_REQUESTS.series()]
    assert sorted(r["labels"]["outcome"] for r in rules) == sorted(o.value for o in c.Outcome)
    assert not [r for r in rules if " or " in r["expr"]]


def test_llm_d_new_families_win_and_only_streamed_ttft_counts():
    out = translate_text(page("llm-d"), "llm-d")
    assert scope(out) == {("client", "pd", "llm-d")}
    m = {"model": LLAMA_8B}
    # streamed TTFT only (0.15 0.35 0.9 2.4 2.7); the non-streamed 6.0 and 9.5 are whole durations
    assert get(out, c.CLIENT_TTFT, "_count", **m) == 5
    assert get(out, c.CLIENT_TTFT, "_sum", **m) == pytest.approx(6.5)
    ttft = buckets(out, c.CLIENT_TTFT, **m)
    assert (ttft["0.2"], ttft["1"], ttft["2"], ttft["3"], ttft["120"], ttft["+Inf"]) == (1, 3, 3, 5, 5, 5)
    assert len(ttft) == 25  # the EPP's 24 TTFT boundaries and +Inf
    assert get(out, c.CLIENT_TPOT, "_count", **m) == 4
    assert get(out, c.CLIENT_TPOT, "_sum", **m) == pytest.approx(0.088)
    assert buckets(out, c.CLIENT_TPOT, **m)["0.02"] == 2
    # the deprecated inference_objective_* twins are not added on top
    assert get(out, c.CLIENT_E2E, "_count", **m) == 7
    assert get(out, c.CLIENT_E2E, "_sum", **m) == pytest.approx(54.83)
    assert get(out, c.CLIENT_IN_FLIGHT, **m) == 1
    # counted on arrival vs errors at the end: not a faithful per-outcome counter, not mapped
    assert not [n for n, _, _ in out if n == c.CLIENT_REQUESTS.series()]


def test_llm_d_old_inference_model_names_summed_over_target_models():
    out = translate_text(page("llm-d-gie-v0"), "llm-d")
    m = {"model": "food-review"}
    assert get(out, c.CLIENT_E2E, "_count", **m) == 5
    assert get(out, c.CLIENT_E2E, "_sum", **m) == pytest.approx(11.45)
    e2e = buckets(out, c.CLIENT_E2E, **m)
    assert (e2e["0.4"], e2e["1.25"], e2e["3"], e2e["8"], e2e["+Inf"]) == (1, 3, 4, 5, 5)
    assert get(out, c.CLIENT_IN_FLIGHT, **m) == 3
    assert {n for n, _, _ in out} & {c.CLIENT_TTFT.series("_count"), c.CLIENT_TPOT.series("_count")} == set()


def _gie_predicted_latency_page(requests: int, duration_s: float) -> str:
    """A GIE EPP with the predicted-latency plugin at its default streamingMode=false: its
    inference_objective_request_ttft_seconds is taken at end of stream, so each request's
    "TTFT" is its whole duration (requestcontrol_hooks.go: "In non-streaming mode, TTFT
    represents full e2e latency")."""
    lab = 'model_name="chat",target_model_name="chat"'
    lines = []
    for fam in ("inference_objective_request_duration_seconds", "inference_objective_request_ttft_seconds"):
        lines.append(f"# TYPE {fam} histogram")
        lines += [f'{fam}_bucket{{{lab},le="{b:g}"}} {requests if duration_s <= b else 0}'
                  for b in _rebuild().GEN_LAT]
        lines += [f'{fam}_bucket{{{lab},le="+Inf"}} {requests}', f"{fam}_sum{{{lab}}} {requests * duration_s}",
                  f"{fam}_count{{{lab}}} {requests}"]
    return "\n".join(lines) + "\n"


def _router_guard_scraped_twice(target: dict, ttft_mean_s: float, next_page) -> tuple[SeriesStore, Scraper, object]:
    """A guard (SLOs only: a client-scope mean TTFT over 90 s) on one router target, scraped at
    1000 s and, after ``next_page()``, at 1060 s: (store, scraper, guard)."""
    cfg = parse_config({
        "source": {"mode": "scrape", "timeout_s": 2, "targets": [target]},
        "slos": [{"pool": "client", "objectives": [
            {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": ttft_mean_s,
             "window": "90s", "min_requests": 3}]}],
    })
    store = SeriesStore()
    scr = Scraper(cfg.source, store)
    guard = compose(cfg, source=scr, detectors=False, advisor=False).guard

    async def go():
        await scr.scrape_target(cfg.source.targets[0], 1000.0)
        next_page()
        await scr.scrape_target(cfg.source.targets[0], 1060.0)
        await scr.aclose()

    asyncio.run(go())
    return store, scr, guard


def test_predicted_latency_plugin_ttft_is_not_read_as_ttft():
    """Streamed requests whose first token came at 0.2 s and whose response ended at 8 s: the
    plugin's deprecated TTFT histogram says 8 s. Mapped as the client TTFT, the guard judged a
    2 s TTFT mean violated (8.0) that clients met; the page cannot say which mode the plugin
    runs in, so the TTFT is unknown and the end-to-end latency still maps."""
    assert not [n for n, _, _ in translate_text(_gie_predicted_latency_page(10, 8.0), "llm-d")
                if n.startswith(c.CLIENT_TTFT.name)]
    pages = iter([_gie_predicted_latency_page(0, 8.0), _gie_predicted_latency_page(10, 8.0)])
    current = {"text": next(pages)}
    srv = Served(lambda: current["text"])
    try:
        store, _scr, guard = _router_guard_scraped_twice(
            {"url": srv.url, "pool": "client", "adapter": "llm-d", "name": "epp"}, 2.0,
            lambda: current.update(text=next(pages)))
        guard.tick(1060.0)
        res = guard.evaluator("slo").pools[("chat", "client")].slos[0]
        assert res.status is Status.UNKNOWN and "no current ttft data" in res.reason, res
        e2e = store.instant(c.CLIENT_E2E.series("_count"), {"pool": "client"}, 1060.0)
        assert {dict(k)["model"]: v for k, v in e2e.items()} == {"chat": 10}
    finally:
        srv.stop()


def test_preference_is_per_model():
    """One model already on the new llm_d_epp_* name, another still only on the old one."""
    text = (
        "# TYPE llm_d_epp_request_running gauge\n"
        'llm_d_epp_request_running{fairness_id="f",model_name="a",priority="0",target_model_name="a"} 4\n'
        "# TYPE inference_objective_running_requests gauge\n"
        'inference_objective_running_requests{model_name="a"} 4\n'
        'inference_objective_running_requests{model_name="b"} 7\n')
    out = translate_text(text, "llm-d")
    assert {lab["model"]: v for _, lab, v in out} == {"a": 4, "b": 7}


def test_production_stack_router_maps_latency_and_outcomes_only():
    out = translate_text(page("production-stack"), "production-stack")
    m = {"model": LLAMA_8B}
    # the router's histogram covers only its non-disaggregated path
    assert scope(out) == {("client", "aggregated", "production-stack")}
    assert get(out, c.CLIENT_E2E, "_count", **m) == 7
    assert get(out, c.CLIENT_E2E, "_sum", **m) == pytest.approx(13.17)
    e2e = buckets(out, c.CLIENT_E2E, **m)
    assert (e2e["0.1"], e2e["1.0"], e2e["5.0"], e2e["10.0"], e2e["+Inf"]) == (1, 4, 6, 7, 7)
    assert get(out, c.CLIENT_REQUESTS, outcome="ok", **m) == 6
    assert get(out, c.CLIENT_REQUESTS, outcome="error", **m) == 1
    # avg gauges are not histograms: no TTFT, TPOT or in-flight
    assert {n for n, _, _ in out} == {c.CLIENT_E2E.series(s) for s in ("_bucket", "_sum", "_count")} | {
        c.CLIENT_REQUESTS.series()}


@pytest.mark.parametrize("fixture,adapter", [("dynamo", "dynamo"), ("llm-d", "llm-d"), ("llm-d-gie-v0", "llm-d"),
                                             ("production-stack", "production-stack")])
def test_guard_parser_and_reference_parser_translate_alike(fixture, adapter):
    samples, _ = parse_exposition(page(fixture))
    assert by_series(translate(samples, adapter)) == by_series(translate_text(page(fixture), adapter))


def test_every_mapping_names_its_source_and_targets_the_client_scope():
    for ad in ADAPTERS.values():
        for mp in ad.mappings:
            assert mp.metric.component is c.Component.ROUTER, mp.native
            assert "@" in mp.source and ":" in mp.source, mp.native
            assert mp.model_label in mp.labels, mp.native
            assert (mp.metric is c.CLIENT_REQUESTS) == bool(mp.outcomes), mp.native


# -- scrape mode -------------------------------------------------------------------------------
def _rebuild():
    spec = importlib.util.spec_from_file_location("router_rebuild", FIXTURES / "rebuild.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("new_ttft,status", [([1.0, 1.5, 2.0, 3.5], Status.OK),
                                             ([3.0, 4.0, 4.5, 5.0], Status.VIOLATED)])
def test_guard_scrapes_a_dynamo_frontend_and_judges_pool_client(monkeypatch, new_ttft, status):
    """A real loopback server serves the Dynamo page; the guard scrapes it as an adapter target,
    stores contract client-scope series only, and its SLO evaluator judges (model, "client") on
    the TTFT of the requests between two scrapes. The 90 s window starts 30 s before the first
    scrape, so PromQL's extrapolation stretches _sum and _count alike (over 5m the counters'
    zero point would cut _sum's stretch shorter than _count's) and the mean is exact."""
    rb = _rebuild()
    first = page("dynamo")
    monkeypatch.setitem(rb.DYN_TTFT, "qwen", rb.DYN_TTFT["qwen"] + new_ttft)
    pages = iter([first, rb.dynamo()])
    current = {"text": next(pages)}
    srv = Served(lambda: current["text"])
    try:
        store, scr, guard = _router_guard_scraped_twice(
            {"url": srv.url, "model": QWEN, "pool": "client", "adapter": "dynamo", "name": "dynamo-fe"}, 2.5,
            lambda: current.update(text=next(pages)))
        st = scr.targets()[0]
        assert st.up and not st.errors, st
        counts = store.instant(c.CLIENT_TTFT.series("_count"), {"pool": "client"}, 1060.0)
        assert {dict(k)["model"]: v for k, v in counts.items()} == {QWEN: 10, LLAMA: 2}
        assert all(dict(k)["instance"] == "dynamo-fe" and dict(k)["router"] == "dynamo" and dict(k)["route"] == "pd"
                   for k in counts)
        assert store.instant("dynamo_frontend_time_to_first_token_seconds_count", {}, 1060.0) == {}
        # up for each model the router serves (the target's model is no pool of its own)
        assert {dict(k)["model"]: v for k, v in store.instant(UP, {"instance": "dynamo-fe"}, 1060.0).items()} \
            == {QWEN: 1.0, LLAMA: 1.0}
        guard.tick(1060.0)
        pr = guard.evaluator("slo").pools[(QWEN, "client")]
        res = pr.slos[0]
        assert res.status is status, res
        assert res.value == pytest.approx(sum(new_ttft) / len(new_ttft))
    finally:
        srv.stop()


def test_guard_counts_streams_a_dynamo_frontend_refused_as_client_ttft_attainment_misses(monkeypatch):
    """Between two scrapes of a real loopback page in Dynamo's format, 4 streamed requests got their first
    token in 0.5 s and 4 were refused by the frontend (2 overload, 2 unavailable: HTTP errors, no stream,
    no TTFT observation), plus a refused unary request and a stream failed mid-way (internal), neither
    counted. Through the real scraper and SLO evaluator, client TTFT attainment (1 s, a Dynamo boundary)
    read 100 %, ok, while half the streaming clients got an error; it reads 4 of 8, violated (the 90 s
    window starts 30 s before the first scrape, so increase() stretches every counter alike by 1.5)."""
    rb = _rebuild()
    first = page("dynamo")
    monkeypatch.setitem(rb.DYN_TTFT, "qwen", rb.DYN_TTFT["qwen"] + [0.5] * 4)
    monkeypatch.setattr(rb, "DYN_REQ", [*rb.DYN_REQ, ("chat_completions", "stream", "success", "", 4),
                                        ("chat_completions", "stream", "error", "overload", 2),
                                        ("chat_completions", "stream", "error", "unavailable", 2),
                                        ("completions", "unary", "error", "overload", 1),
                                        ("chat_completions", "stream", "error", "internal", 1)])
    current = {"text": first}
    srv = Served(lambda: current["text"])
    cfg = parse_config({"source": {"mode": "scrape", "timeout_s": 2, "targets": [
        {"url": srv.url, "pool": "client", "adapter": "dynamo", "name": "dynamo-fe"}]},
        "staleness_s": 60, "slos": [{"pool": "client", "objectives": [
            {"name": "ttft_att", "indicator": "ttft", "objective": "attainment", "threshold_s": 1.0,
             "target": 0.99, "window": "90s", "min_requests": 4}]}]})
    rig = ScrapeRig(cfg, SeriesStore(), now=1000.0)
    try:
        rig.scrape()
        current["text"] = rb.dynamo()
        rig.scrape(60)
    finally:
        rig.close()
        srv.stop()
    res = rig.slos(QWEN, "client")["ttft_att"]
    assert res.value == pytest.approx(0.5) and res.requests == pytest.approx(8 * 1.5), res
    assert res.status is Status.VIOLATED, res
    assert "6 requests failed by the service before their first token" in res.reason, res.reason


def test_every_model_behind_one_router_is_judged_and_the_targets_model_is_no_phantom_pool(monkeypatch):
    """A Dynamo frontend serving two models, configured with the default target model: each
    model's client pool gets its own verdict (``up`` was written under the target's model only,
    so llama's pool read "no target left ... removed from discovery" and ("default", "client")
    was a pool without data: the overall verdict unknown for good); a router that goes down
    takes every one of its models down."""
    rb = _rebuild()
    # a client's misspelt model: counted and in flight, never a first token (not a pool to judge)
    typo = 'dynamo_frontend_inflight_requests{model="lama-3.1-8b"} 0\n'
    anchor = 'dynamo_frontend_inflight_requests{model="llama-3.1-8b"} 0\n'
    first = page("dynamo").replace(anchor, anchor + typo)
    monkeypatch.setitem(rb.DYN_TTFT, "qwen", rb.DYN_TTFT["qwen"] + [0.5, 0.6, 0.7])
    monkeypatch.setitem(rb.DYN_TTFT, "llama", rb.DYN_TTFT["llama"] + [0.4, 0.5, 0.6])
    assert first != page("dynamo")
    current = {"text": first}
    srv = Served(lambda: current["text"])
    try:
        cfg = parse_config({
            "source": {"mode": "scrape", "timeout_s": 2, "targets": [
                {"url": srv.url, "pool": "client", "adapter": "dynamo", "name": "dynamo-fe"}]},
            "slos": [{"pool": "client", "objectives": [
                {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
                 "window": "90s", "min_requests": 3}]}],
        })
        scr = Scraper(cfg.source, SeriesStore())
        guard = compose(cfg, source=scr, detectors=False, advisor=False).guard
        slo = guard.evaluator("slo")

        async def scrape(t: float) -> None:
            await scr.scrape_target(cfg.source.targets[0], t)
            guard.tick(t)

        async def go():
            await scrape(1000.0)
            current["text"] = rb.dynamo().replace(anchor, anchor + typo)
            await scrape(1060.0)
            got = {k: (r.status, r.reason) for k, r in slo.pools.items()}
            assert got == {(QWEN, "client"): (Status.OK, ""), (LLAMA, "client"): (Status.OK, "")}, got
            assert slo.overall() is Status.OK
            srv.mode = "error"
            await scrape(1090.0)
            assert {k: r.reason for k, r in slo.pools.items()} == {
                (QWEN, "client"): "1 of 1 targets down (dynamo-fe: http_status: HTTP 500)",
                (LLAMA, "client"): "1 of 1 targets down (dynamo-fe: http_status: HTTP 500)"}
            await scr.aclose()

        asyncio.run(go())
    finally:
        srv.stop()


def test_adapter_target_with_a_foreign_page_is_flagged_and_normal_targets_keep_the_fast_path():
    eng = Engine(model="m", pool="decode")
    for _ in range(3):
        eng.request(0.2, 0.01)
    srv = Served(eng.exposition)
    try:
        cfg = parse_config({"source": {"mode": "scrape", "timeout_s": 2, "targets": [
            {"url": srv.url, "model": "m", "pool": "client", "adapter": "dynamo", "name": "wrong"},
            {"url": srv.url, "model": "m", "pool": "decode", "name": "engine"}]}})
        store = SeriesStore()
        scr = Scraper(cfg.source, store, clock=lambda: 1000.0)

        async def go():
            await scr.collect()
            await scr.aclose()

        asyncio.run(go())
        st = {t.name: t for t in scr.targets()}
        assert st["wrong"].up and st["wrong"].errors == {"adapter_no_match": 1}
        assert st["engine"].up and st["engine"].samples > 50
        got = store.instant(c.REQUEST_TTFT.series("_count"), {}, 1000.0)
        assert {dict(k)["instance"] for k in got} == {"engine"}
    finally:
        srv.stop()


# -- Prometheus mode: the same table as recording rules ----------------------------------------
def test_recording_rules_come_from_the_same_table():
    import yaml

    from alerts.generate import RULES_DIR, render_rules

    text = render_rules()["routers.yaml"]
    assert (RULES_DIR / "routers.yaml").read_text() == text  # committed file regenerated exactly
    groups = {g["name"]: g["rules"] for g in yaml.safe_load(text)["groups"]}
    for ad in ADAPTERS.values():
        rules = groups[f"sla-guard-router-{ad.name}"]
        assert {r["labels"]["router"] for r in rules} == {ad.name}
        assert all(r["labels"]["pool"] == "client" and r["labels"]["route"] == ad.route.value for r in rules)
        exprs = "\n".join(r["expr"] for r in rules)
        for mp in ad.mappings:
            assert mp.native in exprs, (ad.name, mp.native)
        # the scraper's translation of the rebuilt page yields exactly the recorded series
        assert {n for n, _, _ in translate_text(page(ad.name), ad)} == {r["record"] for r in rules}
