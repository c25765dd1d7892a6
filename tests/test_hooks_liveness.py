"""A hook that stops recording while vLLM serves and /metrics answers: the guard must read that
target's data as frozen (unknown, kind ``hook_stalled``), not as an idle engine, nor judge "ok" on it.

vLLM 0.32's elastic-EP scale-up (``AsyncLLM._scale_elastic_ep``) builds a new StatLoggerManager with
``custom_stat_loggers=None``: the plugin's logger is no longer called, its series stay on /metrics
with their last values, while vLLM's own ``vllm:`` series (recreated) go on counting. A ``record()``
that fails every step (a renamed vLLM field) freezes series the same way. The real hook
(``SlaGuardStatLogger``) is fed the calls vLLM makes, vLLM's own token counter is a prometheus_client
counter of vLLM's name and labels on the same page, and the real scraper reads it over loopback HTTP.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest
from guard_support import Served
from prometheus_client import REGISTRY, CollectorRegistry, Counter, generate_latest

from exporters import contract as c
from sla_guard.config import ScrapeSource, Target, parse_config
from sla_guard.ingest.scrape import Scraper
from sla_guard.slo import SLOEvaluator
from sla_guard.store import SeriesStore

SLOS = [
    {
        "model": "*",
        "pool": "*",
        "objectives": [
            {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "window": "5m"},
            {
                "name": "ttft_att",
                "indicator": "ttft",
                "objective": "attainment",
                "threshold_s": 2.5,
                "target": 0.99,
                "period": "30d",
            },
        ],
    }
]


def sched(kv: float = 0.3) -> NS:
    return NS(
        num_running_reqs=4,
        num_waiting_reqs=0,
        num_skipped_waiting_reqs=0,
        kv_cache_usage=kv,
        num_kv_fetch_reqs_by_stage={},
        prefix_cache_stats=None,
        connector_prefix_cache_stats=None,
        spec_decoding_stats=None,
        kv_connector_stats=None,
    )


def iteration(ttft: float, tokens: int = 8) -> NS:
    done = NS(
        e2e_latency=ttft + 0.1,
        queued_time=0.01,
        prefill_time=ttft,
        decode_time=0.1,
        mean_time_per_output_token=0.015,
        num_prompt_tokens=64,
        num_cached_tokens=0,
        num_generation_tokens=tokens,
        finish_reason="length",
        request_id="r",
    )
    return NS(
        time_to_first_tokens_iter=[ttft],
        inter_token_latencies_iter=[0.015] * (tokens - 1),
        num_generation_tokens=tokens,
        prompt_token_stats=NS(computed=64, local_cache_hit=0, external_kv_transfer=0),
        num_preempted_reqs=0,
        finished_requests=[done],
    )


class VllmServer:
    """One API server: the real hook beside a stand-in for vLLM's PrometheusStatLogger (its
    ``vllm:generation_tokens`` counter, which vLLM recreates at 0 when it rebuilds its loggers),
    both on one page served over loopback."""

    def __init__(self, model: str, monkeypatch, tmp_path) -> None:
        from engine_hooks.stat_logger import SlaGuardStatLogger

        monkeypatch.setenv("SLA_GUARD_DISABLE_SAMPLER", "1")
        monkeypatch.setenv("SLA_GUARD_RUN_DIR", str(tmp_path))
        monkeypatch.delenv("SLA_GUARD_OTLP_ENDPOINT", raising=False)
        self.model = model
        cfg = NS(
            model_config=NS(served_model_name=model, model="/m"),
            speculative_config=None,
            kv_transfer_config=NS(kv_role="kv_consumer", kv_connector="NixlConnector", is_kv_consumer=True),
            parallel_config=NS(data_parallel_size=1),
        )
        self.hook = SlaGuardStatLogger(cfg, [0])
        self.attached = True  # False: vLLM's loggers were rebuilt without the plugin
        self.rebuild_vllm_logger()
        self.srv = Served(self.page)

    def rebuild_vllm_logger(self) -> None:
        self.vllm_registry = CollectorRegistry()
        self.vllm_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            ["model_name", "engine"],
            registry=self.vllm_registry,
        ).labels(self.model, "0")

    def step(self, s: NS | None, it: NS | None) -> None:
        """What AsyncLLM's output handler does after an engine step: every logger's record()."""
        if it is not None:
            self.vllm_tokens.inc(it.num_generation_tokens)
        if self.attached:
            self.hook.record(s, it, None, 0)
            self.hook.flush()  # the flush thread's work, done here so the test needs no clock

    def page(self) -> str:
        own = [
            ln
            for ln in generate_latest(REGISTRY).decode().splitlines()
            if ln.startswith("#") or f'model="{self.model}"' in ln
        ]
        return "\n".join(own) + "\n" + generate_latest(self.vllm_registry).decode()


@pytest.fixture
def guarded(monkeypatch, tmp_path, request):
    eng = VllmServer(f"stall-{request.node.name[-40:]}", monkeypatch, tmp_path)
    now = [1_700_000_000.0]
    store = SeriesStore(slots=400, lookback_s=60)
    scr = Scraper(
        ScrapeSource(targets=[Target(url=eng.srv.url, model="m", pool="decode", name="d0")], timeout_s=2),
        store,
        clock=lambda: now[0],
    )
    ev = SLOEvaluator(parse_config({"staleness_s": 60, "slos": SLOS}))

    def scrape(n: int, per_scrape, *, evaluate: bool = True, every: float = 5.0):
        """n scrapes ``every`` seconds apart, ``per_scrape()`` engine steps before each."""
        for _ in range(n):
            now[0] += every
            for s, it in per_scrape():
                eng.step(s, it)
            asyncio.run(scr.collect())
        if evaluate:
            ev.evaluate(store, now[0])
        return scr.targets()[0], ev.snapshot()["pools"][0]

    scrape.scraper = scr  # type: ignore[attr-defined]
    busy = lambda ttft=0.5: [(sched(), iteration(ttft)) for _ in range(5)]  # noqa: E731
    scrape(6, busy)  # half a minute of traffic (30 requests), all good
    yield eng, scrape, busy
    eng.srv.stop()
    asyncio.run(scr.aclose())


def test_a_hook_dropped_by_an_elastic_ep_rebuild_turns_the_target_unknown_not_ok(guarded):
    """Before: the hook's series froze (counters flat, KV usage 0.3) while vLLM served requests with
    a 3 s TTFT; the target stayed up and the pool "ok" (mean 0.5 s from the old part of its 5 min
    window, attainment 1.0 for ever), then read "0 requests in 5m" like an idle engine."""
    eng, scrape, busy = guarded
    st, pool = scrape(1, busy)
    assert st.up and pool["status"] == "ok"
    eng.attached = False  # AsyncLLM._scale_elastic_ep: new StatLoggerManager(custom_stat_loggers=None)
    eng.rebuild_vllm_logger()  # ... whose PrometheusStatLogger starts vLLM's counters at 0 again
    st, pool = scrape(3, lambda: busy(ttft=3.0))
    assert not st.up and st.errors.get("hook_stalled") and "stopped recording" in st.last_error
    assert pool["status"] == "unknown" and "targets down" in pool["reason"]
    assert all(s["status"] == "unknown" for s in pool["slos"]), pool["slos"]
    st, pool = scrape(6, lambda: busy(ttft=3.0))  # half a minute later, still
    assert not st.up and pool["status"] == "unknown" and all(s["status"] == "unknown" for s in pool["slos"])
    st, pool = scrape(6, lambda: [])  # vLLM idle now: the hook's series are still frozen, not idle
    assert not st.up and st.errors["hook_stalled"] == 14 and pool["status"] == "unknown"


def test_a_record_that_fails_every_step_is_a_stalled_hook(guarded):
    """A vLLM that renamed a SchedulerStats field: the hook's scheduler section raises on every step,
    counts it in slaguard_hook_errors_total{kind="scheduler"} and never raises into vLLM, but its
    gauges (KV usage) and step counter freeze while tokens still move."""
    eng, scrape, _ = guarded
    renamed = NS(**{k: v for k, v in vars(sched(0.9)).items() if k != "kv_cache_usage"})
    st, _ = scrape(3, lambda: [(renamed, iteration(0.5)) for _ in range(5)], evaluate=False)
    errors = REGISTRY.get_sample_value(
        c.HOOK_ERRORS.series(), {"model": eng.model, "pool": "decode", "kind": "scheduler"}
    )
    assert errors == 15
    assert (
        REGISTRY.get_sample_value(c.KV_CACHE_USAGE.name, {"model": eng.model, "pool": "decode", "engine": "0"}) == 0.3
    )  # frozen
    assert not st.up and st.errors.get("hook_stalled") and c.ENGINE_STEPS.series() in st.last_error


def test_an_idle_engine_and_one_flush_interval_of_lag_are_not_a_stall(guarded):
    """No steps: vLLM's counter and the hook's stand still together; the target stays up. Steps
    vLLM counted in the last interval only (the hook flushes up to one flush interval later) are
    not a stall yet; the hook catching up clears it; traffic resuming keeps it up."""
    eng, scrape, busy = guarded
    st, pool = scrape(6, lambda: [])  # idle
    assert st.up and not st.errors and "hook_stalled" not in pool["reason"]
    eng.attached = False  # vLLM recorded a step; the hook's batch is not flushed yet
    st, _ = scrape(1, busy, evaluate=False)
    assert st.up and not st.errors
    eng.attached = True
    st, pool = scrape(3, busy)
    assert st.up and not st.errors and pool["status"] == "ok"
    # scraped every 0.5 s: the hook's flush (0.5 s, later under load) may span two scrape intervals
    eng.attached = False
    st, _ = scrape(1, busy, every=0.5, evaluate=False)
    st, _ = scrape(1, lambda: [], every=0.5, evaluate=False)
    assert st.up and not st.errors
    eng.attached = True
    st, _ = scrape(4, busy, every=0.5, evaluate=False)
    assert st.up and not st.errors


def test_a_stall_is_seen_at_its_third_scrape_whatever_the_clock_s_fraction(guarded):
    """The scraper stamps a scrape with the wall clock, the store keeps the stamp to the millisecond.
    A stamp the store rounded up (x.0006 -> x.001) lay after the unrounded time ``_hook_stalled``
    read at, so it read the previous scrape's counters: every third scrape of a real clock saw the
    stall one scrape late, and ``check --wait`` (three scrapes) missed it. Stamps are now rounded
    where they are taken."""
    eng, scrape, busy = guarded
    scrape(1, lambda: [], every=0.0006, evaluate=False)  # every later stamp ends in .0006
    eng.attached = False
    st, _ = scrape(1, busy, evaluate=False)  # vLLM rose since the scrape before, the hook did not
    assert st.up
    st, _ = scrape(1, busy, evaluate=False)  # the third scrape, 5 s on: seen now, not one scrape late
    assert not st.up and st.errors.get("hook_stalled") == 1, st


def test_a_page_without_vllm_series_is_not_checked(monkeypatch, tmp_path):
    """The sidecar's page and the simulator's carry only the contract: nothing to compare, no
    verdict from a missing witness."""
    eng = VllmServer("stall-sidecar", monkeypatch, tmp_path)
    eng.srv.body = lambda: "\n".join(ln for ln in eng.page().splitlines() if "vllm:" not in ln) + "\n"
    now = [1_700_000_000.0]
    scr = Scraper(
        ScrapeSource(targets=[Target(url=eng.srv.url, model="m", pool="decode", name="d0")], timeout_s=2),
        SeriesStore(),
        clock=lambda: now[0],
    )
    try:
        eng.attached = False
        for _ in range(4):
            now[0] += 5
            eng.step(sched(), iteration(0.5))
            asyncio.run(scr.collect())
        assert scr.targets()[0].up and not scr.targets()[0].errors
    finally:
        eng.srv.stop()
        asyncio.run(scr.aclose())


def test_a_long_stall_keeps_a_bounded_history(guarded):
    """Before: while a target stayed stalled every good scrape's counters were appended to its
    history and never dropped (the held verdict returned before the pruning): a hook dropped for a
    day held 5760 snapshots of every engine's counters per target at a 15 s scrape interval."""
    eng, scrape, busy = guarded
    eng.attached = False
    st, _ = scrape(3, busy, evaluate=False)
    assert not st.up and (stalled := st.errors.get("hook_stalled"))
    st, _ = scrape(40, busy, evaluate=False)
    assert not st.up and st.errors["hook_stalled"] == stalled + 40
    assert len(scrape.scraper._liveness["d0"]) <= 4, len(scrape.scraper._liveness["d0"])
    eng.attached = True  # the hook records again: up, judged afresh
    st, _ = scrape(4, busy, evaluate=False)
    assert st.up


def test_an_aggregator_page_with_its_engines_instances_is_checked(monkeypatch, tmp_path):
    """An ``honor_labels`` target (an aggregator) whose page carries each engine's own ``instance``:
    before, the check read vLLM's counter under the target's name only, found none, and the frozen
    hook read up."""
    eng = VllmServer("stall-aggregator", monkeypatch, tmp_path)
    eng.srv.body = lambda: eng.page().replace("{", '{instance="10.0.0.7:8000",')
    now = [1_700_000_000.0]
    scr = Scraper(
        ScrapeSource(
            targets=[Target(url=eng.srv.url, model="m", pool="decode", name="agg", honor_labels=True)], timeout_s=2
        ),
        SeriesStore(),
        clock=lambda: now[0],
    )
    try:
        for _ in range(3):
            now[0] += 5
            eng.step(sched(), iteration(0.5))
            asyncio.run(scr.collect())
        assert scr.targets()[0].up
        eng.attached = False
        for _ in range(4):
            now[0] += 5
            eng.step(sched(), iteration(0.5))
            asyncio.run(scr.collect())
        st = scr.targets()[0]
        assert not st.up and st.errors.get("hook_stalled"), st
    finally:
        eng.srv.stop()
        asyncio.run(scr.aclose())
