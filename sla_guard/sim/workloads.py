"""The scaling workload suite: generated workloads and the shared traces in phases, split into
tuning seeds and sealed seeds (issue 15).

A workload is a recipe, not a file: ``Workload.trace()`` builds its :class:`Trace` from the
seed on demand, ``Workload.profile(base)`` adapts the simulator profile (MTP acceptance level).
The suite is deterministic: the same name and seed give the same requests.

Families (each load phase outlasts a 10-minute cold start, except bursty's bursts):

- ``bursty``: a base rate with bursts of 2-3x lasting 4-9 minutes, 10-25 minutes apart (shorter
  than a cold start: only capacity already standing meets them);
- ``diurnal``: a compressed day, rate = base x (1 + a sin(2 pi t / period)), 2.5-4x peak/trough;
- ``step_up`` / ``step_down``: one step of 2-2.8x after 40-55% of the run;
- ``ramp``: a slow linear ramp from 0.7x to 2-2.4x over the whole run;
- ``agentic``: coding-agent sessions (long growing contexts, shared prefixes, sub-agent fan-out)
  in two waves, the second 2x the first;
- ``surge_after_quiet``: a quiet first 55-65% of the run at 0.3-0.4x, then a 2.5-3x surge.

Each generated workload draws its request mix from the seed: prompt length (short 2k, medium 8k,
long 30k medians, lognormal), output length (100-600 tokens), prefix sharing (0, 50% or 80% of
the prompt in blocks shared within one of a few dozen prefix groups) and the MTP acceptance level
(1.0, 0.85 or 0.7 x the profile's per-position rates).

Shared traces (``$SLA_GUARD_TRACES``, else ``shared/traces`` beside the checkout; Mooncake falls
back to its bundled copy, a missing Azure trace is warned about and its cells left out): the trace's
requests replayed in phases at changing speeds (``phased``), each phase 15 minutes; a phase takes
the next slice of the source trace (wrapping around with fresh prefix hashes).

``suite(split)``: ``"tuning"`` (seeds 0-1) or ``"sealed"`` (seeds 100-101, other phase plans):
tune on the first, report the second once per change and never tune to it.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sla_guard.sim.traces import BUNDLED_MOONCAKE, Trace, TraceRequest, agentic_sessions, load_trace

TRACES_ENV = "SLA_GUARD_TRACES"  # folder holding the shared production traces
DEFAULT_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"  # beside the checkout
TRACE_FILES = {"mooncake": "mooncake_conversation_trace.jsonl", "azure": "azure_llm_2023_conv.csv"}
BLOCK = 512
MAX_BASE_RPS = 2.0  # keeps a run's request count (and the grid's run time) bounded

TUNING_SEEDS = (0, 1)
SEALED_SEEDS = (100, 101)
FAMILIES = ("bursty", "diurnal", "step_up", "step_down", "ramp", "agentic", "surge_after_quiet")


@dataclass(frozen=True, slots=True)
class Mix:
    """Request mix of a generated workload."""

    input_median: int
    input_sigma: float
    output_median: int
    prefix_share: float  # share of each prompt in blocks shared with its prefix group
    acceptance: float  # x the profile's per-position MTP acceptance
    groups: int = 40

    @property
    def label(self) -> str:
        kind = "long" if self.input_median >= 20000 else "short" if self.input_median <= 5000 else "mid"
        return f"in={kind} out={self.output_median} prefix={self.prefix_share:.0%} acc={self.acceptance:g}x"

    def mean_uncached(self) -> float:
        mean_in = self.input_median * math.exp(self.input_sigma ** 2 / 2)
        return mean_in * (1 - self.prefix_share)


def draw_mix(rng: random.Random) -> Mix:
    inp = rng.choice([(4000, 0.9), (8000, 0.8), (30000, 0.6)])
    return Mix(input_median=inp[0], input_sigma=inp[1], output_median=rng.choice([100, 250, 600]),
               prefix_share=rng.choice([0.0, 0.5, 0.8]), acceptance=rng.choice([1.0, 0.85, 0.7]))


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    family: str
    seed: int
    split: str  # "tuning" | "sealed"
    duration_s: float
    swing: float  # peak / trough of the offered rate (per minute)
    build: Callable[[], Trace] = field(repr=False, compare=False)
    acceptance: float = 1.0
    note: str = ""

    def trace(self) -> Trace:
        return self.build()

    def profile(self, base):
        """``base`` with the workload's MTP acceptance level."""
        if self.acceptance == 1.0:
            return base
        spec = base.spec.model_copy(update={"acceptance_per_pos": [a * self.acceptance
                                                                   for a in base.spec.acceptance_per_pos]})
        return base.model_copy(update={"spec": spec})


# -- generated workloads -----------------------------------------------------------------------


def _rate_fn(family: str, rng: random.Random, duration_s: float) -> tuple[Callable[[float], float], float]:
    """Shape of the offered rate (x base) and its peak/trough swing."""
    if family == "bursty":
        bursts, t = [], rng.uniform(300, 900)
        while t < duration_s:
            length = rng.uniform(240, 540)
            bursts.append((t, t + length, rng.uniform(2.0, 3.0)))
            t += length + rng.uniform(600, 1500)
        return (lambda x: next((f for a, b, f in bursts if a <= x < b), 1.0)), max(f for *_, f in bursts)
    if family == "diurnal":
        amp, period, phase = rng.uniform(0.45, 0.6), rng.uniform(3600, 5400), rng.uniform(0, 2 * math.pi)
        return (lambda x: 1 + amp * math.sin(2 * math.pi * x / period + phase)), (1 + amp) / (1 - amp)
    if family in ("step_up", "step_down"):
        at, f = rng.uniform(0.4, 0.55) * duration_s, rng.uniform(2.0, 2.8)
        if family == "step_up":
            return (lambda x: f if x >= at else 1.0), f
        return (lambda x: 1.0 if x >= at else f), f
    if family == "ramp":
        top = rng.uniform(2.0, 2.4)
        return (lambda x: 0.7 + (top - 0.7) * x / duration_s), top / 0.7
    if family == "surge_after_quiet":
        quiet, low, high = rng.uniform(0.55, 0.65) * duration_s, rng.uniform(0.3, 0.4), rng.uniform(2.5, 3.0)
        return (lambda x: low if x < quiet else high), high / low
    raise ValueError(f"unknown family {family!r}")


def _plan(family: str, seed: int, duration_s: float):
    """Mix, base load, rate shape and swing of a generated workload, all drawn from the seed."""
    rng = random.Random(f"{family}:{seed}")
    mix = draw_mix(rng)
    base_tps = rng.uniform(22000, 34000)
    shape, swing = _rate_fn(family, rng, duration_s)
    return rng, mix, base_tps, shape, swing


def generated(family: str, seed: int, duration_s: float) -> Trace:
    """A generated trace: non-homogeneous Poisson arrivals (thinning) at ``base x shape(t)``,
    ``base`` = the drawn uncached prompt tokens/s divided by the mix's mean uncached prompt."""
    rng, mix, base_tps, shape, _ = _plan(family, seed, duration_s)
    peak_shape = max(shape(t) for t in range(0, int(duration_s), 10))
    base_rps = min(MAX_BASE_RPS, base_tps / max(mix.mean_uncached(), 500.0))
    lam_max = base_rps * peak_shape
    groups = [list(range(g * 1000 + 1, g * 1000 + 1 + 800)) for g in range(mix.groups)]
    fresh = [10_000_000 + 1000 * seed]
    reqs: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(lam_max)
        if t >= duration_s:
            break
        if rng.random() > shape(t) / peak_shape:
            continue
        n_in = int(min(200_000, max(64, rng.lognormvariate(math.log(mix.input_median), mix.input_sigma))))
        n_out = int(min(4000, max(2, rng.lognormvariate(math.log(mix.output_median), 0.7))))
        blocks = n_in // BLOCK + 1
        shared = int(blocks * mix.prefix_share) if mix.prefix_share else 0
        g = groups[rng.randrange(len(groups))]
        own = list(range(fresh[0], fresh[0] + blocks - shared))
        fresh[0] += blocks - shared
        reqs.append(TraceRequest(t, n_in, n_out, tuple(g[:shared] + own)))
    return Trace(f"{family}-{seed}", tuple(reqs), BLOCK)


def agentic_waves(seed: int, duration_s: float) -> Trace:
    """Agent sessions in two waves: the second half brings twice the first half's sessions."""
    half = duration_s / 2
    rng = random.Random(f"agentic:{seed}")
    n1 = rng.randint(9, 13)
    a = agentic_sessions(n_sessions=n1, duration_s=half, seed=seed)
    b = agentic_sessions(n_sessions=2 * n1, duration_s=half, seed=seed + 7919)
    off = a.max_hash() + 1
    second = [replace(r, t=r.t + half, hash_ids=tuple(h + off for h in r.hash_ids),
                      session=r.session + 100000) for r in b.requests]
    reqs = sorted([r for r in a.requests if r.t < half] + [r for r in second if r.t < duration_s], key=lambda r: r.t)
    return Trace(f"agentic-{seed}", tuple(reqs), a.block_tokens)


# -- shared traces in phases -------------------------------------------------------------------


def traces_dir() -> Path:
    """Where the shared traces are: ``$SLA_GUARD_TRACES``, else ``shared/traces`` beside the
    checkout. A package installed elsewhere, or a git worktree under another folder, has none
    there, and the Azure cells of the suite were then left out without a word."""
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else DEFAULT_TRACES


def shared_trace_path(name: str) -> Path | None:
    """``mooncake`` / ``azure`` from ``traces_dir()``; Mooncake falls back to the bundled copy."""
    p = traces_dir() / TRACE_FILES[name]
    if p.exists():
        return p
    return BUNDLED_MOONCAKE if name == "mooncake" else None


def phased(src: Trace, speeds: list[float], phase_s: float, offset_s: float = 0.0) -> Trace:
    """``src`` replayed in phases: phase k lasts ``phase_s`` and plays the next ``phase_s x
    speeds[k]`` seconds of the source at ``speeds[k]`` x its rate (wrapping around with fresh
    prefix hashes, so a second pass is new conversations)."""
    dur = src.duration_s
    span = max(src.max_hash() + 1, 1)
    out: list[TraceRequest] = []
    pos = offset_s % dur
    laps = 0
    reqs = src.requests
    times = [r.t for r in reqs]
    for k, s in enumerate(speeds):
        need = phase_s * s
        t0 = k * phase_s
        done = 0.0
        while done < need - 1e-9:
            take = min(need - done, dur - pos)
            lo, hi = bisect.bisect_left(times, pos), bisect.bisect_left(times, pos + take)
            for r in reqs[lo:hi]:
                h = tuple(x + laps * span for x in r.hash_ids) if laps else r.hash_ids
                out.append(replace(r, t=t0 + (done + r.t - pos) / s, hash_ids=h))
            done += take
            pos += take
            if pos >= dur - 1e-9:
                pos, laps = 0.0, laps + 1
    name = f"{src.name}@" + "-".join(f"x{s:g}" for s in speeds)
    return Trace(name, tuple(out), src.block_tokens)


# -- the suite ---------------------------------------------------------------------------------


PHASE_S = 900.0  # each phase outlasts a 600 s cold start
TRACE_PLANS = {
    "tuning": [("mooncake", [0.5, 2.0, 2.0, 0.5], 0.0), ("azure", [0.5, 2.0, 4.0, 1.0], 0.0)],
    "sealed": [("mooncake", [1.0, 0.5, 2.0, 1.0], 1200.0), ("azure", [1.0, 4.0, 0.5, 2.0], 1800.0)],
}


def _gen_workload(family: str, seed: int, split: str, duration_s: float) -> Workload:
    if family == "agentic":
        return Workload(f"agentic/s{seed}", family, seed, split, duration_s, 2.0,
                        lambda: agentic_waves(seed, duration_s), note="two waves, 2x sessions")
    _, mix, _, _, swing = _plan(family, seed, duration_s)
    return Workload(f"{family}/s{seed}", family, seed, split, duration_s, round(swing, 2),
                    lambda: generated(family, seed, duration_s), acceptance=mix.acceptance, note=mix.label)


def _trace_workload(name: str, speeds: list[float], offset: float, split: str, seed: int) -> Workload | None:
    path = shared_trace_path(name)
    if path is None:
        warnings.warn(f"the {name} trace is not in {traces_dir()}: the suite's {name}@ cells are left out; "
                      f"set {TRACES_ENV} to the folder holding {TRACE_FILES[name]}", stacklevel=3)
        return None

    def build() -> Trace:
        return phased(load_trace(path), speeds, PHASE_S, offset)

    plan = "-".join(f"x{s:g}" for s in speeds)
    return Workload(f"{name}@{plan}", f"trace_{name}", seed, split, PHASE_S * len(speeds),
                    max(speeds) / min(speeds), build, note=f"phases of {PHASE_S / 60:g} min from {offset:g} s")


def suite(split: str = "sealed", seeds: tuple[int, ...] | None = None, families: tuple[str, ...] = FAMILIES,
          duration_s: float = 3600.0, traces: bool = True) -> list[Workload]:
    """The workloads of one half of the suite (``tuning`` or ``sealed``)."""
    if split not in ("tuning", "sealed"):
        raise ValueError("split is 'tuning' or 'sealed'")
    if seeds is None:
        seeds = TUNING_SEEDS if split == "tuning" else SEALED_SEEDS
    out = []
    for i, fam in enumerate(families):
        seed = seeds[i % len(seeds)]  # families alternate seeds: one run per family per half
        out.append(_gen_workload(fam, seed, split, duration_s))
    if traces:
        for k, (name, speeds, off) in enumerate(TRACE_PLANS[split]):
            w = _trace_workload(name, speeds, off, split, seeds[k % len(seeds)])
            if w is not None:
                out.append(w)
    return out


def quick_suite() -> list[Workload]:
    """Two short tuning workloads (a smoke run of the grid)."""
    return [_gen_workload("surge_after_quiet", 0, "tuning", 3000.0), _gen_workload("bursty", 0, "tuning", 2700.0)]


def by_name(name: str, split: str | None = None) -> Workload:
    for sp in (split,) if split else ("tuning", "sealed"):
        for w in suite(sp):
            if w.name == name:
                return w
    raise KeyError(name)
