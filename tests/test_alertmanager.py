"""Findings -> a REAL Alertmanager (Debian prometheus-alertmanager 0.25) on loopback, and the
failure path (Alertmanager down: retries counted, nothing raised)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics
from sla_guard.detect.alertmanager import AlertmanagerClient, AlertPublisher, to_alert
from sla_guard.detect.findings import FindingsBook

pytestmark = pytest.mark.prometheus

RUNBOOKS = "https://example.invalid/docs/runbooks.md"


def _binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory):
    binary = _binary()
    if binary is None:
        pytest.skip("prometheus-alertmanager not installed; run scripts/setup.sh --full")
    d: Path = tmp_path_factory.mktemp("am")
    (d / "am.yml").write_text("route:\n  receiver: 'null'\nreceivers:\n  - name: 'null'\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(d / "am.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [binary, f"--config.file={d / 'am.yml'}", f"--storage.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", f"--web.external-url={url}"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("alertmanager did not become ready: " + (d / "am.log").read_text()[-2000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _metrics() -> ContractMetrics:
    return ContractMetrics(CollectorRegistry(), components=[Component.GUARD])


def _leak(book: FindingsBook, now: float, key: str = "leak/m/decode/host-a/engine_core"):
    return book.raise_("leak", key, "critical", "EngineCore RSS grows 48.0 MiB/h",
                       {"model": "m", "pool": "decode", "instance": "host-a:8000", "process": "engine_core"},
                       {"slope_mib_per_h": 48.0, "confidence": 0.9999, "onset": now - 7200, "eta_s": 9000.0,
                        "limit_bytes": 8 * 2**30, "limit_source": "cgroup"}, now)


def _am_alerts(url: str) -> list[dict]:
    return httpx.get(url + "/api/v2/alerts", params={"active": "true", "silenced": "true",
                                                     "inhibited": "true", "unprocessed": "true"}).json()


def test_alert_shape_is_pure_and_complete():
    book = FindingsBook()
    f = _leak(book, 1_800_000_000.0)
    a = to_alert(f, RUNBOOKS)
    assert a["labels"]["alertname"] == "SlaGuardHostMemoryLeak"
    for k in ("severity", "pool", "model", "instance", "process"):
        assert a["labels"][k]
    assert a["annotations"]["runbook_url"] == RUNBOOKS + "#leak"
    assert "48.0 MiB/h" in a["annotations"]["description"]
    assert "2.5 h" in a["annotations"]["description"]
    assert "endsAt" not in a


def test_findings_reach_real_alertmanager_then_resolve(alertmanager):
    m = _metrics()
    book = FindingsBook(m)
    now = time.time()
    _leak(book, now)
    book.raise_("acceptance_drift", "acc/m/decode/all", "warning", "acceptance fell",
                {"model": "m", "pool": "decode", "position": "all"},
                {"before": 0.6, "after": 0.5, "what": "spec-decode acceptance", "change_at": now - 300}, now)
    pub = AlertPublisher(book, AlertmanagerClient(alertmanager, metrics=m), RUNBOOKS, resend_s=60)
    assert pub.tick(now) is True
    alerts = {a["labels"]["alertname"]: a for a in _am_alerts(alertmanager)}
    leak = alerts["SlaGuardHostMemoryLeak"]
    assert leak["labels"]["process"] == "engine_core" and leak["labels"]["pool"] == "decode"
    assert leak["labels"]["severity"] == "critical"
    assert leak["annotations"]["runbook_url"].endswith("#leak")
    drift = alerts["SlaGuardSpecDecodeAcceptanceDrift"]
    assert "0.6 to 0.5" in drift["annotations"]["description"]
    assert drift["annotations"]["runbook_url"].endswith("#acceptance-drift")
    assert drift["status"]["state"] == "active"
    # nothing changed and resend interval not over: no push
    assert pub.tick(now + 1) is None
    # resolve the leak: Alertmanager marks it resolved (endsAt in the past -> no longer active)
    book.resolve("leak/m/decode/host-a/engine_core", time.time())
    assert pub.tick(time.time()) is True
    time.sleep(0.5)
    names = {a["labels"]["alertname"] for a in _am_alerts(alertmanager)}
    assert "SlaGuardHostMemoryLeak" not in names
    assert "SlaGuardSpecDecodeAcceptanceDrift" in names
    assert m.registry.get_sample_value(c.GUARD_FINDINGS_TOTAL.exposed,
                                       {"model": "m", "pool": "decode", "detector": "leak"}) == 1.0


def test_alertmanager_down_counts_retries_and_never_raises():
    m = _metrics()
    book = FindingsBook(m)
    _leak(book, time.time())
    sleeps: list[float] = []
    client = AlertmanagerClient(f"http://127.0.0.1:{_free_port()}", metrics=m, retries=3, timeout_s=1,
                                sleep=sleeps.append)
    pub = AlertPublisher(book, client, RUNBOOKS)
    assert pub.tick(time.time()) is False
    assert client.failures == 3 and sleeps == [0.5, 1.0]
    assert m.registry.get_sample_value(c.GUARD_ALERT_PUSH_ERRORS.exposed, {"reason": "connect"}) == 3.0
    # still pending: the next tick retries (no version bump needed)
    assert pub.tick(time.time() + 61) is False
    assert client.failures == 6


def test_a_failing_alertmanager_is_retried_with_backoff_not_every_second():
    """A push failed (429, 5xx, down) was retried at the publisher's next 1 s tick while any
    change was undelivered: 17 POSTs in 15 s against an Alertmanager answering 429. Failed
    pushes now wait 1, 2, 4 ... s (at most resend_s) before the next, changes or not."""
    m = _metrics()
    book = FindingsBook(m)
    client = AlertmanagerClient(f"http://127.0.0.1:{_free_port()}", metrics=m, retries=1, timeout_s=1)
    pub = AlertPublisher(book, client, RUNBOOKS)
    t0 = time.time()
    pushed = []
    for i in range(130):  # a new finding every second for 130 s of the publisher's clock
        _leak(book, t0 + i, key=f"leak/m/decode/host-{i}/engine_core")
        if pub.tick(t0 + i) is not None:
            pushed.append(i)
    assert pushed == [0, 1, 3, 7, 15, 31, 63, 123], pushed
    assert client.failures == len(pushed)


def test_bearer_token_is_sent():
    """Alertmanager 0.25 does not check auth itself (a reverse proxy does), so a real loopback
    HTTP server records the header the client sends."""
    import http.server
    import threading

    seen: dict = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen["auth"] = self.headers.get("Authorization")
            seen["path"] = self.path
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        client = AlertmanagerClient(f"http://127.0.0.1:{srv.server_port}", bearer_token="s3cret")
        assert client.send([{"labels": {"alertname": "x"}}])
        assert seen == {"auth": "Bearer s3cret", "path": "/api/v2/alerts"}
    finally:
        srv.shutdown()


def test_runbook_anchors_exist_in_docs():
    """Every runbook_url anchor resolves to a heading of docs/runbooks.md (GitHub slug rules)."""
    import re

    from sla_guard.detect.alertmanager import RUNBOOK_ANCHORS

    text = (Path(__file__).resolve().parents[1] / "docs" / "runbooks.md").read_text()
    slugs = {"#" + re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}
    missing = set(RUNBOOK_ANCHORS.values()) - slugs
    assert not missing, missing


def test_trickling_alertmanager_fails_within_its_timeout():
    """A real loopback server that accepts the push and trickles its answer's headers a byte every
    0.2 s: httpx's per-read timeout never fires, so the publisher thread, and with it every
    alert, waited on it. ``timeout_s`` bounds the whole push."""
    import threading

    from guard_support import Trickle

    srv = Trickle("{}", what="headers")
    m = _metrics()
    client = AlertmanagerClient(f"http://127.0.0.1:{srv.port}", metrics=m, retries=1, timeout_s=1)
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(ok=client.send([{"labels": {"alertname": "x"}}])), daemon=True)
    try:
        t0 = time.monotonic()
        th.start()
        th.join(4)
        assert not th.is_alive(), "push still waiting on the trickling Alertmanager"
        assert out == {"ok": False} and time.monotonic() - t0 < 3
        assert m.registry.get_sample_value(c.GUARD_ALERT_PUSH_ERRORS.exposed, {"reason": "timeout"}) == 1.0
    finally:
        srv.stop()


def test_severity_change_resolves_the_alert_sent_before(alertmanager):
    """severity is a label, so a leak turning critical is another Alertmanager alert: the warning
    one sent before must be resolved, not left firing until Alertmanager's resolve_timeout (also
    after the finding resolves, when only the critical one was resolved)."""
    book = FindingsBook()
    key = "leak/m/decode/host-b/engine_core"
    lab = {"model": "m", "pool": "decode", "instance": "host-b:8000", "process": "engine_core"}

    def leak(sev: str) -> None:
        book.raise_("leak", key, sev, "grows", lab, {"slope_mib_per_h": 48.0, "eta_s": 9000.0}, time.time())

    def firing() -> set[str]:
        return {a["labels"]["severity"] for a in _am_alerts(alertmanager)
                if a["labels"]["instance"] == "host-b:8000" and a["status"]["state"] == "active"}

    pub = AlertPublisher(book, AlertmanagerClient(alertmanager), RUNBOOKS)
    leak("warning")
    assert pub.tick(time.time()) is True and firing() == {"warning"}
    leak("critical")
    assert pub.tick(time.time()) is True
    time.sleep(0.2)
    assert firing() == {"critical"}
    leak("warning")  # and back: the critical one resolved
    assert pub.tick(time.time()) is True
    time.sleep(0.2)
    assert firing() == {"warning"}
    book.resolve(key, time.time())
    assert pub.tick(time.time()) is True
    time.sleep(0.2)
    assert firing() == set()


def test_resolved_before_opened_is_not_refused(alertmanager):
    """A clock stepped back between open and resolve: endsAt before startsAt made Alertmanager
    refuse the whole batch (400), so every push failed and was retried each second."""
    book = FindingsBook()
    now = time.time()
    _leak(book, now, key="leak/m/decode/host-c/engine_core")
    f = book.resolve("leak/m/decode/host-c/engine_core", now - 30)
    a = to_alert(f, RUNBOOKS)
    assert a["endsAt"] == a["startsAt"]
    assert AlertmanagerClient(alertmanager).send([a]) is True


def test_a_wall_clock_stepped_back_does_not_stop_the_resends(alertmanager):
    """The publisher timed its re-sends on the wall clock: after a step back of an hour (NTP, a
    resumed VM) nothing was re-sent for 3660 s, and Alertmanager resolved the still-open leak
    after its resolve_timeout (5 min). A step back now makes the push due at once."""
    book = FindingsBook()
    now = time.time()
    book.raise_(
        "leak",
        "leak/m/decode/host-d/engine_core",
        "warning",
        "grows",
        {"model": "m", "pool": "decode", "instance": "host-d:8000", "process": "engine_core"},
        {"slope_mib_per_h": 5.0},
        now,
    )
    pub = AlertPublisher(book, AlertmanagerClient(alertmanager), RUNBOOKS, resend_s=60)
    assert pub.tick(now) is True
    stepped = now - 3600
    assert pub.tick(stepped) is True
    assert pub.tick(stepped + 1) is None  # then every resend_s on the new clock
    assert pub.tick(stepped + 61) is True
    firing = [a for a in _am_alerts(alertmanager) if a["labels"]["instance"] == "host-d:8000"]
    assert [a["status"]["state"] for a in firing] == ["active"]


@pytest.mark.parametrize("after_restart", ["warning", "resolved"])
def test_a_restart_resolves_the_alert_alertmanager_holds_from_before(alertmanager, tmp_path, after_restart):
    """A leak fired critical, then turned warning while Alertmanager was unreachable, and the guard
    restarted from its state file: the critical alert (severity is a label, so another alert) lived
    only in the publisher's memory, was never sent with endsAt, and stayed firing in Alertmanager
    until its own resolve_timeout, next to the warning one or after the finding resolved. The
    label sets sent as firing are persisted, and those no longer firing resolved after the restart."""
    from sla_guard.compose import compose
    from sla_guard.config import AlertmanagerSettings, GuardConfig
    from sla_guard.ingest.source import StoreSource
    from sla_guard.state import StateStore
    from sla_guard.store import SeriesStore

    cfg = GuardConfig(alertmanager=AlertmanagerSettings(url=alertmanager))
    key = f"leak/m/decode/host-r-{after_restart}/engine_core"
    lab = {"model": "m", "pool": "decode", "instance": f"host-r-{after_restart}:8000", "process": "engine_core"}

    def up():
        root = compose(cfg, source=StoreSource(SeriesStore()), state=StateStore(tmp_path / "state.db"),
                       slo=False, advisor=False)
        root.alerts.stop()  # ticked by the test, not its thread
        return root

    def leak(root, sev: str) -> None:
        root.findings.raise_("leak", key, sev, "grows", lab, {"slope_mib_per_h": 48.0}, time.time())

    def firing() -> set[str]:
        return {a["labels"]["severity"] for a in _am_alerts(alertmanager)
                if a["labels"]["instance"] == lab["instance"]}

    a = up()
    leak(a, "critical")
    assert a.alerts.tick(time.time()) is True and firing() == {"critical"}
    a.guard.persist(time.time())
    leak(a, "warning")  # Alertmanager unreachable now: the warning is not delivered
    a.alerts.client = AlertmanagerClient(f"http://127.0.0.1:{_free_port()}", retries=1, timeout_s=1)
    assert a.alerts.tick(time.time()) is False
    a.guard.persist(time.time())
    a.guard.state.close()  # the guard is killed here

    b = up()
    assert [f.severity for f in b.findings.open_findings()] == ["warning"]
    if after_restart == "resolved":
        b.findings.resolve(key, time.time())
    else:
        leak(b, "warning")
    assert b.alerts.tick(time.time()) is True
    assert firing() == ({"warning"} if after_restart == "warning" else set())
    b.guard.persist(time.time())
    b.guard.state.close()
    st = StateStore(tmp_path / "state.db")
    held = st.load().get("alertmanager", {})  # what is resolved leaves the file: it stays bounded
    st.close()
    assert [v["labels"]["severity"] for v in held.values()] == ([] if after_restart == "resolved" else ["warning"])


@pytest.mark.parametrize(("listen", "external_url", "base"), [
    ("127.0.0.1:8080", None, "http://127.0.0.1:8080"),
    ("0.0.0.0:9000", None, f"http://{socket.gethostname()}:9000"),  # a wildcard is no address to follow
    ("0.0.0.0:9000", "https://guard.example.com/sla/", "https://guard.example.com/sla"),
])
def test_alerts_link_back_to_the_guards_findings(alertmanager, listen, external_url, base):
    """The served guard sent no generatorURL: Alertmanager's UI and notifications had no link back
    to the finding. Every alert now links to ``/v1/findings`` of its detector, model and pool, at
    ``alertmanager.external_url`` (behind a proxy) or else the address the API listens on."""
    from urllib.parse import parse_qs, urlsplit

    from sla_guard.compose import compose
    from sla_guard.config import AlertmanagerSettings, APISettings, GuardConfig
    from sla_guard.ingest.source import StoreSource
    from sla_guard.store import SeriesStore

    cfg = GuardConfig(api=APISettings(listen=listen),
                      alertmanager=AlertmanagerSettings(url=alertmanager, external_url=external_url))
    root = compose(cfg, source=StoreSource(SeriesStore()), slo=False, advisor=False)
    root.alerts.stop()  # ticked by the test, not its thread
    inst = f"host-g-{listen}-{external_url is not None}"
    now = time.time()
    root.findings.raise_("leak", f"leak/{inst}", "warning", "grows",
                         {"model": "m/1 b", "pool": "decode", "instance": inst, "process": "engine_core"}, {}, now)
    root.findings.raise_("leak", f"resolved/{inst}", "warning", "grows",
                         {"model": "m", "instance": inst + "-r", "process": "engine_core"}, {}, now)
    root.findings.resolve(f"resolved/{inst}", now)
    assert root.alerts.tick(time.time()) is True
    got = [a for a in _am_alerts(alertmanager) if a["labels"]["instance"] == inst]
    assert len(got) == 1
    url = urlsplit(got[0]["generatorURL"])
    assert f"{url.scheme}://{url.netloc}{url.path}" == base + "/v1/findings"
    assert parse_qs(url.query) == {"state": ["all"], "detector": ["leak"], "model": ["m/1 b"], "pool": ["decode"]}
    resolved = to_alert(root.findings.get(f"resolved/{inst}"), RUNBOOKS, root.alerts.external_url)
    assert parse_qs(urlsplit(resolved["generatorURL"]).query) == {"state": ["all"], "detector": ["leak"],
                                                                  "model": ["m"]}


def test_an_external_url_that_is_no_http_url_is_refused_by_name():
    """Alertmanager refuses a whole batch whose generatorURL is not a URL: caught at load instead."""
    from sla_guard.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"alertmanager\.external_url: .*https://sla-guard\.example\.com"):
        parse_config({"source": {"mode": "prometheus", "url": "http://prometheus:9090"},
                      "alertmanager": {"url": "http://alertmanager:9093", "external_url": "guard:8080"}})


_LIFE = """
import sys, time
from sla_guard.compose import compose
from sla_guard.config import AlertmanagerSettings, GuardConfig
from sla_guard.ingest.source import StoreSource
from sla_guard.state import StateStore
from sla_guard.store import SeriesStore

url, db, key, instance, order = sys.argv[1:]
root = compose(GuardConfig(alertmanager=AlertmanagerSettings(url=url)), source=StoreSource(SeriesStore()),
               state=StateStore(db), slo=False, advisor=False)
lab = {"model": "m", "pool": "decode", "instance": instance, "process": "engine_core"}
book, pub = root.findings, root.alerts
for sev in ("warning", "critical"):  # two ticks: the leak found, then found critical
    book.raise_("leak", key, sev, "grows", lab, {"slope_mib_per_h": 48.0}, time.time())
    if sev == "warning" or order == "save-first":  # else the publisher's thread pushes before the tick saves
        root.guard.persist(time.time())  # the tick's save; the publisher's thread pushes on its own
    while pub._last_version != book.version:  # the critical push never completes: killed in it
        time.sleep(0.01)
    root.guard.persist(time.time())  # a later tick
"""


@pytest.mark.parametrize(("order", "after_restart"), [("save-first", "warning"), ("push-first", "resolved")])
def test_a_guard_killed_just_after_a_push_resolves_what_it_pushed_after_the_restart(alertmanager, tmp_path, order,
                                                                                    after_restart):
    """A real guard process (compose, its state file, the publisher's own thread) found a leak
    warning, sent and saved it, then found it critical; its publisher pushed the critical alert
    (after that tick's save, or before it: the publisher has its own thread) and the process was
    SIGKILLed (by a loopback proxy in front of the real Alertmanager, the moment Alertmanager had
    accepted the push), before any save recorded the critical label set. After the restart the
    finding turned warning (or resolved): the critical alert was known to no one and stayed
    firing until Alertmanager's resolve_timeout. The label sets about to be pushed are now
    written to the state file before the push."""
    import http.server
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading

    from sla_guard.compose import compose
    from sla_guard.config import AlertmanagerSettings, GuardConfig
    from sla_guard.ingest.source import StoreSource
    from sla_guard.state import StateStore
    from sla_guard.store import SeriesStore

    key = f"leak/m/decode/host-k-{after_restart}/engine_core"
    lab = {"model": "m", "pool": "decode", "instance": f"host-k-{after_restart}:8000", "process": "engine_core"}
    victim: dict = {}

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            r = httpx.post(alertmanager + self.path, content=body, headers={"Content-Type": "application/json"},
                           timeout=5)
            if any(a["labels"]["severity"] == "critical" for a in json.loads(body)) and "pid" in victim:
                os.kill(victim["pid"], signal.SIGKILL)  # accepted by Alertmanager, not yet answered
                victim["killed"] = r.status_code
                return
            self.send_response(r.status_code)
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{srv.server_port}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        proc = subprocess.Popen([sys.executable, "-c", _LIFE, proxy, str(tmp_path / "state.db"), key,
                                 lab["instance"], order], env=env, stderr=subprocess.PIPE, text=True)
        victim["pid"] = proc.pid
        try:
            assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read()[-2000:]
        finally:
            proc.kill()
            proc.stderr.close()
    finally:
        srv.shutdown()
        srv.server_close()
    assert victim["killed"] == 200

    def firing() -> set[str]:
        return {a["labels"]["severity"] for a in _am_alerts(alertmanager) if a["labels"]["instance"] == lab["instance"]}

    assert firing() == {"critical"}  # the push that died with the guard had reached Alertmanager
    b = compose(GuardConfig(alertmanager=AlertmanagerSettings(url=alertmanager)), source=StoreSource(SeriesStore()),
                state=StateStore(tmp_path / "state.db"), slo=False, advisor=False)
    b.alerts.stop()  # ticked by the test, not its thread
    if after_restart == "resolved":
        b.findings.resolve(key, time.time())
    else:
        b.findings.raise_("leak", key, "warning", "grows", lab, {"slope_mib_per_h": 48.0}, time.time())
    assert b.alerts.tick(time.time()) is True
    b.guard.state.close()
    assert firing() == ({"warning"} if after_restart == "warning" else set())


def test_a_state_file_attached_during_a_push_keeps_the_label_sets_it_restores(tmp_path):
    """A guard started while another process held its state file restores it once usable, on its
    tick thread, while the publisher's thread may be in a push. The file held a warning Alertmanager
    still fires (the leak found critical since, that push never made). Before: the push in flight
    replaced the publisher's memory with its own batch, dropping the warning just restored; the
    next push deleted it from the file too, and it fired beside its critical until Alertmanager's
    resolve_timeout. Here the loopback receiver runs the tick thread's restore while it holds a
    push, before answering it."""
    import http.server
    import json
    import threading

    from sla_guard.compose import compose
    from sla_guard.config import AlertmanagerSettings, GuardConfig
    from sla_guard.ingest.source import StoreSource
    from sla_guard.state import StateStore
    from sla_guard.store import SeriesStore

    pushes: list[list[dict]] = []
    during: dict = {}

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            pushes.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if "restore" in during:
                during.pop("restore")()  # the tick thread's restore, while this push is in flight
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url, db = f"http://127.0.0.1:{srv.server_port}", str(tmp_path / "state.db")
    lab = {"model": "m", "pool": "decode", "instance": "host-a:8000", "process": "engine_core"}
    key = "leak/m/decode/host-a:8000/engine_core"

    def guard(store: StateStore):
        root = compose(GuardConfig(alertmanager=AlertmanagerSettings(url=url)), source=StoreSource(SeriesStore()),
                       state=store, slo=False, advisor=False)
        root.alerts.stop()  # ticked by the test, not its thread
        return root

    try:
        a = guard(StateStore(db))  # the earlier life: a warning pushed, then found critical, not pushed
        a.findings.raise_("leak", key, "warning", "grows", lab, {"slope_mib_per_h": 48.0}, 1000.0)
        assert a.alerts.tick(1000.0) is True
        a.findings.raise_("leak", key, "critical", "grows", lab, {"slope_mib_per_h": 48.0}, 1010.0)
        a.guard.persist(1010.0)
        a.guard.state.close()
        holder = StateStore(db)  # another process holds the file as the next guard starts
        b = guard(StateStore(db, retry=True))
        assert b.guard.state.detached
        other = {**lab, "instance": "host-b:8000"}
        b.findings.raise_("leak", "leak/m/decode/host-b:8000/engine_core", "warning", "grows", other, {}, 2000.0)

        def restore() -> None:
            holder.close()
            b.guard._attach_state()  # what the next tick does first

        during["restore"] = restore
        assert b.alerts.tick(2000.0) is True
        assert "restore" not in during and not b.guard.state.detached
        assert b.alerts.tick(2001.0) is True  # the restored findings: pushed at once
        b.guard.state.close()
    finally:
        srv.shutdown()
        srv.server_close()
    sent = [(a["labels"]["instance"], a["labels"]["severity"], "endsAt" in a) for a in pushes[-1]]
    assert ("host-a:8000", "warning", True) in sent, sent  # resolved: no longer held as firing
    assert ("host-a:8000", "critical", False) in sent, sent
