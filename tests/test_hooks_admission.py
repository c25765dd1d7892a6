"""vLLM's frontend admission rejections (vLLM >= 0.32, ``--max-num-queued-reqs`` /
``--max-num-queued-tokens``) reach the contract: without them a pool refusing clients with 503
read "ok" at the engine scope, since a refused request is in no latency histogram.

The hook is fed exactly the call vLLM makes, ``record_admission_rejection(reason)`` with the reasons
of vLLM's ``ADMISSION_REASONS``; no vLLM engine is started here (too slow for this suite). The same
call through vLLM's own StatLoggerManager, beside vLLM's PrometheusStatLogger, is in
tests/test_hooks_stat_logger.py (parity case).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from prometheus_client import REGISTRY

from exporters import contract as c
from exporters.sidecar import map_exposition

# vllm/v1/metrics/loggers.py ADMISSION_REASONS (0.32)
VLLM_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def _value(model: str, reason: str) -> float | None:
    return REGISTRY.get_sample_value(
        c.ADMISSION_REJECTIONS.series(), {"model": model, "pool": "prefill", "reason": reason}
    )


@pytest.fixture
def logger(monkeypatch, tmp_path):
    from engine_hooks.stat_logger import SlaGuardStatLogger

    monkeypatch.setenv("SLA_GUARD_DISABLE_SAMPLER", "1")
    monkeypatch.setenv("SLA_GUARD_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SLA_GUARD_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("SLA_GUARD_POOL", raising=False)
    cfg = NS(
        model_config=NS(served_model_name="admit", model="/m"),
        kv_transfer_config=NS(kv_role="kv_producer", kv_connector="NixlConnector", is_kv_consumer=False),
        speculative_config=None,
        parallel_config=NS(data_parallel_size=2),
    )
    return SlaGuardStatLogger(cfg, [0, 1])


def test_rejections_are_counted_per_model_pool_and_reason(logger):
    """Series exist at 0 from start (so increase() sees the first refusal), then count each call."""
    base = {r: _value("admit", r) for r in VLLM_REASONS}
    assert all(v is not None for v in base.values())
    for _ in range(3):
        logger.record_admission_rejection("max_num_queued_reqs")
    logger.record_admission_rejection("max_num_queued_tokens")
    assert _value("admit", "max_num_queued_reqs") - base["max_num_queued_reqs"] == 3
    assert _value("admit", "max_num_queued_tokens") - base["max_num_queued_tokens"] == 1


def test_a_new_reason_is_a_new_series_and_bad_input_never_raises(logger):
    """Reasons are an open set (as finish reasons); whatever vLLM passes, nothing raises into it."""
    logger.record_admission_rejection("max_num_queued_kv_blocks")
    assert _value("admit", "max_num_queued_kv_blocks") >= 1
    logger.record_admission_rejection(None)  # type: ignore[arg-type]
    assert _value("admit", "None") >= 1
    logger.record_admission_rejection([])  # type: ignore[arg-type]  # str() of it works too
    broken = type("Broken", (), {"__str__": lambda self: 1 / 0})()
    logger.record_admission_rejection(broken)  # type: ignore[arg-type]
    assert (
        REGISTRY.get_sample_value(c.HOOK_ERRORS.series(), {"model": "admit", "pool": "prefill", "kind": "admission"})
        >= 1
    )


VLLM_PAGE = """# HELP vllm:admission_rejections_total Number of admission attempts rejected by a queue limit, by reason.
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 7.0
vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_tokens"} 2.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 4.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
"""


def test_sidecar_maps_vllms_admission_rejections_without_an_engine_label():
    """vLLM's counter (as its PrometheusStatLogger writes it, see tests/fixtures/vllm_exposition.txt)
    has no engine label: refusals happen at the API server, before any engine."""
    fams, engines, problems = map_exposition(VLLM_PAGE, "m", "prefill")
    assert not problems
    assert engines == {"0", "1"}
    rows = {
        tuple(sorted(s.labels.items())): s.value
        for f in fams
        if f.name == c.ADMISSION_REJECTIONS.name
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert rows == {
        (("model", "m"), ("pool", "prefill"), ("reason", "max_num_queued_reqs")): 7.0,
        (("model", "m"), ("pool", "prefill"), ("reason", "max_num_queued_tokens")): 2.0,
    }
