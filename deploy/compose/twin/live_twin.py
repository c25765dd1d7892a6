"""The simulated P/D deployment (sla_guard.sim) run in wall-clock time, every replica's contract
metrics on its own /metrics port: the `twin` profile of docker-compose.yml, and the engines of the
end-to-end Prometheus test.

Simulated time follows the wall clock (``run_until(elapsed)`` every ``step_s``); the agentic trace
is resubmitted when it runs out, so the twin serves traffic until stopped. Replica i listens on
``port_base + i`` (prefill replicas first, then the proxy), or on a free port when ``port_base`` is 0.

    python deploy/compose/twin/live_twin.py --listen 0.0.0.0 --port-base 9400
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
import time

from sla_guard.sim.deployment import Deployment
from sla_guard.sim.exposition import MetricsServer
from sla_guard.sim.faults import FaultSchedule
from sla_guard.sim.profile import load_profile
from sla_guard.sim.traces import agentic_sessions


class LiveTwin:
    def __init__(self, *, profile: str = "default", prefill: int = 2, decode: int = 2, sessions: int = 100,
                 time_scale: float = 0.25, base_context: int = 4000, seed: int = 1, host: str = "127.0.0.1",
                 port_base: int = 0, faults: FaultSchedule | None = None, step_s: float = 0.1) -> None:
        self.dep = Deployment(load_profile(profile), prefill=prefill, decode=decode, seed=seed, faults=faults)
        self.trace = agentic_sessions(n_sessions=sessions, duration_s=240 / time_scale, seed=seed,
                                      base_context=base_context).scaled(time_scale)
        self.step_s = step_s
        self.servers = [MetricsServer(lambda r=r: r.metrics if r.state in ("ready", "draining") else None,
                                      host=host, port=port_base + i if port_base else 0)
                        for i, r in enumerate(self.dep.replicas)]
        # the P/D proxy's client scope (pool="client") on the next port
        port = port_base + len(self.servers) if port_base else 0
        self.servers.append(MetricsServer(lambda: self.dep.proxy.metrics, host=host, port=port))
        self.targets = [f"{host}:{s.port}" for s in self.servers]
        self.pools = [r.pool for r in self.dep.replicas] + [self.dep.proxy.pool]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-twin")

    def _run(self) -> None:
        t0, offset = time.monotonic(), 0.0
        span = max(self.trace.duration_s, 1.0)
        self.dep.submit(self.trace, offset)
        while not self._stop.is_set():
            now = time.monotonic() - t0
            if now > offset + span - 10:
                offset += span
                self.dep.submit(self.trace, offset)
            self.dep.run_until(now)
            self.dep.sample_processes()
            self._stop.wait(self.step_s)

    def start(self) -> LiveTwin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self.servers:
            s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--port-base", type=int, default=9400)
    p.add_argument("--profile", default="default", help="sim profile name or YAML path")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--sessions", type=int, default=100)
    args = p.parse_args(argv)
    twin = LiveTwin(profile=args.profile, prefill=args.prefill, decode=args.decode, sessions=args.sessions,
                    host=args.listen, port_base=args.port_base).start()
    print("serving", " ".join(f"http://{t}/metrics" for t in twin.targets), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    twin.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
