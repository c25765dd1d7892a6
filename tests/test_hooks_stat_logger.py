"""The stat-logger hook fed with vLLM's REAL stats objects.

The objects are built by tests/fixtures/drive_stat_logger.py inside .venv-vllm (vLLM cannot be
imported in the project venv), which prints the resulting exposition; assertions run here. The
KV-connector payloads are built live by vLLM's own stats classes, and the parity case runs the hook
beside vLLM's PrometheusStatLogger under vLLM's StatLoggerManager: these tests fail when vLLM
changes a field, a unit or a payload format the hook reads.
Skipped with the reason when .venv-vllm is missing or SLA_GUARD_SKIP_VLLM=1.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c

pytestmark = pytest.mark.vllm
DRIVER = Path(__file__).resolve().parent / "fixtures" / "drive_stat_logger.py"
# The NIXL telemetry the driver records (its vLLM imports are lazy: only TRANSFERS is read here).
_spec = importlib.util.spec_from_file_location("record_nixl_stats", DRIVER.parent / "record_nixl_stats.py")
record_nixl_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_nixl_stats)


def drive(python: Path, model_dir: Path) -> dict:
    out = subprocess.run([str(python), str(DRIVER), str(model_dir)], capture_output=True, text=True, timeout=180,
                         cwd=DRIVER.parent.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    samples = {}
    for fam in text_string_to_metric_families(result["exposition"]):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return {"samples": samples, "stderr": out.stderr, "payloads": result["payloads"],
            "one_token": result["parity_one_token_requests"]}


def val(samples, name, **labels):
    hits = [v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items())]
    assert hits, f"no sample {name}{labels}"
    return sum(hits)


@pytest.fixture(scope="module")
def driven(vllm_venv_python, tiny_model_dir):
    return drive(vllm_venv_python, tiny_model_dir)


@pytest.fixture(scope="module")
def decode(driven):
    """Only the decode case's series (pool="decode", model="tiny")."""
    return {**driven, "samples": {k: v for k, v in driven["samples"].items()
                                  if ("pool", "decode") in k[1] and ("model", "tiny") in k[1]}}


def test_decode_engine_scheduler_and_prefix_cache(decode):
    s = decode["samples"]
    for e in ("0", "1"):  # DP=2: one recorder per engine index, pool from kv_consumer
        assert val(s, c.REQUESTS_RUNNING.series(), engine=e, pool="decode") == 3
        assert val(s, c.REQUESTS_WAITING.series(), engine=e) == 3  # waiting + deferred, like vLLM
        assert val(s, c.KV_CACHE_USAGE.series(), engine=e) == 0.25
        assert val(s, c.REQUESTS_KV_FETCH.series(), engine=e, stage="waiting_to_start") == 2
        assert val(s, c.REQUESTS_KV_FETCH.series(), engine=e, stage="completed_waiting") == 0
        assert val(s, c.PREFIX_CACHE_HITS.series(), engine=e, cache="external") == 5 * 64
        assert val(s, c.PREFIX_CACHE_QUERIES.series(), engine=e, cache="local") == 5 * 200
        assert val(s, c.ENGINE_STEPS.series(), engine=e) == 5
        assert val(s, c.SPEC_ACCEPTED_TOKENS.series(), engine=e) == 10
        assert val(s, c.SPEC_ACCEPTED_TOKENS_POS.series(), engine=e, position="2") == 0
        assert val(s, c.SPEC_DRAFT_TOKENS_POS.series(), engine=e, position="2") == 5
    info = val(s, c.ENGINE_INFO.series(), engine="1", kv_role="kv_consumer", spec_method="ngram",
               num_spec_tokens="3", dp_size="2")
    assert info == 1


def test_decode_engine_requests_and_tokens(decode):
    s = decode["samples"]
    assert val(s, c.REQUEST_TTFT.series("_count"), engine="0") == 2
    # TTFT 3.0 s lands above the 2.5 s SLA boundary, 0.015 s below it.
    assert val(s, c.REQUEST_TTFT.series("_bucket"), engine="0", le="2.5") == 1
    assert val(s, c.INTER_TOKEN_LATENCY.series("_bucket"), engine="0", le="0.02") == 5
    # Step 5 (engine 1) finished one 10-token and one 1-token request: TPOT only for the first.
    assert val(s, c.REQUEST_E2E.series("_count"), engine="1") == 2
    assert val(s, c.REQUEST_TPOT.series("_count"), engine="1") == 1
    assert val(s, c.REQUESTS_FINISHED.series(), engine="1", reason="length") == 1
    assert val(s, c.REQUESTS_FINISHED.series(), engine="1", reason="stop") == 1
    assert val(s, c.PREEMPTIONS.series(), engine="1") == 2
    assert val(s, c.PROMPT_TOKENS.series(), engine="0", source="external_kv_transfer") == 5 * 64
    assert val(s, c.GENERATION_TOKENS.series(), engine="0") == 20


def test_nixl_stats_flat_and_under_multiconnector(decode):
    """NIXL payloads built live by vLLM's NixlKVConnectorStats (NIXL itself needs CUDA), pooled over
    two TP ranks by KVOutputAggregator: step 0 flat (engine 0), step 1 under MultiConnector (engine 1,
    keyed by vLLM's class name), step 2 only another connector (ignored, no error), step 3 empty."""
    s = decode["samples"]
    flat = decode["payloads"]["flat"]
    (multi,) = [v for v in decode["payloads"]["multi"].values() if "transfer_duration" in v]
    # NIXL telemetry is in microseconds; the contract's histogram in seconds (rank r adds r us)
    us = sum(t[0] + rank for rank in (0, 7) for t in record_nixl_stats.TRANSFERS)
    assert val(s, c.KV_XFER_DURATION.series("_sum"), engine="0") == pytest.approx(us / 1e6)
    assert val(s, c.KV_XFER_DURATION.series("_count"), engine="0") == 2 * len(record_nixl_stats.TRANSFERS)
    assert val(s, c.KV_XFER_DURATION.series("_count"), engine="0") == len(flat["transfer_duration"])
    assert val(s, c.KV_XFER_DURATION.series("_sum"), engine="0") == pytest.approx(sum(flat["transfer_duration"]))
    assert val(s, c.KV_XFER_BYTES.series("_sum"), engine="0") == sum(flat["bytes_transferred"])
    assert val(s, c.KV_XFER_DESCRIPTORS.series("_sum"), engine="0") == sum(flat["num_descriptors"])
    assert val(s, c.KV_XFER_POST_DURATION.series("_count"), engine="0") == len(flat["post_duration"])
    for kind in ("transfer", "notification", "handshake"):
        assert val(s, c.KV_XFER_FAILURES.series(), engine="0", kind=kind) == 1
    assert val(s, c.KV_XFER_EXPIRED.series(), engine="0") == 1
    assert val(s, c.KV_XFER_LATE_NOTIFICATIONS.series(), engine="0") == 1
    assert val(s, c.KV_XFER_DURATION.series("_count"), engine="1") == len(multi["transfer_duration"])
    assert val(s, c.KV_XFER_FAILURES.series(), engine="1", kind="transfer") == 0
    assert "kv_connector" not in str([k for k in s if k[0] == c.HOOK_ERRORS.series()])


def test_errors_are_counted_by_kind_logged_once_never_raised(decode):
    s = decode["samples"]
    assert val(s, c.HOOK_ERRORS.series(), kind="scheduler", pool="decode") == 1
    assert val(s, c.HOOK_ERRORS.series(), kind="iteration") == 2
    assert decode["stderr"].count("kind=iteration") == 1


def test_prefill_engine_pool_and_one_token_requests(driven):
    s = driven["samples"]
    assert val(s, c.REQUEST_TTFT.series("_count"), pool="prefill") == 4
    assert val(s, c.REQUEST_E2E.series("_count"), pool="prefill") == 4
    assert val(s, c.REQUEST_TPOT.series("_count"), pool="prefill") == 0  # one token: no TPOT
    assert not [k for k in s if k[0] == c.REQUESTS_KV_FETCH.series() and ("pool", "prefill") in k[1]]


def test_no_connector_is_mixed(driven):
    s = driven["samples"]
    assert val(s, c.KV_CACHE_USAGE.series(), pool="mixed") == 0.5
    assert val(s, c.ENGINE_INFO.series(), kv_role="", kv_connector="") == 1


def test_recorded_nixl_fixture_matches_vllm_format(driven):
    """The recorded payloads (used by the vLLM-free parsing tests) must equal what the installed
    vLLM's classes produce now: keys, units, MultiConnector naming. If not, re-record the fixture
    (tests/fixtures/record_nixl_stats.py) and check the hook against the new format."""
    fixture = json.loads((DRIVER.parent / "nixl_kv_connector_stats.json").read_text())
    assert driven["payloads"] == fixture


def test_mooncake_failed_receives_count_as_transfer_failures(driven):
    """MooncakeKVConnectorStats (vLLM's class) has NIXL's list format: its transfers were exported
    but its receiver-side failures (num_failed_recvs) were dropped, so a decode engine whose remote
    KV loads failed showed 0 failures."""
    s = {k: v for k, v in driven["samples"].items() if ("model", "mooncake") in k[1]}
    assert val(s, c.KV_XFER_FAILURES.series(), kind="transfer") == 1 + 2
    assert val(s, c.KV_XFER_DURATION.series("_count")) == 1
    assert val(s, c.KV_XFER_EXPIRED.series()) == 1
    assert not [k for k in s if k[0] == c.HOOK_ERRORS.series()]


# (vLLM's series, the contract's series, labels on both, labels on ours only): equal on the same stream.
PARITY = [
    ("vllm:nixl_xfer_time_seconds_count", c.KV_XFER_DURATION.series("_count"), {}, {}),
    ("vllm:nixl_xfer_time_seconds_sum", c.KV_XFER_DURATION.series("_sum"), {}, {}),
    ("vllm:nixl_post_time_seconds_sum", c.KV_XFER_POST_DURATION.series("_sum"), {}, {}),
    ("vllm:nixl_bytes_transferred_sum", c.KV_XFER_BYTES.series("_sum"), {}, {}),
    ("vllm:nixl_num_descriptors_sum", c.KV_XFER_DESCRIPTORS.series("_sum"), {}, {}),
    ("vllm:nixl_num_failed_transfers_total", c.KV_XFER_FAILURES.series(), {}, {}),  # vLLM sums the three kinds
    ("vllm:nixl_num_failed_notifications_total", c.KV_XFER_FAILURES.series(), {}, {"kind": "notification"}),
    ("vllm:nixl_num_kv_expired_reqs_total", c.KV_XFER_EXPIRED.series(), {}, {}),
    ("vllm:nixl_num_notifications_after_expiry_total", c.KV_XFER_LATE_NOTIFICATIONS.series(), {}, {}),
    ("vllm:spec_decode_num_drafts_total", c.SPEC_DRAFTS.series(), {}, {}),
    ("vllm:spec_decode_num_draft_tokens_total", c.SPEC_DRAFT_TOKENS.series(), {}, {}),
    ("vllm:spec_decode_num_accepted_tokens_total", c.SPEC_ACCEPTED_TOKENS.series(), {}, {}),
    *[("vllm:spec_decode_num_accepted_tokens_per_pos_total", c.SPEC_ACCEPTED_TOKENS_POS.series(), {"position": p}, {})
      for p in ("0", "1", "2")],
    ("vllm:time_to_first_token_seconds_count", c.REQUEST_TTFT.series("_count"), {}, {}),
    ("vllm:time_to_first_token_seconds_sum", c.REQUEST_TTFT.series("_sum"), {}, {}),
    ("vllm:inter_token_latency_seconds_count", c.INTER_TOKEN_LATENCY.series("_count"), {}, {}),
    ("vllm:inter_token_latency_seconds_sum", c.INTER_TOKEN_LATENCY.series("_sum"), {}, {}),
    ("vllm:e2e_request_latency_seconds_sum", c.REQUEST_E2E.series("_sum"), {}, {}),
    ("vllm:request_queue_time_seconds_sum", c.REQUEST_QUEUE.series("_sum"), {}, {}),
    ("vllm:request_prefill_time_seconds_sum", c.REQUEST_PREFILL.series("_sum"), {}, {}),
    ("vllm:request_decode_time_seconds_sum", c.REQUEST_DECODE.series("_sum"), {}, {}),
    ("vllm:request_time_per_output_token_seconds_sum", c.REQUEST_TPOT.series("_sum"), {}, {}),
    ("vllm:request_success_total", c.REQUESTS_FINISHED.series(), {}, {}),
    ("vllm:generation_tokens_total", c.GENERATION_TOKENS.series(), {}, {}),
    ("vllm:num_preemptions_total", c.PREEMPTIONS.series(), {}, {}),
    *[("vllm:prompt_tokens_by_source_total", c.PROMPT_TOKENS.series(), {"source": src}, {})
      for src in ("local_cache_hit", "external_kv_transfer")],
    ("vllm:prefix_cache_queries_total", c.PREFIX_CACHE_QUERIES.series(), {}, {"cache": "local"}),
    ("vllm:prefix_cache_hits_total", c.PREFIX_CACHE_HITS.series(), {}, {"cache": "local"}),
    ("vllm:external_prefix_cache_queries_total", c.PREFIX_CACHE_QUERIES.series(), {}, {"cache": "external"}),
    ("vllm:external_prefix_cache_hits_total", c.PREFIX_CACHE_HITS.series(), {}, {"cache": "external"}),
    ("vllm:num_requests_running", c.REQUESTS_RUNNING.series(), {}, {}),
    ("vllm:num_requests_waiting", c.REQUESTS_WAITING.series(), {}, {}),
    ("vllm:kv_cache_usage_perc", c.KV_CACHE_USAGE.series(), {}, {}),
    *[("vllm:num_requests_kv_fetch_by_stage", c.REQUESTS_KV_FETCH.series(), {"stage": st}, {})
      for st in ("waiting_to_start", "in_progress", "completed_waiting")],
]


@pytest.mark.parametrize("engine", ["0", "1"])
def test_hook_equals_vllms_own_logger_on_the_same_stream(driven, engine):
    """Built by vLLM's StatLoggerManager from a real VllmConfig (NixlConnector consumer, ngram spec
    decode, DP 2) beside vLLM's PrometheusStatLogger, fed the same SchedulerStats (through vLLM's
    codec) and IterationStats: every mapped series agrees per engine. vLLM observes TPOT 0 for
    one-token requests; the contract skips them."""
    s = driven["samples"]
    vllm_labels = {"model_name": "parity", "engine": engine}
    ours = {"model": "parity", "engine": engine, "pool": "decode"}
    for theirs_name, our_name, both, only_ours in PARITY:
        theirs = val(s, theirs_name, **vllm_labels, **both)
        assert val(s, our_name, **ours, **both, **only_ours) == pytest.approx(theirs, abs=1e-12), (theirs_name, both)
    assert val(s, c.REQUEST_TPOT.series("_count"), **ours) == (
        val(s, "vllm:request_time_per_output_token_seconds_count", **vllm_labels) - driven["one_token"][engine])
    assert not [k for k in s if k[0] == c.HOOK_ERRORS.series() and ("model", "parity") in k[1]]


def test_admission_rejections_equal_vllms_own_counter(driven):
    """vLLM >= 0.32 refuses requests at the API server (queue limits, HTTP 503) and tells only
    aggregate loggers (StatLoggerManager.record_admission_rejection): through vLLM's own manager the
    hook counts what vLLM's PrometheusStatLogger counts, per reason, under the pool's labels."""
    s = driven["samples"]
    theirs = {dict(lab)["reason"]: v for (n, lab), v in s.items()
              if n == "vllm:admission_rejections_total" and ("model_name", "parity") in lab}
    # the driver calls it 2, 3, ... times per reason of vLLM's ADMISSION_REASONS
    assert sorted(theirs.values()) == list(range(2, 2 + len(theirs))) and len(theirs) >= 2
    for reason, n in theirs.items():
        assert val(s, c.ADMISSION_REJECTIONS.series(), model="parity", pool="decode", reason=reason) == n
