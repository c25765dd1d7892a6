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


def test_more_seeds_give_new_generated_cells_only():
    more = suite("tuning", seeds=(2, 3), traces=False)
    base = suite("tuning")
    assert {w.seed for w in more} == {2, 3}
    assert not {w.name for w in more} & {w.name for w in base}
    assert all(not w.family.startswith("trace_") for w in more)
