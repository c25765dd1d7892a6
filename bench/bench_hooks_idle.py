"""What the plugin costs a REAL CPU vLLM engine outside its hot path: CPU while idle, and the
longest gap between streamed tokens under load, with the sla-guard plugin and without it, side by
side.

Two servers of the tiny model (ngram speculative decoding, as the tests' shared engine) run at the
same time, one with every vLLM plugin disabled (``VLLM_PLUGINS=""``, the baseline) and one with
sla-guard's hooks, so machine noise falls on both alike. Idle: CPU seconds of each whole process
tree (API server, EngineCore, worker) over ``--idle-s`` seconds, after a warm-up. Load: rounds
alternate between the two servers; each streams ``--requests`` completions one after another and
records the gaps between token chunks as the client reads them. Printed: idle CPU as % of one
core and the ratio plugin / baseline (goal: <= 2), and the p99 and max token gap and their ratios
(goal: p99 <= 1.2; the max, about 1 s on both sides here, is vLLM's own and only shown).

Why: until 2026-12 the process sampler read ``gc.get_freeze_count()`` every 5 s, a ~250 ms
walk under the GIL in each frozen vLLM process; this script measured, before / after that fix:
idle CPU 9.70 vs 0.87 % (ratio 11.2) / 1.23 vs 0.83 % (1.48), token gap p99 14.3 vs 5.0 ms
(2.86) / 4.0 vs 6.0 ms (0.67). See exporters/process_sampler.py.

    .venv/bin/python bench/bench_hooks_idle.py [--idle-s 30] [--rounds 4] [--requests 6]

Runs from the project venv (vLLM runs as subprocesses in .venv-vllm, like the tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import vllm_support as vs  # noqa: E402

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})


def tree_cpu_s(pid: int) -> float:
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    reason = vs.vllm_unavailable_reason()
    if reason:
        print(f"bench_hooks_idle: skipped, {reason}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-hooks-idle-"))
    model = vs.build_tiny_model(tmp / "tiny")
    servers = {
        "baseline": vs.start_server(model, extra_args=["--speculative-config", SPEC], env={"VLLM_PLUGINS": ""},
                                    log_dir=tmp, wait=False),
        "plugin": vs.start_server(model, extra_args=["--speculative-config", SPEC], log_dir=tmp, wait=False),
    }
    try:
        for s in servers.values():
            vs.wait_healthy(s)
        for s in servers.values():  # warm-up, then let the start-up settle
            vs.complete(s.base_url, "warm up " * 20, max_tokens=32)
        time.sleep(10)
        before = {k: tree_cpu_s(s.pid) for k, s in servers.items()}
        t0 = time.monotonic()
        time.sleep(args.idle_s)
        span = time.monotonic() - t0
        idle = {k: 100 * (tree_cpu_s(s.pid) - before[k]) / span for k, s in servers.items()}
        gaps: dict[str, list[float]] = {k: [] for k in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for k in order:
                for i in range(args.requests):
                    gaps[k] += vs.stream_token_gaps(servers[k].base_url, f"round {r} request {i} " + "a b c d " * 40,
                                          args.max_tokens)
    finally:
        for s in servers.values():
            s.stop()
    p99 = {k: float(np.percentile(v, 99)) for k, v in gaps.items()}
    mx = {k: float(np.max(v)) for k, v in gaps.items()}
    print(f"idle CPU (% of one core, {args.idle_s:.0f} s): baseline {idle['baseline']:.2f}  plugin {idle['plugin']:.2f}"
          f"  ratio {idle['plugin'] / max(idle['baseline'], 1e-9):.2f} (goal <= 2)")
    print(f"token gap p99 (ms): baseline {1e3 * p99['baseline']:.1f}  plugin {1e3 * p99['plugin']:.1f}"
          f"  ratio {p99['plugin'] / p99['baseline']:.2f} (goal <= 1.2)")
    print(f"token gap max (ms): baseline {1e3 * mx['baseline']:.1f}  plugin {1e3 * mx['plugin']:.1f}"
          f"  ratio {mx['plugin'] / mx['baseline']:.2f}")
    print(json.dumps({"idle_cpu_pct": idle, "gap_p99_s": p99, "gap_max_s": mx,
                      "gaps": {k: len(v) for k, v in gaps.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
