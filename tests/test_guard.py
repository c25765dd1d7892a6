"""The Guard loop: evaluator isolation, its own metrics, the asyncio serve loop over real
loopback targets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from guard_support import Engine, Served
from prometheus_client import generate_latest

from exporters import contract as c
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.ingest.source import StoreSource
from sla_guard.model import Status
from sla_guard.service import Guard
from sla_guard.store import SeriesStore


class Boom:
    name = "boom"

    def __init__(self):
        self.calls = 0

    def evaluate(self, view, now):
        self.calls += 1
        raise RuntimeError("detector bug")

    def snapshot(self):
        return {"calls": self.calls}


class Counting:
    name = "counting"

    def __init__(self):
        self.seen = []
        self.bound = None

    def bind_metrics(self, metrics):
        self.bound = metrics

    def evaluate(self, view, now):
        self.seen.append((view, now))

    def snapshot(self):
        return {"ticks": len(self.seen)}


def test_failing_evaluator_is_counted_and_others_still_run():
    cfg = parse_config({})
    store = SeriesStore()
    boom, counting = Boom(), Counting()
    guard = Guard.for_store(cfg, store, [boom, counting])
    for t in (100.0, 115.0):
        res = guard.tick(t)
        assert "boom" in res.errors and "RuntimeError" in res.errors["boom"]
    assert [now for _, now in counting.seen] == [100.0, 115.0]
    assert counting.seen[0][0] is store  # evaluators get the view
    assert counting.bound is guard.metrics  # bind_metrics called once with the guard's metrics
    text = generate_latest(guard.registry).decode()
    assert f'{c.GUARD_EVALUATOR_ERRORS.exposed}{{evaluator="boom"}} 2.0' in text
    assert f"{c.GUARD_EVAL_DURATION.name}_count 2.0" in text
    st = guard.status()
    assert st["ticks"] == 2 and st["evaluators"]["counting"] == {"ticks": 2}
    assert st["evaluators"]["slo"]["status"] == Status.UNKNOWN.value  # no data -> unknown


def test_serve_loop_scrapes_and_evaluates_real_targets():
    engines = [Engine(engine=str(i)) for i in range(2)]
    servers = [Served(e.exposition) for e in engines]
    try:
        cfg = parse_config({
            "source": {"mode": "scrape", "interval_s": 0.2, "timeout_s": 1,
                       "targets": [{"url": s.url, "model": "m", "pool": "decode", "name": f"e{i}"}
                                   for i, s in enumerate(servers)]},
            "evaluation_interval_s": 0.3,
            "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                      "threshold_s": 2.5, "window": "2s", "min_requests": 5}]}],
        })
        guard = compose(cfg, detectors=False, advisor=False).guard

        async def go():
            stop = asyncio.Event()
            task = asyncio.create_task(guard.run(stop))
            for _ in range(20):
                for e in engines:
                    for _ in range(3):
                        e.request(0.3, 0.01)
                await asyncio.sleep(0.1)
            stop.set()
            await task

        asyncio.run(go())
        assert guard.ticks >= 4
        assert guard.source.rounds >= 6
        pr = guard.evaluator("slo").pools[("m", "decode")]
        assert pr.status is Status.OK, pr
        assert pr.slos[0].value == pytest.approx(0.3)
        assert pr.targets_up == 2
        assert all(t.up for t in guard.source.targets())
    finally:
        for s in servers:
            s.stop()


def test_example_configs_are_valid():
    from pathlib import Path

    from sla_guard.config import load_config

    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("guard-*.yaml"))
    assert len(examples) >= 2
    for f in examples:
        cfg = load_config(f)
        assert cfg.slos_for("any-model", "decode"), f


def test_serve_command_end_to_end(tmp_path):
    """`sla-guard serve` as a process: ready, SLOs over the API with the token, clean SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import yaml
    from guard_support import free_port

    e = Engine()
    srv = Served(e.exposition)
    port = free_port()
    cfg = {"source": {"mode": "scrape", "interval_s": 0.5, "timeout_s": 0.5,
                      "targets": [{"url": srv.url, "model": "m", "pool": "decode"}]},
           "evaluation_interval_s": 0.5,
           "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                     "threshold_s": 2.5, "window": "3s", "min_requests": 3}]}],
           "api": {"listen": f"127.0.0.1:{port}", "token_env": "GUARD_TEST_TOKEN"}}
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "GUARD_TEST_TOKEN": "tok"}
    proc = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        status = None
        while time.time() < deadline:
            for _ in range(5):
                e.request(0.25, 0.01)
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    body = httpx.get(f"{url}/v1/slo", headers={"Authorization": "Bearer tok"}, timeout=2).json()
                    status = body["pools"][0]["slos"][0]
                    if status["status"] == "ok":
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert status is not None and status["status"] == "ok", status
        assert status["value"] == pytest.approx(0.25)
        assert httpx.get(f"{url}/v1/slo", timeout=2).status_code == 401
        assert c.GUARD_TARGET_UP.name in httpx.get(f"{url}/metrics", timeout=2).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        srv.stop()


def test_serve_refuses_open_api_beyond_loopback(tmp_path):
    import subprocess
    import sys

    f = tmp_path / "g.yaml"
    f.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics'}]}\n"
                 "api: {listen: '0.0.0.0:18080', token_env: NO_SUCH_TOKEN_VAR}\n")
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "api.listen" in r.stderr and "token" in r.stderr


def test_serve_follows_a_rotated_token_file_and_keeps_the_last_good_token_over_a_bad_one(tmp_path):
    """A Kubernetes Secret rotates by swapping the mounted file. The token was read once at start,
    so after a rotation every client holding the new token got 401 until the guard restarted. A
    file that cannot be used after a change (two lines) keeps the last good token: never open."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    from guard_support import free_port

    tf = tmp_path / "token"
    f = tmp_path / "g.yaml"
    port = free_port()
    f.write_text(f"source: {{targets: [{{url: 'http://127.0.0.1:9/metrics'}}]}}\n"
                 f"api: {{listen: '127.0.0.1:{port}', token_file: '{tf}'}}\n")
    tf.write_text("old-token\n")
    proc = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def status(tok: str) -> int | None:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/status", headers={"Authorization": f"Bearer {tok}"},
                             timeout=2).status_code
        except httpx.HTTPError:
            return None

    try:
        deadline = time.time() + 30
        while time.time() < deadline and status("old-token") is None:
            time.sleep(0.1)
        assert status("old-token") == 200 and status("new-token") == 401
        (tmp_path / "token.new").write_text("new-token\n")
        os.replace(tmp_path / "token.new", tf)  # the Secret's atomic swap
        assert status("new-token") == 200 and status("old-token") == 401
        (tmp_path / "token.new").write_text("half\nwritten\n")
        os.replace(tmp_path / "token.new", tf)
        assert status("new-token") == 200 and status("half") == 401
        assert httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=2).status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        err = proc.stderr.read()
        assert "one line" in err and "last token read stays in use" in err and "written" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_serve_stops_cleanly_on_a_sigterm_that_comes_before_the_server_is_up(tmp_path):
    """A pod deleted as it starts: a SIGTERM while serve still loads its config and state took the
    default action (killed, -15: no atexit, no Lease release). Here the config is a FIFO (as
    ``--config <(...)`` gives), so serve waits in its config load until the test writes it, after
    the signal."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from guard_support import free_port

    fifo = tmp_path / "g.yaml"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(fifo)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20  # serve cannot pass the FIFO before the test writes it
        while time.time() < deadline and not any(
                w in Path(f"/proc/{proc.pid}/wchan").read_text() for w in ("wait_for_partner", "fifo")):
            time.sleep(0.05)  # blocked opening the FIFO: imports done, config load under way
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with contextlib.suppress(OSError):  # ENXIO: no reader left, the signal killed serve
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, f"source: {{targets: [{{url: 'http://127.0.0.1:9/metrics'}}]}}\n"
                         f"api: {{listen: '127.0.0.1:{free_port()}'}}\n".encode())
            os.close(fd)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_serve_refuses_a_token_variable_the_config_names_but_nobody_set(tmp_path):
    """api.token_env names the variable meant to hold the token: unset, the guard used to serve
    /v1 open on loopback without a word."""
    import os
    import subprocess
    import sys

    f = tmp_path / "g.yaml"
    f.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics'}]}\n"
                 "api: {listen: '127.0.0.1:18081', token_env: NO_SUCH_TOKEN_VAR}\n")
    env = {k: v for k, v in os.environ.items() if k != "NO_SUCH_TOKEN_VAR"}
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=30, env=env)
    assert r.returncode == 2 and "api.token_env: $NO_SUCH_TOKEN_VAR is not set" in r.stderr


@pytest.mark.parametrize("value", ["", " \t "])
def test_serve_refuses_the_default_token_variable_set_but_blank(tmp_path, value):
    """$SLA_GUARD_TOKEN exported but blank (a Secret with an empty key, `export SLA_GUARD_TOKEN=`) is a
    token someone meant to set: it read as unset and /v1 answered 200 to every client, with no
    Authorization at all, on loopback. Unset, the default variable is still the documented dev mode."""
    import os
    import subprocess
    import sys

    f = tmp_path / "g.yaml"
    f.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics'}]}\n"
                 "api: {listen: '127.0.0.1:1'}\n")  # never bound: the check comes first
    root = str(Path(__file__).resolve().parents[1])  # cwd is tmp_path, where a state file may go
    env = {**os.environ, "SLA_GUARD_TOKEN": value, "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=30, env=env, cwd=tmp_path)
    assert r.returncode == 2 and "api.token_env: $SLA_GUARD_TOKEN is set but empty" in r.stderr, r.stderr


def test_serve_on_an_address_in_use_names_the_setting_and_exits_2(tmp_path):
    """uvicorn exits 3 when it cannot bind, after the guard logged that it was serving there."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        f = tmp_path / "g.yaml"
        f.write_text("source: {targets: [{url: 'http://127.0.0.1:9/metrics'}]}\n"
                     f"api: {{listen: '127.0.0.1:{port}'}}\n")
        r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 2 and f"api.listen: cannot listen on 127.0.0.1:{port}" in r.stderr


def test_serve_sigterm_exits_through_atexit_without_a_false_abandoned_tick(tmp_path):
    """SIGTERM between ticks: the idle tick thread and the API's worker thread were still winding
    down when serve looked for a hung tick, so nearly every stop logged 'exiting with a tick still
    running (abandoned)' and left by os._exit, skipping atexit (where an active advisor's elector
    releases its Lease: the standby then waited out the lease instead of taking over at once)."""
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import yaml
    from guard_support import free_port

    e = Engine()
    srv = Served(e.exposition)
    port = free_port()
    cfg = {"source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.25,
                      "targets": [{"url": srv.url, "model": "m", "pool": "decode"}]},
           "evaluation_interval_s": 0.25, "api": {"listen": f"127.0.0.1:{port}"}}
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump(cfg))
    mark = tmp_path / "atexit-ran"
    code = (f"import atexit, pathlib, sys; atexit.register(pathlib.Path({str(mark)!r}).touch); "
            f"from sla_guard.cli import main; sys.exit(main(['serve', '--config', {str(f)!r}]))")
    try:
        for life in range(3):
            mark.unlink(missing_ok=True)
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            deadline = time.time() + 30
            ticks = 0
            while time.time() < deadline and ticks < 4:
                try:
                    ticks = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=1).json()["ticks"]
                except httpx.HTTPError:
                    time.sleep(0.1)
            assert ticks >= 4, f"life {life}: no ticks"
            time.sleep(1.0)  # between ticks, the API idle
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out[-2000:]
            assert mark.exists(), f"life {life}: atexit handlers did not run\n{out[-2000:]}"
            assert "abandoned" not in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        srv.stop()


def test_serve_token_file_with_two_lines_is_refused_and_a_bom_is_dropped(tmp_path):
    """api.token_file read whole: 'tok\\nother' became a token no Authorization header can carry (401
    to every client, no word at start); a UTF-8 byte-order mark (Windows editors) became part of
    the token, so the 'tok' the operator wrote was refused."""
    import signal
    import subprocess
    import sys
    import time

    import httpx
    from guard_support import free_port

    tf = tmp_path / "token"
    f = tmp_path / "g.yaml"
    port = free_port()
    f.write_text(f"source: {{targets: [{{url: 'http://127.0.0.1:9/metrics'}}]}}\n"
                 f"api: {{listen: '127.0.0.1:{port}', token_file: '{tf}'}}\n")
    tf.write_bytes(b"tok\nother\n")
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "api.token_file" in r.stderr and "one line" in r.stderr, r.stderr
    assert "other" not in r.stderr and "Traceback" not in r.stderr
    tf.write_bytes(b"\xef\xbb\xbftok\r\n")
    proc = subprocess.Popen([sys.executable, "-m", "sla_guard.cli", "serve", "--config", str(f)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, got = time.time() + 30, None
        while time.time() < deadline and got is None:
            try:
                got = httpx.get(f"http://127.0.0.1:{port}/v1/status", headers={"Authorization": "Bearer tok"},
                                timeout=1).status_code
            except httpx.HTTPError:
                time.sleep(0.1)
        assert got == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_wall_clock_step_forward_does_not_make_a_fresh_verdict_stale():
    """A VM resumed, or NTP stepped the host clock a day forward, just after a tick: verdict age was
    wall now minus the tick's wall time, so a verdict milliseconds old read as a day stale (503 on
    /readyz, every verdict expired) until the next tick. Age is measured on the monotonic clock."""
    wall = [1_000_000.0]
    guard = Guard(parse_config({"staleness_s": 60}), StoreSource(SeriesStore()), [Counting()],
                  clock=lambda: wall[0])
    guard.tick()
    wall[0] += 86400.0
    assert guard.verdict_age() < 60 and not guard.stale()
    assert not guard.expire_if_stale()


_FAST = {"source": {"mode": "scrape", "interval_s": 0.05, "timeout_s": 0.05}, "evaluation_interval_s": 0.05,
         "staleness_s": 0.5}


def test_a_wall_clock_step_back_neither_stops_the_loop_nor_keeps_old_verdicts_fresh():
    """NTP stepped the host clock an hour back (or a VM came back from a snapshot): the serve loop
    scheduled its next tick on the wall clock and slept that hour, while the watchdog read the
    verdict's age as wall now minus the last tick, negative, so 0: the last verdicts (an "ok", a
    replica count for KEDA) were served as fresh for the hour. Now the loop keeps its schedule on
    the monotonic clock and does not evaluate at a wall time before its last evaluation (the store
    holds samples stamped up to an hour ahead of it: data an hour old would read as current), so
    the verdicts go stale; once the wall clock is past the last evaluation the ticks resume."""
    offset = [0.0]
    counting = Counting()
    guard = Guard(parse_config(_FAST), StoreSource(SeriesStore()),
                  [counting], clock=lambda: time.time() + offset[0])

    async def until(what, predicate, limit_s=30.0):
        deadline = time.monotonic() + limit_s
        while not predicate():
            assert time.monotonic() < deadline, f"never: {what}"
            await asyncio.sleep(0.02)

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(guard.run(stop))
        try:
            await until("two ticks", lambda: guard.ticks >= 2)
            offset[0] = -3600.0
            await until("the old verdicts go stale", lambda: guard.stale())
            before = guard.ticks
            offset[0] = 0.0  # the wall clock is past the last evaluation again
            await until("ticks resume", lambda: guard.ticks >= before + 2 and not guard.stale())
        finally:
            stop.set()
            await task

    asyncio.run(go())
    nows = [now for _, now in counting.seen]
    assert nows == sorted(nows)  # never evaluated at a wall time before an earlier evaluation
