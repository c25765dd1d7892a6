"""Actuators against real HTTP servers on loopback.

- Webhook: a real ``http.server`` receiver that fails with 5xx a chosen number of times.
- Kubernetes: there is no API server here, so a loopback HTTP server speaks the two
  scale-subresource endpoints (apps/v1 Deployment and leaderworkerset.x-k8s.io/v1
  LeaderWorkerSet ``.../scale``), the pod list and the autoscaling/v2 HPA list with the JSON
  bodies the real API server returns; the requests are built and sent by the official
  ``kubernetes`` client, unmodified.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry
from scale_support import Engine
from scale_support import run as _run
from scale_support import store as _store

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics
from sla_guard.scale.actuators import (
    IDEMPOTENCY_HEADER,
    ActuationError,
    KubernetesActuator,
    WebhookActuator,
    idempotency_key,
)
from sla_guard.scale.evaluator import AdvisorEvaluator
from sla_guard.settings.advisor import AdvisorConfig, KubernetesTarget, Webhook
from sla_guard.store import SeriesStore


@contextmanager
def serve(handler_cls) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


def receiver(fail_first: int, status: int = 503):
    """A webhook receiver answering ``status`` to the first ``fail_first`` POSTs, then 200."""
    seen: list[dict] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"key": self.headers.get(IDEMPOTENCY_HEADER), "auth": self.headers.get("Authorization"),
                         "body": body})
            code = status if len(seen) <= fail_first else 200
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    return H, seen


def test_webhook_retries_5xx_with_one_idempotency_key():
    handler, seen = receiver(fail_first=2)
    with serve(handler) as (url, _):
        act = WebhookActuator(Webhook(url=url + "/scale", retries=3, backoff_s=0.01), token="s3cret")
        key = idempotency_key("m", "decode", 3, 1234.5)
        act.set_replicas("m", "decode", 3, key)
        act.close()
    assert len(seen) == 3  # two 503s, then accepted
    assert {s["key"] for s in seen} == {key}  # the same key on every retry
    assert seen[-1]["body"] == {"model": "m", "pool": "decode", "replicas": 3, "idempotency_key": key}
    assert seen[0]["auth"] == "Bearer s3cret"
    assert idempotency_key("m", "decode", 3, 1300.0) != key  # the next decision gets a new key


def test_webhook_gives_up_and_does_not_retry_4xx():
    handler, seen = receiver(fail_first=100, status=500)
    with serve(handler) as (url, _):
        act = WebhookActuator(Webhook(url=url, retries=2, backoff_s=0.01))
        with pytest.raises(ActuationError, match="HTTP 500"):
            act.set_replicas("m", "prefill", 2, "k1")
    assert len(seen) == 3
    handler, seen = receiver(fail_first=100, status=409)
    with serve(handler) as (url, _):
        act = WebhookActuator(Webhook(url=url, retries=4, backoff_s=0.01))
        with pytest.raises(ActuationError, match="HTTP 409"):
            act.set_replicas("m", "prefill", 2, "k2")
    assert len(seen) == 1


def test_trickling_webhook_fails_each_attempt_within_its_timeout():
    """A receiver that trickles its answer's headers a byte every 0.2 s: httpx's per-read timeout
    never fires, so one scale call held the guard's tick for as long as it trickled. Each attempt
    now ends at ``timeout_s`` and the call fails with the reason."""
    import time

    from guard_support import Trickle

    srv = Trickle("{}", what="headers")
    try:
        act = WebhookActuator(Webhook(url=f"http://127.0.0.1:{srv.port}/scale", retries=1, backoff_s=0.01,
                                      timeout_s=0.5))
        t0 = time.monotonic()
        with pytest.raises(ActuationError, match=r"no complete answer within 0\.5s"):
            act.set_replicas("m", "decode", 3, "k3")
        assert time.monotonic() - t0 < 3 and act.attempts == 2
    finally:
        srv.stop()


def test_active_mode_failure_is_counted_not_fatal():
    """An actuator failing in active mode: the evaluator counts it and keeps recommending."""
    handler, seen = receiver(fail_first=100, status=502)
    with serve(handler) as (url, _):
        reg = CollectorRegistry()
        cfg = AdvisorConfig.model_validate({"mode": "active", "actuation": {"webhook": {"url": url, "retries": 1,
                                                                         "backoff_s": 0.01}},
                             "profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01,
                                         "decode_step_per_request_s": 0.0002}})
        ev = AdvisorEvaluator(cfg, model="m", metrics=ContractMetrics(reg, components=[Component.GUARD]),
                              actuator=WebhookActuator(cfg.actuation.webhook))
        store = _store()
        engines = [Engine("prefill", "p0"), Engine("decode", "d0")]
        busy = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
        _run(engines, store, 1000, 1060, p0=busy, d0={"running": 10, "waiting": 0, "steps": 400})
        ev.evaluate(store, 1060)  # must not raise
    assert len(seen) == 2  # one try + one retry
    assert ev.actuation_errors == 1
    assert reg.get_sample_value(c.GUARD_ACTUATION_ERRORS.series(),
                                {"model": "m", "pool": "prefill", "actuator": "webhook"}) == 1
    rec = next(r for r in ev.snapshot()["recommendations"] if r["pool"] == "prefill")
    assert rec["desired"] > rec["current"]


SELECTORS = {("apps", "llm", "prefill-pool"): "app=p",
             ("lws", "llm", "decode-pool"): "leaderworkerset.sigs.k8s.io/name=decode-pool,"
                                            "leaderworkerset.sigs.k8s.io/worker-index=0"}
NO_GPU = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."


def _pods(state: dict, room: dict) -> list[dict]:
    """The targets' pods as the API server lists them: one per Deployment replica, a leader and
    one worker per LeaderWorkerSet group. Beyond ``room[key]`` replicas the scheduler finds no
    node (the Deployment's pod, or the LWS group's worker, Pending with PodScheduled=False,
    reason Unschedulable; with ``room["tried"]`` False Pending without conditions: the scheduler
    has not got to them yet); the others run."""
    stuck = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": NO_GPU}
    pending = {"phase": "Pending", "conditions": [stuck] if room.get("tried", True) else []}
    out = []
    for key, n in state.items():
        placed = room.get(key, n)
        for i in range(n):
            if key[0] == "apps":
                members = [({"app": "p"}, f"prefill-pool-{i}", i >= placed)]
            else:
                base = {"leaderworkerset.sigs.k8s.io/name": key[2], "leaderworkerset.sigs.k8s.io/group-index": str(i)}
                members = [({**base, "leaderworkerset.sigs.k8s.io/worker-index": str(w)}, f"{key[2]}-{i}-{w}",
                            w == 1 and i >= placed) for w in (0, 1)]
            for labels, name, stuck_here in members:
                out.append({"metadata": {"name": name, "namespace": key[1], "labels": labels},
                            "status": pending if stuck_here else
                            {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}})
    return out


def _matches(selector: str, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",") if term))


def k8s_server(fail_get: int | None = None, fail_patch: int | None = None, grace: int | None = None,
               cap: int | None = None, write_after_get: int | None = None, room: dict | None = None,
               hpas: list[dict] | None = None, forbid: tuple[str, ...] = (), unavailable: set[str] | None = None):
    """Speaks GET/PATCH of the Deployment and LeaderWorkerSet scale subresources (the objects
    themselves are 404, as to a guard without ``get`` on them, unless ``grace``: then GET of the
    Deployment answers it with that ``terminationGracePeriodSeconds``); ``fail_get`` /
    ``fail_patch``: every GET / PATCH answers that status, with a ``Status`` body; ``cap``: a
    PATCH stores (and answers) at most that many replicas, as behind a mutating admission webhook;
    ``write_after_get``: just after answering a scale GET another writer sets that many replicas.
    Each write bumps the object's ``resourceVersion``; a PATCH naming an older one gets 409, as
    from the real API server. It lists pods (``_pods``, with ``room``: key -> replicas the cluster
    can place, changed by the test as it goes) and the HPAs ``hpas`` of namespace llm; a list of
    a resource in ``forbid`` gets 403, as to a Role without ``list`` on it, one in ``unavailable``
    (changed by the test as it goes) 503, as from an API server restarting. ``calls`` holds the
    PATCHes; ``calls.lists`` the list requests (path and query)."""
    state = {("apps", "llm", "prefill-pool"): 2, ("lws", "llm", "decode-pool"): 1}
    calls = _Calls()
    versions = dict.fromkeys(state, 100)
    room = {} if room is None else room

    class H(BaseHTTPRequestHandler):
        def _key(self):
            parts = self.path.split("?")[0].strip("/").split("/")
            # apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
            # apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}/scale
            if len(parts) == 8 and parts[-1] == "scale" and parts[3] == "namespaces":
                group = {"apps": "apps", "leaderworkerset.x-k8s.io": "lws"}.get(parts[1])
                plural_ok = (group, parts[5]) in {("apps", "deployments"), ("lws", "leaderworkersets")}
                if group and plural_ok:
                    return group, parts[4], parts[6]
            return None

        def _reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _scale(self, key):
            group, ns, name = key
            api = "autoscaling/v1" if group == "apps" else "leaderworkerset.x-k8s.io/v1"
            return {"apiVersion": api, "kind": "Scale", "metadata": {"name": name, "namespace": ns,
                                                                  "resourceVersion": str(versions[key])},
                    "spec": {"replicas": state[key]},
                    "status": {"replicas": state[key], "selector": SELECTORS[key]}}

        def _list(self) -> bool:
            from urllib.parse import parse_qs, urlsplit

            url = urlsplit(self.path)
            resource = {"/api/v1/namespaces/llm/pods": "pods",
                        "/apis/autoscaling/v2/namespaces/llm/horizontalpodautoscalers": "horizontalpodautoscalers",
                        }.get(url.path)
            if resource is None:
                return False
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            calls.lists.append({"path": url.path, **q})
            if resource in forbid:
                self._reply(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                  "reason": "Forbidden", "message": f'{resource} is forbidden: User "system:'
                                  f'serviceaccount:monitoring:sla-guard" cannot list resource "{resource}"'})
            elif resource in (unavailable or ()):
                self._reply(503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                                  "reason": "ServiceUnavailable", "message": "the server is currently unable to "
                                  "handle the request"})
            elif resource == "pods":
                items = [p for p in _pods(state, room) if _matches(q.get("labelSelector", ""), p["metadata"]["labels"])
                         and q.get("fieldSelector") in (None, "status.phase=" + p["status"]["phase"])]
                self._reply(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
            else:
                self._reply(200, {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscalerList",
                                  "metadata": {}, "items": hpas or []})
            return True

        def do_GET(self):
            if fail_get is not None:
                return self._reply(fail_get, {"kind": "Status", "code": fail_get, "reason": "InternalError"})
            if self._list():
                return None
            key = self._key()
            if grace is not None and self.path.split("?")[0] == "/apis/apps/v1/namespaces/llm/deployments/prefill-pool":
                return self._reply(200, {"apiVersion": "apps/v1", "kind": "Deployment",
                                         "metadata": {"name": "prefill-pool", "namespace": "llm"},
                                         "spec": {"selector": {"matchLabels": {"app": "p"}}, "template": {"spec": {
                                             "containers": [{"name": "vllm"}],
                                             "terminationGracePeriodSeconds": grace}}}})
            if key not in state:
                return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
            self._reply(200, self._scale(key))
            if write_after_get is not None:
                state[key], versions[key] = write_after_get, versions[key] + 1

        def do_PATCH(self):
            key = self._key()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append({"path": self.path, "content_type": self.headers.get("Content-Type"), "body": body})
            if fail_patch is not None:
                return self._reply(fail_patch, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "code": fail_patch, "message": f"refused with {fail_patch}"})
            if key not in state:
                return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
            if body.get("metadata", {}).get("resourceVersion", str(versions[key])) != str(versions[key]):
                return self._reply(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                                         "reason": "Conflict", "message": "the object has been modified; please "
                                         "apply your changes to the latest version and try again"})
            versions[key] += 1
            state[key] = int(body["spec"]["replicas"]) if cap is None else min(cap, int(body["spec"]["replicas"]))
            self._reply(200, self._scale(key))

        def log_message(self, *a):
            pass

    return H, state, calls


class _Calls(list):
    """The PATCHes the loopback API server received, and (``lists``) its list requests."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: list[dict] = []


def test_kubernetes_scale_subresource_deployment_and_lws():
    from kubernetes import client

    handler, state, calls = k8s_server()
    with serve(handler) as (url, _):
        conf = client.Configuration(host=url)
        api = client.ApiClient(conf)
        act = KubernetesActuator({"prefill": KubernetesTarget(kind="Deployment", name="prefill-pool", namespace="llm"),
                                  "decode": KubernetesTarget(kind="LeaderWorkerSet", name="decode-pool",
                                                             namespace="llm")}, api_client=api)
        assert act.get_replicas("prefill") == 2
        assert act.get_replicas("decode") == 1
        act.set_replicas("m", "prefill", 3, "k")
        act.set_replicas("m", "decode", 2, "k")
        with pytest.raises(ActuationError, match="no kubernetes target"):
            act.set_replicas("m", "mixed", 1, "k")
        missing = KubernetesActuator({"prefill": KubernetesTarget(name="nope", namespace="llm")}, api_client=api)
        with pytest.raises(ActuationError, match="Deployment/llm/nope"):
            missing.set_replicas("m", "prefill", 1, "k")
        api.close()
    assert state[("apps", "llm", "prefill-pool")] == 3
    assert state[("lws", "llm", "decode-pool")] == 2
    paths = [x["path"] for x in calls[:2]]
    assert paths == ["/apis/apps/v1/namespaces/llm/deployments/prefill-pool/scale",
                     "/apis/leaderworkerset.x-k8s.io/v1/namespaces/llm/leaderworkersets/decode-pool/scale"]
    assert all("patch" in (x["content_type"] or "") for x in calls)
    assert calls[0]["body"] == {"metadata": {"resourceVersion": "100"}, "spec": {"replicas": 3}}


def _k8s_actuator(url: str, **kw) -> KubernetesActuator:
    from kubernetes import client

    return KubernetesActuator({"prefill": KubernetesTarget(kind="Deployment", name="prefill-pool", namespace="llm")},
                              api_client=client.ApiClient(client.Configuration(host=url)), **kw)


def test_kubernetes_hung_or_trickling_api_server_fails_within_the_timeout():
    """An API server trickling its answer a byte at a time: the client's ``_request_timeout``
    bounds each read, and the actuator passed none at all, so one scale call held the guard's
    tick for as long as the server trickled. Each call is now whole within ``timeout_s``."""
    import time

    from guard_support import Trickle

    srv = Trickle('{"spec": {"replicas": 2}}', what="headers")
    try:
        act = _k8s_actuator(f"http://127.0.0.1:{srv.port}")
        act.timeout_s = 0.5
        out: dict = {}

        def call() -> None:
            try:
                act.set_replicas("m", "prefill", 3, "k")
            except ActuationError as err:
                out["err"] = str(err)

        t0 = time.monotonic()
        th = threading.Thread(target=call, daemon=True)
        th.start()
        th.join(5)
        assert not th.is_alive(), "the scale call is still held by the trickling API server"
        assert time.monotonic() - t0 < 3
        assert "no complete answer within 0.5s" in out["err"]
    finally:
        srv.stop()


def test_kubernetes_scale_down_fails_closed_when_size_or_grace_period_is_unreadable():
    """The drain check skipped itself when it could not read the current size or the grace
    period (the shipped RBAC granted only ``.../scale``, so reading the Deployment was refused)
    and the scale-down went ahead, killing pods sooner than the pool drains. It is refused now,
    and a pool whose size cannot be read is not patched at all."""
    handler, state, calls = k8s_server()
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        act.drain_grace_s["prefill"] = 200.0
        with pytest.raises(ActuationError, match="cannot read its terminationGracePeriodSeconds"):
            act.set_replicas("m", "prefill", 1, "k")
        act.set_replicas("m", "prefill", 3, "k")  # a scale-up needs no drain
    assert state[("apps", "llm", "prefill-pool")] == 3 and len(calls) == 1
    handler, state, calls = k8s_server(fail_get=500)
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        act.drain_grace_s["prefill"] = 200.0
        with pytest.raises(ActuationError, match="reading scale of Deployment/llm/prefill-pool failed"):
            act.set_replicas("m", "prefill", 1, "k")
        with pytest.raises(ActuationError, match="reading scale"):
            _k8s_actuator(url).set_replicas("m", "prefill", 1, "k")
    assert not calls and state[("apps", "llm", "prefill-pool")] == 2


def test_kubernetes_actuator_does_not_patch_after_losing_the_leadership():
    """LeaderGatedActuator checked the leadership once, before the actuator's reads; a leader
    whose lease lapsed while those reads were slow still sent the patch (two leaders actuating).
    The gate is checked again just before the patch, as it is before each webhook attempt."""
    from sla_guard.scale.actuators import LeaderGatedActuator, StandbyError

    class Lapsing:  # leads at the gate, no longer by the time of the patch
        identity = "guard-a"

        def __init__(self) -> None:
            self.asked = 0

        def is_leader(self) -> bool:
            self.asked += 1
            return self.asked == 1

        def confirm(self, within_s: float) -> bool:  # asked just before the patch
            return self.is_leader()

        def holder(self) -> str | None:
            return None

        def start(self) -> None: ...

        def stop(self) -> None: ...

    handler, state, calls = k8s_server()
    with serve(handler) as (url, _):
        gated = LeaderGatedActuator(_k8s_actuator(url), Lapsing())
        with pytest.raises(StandbyError, match="lost the leadership"):
            gated.set_replicas("m", "prefill", 3, "k")
    assert not calls and state[("apps", "llm", "prefill-pool")] == 2


def _active_evaluator(actuator, reg: CollectorRegistry, **cfg) -> AdvisorEvaluator:
    conf = AdvisorConfig.model_validate({
        "mode": "active", "model": "m", "cooldown_s": 0,
        "actuation": {"kubernetes": {"prefill": {"name": "prefill-pool", "namespace": "llm"}}},
        "pools": {"prefill": {"min_replicas": 1, "max_replicas": 100}},
        "profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01, "decode_step_per_request_s": 0.0002},
        **cfg})
    return AdvisorEvaluator(conf, model="m", metrics=ContractMetrics(reg, components=[Component.GUARD]),
                            actuator=actuator)


BUSY = {"running": 4, "waiting": 30, "computed": 60_000, "prefills": 6, "ttft": 8.0}
DECODE = {"running": 10, "waiting": 0, "steps": 400}


def _prefill(ev: AdvisorEvaluator) -> dict:
    return [r for r in ev.history if r["pool"] == "prefill"][-1]


@pytest.mark.parametrize("gated", [False, True])
def test_an_order_another_writer_set_back_is_noticed_and_placed_again(tmp_path, gated):
    """The guard patches prefill up; then something else sets ``spec.replicas`` back (an HPA or
    KEDA on the same Deployment, an admission policy). The advisor counted the replicas it ordered
    as starting for up to 30 minutes and held ('prefill_steady', current 4 while 1 was ordered):
    the overload went on unanswered and nothing said so. Each tick now compares the outstanding
    order with the target's size: the shortfall is logged, counted as an actuation error and
    recorded as ``overridden``, and the advisor orders again. Also behind the leader gate."""
    from sla_guard.leader import FileLockElector

    handler, state, calls = k8s_server()
    key = ("apps", "llm", "prefill-pool")
    state[key] = 1
    reg = CollectorRegistry()
    elector = FileLockElector(tmp_path / "lock", identity="guard-a")
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        ev = _active_evaluator(_gated(act, elector) if gated else act, reg)
        st, engines = _busy_tick(ev)
        first = _prefill(ev)
        assert first["direction"] == "up" and first["actuated"] is True
        ordered = first["desired"]
        assert state[key] == ordered > 1
        state[key] = 1  # set back by another writer
        _run(engines, st, 1065, 1075, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1075)
    elector.stop()
    again = _prefill(ev)
    assert again["overridden"].startswith(f"prefill: the target's size is 1, not the {ordered} this guard ordered")
    assert again["current"] == 1 and again["direction"] == "up" and again["actuated"] is True
    assert state[key] == again["desired"] and len(calls) == 2
    assert reg.get_sample_value(c.GUARD_ACTUATION_ERRORS.series(),
                                {"model": "m", "pool": "prefill", "actuator": "kubernetes"}) == 1


def test_a_patch_the_api_server_answers_with_a_capped_size_fails_at_once():
    """A mutating admission webhook caps the patch (5 asked, 3 stored): the API server answers
    200 with the stored Scale. The answer was not read, so the guard took 5 as ordered and the
    advisor counted 2 replicas that never come until the next tick's check. The answer's
    ``spec.replicas`` is now compared with the request: ``CappedError`` saying both numbers."""
    from sla_guard.scale.actuators import CappedError

    handler, state, calls = k8s_server(cap=3)
    with serve(handler) as (url, _):
        from kubernetes import client

        api = client.ApiClient(client.Configuration(host=url))
        act = KubernetesActuator({"prefill": KubernetesTarget(kind="Deployment", name="prefill-pool", namespace="llm"),
                                  "decode": KubernetesTarget(kind="LeaderWorkerSet", name="decode-pool",
                                                             namespace="llm")}, api_client=api)
        with pytest.raises(CappedError, match=r"Deployment/llm/prefill-pool to 5: the API server set "
                                              r"spec.replicas to 3 instead") as deployment:
            act.set_replicas("m", "prefill", 5, "k")
        with pytest.raises(CappedError, match=r"LeaderWorkerSet/llm/decode-pool to 4: .* to 3 instead") as lws:
            act.set_replicas("m", "decode", 4, "k")
        act.set_replicas("m", "prefill", 3, "k")  # as asked: no error
        api.close()
    assert deployment.value.applied == lws.value.applied == 3 and len(calls) == 3
    assert state[("apps", "llm", "prefill-pool")] == state[("lws", "llm", "decode-pool")] == 3


def _one_busy_tick(handler, state: dict, reg: CollectorRegistry):
    """One active evaluation against the loopback API server, prefill at 1 replica and busy:
    the evaluator and its prefill decision record."""
    state[("apps", "llm", "prefill-pool")] = 1
    with serve(handler) as (url, _):
        ev = _active_evaluator(_k8s_actuator(url), reg)
        _busy_tick(ev)
    return ev, _prefill(ev)


def _busy_tick(ev: AdvisorEvaluator) -> tuple[SeriesStore, list[Engine]]:
    """Prefill busy on one replica for a minute, then one evaluation: the store and engines, to go on with."""
    st, engines = _store(), [Engine("prefill", "p0"), Engine("decode", "d0")]
    _run(engines, st, 1000, 1060, p0=BUSY, d0=DECODE)
    ev.evaluate(st, 1060)
    return st, engines


def _gated(act, elector):
    """``act`` behind the leader gate, with this guard leading (one step takes the free lock)."""
    from sla_guard.scale.actuators import LeaderGatedActuator

    assert elector.confirm(0.0)
    return LeaderGatedActuator(act, elector)


def test_a_capped_patch_is_counted_as_the_size_the_target_holds():
    """In active mode the capped patch is an actuation error (counted, ``actuated: "error: ..."``)
    and the advisor expects only the size the API server stored, not the one it asked for."""
    handler, state, calls = k8s_server(cap=2)
    key = ("apps", "llm", "prefill-pool")
    reg = CollectorRegistry()
    ev, rec = _one_busy_tick(handler, state, reg)
    assert rec["direction"] == "up" and rec["desired"] > 2 and state[key] == 2 and len(calls) == 1
    assert rec["actuated"].startswith(f"error: scaling Deployment/llm/prefill-pool to {rec['desired']}: the API "
                                      "server set spec.replicas to 2 instead")
    assert ev.advisors["m"].pending["prefill"] == (2, 1060)
    assert reg.get_sample_value(c.GUARD_ACTUATION_ERRORS.series(),
                                {"model": "m", "pool": "prefill", "actuator": "kubernetes"}) == 1


def test_a_write_between_the_read_and_the_patch_gets_a_conflict_not_overwritten():
    """Another writer (an HPA, a newer leader) sets the size after the guard read it: the patch
    carried no ``resourceVersion``, so it overwrote that write unseen (and a patch the API server
    committed after the guard's deadline was not fenced). It now names the version it read and
    the API server answers 409: not applied, decided again next tick."""
    handler, state, calls = k8s_server(write_after_get=6)
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        with pytest.raises(ActuationError, match=r"scaling Deployment/llm/prefill-pool to 3 failed: HTTP 409 .*"
                                                 r"another writer"):
            act.set_replicas("m", "prefill", 3, "k")
    assert state[("apps", "llm", "prefill-pool")] == 6 and calls[0]["body"]["metadata"] == {"resourceVersion": "100"}


@pytest.mark.parametrize(("code", "says"), [
    (401, "rejected the guard's credentials"), (403, "RBAC: the guard's service account needs patch on "
                                                     "deployments/scale 'prefill-pool' in namespace 'llm'"),
    (404, "no such Deployment (advisor.actuation.kubernetes.prefill"), (409, "another writer"),
    (429, "throttling"), (500, "the API server failed"), (503, "the API server failed")])
def test_kubernetes_refusals_leave_the_decision_not_applied_with_one_line_saying_why(code, says):
    """Every refusal of the patch is an ActuationError, the scale untouched, the decision recorded
    as not applied (``/v1/decisions``) and counted (``slaguard_guard_actuation_errors_total``).
    The reason was ``str(ApiException)``: four lines with every response header and no word on
    what to do; it is one line with the status, the API server's message and the fix."""
    handler, state, calls = k8s_server(fail_patch=code)
    key = ("apps", "llm", "prefill-pool")
    reg = CollectorRegistry()
    ev, rec = _one_busy_tick(handler, state, reg)
    assert rec["direction"] == "up" and state[key] == 1 and len(calls) == 1
    why = rec["actuated"]
    assert why.startswith(f"error: scaling Deployment/llm/prefill-pool to {rec['desired']} failed: HTTP {code} ")
    assert "\n" not in why and f"refused with {code}" in why and says in why and "HTTPHeaderDict" not in why
    assert ev.actuation_errors == 1
    assert reg.get_sample_value(c.GUARD_ACTUATION_ERRORS.series(),
                                {"model": "m", "pool": "prefill", "actuator": "kubernetes"}) == 1


def test_scale_down_behind_the_leader_gate_still_goes_through_the_drain_check(tmp_path):
    """Four idle prefill replicas, the longest request ~0.5 s (drain time x 1.5 + 60 s), pods
    killed after 30 s. The evaluator hands the drain time to the actuator only if it has
    ``drain_grace_s``, which the leader gate (two guards) lacked: behind it the Kubernetes
    actuator never checked the grace period and scaled down. The gate passes it on now."""
    from sla_guard.leader import FileLockElector
    from sla_guard.scale.actuators import LeaderGatedActuator

    handler, state, calls = k8s_server(grace=30)
    key = ("apps", "llm", "prefill-pool")
    state[key] = 4
    elector = FileLockElector(tmp_path / "lock", identity="guard-a", retry_s=0.05)
    idle = {"running": 0, "waiting": 0, "computed": 100, "prefills": 1}
    with serve(handler) as (url, _):
        try:
            assert elector.confirm(0.0)  # one step takes the free lock: this guard leads
            gated = LeaderGatedActuator(_k8s_actuator(url), elector)
            ev = _active_evaluator(gated, CollectorRegistry(), stabilization_down_s=0, min_evidence_s=0,
                                   no_reversal_s=0, recurrence_horizon_s=0, window_s=30)
            st = _store()
            engines = [Engine("prefill", f"p{i}") for i in range(4)] + [Engine("decode", "d0")]
            _run(engines, st, 1000, 1060, d0=DECODE, **{f"p{i}": idle for i in range(4)})
            ev.evaluate(st, 1060)
        finally:
            elector.stop()
    rec = _prefill(ev)
    assert rec["direction"] == "down" and rec["numbers"]["drain_grace_s"] > 60
    assert rec["actuated"].startswith("error: refusing to scale Deployment/llm/prefill-pool down to 3: "
                                      "terminationGracePeriodSeconds 30 s < drain time")
    assert state[key] == 4 and not calls


def test_kubernetes_actuation_with_every_model_is_refused_naming_the_field():
    """``advisor.model`` defaults to '*': one advisor per model the engines report. The Kubernetes
    targets are one object per pool, so with two models both advisors patched the same Deployment
    (model 'big' ordered 4 prefill replicas, model 'small' then 2, each tick). Refused at load."""
    from sla_guard.config import ConfigError, parse_config

    active = {"mode": "active", "actuation": {"kubernetes": {"prefill": {"name": "glm-prefill"}}}}
    with pytest.raises(ConfigError, match=r"advisor: .*model '\*' sizes every model .* set advisor\.model"):
        parse_config({"advisor": active})
    assert parse_config({"advisor": {**active, "model": "glm-5.2"}}).advisor.model == "glm-5.2"
    parse_config({"advisor": {"mode": "active", "actuation": {"webhook": {"url": "http://127.0.0.1:9/scale"}}}})


def test_replicas_that_cannot_be_scheduled_are_not_counted_as_starting_nor_ordered_on_top(caplog):
    """The cluster has GPUs for one prefill replica: the guard orders 4 and 3 pods stay Pending
    (PodScheduled=False, Unschedulable). The advisor counted them as starting (current 4 = 1 ready
    + 3 starting, 'prefill_steady') for 30 minutes, held while the pool served on 1, and once the
    order timed out ordered again on top of them. The actuator now reads the target's Pending
    pods (one list per tick while an order is outstanding): once the scheduler has found no room
    the 3 are not starting, the decision holds at what was ordered (``hold_replicas_unschedulable``,
    ``unschedulable`` 3, one log line with the fix), also past the timeout, and the start cut short
    is not learned as a 15 s start time; once the nodes come, they count as starting again."""
    import logging

    key = ("apps", "llm", "prefill-pool")
    room: dict = {key: 1, "tried": False}
    handler, state, calls = k8s_server(room=room)
    state[key] = 1
    reg = CollectorRegistry()
    caplog.set_level(logging.WARNING, logger="sla_guard.scale.evaluator")
    with serve(handler) as (url, _):
        ev = _active_evaluator(_k8s_actuator(url), reg)
        st, engines = _store(), [Engine("prefill", "p0"), Engine("decode", "d0")]
        _run(engines, st, 1000, 1060, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1060)
        first = _prefill(ev)
        assert first["direction"] == "up" and first["actuated"] is True and state[key] == first["desired"] == 4
        pod_lists = lambda: [x for x in calls.lists if x["path"].endswith("/pods")]  # noqa: E731
        assert not pod_lists()  # no order outstanding at the first tick: no pod list
        _run(engines, st, 1065, 1075, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1075)  # the scheduler has not tried yet: they count as starting
        unplaced = _prefill(ev)
        room["tried"] = True
        held = []
        for t in (1090, 1105):
            _run(engines, st, t - 10, t, p0=BUSY, d0=DECODE)
            ev.evaluate(st, t)
            held.append(_prefill(ev))
        assert [x["labelSelector"] for x in pod_lists()] == ["app=p"] * 3  # one per tick
        assert pod_lists()[0]["fieldSelector"] == "status.phase=Pending"
        adv = ev.advisors["m"]
        adv.pending_timeout_s = 60.0  # the order is now older than the timeout
        _run(engines, st, 1305, 1320, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1320)
        held.append(_prefill(ev))
        adv.pending_timeout_s = 1800.0
        room[key] = 4  # GPU nodes added: the 3 are placed and start
        _run(engines, st, 1325, 1335, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1335)
        placed = _prefill(ev)
    assert unplaced["current"] == 4 and unplaced["numbers"]["starting"] == 3
    assert "unschedulable" not in unplaced["numbers"]
    for rec in held:
        assert rec["current"] == 1 and rec["desired"] == 1 and rec["direction"] == "none", rec
        assert rec["reasons"][0] == "hold_replicas_unschedulable" and rec["actuated"] is False
        n = rec["numbers"]
        assert (n["ready"], n["starting"], n["unschedulable"], n["ordered"]) == (1, 0, 3, 4)
        assert n["sized_desired"] > 1
    assert state[key] == 4 and len(calls) == 1  # nothing ordered on top of the 4
    assert adv.memory["prefill"].start_s == 0.0  # an order found stuck is no start time
    assert reg.get_sample_value(c.GUARD_SCALING_DECISIONS.series(), {
        "model": "m", "pool": "prefill", "direction": "none", "reason": "hold_replicas_unschedulable"}) == 3
    said = [r.getMessage() for r in caplog.records if "cannot be scheduled" in r.getMessage()]
    assert said == ["advisor: prefill: 3 of the 4 replicas ordered cannot be scheduled (PodScheduled=False, "
                    f"Unschedulable: {NO_GPU}); they are not counted as starting and no more are ordered on top "
                    "of them: add GPU nodes or lower advisor.pools.prefill.max_replicas"]
    assert placed["current"] == 4 and placed["numbers"]["starting"] == 3 and placed["direction"] == "none"
    assert "unschedulable" not in placed["numbers"] and not any("unschedulable" in r for r in placed["reasons"])


def test_unschedulable_counts_leaderworkerset_groups_and_says_what_rbac_lacks():
    """A LeaderWorkerSet replica is a group; its scale selector names the leaders only, and a group
    whose worker cannot be placed is not coming either: each such group counts once. A pod list
    the Role does not allow is an error naming the permission, never 0."""
    from kubernetes import client

    lws = ("lws", "llm", "decode-pool")
    handler, state, calls = k8s_server(room={lws: 1})
    state[lws] = 3
    with serve(handler) as (url, _):
        act = KubernetesActuator({"decode": KubernetesTarget(kind="LeaderWorkerSet", name="decode-pool",
                                                             namespace="llm")},
                                 api_client=client.ApiClient(client.Configuration(host=url)))
        assert act.unschedulable("decode") == (2, NO_GPU)
    assert calls.lists[-1]["labelSelector"] == "leaderworkerset.sigs.k8s.io/name=decode-pool"
    handler, state, calls = k8s_server(room={("apps", "llm", "prefill-pool"): 0}, forbid=("pods",))
    says = r"listing the pods of Deployment/llm/prefill-pool failed: HTTP 403 .*needs list on pods in namespace 'llm'"
    with serve(handler) as (url, _), pytest.raises(ActuationError, match=says + r" \(deploy/k8s/rbac.yaml\)"):
        _k8s_actuator(url).unschedulable("prefill")


def _hpa(name: str, kind: str, target: str, keda: str | None = None) -> dict:
    meta: dict = {"name": name, "namespace": "llm"}
    if keda:
        meta["labels"] = {"scaledobject.keda.sh/name": keda, "app.kubernetes.io/managed-by": "keda-operator"}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 8}}


@pytest.mark.parametrize("gated", [False, True])
def test_an_hpa_on_the_target_is_named_and_the_guard_does_not_fight_it(caplog, tmp_path, gated):
    """A KEDA ScaledObject (through its HPA) scales the same Deployment as the guard in active
    mode: each set the size in turn, and the guard saw the HPA only by its effect. At the first
    tick the guard now lists the namespace's HPAs, logs one error naming the HPA, its ScaledObject
    and the fix, counts it, and refuses to patch that pool; HPAs on other objects are no conflict.
    The list is asked again every ``hpa_check_s`` (not every tick): once the HPA is gone, it
    patches again. Also behind the leader gate (a standby, which patches nothing, does not look)."""
    import logging

    from sla_guard.leader import FileLockElector

    hpas = [_hpa("keda-hpa-glm-prefill", "Deployment", "prefill-pool", keda="glm-prefill"),
            _hpa("other", "Deployment", "decode-pool"), _hpa("lws-named-alike", "LeaderWorkerSet", "prefill-pool")]
    handler, state, calls = k8s_server(hpas=hpas)
    key = ("apps", "llm", "prefill-pool")
    state[key] = 1
    reg = CollectorRegistry()
    caplog.set_level(logging.WARNING)
    clock = [0.0]
    elector = FileLockElector(tmp_path / "lock", identity="guard-a")
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        act.clock = lambda: clock[0]
        ev = _active_evaluator(_gated(act, elector) if gated else act, reg)
        st, engines = _busy_tick(ev)
        refused = _prefill(ev)
        hpas.clear()  # the ScaledObject is removed
        clock[0] = 299.0
        _run(engines, st, 1065, 1075, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1075)
        still = _prefill(ev)
        clock[0] = 300.0
        _run(engines, st, 1080, 1090, p0=BUSY, d0=DECODE)
        ev.evaluate(st, 1090)
        applied = _prefill(ev)
    elector.stop()
    line = ("HorizontalPodAutoscaler llm/keda-hpa-glm-prefill (created by KEDA ScaledObject 'glm-prefill') also "
            "scales Deployment/llm/prefill-pool, so the guard does not patch prefill (the two would fight): remove "
            "the ScaledObject, or run the guard in advisory mode (advisor.mode: advisory) and let the HPA follow the "
            "guard's desired replicas as its external metric")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("advisor: " + line)
    assert refused["direction"] == "up" and refused["actuated"].startswith(
        f"error: not scaling Deployment/llm/prefill-pool to {refused['desired']}: {line}")
    assert still["actuated"].startswith("error: not scaling")  # the next list is due after 300 s
    hpa_lists = [x for x in calls.lists if x["path"].endswith("/horizontalpodautoscalers")]
    assert len(hpa_lists) == 2 and applied["actuated"] is True and len(calls) == 1
    assert state[key] == applied["desired"]
    # found (1) and two decisions refused (2)
    assert reg.get_sample_value(c.GUARD_ACTUATION_ERRORS.series(),
                                {"model": "m", "pool": "prefill", "actuator": "kubernetes"}) == 3


def test_a_failed_hpa_list_is_asked_again_soon_not_after_five_minutes():
    """The first list of HPAs failed (an API server restarting: 503) and was next asked 300 s
    later: a KEDA ScaledObject on the target went unseen for five minutes while the guard and it
    set the size in turn. A failed list is now asked again after 15 s, then 30, 60 ... s; a list
    that succeeds puts the check back on its 300 s period."""
    hpas = [_hpa("keda-hpa-glm-prefill", "Deployment", "prefill-pool", keda="glm-prefill")]
    down = {"horizontalpodautoscalers"}
    handler, _, calls = k8s_server(hpas=hpas, unavailable=down)
    clock = [0.0]
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        act.clock = lambda: clock[0]
        first = act.check_autoscalers()  # 503: no answer
        clock[0] = 10.0
        early = act.check_autoscalers()  # not due yet
        clock[0] = 15.0
        second = act.check_autoscalers()  # 503 again: next after 30 s
        clock[0] = 40.0
        not_yet = act.check_autoscalers()
        down.clear()  # the API server is back
        clock[0] = 45.0
        found = act.check_autoscalers()
        clock[0] = 45.0 + 299.0
        quiet = act.check_autoscalers()  # a good answer: the normal period again
    hpa_lists = [x for x in calls.lists if x["path"].endswith("/horizontalpodautoscalers")]
    assert first == early == second == not_yet == quiet == {}
    assert list(found) == ["prefill"] and "keda-hpa-glm-prefill" in act.conflicts["prefill"]
    assert len(hpa_lists) == 3


def test_a_forbidden_hpa_list_is_warned_once_naming_the_rbac_rule(caplog):
    """A Role without ``list`` on horizontalpodautoscalers (the shipped one had none): a 403 is no
    answer, not 'no HPA'. One warning says which rule to add to deploy/k8s/rbac.yaml, not one
    per check; the scale itself goes on."""
    import logging

    handler, state, calls = k8s_server(forbid=("horizontalpodautoscalers",))
    caplog.set_level(logging.WARNING, logger="sla_guard.scale.actuators")
    clock = [0.0]
    with serve(handler) as (url, _):
        act = _k8s_actuator(url)
        act.clock = lambda: clock[0]
        act.set_replicas("m", "prefill", 3, "k")
        clock[0] = 600.0
        act.set_replicas("m", "prefill", 4, "k")
    said = [r.getMessage() for r in caplog.records if "HorizontalPodAutoscalers" in r.getMessage()]
    assert len(said) == 1 and "(HTTP 403)" in said[0] and "not read as none" in said[0]
    assert 'apiGroups ["autoscaling"], resources ["horizontalpodautoscalers"], verbs ["list"]' in said[0]
    assert len(calls.lists) == 2 and state[("apps", "llm", "prefill-pool")] == 4 and not act.conflicts


def test_the_shipped_rbac_grants_what_the_actuator_lists():
    """The actuator lists the targets' pods and the namespace's HPAs: the shipped Role grants
    both (without them the checks fail with 403 on every install)."""
    from pathlib import Path

    import yaml

    docs = list(yaml.safe_load_all((Path(__file__).resolve().parents[1] / "deploy/k8s/rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"] if "resourceNames" not in rule}
    assert ("autoscaling", "horizontalpodautoscalers", "list") in granted
    assert ("", "pods", "list") in granted


IDLE = {"running": 0, "waiting": 0, "computed": 100, "prefills": 1}
LESS = {"running": 4, "waiting": 6, "computed": 30_000, "prefills": 6, "ttft": 3.0}  # BUSY eased off


def _life(url: str, db: str, t0: float, t1: float, prefill: list[dict], webhook: bool = False):
    """One life of a guard (its state file, the advisor in active mode on the loopback API server,
    or a webhook receiver, the default 60 s cooldown) over prefill replicas at the loads
    ``prefill`` from ``t0``, ticked at ``t1``: the guard and its advisor."""
    from sla_guard.config import GuardConfig
    from sla_guard.service import Guard
    from sla_guard.state import StateStore

    act = WebhookActuator(Webhook(url=url, retries=0)) if webhook else _k8s_actuator(url)
    ev = _active_evaluator(act, CollectorRegistry(), cooldown_s=60, stabilization_down_s=0,
                           min_evidence_s=0, no_reversal_s=0, recurrence_horizon_s=0, window_s=30)
    st = _store()
    guard = Guard(GuardConfig(), None, [ev], state=StateStore(db))
    engines = [Engine("prefill", f"p{i}") for i in range(len(prefill))] + [Engine("decode", "d0")]
    _run(engines, st, t0, t1, d0=DECODE, **{f"p{i}": load for i, load in enumerate(prefill)})
    guard.tick(t1, view=st)
    return guard, ev


_LIFE = """
import sys
sys.path.insert(0, sys.argv[1])
import test_actuator as t
t._life(sys.argv[2], sys.argv[3], 1000.0, 1060.0, [t.IDLE] * 4 if sys.argv[4] == "down" else [t.BUSY],
        webhook=sys.argv[5] == "webhook")
"""


@contextmanager
def _api_server_that_kills(**kw):
    """The loopback API server (``k8s_server(**kw)``, also a webhook receiver) and ``life(db,
    scenario, via)``: runs ``_LIFE`` in a real process, which the server SIGKILLs as soon as it has
    stored that process's scale PATCH (or received its webhook POST), before answering it;
    returns once the process is dead. ``calls.posts``: the webhook bodies."""
    import io
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    handler, state, calls = k8s_server(**kw)
    calls.posts = []
    victim: dict = {}

    class Killing(handler):
        def do_PATCH(self):
            if "pid" not in victim:
                return super().do_PATCH()
            out, self.wfile = self.wfile, io.BytesIO()  # stored, the answer not yet sent
            super().do_PATCH()
            os.kill(victim.pop("pid"), signal.SIGKILL)
            self.wfile = out
            return None

        def do_POST(self):
            calls.posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if "pid" in victim:
                os.kill(victim.pop("pid"), signal.SIGKILL)
                return
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(Path(tests).parent)}
    with serve(Killing) as (url, _):
        def life(db: str, scenario: str, via: str = "kubernetes") -> None:
            proc = subprocess.Popen([sys.executable, "-c", _LIFE, tests, url, db, scenario, via], env=env,
                                    stderr=subprocess.PIPE, text=True)
            victim["pid"] = proc.pid
            try:
                assert proc.wait(60) == -signal.SIGKILL, proc.stderr.read()[-3000:]
            finally:
                proc.kill()
                proc.stderr.close()

        yield url, state, calls, life


@pytest.mark.parametrize("via", ["kubernetes", "webhook"])
def test_a_guard_killed_just_after_a_scale_down_order_keeps_its_cooldown_and_the_decision(tmp_path, via):
    """A real guard process scales idle prefill down 4 -> 3 and is SIGKILLed by the loopback API
    server the moment it has stored the PATCH (or by the webhook receiver as the POST arrives),
    before answering, so before the tick's save. Restarted 15 s later on the 3 replicas left, it
    had forgotten the scale-down (cooldown clock, size it went down to) and took the next step
    at once, 3 -> 2 within the 60 s cooldown; the decision that was applied was missing from
    ``/v1/decisions``. The advisor's state and the decision (outcome unknown) are now written
    before the order is sent."""
    key = ("apps", "llm", "prefill-pool")
    db = str(tmp_path / "state.db")
    with _api_server_that_kills(grace=600) as (url, state, calls, life):
        state[key] = 4

        def orders() -> list[int]:
            return [c["body"]["spec"]["replicas"] for c in calls] + [b["replicas"] for b in calls.posts]

        life(db, "down", via)
        assert orders() == [3]  # the scale-down reached the target
        guard, ev = _life(url, db, 1045.0, 1075.0, [IDLE] * 3, webhook=via == "webhook")  # the drained one is gone
        guard.state.close()
    rec = _prefill(ev)
    assert rec["t"] == 1075.0 and rec["direction"] == "none" and "hold_cooldown" in rec["reasons"], rec
    assert orders() == [3]
    died = [r for r in ev.history if r["pool"] == "prefill" and r["t"] == 1060.0]
    assert [(r["current"], r["desired"], r["direction"]) for r in died] == [(4, 3, "down")]
    assert died[0]["actuated"].startswith("unknown")


def test_a_guard_killed_just_after_a_scale_up_patch_still_counts_the_replicas_ordered(tmp_path):
    """A real guard process scales busy prefill up 1 -> 4 and is SIGKILLed by the loopback API
    server as it stores the PATCH. Restarted, with the load eased off, it no longer knew the 3
    replicas were ordered: it sized the pool on the 1 ready and ordered 'up' to 3, which set the
    target from 4 down to 3, past every scale-down guardrail (a guard that had saved the order
    held at 4, its stabilisation window). The order is now written ahead, counted as starting
    after the restart and checked against the target's size at the next tick."""
    key = ("apps", "llm", "prefill-pool")
    db = str(tmp_path / "state.db")
    with _api_server_that_kills(grace=600) as (url, state, calls, life):
        state[key] = 1
        life(db, "up")
        assert state[key] == 4 and len(calls) == 1
        guard, ev = _life(url, db, 1060.0, 1120.0, [LESS])
        guard.state.close()
    rec = _prefill(ev)
    assert (rec["current"], rec["numbers"]["starting"], rec["direction"]) == (4, 3, "none"), rec
    assert state[key] == 4 and len(calls) == 1


def _detached_life(url: str, db: str, prefill: list[dict]):
    """A guard started while another holds its state file (a rolling update): persistence off,
    the advisor in active mode on the loopback API server (60 s cooldown), prefill replicas at the
    loads ``prefill`` from 1000 s, ticked at 1060 s: the guard, its advisor, the engines and the
    series store, to go on with."""
    from sla_guard.config import GuardConfig
    from sla_guard.service import Guard
    from sla_guard.state import StateStore

    ev = _active_evaluator(_k8s_actuator(url), CollectorRegistry(), cooldown_s=60, stabilization_down_s=0,
                           min_evidence_s=0, no_reversal_s=0, recurrence_horizon_s=0, window_s=30)
    guard = Guard(GuardConfig(), None, [ev], state=StateStore(db, retry=True))
    assert guard.state.detached
    st = _store()
    engines = [Engine("prefill", f"p{i}") for i in range(len(prefill))] + [Engine("decode", "d0")]
    _run(engines, st, 1000, 1060, d0=DECODE, **{f"p{i}": load for i, load in enumerate(prefill)})
    guard.tick(1060.0, view=st)
    return guard, ev, engines, st


def test_a_state_file_restored_into_a_running_guard_keeps_the_order_it_placed_meanwhile(tmp_path):
    """A guard started in a rolling update serves without its state file (the old guard holds
    it) and scales busy prefill up 1 -> 4. The old guard exits; at the next tick the file is
    restored into the running guard, and its advisor memory (no order outstanding) replaced the
    one learned meanwhile: with the load eased off the guard no longer knew the 3 replicas were
    ordered and ordered 'up' to 3, setting the target from 4 down to 3. The two are merged now:
    the newer outstanding order is kept, counted as starting."""
    key = ("apps", "llm", "prefill-pool")
    db = str(tmp_path / "state.db")
    handler, state, calls = k8s_server()
    with serve(handler) as (url, _):
        state[key] = 1
        old, _old_ev = _life(url, db, 880.0, 940.0, [IDLE])  # the file: its memory, no order; still held
        assert not calls
        guard, ev, engines, st = _detached_life(url, db, [BUSY])
        assert _prefill(ev)["direction"] == "up" and state[key] == 4 and len(calls) == 1
        old.state.close()  # the old guard is gone
        _run(engines, st, 1060, 1120, p0=LESS, d0=DECODE)
        guard.tick(1120.0, view=st)
        assert guard.state.detached is None
        guard.state.close()
    rec = _prefill(ev)
    assert (rec["current"], rec["numbers"]["starting"], rec["direction"]) == (4, 3, "none"), rec
    assert state[key] == 4 and len(calls) == 1
    from sla_guard.state import StateStore

    saved = StateStore(db)
    fresh = _active_evaluator(None, CollectorRegistry())
    fresh.state_load(saved.load()["advisor"], [])
    saved.close()
    assert fresh.advisor.pending["prefill"] == (4, 1060.0)  # saved merged, for the next start


def test_a_state_file_restored_into_a_running_guard_keeps_its_cooldown_and_decisions_in_order(tmp_path):
    """A guard serving without its state file (held by the old guard) scales idle prefill down
    4 -> 3 at 1060 s. Restored at 1075 s, the file's older clocks (the old guard's last action at
    940 s) replaced its own and it took the next step at once, 3 -> 2 within the 60 s cooldown;
    ``/v1/decisions`` listed the file's 940 s decision after the 1060 s one. The later clock is
    kept now and the decisions are in time order."""
    key = ("apps", "llm", "prefill-pool")
    db = str(tmp_path / "state.db")
    handler, state, calls = k8s_server(grace=600)
    with serve(handler) as (url, _):
        state[key] = 5
        old, _old_ev = _life(url, db, 880.0, 940.0, [IDLE] * 5)  # the file: a scale-down 5 -> 4 at 940 s
        assert [c["body"]["spec"]["replicas"] for c in calls] == [4]
        guard, ev, engines, st = _detached_life(url, db, [IDLE] * 4)
        assert state[key] == 3 and len(calls) == 2
        old.state.close()
        engines.pop(0)  # the drained one is gone
        _run(engines, st, 1060, 1075, d0=DECODE, **{e.name: IDLE for e in engines if e.name.startswith("p")})
        guard.tick(1075.0, view=st)
        assert guard.state.detached is None
        guard.state.close()
    rec = _prefill(ev)
    assert rec["t"] == 1075.0 and rec["direction"] == "none" and "hold_cooldown" in rec["reasons"], rec
    assert state[key] == 3 and len(calls) == 2
    ts = [r["t"] for r in ev.history]
    assert ts == sorted(ts) and 940.0 in ts and 1060.0 in ts, ts


def test_a_state_file_attached_later_keeps_the_cooldown_of_an_order_made_without_it(tmp_path):
    """A guard started while another process held its state file (persistence off, the file
    restored into the running guard once usable): it scaled idle prefill down 3 -> 2 meanwhile.
    Before: the restore put the file's advisor memory (from a life long before) over the running
    one, the cooldown of that order was forgotten and the next tick took 2 -> 1 at once, 15 s into
    the 60 s cooldown."""
    from sla_guard.config import GuardConfig
    from sla_guard.service import Guard
    from sla_guard.state import StateStore

    key = ("apps", "llm", "prefill-pool")
    db = str(tmp_path / "state.db")
    handler, state, _calls = k8s_server(grace=600)
    with serve(handler) as (url, _):
        state[key] = 4
        guard, _ = _life(url, db, 1000.0, 1060.0, [IDLE] * 4)  # an earlier life: 4 -> 3, saved
        guard.state.close()
        assert state[key] == 3
        holder = StateStore(db)  # another process holds the file as this guard starts
        ev = _active_evaluator(_k8s_actuator(url), CollectorRegistry(), cooldown_s=60, stabilization_down_s=0,
                               min_evidence_s=0, no_reversal_s=0, recurrence_horizon_s=0, window_s=30)
        guard = Guard(GuardConfig(), None, [ev], state=StateStore(db, retry=True))
        assert guard.state.detached
        st = _store()
        engines = [Engine("prefill", f"p{i}") for i in range(3)] + [Engine("decode", "d0")]
        _run(engines, st, 5000.0, 5060.0, d0=DECODE, **{f"p{i}": IDLE for i in range(3)})
        guard.tick(5060.0, view=st)
        assert state[key] == 2  # ordered without the file
        holder.close()  # the file is usable now: restored at the next tick
        _run(engines[1:], st, 5060.0, 5075.0, d0=DECODE, **{f"p{i}": IDLE for i in range(1, 3)})
        guard.tick(5075.0, view=st)
        assert not guard.state.detached
        guard.state.close()
    rec = _prefill(ev)
    assert rec["t"] == 5075.0 and rec["direction"] == "none" and "hold_cooldown" in rec["reasons"], rec
    assert state[key] == 2
