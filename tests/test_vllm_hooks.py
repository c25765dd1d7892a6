"""The hooks inside REAL CPU vLLM (.venv-vllm), loaded through their entry points.

Engines: the shared ngram spec-decode engine (conftest ``vllm_spec_engine``), a P/D pair with
ExampleConnector behind sla-guard-proxy (pd_proxy), and DP=2 with two API servers. Every assertion
compares the hook's series with vLLM's own counters or with psutil, read at the same moment.
"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest
import vllm_support as vs
from fixtures.otlp_receiver import OtlpReceiver, attrs

from exporters import contract as c
from pd_proxy import ProxyConfig, ProxyThread

pytestmark = pytest.mark.vllm

SPEC_PAIRS = [  # (contract, vLLM's own counter) over the same requests
    (c.SPEC_DRAFTS, "vllm:spec_decode_num_drafts_total"),
    (c.SPEC_DRAFT_TOKENS, "vllm:spec_decode_num_draft_tokens_total"),
    (c.SPEC_ACCEPTED_TOKENS, "vllm:spec_decode_num_accepted_tokens_total"),
]


def wait_for(metrics_url: str, predicate, timeout: float = 20.0):
    """Scrape until predicate(samples) holds (stats reach the API server after the response)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = vs.scrape(metrics_url)
        if predicate(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.3)


def delta(after, before, name, **labels) -> float:
    return vs.total(after, name, **labels) - vs.total(before, name, **labels)


def test_spec_engine_contract_counts_match_vllm(vllm_spec_engine):
    url = vllm_spec_engine.metrics_url
    before = vs.scrape(url)
    n = 4
    for i in range(n):
        vs.complete(vllm_spec_engine.base_url, f"{i} " + "a b c d " * 30, max_tokens=48)
    ttft = c.REQUEST_TTFT.series("_count")
    after = wait_for(url, lambda s: vs.total(s, ttft) - vs.total(before, ttft) >= n)
    time.sleep(1.0)  # idle engine: no further steps, both loggers have seen the same stream
    after = vs.scrape(url)

    contract = [k for k in after if k[0].startswith(c.PREFIX) and "pool" in dict(k[1])]
    assert contract and {dict(k[1])["pool"] for k in contract} == {"mixed"}
    assert delta(after, before, ttft, pool="mixed", engine="0") == n
    assert delta(after, before, c.REQUEST_TPOT.series("_count"), pool="mixed") == n
    assert delta(after, before, c.REQUEST_E2E.series("_count"), pool="mixed") == n
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == n
    for metric, native in SPEC_PAIRS:
        ours = delta(after, before, metric.series(), pool="mixed")
        assert ours == delta(after, before, native), metric.name
    assert delta(after, before, c.SPEC_ACCEPTED_TOKENS.series()) > 0
    for pos in ("0", "1", "2"):
        assert delta(after, before, c.SPEC_ACCEPTED_TOKENS_POS.series(), position=pos) == delta(
            after, before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=pos)
    assert vs.total(after, c.ENGINE_INFO.series(), spec_method="ngram", num_spec_tokens="3", pool="mixed") == 1
    assert vs.total(after, c.HOOK_ERRORS.series()) == 0


def test_engine_core_and_worker_rss_match_psutil(vllm_spec_engine):
    samples = wait_for(vllm_spec_engine.metrics_url, lambda s: len(vs.select(s, c.PROCESS_INFO.series())) >= 3)
    infos = {dict(k[1])["role"]: dict(k[1]) for k in vs.select(samples, c.PROCESS_INFO.series())}
    assert {"api_server", "engine_core", "worker"} <= infos.keys(), infos
    assert int(infos["api_server"]["process_pid"]) == vllm_spec_engine.pid
    tree = {p.pid for p in psutil.Process(vllm_spec_engine.pid).children(recursive=True)}
    for role in ("engine_core", "worker", "api_server"):
        info = infos[role]
        pid = int(info["process_pid"])
        assert role == "api_server" or pid in tree
        got = vs.scrape(vllm_spec_engine.metrics_url)
        truth = psutil.Process(pid).memory_info().rss  # same moment as the scrape
        (rss,) = vs.select(got, c.PROCESS_RSS.series(), role=role, process=info["process"]).values()
        assert abs(rss - truth) / truth < 0.10, (role, rss, truth)
        assert info["pool"] == "mixed" and info["model"] == vs.MODEL_NAME
        assert info["engine"] == ("" if role == "api_server" else "0")
        kinds = {dict(k[1])["kind"] for k in vs.select(got, c.PROCESS_MEMORY.series(), process=info["process"])}
        assert kinds == {"anon", "file", "shmem"}
    frozen = vs.select(samples, c.PROCESS_GC_FROZEN.series(), role="engine_core")
    assert frozen and next(iter(frozen.values())) > 0  # EngineCore calls gc.freeze() after start-up


@pytest.mark.slow
def test_pd_pair_pools_external_hits_and_kv_wait_gauge(vllm_server_factory, tmp_path):
    storage = tmp_path / "kv"
    storage.mkdir()

    def kv_args(role: str) -> list[str]:
        return vs.example_connector_args(role, storage)

    receiver = OtlpReceiver().__enter__()  # both engines also mirror to OTLP: spans joinable by id
    otel = {"SLA_GUARD_OTLP_ENDPOINT": receiver.endpoint, "SLA_GUARD_OTLP_EXPORT_INTERVAL_S": "1"}
    prefill = vllm_server_factory(kv_args("kv_producer"), env={"VLLM_CPU_OMP_THREADS_BIND": "0", **otel},
                                  wait=False)
    decode = vllm_server_factory(kv_args("kv_consumer"), env={"VLLM_CPU_OMP_THREADS_BIND": "1", **otel},
                                 wait=False)
    proxy = None
    try:
        vs.wait_healthy(prefill)
        vs.wait_healthy(decode)
        proxy = ProxyThread(ProxyConfig(prefill=(prefill.base_url,), decode=(decode.base_url,))).start()
        n = 3
        for i in range(n):  # > 128 tokens (the CPU block size) so whole blocks are stored and loaded
            body = {"model": vs.MODEL_NAME, "max_tokens": 8, "ignore_eos": True, "temperature": 0.0,
                    "prompt": f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 30}
            r = httpx.post(proxy.url + "/v1/completions", json=body, headers={"X-Request-Id": f"pd-join-{i}"},
                           timeout=120)
            assert r.status_code == 200, r.text
        ttft = c.REQUEST_TTFT.series("_count")
        p = wait_for(prefill.metrics_url, lambda s: vs.total(s, ttft) >= n)
        d = wait_for(decode.metrics_url, lambda s: vs.total(s, ttft) >= n)
        for samples, pool in ((p, "prefill"), (d, "decode")):
            pools = {dict(k[1])["pool"] for k in samples if k[0].startswith(c.PREFIX) and "pool" in dict(k[1])}
            assert pools == {pool}
            assert vs.total(samples, ttft, pool=pool) == n
        assert vs.total(p, c.REQUEST_TPOT.series("_count")) == 0  # prefill: one token per request
        assert vs.total(d, c.REQUEST_TPOT.series("_count")) == n
        assert vs.total(d, c.PREFIX_CACHE_HITS.series(), cache="external") > 0
        assert vs.total(d, c.PROMPT_TOKENS.series(), source="external_kv_transfer") > 0
        stages = {dict(k[1])["stage"] for k in vs.select(d, c.REQUESTS_KV_FETCH.series(), pool="decode")}
        assert {"waiting_to_start", "in_progress", "completed_waiting"} <= stages
        assert not vs.select(p, c.REQUESTS_KV_FETCH.series())
        assert vs.total(p, c.ENGINE_INFO.series(), kv_role="kv_producer", kv_connector="ExampleConnector") == 1
        assert vs.total(d, c.ENGINE_INFO.series(), kv_role="kv_consumer") == 1
        assert vs.select(d, c.PROCESS_RSS.series(), role="worker", pool="decode")

        def halves(r: OtlpReceiver) -> dict:
            ids: dict = {}
            for span in r.spans():
                if span.name == "sla_guard.request":
                    a = attrs(span.attributes)
                    ids.setdefault(a["sla_guard.pool"], set()).add(a["gen_ai.response.id"])
            return ids

        assert receiver.wait(lambda r: {"prefill", "decode"} <= halves(r).keys() and all(
            len(v) >= n for v in halves(r).values())), halves(receiver)
        for i in range(n):  # each client request has a prefill half and a decode half carrying its id
            for pool, ids in halves(receiver).items():
                assert any(f"pd-join-{i}" in rid for rid in ids), (pool, ids)
        assert c.REQUEST_TTFT.otel_name in receiver.metric_points()
    finally:
        receiver.__exit__()
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.slow
def test_dp2_with_two_api_servers_engine_labels(vllm_server_factory):
    """DP=2 through ``vllm serve --api-server-count 2``: multiprocess mode, each API server sees
    part of the steps; the union on /metrics must still equal vLLM's own per-engine counts."""
    server = vllm_server_factory(["--data-parallel-size", "2", "--api-server-count", "2"], cli=True)
    try:
        n = 8
        for i in range(n):
            vs.complete(server.base_url, f"dp request {i} hello world", max_tokens=6)
        ttft = c.REQUEST_TTFT.series("_count")
        samples = wait_for(server.metrics_url, lambda s: vs.total(s, ttft) >= n)
        time.sleep(1.0)
        samples = vs.scrape(server.metrics_url)
        assert vs.total(samples, ttft) == n
        for e in ("0", "1"):
            assert vs.total(samples, ttft, engine=e) == vs.total(samples, "vllm:time_to_first_token_seconds_count",
                                                                  engine=e)
        assert {dict(k[1])["engine"] for k in vs.select(samples, c.ENGINE_INFO.series(), dp_size="2")} == {"0", "1"}
        procs = wait_for(server.metrics_url,
                         lambda s: len(vs.select(s, c.PROCESS_RSS.series(), role="engine_core")) == 2)
        cores = {dict(k[1])["process"]: dict(k[1])["engine"]
                 for k in vs.select(procs, c.PROCESS_RSS.series(), role="engine_core")}
        assert cores == {"EngineCore_DP0": "0", "EngineCore_DP1": "1"}
        workers = {dict(k[1])["engine"] for k in vs.select(procs, c.PROCESS_RSS.series(), role="worker")}
        assert workers == {"0", "1"}
        api = {dict(k[1])["process"] for k in vs.select(procs, c.PROCESS_RSS.series(), role="api_server")}
        assert api == {"APIServer_0", "APIServer_1"}
        tree = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
        pids = {int(dict(k[1])["process_pid"]) for k in vs.select(procs, c.PROCESS_INFO.series())}
        assert pids - {server.pid} <= tree and len(pids) >= 6
    finally:
        server.stop()
