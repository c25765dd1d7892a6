"""sla-guard-sidecar: vLLM's native exposition -> the contract, process tree via psutil.

The vLLM side here is a real loopback HTTP server serving tests/fixtures/vllm_exposition.txt,
recorded from vLLM's own PrometheusStatLogger (tests/fixtures/record_vllm_exposition.py); the
same sidecar against a live vLLM is in tests/test_vllm_sidecar.py.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c
from exporters.sidecar import SidecarCollector, map_exposition, serve_metrics

FIXTURE = (Path(__file__).parent / "fixtures" / "vllm_exposition.txt").read_text()
SIDECAR = Path(sys.executable).parent / "sla-guard-sidecar"


def parse(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pick(samples: dict, name: str, **labels) -> dict:
    return {k: v for k, v in samples.items() if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items())}


def one(samples: dict, name: str, **labels) -> float:
    hits = pick(samples, name, **labels)
    assert len(hits) == 1, (name, labels, hits)
    return next(iter(hits.values()))


def mapped_samples() -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    fams, engines, problems = map_exposition(FIXTURE, "m", "decode")
    assert not problems  # the recorded vLLM page maps cleanly

    class Fixed(Collector):
        def collect(self):
            return fams

    reg = CollectorRegistry()
    reg.register(Fixed())
    assert engines == {"0", "1"}
    return parse(generate_latest(reg).decode())


def test_histograms_and_counters_pass_through_exactly():
    native, ours = parse(FIXTURE), mapped_samples()
    for e in ("0", "1"):
        assert one(ours, c.REQUEST_TTFT.series("_count"), engine=e, pool="decode", model="m") == one(
            native, "vllm:time_to_first_token_seconds_count", engine=e)
        assert one(ours, c.SPEC_ACCEPTED_TOKENS.series(), engine=e) == one(
            native, "vllm:spec_decode_num_accepted_tokens_total", engine=e)
        assert one(ours, c.REQUESTS_RUNNING.series(), engine=e) == one(native, "vllm:num_requests_running", engine=e)
        assert one(ours, c.PREFIX_CACHE_HITS.series(), engine=e, cache="local") == one(
            native, "vllm:prefix_cache_hits_total", engine=e)
    ours_le = {dict(k[1])["le"] for k in pick(ours, c.REQUEST_TTFT.series("_bucket"), engine="0")}
    native_le = {dict(k[1])["le"] for k in pick(native, "vllm:time_to_first_token_seconds_bucket", engine="0")}
    assert ours_le == native_le and "2.5" in ours_le  # vLLM's own boundaries, no invented counts
    for le in native_le:
        assert one(ours, c.REQUEST_TTFT.series("_bucket"), engine="0", le=le) == one(
            native, "vllm:time_to_first_token_seconds_bucket", engine="0", le=le)


def test_documented_limits_itl_has_no_20ms_boundary_and_source_renamed():
    ours = mapped_samples()
    itl_le = {dict(k[1])["le"] for k in pick(ours, c.INTER_TOKEN_LATENCY.series("_bucket"))}
    assert itl_le and "0.02" not in itl_le  # why the plugin, not the sidecar, is needed for a 20 ms SLI
    sources = {dict(k[1])["source"] for k in pick(ours, c.PROMPT_TOKENS.series())}
    assert sources == {"computed", "local_cache_hit", "external_kv_transfer"}
    assert not pick(ours, c.ENGINE_STEPS.series())  # vLLM exports no step counter


class _FakeVllm:
    """A real HTTP server answering /metrics with ``body`` (the recorded exposition by default).
    ``drip_s``: the body one line per ``drip_s`` seconds and then comment lines forever (a page that
    never finishes); ``endless``: samples streamed forever without a Content-Length."""

    def __init__(self, body: str = FIXTURE, *, drip_s: float | None = None, endless: bool = False) -> None:
        data = body.encode()
        stop = self.stopping = threading.Event()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                if drip_s is None and not endless:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if drip_s is not None:
                        for line in itertools.chain(data.splitlines(keepends=True), itertools.repeat(b"# more\n")):
                            if stop.is_set():
                                return
                            self.wfile.write(line)
                            self.wfile.flush()
                            time.sleep(drip_s)
                    elif endless:
                        i = 0
                        while not stop.is_set():
                            self.wfile.write(b"".join(b'vllm:num_requests_running{engine="%d"} 1\n' % (i + k)
                                                      for k in range(1000)))
                            i += 1000
                    else:
                        self.wfile.write(data)
                except OSError:
                    pass  # the sidecar gave up on us: that is the point

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_until(url: str, predicate, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            last = parse(httpx.get(url, timeout=5).text)
            if predicate(last):
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return last


def test_sidecar_process_end_to_end_and_dead_target(tmp_path):
    vllm = _FakeVllm()
    tree = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time;"
                             "subprocess.Popen([sys.executable,'-c','import time;x=bytearray(2**25);time.sleep(60)']);"
                             "time.sleep(60)"], start_new_session=True)
    port = _free_port()
    side = subprocess.Popen([str(SIDECAR), "--metrics-url", vllm.url, "--pool", "prefill", "--model", "tiny",
                             "--pid", str(tree.pid), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        got = _scrape_until(url, lambda s: len(pick(s, c.PROCESS_INFO.series())) >= 2)
        assert one(got, c.REQUEST_TTFT.series("_count"), engine="0", pool="prefill", model="tiny") == one(
            parse(FIXTURE), "vllm:time_to_first_token_seconds_count", engine="0")
        infos = [dict(k[1]) for k in pick(got, c.PROCESS_INFO.series())]
        pids = {int(i["process_pid"]) for i in infos}
        assert tree.pid in pids and len(pids) == 2
        for info in infos:
            truth = psutil.Process(int(info["process_pid"])).memory_info().rss
            rss = one(got, c.PROCESS_RSS.series(), process=info["process"], role=info["role"])
            assert abs(rss - truth) / truth < 0.10
        vllm.stop()  # dead target: engine series vanish, the error is counted, the sidecar keeps serving
        dead = _scrape_until(url, lambda s: one_or_zero(s, c.HOOK_ERRORS.series(), kind="scrape") >= 1)
        assert one(dead, c.HOOK_ERRORS.series(), kind="scrape", pool="prefill") >= 1
        assert not pick(dead, c.REQUEST_TTFT.series("_count"))
        assert pick(dead, c.PROCESS_RSS.series())
    finally:
        side.terminate()
        side.wait(10)
        import os
        import signal

        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait(10)
        vllm.httpd.server_close()


def one_or_zero(samples, name, **labels) -> float:
    return sum(pick(samples, name, **labels).values())


@pytest.mark.parametrize(("args", "flag"), [
    (["--pool", "bogus"], "--pool"),
    (["--pool", "decode", "--listen", "nowhere"], "--listen"),
    (["--pool", "decode", "--pid", "999999999"], "--pid"),
    (["--pool", "decode", "--max-body-bytes", "10"], "--max-body-bytes"),
])
def test_bad_arguments_name_the_flag(args, flag):
    out = subprocess.run([str(SIDECAR), "--metrics-url", "http://127.0.0.1:1/metrics", "--model", "m", *args],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and flag in out.stderr, out.stderr


def test_listen_address_in_use_or_unresolvable_names_the_flag_and_ipv6_is_accepted():
    """A port another process holds (a second sidecar on the node) or a host that does not resolve
    ended the sidecar with a socket traceback; "[::1]:PORT", the usual way to write an IPv6
    HOST:PORT, did too ("[::1]" is no host name)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        for listen in (busy, "no-such-host.invalid:9400"):
            out = subprocess.run([str(SIDECAR), "--metrics-url", "http://127.0.0.1:1/metrics", "--model", "m",
                                  "--pool", "decode", "--listen", listen], capture_output=True, text=True, timeout=30)
            assert out.returncode == 2 and f"--listen {listen}" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr, out.stderr
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no ::1 on this host")
    vllm = _FakeVllm()
    port = _free_port()
    side = subprocess.Popen([str(SIDECAR), "--metrics-url", vllm.url, "--pool", "decode", "--model", "m",
                             "--listen", f"[::1]:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        got = _scrape_until(f"http://[::1]:{port}/metrics", lambda s: bool(pick(s, c.REQUEST_TTFT.series("_count"))))
        assert pick(got, c.REQUEST_TTFT.series("_count"), pool="decode")
    finally:
        side.terminate()
        side.wait(10)
        vllm.stop()


# --- a broken vLLM page reads "unknown", is counted, and never stalls or bloats the sidecar ----


def _serve_sidecar(vllm_url: str, **kw) -> tuple[str, object]:
    """The collector behind the real threaded /metrics server, as main() runs it."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(SidecarCollector(vllm_url, "m", "decode", None, **kw))
    port = _free_port()
    server, _ = serve_metrics("127.0.0.1", port, reg)
    return f"http://127.0.0.1:{port}/metrics", server


def _sidecar_page(body: str) -> tuple[dict, str]:
    """One sidecar scrape of a vLLM serving ``body`` -> (parsed samples, raw text)."""
    vllm = _FakeVllm(body)
    url, server = _serve_sidecar(vllm.url)
    try:
        text = httpx.get(url, timeout=10).text
        return parse(text), text
    finally:
        server.shutdown()
        vllm.stop()


def _errors(samples: dict, kind: str) -> float:
    return one_or_zero(samples, c.HOOK_ERRORS.series(), kind=kind)


def test_half_open_connections_are_closed_and_release_their_threads():
    """prometheus_client's server gave each connection a thread with no timeout: 300 half-open
    connections (a request line, never the rest) held 300 threads for good. Now a connection silent
    for the request timeout is closed, and a scrape is still answered."""
    from guard_support import closed_by_server, half_open
    from prometheus_client import CollectorRegistry

    port = _free_port()
    server, _ = serve_metrics("127.0.0.1", port, CollectorRegistry(), request_timeout_s=1.0)
    socks = []
    try:
        socks = half_open(port, [b"GET /metrics HTTP/1.1\r\nHost: x\r\n"] * 10)  # headers never finished
        closed = closed_by_server(socks)
        assert closed == len(socks), f"{closed} of {len(socks)} half-open connections closed"
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.shutdown()


def test_page_that_never_finishes_fails_at_the_total_deadline_without_queueing_scrapes():
    """httpx's timeout bounds each read, so a page dripped a line every 0.1 s never timed out and a
    lock held across the fetch queued every other scrape behind it: 4 concurrent scrapes must each
    end by the 1 s deadline (not 4 s serially, not never), with the engine series absent."""
    vllm = _FakeVllm(drip_s=0.1)
    url, server = _serve_sidecar(vllm.url, timeout_s=1.0)
    results: list[tuple[float, str]] = []

    def scrape() -> None:
        t0 = time.monotonic()
        text = httpx.get(url, timeout=30).text
        results.append((time.monotonic() - t0, text))

    threads = [threading.Thread(target=scrape, daemon=True) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(results) == 4, "sidecar scrapes hung on a page that never finishes"
        assert max(d for d, _ in results) < 2.5, [round(d, 2) for d, _ in results]
        last = parse(results[-1][1])
        assert _errors(last, "timeout") >= 1
        assert not pick(last, c.REQUEST_TTFT.series("_count")) and not pick(last, c.ENGINE_INFO.series())
    finally:
        server.shutdown()
        vllm.stop()


def test_slow_name_resolution_ends_the_scrape_at_the_deadline(monkeypatch):
    """httpx resolves the host in asyncio's default executor, and asyncio.run waits for that executor
    at the end: with a resolver taking 5 s, a 0.5 s --timeout was reported at 0.5 s but the scrape
    lasted the whole 5 s (DNS outages in a cluster take as long)."""
    import socket

    real = socket.getaddrinfo

    def slow_resolver(*a, **k):
        time.sleep(5)
        return real(*a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    col = SidecarCollector("http://localhost:9/metrics", "m", "decode", None, timeout_s=0.5)
    t0 = time.monotonic()
    list(col.collect())
    assert time.monotonic() - t0 < 2.0
    assert col.errors == {"timeout": 1}

@pytest.mark.parametrize("endless", [True, False], ids=["streamed-endless", "content-length"])
def test_page_over_max_body_bytes_is_abandoned_and_counted(endless):
    """An endless page grew the sidecar to 2.3 GB: the body is streamed and abandoned past
    --max-body-bytes (or refused by its Content-Length), counted as too_large, nothing exported."""
    vllm = _FakeVllm(endless=endless)
    url, server = _serve_sidecar(vllm.url, timeout_s=20.0, max_body_bytes=len(FIXTURE) // 2)
    try:
        t0 = time.monotonic()
        got = parse(httpx.get(url, timeout=30).text)
        assert time.monotonic() - t0 < 5.0  # abandoned at the limit, not read until the deadline
        assert _errors(got, "too_large") == 1 and _errors(got, "timeout") == 0
        assert not pick(got, c.REQUESTS_RUNNING.series()) and not pick(got, c.REQUEST_TTFT.series("_count"))
    finally:
        server.shutdown()
        vllm.stop()


TTFT = "vllm:time_to_first_token_seconds"


def _ttft(engine: str, buckets: dict[str, float], count: float, total: float = 10.0) -> str:
    rows = [f'{TTFT}_bucket{{engine="{engine}",le="{le}",model_name="m"}} {v}' for le, v in buckets.items()]
    return "\n".join([*rows, f'{TTFT}_count{{engine="{engine}",model_name="m"}} {count}',
                      f'{TTFT}_sum{{engine="{engine}",model_name="m"}} {total}'])


def test_histogram_without_inf_bucket_or_disagreeing_count_is_dropped_not_miscounted():
    """Without +Inf the contract's _count came from the last finite bucket (3 where vLLM counted
    10: attainment 100 %). Engine 0 has no +Inf, engine 2 a +Inf that disagrees with _count:
    both read absent and count malformed_histogram; the sound engine 1 passes through exactly."""
    page = "\n".join([f"# TYPE {TTFT} histogram",
                      _ttft("0", {"1.0": 2, "2.5": 3}, 10),
                      _ttft("1", {"1.0": 2, "2.5": 3, "+Inf": 10}, 10),
                      _ttft("2", {"1.0": 2, "2.5": 3, "+Inf": 3}, 10), ""])
    got, _ = _sidecar_page(page)
    assert not pick(got, c.REQUEST_TTFT.series("_count"), engine="0")
    assert not pick(got, c.REQUEST_TTFT.series("_bucket"), engine="2")
    assert one(got, c.REQUEST_TTFT.series("_count"), engine="1") == 10
    assert one(got, c.REQUEST_TTFT.series("_bucket"), engine="1", le="2.5") == 3
    assert _errors(got, "malformed_histogram") == 2


def test_two_models_on_one_engine_collide_and_are_dropped_not_duplicated():
    """model_name is not kept (the contract's model is --model), so two vLLM models on engine 0 map
    to the same contract series: exported twice they were 3 and 7 under identical labels. They
    are dropped and counted as label_collision; engine 1 with one model still passes through."""
    page = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="a"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="b"} 7.0',
        'vllm:num_requests_running{engine="1",model_name="a"} 4.0',
        f"# TYPE {TTFT} histogram",
        _ttft("0", {"2.5": 1, "+Inf": 1}, 1).replace('model_name="m"', 'model_name="a"'),
        _ttft("0", {"2.5": 0, "+Inf": 5}, 5).replace('model_name="m"', 'model_name="b"'), ""])
    got, text = _sidecar_page(page)
    lines = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if not ln.startswith("#")]
    assert len(lines) == len(set(lines)), "duplicate series on the sidecar's page"
    assert not pick(got, c.REQUESTS_RUNNING.series(), engine="0")
    assert not pick(got, c.REQUEST_TTFT.series("_count"), engine="0")
    assert one(got, c.REQUESTS_RUNNING.series(), engine="1") == 4
    assert _errors(got, "label_collision") == 2  # two families on engine 0


def test_negative_or_nan_counts_and_gauges_are_dropped_and_counted():
    """A running-requests gauge of -5 (or NaN) was passed through and read as a value; every
    mapped counter and gauge is a count, ratio or size, so it reads absent and counts bad_value."""
    page = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} -5.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
        'vllm:num_requests_running{engine="2",model_name="m"} NaN', ""])
    got, _ = _sidecar_page(page)
    assert not pick(got, c.REQUESTS_RUNNING.series(), engine="0")
    assert not pick(got, c.REQUESTS_RUNNING.series(), engine="2")
    assert one(got, c.REQUESTS_RUNNING.series(), engine="1") == 4
    assert _errors(got, "bad_value") == 2


def test_renamed_labels_unknown_values_and_foreign_pages_are_counted():
    """A renamed label (reason instead of finished_reason) or an unknown value (source=kv_transfer)
    used to vanish silently, and so did a page with no vLLM family at all: each is now counted, and
    the affected family reads absent rather than as a partial total."""
    page = "\n".join([
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{engine="0",reason="stop",model_name="m"} 10.0',
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 100.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="kv_transfer"} 900.0',
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 5.0', ""])
    got, _ = _sidecar_page(page)
    assert _errors(got, "unmapped_label") == 2
    assert not pick(got, c.REQUESTS_FINISHED.series()) and not pick(got, c.PROMPT_TOKENS.series())
    assert one(got, c.GENERATION_TOKENS.series(), engine="0") == 5  # the rest of the page still maps
    foreign, _ = _sidecar_page("# TYPE python_info gauge\npython_info{version=\"3.11\"} 1.0\n")
    assert _errors(foreign, "no_vllm_families") == 1 and not pick(foreign, c.ENGINE_INFO.series())


def test_finish_reasons_are_an_open_set_passed_through_and_summable():
    """vLLM's finish reasons grow (error, repetition, ...): the reason mapping has no table of
    known values, so a reason the sidecar has never seen passes through under its own name, the
    family is kept and the sum over reasons is vLLM's total; only a sample without the
    finished_reason label at all (vLLM renamed the label) drops the family for its engine."""
    page = "\n".join([
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 10.0',
        'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 2.0',
        'vllm:request_success_total{engine="0",finished_reason="repetition",model_name="m"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="never_seen_before",model_name="m"} 4.0',
        'vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 5.0',
        'vllm:request_success_total{engine="1",model_name="m"} 6.0', ""])
    fams, engines, problems = map_exposition(page, "m", "decode")
    rows = {(s.labels["engine"], s.labels["reason"]): s.value
            for f in fams if f.name == c.REQUESTS_FINISHED.name for s in f.samples if s.name.endswith("_total")}
    assert rows == {("0", "stop"): 10.0, ("0", "error"): 2.0, ("0", "repetition"): 3.0,
                    ("0", "never_seen_before"): 4.0}
    assert sum(v for (e, _), v in rows.items() if e == "0") == 19.0
    assert engines == {"0", "1"}
    assert problems == {"unmapped_label": 1}  # engine 1's sample without the label, once
