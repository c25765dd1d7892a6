"""Per-process host-memory sampler: one cheap daemon thread in every vLLM process.

vLLM exports host memory only for the API-server process (prometheus_client's process
collector), and not at all with several API servers. EngineCore and workers, where the 2026
host-memory leak grew, are invisible. This thread samples, every ``SLA_GUARD_SAMPLE_INTERVAL_S``
seconds (default 5): RSS (psutil), its anon/file/shmem split (/proc/self/status), Python GC
collections and ``gc.get_freeze_count()`` (EngineCore calls gc.freeze(), hiding pre-freeze objects
from gc), threads and open FDs. Each sample is written atomically as ``proc-<pid>.json`` into the
run directory (``SLA_GUARD_RUN_DIR``), which the API server's collector turns into metrics; see
docs/hooks.md for why files and not prometheus_client's multiprocess mode.

Cost: one psutil call, one /proc read and one small file write per interval; nothing on vLLM's
hot path. The freeze count is the exception, read rarely (see ``FreezeCount``). Never raises: a
failing sample is logged once and skipped.

It lives in ``exporters`` (below ``engine_hooks``) because the vLLM plugin and the sidecar both
sample processes with it: neither imports the other.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import psutil

log = logging.getLogger("sla_guard.process_sampler")

ENV_RUN_DIR = "SLA_GUARD_RUN_DIR"
ENV_INTERVAL = "SLA_GUARD_SAMPLE_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0
MAX_INTERVAL_S = 3600.0  # longer is cut to this (see seconds_from_env)
SNAPSHOT_PREFIX = "proc-"
CENSUS_PREFIX = "census-"  # engine_hooks/census.py writes census-<pid>.json beside the snapshots

_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
_DP_RE = re.compile(r"_DP(\d+)")

# Set by the stat logger when it is built in this process: the process is an API server even
# when it has no vLLM title (single-API-server mode leaves the title unset).
_is_api_server = False


def mark_api_server() -> None:
    global _is_api_server
    _is_api_server = True


@dataclass(slots=True)
class Snapshot:
    """One sample of one process, as written to the run directory."""

    pid: int
    ppid: int
    start_time: float
    ts: float
    title: str
    role: str
    process: str
    dp_rank: int | None
    rss: int
    memory: dict[str, int] = field(default_factory=dict)  # anon | file | shmem, bytes
    gc_collections: list[int] = field(default_factory=list)  # per generation, self only
    gc_frozen: int | None = None
    threads: int = 0
    fds: int | None = 0  # None: not readable (another user's process: /proc/<pid>/fd needs ptrace access)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        return cls(**json.loads(text))


def parse_proc_status(text: str) -> dict[str, int]:
    """``/proc/<pid>/status`` -> {rss, anon, file, shmem} in bytes (kB lines), missing keys omitted."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = _STATUS_KEYS.get(key)
        if name:
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * 1024
    return out


def classify_title(title: str, api_server: bool = False) -> tuple[str, str, int | None]:
    """Process title (``VLLM::EngineCore_DP1``, ``VLLM::Worker_DP0_TP1``, ``VLLM::APIServer_0``)
    -> (role, process label, DP rank or None). An untitled process's title is its command line, which
    may end in ``::`` (``vllm serve ... --host ::``): nothing after it is no name, not an IndexError."""
    after = title.split("::", 1)[1].split() if "::" in title else []
    name = after[0] if after else ""
    m = _DP_RE.search(name)
    dp = int(m.group(1)) if m else None
    if name.startswith("EngineCore"):
        return "engine_core", name, dp
    if name.startswith("Worker"):
        return "worker", name, dp
    if name.startswith("APIServer"):
        return "api_server", name, None
    if name.startswith("DPCoordinator"):
        return "dp_coordinator", name, None
    if api_server:
        return "api_server", "APIServer", None
    return ("other", name, dp) if name else ("main", "main", None)


def _own_title() -> str:
    try:
        import setproctitle

        return setproctitle.getproctitle()
    except ImportError:
        with contextlib.suppress(OSError):
            return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


class FreezeCount:
    """``gc.get_freeze_count()``, read rarely, because it is not a counter but a walk.

    CPython (3.11 here) counts the permanent generation by walking its list under the GIL. In a
    vLLM EngineCore or API server, after their start-up ``gc.freeze()``, that walk took ~250 ms
    (py-spy; 10.7 % of a core per idle engine at one read per 5 s sample, against 0.6 % without
    the plugin), and every read stalled the engine's step loop or event loop for that long.
    vLLM freezes once, at start-up, so a value read earlier still holds. Reads costing under
    ``cheap_s`` (nothing frozen yet) happen at every sample; after a costly one the gap doubles,
    is at least ``cost / budget`` and at most ``max_gap_s``: in steady state one stall an hour.
    """

    def __init__(self, first_gap_s: float, *, budget: float = 0.001, cheap_s: float = 0.001,
                 max_gap_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], int] = gc.get_freeze_count,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.first_gap_s, self.budget, self.cheap_s, self.max_gap_s = first_gap_s, budget, cheap_s, max_gap_s
        self._clock, self._read, self._timer = clock, read, timer
        self._gap = first_gap_s
        self._due = -math.inf
        self.value: int | None = None
        self.last_cost_s = 0.0

    def __call__(self) -> int | None:
        now = self._clock()
        if now < self._due:
            return self.value
        t0 = self._timer()
        self.value = self._read()
        self.last_cost_s = cost = self._timer() - t0
        if cost < self.cheap_s:
            self._gap = self.first_gap_s
        else:
            self._gap = min(max(2 * self._gap, cost / self.budget), self.max_gap_s)
        self._due = now + self._gap
        return self.value


def take_snapshot(pid: int | None = None, api_server: bool | None = None,
                  freeze_count: Callable[[], int | None] = gc.get_freeze_count) -> Snapshot:
    """Sample ``pid`` (default: this process). GC figures exist only for this process; a
    sampling loop passes its ``FreezeCount`` so the freeze-count walk stays rare."""
    own = pid is None or pid == os.getpid()
    proc = psutil.Process(pid)
    with proc.oneshot():
        rss = proc.memory_info().rss
        threads = proc.num_threads()
        try:  # RSS and the rest are world-readable; a sidecar running as another user must still get them
            fds: int | None = proc.num_fds()
        except psutil.AccessDenied:
            fds = None
        ppid = proc.ppid()
        start = proc.create_time()
        title = _own_title() if own else " ".join(proc.cmdline())
    try:
        memory = parse_proc_status(Path(f"/proc/{proc.pid}/status").read_text())
        memory.pop("rss", None)
    except OSError:
        memory = {}
    role, process, dp = classify_title(title, _is_api_server if api_server is None else api_server)
    snap = Snapshot(pid=proc.pid, ppid=ppid, start_time=start, ts=time.time(), title=title[:200], role=role,
                    process=process, dp_rank=dp, rss=rss, memory=memory, threads=threads, fds=fds)
    if own:
        snap.gc_collections = [g["collections"] for g in gc.get_stats()]
        snap.gc_frozen = freeze_count()
    return snap


def write_snapshot(run_dir: Path, snap: Snapshot) -> Path:
    """Atomic write (tmp + rename) so a scrape never reads half a file."""
    path = run_dir / f"{SNAPSHOT_PREFIX}{snap.pid}.json"
    tmp = run_dir / f".{SNAPSHOT_PREFIX}{snap.pid}.tmp"
    tmp.write_text(snap.to_json())
    os.replace(tmp, path)
    return path


def seconds_from_env(name: str, default: float, maximum: float, env: Mapping[str, str] | None = None) -> float:
    """A period in seconds from ``env[name]``: ``default`` unless it is a finite number > 0, at most
    ``maximum``; an ignored or cut value is logged naming the variable (a hook cannot refuse to start).
    Why bounded: ``Event.wait()`` raises OverflowError past ~1e9 s, so ``inf`` or ``1e10`` killed the
    sampler's and the flush thread after their first round, and an infinite sample interval made the
    staleness limit (6 intervals) infinite: the one snapshot taken was exported as current for ever."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        log.warning("%s=%r is not a number of seconds > 0; using %g", name, raw, default)
        return default
    if v > maximum:
        log.warning("%s=%r is above the limit; using %g", name, raw, maximum)
        return maximum
    return v


def interval_from_env(env: Mapping[str, str] | None = None) -> float:
    return seconds_from_env(ENV_INTERVAL, DEFAULT_INTERVAL_S, MAX_INTERVAL_S, env)


class BackgroundLoop:
    """A daemon thread running ``self._run`` until ``stop()``: the process sampler and the object
    census (engine_hooks/census.py) each run one in every vLLM process."""

    thread_name = "sla-guard"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class ProcessSampler(BackgroundLoop):
    """Daemon thread writing this process's snapshot every ``interval`` seconds."""

    thread_name = "sla-guard-sampler"

    def __init__(self, run_dir: Path, interval: float) -> None:
        self.run_dir = run_dir
        self.interval = interval
        self.pid = os.getpid()
        self.errors = 0
        self.freeze_count = FreezeCount(interval)
        super().__init__()

    def stop(self, timeout: float = 2.0) -> None:
        super().stop(timeout)
        with contextlib.suppress(OSError):
            (self.run_dir / f"{SNAPSHOT_PREFIX}{self.pid}.json").unlink()

    def sample_once(self) -> None:
        try:
            write_snapshot(self.run_dir, take_snapshot(freeze_count=self.freeze_count))
        except Exception:  # never let sampling hurt the host process
            self.errors += 1
            if self.errors == 1:
                log.warning("sla-guard process sampler failed in pid %d", self.pid, exc_info=True)

    def _run(self) -> None:
        self.sample_once()
        while not self._stop.wait(self.interval):
            self.sample_once()
