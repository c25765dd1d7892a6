"""Host memory of a simulated replica's processes (API server, EngineCore, workers).

RSS = base + warm-up growth that levels off + GC sawtooth + load-correlated term + noise + any
injected leak. The shape is what the leak detector must see through: a sawtooth, plateaus,
warm-up growth and restarts are not leaks; a steady slope is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sla_guard.sim.profile import ProcessModel


def rss_model(p: ProcessModel, age_s: float, load: float, leak_bytes: float, noise: float) -> float:
    """RSS bytes of process ``p`` ``age_s`` after its start; ``noise`` is a standard normal draw."""
    warm = p.warmup_growth_bytes * (1.0 - math.exp(-age_s / p.warmup_s))
    saw = p.gc_sawtooth_bytes * ((age_s % p.gc_period_s) / p.gc_period_s)
    return p.rss_bytes + warm + saw + 2.0e6 * load + leak_bytes + p.noise_bytes * noise


@dataclass(slots=True)
class ProcessSampler:
    """Produces samples for one replica's processes at a given simulated time."""

    models: list[ProcessModel]
    started_at: float
    pid_base: int
    rng: random.Random

    def sample(self, t: float, load: float, leak_of) -> list[tuple]:
        """(role, name, pid, start_time, rss, anon, file, shmem, gc_counts, frozen, threads, fds) per process;
        ``leak_of(role, t)`` returns leaked bytes."""
        age = max(0.0, t - self.started_at)
        out = []
        for i, p in enumerate(self.models):
            rss = max(1.0, rss_model(p, age, load, leak_of(p.role, t), self.rng.gauss(0.0, 1.0)))
            shmem = min(p.shmem_bytes, rss * 0.5)
            anon = (rss - shmem) * p.anon_share
            file = max(0.0, rss - shmem - anon)
            g2 = int(age // p.gc_period_s)
            gc = (int(age // 2.0) + g2 * 40, int(age // 15.0), g2)
            out.append((p.role, p.name, self.pid_base + i, self.started_at, rss, anon, file, shmem, gc,
                        p.frozen_objects, p.threads, p.open_fds + int(load)))
        return out
