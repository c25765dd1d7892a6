"""The leak detector against REAL CPU vLLM: a healthy engine's EngineCore RSS gives "no leak";
an engine with a test-only general plugin that grows a list on every engine step, after
gc.freeze(), gives "leak".

Time scale: the detector runs with its production parameters compressed in time by
``SCALE`` (``LeakParams().scaled(SCALE)``: every duration / SCALE, slope thresholds * SCALE;
byte thresholds, z threshold, step and plateau tests unchanged). A test cannot wait the 2.5 h a
production verdict needs, so 1 s of this test stands for SCALE s of production. In those units
the plugin's leak (32 KiB per engine step, on the order of 1-3 MiB/s under the load below, i.e.
tens to hundreds of MiB/min) corresponds to a production leak of ~(1-3 MiB/s)/SCALE*3600 =
60-180 MiB/h, the order of the 48 MiB/h target. The healthy engine is judged by the same scaled
detector over the same duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import vllm_support as vs

from exporters import contract as c
from sla_guard.detect import leak

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCALE = 60.0  # 2 h short window -> 120 s; 90 min warm-up -> 90 s; 5 min floor bucket -> 5 s
PARAMS = leak.LeakParams().scaled(SCALE)
# 90 s of warm-up, then >= 15 floor buckets: Mann-Kendall z >= 5 (issue 16) needs 15 points even for a
# perfectly monotone series (at 12, max z = 4.5)
LOAD_S = 180.0
# The leaking engine is driven until the detector fires or this deadline passes. A scrape of a loaded
# engine takes ~1-3 s on this host and longer when the whole suite shares its 2 cores, so a fixed
# LOAD_S left some 5 s floor buckets empty and the verdict short of its 15 points (CI, session 8:
# 'not_significant' at 287 MiB/min of growth). 420 s stands for 7 h of production time.
LEAK_DEADLINE_S = 420.0
PLUGIN_SRC = Path(__file__).resolve().parent / "plugins" / "sla_guard_test_leak"


def _drive_and_sample(
    server: vs.VllmServer, seconds: float, stop: Callable[[np.ndarray, np.ndarray], bool] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Keep 4 requests in flight while sampling EngineCore RSS from /metrics every second, for
    ``seconds`` or until ``stop(t, v)`` says the series already answers the question."""
    ts, vals = [], []
    t_end = time.time() + seconds
    with vs.background_load(server) as errors:
        while time.time() < t_end:
            got = vs.select(vs.scrape(server.metrics_url), c.PROCESS_RSS.series(), role="engine_core")
            if got:
                ts.append(time.time())
                vals.append(max(got.values()))
                if stop is not None and stop(np.asarray(ts), np.asarray(vals)):
                    break
            time.sleep(max(0.0, 1.0 - (time.time() - ts[-1])) if ts else 1.0)
    assert len(errors) < 10, errors[:3]
    return np.asarray(ts), np.asarray(vals)


def test_real_engine_rss_is_not_a_leak(vllm_spec_engine):
    t, v = _drive_and_sample(vllm_spec_engine, LEAK_DEADLINE_S, _judged_enough)
    assert len(t) > 10, "EngineCore RSS was not exported"
    verdict = leak.assess(t, v, PARAMS)
    growth_mib = (v[-10:].min() - v[:10].min()) / 2**20
    assert verdict.status == "ok", (verdict.as_dict(), growth_mib)
    assert not any(ver.detected for _, ver in leak.scan(t, v, PARAMS))


def _detected(t: np.ndarray, v: np.ndarray) -> bool:
    """Stop sampling at the first leak verdict (checked at most once per floor bucket is enough,
    but a scan of a few hundred points costs milliseconds)."""
    return t[-1] - t[0] >= LOAD_S / 2 and leak.first_detection(leak.scan(t, v, PARAMS)) is not None


def _judged_enough(t: np.ndarray, v: np.ndarray) -> bool:
    """The healthy engine is watched for LOAD_S and then until 6 floor buckets have been judged, so
    a slow host cannot turn the "ok" into one made on too few points."""
    if t[-1] - t[0] < LOAD_S:
        return False
    return sum(ver.status != "unknown" for _, ver in leak.scan(t, v, PARAMS)) >= 6


@pytest.fixture
def leak_plugin_path(tmp_path, vllm_venv_python) -> Path:
    """pip-install the test plugin distribution (--no-deps) into a private directory; only the
    server started with it on PYTHONPATH sees it, so no other test (or helper) can load it."""
    target = vs.install_test_plugin(PLUGIN_SRC, tmp_path, vllm_venv_python)
    assert (target / "sla_guard_test_leak").is_dir()
    return target


def test_step_leak_after_gc_freeze_is_detected(vllm_server_factory, leak_plugin_path, tmp_path):
    mark = tmp_path / "leak-mark"
    server = vllm_server_factory(env={"PYTHONPATH": str(leak_plugin_path),
                                      "SLA_GUARD_TEST_LEAK_MARK": str(mark),
                                      "SLA_GUARD_TEST_LEAK_BYTES_PER_STEP": "32768"})
    try:
        t, v = _drive_and_sample(server, LEAK_DEADLINE_S, _detected)
    finally:
        server.stop()
    freeze_count = int(mark.read_text().split()[0])
    assert freeze_count > 0, "growth should start after EngineCore's gc.freeze()"
    verdicts = leak.scan(t, v, PARAMS)
    first = leak.first_detection(verdicts)
    growth_mib_min = (v[-10:].min() - v[:10].min()) / 2**20 / ((t[-1] - t[0]) / 60)
    assert first is not None, ([ver.reason for _, ver in verdicts[-5:]], growth_mib_min, len(t), t[-1] - t[0])
    ver = first[1]
    assert ver.slope_mib_per_h / SCALE > 10, ver.as_dict()  # production-equivalent MiB/h
