"""``vllm.general_plugins`` entry point: start the process sampler in every vLLM process.

vLLM calls ``register()`` once per process: in the launcher/API server (while building the
engine config, before any child exists), first thing in each EngineCore, and in each worker.
The first process without ``SLA_GUARD_RUN_DIR`` creates a run directory and exports it in
``os.environ``, so every child (fork or spawn) inherits it and writes its snapshots there.

Fork safety: a forked child has no threads, and vLLM's own "plugins loaded" flag is inherited
as True, so ``register()`` would not be called again in a forked worker. An
``os.register_at_fork`` handler therefore restarts the sampler in every forked child.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from engine_hooks import census
from exporters.process_sampler import ENV_RUN_DIR, ProcessSampler, interval_from_env

log = logging.getLogger("sla_guard.process_plugin")

ENV_DISABLE = "SLA_GUARD_DISABLE_SAMPLER"

_lock = threading.Lock()
_sampler: ProcessSampler | None = None
_census: census.CensusThread | None = None
_at_fork_registered = False


def run_dir(create: bool = True) -> Path | None:
    """The run directory shared by one vLLM deployment's processes (created on first use)."""
    value = os.environ.get(ENV_RUN_DIR)
    if value:
        path = Path(value)
        with contextlib.suppress(OSError):
            path.mkdir(parents=True, exist_ok=True)
        return path
    if not create:
        return None
    path = Path(tempfile.mkdtemp(prefix=f"sla-guard-run-{os.getpid()}-"))
    os.environ[ENV_RUN_DIR] = str(path)
    owner = os.getpid()

    def _cleanup() -> None:  # only the creator removes it (forked children inherit atexit)
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(_cleanup)
    return path


def start_sampler() -> ProcessSampler | None:
    """Start this process's sampler if not running (idempotent, thread-safe, never raises)."""
    global _sampler
    if os.environ.get(ENV_DISABLE) == "1":
        return None
    try:
        with _lock:
            if _sampler is not None and _sampler.pid == os.getpid() and _sampler.alive:
                return _sampler
            path = run_dir()
            if path is None:
                return None
            _sampler = ProcessSampler(path, interval_from_env()).start()
            return _sampler
    except Exception:
        log.warning("sla-guard: could not start the process sampler", exc_info=True)
        return None


def start_census() -> census.CensusThread | None:
    """Start this process's object census (engine_hooks/census.py) unless ``SLA_GUARD_CENSUS=0``
    (idempotent, thread-safe, never raises)."""
    global _census
    if os.environ.get(ENV_DISABLE) == "1" or not census.enabled():
        return None
    try:
        with _lock:
            if _census is not None and _census.pid == os.getpid() and _census.alive:
                return _census
            path = run_dir()
            if path is None:
                return None
            _census = census.CensusThread(path).start()
            return _census
    except Exception:
        log.warning("sla-guard: could not start the object census", exc_info=True)
        return None


def _after_fork_in_child() -> None:
    global _sampler, _census, _lock
    _lock = threading.Lock()  # the parent's lock may have been held by another thread
    _sampler = None
    _census = None
    if os.environ.get(ENV_RUN_DIR):
        start_sampler()
        start_census()


def register() -> None:
    """The general-plugin entry point (no arguments, called once per process by vLLM)."""
    global _at_fork_registered
    if not _at_fork_registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _at_fork_registered = True
    start_sampler()
    start_census()
