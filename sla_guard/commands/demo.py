"""`sla-guard demo`: a simulated 2P2D deployment replaying a real trace at accelerated speed, with
a host-RSS leak and a speculative-decoding acceptance drift injected, guarded live; ends with a
report directory (Markdown + PNG plots; the plots need matplotlib: pip install 'sla-guard[report]')."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from sla_guard.commands import number

MAX_SIMULATED_S = 24 * 3600.0
# the surge's extra copies of every request are submitted up front: --surge 1e300 grew by 1.4 GB in
# 20 s and never ended, and 100 ran a 2 s demo for 33 s
MAX_SURGE = 10.0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="simulated 2P2D deployment with injected faults, guarded live; writes a report",
                       description=__doc__)
    # finite and in range at parse time: --speed inf, --duration nan and --scrape-interval 0 were
    # tracebacks; --drift-to -1 or --leak-mib-per-hour -100 ran a story no engine can tell
    p.add_argument("--duration", type=number(0), default=90.0, help="wall-clock seconds to run (default 90)")
    p.add_argument("--speed", type=number(0), default=120.0,
                   help="simulated seconds per wall second (default 120: three simulated hours in 90 s)")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="report directory (default ./out/demo)")
    p.add_argument("--trace", default=None,
                   help="trace file (default: the Mooncake FAST'25 conversation trace bundled with sla-guard)")
    p.add_argument("--profile", default="default", help="simulator profile (default: GLM-5.2 on H200, DEP16)")
    p.add_argument("--policy", default="guard",
                   help="scaling policy acting on the deployment (default guard: the advisor at work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leak-mib-per-hour", type=number(0, above=False), default=200.0,
                   help="RSS leak injected into the decode EngineCores (default 200; the leak in 'From Day 0 "
                        "to Production SLAs' (DaoCloud) was ~48; 0 = none)")
    p.add_argument("--surge", type=number(1, above=False), default=2.0,
                   help="arrival-rate factor of the load surge over the second sixth of the run "
                        "(default 2; 1 = none; at most 10)")
    p.add_argument("--drift-to", type=number(0, above=False), default=0.4,
                   help="acceptance falls to this fraction of its profile value (default 0.4; 1 = none)")
    p.add_argument("--scrape-interval", type=number(0), default=30.0, help="simulated seconds between scrapes")
    p.add_argument("--no-http", action="store_true", help="scrape in-process instead of over loopback HTTP")
    p.add_argument("--quiet", action="store_true", help="no live status lines")
    return p


def default_trace() -> str:
    """The trace shipped inside the package, so the demo behaves the same from any directory."""
    from sla_guard.sim.traces import BUNDLED_MOONCAKE

    return str(BUNDLED_MOONCAKE)


def demo_faults(sim_s: float, leak_mib_h: float, drift_to: float, surge: float = 1.0) -> list[dict]:
    """The demo's schedule, scaled to the simulated span: a leak from 5% of the run in the
    EngineCore of both decode replicas of the 2P2D start (a leak is in the code every replica
    runs; and the advisor may give either one back before the onset: it drains the less loaded),
    a load surge over the second sixth (``surge`` x the arrivals), an acceptance drift over the
    middle third on every decode replica. A fault that would inject nothing (a 0 MiB/h leak, a drift
    to 1x) is left out: the report listed it as injected, and a run without faults told a story."""
    out = [{"kind": "leak", "replica": name, "role": "engine_core", "mib_per_hour": leak_mib_h,
            "start_s": round(0.05 * sim_s, 1)} for name in ("d0", "d1") if leak_mib_h > 0]
    if surge > 1.0:
        out.append({"kind": "load_spike", "start_s": round(sim_s / 6, 1), "end_s": round(sim_s / 3, 1),
                    "factor": surge})
    if drift_to != 1.0:
        out.append({"kind": "acceptance_drift", "start_s": round(sim_s / 3, 1), "end_s": round(2 * sim_s / 3, 1),
                    "to_factor": drift_to})
    return out


def run(args: argparse.Namespace) -> int:
    from sla_guard.sim.deployment import Deployment
    from sla_guard.sim.faults import FaultSchedule
    from sla_guard.sim.harness import ClosedLoop, make_store
    from sla_guard.sim.live import LiveEndpoints, Pacer
    from sla_guard.sim.policy import get_policy
    from sla_guard.sim.profile import ProfileError, load_profile
    from sla_guard.sim.report import plots_unavailable, write_report
    from sla_guard.sim.run import build_guard
    from sla_guard.sim.run import detectors as replay_detectors
    from sla_guard.sim.traces import TraceError, load_trace

    sim_s = args.duration * args.speed
    if sim_s > MAX_SIMULATED_S:  # the whole span's arrivals are submitted up front: memory grows with it
        print(f"sla-guard demo: --duration x --speed is {sim_s / 3600:.3g} simulated hours, over the demo's "
              f"{MAX_SIMULATED_S / 3600:g}; lower --speed or --duration (sla-guard replay runs longer traces)",
              file=sys.stderr)
        return 2
    if args.surge > MAX_SURGE:
        print(f"sla-guard demo: --surge {args.surge:g} is over {MAX_SURGE:g}, the most the paced demo keeps up with; "
              f"sla-guard replay --fault '{{\"kind\": \"load_spike\", ...}}' runs larger surges", file=sys.stderr)
        return 2
    trace_path = args.trace or default_trace()
    try:
        profile = load_profile(args.profile)
        trace = load_trace(trace_path)
        policy = get_policy(args.policy)
    except (ProfileError, TraceError, ValueError) as err:
        print(f"sla-guard demo: {err}", file=sys.stderr)
        return 2
    try:  # before the run, as replay does: a file there was a traceback after minutes, the report lost
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".sla-guard-demo-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        print(f"sla-guard demo: --out {args.out}: cannot write the report there: {err.strerror or err}; "
              f"name a writable directory", file=sys.stderr)
        return 2
    faults = demo_faults(sim_s, args.leak_mib_per_hour, args.drift_to, args.surge)
    dep = Deployment(profile, 2, 2, seed=args.seed, faults=FaultSchedule(faults),
                     trace_block_tokens=trace.block_tokens)
    span = max(trace.duration_s, 1.0)
    stride = trace.max_hash() + 1
    for k in range(math.ceil(sim_s / span)):  # loop the trace (new prefixes each pass) to cover the run
        dep.submit(trace.scaled(duration_s=sim_s - k * span).with_hash_offset(k * stride), offset_s=k * span)
    store = make_store(retention_s=sim_s + 3600, interval_s=args.scrape_interval)
    # detectors' warm-ups shortened to fit the run (their defaults learn baselines for an hour)
    detectors, book = replay_detectors(min(900.0, sim_s / 4), min(5400.0, sim_s / 4))
    guard = build_guard(store, dep.slo_ttft_s, dep.slo_tpot_s, args.scrape_interval, detectors)
    live = None if args.no_http else LiveEndpoints(dep)
    loop = ClosedLoop(dep, store=store, policy=policy, guard=guard, fetch=live.fetch if live else None,
                      scrape_interval_s=args.scrape_interval, eval_interval_s=args.scrape_interval,
                      findings=book.open_findings)
    tty = sys.stdout.isatty()
    if not args.quiet:
        where = f"{len(live.servers)} engines on http://127.0.0.1 ports " + ", ".join(
            str(s.port) for s in live.servers.values()) if live else "in-process scraping"
        print(f"sla-guard demo: 2P2D `{profile.model}` ({profile.name}), trace {Path(trace_path).name}, "
              f"{sim_s / 60:.0f} simulated min at {args.speed:g}x; {where}")
        print(f"faults: {json.dumps(faults)}")

    def status(sim_now: float, wall: float) -> None:
        if args.quiet:
            return
        h = loop.history[-1].values if loop.history else {}
        slo = guard.evaluator("slo")
        verdict = slo.overall().value if slo is not None and slo.evaluated_at else "-"

        def f(key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
            return fmt.format(h[key] * scale) if key in h else "-"

        line = (f"[{wall:5.1f}s] sim {int(sim_now // 3600)}:{int(sim_now % 3600 // 60):02d}:{int(sim_now % 60):02d} "
                f"| P {dep.pool_counts('prefill')['ready']} D {dep.pool_counts('decode')['ready']} "
                f"| TTFT p {f('prefill_ttft_mean')}s d {f('decode_ttft_mean')}s "
                f"| TPOT {f('decode_tpot_mean', 1000, '{:.1f}')}ms | accept {f('acceptance')} "
                f"| done {len(dep.done)} | guard {verdict} | findings {len(book.open_findings())}")
        print(("\r" + line + "   ") if tty else line, end="" if tty else "\n", flush=True)

    t0 = time.monotonic()
    try:
        Pacer(dep, args.speed).run(sim_s, status, progress_s=2.0 if not tty else 0.5)
    except KeyboardInterrupt:
        print("\ninterrupted; writing the report for what ran", file=sys.stderr)
    finally:
        if live is not None:
            live.close()
    wall = time.monotonic() - t0
    if tty and not args.quiet:
        print()
    summary = dep.summary()
    slo = guard.evaluator("slo")
    findings = [{"detector": f.detector, "severity": f.severity, "summary": f.summary,
                 "opened_min": round((f.opened_at - dep.epoch) / 60, 1), "open": f.open,
                 "engine": f.labels.get("engine") or f.labels.get("instance") or "",
                 "resolved_min": None if f.open else round((f.resolved_at - dep.epoch) / 60, 1),
                 "resolution": str(f.details.get("resolution") or "")}
                for f in sorted(book.all() if book is not None else [], key=lambda f: f.opened_at)]
    report = write_report(args.out, dep=dep, summary=summary, history=loop.history, store=store,
                          guard_status=slo.snapshot() if slo is not None else None, findings=findings,
                          faults=faults, actions=loop.actions,
                          decisions=getattr(policy, "decisions", None),
                          recommended=getattr(policy, "recommended", None),
                          meta={"topology": "2P2D", "trace": Path(trace_path).name, "speed": args.speed,
                                "wall_s": wall, "http": live is not None, "policy": args.policy,
                                "eval_interval_s": args.scrape_interval})
    if (no_plots := plots_unavailable()) is not None:
        print(f"sla-guard demo: {no_plots}", file=sys.stderr)
    print(f"guard verdict: {slo.overall().value if slo is not None else 'n/a'}; SLO attainment "
          f"{summary.slo_attainment:.2%} over {summary.requests} requests; report: {report}")
    return 0
