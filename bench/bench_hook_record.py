"""Cost of the sla-guard stat logger's record() per engine step vs vLLM's own PrometheusStatLogger.

Both loggers get the SAME replayed stream of vLLM's real stats objects (SchedulerStats with
prefix-cache and spec-decode stats, IterationStats with TTFT/ITL lists, FinishedRequestStats),
built from a real VllmConfig (tiny Llama dir, ngram speculative decoding, created with
EngineArgs.create_engine_config, no engine started). Each logger is timed over the whole stream,
alternating several rounds to even out noise; the script prints microseconds per step and the
ratio hook / vLLM (goal: <= 0.5).

Runs inside .venv-vllm; started from the project venv it re-executes itself there:

    .venv/bin/python bench/bench_hook_record.py [--steps 20000] [--rounds 5] [--batch 16] [--otel]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def reexec_in_vllm_venv() -> int:
    if not VLLM_PYTHON.exists():
        print(f"bench_hook_record: skipped, no vLLM venv at {VLLM_PYTHON.parent.parent}")
        return 0
    return subprocess.call([str(VLLM_PYTHON), __file__, *sys.argv[1:]], cwd=REPO)


def vllm_config(model_dir: Path):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), served_model_name=["tiny"], load_format="dummy", dtype="float32",
                      enforce_eager=True, max_model_len=2048,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    return args.create_engine_config()


def stream(steps: int, batch: int, seed: int = 0) -> list:
    """A decode-heavy serving pattern: ``batch`` running requests, one finishing and one arriving
    every 32 steps per slot on average, spec decode on every step."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    rng = random.Random(seed)
    out = []
    for step in range(steps):
        s = SchedulerStats(num_running_reqs=batch, num_waiting_reqs=rng.randint(0, 4), kv_cache_usage=rng.random(),
                           step_counter=step, prefix_cache_stats=PrefixCacheStats(queries=rng.choice((0, 256)),
                                                                                  hits=rng.choice((0, 128))))
        sd = SpecDecodingStats.new(3)
        for _ in range(batch):
            sd.observe_draft(3, rng.randint(0, 3))
        s.spec_decoding_stats = sd
        it = IterationStats()
        it.num_generation_tokens = batch * 2
        it.inter_token_latencies_iter = [rng.uniform(0.005, 0.04) for _ in range(batch)]
        if step % 2 == 0:
            it.time_to_first_tokens_iter = [rng.uniform(0.05, 3.0)]
            it.prompt_token_stats.computed = 512
            it.prompt_token_stats.local_cache_hit = 128
            it.finished_requests = [FinishedRequestStats(
                finish_reason=FinishReason.LENGTH, request_id=f"r{step}", e2e_latency=rng.uniform(0.5, 8),
                num_prompt_tokens=640, num_generation_tokens=128, queued_time=0.01, prefill_time=0.2,
                inference_time=3.0, decode_time=2.8, mean_time_per_output_token=0.022, num_cached_tokens=128)]
        out.append((s, it))
    return out


def time_logger(logger, steps: list) -> float:
    """Wall time of the stream through record(), plus the hook's final flush: its flush thread runs
    concurrently (same GIL), so the batched export work is inside the measured time too."""
    record = logger.record
    t0 = time.perf_counter()
    for s, it in steps:
        record(s, it, None, 0)
    flush = getattr(logger, "flush", None)
    if flush is not None:
        flush()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--otel", action="store_true",
                    help="also mirror to OTLP (records into the OTel SDK; exports go to a closed port)")
    a = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return reexec_in_vllm_venv()
    os.environ.setdefault("SLA_GUARD_DISABLE_SAMPLER", "1")  # measure record(), not the sampler thread
    if a.otel:
        os.environ.update(SLA_GUARD_OTLP_ENDPOINT="http://127.0.0.1:9", SLA_GUARD_OTLP_EXPORT_INTERVAL_S="3600",
                          SLA_GUARD_OTLP_TIMEOUT_S="0.2")
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_support
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from engine_hooks.stat_logger import SlaGuardStatLogger
    from exporters.process_sampler import DEFAULT_INTERVAL_S, take_snapshot, write_snapshot

    with tempfile.TemporaryDirectory() as tmp:  # the per-process sampler (measured before any thread runs)
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            write_snapshot(Path(tmp), take_snapshot())
        per = (time.perf_counter() - t0) / n
    share = per / DEFAULT_INTERVAL_S * 100
    sampler_line = (f"  process sampler                  : {per * 1e6:8.1f} us/sample, "
                    f"every {DEFAULT_INTERVAL_S:.0f} s = {share:.4f} % of one core per process")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = vllm_config(vllm_support.build_tiny_model(Path(tmp) / "tiny", Path(sys.executable)))
    ours, theirs = SlaGuardStatLogger(cfg, [0]), PrometheusStatLogger(cfg, [0])
    steps = stream(a.steps, a.batch)
    time_logger(ours, steps[:1000])  # warm both (child creation, caches)
    time_logger(theirs, steps[:1000])
    t_ours, t_theirs = [], []
    for _ in range(a.rounds):
        t_theirs.append(time_logger(theirs, steps))
        t_ours.append(time_logger(ours, steps))
    best_ours, best_theirs = min(t_ours) / a.steps * 1e6, min(t_theirs) / a.steps * 1e6
    print(f"steps={a.steps} batch={a.batch} rounds={a.rounds} otel={'on' if a.otel else 'off'} "
          "(best round; spec decode on, 1 finished req / 2 steps)")
    print(f"  vLLM PrometheusStatLogger.record : {best_theirs:8.2f} us/step")
    print(f"  sla-guard SlaGuardStatLogger.record: {best_ours:8.2f} us/step")
    print(f"  ratio hook / vLLM                : {best_ours / best_theirs:8.3f}  (goal <= 0.5)")
    print(sampler_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
