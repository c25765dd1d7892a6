"""StepBatch: steps folded between flushes give the same series as recording each step."""

from types import SimpleNamespace as NS

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine_hooks.batch import StepBatch, apply
from exporters import contract as c
from exporters.prometheus import ContractMetrics, EngineRecorder


def sched(running, kv, queries=0, hits=0, fetch=None, spec=None):
    return NS(num_running_reqs=running, num_waiting_reqs=1, num_skipped_waiting_reqs=2, kv_cache_usage=kv,
              num_kv_fetch_reqs_by_stage=fetch or {}, prefix_cache_stats=NS(queries=queries, hits=hits),
              connector_prefix_cache_stats=None, spec_decoding_stats=spec, kv_connector_stats=None)


def it(ttfts=(), itls=(), gen=0, finished=()):
    return NS(time_to_first_tokens_iter=list(ttfts), inter_token_latencies_iter=list(itls), num_generation_tokens=gen,
              prompt_token_stats=NS(computed=10, local_cache_hit=5, external_kv_transfer=0), num_preempted_reqs=0,
              finished_requests=list(finished))


def fin(gen, reason="length"):
    return NS(e2e_latency=1.0, queued_time=0.1, prefill_time=0.2, decode_time=0.7, mean_time_per_output_token=0.019,
              num_generation_tokens=gen, finish_reason=reason)


def exposition(batches) -> str:
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    rec.prebind_kv_fetch_stages(("waiting_to_start", "in_progress", "completed_waiting"))  # as the hook does
    for b in batches:
        apply(rec, b)
    return generate_latest(reg).decode()


def steps():
    spec = NS(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0],
              num_draft_tokens_per_pos=[2, 2, 2])
    return [(sched(4, 0.1, 100, 50, {"in_progress": 2}, spec), it([0.3], [0.01, 0.03], 2, [fin(5)])),
            (sched(3, 0.2, 0, 0, {"in_progress": 0}, spec), it([], [0.015], 1, [fin(1, "stop")])),
            (sched(1, 0.7, 20, 20, {}, None), it([3.0], [], 1, []))]


def test_one_batch_equals_one_batch_per_step():
    reasons: dict = {}
    whole = StepBatch()
    per_step = []
    for s, i in steps():
        for b in (whole, b1 := StepBatch()):
            b.add_scheduler(s, kv_consumer=True)
            if s.spec_decoding_stats:
                b.add_spec(s.spec_decoding_stats)
            b.add_iteration(i, reasons)
        per_step.append(b1)
    a = [ln for ln in exposition([whole]).splitlines() if "_created" not in ln]
    b = [ln for ln in exposition(per_step).splitlines() if "_created" not in ln]
    assert a == b


def test_counters_sum_gauges_take_latest():
    reasons: dict = {}
    b = StepBatch()
    for s, i in steps():
        b.add_scheduler(s, kv_consumer=True)
        if s.spec_decoding_stats:
            b.add_spec(s.spec_decoding_stats)
        b.add_iteration(i, reasons)
    text = exposition([b])
    assert 'slaguard_requests_running{engine="0",model="m",pool="decode"} 1.0' in text
    assert 'slaguard_kv_cache_usage_ratio{engine="0",model="m",pool="decode"} 0.7' in text
    assert 'slaguard_requests_waiting{engine="0",model="m",pool="decode"} 3.0' in text
    assert f'{c.ENGINE_STEPS.series()}{{engine="0",model="m",pool="decode"}} 3.0' in text
    assert f'{c.SPEC_ACCEPTED_TOKENS_POS.series()}{{engine="0",model="m",pool="decode",position="0"}} 4.0' in text
    assert f'{c.PREFIX_CACHE_HITS.series()}{{cache="local",engine="0",model="m",pool="decode"}} 70.0' in text
    assert f'{c.REQUEST_TPOT.series("_count")}{{engine="0",model="m",pool="decode"}} 1.0' in text  # 1-token: none
    assert f'{c.REQUESTS_FINISHED.series()}{{engine="0",model="m",pool="decode",reason="stop"}} 1.0' in text
    # the last step reported no stages: the gauge keeps the last reported value per stage (0)
    assert f'{c.REQUESTS_KV_FETCH.series()}{{engine="0",model="m",pool="decode",stage="in_progress"}} 0.0' in text
    assert b.size == 3 + 2 + 2  # itls + ttfts + finished queued


def test_empty_batch_changes_nothing():
    assert [ln for ln in exposition([StepBatch()]).splitlines() if "_created" not in ln] == [
        ln for ln in exposition([]).splitlines() if "_created" not in ln]


def _errors(text: str, kind: str) -> float:
    prefix = f'{c.HOOK_ERRORS.series()}{{kind="{kind}",model="m",pool="decode"}} '
    hits = [float(ln[len(prefix):]) for ln in text.splitlines() if ln.startswith(prefix)]
    return hits[0] if hits else 0.0


def test_nan_negative_inf_observations_are_refused_and_counted():
    """NaN landed in the fastest bucket and made _sum NaN; a negative lowered _sum (a fake reset)."""
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    rec.observe_ttfts([float("nan"), -3.0, float("inf"), None, 0.3])
    rec.kv_transfer(durations=[float("nan"), -1.0, 0.01])
    rec.request_done(1.0, float("nan"), 0.2, 0.7, 0.01, 10, "stop")
    text = generate_latest(reg).decode()
    lab = '{engine="0",model="m",pool="decode"}'
    assert f"{c.REQUEST_TTFT.series('_count')}{lab} 1.0" in text
    assert f"{c.REQUEST_TTFT.series('_sum')}{lab} 0.3" in text
    assert f'{c.REQUEST_TTFT.series("_bucket")}{{engine="0",le="0.005",model="m",pool="decode"}} 0.0' in text
    assert f"{c.KV_XFER_DURATION.series('_count')}{lab} 1.0" in text
    assert f"{c.KV_XFER_DURATION.series('_sum')}{lab} 0.01" in text
    assert f"{c.REQUEST_QUEUE.series('_count')}{lab} 0.0" in text  # the NaN queue time only
    assert f"{c.REQUEST_E2E.series('_count')}{lab} 1.0" in text
    assert _errors(text, "bad_observation") == 4 + 2 + 1


def test_negative_counts_are_refused_per_step_not_netted():
    """100 then -50 in one flush window must not export +50; nor -50 later rewind the counter."""
    reasons: dict = {}
    b = StepBatch()
    b.add_iteration(it(gen=100), reasons)
    b.add_iteration(it(gen=-50), reasons)
    neg_preempt = it()
    neg_preempt.num_preempted_reqs = float("nan")
    b.add_iteration(neg_preempt, reasons)
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    apply(rec, b)
    rec.tokens(-50)  # a direct caller (simulator, sidecar) is checked too
    rec.preempted(-1)
    rec.kv_transfer(failures={"transfer": -1}, expired=float("nan"))
    text = generate_latest(reg).decode()
    assert f'{c.GENERATION_TOKENS.series()}{{engine="0",model="m",pool="decode"}} 100.0' in text
    assert f'{c.PREEMPTIONS.series()}{{engine="0",model="m",pool="decode"}} 0.0' in text
    assert f'{c.KV_XFER_FAILURES.series()}{{engine="0",kind="transfer",model="m",pool="decode"}} 0.0' in text
    assert _errors(text, "bad_increment") == 2 + 4


def test_an_infinite_step_is_refused_per_step_not_the_whole_window():
    """inf passed the per-step check (inf >= 0), so the window's sum was inf, which the recorder refused
    whole: one bad step erased every other step's tokens, prefix-cache queries and accepted drafts."""
    reasons: dict = {}
    inf = float("inf")
    b = StepBatch()
    b.add_iteration(it(gen=100), reasons)
    b.add_iteration(it(gen=inf), reasons)
    b.add_iteration(it(gen=7), reasons)
    b.add_scheduler(sched(1, 0.1, queries=inf, hits=5), kv_consumer=False)
    b.add_scheduler(sched(1, 0.1, queries=10, hits=5), kv_consumer=False)
    for accepted, per_pos in ((inf, [2, inf]), (3, [2, 1])):
        b.add_spec(NS(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=accepted,
                      num_accepted_tokens_per_pos=per_pos, num_draft_tokens_per_pos=[2, 2]))
    text = exposition([b])
    lab = '{engine="0",model="m",pool="decode"}'
    assert f"{c.GENERATION_TOKENS.series()}{lab} 107.0" in text
    assert f'{c.PREFIX_CACHE_QUERIES.series()}{{cache="local",engine="0",model="m",pool="decode"}} 10.0' in text
    assert f"{c.SPEC_ACCEPTED_TOKENS.series()}{lab} 3.0" in text
    assert f'{c.SPEC_ACCEPTED_TOKENS_POS.series()}{{engine="0",model="m",pool="decode",position="1"}} 1.0' in text
    assert _errors(text, "bad_increment") == 4

def test_one_bad_item_costs_only_itself():
    """An exception on one part of a flush lost every finished request after it."""
    reasons: dict = {}
    b = StepBatch()
    none_tpot = fin(5, "stop")
    none_tpot.mean_time_per_output_token = None
    b.add_iteration(it(gen=3, finished=[none_tpot]), reasons)
    b.kv_fetch = 7  # not a mapping: kv_fetch_by_stage raises
    b.finished.append((1.0, 0.1, 0.2))  # wrong shape: request_done raises
    b.add_iteration(it(gen=2, finished=[fin(5, "stop")]), reasons)
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    apply(rec, b)
    text = generate_latest(reg).decode()
    lab = '{engine="0",model="m",pool="decode"}'
    assert f'{c.REQUESTS_FINISHED.series()}{{engine="0",model="m",pool="decode",reason="stop"}} 2.0' in text
    assert f"{c.REQUEST_E2E.series('_count')}{lab} 2.0" in text
    assert f"{c.REQUEST_TPOT.series('_count')}{lab} 1.0" in text  # the None TPOT is refused, not observed
    assert f"{c.GENERATION_TOKENS.series()}{lab} 5.0" in text
    assert _errors(text, "bad_observation") == 1
    assert _errors(text, "flush") == 2  # the two parts that raised, each counted once


@pytest.mark.parametrize("value", ["inf", "1e10", "nan", "-1", "soon"])
def test_flush_interval_from_env_is_a_period_the_flush_thread_can_wait(monkeypatch, value):
    """SLA_GUARD_FLUSH_INTERVAL_S=inf or 1e10 made the flush thread's Event.wait() raise OverflowError:
    the thread died at its first wait and the batches were applied only on vLLM's log()."""
    from engine_hooks.stat_logger import _flush_interval

    monkeypatch.setenv("SLA_GUARD_FLUSH_INTERVAL_S", value)
    assert 0 < _flush_interval() <= 60


def test_rebuilt_stat_loggers_share_one_flush_thread_and_are_freed(monkeypatch, tmp_path):
    """A process that builds AsyncLLM again and again builds a stat logger each time. Each one
    started its own flush thread and atexit hook, which kept it alive: 200 builds, 200 threads waking
    every 0.5 s. Now one thread per process flushes every live logger, held weakly."""
    import gc
    import threading
    import time
    import weakref

    from prometheus_client import REGISTRY

    from engine_hooks.stat_logger import SlaGuardStatLogger

    monkeypatch.setenv("SLA_GUARD_DISABLE_SAMPLER", "1")
    monkeypatch.setenv("SLA_GUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SLA_GUARD_FLUSH_INTERVAL_S", "0.05")
    monkeypatch.delenv("SLA_GUARD_OTLP_ENDPOINT", raising=False)
    cfg = NS(model_config=NS(served_model_name="rebuilt", model="/m"), kv_transfer_config=None,
             speculative_config=None, parallel_config=NS(data_parallel_size=1))
    SlaGuardStatLogger(cfg, [0])  # the first may stay referenced (the process snapshot exporter's error hook)
    before = threading.active_count()
    refs = [weakref.ref(SlaGuardStatLogger(cfg, [0])) for _ in range(50)]
    gc.collect()
    assert threading.active_count() <= before + 1
    assert sum(r() is not None for r in refs) == 0
    # a newer vLLM may pass its factories more arguments: a TypeError would stop vLLM's start
    live = SlaGuardStatLogger(vllm_config=cfg, engine_indexes=[3], client_count=2)
    # still flushed by the process thread, without log()
    live.record(NS(num_running_reqs=7, num_waiting_reqs=0, num_skipped_waiting_reqs=0, kv_cache_usage=0.5,
                   num_kv_fetch_reqs_by_stage={}, prefix_cache_stats=None, connector_prefix_cache_stats=None,
                   spec_decoding_stats=None, kv_connector_stats=None), None, None, 3)
    labels = {"model": "rebuilt", "pool": "mixed", "engine": "3"}
    deadline = time.monotonic() + 5
    while REGISTRY.get_sample_value(c.REQUESTS_RUNNING.name, labels) != 7 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert REGISTRY.get_sample_value(c.REQUESTS_RUNNING.name, labels) == 7
