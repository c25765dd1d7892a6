"""Object census inside a vLLM process: name the Python containers that grow.

The leak detector says *that* a process leaks and how fast; this says *what* grows. A daemon
thread (started by the general plugin beside the process sampler) walks the object graph from
the process's roots every ``SLA_GUARD_CENSUS_INTERVAL_S`` (600 s; 60 s while a census request is
open), records the length of every ``list``, ``dict``, ``set`` and ``deque`` it reaches with a
readable owner path (``EngineCoreProc.scheduler.kv_cache_manager.coordinator.
single_type_managers[0].new_block_ids``), compares walks and reports the containers that grow
steadily: growth per hour, estimated bytes per hour, and the share of the process's RSS slope
they explain (the rest is native memory the census cannot see). docs/census.md has the details.

**Roots and gc.freeze().** EngineCore calls ``gc.freeze()`` after start-up: everything built
before it (the engine, the scheduler, the KV manager and their containers) moves to the
permanent generation, which ``gc.get_objects()``, ``gc.get_referrers()`` and tracemalloc
snapshots taken the usual way do not show. The census therefore never asks the collector what
exists: it follows references itself, from (1) the ``self`` of every frame on every other
thread's stack (the busy loop's ``EngineCoreProc``, a worker's runner, the API server's
objects), then (2) the globals of every module in ``sys.modules``. Frozen or not makes no
difference to that walk. (``gc.unfreeze()`` + ``gc.get_objects()`` + ``gc.freeze()`` was
rejected: unfreezing hands millions of start-up objects back to the collector, so the next full
collection scans them all -- the long pause vLLM froze them to avoid -- and re-freezing also
freezes whatever garbage exists at that moment; nor would it give owner paths.)

**Bounded.** The walk is an explicit breadth-first queue (shortest, most readable path first)
run as a generator: the thread advances it in slices of at most ``SLA_GUARD_CENSUS_SLICE_MS``
(1.5 ms; 5 ms at most) and then sleeps so that walking takes at most ``SLA_GUARD_CENSUS_CPU_BUDGET`` (1 %) of
one core on average; a walk stops at ``max_objects`` objects, ``max_depth`` levels, looks at
``max_children`` elements per container, and only containers of ``min_len`` or more elements are
recorded; at most ``max_tracked`` owner paths are followed across walks. Paths are cut at
``max_path_len`` characters; element positions of lists, sets and deques and dict keys that look
like identifiers of one request (digit or hex runs) are written ``[*]``, so per-request
containers add up under one path instead of creating a new path per request.

**Channel.** A census request is a JSON file ``{"interval_s": 60, "until": <unix time>}`` at
``SLA_GUARD_CENSUS_REQUEST_FILE`` (default ``$SLA_GUARD_RUN_DIR/census-request.json``), polled
every few seconds: until ``until``, walks run every ``interval_s`` (never below 5 s); with
``"pause": true`` none runs (benchmarks compare the same engine with and without the census so).
The guard writes it while a leak finding is open (sla_guard/detect/census.py); an operator can too.

**Output.** After each walk the thread writes ``census-<pid>.json`` atomically into the run
directory; the API server's snapshot collector exports the top growers as contract metrics
(``slaguard_census_*``, exporters/process_collector.py) and ``sla-guard analyze leak --census
FILE`` reads the same file. Never raises into vLLM: a failing walk is logged once, skipped, and
counted in the file's ``errors`` (``slaguard_census_errors_total``); the file is written after a
failure too, so a census whose every walk fails is visible, not absent.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import os
import re
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice, pairwise
from pathlib import Path

from exporters.process_sampler import CENSUS_PREFIX, ENV_RUN_DIR, BackgroundLoop

log = logging.getLogger("sla_guard.census")

ENV_ENABLE = "SLA_GUARD_CENSUS"  # "0" disables
ENV_INTERVAL = "SLA_GUARD_CENSUS_INTERVAL_S"
ENV_FAST_INTERVAL = "SLA_GUARD_CENSUS_FAST_INTERVAL_S"
ENV_START_DELAY = "SLA_GUARD_CENSUS_START_DELAY_S"
ENV_SLICE_MS = "SLA_GUARD_CENSUS_SLICE_MS"
ENV_BUDGET = "SLA_GUARD_CENSUS_CPU_BUDGET"
ENV_MAX_OBJECTS = "SLA_GUARD_CENSUS_MAX_OBJECTS"
ENV_TOP = "SLA_GUARD_CENSUS_TOP"
ENV_FULL_EVERY = "SLA_GUARD_CENSUS_FULL_EVERY"
ENV_REQUEST_FILE = "SLA_GUARD_CENSUS_REQUEST_FILE"
REQUEST_NAME = "census-request.json"

DEFAULT_INTERVAL_S = 600.0
DEFAULT_FAST_INTERVAL_S = 60.0
MIN_INTERVAL_S = 5.0
DEFAULT_START_DELAY_S = 120.0
DEFAULT_SLICE_S = 0.0015
MAX_SLICE_S = 0.005
DEFAULT_BUDGET = 0.01
DEFAULT_FULL_EVERY = 6
POLL_S = 5.0


# --- the walk ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Limits:
    max_objects: int = 200_000  # objects expanded per walk (containers and instances; leaves are free)
    max_depth: int = 32
    max_children: int = 256  # elements / items / attributes looked into per object
    max_path_len: int = 200
    min_len: int = 8  # shorter containers are not recorded
    max_tracked: int = 1000  # owner paths followed across walks
    sample: int = 8  # elements sampled per recorded container for the bytes estimate
    chunk: int = 8  # objects expanded between two yields of the walk generator


@dataclass(slots=True)
class Walk:
    """One walk's result: ``containers[path] = [length, instances, bytes_per_element, t_seen,
    phase]`` (``length`` summed over the ``instances`` that share the path; phase 0: reached from
    the frames' objects, 1: from module globals) and the walk's cost. A frames walk records
    phase 0; a ``full`` walk walks both phases and records phase 1 (the objects the frames reach
    are walked to be excluded, not recorded twice)."""

    started: float = 0.0
    full: bool = False
    finished: float = 0.0
    containers: dict[str, list] = field(default_factory=dict)
    objects: int = 0
    roots: int = 0
    root_names: list[str] = field(default_factory=list)  # the first few, for the census file
    truncated: bool = False
    max_queued: int = 0  # the queue's high-water mark (objects held by the walk at once)
    busy_s: float = 0.0  # GIL-holding time: the sum of slices
    max_slice_s: float = 0.0  # wall time (includes the OS preempting this thread)
    max_slice_cpu_s: float = 0.0  # this thread's CPU time
    slices: int = 0
    slice_durations: list[float] = field(default_factory=list)  # wall
    slice_cpu: list[float] = field(default_factory=list)  # this thread's CPU time (GC pauses it triggers included)


# type -> how to expand it
_SKIP, _DICT, _SEQ, _TUPLE, _SET, _OBJ = range(6)
_LEAVES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType,
           types.TracebackType, types.MemberDescriptorType, types.GetSetDescriptorType, types.WrapperDescriptorType,
           types.MethodWrapperType, types.MethodDescriptorType, types.ClassMethodDescriptorType, property,
           staticmethod, classmethod, weakref.ref, weakref.ProxyType, weakref.CallableProxyType, str, bytes,
           bytearray, memoryview, int, float, complex, bool, type(None), range, slice, threading.Thread)
# per walk (cleared when one starts or ends): it holds its types, and a class made per request
# (pydantic create_model, a namedtuple factory) must not outlive its instances because a walk saw one
_kinds: dict[type, tuple[int, tuple]] = {}
# type's own C-level getters: ``t.__mro__``, ``t.__dictoffset__``, ``vars(t)``, ``t.__name__`` go
# through the metaclass (its __getattribute__, or a property of that name): Python code, which
# may raise, and one such class anywhere in the graph used to abort every walk of the process
_type_mro = type.__dict__["__mro__"].__get__
_type_dictoffset = type.__dict__["__dictoffset__"].__get__
_type_vars = type.__dict__["__dict__"].__get__
_type_name = type.__dict__["__name__"].__get__


def _kind(t: type) -> tuple[int, tuple]:
    """(how to expand instances of ``t``, its slot descriptors), cached per type."""
    k = _kinds.get(t)
    if k is not None:
        return k
    slots: tuple = ()
    try:
        if issubclass(t, _LEAVES):
            kind = _SKIP
        elif issubclass(t, dict):
            kind = _DICT
        elif issubclass(t, list | deque):
            kind = _SEQ
        elif issubclass(t, tuple):
            kind = _TUPLE
        elif issubclass(t, set | frozenset):
            kind = _SET
        else:
            slots = tuple((name, d) for klass in _type_mro(t) for name, d in _type_vars(klass).items()
                          if type(d) is types.MemberDescriptorType)
            kind = _OBJ if (_type_dictoffset(t) or slots) else _SKIP
    except Exception:  # an exotic type: its instances are not walked
        kind, slots = _SKIP, ()
    k = (kind, slots)
    if len(_kinds) < 50_000:
        _kinds[t] = k
    return k


_ID_LIKE = re.compile(r"\d{4,}|[0-9a-fA-F]{8,}|-[0-9a-fA-F]{4,}")
_NAME_LIKE = re.compile(r"[A-Za-z_][\w.:/-]{0,47}\Z")


def _key(k) -> str:
    """Dict key -> path part: ``['name']`` for short name-like strings, ``[*]`` for the rest
    (request ids, block hashes, numbers): one path per role, not per request."""
    if type(k) is str and _NAME_LIKE.match(k) and not _ID_LIKE.search(k):
        return f"[{k!r}]"
    if type(k) is bool or k is None:
        return f"[{k!r}]"
    return "[*]"


def _size_of(x) -> int:
    try:
        n = sys.getsizeof(x)
        if _type_dictoffset(type(x)) and _kind(type(x))[0] == _OBJ:
            d = object.__getattribute__(x, "__dict__")
            if type(d) is dict:
                n += sys.getsizeof(d)
        return n
    except Exception:
        return 0


# C-level views of the builtin containers: a subclass's own __len__ / items() / __iter__ (a lazy
# mapping that imports modules, say) is never called
def _len(obj, kind: int) -> int:
    t = type(obj)
    if kind == _DICT:
        return dict.__len__(obj)
    if kind == _SEQ:
        return list.__len__(obj) if issubclass(t, list) else deque.__len__(obj)
    if kind == _SET:
        return set.__len__(obj) if issubclass(t, set) else frozenset.__len__(obj)
    return tuple.__len__(obj)


def _items(obj, kind: int, n: int, newest: bool = False) -> list:
    """Up to ``n`` elements (dict: (key, value) pairs) without running the subclass's code;
    ``newest``: from the end (lists, deques, dicts)."""
    t = type(obj)
    if kind == _DICT:
        return list(islice(reversed(dict.items(obj)) if newest else dict.items(obj), n))
    if kind == _SEQ:
        if issubclass(t, list):
            return list.__getitem__(obj, slice(-n, None) if newest else slice(0, n))
        return list(islice(deque.__reversed__(obj) if newest else deque.__iter__(obj), n))
    if kind == _SET:
        return list(islice(set.__iter__(obj) if issubclass(t, set) else frozenset.__iter__(obj), n))
    return list(tuple.__getitem__(obj, slice(0, n)))


def _bytes_per_element(obj, kind: int, n: int, sample: int) -> float:
    """sys.getsizeof of the container per element, plus the mean size of a sample of the
    newest elements (the tail, where a leak appends; a dict's last inserted items)."""
    try:
        own = sys.getsizeof(obj) / max(n, 1)
        items = _items(obj, kind, sample, newest=True)
        elems = [_size_of(a) + _size_of(b) for a, b in items] if kind == _DICT else [_size_of(x) for x in items]
        return own + (sum(elems) / len(elems) if elems else 0.0)
    except Exception:
        return 0.0


def _clip(path: str, limit: int) -> str:
    if len(path) <= limit:
        return path
    half = (limit - 1) // 2
    return path[:half] + "…" + path[-(limit - 1 - half):]


Roots = Iterable[tuple[str, object]] | Callable[[], Iterable[tuple[str, object]]]


def walk_steps(roots: Roots, limits: Limits, out: Walk, *, skip_ids: Iterable[int] = (),
               clock: Callable[[], float] = time.time, more_roots: Roots | None = None,
               record_from: int = 0) -> Iterator[None]:
    """Breadth-first walk from ``roots`` ((name, object) pairs), then from ``more_roots()``
    (a second phase: only objects the first did not reach), filling ``out.containers``.
    A generator: it yields every ``limits.chunk`` expanded objects, so the caller decides how
    long it holds the GIL. The walk never calls Python-level code of the objects it visits
    (no properties, no ``__getattr__``, no ``__len__`` of user classes)."""
    _kinds.clear()
    seen: set[int] = set(skip_ids)
    containers = out.containers
    max_objects, max_depth, max_children = limits.max_objects, limits.max_depth, limits.max_children
    min_len, plen, sample, chunk = limits.min_len, limits.max_path_len, limits.sample, limits.chunk
    cap = 3 * limits.max_tracked
    # the queue as three parallel deques: no tuple per entry, so the walk adds no GC-tracked
    # objects per visited object (the collector's passes, which pause every thread, stay short)
    q_obj: deque = deque()
    q_path: deque = deque()
    q_depth: deque = deque()
    phases = [roots] + ([more_roots] if more_roots is not None else [])
    budget = 0
    for phase_no, phase in enumerate(phases):
        items = phase() if callable(phase) else phase
        for name, obj in items:
            if _kind(type(obj))[0] != _SKIP and id(obj) not in seen:
                if out.objects + len(q_obj) >= max_objects:  # would never be expanded: see below
                    out.truncated = True
                    break
                seen.add(id(obj))
                q_obj.append(obj)
                q_path.append(name)
                q_depth.append(0)
                out.max_queued = max(out.max_queued, len(q_obj))
                out.roots += 1
                if phase_no == 0 and len(out.root_names) < 20:
                    out.root_names.append(name)
            budget += 1
            if budget >= 4 * chunk:  # enumerating roots (thousands of module globals) costs time too
                budget = 0
                yield
        while q_obj:
            if out.objects >= max_objects:
                out.truncated = True
                q_obj.clear()
                q_path.clear()
                q_depth.clear()
                break
            obj, path, depth = q_obj.popleft(), q_path.popleft(), q_depth.popleft()
            out.objects += 1
            t = type(obj)
            kind, slots = _kind(t)
            try:
                if kind == _OBJ:
                    children = []
                    d = None
                    if _type_dictoffset(t):
                        with contextlib.suppress(Exception):
                            d = object.__getattribute__(obj, "__dict__")
                    if type(d) is dict:
                        children = [(f"{path}.{k}", v) for k, v in islice(list(d.items()), max_children)
                                    if type(k) is str]
                    for name, desc in slots[:max_children]:
                        with contextlib.suppress(Exception):
                            children.append((f"{path}.{name}", desc.__get__(obj, t)))
                else:
                    n = _len(obj, kind)
                    if kind != _TUPLE and n >= min_len and phase_no >= record_from:
                        rec = containers.get(path)
                        if rec is None:
                            containers[path] = [n, 1, _bytes_per_element(obj, kind, n, sample), clock(), phase_no]
                            if len(containers) > cap:
                                yield  # a fresh slice for the pruning
                                _prune(containers, limits.max_tracked)
                        else:
                            rec[0] += n
                            rec[1] += 1
                    items = _items(obj, kind, max_children)
                    if kind == _DICT:
                        children = [(path + _key(k), v) for k, v in items]
                    elif kind == _TUPLE:
                        children = [(f"{path}[{i}]", v) for i, v in enumerate(items)]
                    else:
                        children = [(path + "[*]", v) for v in items]
            except Exception:  # mutated under us, or an exotic object: skip it
                children = []
            if depth < max_depth:
                # breadth first, so what is queued beyond max_objects would never be expanded: not
                # queuing it bounds the walk's memory (queue, seen ids, paths) by max_objects,
                # whatever the fan-out (1M queued objects held 240 MiB and a 100 ms GIL stall)
                room = max_objects - out.objects - len(q_obj)
                for cpath, child in children:
                    if id(child) in seen or _kind(type(child))[0] == _SKIP:
                        continue
                    if room <= 0:
                        out.truncated = True
                        break
                    room -= 1
                    seen.add(id(child))
                    q_obj.append(child)
                    q_path.append(cpath if len(cpath) <= plen else _clip(cpath, plen))
                    q_depth.append(depth + 1)
                if len(q_obj) > out.max_queued:
                    out.max_queued = len(q_obj)
            if out.objects % chunk == 0:
                yield
    _kinds.clear()


def _prune(containers: dict[str, list], keep: int) -> None:
    """Keep the ``keep`` longest containers (the walk's memory stays bounded)."""
    for path in sorted(containers, key=lambda p: containers[p][0], reverse=True)[keep:]:
        del containers[path]


def run_sliced(steps: Iterator, walk: Walk, *, slice_s: float = DEFAULT_SLICE_S, budget: float = DEFAULT_BUDGET,
               wait: Callable[[float], bool] | None = None, clock: Callable[[], float] = time.perf_counter,
               cpu_clock: Callable[[], float] = time.thread_time, max_slices: int | None = None) -> bool | None:
    """Advance ``steps`` in slices of about ``slice_s`` (overshoot: one chunk), sleeping
    ``busy * (1 - budget) / budget`` after each, so the walk holds the GIL for at most ``budget``
    of the time. ``wait(seconds)`` sleeps and returns True to abort. Returns True when done,
    False when aborted, None after ``max_slices`` slices with the walk unfinished."""
    wait = wait or (lambda s: time.sleep(s) or False)
    budget = min(max(budget, 1e-4), 1.0)
    n = 0
    while max_slices is None or n < max_slices:
        n += 1
        t0, c0 = clock(), cpu_clock()
        done = False
        try:
            while clock() - t0 < slice_s:
                next(steps)
        except StopIteration:
            done = True
        d = clock() - t0
        dc = cpu_clock() - c0
        walk.max_slice_cpu_s = max(walk.max_slice_cpu_s, dc)
        walk.busy_s += d
        walk.slices += 1
        walk.max_slice_s = max(walk.max_slice_s, d)
        if len(walk.slice_durations) < 100_000:
            walk.slice_durations.append(d)
            walk.slice_cpu.append(dc)
        if done:
            return True
        if budget < 1.0 and wait(d * (1.0 - budget) / budget):
            return False
    return None


# --- roots ------------------------------------------------------------------------------------

def frame_roots(exclude_thread: int | None = None) -> list[tuple[str, object]]:
    """The ``self`` of every frame of every other thread, outermost frames first (the long-lived
    objects: the busy loop's engine before a helper's), named by class."""
    out: list[tuple[str, object]] = []
    seen: set[int] = set()
    names: dict[str, int] = {}
    try:
        frames = sys._current_frames()
    except Exception:
        return out
    for tid, top in frames.items():
        if tid == exclude_thread:
            continue
        stack = []
        f = top
        while f is not None and len(stack) < 256:
            stack.append(f)
            f = f.f_back
        for f in reversed(stack):
            code = f.f_code
            if not code.co_argcount or code.co_varnames[0] != "self":
                continue
            try:
                obj = f.f_locals.get("self")
            except Exception:
                continue
            if obj is None or id(obj) in seen or _kind(type(obj))[0] != _OBJ:
                continue
            seen.add(id(obj))
            name = _type_name(type(obj))
            names[name] = names.get(name, 0) + 1
            out.append((name if names[name] == 1 else f"{name}#{names[name]}", obj))
    del frames
    return out


def module_roots() -> Iterator[tuple[str, object]]:
    """``module.global`` for every loaded module (modules, classes, functions are not walked)."""
    for mod_name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None)
        if type(d) is not dict:
            continue
        for k, v in list(d.items()):
            if type(k) is str and not k.startswith("__"):
                yield f"{mod_name}.{k}", v


# --- growth -----------------------------------------------------------------------------------

@dataclass(slots=True)
class Grower:
    owner: str
    length: int
    instances: int
    growth_per_h: float  # elements per hour (least squares over the kept walks)
    bytes_per_element: float
    bytes_per_h: float
    walks: int
    first_length: int

    def as_dict(self) -> dict:
        return {"owner": self.owner, "length": self.length, "instances": self.instances,
                "growth_per_h": round(self.growth_per_h, 3), "bytes_per_element": round(self.bytes_per_element, 1),
                "bytes_per_h": round(self.bytes_per_h, 1), "walks": self.walks, "first_length": self.first_length}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per second) of (t, y) points; 0 with fewer than 2 or no spread."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mt) ** 2 for p in points)
    if sxx <= 0:
        return 0.0
    return sum((p[0] - mt) * (p[1] - my) for p in points) / sxx


def steady_growth(points: list[tuple[float, float]], min_walks: int = 3) -> bool:
    """Growing steadily: at least ``min_walks`` walks, ending above where it began, the length
    never falling by more than 10 % between walks and rising in at least two thirds of them
    (a queue that fills and drains with load is not a leak)."""
    if len(points) < min_walks:
        return False
    ys = [p[1] for p in points]
    if ys[-1] <= ys[0]:
        return False
    ups = sum(1 for a, b in pairwise(ys) if b > a)
    falls = any(b < 0.9 * a for a, b in pairwise(ys))
    return not falls and ups >= (2 * (len(ys) - 1)) / 3


class GrowthTracker:
    """Length history of the tracked owner paths and the process's RSS, over the last ``keep`` walks."""

    def __init__(self, max_tracked: int = 1000, keep: int = 12, min_walks: int = 3) -> None:
        self.max_tracked, self.keep, self.min_walks = max_tracked, keep, min_walks
        self.series: dict[str, deque] = {}
        self.bytes_per_element: dict[str, float] = {}
        self.instances: dict[str, int] = {}
        self.phase: dict[str, int] = {}
        self.rss: deque = deque(maxlen=keep)
        self.walks = 0

    def add(self, walk: Walk, rss: float | None = None) -> None:
        """Fold one walk in. A path the walk did not find is dropped (gone, or below ``min_len``)
        only if the walk covered its phase: a frames-only walk leaves module-global paths alone."""
        self.walks += 1
        if rss is not None:
            self.rss.append((walk.finished or walk.started, float(rss)))
        found = walk.containers
        covered = 1 if walk.full else 0
        for p in [p for p in self.series if p not in found and self.phase.get(p, 0) == covered]:
            del self.series[p]
            for d in (self.bytes_per_element, self.instances, self.phase):
                d.pop(p, None)
        # paths already followed keep their place; new ones fill what is left, longest first
        keep = [p for p in found if p in self.series]
        room = max(self.max_tracked - len(self.series), 0)
        new = sorted((p for p in found if p not in self.series), key=lambda p: found[p][0], reverse=True)[:room]
        for p in keep + new:
            n, inst, bpe, t, phase = found[p]
            self.series.setdefault(p, deque(maxlen=self.keep)).append((t, float(n)))
            self.bytes_per_element[p] = bpe
            self.instances[p] = inst
            self.phase[p] = phase

    def growers(self, top: int = 5) -> list[Grower]:
        """The ``top`` steady growers by estimated bytes per hour. Cheap on purpose (it runs inside
        one GIL slice): a first O(1) ranking of every path by (last - first) length x bytes per
        element over the time between, then the fits only for the best ``4 * top`` candidates."""
        rough = []
        for p, pts in self.series.items():
            if len(pts) >= self.min_walks and pts[-1][1] > pts[0][1] and pts[-1][0] > pts[0][0]:
                rough.append(((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
                              * max(self.bytes_per_element.get(p, 0.0), 1.0), p))
        out = []
        for _, p in heapq.nlargest(4 * top, rough):
            pts_l = list(self.series[p])
            if not steady_growth(pts_l, self.min_walks):
                continue
            g = slope(pts_l) * 3600.0
            if g <= 0:
                continue
            bpe = self.bytes_per_element.get(p, 0.0)
            out.append(Grower(p, int(pts_l[-1][1]), self.instances.get(p, 1), g, bpe, g * bpe, len(pts_l),
                              int(pts_l[0][1])))
        out.sort(key=lambda g: (g.bytes_per_h, g.growth_per_h), reverse=True)
        return out[:top]

    def rss_slope_per_h(self) -> float | None:
        return slope(list(self.rss)) * 3600.0 if len(self.rss) >= 2 else None


def explained(growers: list[Grower], rss_bytes_per_h: float | None) -> tuple[float | None, float | None]:
    """(share of the RSS slope the growers' estimated bytes explain, unexplained bytes/h);
    None where the RSS does not grow."""
    if rss_bytes_per_h is None or not math.isfinite(rss_bytes_per_h) or rss_bytes_per_h <= 0:
        return None, None
    got = sum(g.bytes_per_h for g in growers)
    return got / rss_bytes_per_h, rss_bytes_per_h - got


# --- the thread -------------------------------------------------------------------------------

def walk_stats(w: Walk | None) -> dict | None:
    """What one walk cost and covered (the census file's ``walk`` / ``full_walk``)."""
    if w is None:
        return None
    slices, cpu = sorted(w.slice_durations), sorted(w.slice_cpu)
    return {"started": w.started, "finished": w.finished, "full": w.full, "busy_s": round(w.busy_s, 6),
            "wall_s": round(w.finished - w.started, 3), "slices": w.slices,
            "max_slice_s": round(w.max_slice_s, 6), "max_slice_cpu_s": round(w.max_slice_cpu_s, 6),
            "p99_slice_s": round(slices[int(0.99 * (len(slices) - 1))], 6) if slices else 0.0,
            "p99_slice_cpu_s": round(cpu[int(0.99 * (len(cpu) - 1))], 6) if cpu else 0.0,
            "objects": w.objects, "max_queued": w.max_queued, "roots": w.roots, "containers": len(w.containers),
            "truncated": w.truncated, "frame_roots": w.root_names}


def _env_float(name: str, default: float, env=None) -> float:
    env = os.environ if env is None else env
    try:
        v = float(env.get(name, default))
    except ValueError:
        return default
    return v if math.isfinite(v) and v > 0 else default


def _rss() -> float | None:
    try:
        with open("/proc/self/statm") as fh:
            return float(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def request_file(run_dir: Path | None, env=None) -> Path | None:
    env = os.environ if env is None else env
    if env.get(ENV_REQUEST_FILE):
        return Path(env[ENV_REQUEST_FILE])
    return run_dir / REQUEST_NAME if run_dir is not None else None


def read_request(path: Path | None, now: float) -> float | None:
    """The requested interval while a census request is open (``inf`` for a pause: no walk
    starts or advances), else None."""
    if path is None:
        return None
    try:
        req = json.loads(path.read_text())
        until, interval = float(req.get("until", 0)), float(req.get("interval_s", DEFAULT_FAST_INTERVAL_S))
        pause = req.get("pause") is True
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if not (math.isfinite(until) and math.isfinite(interval)) or until < now:
        return None
    return math.inf if pause else max(interval, MIN_INTERVAL_S)


def write_request(path: Path, interval_s: float, until: float, pause: bool = False) -> None:
    """Open (or extend) a census request, or a pause (atomic: tmp + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"interval_s": interval_s, "until": until, "pause": pause}))
    os.replace(tmp, path)


class CensusThread(BackgroundLoop):
    """The daemon thread of one process: walk, track, write ``census-<pid>.json``."""

    thread_name = "sla-guard-census"

    def __init__(self, run_dir: Path, *, interval_s: float | None = None, fast_interval_s: float | None = None,
                 start_delay_s: float | None = None, slice_s: float | None = None, budget: float | None = None,
                 limits: Limits | None = None, top: int | None = None, full_every: int | None = None,
                 env=None) -> None:
        env = os.environ if env is None else env
        self.run_dir = run_dir
        self.interval_s = max(interval_s or _env_float(ENV_INTERVAL, DEFAULT_INTERVAL_S, env), MIN_INTERVAL_S)
        self.fast_interval_s = max(fast_interval_s or _env_float(ENV_FAST_INTERVAL, DEFAULT_FAST_INTERVAL_S, env),
                                   MIN_INTERVAL_S)
        self.start_delay_s = (start_delay_s if start_delay_s is not None
                              else _env_float(ENV_START_DELAY, DEFAULT_START_DELAY_S, env))
        self.slice_s = min(slice_s or _env_float(ENV_SLICE_MS, DEFAULT_SLICE_S * 1000, env) / 1000, MAX_SLICE_S)
        self.budget = min(budget or _env_float(ENV_BUDGET, DEFAULT_BUDGET, env), 1.0)
        self.limits = limits or Limits(max_objects=int(_env_float(ENV_MAX_OBJECTS, Limits().max_objects, env)))
        self.top = int(top or _env_float(ENV_TOP, 5, env))
        self.full_every = max(int(full_every or _env_float(ENV_FULL_EVERY, DEFAULT_FULL_EVERY, env)), 1)
        self.request = request_file(run_dir, env)
        self.tracker = GrowthTracker(self.limits.max_tracked)
        self.pid = os.getpid()
        self.last: Walk | None = None
        self.last_full: Walk | None = None
        self.errors = 0
        super().__init__()

    def current_interval(self, now: float) -> float:
        fast = read_request(self.request, now)
        if fast == math.inf:
            return fast  # paused
        return min(fast, self.interval_s) if fast is not None else self.interval_s

    def start_walk(self, full: bool, write: bool = True) -> tuple[Walk, Iterator[None]]:
        """A walk not yet run: from the frames' objects, or (``full``) from module globals; its
        steps end with folding it into the tracker and (``write``) writing the census file."""
        walk = Walk(started=time.time(), full=full)
        skip = [id(self), id(self.tracker), id(self.tracker.series), id(walk), id(walk.containers)]
        me = threading.get_ident()
        steps = walk_steps(lambda: frame_roots(me), self.limits, walk, skip_ids=skip,
                           more_roots=module_roots if full else None, record_from=1 if full else 0)
        return walk, self._steps(walk, steps, write)

    def _steps(self, walk: Walk, steps: Iterator[None], write: bool) -> Iterator[None]:
        """The walk, then folding it in and writing the file, each its own slice."""
        yield from steps
        walk.finished = time.time()
        yield
        self.tracker.add(walk, _rss())
        self.last = walk
        if walk.full:
            self.last_full = walk
        if write:
            yield
            self.write()

    def advance(self, walk: Walk, steps: Iterator[None], max_slices: int | None = None) -> bool | None:
        """Run a walk's ``steps`` in budgeted slices. True: done (folded in, file written);
        False: stopped; None: ``max_slices`` ran out first (call again with the same steps)."""
        done = run_sliced(steps, walk, slice_s=self.slice_s, budget=self.budget, wait=self._stop.wait,
                          max_slices=max_slices)
        if done is not None:
            steps.close()
        return done

    def walk_once(self, full: bool = False, write: bool = False) -> Walk | None:
        """One whole walk, blocking this thread (never the others for longer than a slice)."""
        walk, steps = self.start_walk(full, write)
        return walk if self.advance(walk, steps) else None

    def result(self) -> dict:
        """The census file's content: the top growers with their length history, the RSS slope
        and the share of it they explain, the largest containers, and the cost of the last walks."""
        w = self.last
        growers = self.tracker.growers(self.top)
        rss_slope = self.tracker.rss_slope_per_h()
        share, rest = explained(growers, rss_slope)
        largest: dict[str, list] = {}
        for walk in (self.last_full, w):
            if walk is not None:
                largest.update(heapq.nlargest(10, walk.containers.items(), key=lambda kv: kv[1][0]))
        return {
            "pid": self.pid, "ts": w.finished if w else time.time(), "walks": self.tracker.walks,
            "errors": self.errors,
            "walk": walk_stats(w), "full_walk": walk_stats(self.last_full),
            "settings": {"interval_s": self.interval_s, "fast_interval_s": self.fast_interval_s,
                         "slice_s": self.slice_s, "budget": self.budget, "max_objects": self.limits.max_objects,
                         "full_every": self.full_every},
            "rss_bytes_per_h": rss_slope, "explained_ratio": share, "unexplained_bytes_per_h": rest,
            "rss": [[round(t, 3), v] for t, v in self.tracker.rss],
            "growers": [g.as_dict() | {"history": [[round(t, 3), n] for t, n in self.tracker.series[g.owner]]}
                        for g in growers],
            "largest": [{"owner": p, "length": r[0], "instances": r[1]} for p, r in
                        sorted(largest.items(), key=lambda kv: kv[1][0], reverse=True)[:10]],
        }

    def write(self) -> Path:
        path = self.run_dir / f"{CENSUS_PREFIX}{self.pid}.json"
        tmp = self.run_dir / f".{CENSUS_PREFIX}{self.pid}.tmp"
        tmp.write_text(json.dumps(self.result(), separators=(",", ":")))
        os.replace(tmp, path)
        return path

    def _run(self) -> None:
        """Frames walks every interval (short: the engine's objects), run whole; a module-globals
        walk every ``full_every`` intervals, long, advanced one slice at a time in between, so it
        never delays a frames walk. Both share the GIL budget (each slice is followed by its sleep)."""
        if self._stop.wait(self.start_delay_s):
            return
        last = last_full = -math.inf
        full: tuple[Walk, Iterator[None]] | None = None
        while not self._stop.is_set():
            now = time.time()
            interval = self.current_interval(now)  # a request shortens the wait already begun
            try:
                if now - last >= interval:
                    last = now  # a walk longer than the interval runs back to back
                    self.advance(*self.start_walk(False))
                    continue
                if full is None and now - last_full >= interval * self.full_every:
                    last_full = now
                    full = self.start_walk(True)
                if full is not None and interval != math.inf:
                    if self.advance(*full, max_slices=1) is not None:
                        full = None
                    continue
            except Exception:  # never let the census hurt the host process
                full = None
                self.errors += 1
                if self.errors == 1:
                    log.warning("sla-guard census failed in pid %d", self.pid, exc_info=True)
                with contextlib.suppress(Exception):  # the count reaches the exporter even if no walk ends
                    self.write()
                continue
            self._stop.wait(min(POLL_S, max(last + interval - now, 0.05)))


def enabled(env=None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV_ENABLE, "1") != "0"


def census_path(run_dir: Path, pid: int) -> Path:
    return run_dir / f"{CENSUS_PREFIX}{pid}.json"


def run_dir_from_env(env=None) -> Path | None:
    env = os.environ if env is None else env
    return Path(env[ENV_RUN_DIR]) if env.get(ENV_RUN_DIR) else None
