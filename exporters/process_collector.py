"""Turn the run directory's per-process snapshots into the contract's PROCESS metrics.

Two ways to reach vLLM's /metrics, chosen by how vLLM serves it (docs/hooks.md):

* one API server: /metrics serves prometheus_client's default REGISTRY, so a custom
  ``SnapshotCollector`` registered there reads the snapshot files at scrape time;
* several API servers (PROMETHEUS_MULTIPROC_DIR set): /metrics serves a fresh registry holding
  only a MultiProcessCollector over the mmap files, so a collector cannot be added. There one
  API server (elected with a file lock, taking over if it dies) writes the snapshots' series
  every interval into mmap files of its own there, where vLLM's collector finds them.

Labels: model and pool come from the API server's vLLM config; engine from the DP rank in the
process title (a worker without one inherits its parent EngineCore's); role and process from
the title; PID and start time in slaguard_process_info.

Shared by the vLLM plugin (``engine_hooks.stat_logger``) and ``exporters.sidecar``, hence here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.registry import Collector

from exporters import contract as c
from exporters.process_sampler import CENSUS_PREFIX, SNAPSHOT_PREFIX, Snapshot

log = logging.getLogger("sla_guard.process_collector")

MAX_SNAPSHOTS = 4096  # bound on files read per scrape (a runaway fork loop must not hurt scrapes)
MAX_CENSUS_OWNERS = 20  # owner series per process, whatever a census file says (cardinality bound)


def read_snapshots(run_dir: Path, stale_after_s: float, now: float | None = None,
                   remove_dead: bool = True) -> list[Snapshot]:
    """Snapshots of live processes; files of dead PIDs are removed, stale ones skipped."""
    now = time.time() if now is None else now
    out: list[Snapshot] = []
    try:
        paths = sorted(run_dir.glob(f"{SNAPSHOT_PREFIX}*.json"))[:MAX_SNAPSHOTS]
    except OSError:
        return out
    for path in paths:
        try:
            snap = Snapshot.from_json(path.read_text())
        except (OSError, ValueError, TypeError):
            continue  # being replaced or garbage: skip this scrape
        alive = _alive(snap)
        if not alive:
            if remove_dead:
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        if now - snap.ts > stale_after_s:
            continue
        out.append(snap)
    return out


def read_census(run_dir: Path, pids: Iterable[int]) -> dict[int, dict]:
    """The object census (engine_hooks/census.py) of each live process in ``pids``: the
    ``census-<pid>.json`` beside its snapshot; missing or garbled files are skipped, files of
    processes without a live snapshot are removed."""
    out: dict[int, dict] = {}
    live = set(pids)
    try:
        paths = sorted(run_dir.glob(f"{CENSUS_PREFIX}*.json"))[:MAX_SNAPSHOTS]
    except OSError:
        return out
    for path in paths:
        try:
            pid = int(path.stem[len(CENSUS_PREFIX):])
        except ValueError:
            continue
        if pid not in live:
            if not (run_dir / f"{SNAPSHOT_PREFIX}{pid}.json").exists():  # its process is gone
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[pid] = data
    return out


def census_rows(data: dict, labels: tuple[str, ...]):
    """(metric, label values, value) rows of one process's census file."""
    walk = data.get("walk") if isinstance(data.get("walk"), dict) else {}
    for m, key in ((c.CENSUS_WALK_SECONDS, "busy_s"), (c.CENSUS_WALK_MAX_SLICE, "max_slice_s"),
                   (c.CENSUS_OBJECTS, "objects")):
        v = walk.get(key)
        if isinstance(v, int | float):
            yield m, labels, float(v)
    errors = data.get("errors")
    if isinstance(errors, int | float) and not isinstance(errors, bool):
        yield c.CENSUS_ERRORS, labels, float(errors)
    share = data.get("explained_ratio")
    if isinstance(share, int | float):
        yield c.CENSUS_RSS_EXPLAINED, labels, float(share)
    growers = data.get("growers")
    for g in (growers if isinstance(growers, list) else [])[:MAX_CENSUS_OWNERS]:
        try:  # a garbled entry is skipped, never the scrape
            owner = str(g.get("owner", ""))[:256]
            row = (float(g.get("length", 0)), float(g.get("growth_per_h", 0)) / 3600.0,
                   float(g.get("bytes_per_h", 0)) / 3600.0)
        except (AttributeError, TypeError, ValueError):
            continue
        if owner:
            yield c.CENSUS_CONTAINER_LENGTH, (*labels, owner), row[0]
            yield c.CENSUS_CONTAINER_GROWTH, (*labels, owner), row[1]
            yield c.CENSUS_CONTAINER_BYTES, (*labels, owner), row[2]


def _alive(snap: Snapshot) -> bool:
    """The snapshot's process still runs: same PID and start time (not a reused PID), not a zombie
    (exited, not yet reaped: its last snapshot read as a live process until it went stale)."""
    try:
        proc = psutil.Process(snap.pid)
        with proc.oneshot():
            same = abs(proc.create_time() - snap.start_time) < 1.0
            return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def _report(on_error: Callable[[BaseException], None] | None, exc: BaseException, first: bool, what: str) -> None:
    """Count through the hook's error counter when wired, else log the first occurrence."""
    if on_error is not None:
        with contextlib.suppress(Exception):
            on_error(exc)
    elif first:
        log.warning("sla-guard: %s", what, exc_info=exc)


def engine_label(snap: Snapshot, by_pid: dict[int, Snapshot], dp_size: int) -> str:
    """DP rank as the engine label; "" for processes serving all engines (API servers)."""
    if snap.dp_rank is not None:
        return str(snap.dp_rank)
    if snap.role == "worker":
        parent = by_pid.get(snap.ppid)
        if parent is not None and parent.dp_rank is not None:
            return str(parent.dp_rank)
    if snap.role in ("engine_core", "worker") and dp_size <= 1:
        return "0"
    return ""


def snapshot_rows(snaps: Iterable[Snapshot], model: str, pool: str, dp_size: int,
                  census: dict[int, dict] | None = None):
    """Yield (metric, label values, value) for every contract PROCESS sample of ``snaps``
    (and of their census files, ``census`` by PID, see ``read_census``)."""
    snaps = list(snaps)
    by_pid = {s.pid: s for s in snaps}
    keyed = [(s, (model, pool, engine_label(s, by_pid, dp_size), s.role, s.process)) for s in snaps]
    oldest: dict[tuple, int] = {}
    for s, labels in sorted(keyed, key=lambda k: (k[0].start_time, k[0].pid)):
        oldest.setdefault(labels, s.pid)
    for s, labels in keyed:
        # same title twice (a helper forked from EngineCore or a worker inherits its title, early
        # workers): the oldest keeps the name, the others get a PID suffix. Suffixing all of them
        # renamed EngineCore's own series for as long as a helper lived (its history cut in two)
        if oldest[labels] != s.pid:
            labels = (*labels[:4], f"{s.process}_pid{s.pid}")
        yield c.PROCESS_RSS, labels, float(s.rss)
        for kind, v in s.memory.items():
            yield c.PROCESS_MEMORY, (*labels, kind), float(v)
        for gen, n in enumerate(s.gc_collections):
            yield c.PROCESS_GC_COLLECTIONS, (*labels, str(gen)), float(n)
        if s.gc_frozen is not None:
            yield c.PROCESS_GC_FROZEN, labels, float(s.gc_frozen)
        yield c.PROCESS_THREADS, labels, float(s.threads)
        if s.fds is not None:  # unreadable: absent (unknown), not 0
            yield c.PROCESS_OPEN_FDS, labels, float(s.fds)
        yield c.PROCESS_INFO, (*labels, str(s.pid), f"{s.start_time:.0f}"), 1.0
        if census and s.pid in census:
            yield from census_rows(census[s.pid], labels)


def families(rows) -> list[Metric]:
    """Rows -> prometheus_client metric families (one per contract metric)."""
    fams: dict[str, Metric] = {}
    for m, labels, value in rows:
        fam = fams.get(m.name)
        if fam is None:
            cls = CounterMetricFamily if m.kind is c.Kind.COUNTER else GaugeMetricFamily
            fam = fams[m.name] = cls(m.name, m.help, labels=list(m.labels))
        fam.add_metric(list(labels), value)
    return list(fams.values())


class SnapshotCollector(Collector):
    """Custom collector for the default registry (one-API-server mode)."""

    def __init__(self, run_dir: Path, model: str, pool: str, dp_size: int, stale_after_s: float,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.run_dir, self.model, self.pool, self.dp_size = run_dir, model, pool, dp_size
        self.stale_after_s = stale_after_s
        self.on_error = on_error
        self.errors = 0

    def collect(self) -> Iterator[Metric]:
        try:
            snaps = read_snapshots(self.run_dir, self.stale_after_s)
            census = read_census(self.run_dir, [s.pid for s in snaps])
            yield from families(snapshot_rows(snaps, self.model, self.pool, self.dp_size, census))
        except Exception as e:  # a scrape must never fail because of us
            self.errors += 1
            _report(self.on_error, e, self.errors == 1, "reading process snapshots failed")

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families depend on what processes exist


class MultiprocessMirror:
    """Multi-API-server mode: the lock holder writes the snapshots' contract series into mmap files
    of its own in PROMETHEUS_MULTIPROC_DIR, where vLLM's MultiProcessCollector reads them.

    Why its own files, rewritten whole each round (temp file + rename): prometheus_client's values
    live in the leader's per-PID files, which cannot forget a label set, so every process that ever
    lived (each forked helper a new ``_pid<PID>`` series, and its ``process_info``) was exported
    for as long as vLLM ran. Counters are written as the snapshots' totals, not as increments: a
    new leader no longer adds them again next to the old leader's file."""

    FILE_ID = "slaguard-mirror"  # in place of a PID in the file names (no "_": the collector splits on it)

    def __init__(self, run_dir: Path, mp_dir: Path, model: str, pool: str, dp_size: int,
                 interval: float, stale_after_s: float,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.on_error = on_error
        self.run_dir, self.mp_dir, self.model, self.pool, self.dp_size = run_dir, Path(mp_dir), model, pool, dp_size
        self.interval, self.stale_after_s = interval, stale_after_s
        self._prefixes: set[str] = set()  # files written once are always rewritten (empty if need be)
        self._write_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="sla-guard-mp-mirror", daemon=True)

    def start(self) -> MultiprocessMirror:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def leader(self) -> bool:
        if self._lock_fd is not None:
            return True
        fd = os.open(self.run_dir / "mp-mirror.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def mirror_once(self) -> None:
        """One round: the live processes' series, and nothing else, in the mirror's files."""
        snaps = read_snapshots(self.run_dir, self.stale_after_s)
        census = read_census(self.run_dir, [s.pid for s in snaps])
        now = time.time()  # a "mostrecent" gauge sample without a time is never served
        files: dict[str, list[tuple[str, float, float]]] = {}
        for m, labels, value in snapshot_rows(snaps, self.model, self.pool, self.dp_size, census):
            if m.kind is c.Kind.COUNTER:  # prometheus_client's key for a counter sample
                prefix, sample, ts = "counter", m.name + "_total", 0.0
            else:
                prefix, sample, ts = f"gauge_{m.multiprocess_mode}", m.name, now
            files.setdefault(prefix, []).append((mmap_key(m.name, sample, list(m.labels), list(labels), m.help),
                                                 value, ts))
        with self._write_lock:
            self._prefixes |= files.keys()
            for prefix in sorted(self._prefixes):
                self._replace(self.mp_dir / f"{prefix}_{self.FILE_ID}.db", files.get(prefix, []))

    @staticmethod
    def _replace(path: Path, entries: list[tuple[str, float, float]]) -> None:
        """Write ``entries`` to a temp file and rename it over ``path``: a scrape reads the old or
        the new file, never half of one, and never finds it missing (the collector raises then)."""
        tmp = path.with_name(path.name + ".tmp")  # not *.db: the collector does not read it
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # MmapedDict would keep the entries of a file left by a crash
        d = MmapedDict(str(tmp))
        try:
            for key, value, ts in entries:
                d.write_value(key, value, ts)
        finally:
            d.close()
        os.replace(tmp, path)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.leader():
                    self.mirror_once()
            except Exception as e:
                self.errors += 1
                _report(self.on_error, e, self.errors == 1, "multiprocess mirror failed")
            self._stop.wait(self.interval)
