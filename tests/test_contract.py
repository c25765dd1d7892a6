"""The metric contract: naming rules, SLA thresholds as bucket boundaries, generated docs."""

import re
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporters import contract as c
from exporters.prometheus import ContractMetrics, EngineRecorder, FinishedRequest


def test_names_follow_prometheus_conventions():
    for m in c.ALL:
        assert m.name.startswith(c.PREFIX) and not m.name.startswith("vllm:"), m.name
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", m.name), m.name
        assert not m.name.endswith("_total"), f"{m.name}: counters get _total at exposition"
        if m.unit == "s":
            assert m.name.endswith("_seconds"), m.name
        if m.kind is c.Kind.HISTOGRAM:
            assert list(m.buckets) == sorted(m.buckets) and m.buckets, m.name
    assert len({m.name for m in c.ALL}) == len(c.ALL)


def test_sla_thresholds_are_bucket_boundaries():
    assert c.DEFAULT_TTFT_SLO_S in c.REQUEST_TTFT.buckets
    assert c.DEFAULT_TPOT_SLO_S in c.REQUEST_TPOT.buckets
    assert c.DEFAULT_TPOT_SLO_S in c.INTER_TOKEN_LATENCY.buckets


def test_bucket_override_adds_thresholds_and_ignores_garbage(caplog):
    b = c.bucket_override(c.REQUEST_TPOT, {"SLA_GUARD_TPOT_SLO_S": "0.018,0.033"})
    assert 0.018 in b and 0.033 in b and c.DEFAULT_TPOT_SLO_S in b and list(b) == sorted(b)
    assert c.bucket_override(c.REQUEST_TPOT, {"SLA_GUARD_TPOT_SLO_S": "2.5,abc"}) == c.REQUEST_TPOT.buckets
    # ignored so as not to fail vLLM's start-up, but said: it was dropped without a word
    assert "SLA_GUARD_TPOT_SLO_S='2.5,abc' is not a comma-separated list of seconds" in caplog.text


@pytest.mark.parametrize(("role", "env", "pool"), [
    ("kv_producer", {}, "prefill"), ("kv_consumer", {}, "decode"), ("kv_both", {}, "mixed"),
    (None, {}, "mixed"), ("kv_producer", {"SLA_GUARD_POOL": "decode"}, "decode"),
    ("kv_consumer", {"SLA_GUARD_POOL": "bogus"}, "decode"),
])
def test_pool_from_kv_role(role, env, pool):
    assert c.pool_from_kv_role(role, env) == pool


@pytest.mark.parametrize("wrong", ["prefil", "client"])
def test_a_pool_override_that_is_no_engine_pool_is_said(caplog, wrong):
    """A misspelt SLA_GUARD_POOL left the engine in its KV role's pool without a word, and
    'client' (the proxy's scope, no engine's) was taken: engine series under the client SLOs."""
    assert c.pool_from_kv_role("kv_producer", {"SLA_GUARD_POOL": wrong}) == "prefill"
    assert f"SLA_GUARD_POOL='{wrong}' is not one of prefill, decode, mixed" in caplog.text


@pytest.mark.parametrize(("status", "outcome"), [
    (200, "ok"), (400, "client_error"), (401, "client_error"), (404, "client_error"), (413, "client_error"),
    (422, "client_error"), (408, "error"), (429, "error"), (500, "error"), (502, "error"), (503, "error"),
    (504, "error"), (301, "error"),
])
def test_outcome_of_status_leaves_the_clients_own_mistakes_out_of_errors(status, outcome):
    """4xx is the client's mistake, except 429 (the service refusing load) and 408 (behind a router
    the request an engine waited for is the router's); the help text lists every outcome."""
    assert c.outcome_of_status(status) == outcome
    assert all(o.value in c.CLIENT_REQUESTS.help for o in c.Outcome)


def test_recorder_exposes_contract_names_with_labels():
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 1)
    rec.finished(FinishedRequest(1.0, 0.1, 0.2, 0.7, 0.015, 100, 20, 10))
    rec.finished(FinishedRequest(0.3, 0.1, 0.2, 0.0, 0.0, 100, 0, 1))  # one token: no TPOT
    rec.spec_decode(2, 6, 3, [2, 1, 0], [2, 2, 2])
    text = generate_latest(reg).decode()
    lab = 'engine="1",model="m",pool="decode"'
    assert f"slaguard_request_tpot_seconds_count{{{lab}}} 1.0" in text
    assert f"slaguard_request_e2e_seconds_count{{{lab}}} 2.0" in text
    assert 'slaguard_request_tpot_seconds_bucket{engine="1",le="0.02",model="m",pool="decode"} 1.0' in text
    pos1 = 'slaguard_spec_decode_accepted_tokens_per_pos_total{engine="1",model="m",pool="decode",position="1"}'
    assert f"{pos1} 1.0" in text
    assert "slaguard_spec_decode_draft_tokens_total" in text


def test_generated_metrics_doc_is_current():
    r = subprocess.run([sys.executable, "-m", "exporters.docs", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
