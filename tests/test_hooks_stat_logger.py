"""The stat-logger hook fed with vLLM's REAL stats objects.

The objects are built by tests/fixtures/drive_stat_logger.py inside .venv-vllm (vLLM cannot be
imported in the project venv), which prints the resulting exposition; assertions run here.
Skipped with the reason when .venv-vllm is missing or SLA_GUARD_SKIP_VLLM=1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c

pytestmark = pytest.mark.vllm
DRIVER = Path(__file__).resolve().parent / "fixtures" / "drive_stat_logger.py"


def drive(python: Path) -> dict:
    out = subprocess.run([str(python), str(DRIVER)], capture_output=True, text=True, timeout=180,
                         cwd=DRIVER.parent.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    samples = {}
    for fam in text_string_to_metric_families(result["exposition"]):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return {"samples": samples, "stderr": out.stderr, "nixl_keys": result["nixl_keys"]}


def val(samples, name, **labels):
    hits = [v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items())]
    assert hits, f"no sample {name}{labels}"
    return sum(hits)


@pytest.fixture(scope="module")
def driven(vllm_venv_python):
    return drive(vllm_venv_python)


@pytest.fixture(scope="module")
def decode(driven):
    """Only the decode case's series (pool="decode")."""
    return {**driven, "samples": {k: v for k, v in driven["samples"].items() if ("pool", "decode") in k[1]}}


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
    """Recorded NIXL dicts (tests/fixtures/nixl_kv_connector_stats.json, produced by vLLM's own
    NixlKVConnectorStats since NIXL needs CUDA): step 0 flat (engine 0), step 1 under
    MultiConnector (engine 1), step 2 an unknown connector (ignored, no error)."""
    s = decode["samples"]
    fixture = json.loads((DRIVER.parent / "nixl_kv_connector_stats.json").read_text())
    flat, multi = fixture["flat"], fixture["multi"]["NixlConnector"]
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
    """Fails when vLLM's NixlKVConnectorStats changes its keys: re-record the fixture then."""
    fixture = json.loads((DRIVER.parent / "nixl_kv_connector_stats.json").read_text())
    assert driven["nixl_keys"] == sorted(fixture["flat"])
