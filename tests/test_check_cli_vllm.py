"""`sla-guard check` against the REAL CPU vLLM engine (shared ``vllm_spec_engine``: the
engine-hooks plugin serves the contract on vLLM's /metrics with pool="mixed").

The engine is shared by the session, so expected values come from the exposition itself,
scraped right before and after the check with no traffic in between: the table must show
exactly the engine's lifetime mean TTFT / TPOT and request count."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm_support as vs
import yaml

from exporters import contract as c

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def _contract_total(samples, metric_sample: str) -> float:
    return vs.total(samples, metric_sample, pool="mixed")


def test_check_against_real_vllm(vllm_spec_engine, tmp_path):
    server = vllm_spec_engine
    before = vs.scrape(server.metrics_url)
    n0 = _contract_total(before, c.REQUEST_TTFT.series("_count"))
    prompt = "a b c d " * 12
    n = 6
    for _ in range(n):
        vs.complete(server.base_url, prompt, max_tokens=24)
    deadline = time.time() + 30  # the stat logger records asynchronously
    while True:
        after = vs.scrape(server.metrics_url)
        if _contract_total(after, c.REQUEST_TTFT.series("_count")) >= n0 + n or time.time() > deadline:
            break
        time.sleep(0.5)
    cfg = {"source": {"mode": "scrape", "timeout_s": 5,
                      "targets": [{"url": server.metrics_url, "model": vs.MODEL_NAME, "pool": "mixed",
                                   "name": "vllm"}]},
           "slos": [{"objectives": [
               {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "min_requests": 3},
               {"name": "tpot_mean", "indicator": "tpot", "objective": "mean", "threshold_s": 2.5,  # the top bucket
                "min_requests": 3},
               {"name": "ttft_p90", "indicator": "ttft", "objective": "percentile", "threshold_s": 20.0,
                "percentile": 0.9, "min_requests": 3},
           ]}]}
    f = tmp_path / "guard.yaml"
    f.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    again = vs.scrape(server.metrics_url)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    count = _contract_total(again, c.REQUEST_TTFT.series("_count"))
    assert count == _contract_total(after, c.REQUEST_TTFT.series("_count")) >= n0 + n  # no traffic in between
    ttft = _contract_total(again, c.REQUEST_TTFT.series("_sum")) / count
    tpot = _contract_total(again, c.REQUEST_TPOT.series("_sum")) / _contract_total(
        again, c.REQUEST_TPOT.series("_count"))
    rows = {ln.split()[2]: ln for ln in r.stdout.splitlines()[1:] if ln.startswith(vs.MODEL_NAME)}
    assert set(rows) == {"ttft_mean", "tpot_mean", "ttft_p90"}, r.stdout

    def shown(v: float) -> str:
        return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"

    assert shown(ttft) in rows["ttft_mean"], (r.stdout, ttft)
    assert shown(tpot) in rows["tpot_mean"], (r.stdout, tpot)
    assert re.search(rf"\b{int(count)}\b", rows["ttft_mean"]), r.stdout
    assert "mixed" in rows["ttft_mean"] and "since engine start" in rows["ttft_mean"]
    expect = "violated" if ttft > 2.5 else "ok"
    assert expect in rows["ttft_mean"], r.stdout
