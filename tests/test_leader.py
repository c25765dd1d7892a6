"""High availability for actuation (issue 13): two guards, one leader actuates, the standby takes
over within 30 s of the leader's death.

- File lock: real ``sla-guard serve`` processes in active mode with a webhook actuator, scraping
  real loopback engines, sharing one lock file; the webhook receiver records which guard called
  (each guard sends its own bearer token). The leader is SIGKILLed; takeover time is printed.
- Kubernetes Lease: no API server can run here, so ``LeaseAPI`` is a FAKE: a loopback HTTP
  server implementing the Lease endpoints (GET/POST/PUT of coordination.k8s.io/v1 leases, with
  resourceVersion optimistic concurrency and 409 on conflict). The requests are made by the
  official ``kubernetes`` client inside ``LeaseElector``, unmodified.

``LeaderWatch`` samples every elector's ``is_leader()`` all along and fails a test that ever saw
two leaders at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from guard_support import Served, free_port
from prometheus_client import generate_latest
from scale_support import Engine

from sla_guard.compose import build_actuator
from sla_guard.config import ConfigError, parse_config
from sla_guard.leader import FileLockElector, LeaseElector
from sla_guard.scale.actuators import (
    ActuationError,
    KubernetesActuator,
    LeaderGatedActuator,
    StandbyError,
    WebhookActuator,
)
from sla_guard.settings.advisor import AdvisorConfig, KubernetesTarget, Webhook

ROOT = Path(__file__).resolve().parents[1]


# -- helpers ---------------------------------------------------------------------------------
@contextmanager
def serve(handler_cls) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


def wait_for(cond, timeout: float, what: str, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class LeaderWatch:
    """Samples ``is_leader()`` of each elector every few ms in a thread: records when each was
    first and last seen leading, and every instant two led at once."""

    def __init__(self, electors) -> None:
        self.electors = list(electors)
        self.overlaps: list[tuple[float, list[str]]] = []
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            leaders = [e.identity for e in self.electors if e.is_leader()]
            for name in leaders:
                self.first.setdefault(name, t)
                self.last[name] = t
            if len(leaders) > 1:
                self.overlaps.append((t, leaders))
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._th.join(5)


def webhook_receiver():
    """Records (monotonic time, bearer token, body) of every POST; always answers 200."""
    calls: list[tuple[float, str, dict]] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((time.monotonic(), (self.headers.get("Authorization") or "")[7:], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    return H, calls


# -- file lock: two real `sla-guard serve` processes -----------------------------------------
def _guard_config(tmp: Path, name: str, targets: list[dict], webhook: str, lock: Path) -> Path:
    cfg = {"source": {"mode": "scrape", "interval_s": 0.5, "timeout_s": 0.5, "targets": targets},
           "evaluation_interval_s": 1.0,
           "api": {"listen": f"127.0.0.1:{free_port()}"},
           "advisor": {
               "mode": "active", "model": "m", "window_s": 5, "stale_after_s": 10,
               "warmup_s": 1e6, "adapt_utilization": False, "cooldown_s": 0, "stabilization_up_s": 0,
               "decision_log": str(tmp / f"{name}-decisions.jsonl"),
               "pools": {"prefill": {"min_replicas": 1, "max_replicas": 100_000, "max_step_up": 1},
                         "decode": {"min_replicas": 1, "max_replicas": 100_000, "max_step_up": 1}},
               "profile": {"prefill_tokens_per_s": 1000, "decode_step_base_s": 0.01,
                           "decode_step_per_request_s": 0.0002},
               "actuation": {"webhook": {"url": webhook, "retries": 0, "timeout_s": 2,
                                         "bearer_token_env": "SCALER_TOKEN"},
                             "leader_election": {"mode": "file", "lock_file": str(lock), "identity": name,
                                                 "retry_s": 0.5}}}}
    f = tmp / f"{name}.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return f


def _decisions(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_two_serve_guards_share_a_file_lock_and_the_standby_takes_over(tmp_path):
    """Two `sla-guard serve` processes (active mode, webhook actuator, one lock file) on the same
    overloaded prefill engine: only the lock holder calls the webhook, the other decides the same
    scale-up every tick and records 'standby: not the leader (holder guard-a)' instead;
    after SIGKILL of the leader the standby actuates within 30 s, and the webhook never saw the
    two guards' calls interleave."""
    prefill, decode = Engine("prefill", "p0"), Engine("decode", "d0")
    mu = threading.Lock()

    def page(e: Engine):
        def body() -> bytes:
            with mu:
                return generate_latest(e.registry)
        return body

    servers = [Served(page(prefill)), Served(page(decode))]
    targets = [{"url": servers[0].url, "model": "m", "pool": "prefill"},
               {"url": servers[1].url, "model": "m", "pool": "decode"}]
    stop = threading.Event()

    def drive() -> None:  # prefill far beyond its 1000 tok/s prior: every tick asks for one more replica
        while not stop.is_set():
            with mu:
                prefill.tick(running=4, waiting=30, computed=25_000, prefills=2)
                decode.tick(running=10, waiting=0, steps=50)
            stop.wait(0.25)

    def alive(procs: dict[str, subprocess.Popen]) -> bool:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited {p.returncode}: {(tmp_path / f'{name}.log').read_text()[-2000:]}")
        return True

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    handler, calls = webhook_receiver()
    procs: dict[str, subprocess.Popen] = {}
    lock = tmp_path / "actuation.lock"
    try:
        with serve(handler) as (url, _):
            for name in ("guard-a", "guard-b"):
                f = _guard_config(tmp_path, name, targets, url, lock)
                env = {**os.environ, "SCALER_TOKEN": name}
                with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own copy of the fd
                    procs[name] = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config",
                                                    str(f), "--log-level", "warning"], env=env, cwd=ROOT,
                                                   stdout=subprocess.DEVNULL, stderr=log)
                if name == "guard-a":  # a leads: it takes the lock first and actuates
                    wait_for(lambda: alive(procs) and [c for c in calls if c[1] == "guard-a"], 60, "guard-a actuating")
            # b runs its advisor on the same data and stands by
            wait_for(lambda: alive(procs) and [d for d in _decisions(tmp_path / "guard-b-decisions.jsonl")
                              if "standby: not the leader (holder guard-a)" in str(d.get("actuated"))],
                     60, "guard-b standing by")
            # a few more ticks of both: b keeps deciding to scale and keeps standing by
            n_b_standby = len(_decisions(tmp_path / "guard-b-decisions.jsonl"))
            wait_for(lambda: alive(procs) and len(_decisions(tmp_path / "guard-b-decisions.jsonl")) >= n_b_standby + 6,
                     30, "more ticks of guard-b")
            assert {c[1] for c in calls} == {"guard-a"}, "only the leader actuates"
            assert all("standby" in str(d["actuated"]) for d in _decisions(tmp_path / "guard-b-decisions.jsonl")
                       if d.get("direction") in ("up", "down"))
            assert lock.read_text().startswith(f"guard-a pid={procs['guard-a'].pid} ")

            t_kill = time.monotonic()
            procs["guard-a"].send_signal(signal.SIGKILL)
            procs["guard-a"].wait(10)
            first_b = wait_for(lambda: next((c for c in calls if c[1] == "guard-b"), None), 30,
                               "guard-b taking over within 30 s")
            takeover = first_b[0] - t_kill
            print(f"\nfile lock, two sla-guard serve: takeover {takeover:.2f} s after SIGKILL of the leader "
                  f"(retry_s 0.5, evaluation every 1 s)")
            assert takeover < 30
        who = [c[1] for c in sorted(calls)]
        switch = who.index("guard-b")
        assert set(who[:switch]) == {"guard-a"} and set(who[switch:]) == {"guard-b"}, who  # no interleaving
        assert max(c[0] for c in calls if c[1] == "guard-a") < t_kill
        assert lock.read_text().startswith(f"guard-b pid={procs['guard-b'].pid} ")
        b_log = _decisions(tmp_path / "guard-b-decisions.jsonl")
        assert any(d.get("actuated") is True for d in b_log)
        procs["guard-b"].send_signal(signal.SIGTERM)
        assert procs["guard-b"].wait(15) == 0
    finally:
        stop.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for s in servers:
            s.stop()


def test_file_lock_elector_holder_note_replaced_file_and_handover(tmp_path):
    """In one process (flock locks of two open files exclude each other there too): the holder
    writes its identity into the file, the standby reports it; a replaced lock file makes the
    holder step down; stop() hands over at the next retry."""
    lock = tmp_path / "locks" / "guard.lock"
    a = FileLockElector(lock, identity="guard-a", retry_s=0.05)
    b = FileLockElector(lock, identity="guard-b", retry_s=0.05)
    watch = LeaderWatch([a, b])
    try:
        a.start()
        wait_for(a.is_leader, 10, "a leading")
        b.start()
        wait_for(lambda: b.holder() == "guard-a", 10, "b seeing a as the holder")
        assert not b.is_leader()
        assert lock.read_text().startswith(f"guard-a pid={os.getpid()} since=")
        # the lock file is deleted and a third process locks the new one: a's lock now guards
        # nothing; a must step down (and b must not lead either)
        os.unlink(lock)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        wait_for(lambda: not a.is_leader(), 10, "a stepping down")
        time.sleep(0.3)  # several retry periods of both
        assert not a.is_leader() and not b.is_leader()
        os.close(fd)  # the third process goes away
        leader = wait_for(lambda: next((e for e in (a, b) if e.is_leader()), None), 10, "a new leader")
        other = b if leader is a else a
        leader.stop()
        wait_for(other.is_leader, 10, "the other taking over after stop()")
    finally:
        a.stop()
        b.stop()
        watch.stop()
    assert not watch.overlaps, watch.overlaps[:3]


# -- the gate --------------------------------------------------------------------------------
def test_standby_does_not_call_the_webhook_and_says_who_leads(tmp_path):
    """A gated webhook actuator on the standby raises StandbyError naming the holder and never
    reaches the receiver; on the leader it calls through. A leader deposed during a retry's
    backoff does not send the retry."""
    handler, calls = webhook_receiver()
    lock = tmp_path / "g.lock"
    a = FileLockElector(lock, identity="guard-a", retry_s=0.05)
    b = FileLockElector(lock, identity="guard-b", retry_s=0.05)
    with serve(handler) as (url, _):
        try:
            a.start()
            wait_for(a.is_leader, 10, "a leading")
            b.start()
            wait_for(lambda: b.holder() == "guard-a", 10, "b seeing a")
            on_a = LeaderGatedActuator(WebhookActuator(Webhook(url=url, retries=0), token="guard-a"), a)
            on_b = LeaderGatedActuator(WebhookActuator(Webhook(url=url, retries=0), token="guard-b"), b)
            assert on_b.name == "webhook"
            with pytest.raises(StandbyError, match=r"standby: not the leader \(holder guard-a\)"):
                on_b.set_replicas("m", "decode", 3, "k1")
            on_a.set_replicas("m", "decode", 3, "k2")
            assert [c[1] for c in calls] == ["guard-a"]
        finally:
            a.stop()
            b.stop()

    # deposed between two attempts: the retry is not sent
    failing: list[int] = []

    class Fail(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            failing.append(1)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    class Flag:
        identity = "me"
        leader = True

        def is_leader(self) -> bool:
            return self.leader

        def confirm(self, within_s: float) -> bool:
            return self.leader

        def holder(self) -> str:
            return "me" if self.leader else "other"

        def start(self) -> None: ...

        def stop(self) -> None: ...

    flag = Flag()
    with serve(Fail) as (url, _):
        def depose(_s: float) -> None:  # the backoff sleep: leadership is lost meanwhile
            flag.leader = False

        inner = WebhookActuator(Webhook(url=url, retries=3, backoff_s=0.01), sleep=depose)
        gated = LeaderGatedActuator(inner, flag)
        with pytest.raises(StandbyError, match="lost the leadership before attempt 2"):
            gated.set_replicas("m", "prefill", 2, "k")
    assert len(failing) == 1


def test_leader_election_config_names_fields_and_wires_the_gate(tmp_path):
    def err(le: dict) -> str:
        with pytest.raises(ConfigError) as e:
            parse_config({"advisor": {"mode": "active", "actuation": {"webhook": {"url": "http://127.0.0.1:9/x"},
                                                                      "leader_election": le}}})
        return str(e.value)

    assert "advisor.actuation.leader_election" in err({"mode": "file"}) and "lock_file" in err({"mode": "file"})
    msg = err({"mode": "kubernetes", "renew_deadline_s": 15, "lease_duration_s": 15})
    assert "renew_deadline_s (15.0) must be below lease_duration_s (15)" in msg
    assert "advisor.actuation.leader_election.mode" in err({"mode": "etcd"})
    assert "advisor.actuation.leader_election.retry_s" in err({"mode": "file", "lock_file": "x", "retry_s": 0})

    plain = build_actuator(AdvisorConfig.model_validate({"mode": "active", "actuation": {"webhook": {"url": "http://127.0.0.1:9"}}}))
    assert isinstance(plain, WebhookActuator)  # mode none: today's behaviour
    cfg = AdvisorConfig.model_validate({"mode": "active", "actuation": {
        "webhook": {"url": "http://127.0.0.1:9"},
        "leader_election": {"mode": "file", "lock_file": str(tmp_path / "l"), "identity": "me", "retry_s": 0.05}}})
    gated = build_actuator(cfg)
    try:
        assert isinstance(gated, LeaderGatedActuator) and gated.name == "webhook"
        wait_for(gated.elector.is_leader, 10, "the started elector leading")
        assert (tmp_path / "l").read_text().startswith("me pid=")
    finally:
        gated.close()
    assert not gated.elector.is_leader()


# -- Kubernetes Lease against a fake API server ----------------------------------------------
MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


class LeaseAPI:
    """FAKE Kubernetes API server (no real one can run here): the Lease endpoints of
    coordination.k8s.io/v1 on loopback. GET/PUT/DELETE ``.../namespaces/{ns}/leases/{name}``, POST
    ``.../namespaces/{ns}/leases``; every write bumps ``metadata.resourceVersion``; a PUT whose
    resourceVersion is not the current one and a POST of an existing Lease answer 409 with a
    ``Status`` body, as the real server does. Also GET/PATCH of a Deployment's scale subresource
    (``/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``), every PATCH logged in
    ``patches`` as (client, replicas). Test hooks: ``hang`` (client tags whose requests hang,
    then fail without being applied), ``forbid`` (client tags answered 403, as to a service
    account without RBAC on leases) and ``intrude_on_put`` (before that client's next PUT,
    another writer updates the Lease, so the PUT conflicts)."""

    PREFIX = "/apis/coordination.k8s.io/v1/namespaces/"

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict] = {}
        self.rv = 100
        self.mu = threading.Lock()
        self.hang: set[str] = set()
        self.forbid: set[str] = set()
        self.unhang = threading.Event()
        self.scales: dict[tuple[str, str], int] = {}
        self.patches: list[tuple[str, int]] = []
        self.intrude_on_put: str | None = None
        self.events: list[tuple[float, str, str, int, str]] = []  # (t, client, method, status, holder)
        api = self

        class H(BaseHTTPRequestHandler):
            def _reply(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that gave up
                    self.wfile.write(data)

            def _status(self, code: int, reason: str, msg: str) -> None:
                self._reply(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                   "message": msg, "reason": reason, "code": code})

            def _route(self):
                path = self.path.split("?")[0]
                if not path.startswith(api.PREFIX):
                    return None
                parts = path[len(api.PREFIX):].strip("/").split("/")
                if len(parts) == 2 and parts[1] == "leases":
                    return parts[0], None
                if len(parts) == 3 and parts[1] == "leases":
                    return parts[0], parts[2]
                return None

            def _handle(self, method: str) -> None:
                tag = self.headers.get("X-Client", "?")
                body = None
                if int(self.headers.get("Content-Length") or 0):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if tag in api.hang:
                    api.unhang.wait(60)
                    api.events.append((time.monotonic(), tag, method, 504, ""))
                    return self._status(504, "Timeout", "hung")
                if tag in api.forbid:
                    return self._status(403, "Forbidden", f'leases.coordination.k8s.io is forbidden: User "{tag}" '
                                                          "cannot get resource \"leases\"")
                scale = re.fullmatch(r"/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale",
                                     self.path.split("?")[0])
                if scale:
                    return self._scale(method, tag, (scale[1], scale[2]), body)
                route = self._route()
                if route is None:
                    return self._status(404, "NotFound", "no such path")
                ns, name = route
                with api.mu:
                    code, obj = api.apply(method, tag, ns, name, body)
                    holder = (obj.get("spec") or {}).get("holderIdentity", "") if code < 300 else ""
                    api.events.append((time.monotonic(), tag, method, code, holder))
                self._reply(code, obj)

            def _scale(self, method: str, tag: str, key: tuple[str, str], body: dict | None) -> None:
                with api.mu:
                    if key not in api.scales:
                        return self._status(404, "NotFound", f'deployments.apps "{key[1]}" not found')
                    if method == "PATCH":
                        assert body is not None
                        api.scales[key] = int(body["spec"]["replicas"])
                        api.patches.append((tag, api.scales[key]))
                    n = api.scales[key]
                self._reply(200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                                  "metadata": {"name": key[1], "namespace": key[0]},
                                  "spec": {"replicas": n}, "status": {"replicas": n}})

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

            def do_DELETE(self):
                self._handle("DELETE")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def log_message(self, *a):
                pass

        self.handler = H

    def _status_obj(self, code: int, reason: str, msg: str) -> tuple[int, dict]:
        return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": msg,
                      "reason": reason, "code": code}

    def _store(self, ns: str, name: str, body: dict) -> dict:
        self.rv += 1
        obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": name, "namespace": ns, "resourceVersion": str(self.rv),
                            "uid": f"uid-{name}", "creationTimestamp": "2025-01-01T00:00:00Z"},
               "spec": dict(body.get("spec") or {})}
        self.leases[(ns, name)] = obj
        return obj

    def apply(self, method: str, tag: str, ns: str, name: str | None, body: dict | None) -> tuple[int, dict]:
        if method in ("GET", "DELETE"):  # DELETE: as `kubectl delete lease`, to force a new election
            obj = self.leases.pop((ns, name or ""), None) if method == "DELETE" else self.leases.get((ns, name or ""))
            return (200, obj) if obj else self._status_obj(404, "NotFound", f'leases "{name}" not found')
        assert body is not None
        for field in ("acquireTime", "renewTime"):  # MicroTime: RFC 3339 with six fractional digits
            v = (body.get("spec") or {}).get(field)
            if v is not None and not MICRO_TIME.fullmatch(str(v)):
                return self._status_obj(400, "BadRequest", f"spec.{field}: cannot parse {v!r} as MicroTime")
        if method == "POST":
            name = body["metadata"]["name"]
            if (ns, name) in self.leases:
                return self._status_obj(409, "AlreadyExists", f'leases "{name}" already exists')
            return 201, self._store(ns, name, body)
        cur = self.leases.get((ns, name or ""))
        if cur is None:
            return self._status_obj(404, "NotFound", f'leases "{name}" not found')
        if self.intrude_on_put == tag:  # another writer gets there first
            self.intrude_on_put = None
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            cur = self._store(ns, name or "", {"spec": {**cur["spec"], "holderIdentity": "guard-c",
                                                        "renewTime": now, "acquireTime": now}})
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if rv is not None and rv != cur["metadata"]["resourceVersion"]:
            return self._status_obj(409, "Conflict", "Operation cannot be fulfilled on leases.coordination.k8s.io "
                                                     f'"{name}": the object has been modified')
        return 200, self._store(ns, name or "", body)

    def lease(self, ns: str = "llm", name: str = "guard") -> dict | None:
        with self.mu:
            return self.leases.get((ns, name))

    def writes(self, tag: str) -> list[float]:
        return [t for t, who, m, code, _ in list(self.events) if who == tag and m in ("POST", "PUT") and code < 300]


@contextmanager
def lease_api() -> Iterator[tuple[str, LeaseAPI]]:
    api = LeaseAPI()
    try:
        with serve(api.handler) as (url, _):
            yield url, api
    finally:
        api.unhang.set()


def lease_elector(url: str, identity: str, **timing) -> LeaseElector:
    from kubernetes import client

    conf = client.Configuration(host=url)
    conf.retries = 0  # as LeaseElector configures the client it builds itself
    api_client = client.ApiClient(conf, header_name="X-Client", header_value=identity)
    return LeaseElector("guard", "llm", identity, api_client=api_client, **timing)


LEADER_SCRIPT = """
import sys, time
from kubernetes import client
from sla_guard.leader import LeaseElector
conf = client.Configuration(host=sys.argv[1])
conf.retries = 0
api = client.ApiClient(conf, header_name="X-Client", header_value="guard-a")
e = LeaseElector("guard", "llm", "guard-a", api_client=api)  # the defaults: 15 s lease, renew every 5 s
e.start()
while not e.is_leader():
    time.sleep(0.05)
print("leader", flush=True)
time.sleep(3600)
"""


def test_lease_standby_takes_over_within_30s_of_the_leaders_death_with_default_timing():
    """A leader in its own process (default timing: lease 15 s, renew 5 s, deadline 10 s, retry
    2 s) and a standby here. The standby does not take the Lease while it is renewed; after
    SIGKILL of the leader it takes it once the Lease has gone unrenewed for 15 s, within 30 s."""
    with lease_api() as (url, api):
        proc = subprocess.Popen([sys.executable, "-c", LEADER_SCRIPT, url], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        b = lease_elector(url, "guard-b")
        watch = LeaderWatch([b])
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "leader", proc.stderr.read() if proc.stderr else ""
            b.start()
            wait_for(lambda: len(api.writes("guard-a")) >= 2, 30, "the leader renewing")  # one renewal seen by b
            assert b.holder() == "guard-a" and not b.is_leader()
            assert api.lease()["spec"]["holderIdentity"] == "guard-a"
            t_kill = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(b.is_leader, 30, "guard-b taking over within 30 s of the kill")
            takeover = time.monotonic() - t_kill
            # the watcher samples every 5 ms, but a loaded host can starve its thread: let it see b lead
            wait_for(lambda: "guard-b" in watch.first, 10, "the watcher seeing guard-b lead")
            print(f"\nKubernetes Lease (defaults): takeover {takeover:.2f} s after SIGKILL of the leader")
            assert takeover < 30
            last_a, first_b = max(api.writes("guard-a")), min(api.writes("guard-b"))
            assert first_b - last_a >= 15 - 0.2  # only after the Lease went unrenewed a full duration
            spec = api.lease()["spec"]
            assert spec["holderIdentity"] == "guard-b" and spec["leaseTransitions"] == 1
            assert spec["leaseDurationSeconds"] == 15
            assert MICRO_TIME.fullmatch(spec["renewTime"]) and MICRO_TIME.fullmatch(spec["acquireTime"])
        finally:
            watch.stop()
            b.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        # stop() released the Lease: the next candidate need not wait for it to expire
        assert api.lease()["spec"]["holderIdentity"] == ""
        assert "guard-b" in watch.first


def test_lease_conflict_on_renew_steps_the_leader_down():
    """Another writer updates the Lease between the leader's read and its renewal: the renewal
    gets 409 and the leader stops actuating at once (its 20 s renew deadline is far away), then
    re-reads and stands by for the new holder."""
    timing = {"lease_duration_s": 30, "renew_deadline_s": 20, "renew_s": 0.3, "retry_s": 0.3}
    with lease_api() as (url, api):
        a, b = lease_elector(url, "guard-a", **timing), lease_elector(url, "guard-b", **timing)
        watch = LeaderWatch([a, b])
        try:
            a.start()
            wait_for(a.is_leader, 10, "a leading")
            b.start()
            wait_for(lambda: b.holder() == "guard-a", 10, "b standing by")
            api.intrude_on_put = "guard-a"
            wait_for(lambda: any(w == "guard-a" and m == "PUT" and code == 409 for _, w, m, code, _ in api.events),
                     10, "the leader's renewal conflicting")
            t409 = next(t for t, w, m, code, _ in api.events if w == "guard-a" and code == 409)
            wait_for(lambda: not a.is_leader(), 5, "a stepping down after the 409")
            assert watch.last["guard-a"] - t409 < 5 < timing["renew_deadline_s"]
            assert a.conflicts >= 1
            wait_for(lambda: a.holder() == "guard-c", 5, "a re-reading the Lease")
            wait_for(lambda: b.holder() == "guard-c", 5, "b seeing the new holder")
            assert not b.is_leader()
        finally:
            watch.stop()
            a.stop()
            b.stop()
    assert not watch.overlaps, watch.overlaps[:3]


def test_lease_hung_api_server_makes_the_leader_step_down_before_the_lease_expires():
    """The API server stops answering the leader (requests hang past every deadline): the
    leader stops actuating within its renew deadline, before the Lease can expire for anyone
    else; the standby takes over after expiry. Never two leaders."""
    timing = {"lease_duration_s": 6, "renew_deadline_s": 2.5, "renew_s": 0.5, "retry_s": 0.25}
    with lease_api() as (url, api):
        a, b = lease_elector(url, "guard-a", **timing), lease_elector(url, "guard-b", **timing)
        watch = LeaderWatch([a, b])
        try:
            a.start()
            wait_for(a.is_leader, 10, "a leading")
            b.start()
            wait_for(lambda: b.holder() == "guard-a", 10, "b standing by")
            t_hang = time.monotonic()
            api.hang.add("guard-a")
            wait_for(b.is_leader, 30, "b taking over within 30 s")
            wait_for(lambda: "guard-b" in watch.first, 5, "the watch seeing b lead")
            last_renewal = max(api.writes("guard-a"))
            stepped_down = watch.last["guard-a"]
            print(f"\nhung API server: leader stepped down {stepped_down - last_renewal:.2f} s after its last "
                  f"renewal (deadline 2.5 s, lease 6 s); standby leading {watch.first['guard-b'] - t_hang:.2f} s "
                  "after the hang began")
            assert stepped_down < last_renewal + timing["lease_duration_s"]
            assert stepped_down < watch.first["guard-b"]
            assert not a.is_leader()
        finally:
            watch.stop()
            api.unhang.set()
            a.stop()
            b.stop()
    assert not watch.overlaps, watch.overlaps[:3]


def _gated_kubernetes(url: str, identity: str, elector: LeaseElector) -> LeaderGatedActuator:
    """A guard's actuator: the Kubernetes actuator (official client, this guard's X-Client tag)
    behind the leader gate, patching Deployment llm/prefill-pool on the FAKE API server."""
    from kubernetes import client

    api_client = client.ApiClient(client.Configuration(host=url), header_name="X-Client", header_value=identity)
    inner = KubernetesActuator({"prefill": KubernetesTarget(name="prefill-pool", namespace="llm")},
                               api_client=api_client, timeout_s=2.0)
    return LeaderGatedActuator(inner, elector)


def test_two_guards_a_leader_whose_lease_was_taken_does_not_patch_before_its_next_renewal():
    """Two guards, each a LeaseElector and a gated Kubernetes actuator, on one FAKE API server.
    The Lease is deleted (``kubectl delete lease``, to force a new election): the standby creates
    it at its next retry and leads, while the old leader, which renews only every ``renew_s``,
    still reads itself as leader from memory. It patched its stale decision over the new
    leader's (two guards actuating). The gate now renews the Lease just before the patch: the
    old leader finds guard-b holding it, steps down and does not patch."""
    from kubernetes import client

    timing = {"lease_duration_s": 60, "renew_deadline_s": 45, "renew_s": 30, "retry_s": 0.2}
    with lease_api() as (url, api):
        api.scales[("llm", "prefill-pool")] = 2
        a, b = lease_elector(url, "guard-a", **timing), lease_elector(url, "guard-b", **timing)
        try:
            a.start()
            wait_for(a.is_leader, 10, "a leading")
            b.start()
            wait_for(lambda: b.holder() == "guard-a", 10, "b standing by")
            on_a, on_b = _gated_kubernetes(url, "guard-a", a), _gated_kubernetes(url, "guard-b", b)
            on_a.set_replicas("m", "prefill", 3, "k1")  # the leader patches
            with pytest.raises(StandbyError, match=r"not the leader \(holder guard-a\)"):
                on_b.set_replicas("m", "prefill", 5, "k2")
            kubectl = client.CoordinationV1Api(client.ApiClient(client.Configuration(host=url),
                                                                header_name="X-Client", header_value="kubectl"))
            kubectl.delete_namespaced_lease("guard", "llm", _request_timeout=5)
            wait_for(b.is_leader, 10, "b taking the Lease it recreated")
            assert a.is_leader()  # a's memory: renewed well inside its 45 s deadline, next renewal in 30 s
            on_b.set_replicas("m", "prefill", 6, "k3")
            with pytest.raises(StandbyError, match=r"lost the leadership before patching prefill=4 \(holder guard-b\)"):
                on_a.set_replicas("m", "prefill", 4, "k4")
            assert not a.is_leader() and b.is_leader()
        finally:
            a.stop()
            b.stop()
    assert api.patches == [("guard-a", 3), ("guard-b", 6)]
    assert api.scales[("llm", "prefill-pool")] == 6


def test_lease_leader_confirms_by_renewing_and_only_for_a_request_that_ends_before_its_deadline():
    """``confirm(within_s)`` renews the Lease then and there (one more write), and holds only if a
    request answered within ``within_s`` ends before the renew deadline; a stopped elector
    confirms nothing. The config refuses a renew deadline no request deadline fits in."""
    timing = {"lease_duration_s": 8, "renew_deadline_s": 4, "renew_s": 2, "retry_s": 0.2}
    with lease_api() as (url, api):
        a = lease_elector(url, "guard-a", **timing)
        try:
            a.start()
            wait_for(a.is_leader, 10, "a leading")
            writes = len(api.writes("guard-a"))
            assert a.confirm(1.0)
            assert len(api.writes("guard-a")) > writes  # renewed for the request, not taken from memory
            assert not a.confirm(4.0)  # a 4 s request could end past the 4 s renew deadline
            api.hang.add("guard-a")  # a renewal that cannot complete confirms nothing
            assert not a.confirm(0.5)
        finally:
            api.unhang.set()
            a.stop()
        assert not a.confirm(0.5)
    with pytest.raises(ConfigError, match=r"renew_deadline_s \(4\.0\) must be above the kubernetes request deadline"):
        parse_config({"advisor": {"mode": "active", "actuation": {
            "kubernetes": {"prefill": {"name": "p"}},
            "leader_election": {"mode": "kubernetes", "lease_duration_s": 8, "renew_deadline_s": 4, "renew_s": 2}}}})


def test_lease_election_refused_by_rbac_is_an_actuation_error_not_a_quiet_standby():
    """The API server answers 403 to every Lease request (the shipped Role grants leases in one
    namespace, the Lease defaults to the guard's own): the guard never leads, and every decision
    read 'standby: not the leader (holder unknown)', not counted as an error, with no guard
    actuating. It is an ActuationError (counted) that names the HTTP 403."""
    with lease_api() as (url, api):
        api.forbid.add("guard-a")
        a = lease_elector(url, "guard-a", lease_duration_s=6, renew_deadline_s=3, renew_s=1, retry_s=0.2)
        try:
            a.start()
            wait_for(lambda: a.last_error, 10, "the election failing")
            gated = _gated_kubernetes(url, "guard-a", a)
            with pytest.raises(ActuationError) as err:
                gated.set_replicas("m", "prefill", 3, "k")
            assert not isinstance(err.value, StandbyError)
            assert "leader election fails (reading the lease: HTTP 403 Forbidden)" in str(err.value)
        finally:
            a.stop()
    assert not api.patches


def test_lease_elector_built_from_config_and_kubeconfig(tmp_path):
    """The production path: ``advisor.actuation.leader_election`` + ``kubeconfig`` build the
    elector (the client it builds itself, no urllib3 retries); it acquires the Lease with the
    configured identity and duration, and a clean stop releases it. The API server is the FAKE."""
    from sla_guard.compose import build_elector
    from sla_guard.settings.advisor import LeaderElection

    with lease_api() as (url, api):
        kube = tmp_path / "kubeconfig"
        kube.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": url}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
            "users": [{"name": "u", "user": {"token": "x"}}]}))
        le = LeaderElection(mode="kubernetes", lease_name="guard", namespace="llm", identity="guard-z",
                            lease_duration_s=6, renew_deadline_s=3, renew_s=1, retry_s=0.5)
        e = build_elector(le, kubeconfig=str(kube))
        try:
            e.start()
            wait_for(e.is_leader, 10, "the elector leading")
            spec = api.lease()["spec"]
            assert spec["holderIdentity"] == "guard-z" and spec["leaseDurationSeconds"] == 6
        finally:
            e.stop()
        assert api.lease()["spec"]["holderIdentity"] == ""
    with pytest.raises(ConfigError, match=r"advisor\.actuation\.leader_election"):
        build_elector(le, kubeconfig=str(tmp_path / "missing"))


def test_lease_trickling_api_server_fails_each_call_within_call_timeout():
    """An API server trickling its answer a byte at a time: the client's ``_request_timeout``
    bounds each read, so one 0.5 s call held the elector thread for as long as the server trickled
    (and ``stop()`` gave up joining it, leaving the Lease unreleased). Each call is now whole
    within ``call_timeout_s``."""
    from guard_support import Trickle

    srv = Trickle(json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                              "metadata": {"name": "guard", "namespace": "llm", "resourceVersion": "7"},
                              "spec": {"holderIdentity": "guard-x", "leaseDurationSeconds": 15}}), what="headers")
    e = lease_elector(f"http://127.0.0.1:{srv.port}", "guard-a", lease_duration_s=6, renew_deadline_s=2.5,
                      renew_s=0.5, retry_s=0.25, call_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        e.start()
        wait_for(lambda: e.last_error, 5, "the read failing at its deadline")
        assert time.monotonic() - t0 < 3
        assert e.last_error == "reading the lease: TimeoutError: no complete answer within 0.5s"
        assert not e.is_leader()
    finally:
        e.stop()
        srv.stop()
