"""Simulator vs REAL CPU vLLM on the same request mix (short version of bench/fidelity.py).

The bench holds the +-20% target on a quiet machine; here, on a shared CI runner, the test checks
the calibrated simulator lands within a factor of 2 of the real P/D pair on TTFT and TPOT medians,
which a wrong model (e.g. per-request instead of per-token prefill cost, or no batching in decode)
would miss by far more.
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


def test_simulator_tracks_real_vllm(pd_pair):
    rng = random.Random(3)
    cal = asyncio.run(fidelity.calibrate(pd_pair, rng))
    profile = fidelity.fitted_profile(cal)
    # the fit is physical: costs grow with prompt length and with decode batch
    assert profile.prefill.per_token_s > 0 and profile.decode.step_base_s > 0
    mix = fidelity.request_mix(random.Random(4), 16, 0.6)
    real, real_samples = asyncio.run(fidelity.run_real(pd_pair, mix, rng))
    sim, sim_samples = fidelity.run_sim(profile, mix)
    assert len(real) == len(sim) == 16
    r, s = fidelity.pct([x["e2e"] for x in real], 0.5), fidelity.pct([x["e2e"] for x in sim], 0.5)
    assert 0.5 < s / r < 2.0, ("e2e", r, s)
    for pool, metric in (("prefill", c.REQUEST_TTFT), ("decode", c.REQUEST_TPOT)):
        r = fidelity.engine_quantile(real_samples[pool], metric, 0.5)
        s = fidelity.engine_quantile(sim_samples[pool], metric, 0.5)
        assert 0.5 < s / r < 2.0, (pool, metric.name, r, s)
