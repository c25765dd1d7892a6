"""sla-guard-sidecar against a live CPU vLLM (the shared spec-decode engine)."""

from __future__ import annotations

import subprocess
import time

import httpx
import psutil
import pytest
import vllm_support as vs
from test_sidecar import SIDECAR, _free_port, _scrape_until, one, parse, pick

from exporters import contract as c

pytestmark = pytest.mark.vllm


def test_sidecar_maps_live_vllm_and_samples_its_process_tree(vllm_spec_engine):
    for i in range(2):
        vs.complete(vllm_spec_engine.base_url, f"sidecar {i} " + "a b c d " * 10, max_tokens=16)
    port = _free_port()
    side = subprocess.Popen([str(SIDECAR), "--metrics-url", vllm_spec_engine.metrics_url, "--pool", "decode",
                             "--model", vs.MODEL_NAME, "--pid", str(vllm_spec_engine.pid),
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        time.sleep(1.0)  # idle engine: nothing moves between the two scrapes below
        ours = _scrape_until(url, lambda s: bool(pick(s, c.REQUEST_TTFT.series("_count"))))
        native = parse(httpx.get(vllm_spec_engine.metrics_url, timeout=10).text)
        assert one(ours, c.REQUEST_TTFT.series("_count"), engine="0", pool="decode") == one(
            native, "vllm:time_to_first_token_seconds_count", engine="0")
        assert one(ours, c.SPEC_DRAFTS.series(), engine="0") == one(native, "vllm:spec_decode_num_drafts_total",
                                                                    engine="0")
        roles = {dict(k[1])["role"]: dict(k[1]) for k in pick(ours, c.PROCESS_INFO.series())}
        assert {"api_server", "engine_core", "worker"} <= roles.keys()
        for role in ("engine_core", "worker"):
            info = roles[role]
            truth = psutil.Process(int(info["process_pid"])).memory_info().rss
            rss = one(ours, c.PROCESS_RSS.series(), role=role, process=info["process"])
            assert abs(rss - truth) / truth < 0.10
            assert info["engine"] == "0"
    finally:
        side.terminate()
        side.wait(10)
