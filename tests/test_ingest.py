"""Exposition parsing (fast path vs prometheus_client's reference parser), the scraper against
real loopback servers, and target files."""

from __future__ import annotations

import asyncio
import collections
import gzip
import http.server
import os
import re
import threading
from pathlib import Path

import pytest
from guard_support import Engine, Served, free_port

from exporters import contract as c
from sla_guard.config import ScrapeSource, Target
from sla_guard.exposition import ExpositionError, _reference, parse_exposition
from sla_guard.ingest.discovery import DiscoveryError, parse_targets
from sla_guard.ingest.scrape import Scraper
from sla_guard.ingest.source import UP
from sla_guard.store import SeriesStore

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_server_metrics.txt"

TRICKY = r'''# HELP x_total A counter with "quotes" and \ backslash
# TYPE x_total counter
x_total{path="/a,b}c",q="say \"hi\"",nl="a\nb",bs="c:\\dir"} 3
x_total{path="",q="",nl="",bs=""} 1e3
g_ratio -0.5
g_ratio{a="1"} +Inf
g_ratio{a="2"} -Inf
g_ratio{a="3"} NaN
with_ts{a="x"} 7 1700000000000
spaces{ a = "1" , b="2",} 9
'''


def _norm(samples):
    return sorted((n, tuple(sorted(lab.items())), repr(v)) for n, lab, v in samples)


def test_fast_parser_agrees_with_reference_on_contract_exposition():
    e = Engine()
    for i in range(50):
        e.request(0.1 * i, 0.001 * i)
    e.rec.spec_decode(2, 6, 4, [2, 1, 1], [2, 2, 2])
    text = e.exposition()
    fast, _ = parse_exposition(text)
    assert _norm(fast) == _norm(_reference(text, True))
    assert any(n == c.REQUEST_TTFT.series("_bucket") for n, _, _ in fast)
    assert not any(n.endswith("_created") for n, _, _ in fast)


def test_fast_parser_agrees_with_reference_on_tricky_lines():
    fast, _ = parse_exposition(TRICKY)
    ref = _reference(TRICKY, True)
    assert _norm(fast) == _norm(ref)
    x = next(lab for n, lab, _ in fast if n == "x_total" and lab["path"])
    assert x == {"path": "/a,b}c", "q": 'say "hi"', "nl": "a\nb", "bs": "c:\\dir"}


@pytest.mark.skipif(not FIXTURE.exists(), reason="no recorded vLLM exposition yet")
def test_fast_parser_agrees_on_recorded_vllm_exposition():
    text = FIXTURE.read_text()
    fast, _ = parse_exposition(text)
    assert len(fast) > 100
    assert _norm(fast) == _norm(_reference(text, True))


@pytest.mark.parametrize("bad", ["x_total{a=\"1\" 3\n", "x_total 1 2 3 4\n", "x_total notanumber\n",
                                 "{a=\"1\"} 3\n", 'x{a="1",a="2"} 1\n'])
def test_malformed_lines_fail_the_whole_exposition(bad):
    with pytest.raises(ExpositionError):
        parse_exposition("ok_total 1\n" + bad)


def test_openmetrics_exemplars_fall_back_to_reference():
    text = ('# TYPE r counter\nr_total 5 # {trace_id="abc"} 1.0\n# EOF\n')
    samples, _ = parse_exposition(text)
    assert [(n, v) for n, _, v in samples] == [("r_total", 5.0)]


def test_quoted_utf8_metric_names_fall_back_to_reference():
    """A Prometheus 3 page may quote a UTF-8 metric name inside the braces. The fast path read
    such a line as malformed and failed the whole page (the target went down); the reference
    parser reads it, and a truly malformed line still fails the page."""
    text = 'ok_total 1\n{"vllm.kv.usage",engine="0"} 0.5\nm{"lab.el"="x"} 2\n'
    samples, _ = parse_exposition(text)
    assert _norm(samples) == _norm([("ok_total", {}, 1.0), ("vllm.kv.usage", {"engine": "0"}, 0.5),
                                    ("m", {"lab.el": "x"}, 2.0)])
    store = SeriesStore()
    res = store.ingest_text(text, 1000.0, {"instance": "e"})
    assert res.samples == 3 and not res.errors
    with pytest.raises(ExpositionError):
        parse_exposition('ok_total 1\n{"vllm.kv.usage" 0.5\n')


@pytest.mark.skipif(not FIXTURE.exists(), reason="no recorded vLLM exposition yet")
def test_a_page_with_crlf_line_ends_reads_as_the_reference_parser_reads_it():
    """A page with CRLF line ends (served from Windows, or rewritten by a proxy) failed the fast
    path's every line, so the target went down, though the reference parser reads it. Both the
    first scrape and the store's scrape-cache path (known series texts) read it now."""
    text = FIXTURE.read_text().replace("\n", "\r\n")
    fast, _ = parse_exposition(text)
    assert len(fast) > 100 and _norm(fast) == _norm(_reference(text, True))
    lf, crlf = SeriesStore(), SeriesStore()
    for t in (1000.0, 1015.0):  # the second page takes the known-texts path
        want = lf.ingest_text(FIXTURE.read_text(), t, {"instance": "e"})
        got = crlf.ingest_text(text, t, {"instance": "e"})
        assert (got.samples, got.errors) == (want.samples, want.errors) and got.samples > 100


def test_targets_file_formats_and_errors():
    ts = parse_targets([{"url": "http://a:1/metrics", "model": "m", "pool": "decode"},
                        {"targets": ["b:2", "c:3"], "labels": {"model": "n", "pool": "prefill"}}])
    assert [(t.url, t.model, t.pool) for t in ts] == [
        ("http://a:1/metrics", "m", "decode"), ("http://b:2/metrics", "n", "prefill"),
        ("http://c:3/metrics", "n", "prefill")]
    with pytest.raises(DiscoveryError, match=r"\[0\]\.pool"):
        parse_targets([{"url": "http://a/metrics", "pool": "middle"}], "t.yaml")
    with pytest.raises(DiscoveryError, match="expected a list"):
        parse_targets({"url": "x"})


@pytest.mark.parametrize(("text", "says"), [
    ("- targets: ['127.0.0.1:1']\n  labels: [model, pool]\n", r"\[0\]\.labels: expected a mapping"),
    ("- targets: '127.0.0.1:1'\n", r"\[0\]\.targets: expected a list of \"host:port\" strings"),
    ("- targets: ['127.0.0.1:1']\n  ? [x]\n  : 1\n", "found unhashable key"),
    ("- url: http://127.0.0.1:1/metrics\n  model: caf\xe9\n", "is not UTF-8 text"),
    # file_sd addresses with a scheme or a path became http://http://h:1/metrics (host "http") or
    # .../metrics/metrics: accepted, and every scrape of them failed
    ("- targets: ['http://127.0.0.1:1']\n", r"\[0\]\.targets\[0\]: expected \"host:port\" without scheme"),
    ("- targets: ['127.0.0.1:1', '127.0.0.1:1/metrics']\n", r"\[0\]\.targets\[1\]: expected \"host:port\""),
    ("- targets: ['127.0.0.1:1']\n  labels: {__metrics_path__: metrics}\n",
     r"\[0\]\.labels\.__metrics_path__: expected a path starting with '/'"),
], ids=["labels-list", "targets-string", "list-as-key", "latin-1", "file-sd-scheme", "file-sd-path",
        "file-sd-relative-path"])
def test_a_wrong_targets_file_keeps_the_last_good_list_and_names_the_problem(tmp_path, text, says):
    """A file_sd group whose ``labels`` is a list, a ``targets`` that is one string, a YAML key
    that is a list, a Latin-1 file: each raised out of the discovery (ValueError, TypeError,
    UnicodeDecodeError), so every round failed and no target -- the static ones neither -- was
    scraped again; a string ``targets`` was read a character at a time. Now the file is refused
    with what is wrong and the last good list is still scraped."""
    e = Engine()
    srv = Served(e.exposition)
    f = tmp_path / "targets.yaml"
    f.write_text(f"- {{url: '{srv.url}', model: m, pool: decode, name: e0}}\n")
    scr = Scraper(ScrapeSource(targets_file=f, timeout_s=2), SeriesStore())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scr.collect())
        f.write_bytes(text.encode("latin-1"))
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        hits = srv.hits
        loop.run_until_complete(scr.collect())
        assert [(t.name, t.up) for t in scr.targets()] == [("e0", True)] and srv.hits == hits + 1
        assert scr.discovery.errors == 1 and re.search(says, scr.discovery.last_error)
    finally:
        loop.run_until_complete(scr.aclose())
        loop.close()
        srv.stop()


def test_a_targets_file_replaced_by_one_with_the_same_mtime_is_read(tmp_path):
    """The file was re-read only when its mtime changed: one renamed over it (or copied with
    ``cp -p``, ``rsync -t``) that carries the same mtime was never read, and the guard scraped the
    old engines for good. Size and inode count too now."""
    e0, e1 = Engine(engine="0"), Engine(engine="1")
    s0, s1 = Served(e0.exposition), Served(e1.exposition)
    f, new = tmp_path / "targets.yaml", tmp_path / "targets.yaml.new"
    f.write_text(f"- {{url: '{s0.url}', model: m, pool: decode, name: e0}}\n")
    scr = Scraper(ScrapeSource(targets_file=f, timeout_s=2), SeriesStore())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scr.collect())
        assert [t.name for t in scr.targets()] == ["e0"]
        new.write_text(f"- {{url: '{s1.url}', model: m, pool: decode, name: e1-renamed}}\n")
        os.utime(new, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
        os.replace(new, f)
        loop.run_until_complete(scr.collect())
        assert [(t.name, t.up) for t in scr.targets()] == [("e1-renamed", True)]
    finally:
        loop.run_until_complete(scr.aclose())
        loop.close()
        s0.stop()
        s1.stop()


def test_one_url_listed_under_two_names_is_scraped_once(tmp_path):
    """The same engine listed twice (two names, or the second in another pool) was scraped twice:
    its requests counted twice in the pool (96 for 48 sent), meeting ``min_requests`` on half the
    evidence, or once in each of two pools. The first definition is scraped, the other logged."""
    e = Engine(model="m")
    srv = Served(e.exposition)
    f = tmp_path / "targets.yaml"
    f.write_text(f"- {{url: '{srv.url}', model: m, pool: decode, name: a}}\n"
                 f"- {{url: '{srv.url}', model: m, pool: decode, name: b}}\n"
                 f"- targets: ['127.0.0.1:{srv.port}']\n  labels: {{model: m, pool: prefill}}\n")
    store = SeriesStore()
    scr = Scraper(ScrapeSource(targets_file=f, timeout_s=2), store)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(3):
            e.request(0.2, 0.01)
            loop.run_until_complete(scr.collect())
        assert [t.name for t in scr.targets()] == ["a"] and srv.hits == 3
        counts = store.instant(c.REQUEST_TTFT.series("_count"), {}, store.newest)
        assert sum(counts.values()) == 3 and {dict(k)["pool"] for k in counts} == {"decode"}
    finally:
        loop.run_until_complete(scr.aclose())
        loop.close()
        srv.stop()


class _Gzip(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        data = gzip.compress(self.body)
        self.send_response(200)
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_scraper_stores_target_labels_up_and_gzip():
    e = Engine(model="llama", pool="prefill", engine="3")
    for _ in range(5):
        e.request(0.2, 0.01)
    plain = Served(e.exposition)
    _Gzip.body = e.exposition().encode()
    gz = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Gzip)
    threading.Thread(target=gz.serve_forever, daemon=True).start()
    store = SeriesStore()
    cfg = ScrapeSource(targets=[Target(url=plain.url, model="llama", pool="prefill", name="a"),
                                Target(url=f"http://127.0.0.1:{gz.server_address[1]}/metrics", model="llama",
                                       pool="prefill", name="b")], timeout_s=2)
    scr = Scraper(cfg, store, clock=lambda: 1000.0)
    try:
        asyncio.run(scr.collect(1000.0))
        count = c.REQUEST_TTFT.series("_count")
        got = store.instant(count, {}, 1000.0)
        assert {dict(k)["instance"] for k in got} == {"a", "b"}
        assert all(v == 5 for v in got.values())
        # the exposition's own labels are kept (engine), target labels fill in instance
        assert all(dict(k)["engine"] == "3" and dict(k)["model"] == "llama" for k in got)
        ups = store.instant(UP, {"model": "llama", "pool": "prefill"}, 1000.0)
        assert sorted(ups.values()) == [1.0, 1.0]
        st = {t.name: t for t in scr.targets()}
        assert st["a"].up and st["b"].up and st["a"].samples == st["b"].samples > 50
    finally:
        plain.stop()
        gz.shutdown()
        gz.server_close()


def test_scraper_concurrency_limit_is_respected():
    active, peak, lock = [0], [0], threading.Lock()

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            import time

            time.sleep(0.2)
            with lock:
                active[0] -= 1
            body = b"x_total 1\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Slow)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    cfg = ScrapeSource(targets=[Target(url=f"http://127.0.0.1:{port}/metrics?i={i}", name=f"t{i}")
                                for i in range(8)], concurrency=3, timeout_s=5)
    scr = Scraper(cfg, SeriesStore())
    try:
        asyncio.run(scr.collect())
        assert peak[0] == 3
        assert all(t.up for t in scr.targets())
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_sample_its_exporter_stamped_older_than_the_lookback_is_not_a_current_value():
    """The optional timestamp on an exposition line is the exporter saying when the value was
    true. One stamped an hour back used to be stored as a value of now, and judged "ok" as
    current data; now it is left out and counted, and the series goes stale as Prometheus's
    lookback would see it. Stamped within the lookback, it is stored as before; both on the first
    scrape and on later ones, where a target's known lines take the fast path."""
    store = SeriesStore(lookback_s=60.0)
    now = 1_700_003_600.0
    for t in (now, now + 15):
        page = (f'fresh{{a="1"}} 1 {int((t - 5) * 1000)}\n'
                f'old{{a="1"}} 2 {int((t - 3600) * 1000)}\n'
                f'plain{{a="1"}} 3\n')
        res = store.ingest_text(page, t, {"instance": "e"})
        assert res.errors["stale_timestamp"] == 1
    got = {name: store.instant(name, {}, now + 15) for name in ("fresh", "old", "plain")}
    assert list(got["fresh"].values()) == [1.0] and list(got["plain"].values()) == [3.0]
    assert got["old"] == {}
    assert store.dropped["stale_timestamp"] == 2
    # the reference parser, for pages the fast path hands over, does the same
    problems = collections.Counter()
    samples = _reference(f'x{{a="1"}} 1 {int(now * 1000)}\nold{{a="1"}} 2 1000\n', True, now - 60, problems)
    assert problems["stale_timestamp"] == 1 and [s[0] for s in samples] == ["x"]
    assert parse_exposition('old{a="1"} 2 1000\n', oldest_s=now - 60)[1]["stale_timestamp"] == 1




def _one_target(page) -> tuple[Served, SeriesStore, list[float], Scraper]:
    """A served page, a store, the scraper's settable clock (starts at 1000 s), the scraper."""
    srv = Served(page)
    store = SeriesStore()
    now = [1000.0]
    scr = Scraper(ScrapeSource(targets=[Target(url=srv.url, model="llama", pool="prefill", name="a")], timeout_s=2),
                  store, clock=lambda: now[0])
    return srv, store, now, scr


@pytest.mark.parametrize("ts", ["1.2.3", "1e1e", "1-2"])
def test_a_malformed_timestamp_fails_the_scrape_not_the_scraper(ts):
    """The line pattern admits a timestamp such as "1.2.3"; its float() raised a bare ValueError
    out of the parser, past the store and the scraper's error accounting: the target stayed up=1
    on /metrics and in /v1/targets with no error, its old samples still judged, for as long as
    it served the line. It is a malformed exposition: the scrape fails and says so."""
    with pytest.raises(ExpositionError, match="timestamp"):
        parse_exposition(f"a 1 {ts}\n")
    e = Engine(model="llama", pool="prefill")
    e.request(0.2, 0.01)
    bad = [False]
    srv, store, now, scr = _one_target(lambda: e.exposition() + (f"slaguard_extra 1 {ts}\n" if bad[0] else ""))
    try:
        asyncio.run(scr.collect())
        assert scr.targets()[0].up
        bad[0], now[0] = True, 1005.0
        asyncio.run(scr.collect())
        st = scr.targets()[0]
        assert not st.up and st.errors == {"parse": 1} and st.last_scrape == 1005.0
        assert store.instant(UP, {"model": "llama"}, 1005.0) and \
            list(store.instant(UP, {"model": "llama"}, 1005.0).values()) == [0.0]
    finally:
        srv.stop()


def test_anything_a_page_makes_the_store_raise_is_a_failed_scrape(monkeypatch):
    """Whatever a page makes the parser or the store raise (a bare ValueError from the parser did)
    must not leave the target up with its last samples and no error: the scrape fails, kind
    internal, the target's data goes stale. The failure is injected into the real store."""
    e = Engine(model="llama", pool="prefill")
    e.request(0.2, 0.01)
    srv, store, now, scr = _one_target(e.exposition)
    try:
        asyncio.run(scr.collect())
        assert scr.targets()[0].up

        def boom(*a, **k):
            raise RuntimeError("a page the store could not take")

        monkeypatch.setattr(store, "ingest_text", boom)
        now[0] = 1005.0
        asyncio.run(scr.collect())
        st = scr.targets()[0]
        assert not st.up and st.errors == {"internal": 1} and "RuntimeError" in st.last_error
        assert list(store.instant(UP, {"model": "llama"}, 1005.0).values()) == [0.0]
    finally:
        srv.stop()


def test_a_gzip_page_is_read_and_a_gzip_bomb_is_too_large_without_being_inflated():
    """httpx inflates each 64 KiB compressed chunk whole: ~60 KB of gzip became 60 MB in memory
    before the page limit saw a byte, per target and scrape. The page is inflated within the limit
    now; an ordinary gzip page reads as before."""
    import gzip
    import tracemalloc

    e = Engine(model="llama", pool="prefill")
    e.request(0.2, 0.01)
    srv = Served(e.exposition)
    srv.mode = "gzip"
    store = SeriesStore()
    scr = Scraper(ScrapeSource(targets=[Target(url=srv.url, model="llama", pool="prefill", name="a")],
                               timeout_s=10, max_body_bytes=1 << 20), store, clock=lambda: 1000.0)
    try:
        asyncio.run(scr.collect())
        st = scr.targets()[0]
        assert st.up and st.samples > 10, st.last_error
        bomb = gzip.compress(b"\n" * 60_000_000)
        assert len(bomb) < 100_000
        srv.body, srv.mode = (lambda: bomb), "gzipped"
        tracemalloc.start()
        try:
            asyncio.run(scr.collect())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        st = scr.targets()[0]
        assert not st.up and st.errors.get("too_large") == 1, st.errors
        assert peak < 20 << 20, f"{peak / 2**20:.0f} MiB held for a page limited to 1 MiB"
    finally:
        srv.stop()
