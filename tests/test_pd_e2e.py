"""The client's SLA on a REAL CPU vLLM P/D pair (issue 14's done-when), as a new user would run it.

Two vLLM engines (tiny model, ExampleConnector producer and consumer sharing a directory) behind
``sla-guard-proxy`` started as its console entry point (``python -m pd_proxy``, a subprocess). A
client in its own process (tests/fixtures/stream_client.py) sends streaming completions through
the proxy and times the first streamed token itself. Then:

- the proxy's client-scope TTFT mean (its own /metrics) is within 5% of the client-measured mean,
  less the time the client's own thread waited for a CPU (measured by the client, from the
  kernel's schedstat: a delay on the client's host that no server can see);
- ``sla-guard check --json`` with the DEFAULT SLOs over the three targets (prefill, decode, and
  the proxy as ``pool: client``) exits 0, with a verdict for every pool and the client scope;
- its TTFT breakdown sums to within 10% of the client-measured mean, every stage the router
  derives is non-negative, and the engine-measured stages explain less than the whole.

The figures are printed (pytest -s) for the closing note.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import vllm_support as vs
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c

STREAM_CLIENT = Path(__file__).resolve().parent / "fixtures" / "stream_client.py"

N_REQUESTS = 24
# ExampleConnector's consumer cannot load KV that was prefilled in chunks ("shape mismatch [2048]
# vs [2432]"): room for the longest prompt and its 128 tokens in one batch
ONE_CHUNK = ["--max-model-len", "4096", "--max-num-batched-tokens", "4096"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "patient",
         "operator", "reads", "the", "dashboards"]


def _prompt(i: int, rng: np.random.Generator) -> str:
    # the reproduction: 180-1,200 words (~470-3,100 tokens of the tiny tokenizer); each
    # prompt prefills in one chunk (ONE_CHUNK), or ExampleConnector's consumer fails
    n = int(rng.integers(180, 1200))
    return f"request {i}: " + " ".join(WORDS[j % len(WORDS)] for j in rng.integers(0, len(WORDS), n))


def _lower_priority(pid: int, nice: int = 10) -> None:
    """An engine's process tree at ``nice``. In a deployment the client and the proxy do not queue
    for a CPU behind both engines; on this 2-core host the client's thread waited 13-83 ms in the
    run queue in some requests (its /proc schedstat), a wait no server can see that moved the
    mean by 2-14 % between runs. Each engine runs in its own session, and with autogroup
    scheduling (on here) a session competes as one group whatever its threads' nice values, so
    the group's nice is set too (/proc/PID/autogroup); per-thread values cover kernels without
    autogroup (Linux priorities are per thread)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        for task in proc.threads():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, task.id, nice)


def _client_ttft_mean(metrics_text: str) -> tuple[float, float]:
    s = n = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != c.CLIENT_TTFT.name:
            continue
        for smp in fam.samples:
            if smp.labels.get("pool") != "client":
                continue
            if smp.name.endswith("_sum"):
                s += smp.value
            elif smp.name.endswith("_count"):
                n += smp.value
    return s / n if n else float("nan"), n


@pytest.mark.slow
def test_client_ttft_measured_explained_and_judged_on_a_real_pd_pair(vllm_server_factory, tmp_path):
    storage = tmp_path / "kv"
    storage.mkdir()

    def kv_args(role: str) -> list[str]:
        return [*vs.example_connector_args(role, storage), *ONE_CHUNK]

    prefill = vllm_server_factory(kv_args("kv_producer"), env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, wait=False)
    decode = vllm_server_factory(kv_args("kv_consumer"), env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, wait=False)
    port = vs.free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "proxy.log").open("w")
    proxy = None
    try:
        vs.wait_healthy(prefill)
        vs.wait_healthy(decode)
        for server in (prefill, decode):
            _lower_priority(server.pid)
        proxy = subprocess.Popen([sys.executable, "-m", "pd_proxy", "--prefill", prefill.base_url,
                                  "--decode", decode.base_url, "--listen", f"127.0.0.1:{port}",
                                  "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert proxy.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                if httpx.get(proxy_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "sla-guard-proxy did not come up"
            time.sleep(0.2)

        rng = np.random.default_rng(14)
        # 128 tokens a request: with 48, one pause of ~0.6 s in a request's stream (seen on this host,
        # mean TPOT 6 ms) put its TPOT over 20 ms and the 99% TPOT attainment of 24 requests below target
        requests = [{"id": f"e2e-{i}", "body": {"model": vs.MODEL_NAME, "prompt": _prompt(i, rng), "max_tokens": 128,
                                                "ignore_eos": True, "temperature": 0.0, "stream": True}}
                    for i in range(N_REQUESTS)]
        (tmp_path / "requests.json").write_text(json.dumps(requests))
        # the client runs in its own process, as a user's does (tests/fixtures/stream_client.py says why)
        r = subprocess.run([sys.executable, str(STREAM_CLIENT), proxy_url, str(tmp_path / "requests.json")],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        measured = json.loads(r.stdout)
        assert len(measured) == N_REQUESTS
        client_mean = float(np.mean([m["ttft"] for m in measured]))
        client_wait = float(np.mean([m["cpu_wait"] for m in measured]))

        proxy_mean, proxy_n = _client_ttft_mean(httpx.get(proxy_url + "/metrics", timeout=5).text)
        assert proxy_n == N_REQUESTS
        client_own = client_mean - client_wait
        print(f"\nclient-measured TTFT mean {client_mean * 1000:.1f} ms over {N_REQUESTS} streaming requests, "
              f"{client_wait * 1000:.1f} ms of it the client's thread waiting for a CPU; proxy client scope "
              f"{proxy_mean * 1000:.1f} ms ({100 * (proxy_mean / client_mean - 1):+.1f}% of the whole, "
              f"{100 * (proxy_mean / client_own - 1):+.1f}% of the client's time less its CPU wait)")
        # What no server can see (per-request probe on one monotonic clock): the client's send path
        # to the proxy's socket, 1-2 ms, and the relay of the first token to the client, 0.2-1 ms;
        # plus, in a few requests a run, the client waiting 10-80 ms for a CPU even with the engines
        # niced (_lower_priority): CI saw the proxy 5.6 % under the client's whole mean. That wait is
        # measured by the client itself (its thread's schedstat), so it is taken out, not allowed for.
        assert proxy_mean == pytest.approx(client_own, rel=0.05)

        # an engine hands a request's stats to its API server after the answer (later on a busy host):
        # the check below must judge, and its breakdown split, every request, not the part counted so far
        ttft, tpot = c.REQUEST_TTFT.series("_count"), c.REQUEST_TPOT.series("_count")
        deadline = time.monotonic() + 60
        while (vs.total(vs.scrape(prefill.metrics_url), ttft) < N_REQUESTS
               or vs.total(vs.scrape(decode.metrics_url), tpot) < N_REQUESTS):
            assert time.monotonic() < deadline, "the engines did not count every request within 60 s"
            time.sleep(0.3)

        cfg = {"source": {"mode": "scrape", "targets": [
            {"url": prefill.metrics_url, "model": vs.MODEL_NAME, "pool": "prefill"},
            {"url": decode.metrics_url, "model": vs.MODEL_NAME, "pool": "decode"},
            {"url": proxy_url + "/metrics", "model": vs.MODEL_NAME, "pool": "client"}]}}
        (tmp_path / "guard.yaml").write_text(yaml.safe_dump(cfg))
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(tmp_path / "guard.yaml"),
                            "--json"], capture_output=True, text=True, timeout=120)
        snap = json.loads(r.stdout)
        verdicts = {p["pool"]: p["status"] for p in snap["pools"]}
        values = {(p["pool"], s["slo"]): (s["status"], s["value"], s["requests"])
                  for p in snap["pools"] for s in p["slos"]}
        print(f"sla-guard check (default SLOs): exit {r.returncode}, {verdicts}\n{values}")
        assert r.returncode == 0, (values, r.stderr[-2000:])
        assert verdicts == {"prefill": "ok", "decode": "ok", "client": "ok"}

        b = next(m for m in snap["ttft_breakdown"]["models"] if m["model"] == vs.MODEL_NAME)
        stages = {s["stage"]: s for s in b["stages"]}
        print("where the TTFT went: " + ", ".join(f"{k} {v['seconds'] * 1000:.1f} ms ({v['source']})"
                                                   for k, v in stages.items()))
        print(f"stages sum {b['sum_of_stages_s'] * 1000:.1f} ms = "
              f"{100 * b['sum_of_stages_s'] / client_mean:.1f}% of the client-measured mean")
        assert not b["estimated"]
        assert {"proxy", "prefill_server", "prefill_queue", "prefill_compute", "decode_queue",
                "first_decode_step", "decode_server"} <= set(stages)
        assert b["sum_of_stages_s"] == pytest.approx(client_own, rel=0.10)
        assert all(v["seconds"] >= -0.001 for v in stages.values() if v["source"] == "derived"), stages
        engine = sum(v["seconds"] for v in stages.values() if v["source"] == "engine")
        assert 0 < engine < client_mean
        assert any("synchronous connector" in n for n in b["notes"])  # ExampleConnector: KV in the first step
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        log.close()
        prefill.stop()
        decode.stop()
