"""Leader election for actuation: two guards run side by side, only the leader actuates.

Everything else (scraping, SLOs, detectors, recommendations, the API) runs on both; the standby
takes over when the leader dies. Two electors share one small protocol:

- ``FileLockElector`` (one host): ``fcntl.flock`` on a lock file, tried without blocking every
  ``retry_s``. The kernel drops the lock when its holder dies, however it dies, so a standby
  takes over within one retry period. The holder writes its identity and pid into the file for
  humans (``cat`` it to see who leads). Local filesystems only: flock over NFS is not reliable.
- ``LeaseElector`` (Kubernetes): client-go's leader-election algorithm on a
  ``coordination.k8s.io/v1`` Lease, through the official ``kubernetes`` client. A candidate
  takes the Lease when it is absent, released, or unchanged for ``leaseDurationSeconds`` as
  measured on the candidate's own monotonic clock from when it saw the record change (so wall
  clocks need not agree); writes carry the observed ``resourceVersion`` so two candidates cannot
  both win (the loser gets 409). The leader renews every ``renew_s`` and stops actuating
  ``renew_deadline_s`` after the start of its last successful write, which is before any other
  guard can see the Lease expire (``renew_deadline_s < lease_duration_s``, checked). Any error
  counts as "not renewed": fail safe, never two leaders actuating.

Electors run in a daemon thread; ``is_leader()`` only reads memory and the clock, so the guard's
tick never blocks on the API server or the filesystem, and a renewal hung in the network cannot
keep a stale leader actuating (the deadline is evaluated at call time, not by the thread).
``confirm(within_s)`` is the check just before an actuation's request: it renews the Lease (or
re-checks the lock file) then and there, and holds only if the request's whole deadline ends
within the renew deadline. ``is_leader()`` trusts a renewal up to ``renew_s`` old, and a Lease
deleted or taken over in between went unnoticed until the next renewal: two guards patched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sla_guard.outbound import call_within, kube_api_client

log = logging.getLogger(__name__)

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class Elector(Protocol):
    """Who may actuate. ``is_leader`` must be cheap and must never block."""

    identity: str

    def is_leader(self) -> bool: ...

    def confirm(self, within_s: float) -> bool: ...

    def holder(self) -> str | None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def default_identity() -> str:
    """hostname-pid: unique per process, so a restarted guard is a new candidate."""
    return f"{socket.gethostname()}-{os.getpid()}"


class _Loop:
    """The background thread both electors share: ``_step()`` then wait ``_wait_s()``."""

    name = "elector"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_mu = threading.Lock()  # one step at a time: the loop's or confirm()'s

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"sla-guard-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._step_mu:
                self._guarded_step()
            self._stop.wait(self._wait_s())

    def _guarded_step(self) -> None:
        try:
            self._step()
        except Exception:  # the elector thread must outlive any surprise; not leader meanwhile
            log.exception("%s: election step failed", self.name)
            self._on_crash()

    def confirm(self, within_s: float) -> bool:
        """Just before an actuation's request: one election step now (a Lease renewal, a lock
        file re-check), then whether this guard leads for the request's whole ``within_s``.
        False when the loop's own step holds the elector past ``_confirm_wait_s()`` (a hung API
        server), or after ``stop()``."""
        t0 = self._clock_now()
        if self._stop.is_set() or not self._step_mu.acquire(timeout=self._confirm_wait_s()):
            return False
        try:
            if self._stop.is_set():  # stop() began while this waited: no renewal after it
                return False
            self._guarded_step()
        finally:
            self._step_mu.release()
        return self._holds(t0, within_s)

    def _clock_now(self) -> float:
        return time.monotonic()

    def _confirm_wait_s(self) -> float:
        return 5.0

    def _holds(self, since: float, within_s: float) -> bool:
        raise NotImplementedError

    def _join(self, timeout: float) -> bool:
        self._stop.set()
        th, self._thread = self._thread, None
        if th is not None and th is not threading.current_thread():
            th.join(timeout)
            return not th.is_alive()
        return True

    def _step(self) -> None:
        raise NotImplementedError

    def _wait_s(self) -> float:
        raise NotImplementedError

    def _on_crash(self) -> None:
        raise NotImplementedError


class FileLockElector(_Loop):
    """Leader = holder of an exclusive ``flock`` on ``path``."""

    name = "file-lock"

    def __init__(self, path: str | os.PathLike[str], identity: str | None = None, retry_s: float = 2.0) -> None:
        super().__init__()
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        self.path = Path(path)
        self.identity = identity or default_identity()
        self.retry_s = retry_s
        self._fd: int | None = None
        self._leader = False
        self._holder: str | None = None

    def is_leader(self) -> bool:
        return self._leader

    def holder(self) -> str | None:
        return self.identity if self._leader else self._holder

    def _wait_s(self) -> float:
        return self.retry_s

    def _holds(self, since: float, within_s: float) -> bool:
        return self._leader  # the kernel holds an flock until released: no expiry to race

    def _on_crash(self) -> None:
        self._release()

    def _step(self) -> None:
        if self._fd is None:
            self._try_acquire()
        elif not self._same_file(self._fd):
            # someone deleted or replaced the lock file: our lock no longer excludes anyone
            log.warning("%s: lock file %s was replaced; stepping down", self.name, self.path)
            self._release()
            self._try_acquire()
        if self._fd is None:
            self._holder = self._read_holder()

    def _same_file(self, fd: int) -> bool:
        try:
            a, b = os.fstat(fd), os.stat(self.path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _try_acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by another process
            os.close(fd)
            return
        if not self._same_file(fd):  # unlinked between our open and our lock: a lock on nothing
            os.close(fd)
            return
        since = datetime.now(UTC).isoformat(timespec="seconds")
        with contextlib.suppress(OSError):  # the note is for humans; the lock is what counts
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.identity} pid={os.getpid()} since={since}\n".encode(), 0)
            os.fsync(fd)
        self._fd = fd
        self._leader = True
        log.info("%s: %s is the leader (lock %s)", self.name, self.identity, self.path)

    def _read_holder(self) -> str | None:
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return None
        return text.split(" pid=")[0] if text else None

    def _release(self) -> None:
        self._leader = False  # first: no actuation from here on
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

    def stop(self) -> None:
        self._leader = False
        self._join(5.0)
        self._release()


def _micro_time(t: datetime) -> datetime:
    """A Lease MicroTime. The client serialises datetimes with ``isoformat()``, which drops the
    fraction at microsecond 0, and the API server parses RFC 3339 with exactly six fractional
    digits: so never send microsecond 0 (one microsecond off is immaterial to a lease)."""
    t = t.astimezone(UTC)
    return t.replace(microsecond=1) if t.microsecond == 0 else t


def _parse_time(v: Any) -> datetime | None:
    if isinstance(v, datetime):
        return v
    try:
        return datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    except ValueError:
        return None


def namespace_default() -> str:
    """The pod's own namespace in-cluster, else ``default``."""
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip() or "default"
    except OSError:
        return "default"


class LeaseElector(_Loop):
    """client-go leader election on a ``coordination.k8s.io/v1`` Lease."""

    name = "lease"

    def __init__(self, name: str, namespace: str | None = None, identity: str | None = None, *,
                 lease_duration_s: int = 15, renew_deadline_s: float = 10.0, renew_s: float = 5.0,
                 retry_s: float = 2.0, call_timeout_s: float | None = None, api_client: Any = None,
                 kubeconfig: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not 0 < renew_s < renew_deadline_s < lease_duration_s:
            raise ValueError(f"need 0 < renew_s ({renew_s}) < renew_deadline_s ({renew_deadline_s}) < "
                             f"lease_duration_s ({lease_duration_s}): a leader must stop actuating before "
                             "another guard can see its lease expire")
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        from kubernetes import client  # optional extra: sla-guard[kubernetes]

        if api_client is None:
            api_client = kube_api_client(kubeconfig)
        self._api = client.CoordinationV1Api(api_client)
        self._api_exception = client.exceptions.ApiException
        self.lease_name = name
        self.namespace = namespace or namespace_default()
        self.identity = identity or default_identity()
        self.lease_duration_s = int(lease_duration_s)
        self.renew_deadline_s = float(renew_deadline_s)
        self.renew_s = float(renew_s)
        self.retry_s = float(retry_s)
        # one API call may take at most this long (a hung API server must not hold the thread past
        # the renew deadline for long; is_leader() does not depend on it either way)
        self.call_timeout_s = call_timeout_s or max(0.5, min(self.renew_deadline_s / 2, 5.0))
        self._clock = clock
        self._mu = threading.Lock()
        self._renewed_at: float | None = None  # monotonic start of our last successful write
        self._observed: tuple | None = None  # (holder, renewTime, resourceVersion) last seen
        self._observed_at = 0.0  # monotonic time the observed record last changed
        self._holder: str | None = None
        self._lease: dict | None = None  # last lease body we read or wrote
        self._reread = False  # after a 409: read again at once
        self.last_error: str | None = None
        self.conflicts = 0

    # -- what the actuator asks ----------------------------------------------------------------
    def is_leader(self) -> bool:
        with self._mu:
            t = self._renewed_at
        return t is not None and self._clock() - t < self.renew_deadline_s

    def holder(self) -> str | None:
        return self.identity if self.is_leader() else self._holder

    def _clock_now(self) -> float:
        return self._clock()

    def _confirm_wait_s(self) -> float:
        return self.call_timeout_s

    def _holds(self, since: float, within_s: float) -> bool:
        """Renewed by this confirm (at or after ``since``), and the request, answered within
        ``within_s``, done before the renew deadline: ``lease_duration_s - renew_deadline_s``
        before any other guard can see the Lease expire."""
        with self._mu:
            t = self._renewed_at
        return t is not None and t >= since and self._clock() + within_s < t + self.renew_deadline_s

    # -- the loop ------------------------------------------------------------------------------
    def _wait_s(self) -> float:
        if self._reread:
            self._reread = False
            return 0.0
        with self._mu:
            renewed = self._renewed_at
        if renewed is not None and self._clock() - renewed < self.renew_deadline_s and self.last_error is None:
            return self.renew_s
        return self.retry_s

    def _on_crash(self) -> None:
        self._step_down("election step failed")

    def _step_down(self, why: str) -> None:
        with self._mu:
            was = self._renewed_at is not None
            self._renewed_at = None
        if was:
            log.warning("%s: %s steps down: %s", self.name, self.identity, why)

    def _won(self, t_send: float, lease: dict) -> None:
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        with self._mu:
            new = self._renewed_at is None
            self._renewed_at = t_send
            self._lease = lease
            self._observed = (spec.get("holderIdentity"), spec.get("renewTime"), meta.get("resourceVersion"))
            self._observed_at = self._clock()
            self._holder = self.identity
        self.last_error = None
        if new:
            log.info("%s: %s is the leader (lease %s/%s, transitions %s)", self.name, self.identity,
                     self.namespace, self.lease_name, spec.get("leaseTransitions"))

    def _fail(self, what: str, err: Exception) -> None:
        # a failed renewal is retried every retry_s; the leader stays leader only until its renew
        # deadline (is_leader() checks the clock), never past it
        self.last_error = f"{what}: {_short(err)}"
        log.warning("%s: %s", self.name, self.last_error)

    def _call(self, fn: Callable[..., Any], *args: Any) -> dict:
        # whole within call_timeout_s: the client's timeout bounds each read, and an API server
        # trickling its answer held the elector (and stop(), so the Lease was never released)
        resp = call_within(lambda: fn(*args, _preload_content=False, _request_timeout=self.call_timeout_s),
                           self.call_timeout_s)
        return json.loads(resp.data)

    def _record(self, now: datetime, acquire: datetime, transitions: int) -> dict:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_duration_s,
                "acquireTime": _micro_time(acquire), "renewTime": _micro_time(now), "leaseTransitions": transitions}

    def _step(self) -> None:
        """One try to acquire or renew (client-go ``tryAcquireOrRenew``)."""
        try:
            lease: dict | None = self._call(self._api.read_namespaced_lease, self.lease_name, self.namespace)
        except self._api_exception as err:
            if err.status != 404:
                return self._fail("reading the lease", err)
            lease = None
        except Exception as err:  # timeouts, refused connections, bad JSON
            return self._fail("reading the lease", err)
        now = datetime.now(UTC)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.lease_name, "namespace": self.namespace},
                    "spec": self._record(now, now, 0)}
            return self._write(self._api.create_namespaced_lease, self.namespace, body)
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime"), meta.get("resourceVersion"))
        t = self._clock()
        with self._mu:
            if seen != self._observed:
                self._observed, self._observed_at = seen, t
            observed_at = self._observed_at
            self._lease = lease
            self._holder = holder or None
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and t < observed_at + duration:
            self.last_error = None
            return self._step_down(f"the lease is held by {holder}")
        if holder == self.identity:
            record = self._record(now, _parse_time(spec.get("acquireTime")) or now,
                                  int(spec.get("leaseTransitions") or 0))
        else:  # free, released or expired
            record = self._record(now, now, int(spec.get("leaseTransitions") or 0) + 1)
            if holder:
                log.info("%s: lease held by %s expired (unchanged for %.1f s); taking it", self.name, holder,
                         t - observed_at)
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.lease_name, "namespace": self.namespace,
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": record}
        self._write(self._api.replace_namespaced_lease, self.lease_name, self.namespace, body)

    def _write(self, fn: Callable[..., Any], *args: Any) -> None:
        t_send = self._clock()  # before the request: the server commits at or after this instant
        try:
            lease = self._call(fn, *args)
        except self._api_exception as err:
            if err.status == 409:
                # someone else wrote the lease since we read it: we may no longer hold it
                # (a lost race, not a failing election: last_error stays for real failures)
                self.conflicts += 1
                self.last_error = None
                with self._mu:
                    self._holder = None  # unknown until the re-read
                self._step_down("409 conflict on the lease (another guard wrote it)")
                self._reread = True
                return
            return self._fail("writing the lease", err)
        except Exception as err:
            return self._fail("writing the lease", err)
        self._won(t_send, lease)

    def stop(self) -> None:
        """Step down, then release the lease (holder cleared, duration 1 s) so a standby takes
        over at its next retry instead of waiting for the lease to expire."""
        was = self.is_leader()
        self._stop.set()  # first: a confirm() from here on renews nothing
        self._step_down("stopping")
        done = self._join(self.call_timeout_s * 2 + 1)
        lease = self._lease
        if not (was and done and lease):
            return
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return
        now = _micro_time(datetime.now(UTC))
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.lease_name, "namespace": self.namespace,
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                         "leaseTransitions": int(spec.get("leaseTransitions") or 0)}}
        try:
            self._call(self._api.replace_namespaced_lease, self.lease_name, self.namespace, body)
            log.info("%s: %s released the lease", self.name, self.identity)
        except Exception as err:  # it expires on its own
            log.warning("%s: releasing the lease failed: %s", self.name, _short(err))


def _short(err: Exception) -> str:
    status = getattr(err, "status", None)
    if status is not None and getattr(err, "reason", None) is not None:
        return f"HTTP {status} {err.reason}"
    return f"{type(err).__name__}: {err}"[:300]
