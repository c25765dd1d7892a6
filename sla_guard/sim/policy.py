"""The scaling-policy interface the simulator's replay drives (``sla-guard replay --policy``).

A policy sees what an autoscaler in a real deployment sees: the contract metrics (through the
same ``MetricsView`` the guard's evaluators use, fed by scraping the simulated engines at
simulated time) and the replica counts a controller knows (ready, starting, draining). It
answers with the desired replica count per pool. The simulator applies the answer with real
dynamics: new replicas cold-start before serving, removed ones drain before they stop.

Policies are looked up by name: ``static`` lives here; others are registered by the scaling
advisor (``sla_guard.scale``) through :func:`register_policy` or found as
``sla_guard.scale.policies.get_policy(name, **kw)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from sla_guard.model import Finding, MetricsView


@dataclass(frozen=True, slots=True)
class PoolState:
    """What a deployment controller knows about one pool (like a Deployment's status)."""

    pool: str  # "prefill" | "decode"
    ready: int  # replicas serving
    starting: int  # replicas cold-starting (count against the budget, serve nothing yet)
    draining: int  # replicas finishing in-flight work after a scale-down
    gpus_per_replica: int
    min_replicas: int = 1
    max_replicas: int = 64

    @property
    def current(self) -> int:
        """Replicas that exist or are coming (ready + starting): what ``desired`` is compared to."""
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class Observation:
    """Input of one policy decision, at simulated time ``now`` (unix seconds).

    ``view`` holds every contract series scraped from the simulated engines so far (engine
    label = replica name, e.g. ``p0``; ``model`` and ``pool`` labels as in a real deployment).
    ``findings`` are the detectors' open findings when detectors run, else empty.
    ``profile`` is the simulator's performance profile (a ``sla_guard.sim.profile.Profile``):
    policies that read capacities "from a profile" (Dynamo-planner style) may use it; policies
    that learn online should use ``view`` only.
    """

    now: float
    model: str
    pools: Mapping[str, PoolState]
    view: MetricsView | None
    gpu_budget: int | None = None  # total GPUs both pools may use, None = unlimited
    findings: tuple[Finding, ...] = ()
    profile: object | None = None
    slo_ttft_s: float = 2.5
    slo_tpot_s: float = 0.020
    extra: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """A scaling policy. ``decide`` is called every ``interval_s`` of simulated time.

    Return the desired replicas per pool (omit a pool to leave it unchanged). The simulator
    clamps to [min_replicas, max_replicas] and the GPU budget, counts every change as one
    scaling action, and records it. ``restarts`` (optional, may be absent) returns replica
    names to restart one at a time (a leak finding recommends a rolling restart, not scaling).
    """

    name: str
    interval_s: float

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]: ...


class StaticPolicy:
    """Fixed size: never changes the replica counts (the baseline every other policy beats)."""

    name = "static"

    def __init__(self, interval_s: float = 30.0, **_: object) -> None:
        self.interval_s = interval_s

    def decide(self, now: float, obs: Observation) -> Mapping[str, int]:
        return {}


_REGISTRY: dict[str, Callable[..., Policy]] = {"static": StaticPolicy}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make ``factory(**kw)`` available as ``--policy name``."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    _load_advisor()
    return sorted(_REGISTRY)


def get_policy(name: str, **kw: object) -> Policy:
    """The policy called ``name``; a clear error lists the known names otherwise."""
    _load_advisor()
    if name in _REGISTRY:
        return _REGISTRY[name](**kw)
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")


def _load_advisor() -> None:
    """Import the scaling advisor's policies if that package exists (it registers itself, or
    exposes ``POLICIES: dict[name, factory]``)."""
    try:
        mod = importlib.import_module("sla_guard.scale.policies")
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("sla_guard.scale"):
            return
        raise
    for name, factory in getattr(mod, "POLICIES", {}).items():
        _REGISTRY.setdefault(name, factory)
