"""NIXL kv_connector_stats parsing on the recorded dicts (no vLLM needed).

tests/fixtures/nixl_kv_connector_stats.json was produced by vLLM's own stats classes
(tests/fixtures/record_nixl_stats.py; tests/test_hooks_stat_logger.py fails when it no longer equals
what the installed vLLM produces); real NIXL transfers need CUDA.
"""

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from engine_hooks.kv_connector import parse_kv_connector_stats
from exporters import contract as c
from exporters.prometheus import ContractMetrics, EngineRecorder

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "nixl_kv_connector_stats.json").read_text())


def test_flat_nixl_dict():
    (b,) = parse_kv_connector_stats(FIXTURE["flat"])
    assert b.connector == "NixlConnector"
    assert b.durations == FIXTURE["flat"]["transfer_duration"]
    assert b.nbytes == [float(x) for x in FIXTURE["flat"]["bytes_transferred"]]
    assert b.failures == {"transfer": 1, "notification": 1, "handshake": 1}
    assert (b.expired, b.late_notifications) == (1, 1)


def test_multiconnector_nesting_keeps_only_nixl():
    """MultiConnector keys by class name: vLLM 0.32's NixlConnector is NixlPullConnector."""
    batches = list(parse_kv_connector_stats(FIXTURE["multi"]))
    assert [b.connector for b in batches] == ["NixlPullConnector"]
    assert len(batches[0].durations) == len(FIXTURE["multi"]["NixlPullConnector"]["transfer_duration"])


def test_mooncake_failed_receives_are_transfer_failures():
    """MooncakeConnector's payload has NIXL's list format and is exported, but its receiver-side
    failures (``num_failed_recvs``: a remote KV load that failed) were dropped: a decode engine whose
    loads all failed showed 0 failures."""
    (b,) = parse_kv_connector_stats(FIXTURE["mooncake"])
    assert b.failures["transfer"] == 1 + 2  # one failed send, two failed receives
    assert b.expired == 1 and b.durations == [0.004] and b.bad == 0


def test_unknown_empty_and_garbage_yield_nothing():
    assert list(parse_kv_connector_stats(FIXTURE["unknown"])) == []
    assert list(parse_kv_connector_stats(FIXTURE["empty"])) == []
    assert list(parse_kv_connector_stats(None)) == []
    assert list(parse_kv_connector_stats({"transfer_duration": "oops", "num_failed_transfers": [True]})) == []
    deep: dict = {"transfer_duration": [0.1]}
    for i in range(10):
        deep = {f"Multi{i}": deep}
    assert list(parse_kv_connector_stats(deep)) == []  # bounded nesting


def test_recorder_exposes_kv_transfer_series():
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    for b in parse_kv_connector_stats(FIXTURE["flat"]):
        rec.kv_transfer(b.durations, b.post_durations, b.nbytes, b.descriptors, b.failures, b.expired,
                        b.late_notifications)
    text = generate_latest(reg).decode()
    n = len(FIXTURE["flat"]["transfer_duration"])
    assert f'{c.KV_XFER_DURATION.series("_count")}{{engine="0",model="m",pool="decode"}} {float(n)}' in text
    assert f'{c.KV_XFER_FAILURES.series()}{{engine="0",kind="handshake",model="m",pool="decode"}} 1.0' in text


def test_malformed_event_counts_are_refused_not_summed():
    """[-1] used to reach Counter.inc(-1) (raises) and [1, -1] netted to 0 silently."""
    (b,) = parse_kv_connector_stats({"transfer_duration": [0.01], "num_failed_transfers": [1, -1, float("nan")],
                                     "num_kv_expired_reqs": [float("inf")], "num_failed_handshakes": -2})
    assert b.failures == {"transfer": 1, "notification": 0, "handshake": 0}
    assert b.expired == 0 and b.bad == 4
    (only_bad,) = parse_kv_connector_stats({"transfer_duration": [], "num_failed_transfers": [-1]})
    assert only_bad.bad == 1  # not dropped as empty: the refusal must still be counted


def test_non_number_entries_are_counted_not_dropped_without_a_word():
    """Strings and None inside NIXL's lists: a failure ["1"] vanished (no failure, no hook error)
    and durations ["0.5", None] were filtered before the histogram that counts refused values."""
    reg = CollectorRegistry()
    rec = EngineRecorder(ContractMetrics(reg), "m", "decode", 0)
    (b,) = parse_kv_connector_stats({"transfer_duration": [0.01, "0.5", None], "num_failed_transfers": ["1"],
                                     "num_kv_expired_reqs": [None, 1]})
    assert b.bad == 2 and b.expired == 1 and b.failures["transfer"] == 0
    rec.kv_transfer(b.durations, b.post_durations, b.nbytes, b.descriptors, b.failures, b.expired,
                    b.late_notifications)
    text = generate_latest(reg).decode()
    assert f'{c.KV_XFER_DURATION.series("_count")}{{engine="0",model="m",pool="decode"}} 1.0' in text
    assert f'{c.HOOK_ERRORS.series()}{{kind="bad_observation",model="m",pool="decode"}} 2.0' in text


def test_an_engine_with_a_kv_connector_exports_its_failure_counters_at_zero_from_start(tmp_path, monkeypatch):
    """The failure counters were bound at the first KV stats batch and incremented in the same call:
    a failure in that batch made the series' first sample 1, which increase() (Prometheus's and the
    guard's) never counts, so an engine's first KV-transfer failure raised no alert."""
    from types import SimpleNamespace as NS

    from prometheus_client import REGISTRY

    from engine_hooks.stat_logger import SlaGuardStatLogger

    monkeypatch.setenv("SLA_GUARD_DISABLE_SAMPLER", "1")
    monkeypatch.setenv("SLA_GUARD_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SLA_GUARD_OTLP_ENDPOINT", raising=False)
    kv = NS(kv_role="kv_producer", kv_connector="NixlConnector", is_kv_consumer=False)
    cfg = NS(model_config=NS(served_model_name="kvstart", model="/m"), kv_transfer_config=kv,
             speculative_config=None, parallel_config=NS(data_parallel_size=1))
    SlaGuardStatLogger(cfg, [5])
    for kind in ("transfer", "notification", "handshake"):
        labels = {"model": "kvstart", "pool": "prefill", "engine": "5", "kind": kind}
        assert REGISTRY.get_sample_value(c.KV_XFER_FAILURES.series(), labels) == 0.0, kind
    labels = {"model": "kvstart", "pool": "prefill", "engine": "5"}
    assert REGISTRY.get_sample_value(c.KV_XFER_DURATION.series("_count"), labels) == 0.0
