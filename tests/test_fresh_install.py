"""A new user's first two commands, `pip install .` then `sla-guard demo`, in a fresh venv.

Why: the demo once found its trace next to this repository and died on a missing matplotlib after
the whole run. Here the package is installed non-editable (declared dependencies only, fetched by
pip: PyPI or PIP_FIND_LINKS, pip's cache reused) and run from a directory that is not the repo, so
anything the product takes from its surroundings instead of its own package shows up as a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a fresh clone does not have: local venvs, build outputs, caches, earlier demo output.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                        ".pytest_cache", ".ruff_cache", ".cache", "out", "reports")
PLOTS_HINT = "pip install 'sla-guard[report]'"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _clean_env(venv: Path) -> dict[str, str]:
    """The caller's environment minus anything that would let the repo or its venv leak in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.slow
def test_pip_install_then_demo_outside_the_repo(tmp_path: Path) -> None:
    t0 = time.monotonic()
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=NOT_IN_A_CLONE)  # pip builds in-tree: keep the repo's tree untouched
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = _clean_env(venv)
    work = tmp_path / "elsewhere"
    work.mkdir()

    inst = _run([str(venv / "bin" / "pip"), "install", str(src)], work, env, timeout=900)
    assert inst.returncode == 0, f"pip install failed:\n{inst.stdout[-3000:]}\n{inst.stderr[-3000:]}"
    t_install = time.monotonic() - t0

    where = _run([str(venv / "bin" / "python"), "-c",
                  "import importlib.util as u, sla_guard; print(sla_guard.__file__);"
                  "print(u.find_spec('matplotlib') is not None)"], work, env, timeout=60)
    assert where.returncode == 0, where.stderr
    module_file, has_mpl = where.stdout.split()
    assert Path(module_file).is_relative_to(venv), f"sla_guard imported from {module_file}, not the fresh venv"

    out = work / "report"
    demo = _run([str(venv / "bin" / "sla-guard"), "demo", "--duration", "6", "--speed", "300",
                 "--scrape-interval", "15", "--out", str(out)], work, env, timeout=300)
    text = demo.stdout + demo.stderr
    assert demo.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "trace mooncake_conversation_trace.jsonl.gz" in demo.stdout  # the trace shipped in the wheel
    report = (out / "report.md").read_text()
    assert "## Guard verdicts at the end" in report and "glm-5.2/decode" in report
    assert f"report: {out / 'report.md'}" in demo.stdout
    pngs = sorted(p.name for p in out.glob("*.png"))
    if has_mpl == "True":  # only if matplotlib became a core dependency
        assert len(pngs) == 5 and PLOTS_HINT not in report
    else:
        # no plots, and the user is told why and how to get them, once on stderr and in the report
        assert pngs == []
        assert PLOTS_HINT in report and "## Plots" in report
        assert demo.stderr.count(PLOTS_HINT) == 1, demo.stderr
    print(f"fresh install {t_install:.1f} s, total {time.monotonic() - t0:.1f} s")
