"""The simulated deployment on real loopback ports, paced against the wall clock.

``LiveEndpoints`` gives every replica its own ``/metrics`` server (opened when the replica is
created, 503 while it starts or after a crash, closed when it is scaled away), and the P/D proxy
one for the client scope (``pool="client"``), so a real Prometheus or the guard's scraper can
target the simulated engines and proxy like real ones.
``Pacer`` advances simulated time at ``speed`` x wall time. With speed 1 the exposition is
indistinguishable from live engines (Prometheus stamps samples at scrape time); with speed > 1
drive the guard at simulated time (``harness.scrape_into`` with an HTTP ``fetch``).

Example (a real Prometheus scraping a simulated 2P2D for a minute)::

    dep = Deployment(load_profile("default"), 2, 2)
    dep.submit(load_trace("mooncake.jsonl"))
    with LiveEndpoints(dep) as ep:
        dep.every(5, lambda d, now: d.sample_processes(), start_s=0)
        Pacer(dep, speed=1.0).run(60)          # ep.targets() -> [(url, labels), ...]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from sla_guard.sim.deployment import STOPPED, Deployment, Replica
from sla_guard.sim.exposition import MetricsServer


class LiveEndpoints:
    def __init__(self, dep: Deployment, host: str = "127.0.0.1") -> None:
        self.dep = dep
        self.host = host
        self.servers: dict[str, MetricsServer] = {}
        self._client = httpx.Client(timeout=5.0)
        self._sync(dep)
        dep.listeners.append(self._sync)

    def _members(self) -> tuple:
        return (*self.dep.replicas, self.dep.proxy)

    def _sync(self, dep: Deployment) -> None:
        for r in self._members():
            if r.state == STOPPED:
                srv = self.servers.pop(r.name, None)
                if srv is not None:
                    srv.close()
            elif r.name not in self.servers:
                self.servers[r.name] = MetricsServer(lambda r=r: r.metrics, self.host)

    def url(self, replica: Replica | str) -> str | None:
        name = replica if isinstance(replica, str) else replica.name
        srv = self.servers.get(name)
        return srv.url if srv else None

    def targets(self) -> list[tuple[str, dict[str, str]]]:
        """(url, labels) of every live endpoint, e.g. for a Prometheus file_sd config."""
        out = []
        for r in self._members():
            srv = self.servers.get(r.name)
            if srv is not None:
                out.append((srv.url, {"instance": r.name, "model": self.dep.model, "pool": r.pool}))
        return out

    def fetch(self, replica: Replica) -> str | None:
        """GET the replica's /metrics over HTTP; None when unreachable or not 200."""
        url = self.url(replica)
        if url is None:
            return None
        try:
            resp = self._client.get(url)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    def close(self) -> None:
        if self._sync in self.dep.listeners:
            self.dep.listeners.remove(self._sync)
        for srv in self.servers.values():
            srv.close()
        self.servers.clear()
        self._client.close()

    def __enter__(self) -> LiveEndpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pacer:
    """Advance the simulation at ``speed`` x wall time, calling ``on_progress(sim_now, wall)``
    every ``progress_s`` wall seconds. If the simulation cannot keep up it runs as fast as it can
    (the status line shows the achieved speed)."""

    def __init__(self, dep: Deployment, speed: float = 60.0, step_wall_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.dep, self.speed, self.step_wall_s = dep, speed, step_wall_s
        self.clock, self.sleep = clock, sleep

    def run(self, sim_seconds: float, on_progress: Callable[[float, float], None] | None = None,
            progress_s: float = 1.0) -> float:
        """Run ``sim_seconds`` of simulated time; returns the wall time taken."""
        start_wall = self.clock()
        start_sim = self.dep.now
        end_sim = start_sim + sim_seconds
        next_progress = start_wall
        while self.dep.now < end_sim:
            wall = self.clock() - start_wall
            target = min(end_sim, start_sim + (wall + self.step_wall_s) * self.speed)
            self.dep.run_until(target)
            if on_progress is not None and self.clock() >= next_progress:
                on_progress(self.dep.now, self.clock() - start_wall)
                next_progress = self.clock() + progress_s
            ahead = (self.dep.now - start_sim) / self.speed - (self.clock() - start_wall)
            if ahead > 0:
                self.sleep(ahead)
        return self.clock() - start_wall
