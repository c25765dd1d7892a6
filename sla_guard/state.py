"""Crash-safe state for the guard: one SQLite file in WAL mode, written once per tick.

Why SQLite/WAL: a transaction commits by appending to the write-ahead log, so a ``kill -9`` at any
moment leaves either the previous tick's state or this tick's, never a torn mix, and opening the
file after a crash replays the log in milliseconds. ``synchronous=NORMAL`` (the default here):
in WAL mode a commit is then durable against a *process* crash (kill -9, OOM kill, a pod restart:
the WAL pages are in the OS page cache), and only a power loss or kernel crash can drop the last
commits since a checkpoint (the file stays consistent). ``FULL`` adds one fsync per tick, for
hosts where that matters more than the fsync's cost.

Schema (``PRAGMA user_version`` = 2):

- ``kv(component, part, value, updated_at, crc)``: each stateful component's snapshot, in parts, so
  a tick rewrites only what changed (an SLO ledger's current bucket chunk, not 30 days of them);
- ``log(id, stream, t, value, crc)``: append-only records (the advisor's decisions), trimmed by age.

``crc`` is the CRC32 of the names and the stored value, checked at load: a damaged value that is
still valid JSON (a flipped digit of an error-budget count) is skipped and counted as unreadable,
never restored as a different number. A version-1 file (no ``crc``) is migrated when opened: the
column is added and filled from the rows as they are, which then load as they did before.

Components implement the ``Stateful`` protocol; the store never looks inside their parts. A
damaged file (not a database, malformed, fails its integrity check) is moved aside
(``<name>.corrupt-<unix time>``) and a fresh one started; ``status()`` says so, and the guard
serves that on ``/v1/status``. A file that is fine but unusable now (locked, read-only, disk full,
newer schema) raises ``StateUnavailable`` at start instead: a fresh file would forget the budgets.
So does a file another guard has open (``<name>.lock``, an ``flock`` held while the store is
open): two guards writing one file would each restore the other's ledgers and findings. With
``retry=True`` (``serve``) a condition that may end leaves the store ``detached`` instead: nothing
read or written, ``attach`` tries again, and the guard restores the file before saving to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("sla_guard.state")

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (component TEXT NOT NULL, part TEXT NOT NULL, value TEXT NOT NULL,
                               updated_at REAL NOT NULL, crc INTEGER,
                               PRIMARY KEY (component, part)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS log (id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, t REAL NOT NULL,
                                value TEXT NOT NULL, crc INTEGER);
CREATE INDEX IF NOT EXISTS log_stream_t ON log (stream, t);
"""


def _crc(*fields: bytes) -> int:
    """CRC32 over a row's names and value, as stored (UTF-8): a single flipped bit anywhere in them
    always changes it, so damage is reported instead of restored as a different value."""
    return zlib.crc32(b"\0".join(fields))


@runtime_checkable
class Stateful(Protocol):
    """What a component (an evaluator, the findings book) implements to survive a restart.

    ``state_dump(full)`` returns {part: JSON-able value}; with ``full=False`` it may return only
    the parts changed since its previous dump, and ``None`` as a value deletes a part. With
    ``full=True`` (the first save, or after the file was replaced) it returns everything.
    ``state_load(parts, records)`` restores from the saved parts and the tail of the
    component's append stream (oldest first), before its first evaluation."""

    def state_dump(self, full: bool) -> dict[str, Any]: ...

    def state_load(self, parts: dict[str, Any], records: list[dict]) -> None: ...


class StateUnavailable(RuntimeError):
    """The state file exists but cannot be used now (locked by another process, read-only, disk
    full, written by a newer guard). Why an error and not a fresh file: starting fresh would
    silently forget the error budgets and findings. ``retry``: a condition that may end while the
    guard runs (a lock, read-only, full, I/O): ``serve`` then runs with persistence off and retries
    (``StateStore(retry=True)``); otherwise (a newer schema, another program's file, a path that
    cannot be a file) it prints this and exits 2."""

    def __init__(self, msg: str, *, retry: bool = False) -> None:
        super().__init__(msg)
        self.retry = retry


class _Corrupt(sqlite3.DatabaseError):
    """``quick_check`` failed: the file itself is bad, so moving it aside loses nothing usable."""


def _is_corrupt(err: sqlite3.Error) -> bool:
    """Only a damaged file is moved aside; locked/read-only/full are conditions to fix, not data to drop."""
    return isinstance(err, _Corrupt) or str(getattr(err, "sqlite_errorname", "")).startswith(
        ("SQLITE_CORRUPT", "SQLITE_NOTADB"))


_TABLES = {"kv": ["component", "part", "value", "updated_at", "crc"], "log": ["id", "stream", "t", "value", "crc"]}


def _foreign_table(conn: sqlite3.Connection) -> str | None:
    """The first table that is not the guard's (another program's database at ``state.path``), or
    None. Checked before anything is written: the schema's ``IF NOT EXISTS`` took another ``kv``
    table for its own, stamped the file as ours and then failed with a traceback at every start."""
    names = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    for name in names:
        if name == "sqlite_sequence":
            continue
        cols = [r[0] for r in conn.execute("SELECT name FROM pragma_table_info(?)", (name,))]
        if name not in _TABLES or cols not in (_TABLES[name], _TABLES[name][:-1]):  # v2, or v1 without crc
            return f"table {name}({', '.join(cols)})"
    return None


_SAVE_FIX = ("the guard keeps running and retries at every tick, but what it learns meanwhile is only in memory: "
             "free disk space, make the file and its directory writable, or stop what holds the file")
_FIX = ("another sla-guard or tool may hold it, or the file/directory is read-only, or the disk is full: fix "
        "that, or set state.path to another file (moving this one away starts fresh and forgets the error budgets)")


class StateStore:
    """One SQLite file; every method is safe to call from the tick thread and the API thread."""

    def __init__(self, path: str | Path, *, max_bytes: int = 256 * 1024 * 1024, retention_s: float = 31 * 86400.0,
                 synchronous: str = "normal", clock=time.time, retry: bool = False) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.retention_s = float(retention_s)
        self.synchronous = synchronous.upper()
        self.clock = clock
        self._lock = threading.Lock()
        self.moved_aside: str | None = None  # where an unreadable file went
        self.problem: str | None = None
        self.errors = 0
        self.saves = 0
        self.last_save_at: float | None = None
        self.last_save_ms: float | None = None
        self.trimmed = 0
        self.unreadable = 0  # parts/records skipped at restore (damaged)
        self._bad_records: set[int] = set()  # log rows already counted in unreadable
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        # why the file is not in use (``retry=True`` and a condition that may end): nothing is read
        # or written, the file is left as it is, and ``attach`` tries again
        self.detached: str | None = None
        try:
            self._connect(5.0)
        except StateUnavailable as err:
            if not (retry and err.retry):
                raise
            self._detach(err)

    def _connect(self, busy_s: float) -> None:
        """Lock and open the file (a damaged one is moved aside and a fresh one started)."""
        try:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as err:  # config: retrying will not help
                raise StateUnavailable(f"state file {self.path} cannot be created ({err}): a part of the "
                                       f"path is a file; set state.path to a file in a directory") from err
            if self.path.is_dir():
                raise StateUnavailable(f"state file {self.path} is a directory: set state.path to a file in it")
            self._lock_fd = self._take_lock()
            try:
                self._conn = self._open(busy_s)
            except sqlite3.DatabaseError as err:
                if not _is_corrupt(err):
                    raise
                self._move_aside(f"{type(err).__name__}: {err}")
                self._conn = self._open(busy_s)
        except (sqlite3.Error, OSError, StateUnavailable) as err:
            self._release_lock()
            if isinstance(err, StateUnavailable):
                raise
            raise StateUnavailable(f"state file {self.path} cannot be used ({type(err).__name__}: {err}); "
                                   f"{_FIX}", retry=True) from err

    def _detach(self, err: StateUnavailable) -> None:
        """Persistence off, for ``err`` (logged, and on ``/v1/status``)."""
        self.detached = str(err)
        self.problem = f"persistence is off: {err}; the guard serves without it and retries at every tick"
        log.error("%s", self.problem)

    def attach(self) -> bool:
        """Try again to use a file that could not be used at start (``detached``). True once it
        is open and locked: the caller then restores from it (``load``, ``tail``) before saving,
        so what the file holds is never overwritten by what was learned without it. Never raises;
        the busy wait is short, as this runs on the tick thread."""
        if self.detached is None:
            return True
        try:
            self._connect(0.2)
            self._conn.execute("PRAGMA busy_timeout=5000")
        except StateUnavailable as err:
            if str(err) != self.detached:  # said once per cause
                self._detach(err)
            return False
        self.detached = self.problem = None
        log.warning("state file %s: usable again; restoring it and saving from now on", self.path)
        return True

    def _take_lock(self) -> int:
        """An exclusive ``flock`` on ``<name>.lock`` for as long as this store is open (released
        by the kernel when the process dies, so a crash never leaves it held). Local filesystems
        only, as the file-lock elector: flock over NFS is not reliable."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise StateUnavailable(f"state file {self.path} is in use by another sla-guard ({holder}; lock "
                                   f"{lock_path}): each guard needs its own state.path, or stop the other",
                                   retry=True) from None
        except OSError:
            os.close(fd)
            raise
        note = f"pid {os.getpid()} on {socket.gethostname()}".encode()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note, 0)
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    # -- opening ---------------------------------------------------------------------------------
    def _open(self, busy_s: float = 5.0) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), timeout=busy_s, isolation_level=None, check_same_thread=False)
        try:
            if foreign := _foreign_table(conn):
                raise StateUnavailable(f"state file {self.path} is not an sla-guard state file (it has {foreign}); "
                                       f"left untouched: set state.path to a file of the guard's own")
            conn.execute("PRAGMA journal_mode=WAL").fetchone()
            conn.execute(f"PRAGMA synchronous={'FULL' if self.synchronous == 'FULL' else 'NORMAL'}")
            conn.execute("PRAGMA journal_size_limit=8388608")  # the WAL shrinks back after a checkpoint
            ok = conn.execute("PRAGMA quick_check").fetchone()
            if not ok or ok[0] != "ok":
                raise _Corrupt(f"quick_check: {ok[0] if ok else 'no answer'}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, 1, SCHEMA_VERSION):
                raise StateUnavailable(f"state file {self.path} has schema version {version}, this guard reads "
                                       f"{SCHEMA_VERSION}: run the sla-guard that wrote it, or set state.path to "
                                       f"another file (moving this one away forgets the error budgets)")
            conn.executescript(_SCHEMA)
            self._add_checksums(conn)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except Exception:
            conn.close()
            raise
        return conn

    @staticmethod
    def _add_checksums(conn: sqlite3.Connection) -> None:
        """Migrate a version-1 file: add ``crc`` and fill it from the rows as they are (one
        transaction), so its parts load as before and every later write is checked."""
        missing = [t for t in _TABLES
                   if "crc" not in [r[0] for r in conn.execute("SELECT name FROM pragma_table_info(?)", (t,))]]
        if not missing:
            return
        conn.create_function("guard_crc", -1, lambda *f: _crc(*f), deterministic=True)
        conn.execute("BEGIN IMMEDIATE")
        try:
            if "kv" in missing:
                conn.execute("ALTER TABLE kv ADD COLUMN crc INTEGER")
                conn.execute("UPDATE kv SET crc = guard_crc(CAST(component AS BLOB), CAST(part AS BLOB), "
                             "CAST(value AS BLOB))")
            if "log" in missing:
                conn.execute("ALTER TABLE log ADD COLUMN crc INTEGER")
                conn.execute("UPDATE log SET crc = guard_crc(CAST(stream AS BLOB), CAST(value AS BLOB))")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        log.info("state: %s: added checksums to a version-1 file", ", ".join(missing))

    def _move_aside(self, why: str) -> None:
        """Keep the bad file for a post-mortem, never crash the guard over it. A name already
        taken (another file moved aside that second, or a clock stepped back) gets ``.1``, ``.2``:
        ``os.replace`` overwrote the earlier copy, the only one left of what it held."""
        base = dest = self.path.with_name(f"{self.path.name}.corrupt-{int(self.clock())}")
        n = 0
        while any(os.path.lexists(str(dest) + suffix) for suffix in ("", "-wal", "-shm")):
            n += 1
            dest = base.with_name(f"{base.name}.{n}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                with contextlib.suppress(OSError):
                    os.replace(src, str(dest) + suffix)
        self.moved_aside = str(dest)
        self.problem = f"state file {self.path} was unreadable ({why}); moved to {dest}, started fresh"
        log.error("%s", self.problem)

    def reset(self, why: str) -> None:
        """Replace a file that went bad while running: move it aside, open a fresh one."""
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
            self._conn = None
            self._move_aside(why)
            self._conn = self._open()

    # -- reading ---------------------------------------------------------------------------------
    def load(self) -> dict[str, dict[str, Any]]:
        """{component: {part: value}} as last committed. A part that cannot be read (checksum
        mismatch, not UTF-8, not JSON: a damaged page the quick check does not see) is skipped,
        counted in ``unreadable`` and named in ``problem`` (so ``/v1/status`` says what was lost).
        Columns are read as bytes and decoded row by row: one bad byte made sqlite3's own decoding
        raise out of the whole query, and ``serve`` died with a traceback at every start."""
        out: dict[str, dict[str, Any]] = {}
        if self.detached is not None:
            return out
        with self._lock:
            rows = self._conn.execute("SELECT CAST(component AS BLOB), CAST(part AS BLOB), CAST(value AS BLOB), crc "
                                      "FROM kv").fetchall()
        bad: list[str] = []
        for comp, part, value, crc in rows:
            try:
                if crc != _crc(comp, part, value):
                    raise ValueError("checksum mismatch")
                name = (comp.decode(), part.decode())
                out.setdefault(name[0], {})[name[1]] = json.loads(value.decode())
            except ValueError:
                bad.append(f"{comp.decode(errors='replace')}/{part.decode(errors='replace')}")
        if bad:
            self._unreadable(f"{len(bad)} unreadable part(s) skipped: {', '.join(bad[:8])}", len(bad))
        return out

    def tail(self, stream: str, limit: int) -> list[dict]:
        """The newest ``limit`` records of ``stream``, oldest first (unreadable ones skipped and
        counted, as in ``load``). Read from the table itself, newest first, checking every row on
        the way: one damaged entry of the ``(stream, t)`` index (the quick check does not compare
        it with the table) hid every record sorted after it (62 of 180), and a record whose
        stream name was damaged was left out by ``WHERE stream = ?``, neither of them reported."""
        want = stream.encode()
        out: list[dict] = []
        if self.detached is not None:
            return out
        bad = 0
        with self._lock:
            cur = self._conn.execute("SELECT id, CAST(stream AS BLOB), CAST(value AS BLOB), crc FROM log NOT INDEXED "
                                     "ORDER BY id DESC")
            for rid, name, value, crc in cur:
                if len(out) >= limit:
                    break
                try:
                    if crc != _crc(name, value):
                        raise ValueError("checksum mismatch")
                    if name == want:
                        out.append(json.loads(value.decode()))
                except ValueError:
                    if rid not in self._bad_records:  # each damaged row once, whichever stream asks
                        self._bad_records.add(rid)
                        bad += 1
            cur.close()
        if bad:
            self._unreadable(f"{bad} unreadable record(s) skipped reading {stream}", bad)
        return out[::-1]

    def _unreadable(self, what: str, n: int) -> None:
        self.unreadable += n
        self.problem = f"state file {self.path}: {what} (the rest was restored)"
        log.error("%s", self.problem)

    # -- writing ---------------------------------------------------------------------------------
    def save(self, parts: Mapping[str, Mapping[str, Any]], records: Mapping[str, Iterable[dict]] = {},
             now: float | None = None) -> bool:
        """One transaction: upsert/delete parts, append records, apply retention. False (logged,
        counted) when the write failed; the state in the file is then the previous commit's."""
        now = self.clock() if now is None else now
        if self.detached is not None:  # never opened here: the guard restores the file first (attach)
            self.errors += 1
            return False
        t0 = time.perf_counter()
        kv_rows, deletes, log_rows = [], [], []
        for comp, ps in parts.items():
            for part, value in ps.items():
                if value is None:
                    deletes.append((comp, part))
                else:
                    text = json.dumps(value, separators=(",", ":"))
                    kv_rows.append((comp, part, text, now, _crc(comp.encode(), part.encode(), text.encode())))
        for stream, recs in records.items():
            for r in recs:
                text = json.dumps(r, separators=(",", ":"), default=float)
                log_rows.append((stream, float(r.get("t", now)), text, _crc(stream.encode(), text.encode())))
        try:
            with self._lock:
                if self._conn is None:  # a reset's reopen failed: try again each save
                    self._conn = self._open()
                c = self._conn
                c.execute("BEGIN IMMEDIATE")
                try:
                    c.executemany("DELETE FROM kv WHERE component = ? AND part = ?", deletes)
                    c.executemany("INSERT OR REPLACE INTO kv (component, part, value, updated_at, crc) "
                                  "VALUES (?, ?, ?, ?, ?)", kv_rows)
                    c.executemany("INSERT INTO log (stream, t, value, crc) VALUES (?, ?, ?, ?)", log_rows)
                    if self.saves % 64 == 0:
                        self._retain(c, now)
                    c.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        c.execute("ROLLBACK")
                    raise
        except sqlite3.DatabaseError as err:
            self.errors += 1
            if not _is_corrupt(err):  # disk full, locked, read-only: keep running, retry next save
                self._save_failed(err)
                return False
            with contextlib.suppress(sqlite3.Error, StateUnavailable, OSError):
                self.reset(f"{type(err).__name__}: {err}")  # the file went bad under us
            return False
        except (sqlite3.Error, StateUnavailable, OSError) as err:  # never raise into the tick
            self.errors += 1
            self._save_failed(err)
            return False
        self.saves += 1
        if self.problem is not None and self.problem.startswith("state save failed"):
            self.problem = None  # saving again: /v1/status kept reporting a disk-full that had ended
            log.warning("state file %s: saving again", self.path)
        self.last_save_at = now
        self.last_save_ms = (time.perf_counter() - t0) * 1e3
        return True

    def _save_failed(self, err: Exception) -> None:
        """Name the file and the fix: "disk I/O error" alone (a full disk under RLIMIT_FSIZE) said
        neither which file nor what to do."""
        self.problem = f"state save failed: state file {self.path}: {type(err).__name__}: {err}; {_SAVE_FIX}"
        log.warning("%s", self.problem)

    def _retain(self, c: sqlite3.Connection, now: float) -> None:
        """Age first (records and parts older than the longest SLO period), then size: oldest
        records go until the live pages fit ``max_bytes`` (freed pages are reused, so the file
        stops growing instead of shrinking, with no VACUUM on the tick path)."""
        cutoff = now - self.retention_s
        self.trimmed += c.execute("DELETE FROM log WHERE t < ?", (cutoff,)).rowcount
        self.trimmed += c.execute("DELETE FROM kv WHERE updated_at < ?", (cutoff,)).rowcount
        for _ in range(8):
            if self._live_bytes(c) <= self.max_bytes:
                break
            n = c.execute("SELECT COUNT(*) FROM log").fetchone()[0]
            if n == 0:
                self.problem = f"state exceeds max_bytes={self.max_bytes} without any log records to drop"
                break
            self.trimmed += c.execute("DELETE FROM log WHERE id IN (SELECT id FROM log ORDER BY id LIMIT ?)",
                                      (max(1, n // 4),)).rowcount

    @staticmethod
    def _live_bytes(c: sqlite3.Connection) -> int:
        pages = c.execute("PRAGMA page_count").fetchone()[0] - c.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * c.execute("PRAGMA page_size").fetchone()[0]

    def live_bytes(self) -> int:
        """Bytes in use (pages not on the free list): what ``max_bytes`` bounds."""
        with self._lock:
            return self._live_bytes(self._conn)

    def conn_mode(self) -> str:
        with self._lock:
            return self._conn.execute("PRAGMA journal_mode").fetchone()[0]

    def integrity(self) -> str:
        with self._lock:
            return self._conn.execute("PRAGMA integrity_check").fetchone()[0]

    def file_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in (str(self.path), str(self.path) + "-wal") if os.path.exists(p))

    def status(self) -> dict:
        return {"path": str(self.path), "bytes": self.file_bytes(), "max_bytes": self.max_bytes,
                "saves": self.saves, "errors": self.errors, "last_save_at": self.last_save_at,
                "last_save_ms": self.last_save_ms, "trimmed": self.trimmed, "unreadable": self.unreadable,
                "moved_aside": self.moved_aside, "problem": self.problem, "persisting": self.detached is None}

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None
            self._release_lock()

    def __del__(self) -> None:  # a store dropped without close() must not keep the file locked
        if getattr(self, "_lock_fd", None) is not None:
            self._release_lock()


# -- a small JSON codec for components' dataclass state -----------------------------------------

def encode(obj: Any) -> Any:
    """JSON-able form of plain data plus dataclasses, tuples, sets, deques and dicts with
    non-string keys (each tagged so ``decode`` rebuilds the same types)."""
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__dc__": type(obj).__name__,
                "f": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, tuple):
        return {"__t__": [encode(x) for x in obj]}
    if isinstance(obj, set | frozenset):
        return {"__s__": [encode(x) for x in sorted(obj, key=repr)]}
    if isinstance(obj, deque):
        return {"__q__": [encode(x) for x in obj], "max": obj.maxlen}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__d__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if hasattr(obj, "item"):  # numpy scalar
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot persist {type(obj).__name__}")


def decode(obj: Any, classes: Mapping[str, type] = {}, overrides: Mapping[str, Any] = {}) -> Any:
    """Inverse of ``encode``. Dataclasses are rebuilt only from ``classes`` (by name; an unknown
    name raises ``ValueError``); ``overrides`` replaces fields by name (e.g. ``params`` from the
    current configuration rather than the saved one)."""
    if isinstance(obj, list):
        return [decode(x, classes, overrides) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__dc__" in obj:
        cls = classes.get(obj["__dc__"])
        if cls is None:
            raise ValueError(f"unknown state class {obj['__dc__']!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: decode(v, classes, overrides) for k, v in obj["f"].items() if k in names}
        kw.update({k: v for k, v in overrides.items() if k in names})
        return cls(**kw)
    if "__t__" in obj:
        return tuple(decode(x, classes, overrides) for x in obj["__t__"])
    if "__s__" in obj:
        return {decode(x, classes, overrides) for x in obj["__s__"]}
    if "__q__" in obj:
        return deque((decode(x, classes, overrides) for x in obj["__q__"]), maxlen=obj.get("max"))
    if "__d__" in obj:
        return {decode(k, classes, overrides): decode(v, classes, overrides) for k, v in obj["__d__"]}
    return {k: decode(v, classes, overrides) for k, v in obj.items()}


def open_state(config, *, retry: bool = False) -> StateStore | None:
    """The store ``serve`` uses: ``config.state.path``, retention one day past the longest SLO
    period (an older ledger bucket or decision can no longer change any verdict). ``retry``: see
    ``StateStore``."""
    settings = getattr(config, "state", None)
    if settings is None or settings.path is None:
        return None
    from sla_guard.config import parse_duration

    periods = [parse_duration(o.period) for s in config.slos for o in s.objectives] or [30 * 86400.0]
    return StateStore(settings.path, max_bytes=settings.max_bytes, retention_s=max(periods) + 86400.0,
                      synchronous=settings.synchronous, retry=retry)
