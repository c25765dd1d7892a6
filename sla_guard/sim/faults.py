"""Fault injection on a schedule: what goes wrong, where and when, in simulated seconds.

A schedule is a list of faults (dataclasses, or dicts with a ``kind`` from YAML/CLI). The
simulator asks pure questions of it (``acceptance_factor(replica, t)`` ...), so a fault is visible
only through the metrics it bends, as in production.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Leak:
    """Host-RSS growth of one process of one replica (e.g. 48 MiB/h on EngineCore, as reported in
    "From Day 0 to Production SLAs")."""

    replica: str
    role: str = "engine_core"
    mib_per_hour: float = 48.0
    start_s: float = 0.0
    # what the plugin's object census (docs/census.md) would name: the container that grows and
    # the bytes each element holds (vLLM issue 44175: block ids appended, never drained); "" for
    # a native leak the census cannot see
    owner: str = "EngineCoreProc.scheduler.kv_cache_manager.coordinator.single_type_managers[0].new_block_ids"
    bytes_per_element: float = 64.0


@dataclass(frozen=True, slots=True)
class AcceptanceDrift:
    """Spec-decode acceptance falls linearly to ``to_factor`` x its profile value between start and end."""

    start_s: float
    end_s: float
    to_factor: float = 0.75
    replica: str | None = None  # None = every decode replica


@dataclass(frozen=True, slots=True)
class TransferSlowdown:
    start_s: float
    end_s: float
    factor: float = 4.0  # transfer duration multiplier


@dataclass(frozen=True, slots=True)
class TransferFailures:
    start_s: float
    end_s: float
    prob: float = 0.2


@dataclass(frozen=True, slots=True)
class LoadSpike:
    """Arrival rate x ``factor`` inside the window (extra copies of the trace's requests)."""

    start_s: float
    end_s: float
    factor: float = 2.0


@dataclass(frozen=True, slots=True)
class Crash:
    """Replica dies at ``at_s`` (in-flight requests abort); restarts after ``restart_after_s``
    (None = the profile's cold start) with fresh counters."""

    replica: str
    at_s: float
    restart_after_s: float | None = None


Fault = Leak | AcceptanceDrift | TransferSlowdown | TransferFailures | LoadSpike | Crash
KINDS: dict[str, type] = {"leak": Leak, "acceptance_drift": AcceptanceDrift, "transfer_slowdown": TransferSlowdown,
                          "transfer_failures": TransferFailures, "load_spike": LoadSpike, "crash": Crash}


def parse_fault(d: Mapping[str, object]) -> Fault:
    """A fault from a dict like ``{"kind": "leak", "replica": "d0", "mib_per_hour": 48}``."""
    kind = d.get("kind")
    if kind not in KINDS:
        raise ValueError(f"fault kind {kind!r} unknown; use one of {sorted(KINDS)}")
    cls = KINDS[str(kind)]
    names = {f.name for f in fields(cls)}
    extra = set(d) - names - {"kind"}
    if extra:
        raise ValueError(f"fault {kind!r}: unknown field(s) {sorted(extra)}; allowed: {sorted(names)}")
    for f in fields(cls):  # a string where a number goes failed with a TypeError deep in the replay
        v, want = d.get(f.name), str(f.type)
        if f.name not in d or (v is None and "None" in want):
            continue
        if "float" in want and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise ValueError(f"fault {kind!r}: field {f.name!r} must be a finite number, got {v!r}")
        if want.startswith("str") and not isinstance(v, str):
            raise ValueError(f"fault {kind!r}: field {f.name!r} must be a string, got {v!r}")
    try:
        return cls(**{k: v for k, v in d.items() if k != "kind"})
    except TypeError as err:
        raise ValueError(f"fault {kind!r}: {err}") from None


class FaultSchedule:
    def __init__(self, faults: Iterable[Fault | Mapping[str, object]] = ()) -> None:
        self.faults: list[Fault] = [f if not isinstance(f, Mapping) else parse_fault(f) for f in faults]
        self._leaks = [f for f in self.faults if isinstance(f, Leak)]
        self._drifts = [f for f in self.faults if isinstance(f, AcceptanceDrift)]
        self._slow = [f for f in self.faults if isinstance(f, TransferSlowdown)]
        self._fail = [f for f in self.faults if isinstance(f, TransferFailures)]

    @property
    def crashes(self) -> list[Crash]:
        return [f for f in self.faults if isinstance(f, Crash)]

    @property
    def spikes(self) -> list[LoadSpike]:
        return [f for f in self.faults if isinstance(f, LoadSpike)]

    def leak_bytes(self, replica: str, role: str, t: float, since: float = 0.0) -> float:
        """Bytes leaked by ``replica``'s ``role`` process at ``t`` since it started at ``since``."""
        total = 0.0
        for f in self._leaks:
            if f.replica == replica and f.role == role:
                start = max(f.start_s, since)
                if t > start:
                    total += f.mib_per_hour * MIB * (t - start) / 3600.0
        return total

    def census(self, replica: str, role: str, t: float, since: float = 0.0) -> list[tuple[str, float, float, float]]:
        """(owner, length, growth in elements/s, estimated bytes/s) of each leak of ``replica``'s
        ``role`` process that names a container, as the census would report it at ``t``."""
        out = []
        for f in self._leaks:
            start = max(f.start_s, since)
            if f.replica == replica and f.role == role and f.owner and t > start and f.bytes_per_element > 0:
                bps = f.mib_per_hour * MIB / 3600.0
                out.append((f.owner, bps * (t - start) / f.bytes_per_element, bps / f.bytes_per_element, bps))
        return out

    def acceptance_factor(self, replica: str, t: float) -> float:
        factor = 1.0
        for f in self._drifts:
            if f.replica not in (None, replica) or t <= f.start_s:
                continue
            span = max(f.end_s - f.start_s, 1e-9)
            frac = min(1.0, (t - f.start_s) / span)
            factor *= 1.0 + (f.to_factor - 1.0) * frac
        return factor

    def transfer_factor(self, t: float) -> float:
        factor = 1.0
        for f in self._slow:
            if f.start_s <= t < f.end_s:
                factor *= f.factor
        return factor

    def transfer_failure_prob(self, t: float, base: float = 0.0) -> float:
        p = base
        for f in self._fail:
            if f.start_s <= t < f.end_s:
                p = 1 - (1 - p) * (1 - f.prob)
        return p
