"""``bench_policies.py --seeds`` adds tuning cells and must never reach the sealed seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_policies as bp

from sla_guard.sim.workloads import SEALED_SEEDS, suite


@pytest.mark.parametrize("argv", [["--split", "sealed", "--seeds", "2"],
                                  ["--split", "tuning", "--seeds", "2", str(SEALED_SEEDS[0])]])
def test_seeds_refuse_the_sealed_half(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bp.main([*argv, "--policies", "guard", "--no-static"])
    assert e.value.code == 2
    assert "sealed" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--split", "sealed", "--seeds", "810"],
                                  ["--split", "tuning", "--seeds", "810", "907"]])
def test_blind_seeds_refuse_the_blind_sealed_half(argv, capsys):
    """The blind generator's --seeds add tuning-more cells (800-899); its sealed seeds are 900-999."""
    with pytest.raises(SystemExit) as e:
        bp.main(["--generator", "blind", *argv, "--policies", "guard", "--no-static"])
    assert e.value.code == 2
    assert "sealed" in capsys.readouterr().err


def test_more_seeds_give_new_generated_cells_only():
    more = suite("tuning", seeds=(2, 3), traces=False)
    base = suite("tuning")
    assert {w.seed for w in more} == {2, 3}
    assert not {w.name for w in more} & {w.name for w in base}
    assert all(not w.family.startswith("trace_") for w in more)


def test_gpu_hours_until_the_last_arrival_leave_the_drain_out():
    # 2 replicas from 0 s, 4 from 1800 s, 1 from 3700 s; 16 GPUs each; trace ends at 3600 s
    timeline = [(0.0, 1, 1, 1, 1), (1800.0, 3, 1, 3, 1), (3700.0, 1, 0, 1, 0)]
    assert bp.gpu_hours_until(timeline, 3600.0, 16) == pytest.approx((2 * 1800 + 4 * 1800) * 16 / 3600)
    assert bp.gpu_hours_until(timeline, 900.0, 16) == pytest.approx(2 * 900 * 16 / 3600)
    # past the last change the last count holds
    assert bp.gpu_hours_until(timeline, 4300.0, 1) == pytest.approx((2 * 1800 + 4 * 1900 + 1 * 600) / 3600)


def test_checks_repeat_the_baseline_test_on_the_trace_window():
    guard = {"policy": "guard", "attainment": 0.48, "gpu_hours": 160.0, "gpu_hours_trace": 117.0,
             "reversals": 0, "aborted": 0}
    keda = {"policy": "keda-hpa", "attainment": 0.49, "gpu_hours": 144.0, "gpu_hours_trace": 120.0,
            "reversals": 0, "aborted": 0}
    ck = bp.checks([keda, guard], None, 8.0)
    assert ck["dominated_by"] == ["keda-hpa"] and ck["dominated_in_trace_by"] == []
    assert not ck["pass"]  # the checks keep the whole run
