"""sla-guard-proxy (pd_proxy/) over real loopback HTTP.

The engines here are small real HTTP servers on 127.0.0.1 that speak vLLM's OpenAI completions
and chat-completions formats (JSON answers, SSE streams with the final usage chunk when asked,
``kv_transfer_params`` from prefill), not vLLM: engine errors, an engine slower than its deadline,
a stream that stalls and a client that leaves mid-stream cannot be produced on demand by a real
vLLM. The proxy itself runs under uvicorn in a thread of this process, so the proxy's clock and the
test client's clock are the same ``time.perf_counter``: client-measured times bound the proxy's
exactly (the proxy's TTFT starts after the client sent and ends before the client received).
Real CPU vLLM drives the proxy in tests/test_vllm_hooks.py (the P/D pair) and tests/test_pd_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from guard_support import ScrapeRig
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c
from pd_proxy import ProxyConfig, ProxyThread, balance, legs
from pd_proxy.balance import EnginePool
from pd_proxy.metrics import ClientMetrics
from sla_guard.config import parse_config
from sla_guard.store import SeriesStore

ROOT = Path(__file__).resolve().parents[1]
ROUTER = "proxy-under-test"


# --- stand-in engines ------------------------------------------------------------------------------

class Engine:
    """A vLLM-shaped engine. Prefill answers one token and ``kv_transfer_params``; decode answers
    whole or streams ``tokens`` chunks (first after ``first_token_s``, then every ``itl_s``), then
    the usage chunk if asked, then ``[DONE]`` (unless ``send_done`` is off). Knobs: ``delay_s``
    before any answer, ``status`` / ``error`` for an error answer, ``stall_after`` tokens then
    ``stall_s`` of silence, ``first_chunk_extra`` fields added to chat's first chunk, ``force_usage``
    (vLLM's ``--enable-force-include-usage``), ``abort_after`` tokens (vLLM's ending of a request its
    engine aborted), ``fingerprint`` (vLLM's ``system_fingerprint``, placed where vLLM places it), ``die_after``
    tokens then the connection cut mid-body (a chunked stream without its last chunk: the process died),
    ``health_status`` of ``GET /health`` (vLLM: 200, 503 once its engine core is dead), ``error_event`` a stream's
    only event before ``[DONE]`` (vLLM's error in a stream), ``whole_status`` of a
    non-streamed answer (its body ``error``; streams still 200), ``chunked`` (a stream sent
    as uvicorn sends it: HTTP/1.1 chunked, ended cleanly with its last chunk). A whole answer honours
    ``stall_after`` as its headers, then ``stall_s`` of silence, then its body; ``cut_body`` sends only half of its
    200 body, then closes the connection: ``"length"`` under its whole Content-Length, ``"close"`` with none
    (HTTP/1.0: the body ends with the connection, as a hop's cut looks).
    Records every request, the /health probes, and whether the proxy hung up mid-stream."""

    def __init__(self, role: str, name: str = "", port: int = 0) -> None:
        self.role, self.name = role, name or role
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.delay_s = 0.0
        self.first_token_s = 0.0
        self.itl_s = 0.0
        self.tokens = 5
        self.status = 200
        self.error: tuple[bytes, str] = (b'{"error": {"message": "nope", "code": 400}}', "application/json")
        self.stall_after: int | None = None
        self.stall_s = 3.0
        self.send_done = True
        self.first_chunk_extra: dict = {}  # more fields of chat's first (role) chunk
        self.eos = False  # end as vLLM does at EOS: one more step, no text, finish_reason, counted in usage
        # else as vLLM does at max_tokens: the last token's chunk carries the finish_reason (None: a stream whose
        # endings were lost, [DONE] without any)
        self.finish: str | None = "length"
        self.force_usage = False  # vLLM's should_include_usage when forced: usage in every chunk, and the usage chunk
        self.abort_after: int | None = None  # the engine aborts the request (shutdown, fault) after this many tokens
        # vLLM 0.32 (--fingerprint-mode full by default): in a whole answer; in a stream, on the usage chunk when
        # include_usage is on, else on each choice's chunk carrying a finish_reason
        self.fingerprint: str | None = None
        self.die_after: int | None = None
        self.chunked = False
        self.cut_body: str | None = None  # "length" or "close", see above
        self.health_status = 200
        self.whole_status = 200
        self.error_event: dict | None = None  # a stream's only event before [DONE] (vLLM's error in a stream)
        self.health_gets = 0
        self.hung_up = threading.Event()
        self.active = 0
        # per streamed answer, when the engine began writing each decode step's chunk (this process's
        # perf_counter, the proxy's and the client's clock too): the proxy stamps a step after this
        self.step_times: list[list[float]] = []
        eng = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                eng.requests.append(body)
                eng.headers.append({k.lower(): v for k, v in self.headers.items()})
                eng.active += 1
                try:
                    eng.answer(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    eng.hung_up.set()
                finally:
                    eng.active -= 1

            def do_GET(self):
                if self.path != "/health":
                    self.send_error(404)
                    return
                eng.health_gets += 1
                eng._send(self, eng.health_status, b"", "text/plain")

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # http.server's 5 reset connections of a burst; uvicorn's (vLLM's) is 2048

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _send(self, h, status: int, data: bytes, ctype: str) -> None:
        cut = self.cut_body if status == 200 and h.command == "POST" else None
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        if cut != "close":
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if cut:
            h.wfile.write(data[: len(data) // 2])
            h.close_connection = True
            return
        if status == 200 and self.stall_after is not None and data:  # the headers, then silence
            h.wfile.flush()
            time.sleep(self.stall_s)
        h.wfile.write(data)

    def answer(self, h, body: dict) -> None:
        time.sleep(self.delay_s)
        if self.status != 200:
            self._send(h, self.status, *self.error)
            return
        chat = h.path.endswith("/chat/completions")
        if self.role == "prefill":
            out = {"id": "p", "choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1},
                   "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                          "remote_engine_id": self.name, "remote_block_ids": [1, 2],
                                          "remote_host": "10.0.0.1", "remote_port": 5600}}
            self._send(h, 200, json.dumps(out).encode(), "application/json")
            return
        if not body.get("stream"):
            if self.whole_status != 200:
                self._send(h, self.whole_status, *self.error)
                return
            msg = {"message": {"role": "assistant", "content": "hello world"}} if chat else {"text": "hello world"}
            out = {"id": "d", "choices": [{"index": 0, **msg}], "usage": {"completion_tokens": self.tokens}}
            if self.abort_after is not None:
                out["choices"][0]["finish_reason"] = "abort"
            if self.fingerprint is not None:
                out["system_fingerprint"] = self.fingerprint
            self._send(h, 200, json.dumps(out).encode(), "application/json")
            return
        dies = self.die_after is not None
        chunked = dies or self.chunked
        if chunked:  # as uvicorn (vLLM) sends a stream: HTTP/1.1, chunked
            h.protocol_version = "HTTP/1.1"
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        if chunked:
            h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def event(obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            h.wfile.flush()

        if self.error_event is not None:  # vLLM: the generator raised before any output (EngineDeadError)
            event(self.error_event)
            event(b"[DONE]")
            return
        # vLLM's should_include_usage: continuous usage (in every chunk) only along with include_usage
        so = body.get("stream_options") or {}
        include = self.force_usage or bool(so.get("include_usage"))
        continuous = self.force_usage or bool(so.get("include_usage") and so.get("continuous_usage_stats"))
        n = body.get("n") or 1  # n choices, interleaved, each chunk one choice (vLLM's form)
        if chat:  # vLLM's first chat chunk: the role, no text
            for k in range(n):
                usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3} if continuous else None
                event({"id": "d", "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}}],
                       "usage": usage, **self.first_chunk_extra})
        time.sleep(self.first_token_s)
        tokens = self.tokens if self.abort_after is None else min(self.tokens, self.abort_after)
        steps: list[float] = []
        self.step_times.append(steps)
        for i in range(tokens):
            if i == self.die_after:
                h.close_connection = True  # the socket closes with the body unfinished
                return
            if i:
                time.sleep(self.itl_s)
            if self.stall_after is not None and i == self.stall_after:
                time.sleep(self.stall_s)
            steps.append(time.perf_counter())
            last = i == tokens - 1 and self.abort_after is None and not self.eos and self.finish
            for k in range(n):
                choice = {"index": k, "delta": {"content": f"t{i} "}} if chat else {"index": k, "text": f"t{i} "}
                fp = {}
                if last:
                    choice["finish_reason"] = self.finish
                    fp = {"system_fingerprint": self.fingerprint} if self.fingerprint and not include else {}
                if not chat and i == 0 and body.get("echo"):  # the prompt, and its logprobs, with the first token
                    words = body["prompt"].split(" ")
                    choice["text"] = body["prompt"] + choice["text"]
                    if body.get("logprobs") is not None:
                        choice["logprobs"] = {"tokens": words, "token_logprobs": [-0.25] * len(words),
                                              "top_logprobs": [{w: -0.25, " x": -1.5} for w in words],
                                              "text_offset": list(range(len(words)))}
                usage = {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i} if continuous else None
                event({"id": "d", "choices": [choice], "usage": usage, **fp})
        # vLLM's ending at EOS, or of an aborted request: a chunk without text (none when nothing was generated)
        ending = "abort" if self.abort_after is not None else "stop" if self.eos else None
        if ending and tokens:
            time.sleep(self.itl_s)
            steps.append(time.perf_counter())
            m = tokens + (ending == "stop")
            usage = {"prompt_tokens": 3, "completion_tokens": m, "total_tokens": 3 + m} if continuous else None
            for k in range(n):
                choice = {"index": k, "delta": {"content": ""}} if chat else {"index": k, "text": ""}
                fp = {"system_fingerprint": self.fingerprint} if self.fingerprint and not include else {}
                event({"id": "d", "choices": [{**choice, "finish_reason": ending}], "usage": usage, **fp})
        generated = n * (tokens + (ending == "stop"))
        if include:
            fp = {"system_fingerprint": self.fingerprint} if self.fingerprint else {}
            event({"id": "d", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": generated,
                                                        "total_tokens": 3 + generated}, **fp})
        if self.send_done:
            event(b"[DONE]")
        if chunked:  # the body's last chunk: the stream ended cleanly, [DONE] or not
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(role: str, name: str = "", port: int = 0) -> Engine:
        made.append(Engine(role, name, port))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def proxies():
    made: list[ProxyThread] = []

    def make(prefill, decode, **kw) -> ProxyThread:
        p = [e.url if isinstance(e, Engine) else e for e in prefill]
        d = [e.url if isinstance(e, Engine) else e for e in decode]
        kw.setdefault("health_interval_s", 0)  # the passive rules alone, unless a test turns the probes on
        made.append(ProxyThread(ProxyConfig(prefill=tuple(p), decode=tuple(d), router=ROUTER, **kw)).start())
        return made[-1]

    yield make
    for p in made:
        p.stop()


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def client_rig(px, objectives: list[dict]) -> ScrapeRig:
    """The proxy's /metrics (model m) scraped by the real Scraper and its client scope judged by the
    real evaluator against ``objectives``; the caller closes it."""
    cfg = parse_config({"source": {"mode": "scrape", "timeout_s": 5, "targets": [
        {"url": px.url + "/metrics", "model": "m", "pool": "client", "name": "proxy"}]},
        "staleness_s": 60, "slos": [{"pool": "client", "objectives": objectives}]})
    return ScrapeRig(cfg, SeriesStore(slots=64, lookback_s=60))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(url: str, body: dict, headers: dict | None = None, timeout: float = 30):
    """Stream a request; returns (response, events [(t, payload)], t_sent)."""
    events: list[tuple[float, str]] = []
    t_sent = time.perf_counter()
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append((time.perf_counter(), line[5:].strip()))
    return r, events, t_sent


def tpot_bounds(engine: Engine, first_seen: float, last_seen: float) -> tuple[float, float]:
    """The TPOT the proxy can have observed for ``engine``'s last streamed answer, given when the client
    received its first and last decode step: the proxy stamps each step after the engine began writing it
    and before the client received it (one clock). Bounds, not a tolerance: a loaded host only widens them."""
    steps = engine.step_times[-1]
    n = len(steps) - 1
    return (steps[-1] - first_seen) / n, (last_seen - steps[0]) / n


def token_times(events) -> list[float]:
    out = []
    for t, data in events:
        if data != "[DONE]":
            ch = json.loads(data).get("choices") or []
            if any(x.get("text") or (x.get("delta") or {}).get("content") for x in ch):
                out.append(t)
    return out


# --- streaming: the numbers ------------------------------------------------------------------------

def test_streamed_completion_ttft_stages_tpot_e2e_match_what_the_client_measured(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    p.delay_s, d.first_token_s, d.itl_s, d.tokens = 0.20, 0.30, 0.05, 6
    px = proxies([p], [d])
    body = {"model": "m1", "prompt": "hello", "max_tokens": 6, "stream": True}
    r, events, t_sent = stream(px.url + "/v1/completions", body,
                               headers={"X-Request-Id": "rid-1", "Authorization": "Bearer k"})
    t_done = time.perf_counter()
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
    toks = token_times(events)
    assert len(toks) == 6 and events[-1][1] == "[DONE]"
    assert not any('"usage": {' in e for _, e in events)  # the client did not ask for usage: dropped

    # the two legs, as the P/D protocol wants them
    pb, db = p.requests[0], d.requests[0]
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "stream_options" not in pb
    assert pb["kv_transfer_params"] == legs.PREFILL_KV_PARAMS
    assert db["max_tokens"] == 6 and db["stream"] is True and db["stream_options"] == {"include_usage": True}
    assert db["kv_transfer_params"]["remote_engine_id"] == "prefill" and db["kv_transfer_params"]["remote_block_ids"]
    for hs in (p.headers[0], d.headers[0]):
        assert hs["x-request-id"] == "rid-1" and hs["authorization"] == "Bearer k"

    s = scrape(px.url)
    lab = {"model": "m1", "pool": "client", "route": "pd", "router": ROUTER}
    ttft_name, stage_name = c.CLIENT_TTFT.name, c.CLIENT_STAGE.name
    assert value(s, ttft_name + "_count", **lab) == 1
    ttft = value(s, ttft_name + "_sum", **lab)
    client_ttft = toks[0] - t_sent
    assert 0.20 + 0.30 <= ttft <= client_ttft  # same clock: the proxy's TTFT lies inside the client's
    prefill_leg = value(s, stage_name + "_sum", stage="prefill_leg", **lab)
    decode_first = value(s, stage_name + "_sum", stage="decode_first_leg", **lab)
    proxy_stage = value(s, stage_name + "_sum", stage="proxy", **lab)
    assert 0.20 <= prefill_leg < ttft and 0.30 <= decode_first < ttft
    assert proxy_stage == pytest.approx(ttft - prefill_leg - decode_first, abs=1e-9) and proxy_stage >= 0
    assert value(s, stage_name + "_count", **lab) == 3
    # TPOT: (last token - first token) / (completion_tokens - 1), within what the engine and the client saw
    assert value(s, c.CLIENT_TPOT.name + "_count", **lab) == 1
    tpot = value(s, c.CLIENT_TPOT.name + "_sum", **lab)
    lo, hi = tpot_bounds(d, toks[0], toks[-1])
    assert lo <= tpot <= hi, (lo, tpot, hi)
    e2e = value(s, c.CLIENT_E2E.name + "_sum", **lab)
    assert value(s, c.CLIENT_E2E.name + "_count", **lab) == 1
    assert 0.20 + 0.30 + 5 * 0.05 <= e2e <= t_done - t_sent  # prefill, first token, 5 more 50 ms apart, [DONE]
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok", **lab) == 1
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 0
    assert value(s, c.CLIENT_IN_FLIGHT.name, **lab) == 0
    # buckets are the contract's: the TTFT histogram's bounds, and its +Inf count
    bounds = sorted(float(dict(ls)["le"]) for (n, ls), _ in s.items() if n == ttft_name + "_bucket")
    assert bounds == sorted([*c.bucket_override(c.CLIENT_TTFT), float("inf")])


def test_chat_stream_role_chunk_is_not_a_token_and_usage_is_forwarded_when_asked(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    d.first_token_s, d.itl_s, d.tokens = 0.30, 0.01, 3
    px = proxies([p], [d])
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    r, events, _ = stream(px.url + "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["x-request-id"]  # generated when the client sent none
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == r.headers["x-request-id"]
    assert p.requests[0]["max_completion_tokens"] == 1 and d.requests[0]["max_completion_tokens"] == 3
    assert d.requests[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    usage = [json.loads(e)["usage"] for _, e in events if e != "[DONE]" and not json.loads(e)["choices"]]
    assert usage == [{"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}]
    s = scrape(px.url)
    ttft = value(s, c.CLIENT_TTFT.name + "_sum")
    assert ttft >= 0.30  # the role chunk came at once: counting it would give TTFT ~ 0
    assert value(s, c.CLIENT_TPOT.name + "_count") == 1


def test_non_streamed_request_records_e2e_and_outcome_only(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    p.delay_s = d.delay_s = 0.1
    px = proxies([p], [d])
    t_sent = time.perf_counter()
    r = httpx.post(px.url + "/v1/completions", json={"model": "m1", "prompt": "x", "max_tokens": 9}, timeout=10)
    took = time.perf_counter() - t_sent
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world"
    assert "stream_options" not in d.requests[0] and d.requests[0]["kv_transfer_params"]["remote_host"] == "10.0.0.1"
    s = scrape(px.url)
    assert value(s, c.CLIENT_TTFT.name + "_count") == 0 and value(s, c.CLIENT_STAGE.name + "_count") == 0
    assert value(s, c.CLIENT_TPOT.name + "_count") == 0
    assert value(s, c.CLIENT_E2E.name + "_count") == 1
    assert 0.2 <= value(s, c.CLIENT_E2E.name + "_sum") <= took
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok", model="m1") == 1


# --- errors ---------------------------------------------------------------------------------------

def test_engine_error_answers_pass_through_with_their_status_and_body(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    p.status = 400
    r = httpx.post(px.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json() == {"error": {"message": "nope", "code": 400}}
    assert d.requests == []  # no decode after a failed prefill
    p.status = 200
    d.status, d.error = 503, (b"overloaded", "text/plain")
    r = httpx.post(px.url + "/v1/completions", json={"model": "m1", "prompt": "x", "stream": True}, timeout=10)
    assert r.status_code == 503 and r.text == "overloaded" and r.headers["content-type"].startswith("text/plain")
    assert r.headers["x-request-id"]
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error", model="m1") == 1  # the 400
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error", model="m1") == 1  # the 503
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 0
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0
    assert px.proxy.health()["in_flight"] == {"prefill": {p.url: 0}, "decode": {d.url: 0}}


def test_unreachable_engine_is_a_502_naming_the_leg_and_engine(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    dead = f"http://127.0.0.1:{closed_port()}"
    r = httpx.post(proxies([dead], [d]).url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["leg"] == "prefill" and err["engine"] == dead and err["code"] == 502
    px = proxies([p], [dead])
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["leg"] == "decode" and r.json()["error"]["engine"] == dead
    assert value(scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="error") == 1


def test_legs_past_their_deadline(engines, proxies):
    """A prefill slower than --prefill-timeout is a 504 at the deadline; a decode stream that stalls
    mid-way ends at --decode-timeout with an in-stream error event (the 200 is already sent). Each
    deadline is tried on its own proxy: the legs that should pass are not held to a short one."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], prefill_timeout_s=0.4)
    p.delay_s = 5
    t = time.perf_counter()
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 504 and time.perf_counter() - t >= 0.4  # the engine's answer would be a 200 at 5 s
    assert r.json()["error"]["leg"] == "prefill" and r.json()["error"]["engine"] == p.url
    p.delay_s = 0
    d.stall_after, d.tokens, d.stall_s = 2, 5, 4.0
    px2 = proxies([p], [d], decode_timeout_s=2.0)
    t = time.perf_counter()
    r, events, _ = stream(px2.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    assert time.perf_counter() - t >= 2.0
    assert len(token_times(events)) == 2 and events[-1][1] != "[DONE]"  # [DONE] would follow the 4 s stall
    err = json.loads(events[-1][1])["error"]
    assert err["code"] == 504 and err["leg"] == "decode"
    assert d.hung_up.wait(30)  # the stalled engine finds its connection closed when it writes again
    s, s2 = scrape(px.url), scrape(px2.url)
    errors = [value(x, c.CLIENT_REQUESTS.exposed, outcome="error") for x in (s, s2)]
    assert errors == [1, 1]
    assert value(s2, c.CLIENT_TTFT.name + "_count") == 1  # the first token did reach the client
    assert value(s2, c.CLIENT_TPOT.name + "_count") == 0 and value(s2, c.CLIENT_IN_FLIGHT.name) == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_stream_the_engine_ends_without_done_is_an_error_the_client_sees_and_its_engine_is_left_out(
        engines, proxies, monkeypatch, chunked):
    """A decode stream that ends cleanly without ``[DONE]``: a body delimited by the connection's close (HTTP/1.0), or a
    chunked body a hop ended with its last chunk after the engine behind it died. The client got the cut answer with
    no error in it, and the engine, taken as up on its first chunk, kept its share of the next requests. Now it ends
    as a broken stream does: a 502 event, and the engine left out."""
    for name in ("EJECT_S", "EJECT_MAX_S"):  # still out when the test looks, however slow the machine
        monkeypatch.setattr(balance, name, 60.0)
    p, bad, good = engines("prefill"), engines("decode", "bad"), engines("decode", "good")
    bad.send_done, bad.chunked = False, chunked
    px = proxies([p], [bad, good])
    body = {"model": "m", "prompt": "x", "stream": True}
    r, events, _ = stream(px.url + "/v1/completions", body)  # round-robin: bad first
    assert r.status_code == 200 and len(token_times(events)) == 5 and events[-1][1] != "[DONE]"
    err = json.loads(events[-1][1])["error"]
    assert (err["code"], err["type"], err["leg"], err["engine"]) == (502, "upstream_invalid", "decode", bad.url)
    assert set(px.proxy.health()["left_out"]["decode"]) == {bad.url}
    for _ in range(2):
        r, events, _ = stream(px.url + "/v1/completions", body)
        assert r.status_code == 200 and events[-1][1] == "[DONE]"
    assert len(bad.requests) == 1 and len(good.requests) == 2
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1 and value(s, c.CLIENT_REQUESTS.exposed) == 3
    assert value(s, c.CLIENT_TTFT.name + "_count") == 3 and value(s, c.CLIENT_TPOT.name + "_count") == 2


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("cut", ["length", "close"])
def test_a_whole_answer_cut_short_is_a_502_and_its_engine_is_left_out(engines, proxies, monkeypatch, leg, cut):
    """A 200 whose JSON body the engine's death cut in half. Under its Content-Length httpx sees the body unfinished;
    without one (HTTP/1.0, or a hop that ended it cleanly) the body just ends. Then a decode answer was relayed as a
    200 and counted ok, and a prefill answer was a 502 that left the engine in, to cut the next answers too."""
    for name in ("EJECT_S", "EJECT_MAX_S"):
        monkeypatch.setattr(balance, name, 60.0)
    bad, good = engines(leg, "bad"), engines(leg, "good")
    bad.cut_body = cut
    other = engines("decode" if leg == "prefill" else "prefill")
    px = proxies(*(([bad, good], [other]) if leg == "prefill" else ([other], [bad, good])))
    body = {"model": "m", "prompt": "x"}
    r = httpx.post(px.url + "/v1/completions", json=body, timeout=10)  # round-robin: bad first
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert (err["leg"], err["engine"]) == (leg, bad.url) and err["type"] in ("upstream_invalid", "upstream_unreachable")
    assert set(px.proxy.health()["left_out"][leg]) == {bad.url}
    for _ in range(2):
        assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).json()["choices"]
    assert len(bad.requests) == 1 and len(good.requests) == 2
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1 and value(s, c.CLIENT_REQUESTS.exposed) == 3


def test_streamed_errors_are_counted_once_as_misses_of_the_indicator_they_left_unobserved(engines, proxies):
    """Which client-scope counter a failed request lands in: a streamed request the service failed before its
    first token (every engine 503, a failed leg) is in no TTFT histogram and counts as failed before the first
    token; one cut after its first token has a TTFT (observed, not counted again) and no TPOT, and counts as
    failed after it. Not counted: a non-streamed error (no TTFT is observed for those at all), the client's own
    4xx, ok streams."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    body = {"model": "m", "prompt": "x", "stream": True}
    before, after = c.CLIENT_FAILED_BEFORE_FIRST_TOKEN.exposed, c.CLIENT_FAILED_AFTER_FIRST_TOKEN.exposed
    p.status, p.error = 503, VLLM_503
    assert stream(px.url + "/v1/completions", body)[0].status_code == 503  # streamed, refused: TTFT miss
    s = scrape(px.url)
    assert (value(s, before), value(s, after)) == (1, 0)
    # the histogram a miss is added to exists (at zero) though no request got a first token yet
    assert (c.CLIENT_TTFT.name + "_count", frozenset({("model", "m"), ("pool", "client"), ("route", "pd"),
                                                      ("router", ROUTER)})) in s
    assert httpx.post(px.url + "/v1/completions", json={**body, "stream": False}, timeout=10).status_code == 503
    p.status = 400  # the client's own mistake
    assert stream(px.url + "/v1/completions", body)[0].status_code == 400
    p.status = 200
    px.proxy.prefill.answered(p.url)  # back in at once, whatever the 503s left
    d.die_after = 1  # one token, then the decode engine's connection is cut: a 502 event mid-stream
    r, events, _ = stream(px.url + "/v1/completions", body)
    assert r.status_code == 200 and len(token_times(events)) == 1 and json.loads(events[-1][1])["error"]["code"] == 502
    d.die_after = None
    px.proxy.decode.answered(d.url)
    assert stream(px.url + "/v1/completions", body)[1][-1][1] == "[DONE]"
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 3
    assert (value(s, before), value(s, after)) == (1, 1)
    assert value(s, c.CLIENT_TTFT.name + "_count") == 2 and value(s, c.CLIENT_TPOT.name + "_count") == 1


def test_the_guard_judges_client_attainment_by_what_the_client_got_not_only_by_the_tokens_it_saw(engines, proxies):
    """Half the streamed requests refused with 503 by every prefill engine, scraped through the real Scraper and
    judged by the real evaluator: client TTFT attainment read 100 % "ok" (5 of 5 observed in time) while half
    the clients got an error. Now it reads 50 % and violated; streams cut after their first token leave TTFT
    as observed (in time, counted once) and are TPOT attainment misses, on the store and in a one-shot check
    (LifetimeView) alike."""
    from sla_guard.ingest.lifetime import LifetimeView
    from sla_guard.model import Status

    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    rig = client_rig(px, [
        {"name": f"{ind}_att", "indicator": ind, "objective": "attainment", "threshold_s": thr, "target": 0.99,
         # TPOT at 0.5 s, not 20 ms: the stand-in's tokens are ms apart, but not on a loaded machine
         "min_requests": 4} for ind, thr in (("ttft", 2.5), ("tpot", 0.5))])
    try:
        rig.scrape()
        rig.judge("m", "client")
        for i in range(10):  # every other request refused (503) by the only prefill engine
            p.status, p.error = (503, VLLM_503) if i % 2 else (200, p.error)
            px.proxy.prefill.answered(p.url)
            stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        p.status = 200
        px.proxy.prefill.answered(p.url)
        rig.scrape(15)
        rig.judge("m", "client")
        for view in (rig.store, LifetimeView(rig.store)):
            got = rig.slos("m", "client", view)
            assert got["ttft_att"].value == pytest.approx(0.5) and got["ttft_att"].requests == 10, view
            assert got["ttft_att"].status is Status.VIOLATED, (got["ttft_att"].reason, view)
            assert "5 requests failed by the service before their first token" in got["ttft_att"].reason
            assert got["tpot_att"].status is Status.OK and got["tpot_att"].value == 1.0
        for i in range(10):  # every other stream cut after its first token
            d.die_after = 1 if i % 2 else None
            px.proxy.decode.answered(d.url)
            stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        rig.scrape(15)
        got = rig.slos("m", "client")
        # the cut streams' TTFTs were in time and count once each: 15 of 15 + 5 refused; TPOT: 10 of 10 + 5 cut
        assert got["ttft_att"].value == pytest.approx(15 / 20) and got["ttft_att"].requests == 20
        assert got["tpot_att"].value == pytest.approx(10 / 15) and got["tpot_att"].requests == 15
        assert got["tpot_att"].status is Status.VIOLATED and "after their first token" in got["tpot_att"].reason
    finally:
        rig.close()


VLLM_500 = (json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root "
                                              "cause.", "type": "InternalServerError", "param": None,
                                   "code": 500}}).encode(), "application/json")  # vLLM's EngineDeadError answer


def test_non_streamed_requests_the_service_failed_spend_an_availability_error_budget(engines, proxies):
    """Every non-streamed request fails (the decode engine answers it 500, as vLLM does once its engine core is
    dead) while every streamed one is served in time. Scraped through the real Scraper and judged by the real
    evaluator, the client scope read "ok": a non-streamed request observes no TTFT, so its errors reached no
    objective. The availability objective (requests failed / requests answered or failed) reads 50 % and
    violated, on the store and in a one-shot check (LifetimeView) alike; the client's own 4xx (a body that is
    not JSON) is counted in neither its failures nor its requests."""
    from sla_guard.commands.check import render_table
    from sla_guard.ingest.lifetime import LifetimeView
    from sla_guard.model import Status

    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    d.whole_status, d.error = 500, VLLM_500
    rig = client_rig(px, [
        {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "min_requests": 4},
        {"name": "ttft_att", "indicator": "ttft", "objective": "attainment", "threshold_s": 2.5,
         "target": 0.99, "min_requests": 4},
        {"name": "avail", "indicator": "availability", "objective": "attainment", "target": 0.999,
         "min_requests": 4}])
    try:
        rig.scrape()
        rig.judge("m", "client")
        body = {"model": "m", "prompt": "x"}
        for _ in range(10):
            assert stream(px.url + "/v1/completions", {**body, "stream": True})[1][-1][1] == "[DONE]"
            assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).status_code == 500
            px.proxy.decode.answered(d.url)
        assert httpx.post(px.url + "/v1/completions", content=b"not json", timeout=10).status_code == 400
        rig.scrape(15)
        rig.judge("m", "client")
        for view in (rig.store, LifetimeView(rig.store)):
            got = rig.slos("m", "client", view)
            assert got["ttft_mean"].status is Status.OK and got["ttft_att"].status is Status.OK  # what it read before
            assert got["avail"].value == pytest.approx(0.5) and got["avail"].requests == 10 + 10, view
            assert got["avail"].status is Status.VIOLATED, (got["avail"].reason, view)
            assert "10 of 20 requests failed by the service" in got["avail"].reason
            assert rig.ev.pools[("m", "client")].status is Status.VIOLATED
        assert got["avail"].period_requests == 20 and got["avail"].budget_remaining == pytest.approx(1 - 0.5 / 0.001)
        row = next(line for line in render_table(rig.ev.snapshot()).splitlines() if " avail " in line)
        assert "99.9% availability" in row and "50.00%" in row and "violated" in row, row
    finally:
        rig.close()


def test_client_leaving_mid_stream_is_aborted_and_closes_the_decode_stream(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    d.itl_s, d.tokens = 0.05, 400  # 20 s of tokens unless the proxy hangs up
    px = proxies([p], [d])
    seen = 0
    with httpx.stream("POST", px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                      timeout=10) as r:
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break  # leaving the block closes the connection
    assert d.hung_up.wait(10), "the decode engine never saw the proxy hang up"
    deadline = time.monotonic() + 30
    while value(s := scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="aborted") < 1:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 0
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0 and value(s, c.CLIENT_E2E.name + "_count") == 0
    assert value(s, c.CLIENT_TTFT.name + "_count") == 1
    assert px.proxy.health()["in_flight"]["decode"] == {d.url: 0}
    assert px.proxy.health()["left_out"]["decode"] == {}  # the client left: nothing against the engine


def test_bad_bodies_are_400_and_413(engines, proxies):
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], max_body_bytes=1000)
    r = httpx.post(px.url + "/v1/completions", content=b"{not json", timeout=5)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(px.url + "/v1/chat/completions", content=b"[1, 2]", timeout=5)
    assert r.status_code == 400
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x" * 2000}, timeout=5)
    assert r.status_code == 413
    chunks = (b"{" if i == 0 else b" " * 100 for i in range(20))  # no Content-Length: counted as it comes
    r = httpx.post(px.url + "/v1/completions", content=chunks, timeout=5)
    assert r.status_code == 413
    assert p.requests == [] and d.requests == []
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error", model="unknown") == 4
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 0


def test_the_clients_own_4xx_is_client_error_not_an_error_of_the_service(engines, proxies):
    """A request the engine refuses as malformed, a prompt over max_model_len, an unknown model, or
    a body the proxy itself refuses (400 not JSON, 413) used to be counted outcome="error": the
    client's mistakes burned the operator's error budget. They are client_error now, on either leg,
    streamed or not; 429 (the service refusing load), 408 and 5xx stay errors."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], max_body_bytes=10_000)
    too_long = (b'{"object": "error", "message": "This model\'s maximum context length is 2048 tokens. However, '
                b'you requested 4096 tokens (1000 in the messages, 3096 in the completion).", '
                b'"type": "BadRequestError", "param": null, "code": 400}', "application/json")
    cases = [  # (engine that answers, status, streamed, outcome)
        (p, 400, False, "client_error"),  # prompt over max_model_len
        (p, 404, True, "client_error"),  # no such model
        (d, 400, True, "client_error"),  # prompt + max_tokens over max_model_len: only decode sees max_tokens
        (d, 422, False, "client_error"),
        (p, 429, False, "error"),  # rate limited / overloaded: the service refusing load
        (d, 429, True, "error"),
        (p, 408, False, "error"),  # the engine waited for the proxy's request, not for the client's
        (d, 500, False, "error"),
        (p, 503, True, "error"),
    ]
    want = {"client_error": 0, "error": 0}
    for eng, status, streamed, outcome in cases:
        eng.status, eng.error = status, too_long
        r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": streamed},
                       timeout=10)
        assert r.status_code == status and r.content == too_long[0]  # passed through as it came
        eng.status = 200
        want[outcome] += 1
        s = scrape(px.url)
        got = {o: value(s, c.CLIENT_REQUESTS.exposed, outcome=o, model="m") for o in want}
        assert got == want, (eng.role, status, streamed)
    # the proxy's own refusals of a bad body
    assert httpx.post(px.url + "/v1/completions", content=b"{oops", timeout=5).status_code == 400
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x" * 20_000},
                      timeout=5).status_code == 413
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5).status_code == 200
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error") == 4 + 2
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 5
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 1
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0
    # every outcome the proxy records is one the contract defines
    assert {dict(ls)["outcome"] for (n, ls), _ in s.items() if n == c.CLIENT_REQUESTS.exposed} <= set(c.Outcome)


def test_client_ttft_ends_when_the_token_is_handed_to_the_connection_not_when_a_slow_client_reads_it(
        engines, proxies):
    """A client that does not read yet, on a link whose socket buffers are small (a real network's,
    not loopback's autotuned MBs): the stream's first chunk (vLLM's chat role chunk carrying the
    prompt's token ids, hundreds of KB for a long prompt) fills them, and uvicorn's send() of the next
    event waits for the client to drain it. TTFT was stamped after that send returned, so it held the
    client's reading time; it ends when the first token is handed to the connection now."""
    p, d = engines("prefill"), engines("decode")
    d.tokens = 3
    d.first_chunk_extra = {"prompt_token_ids": [151644] * 40_000}  # ~320 KB, no generated text
    px = proxies([p], [d])
    # accepted connections inherit the listener's send buffer: 16 KB, not autotuned up to MBs
    px.server.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", px.port))
        sock.sendall(head + body)
        # the client reads nothing for 1.5 s, and on until the proxy has its TTFT (30 s at most)
        time.sleep(1.5)
        deadline = time.monotonic() + 30
        while (seen := value(scrape(px.url), c.CLIENT_TTFT.name + "_count")) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        reading = time.perf_counter()
        sock.settimeout(10)
        got = bytearray()
        while chunk := sock.recv(1 << 20):
            got += chunk
    assert seen == 1, "no TTFT while the client had read nothing: it would hold the client's reading time"
    assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got and got.count(b'"content": "t') == 3
    deadline = time.monotonic() + 30
    while value(s := scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="ok") < 1:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    # the proxy did wait for the client: its last byte went out once the client was reading (it arrived
    # before the decode engine wrote its first token)
    assert value(s, c.CLIENT_E2E.name + "_sum") >= reading - d.step_times[-1][0]
    ttft = value(s, c.CLIENT_TTFT.name + "_sum")
    assert value(s, c.CLIENT_TTFT.name + "_count") == 1
    stages = sum(value(s, c.CLIENT_STAGE.name + "_sum", stage=st.value) for st in c.Stage)
    assert stages == pytest.approx(ttft, abs=1e-6)


def test_a_client_reading_late_does_not_push_the_decode_leg_past_its_deadline(engines, proxies):
    """The decode deadline ran on while the proxy waited for a slow client to take what it had handed over:
    an engine that had finished its stream at once, behind a client that began reading after the deadline,
    got a 504 "decode leg passed its deadline" event in mid-answer (1 token of 3, no ``[DONE]``), counted as the
    service's error. Only the time the proxy waits for the engine counts now, against the deadline and against
    the stall bound alike: the engine that waited on the client is not left out."""
    p, d = engines("prefill"), engines("decode")
    d.tokens, d.first_token_s = 3, 0.3  # the tokens come once the proxy waits for the client, not with the first chunk
    d.first_chunk_extra = {"prompt_token_ids": [151644] * 40_000}  # ~320 KB: fills the small socket buffers
    # the engine's part (its 0.3 s, and on a loaded host the waits for a CPU) must fit the deadline and the stall
    # bound with room; the client waits past both
    px = proxies([p], [d], decode_timeout_s=3.0, decode_stall_timeout_s=2.0)
    px.server.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", px.port))
        sock.sendall(head + body)
        time.sleep(4.0)  # the client reads nothing until the 3 s decode deadline is past
        sock.settimeout(10)
        got = bytearray()
        while chunk := sock.recv(1 << 20):
            got += chunk
    assert b"data: [DONE]" in got and got.count(b'"content": "t') == 3 and b"upstream_timeout" not in got
    deadline = time.monotonic() + 30
    while value(s := scrape(px.url), c.CLIENT_REQUESTS.exposed) < 1:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 1 and value(s, c.CLIENT_TPOT.exposed + "_count") == 1
    assert px.proxy.health()["left_out"]["decode"] == {}


# --- labels, balancing, robustness ----------------------------------------------------------------

def test_model_label_is_bounded(engines, proxies, caplog):
    """Past --max-models (LoRA adapters requested by name) models are counted as "other"; the
    operator saw a pool "other" at the guard and nothing saying why: one warning names the flag."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], max_models=2)
    with caplog.at_level(logging.WARNING, logger="pd_proxy.metrics"):
        for m in ("a", "b", "c", "a", "d", None):
            body = {"prompt": "x"} if m is None else {"model": m, "prompt": "x"}
            assert httpx.post(px.url + "/v1/completions", json=body, timeout=5).status_code == 200
    s = scrape(px.url)
    by_model: dict[str, float] = {}
    for (n, ls), v in s.items():
        if n == c.CLIENT_REQUESTS.exposed:  # every outcome (ok and error exist from a model's first request)
            by_model[dict(ls)["model"]] = by_model.get(dict(ls)["model"], 0.0) + v
    assert by_model == {"a": 2, "b": 1, "other": 2, "unknown": 1}
    warned = [r.getMessage() for r in caplog.records if "--max-models" in r.getMessage()]
    assert len(warned) == 1 and "'c'" in warned[0] and "2" in warned[0], warned  # once, not per request


def test_engine_pool_policies():
    rr = EnginePool(["u1", "u2", "u3"], "round-robin")
    held = [rr.acquire() for _ in range(4)]
    assert [h.url for h in held] == ["u1", "u2", "u3", "u1"]
    ll = EnginePool(["u1", "u2", "u3"], "least-loaded")
    a, b = ll.acquire(), ll.acquire()
    assert (a.url, b.url) == ("u1", "u2")
    b.release()
    b.release()  # idempotent
    assert ll.in_flight() == {"u1": 1, "u2": 0, "u3": 0}
    assert [ll.acquire().url for _ in range(3)] == ["u3", "u2", "u3"]  # least loaded, ties in turn


def test_least_loaded_sends_around_a_busy_decode_engine(engines, proxies):
    p, d1, d2 = engines("prefill"), engines("decode", "d1"), engines("decode", "d2")
    d1.itl_s = d2.itl_s = 0.05
    d1.tokens = d2.tokens = 1200  # 60 s streams: d1 still streams, however slow the short requests are
    px = proxies([p], [d1, d2], policy="least-loaded")
    with httpx.stream("POST", px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                      timeout=60) as long:
        deadline = time.monotonic() + 30
        while px.proxy.health()["in_flight"]["decode"][d1.url] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):  # short requests while d1 streams: all to d2
            assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                              timeout=10).status_code == 200
        assert long.status_code == 200 and px.proxy.health()["in_flight"]["decode"][d1.url] == 1
    assert len(d1.requests) == 1 and len(d2.requests) == 3


# --- engines that are down, stuck or refusing load -------------------------------------------------

VLLM_503 = (json.dumps({"error": {"message": "The engine is currently busy and cannot accept new requests. Please "
                                              "try again later or on a different instance.",
                                   "type": "Service Unavailable", "param": None, "code": 503}}).encode(),
            "application/json")  # vLLM 0.32's QueueOverflowError (--max-num-queued-reqs), raised before admission


class HungEngine:
    """Accepts connections and never answers (an engine stuck, or paused / asleep with requests queued)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.accepted: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_engine_pool_leaves_a_failed_engine_out_and_takes_it_back():
    now = [0.0]
    pool = EnginePool(["u1", "u2"], "round-robin", clock=lambda: now[0])
    pool.failed("u1", "refused")
    pool.failed("u1", "refused")  # another call of the same outage: counted once
    assert pool.ejected() == {"u1": 1.0}
    leases = [pool.acquire() for _ in range(3)]
    assert [x.url for x in leases] == ["u2", "u2", "u2"] and not pool.another(["u2"])
    for x in leases:
        x.release()
    now[0] = 1.0  # its time out is over: one request at a time tries it again
    probe = pool.acquire()
    assert pool.ejected() == {} and probe.url == "u1"
    assert [pool.acquire().url for _ in range(3)] == ["u2", "u2", "u2"]  # a hung engine holds one request, not 1/2
    probe.release()  # the client left: no verdict, the next request tries it
    assert pool.acquire().url == "u1"
    pool.failed("u1", "refused again")  # failed again: out twice as long
    assert pool.ejected() == {"u1": 2.0}
    pool.answered("u1")  # any answer but 503: back at once, and the next failure starts over
    assert pool.ejected() == {}
    for _ in range(10):
        now[0] += 100
        pool.failed("u1", "down")
    assert pool.ejected() == {"u1": balance.EJECT_MAX_S}
    pool.failed("u2", "down")  # the whole pool out: an engine is still chosen, its own error goes to the client
    assert pool.acquire().url in ("u1", "u2") and not pool.another([])
    assert pool.acquire(tried=["u1"]).url == "u2"


def test_engine_pool_health_probe_verdicts():
    """A failed /health holds an engine out past its time out until a 200; a 200 ends no time out real traffic set,
    and resets no failure count; a real answer lifts the hold; a /health that says nothing (404) changes nothing."""
    now = [0.0]
    pool = EnginePool(["u1", "u2"], "round-robin", clock=lambda: now[0])
    pool.probe_failed("u1", "ConnectError")
    now[0] = 5.0  # its 1 s is long over: still held
    assert pool.ejected() == {"u1": 0.0} and [pool.acquire().url for _ in range(2)] == ["u2", "u2"]
    assert pool.probes() == {"u1": {"state": "down", "detail": "ConnectError", "age_s": 5.0}}
    pool.probe_ok("u1")
    assert pool.ejected() == {} and pool.acquire().url == "u1"  # the next request tries it (one at a time)
    pool.failed("u1", "stalled")  # real traffic: 2nd failure in a row, out 2 s
    assert pool.ejected() == {"u1": 2.0}
    pool.probe_ok("u1")  # /health 200 while it stalls: the time out stands
    assert pool.ejected() == {"u1": 2.0}
    pool.probe_unknown("u2", "answered 404")
    assert pool.probes()["u2"]["state"] == "unknown" and "u2" not in pool.ejected()
    now[0] = 100.0
    pool.probe_failed("u2", "answered 503")
    pool.answered("u2")  # a request it was tried with anyway (the pool out) was answered: real traffic outranks
    assert "u2" not in pool.ejected()


def test_an_engine_refusing_connections_is_left_out_and_its_requests_served_by_another(engines, proxies, monkeypatch):
    """One engine of each pool down (connection refused, as while vLLM loads): half the requests were 502s,
    for as long as it stayed down. Now the call moves to another engine and the dead one is left out."""
    for name in ("EJECT_S", "EJECT_MAX_S"):  # still out when the test looks, however slow the machine
        monkeypatch.setattr(balance, name, 60.0)
    p, d = engines("prefill"), engines("decode")
    dead_p, dead_d = f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{closed_port()}"
    px = proxies([dead_p, p], [dead_d, d])
    for i in range(10):
        body = {"model": "m", "prompt": "x", "stream": i % 2 == 0}
        r = httpx.post(px.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
    assert len(p.requests) == len(d.requests) == 10
    kv = json.loads(json.dumps(d.requests[0]["kv_transfer_params"]))
    assert kv == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill",
                  "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600}  # as prefill answered
    left_out = px.proxy.health()["left_out"]
    assert set(left_out["prefill"]) == {dead_p} and set(left_out["decode"]) == {dead_d}
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 10 and value(s, c.CLIENT_REQUESTS.exposed) == 10


def test_an_engine_answering_503_is_tried_no_more_and_the_time_lost_stays_in_the_ttft(engines, proxies):
    """vLLM's admission control answers 503 "try again on a different instance" before it starts the request:
    the client got that 503 while another engine was idle. Now the leg moves on (prefill and decode alike, the
    client has seen nothing yet), and the time the 503 cost is in the client's TTFT and the leg's stage."""
    busy_p, p = engines("prefill", "busy-p"), engines("prefill")
    busy_d, d = engines("decode", "busy-d"), engines("decode")
    for e in (busy_p, busy_d):
        e.status, e.error, e.delay_s = 503, VLLM_503, 0.3
    px = proxies([busy_p, p], [busy_d, d])
    r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 200 and events[-1][1] == "[DONE]"
    assert [len(e.requests) for e in (busy_p, p, busy_d, d)] == [1, 1, 1, 1]
    assert d.requests[0]["kv_transfer_params"]["remote_engine_id"] == "prefill"
    s = scrape(px.url)
    stage = c.CLIENT_STAGE.name + "_sum"
    assert value(s, stage, stage="prefill_leg") >= 0.3 and value(s, stage, stage="decode_first_leg") >= 0.3
    assert value(s, c.CLIENT_TTFT.name + "_sum") >= 0.6 and value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 1
    # every engine refusing: the client gets the last one's 503 as it came, an error of the service
    other = engines("prefill", "busy-p2")
    other.status, other.error = 503, VLLM_503
    px = proxies([busy_p, other], [d])
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.content == VLLM_503[0] and len(other.requests) == 1
    assert value(scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="error") == 1


def test_an_engine_that_never_answers_is_left_out_after_one_deadline(engines, proxies, monkeypatch):
    """A prefill engine that accepts and never answers: every other request waited the whole prefill
    deadline for a 504. Now one request does (its deadline is spent, no time is left to move it) and the
    next ones go to the engine that answers."""
    for name in ("EJECT_S", "EJECT_MAX_S"):
        monkeypatch.setattr(balance, name, 60.0)
    hung, p, d = HungEngine(), engines("prefill"), engines("decode")
    try:
        px = proxies([hung.url, p], [d], prefill_timeout_s=0.5)
        codes = [httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10).status_code
                 for _ in range(6)]
        assert codes == [504, 200, 200, 200, 200, 200] and len(hung.accepted) == 1
        assert set(px.proxy.health()["left_out"]["prefill"]) == {hung.url}
    finally:
        hung.close()


def test_an_engine_left_out_comes_back_once_it_answers(engines, proxies):
    port = closed_port()
    p, d = engines("prefill"), engines("decode")
    px = proxies([f"http://127.0.0.1:{port}", p], [d])
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10).status_code == 200
    assert list(px.proxy.health()["left_out"]["prefill"]) == [f"http://127.0.0.1:{port}"]
    back = engines("prefill", "back", port=port)  # the engine has restarted
    deadline = time.monotonic() + 10 * balance.EJECT_S
    while not back.requests:
        assert time.monotonic() < deadline, "the engine that came back got no request"
        assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10).status_code == 200
        time.sleep(0.05)
    assert px.proxy.health()["left_out"]["prefill"] == {}


@pytest.mark.parametrize("stall_after", [0, 2], ids=["after_headers", "after_chunks"])
def test_a_decode_stream_that_stalls_ends_with_an_error_and_its_engine_is_left_out(
        engines, proxies, monkeypatch, stall_after):
    """A decode engine that sent its 200 (vLLM sends it before the first token) or some chunks, then nothing: the
    client waited the whole decode deadline (600 s by default) for a 504 event, and the engine kept its share of the
    next requests. Now a silence past --decode-stall-timeout (before the first chunk: --prefill-timeout, if longer)
    ends the stream with an error event and leaves the engine out, as a hung engine is."""
    for name in ("EJECT_S", "EJECT_MAX_S"):  # still out when the test looks, however slow the machine
        monkeypatch.setattr(balance, name, 60.0)
    p, bad, good = engines("prefill"), engines("decode", "bad"), engines("decode", "good")
    bad.stall_after, bad.stall_s = stall_after, 5.0  # without a stall bound the stream resumes and ends ok
    px = proxies([p], [bad, good], prefill_timeout_s=0.5, decode_stall_timeout_s=0.5, decode_timeout_s=10.0)
    r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 200 and len(token_times(events)) == stall_after and events[-1][1] != "[DONE]"
    err = json.loads(events[-1][1])["error"]
    assert (err["code"], err["type"], err["leg"], err["engine"]) == (504, "upstream_timeout", "decode", bad.url)
    assert "stalled" in err["message"]
    assert set(px.proxy.health()["left_out"]["decode"]) == {bad.url}
    assert bad.hung_up.wait(10)  # the stalled stream was closed: vLLM aborts the request
    for _ in range(3):
        r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200 and events[-1][1] == "[DONE]"
    assert len(bad.requests) == 1 and len(good.requests) == 3
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1 and value(s, c.CLIENT_REQUESTS.exposed) == 4
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0 and px.proxy.health()["in_flight"]["decode"][bad.url] == 0


def test_a_stalling_decode_engine_is_probed_by_one_request_at_a_time_and_left_out_longer(
        engines, proxies, monkeypatch, caplog):
    """The 200 of a stream is no sign that the engine is up: vLLM sends it before the first token. Taken as one, the
    probing request's 200 brought a stalled engine back at once (every request after it went there again, to stall),
    and its next stall counted as a first failure (1 s out, never doubled)."""
    monkeypatch.setattr(balance, "EJECT_S", 0.2)
    monkeypatch.setattr(balance, "EJECT_MAX_S", 60.0)
    p, bad, good = engines("prefill"), engines("decode", "bad"), engines("decode", "good")
    bad.stall_after, bad.stall_s = 0, 8.0
    px = proxies([p], [bad, good], prefill_timeout_s=2.0, decode_stall_timeout_s=2.0, decode_timeout_s=30.0)
    body = {"model": "m", "prompt": "x", "stream": True}
    with caplog.at_level(logging.WARNING, logger="pd_proxy"):
        assert "stalled" in stream(px.url + "/v1/completions", body)[1][-1][1]  # round-robin: bad first
        assert stream(px.url + "/v1/completions", body)[1][-1][1] == "[DONE]"  # good; bad is next in turn
        deadline = time.monotonic() + 10
        while px.proxy.health()["left_out"]["decode"]:  # its time out is over: the next request probes it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        box: list = []
        probe = threading.Thread(target=lambda: box.append(stream(px.url + "/v1/completions", body)))
        probe.start()
        while px.proxy.health()["in_flight"]["decode"][bad.url] != 1:  # its 200 came, it stalls now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):  # while the probe runs, the other requests stay off the engine
            assert stream(px.url + "/v1/completions", body)[1][-1][1] == "[DONE]"
        probe.join(15)
    assert len(bad.requests) == 2 and len(good.requests) == 4
    assert "stalled" in box[0][1][-1][1]
    fails = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(f"engine {bad.url} left out")]
    assert len(fails) == 2 and "2 failure(s) in a row" in fails[1], fails


def test_a_decode_stream_that_breaks_mid_way_leaves_its_engine_out(engines, proxies, monkeypatch):
    """A decode engine whose process died mid-stream (its connection closed with the chunked body unfinished): the
    client got its 502 event, and the engine kept its share of the next requests, each broken the same way. Now it
    is left out as a refusing engine is (a client that leaves mid-stream is not: see the test above that)."""
    for name in ("EJECT_S", "EJECT_MAX_S"):  # still out when the test looks, however slow the machine
        monkeypatch.setattr(balance, name, 60.0)
    p, bad, good = engines("prefill"), engines("decode", "bad"), engines("decode", "good")
    bad.die_after = 2  # it still accepts: only the ejection keeps the next requests away
    px = proxies([p], [bad, good])
    body = {"model": "m", "prompt": "x", "stream": True}
    r, events, _ = stream(px.url + "/v1/completions", body)  # round-robin: bad first
    assert r.status_code == 200 and len(token_times(events)) == 2 and events[-1][1] != "[DONE]"
    err = json.loads(events[-1][1])["error"]
    assert (err["code"], err["type"], err["leg"], err["engine"]) == (502, "upstream_unreachable", "decode", bad.url)
    assert "RemoteProtocolError" in err["message"]
    assert set(px.proxy.health()["left_out"]["decode"]) == {bad.url}
    for _ in range(3):
        r, events, _ = stream(px.url + "/v1/completions", body)
        assert r.status_code == 200 and events[-1][1] == "[DONE]"
    assert len(bad.requests) == 1 and len(good.requests) == 3
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1 and value(s, c.CLIENT_REQUESTS.exposed) == 4


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_a_whole_answer_silent_after_its_headers_is_a_stall_and_its_engine_is_left_out(
        engines, proxies, monkeypatch, caplog, leg):
    """A non-streamed answer (prefill's, or decode's) whose headers came, then nothing: the client waited out the whole
    leg deadline (decode: 600 s) for a 504 and the engine, taken as up on its headers, kept its share. vLLM sends a
    whole answer's headers with its body: silence past --decode-stall-timeout is a stalled engine, left out, and a
    200 whose body never comes does not bring it back (its next stall is the 2nd failure in a row, out longer)."""
    monkeypatch.setattr(balance, "EJECT_S", 0.2)
    monkeypatch.setattr(balance, "EJECT_MAX_S", 60.0)
    bad, good = engines(leg, "bad"), engines(leg, "good")
    bad.stall_after, bad.stall_s = 0, 5.0  # without a stall bound the body comes after 5 s and the answer is a 200
    other = engines("decode" if leg == "prefill" else "prefill")
    pools = ([bad, good], [other]) if leg == "prefill" else ([other], [bad, good])
    px = proxies(*pools, prefill_timeout_s=10.0, decode_timeout_s=10.0, decode_stall_timeout_s=0.5)
    body = {"model": "m", "prompt": "x"}
    with caplog.at_level(logging.WARNING, logger="pd_proxy"):
        r = httpx.post(px.url + "/v1/completions", json=body, timeout=30)  # round-robin: bad first
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert (err["type"], err["leg"], err["engine"]) == ("upstream_timeout", leg, bad.url)
        assert "stalled" in err["message"]
        deadline = time.monotonic() + 30
        while len(bad.requests) < 2:  # good meanwhile; once its time out is over, one request tries bad again
            assert time.monotonic() < deadline, "the stalled engine was never tried again"
            assert httpx.post(px.url + "/v1/completions", json=body, timeout=30).status_code in (200, 504)
    fails = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(f"engine {bad.url} left out")]
    assert len(fails) == 2 and "2 failure(s) in a row" in fails[1], fails
    assert value(scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="error") == 2


def test_health_probes_leave_a_hung_engine_out_before_a_request_waits_on_it(engines, proxies):
    """Passive ejection alone: the first request sent to an engine that hangs waits out its whole deadline. With
    --health-interval, a /health that gives no answer within --health-timeout leaves the engine out before any request
    goes there. Each engine has its own probe: one that hangs holds up no other's. A /health that says neither up nor
    down (404: not served there) is no verdict."""
    hung, p, good, other = HungEngine(), engines("prefill"), engines("decode", "good"), engines("decode", "other")
    other.health_status = 404
    try:
        px = proxies([p], [hung.url, good, other], health_interval_s=0.1, health_timeout_s=0.5, decode_timeout_s=5.0)
        deadline = time.monotonic() + 30
        while hung.url not in px.proxy.health()["left_out"]["decode"] or good.health_gets < 3:
            assert time.monotonic() < deadline, px.proxy.health()
            time.sleep(0.05)
        probes = px.proxy.health()["probes"]["decode"]
        assert probes[hung.url]["state"] == "down" and "no answer" in probes[hung.url]["detail"]
        assert probes[good.url]["state"] == "up" and px.proxy.health()["probes"]["interval_s"] == 0.1
        for i in range(6):  # without the probes, round-robin sends the first of these to the hung engine: a 504
            r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": i % 2 == 0},
                           timeout=30)
            assert r.status_code == 200 and "error" not in r.text, r.text
        assert len(good.requests) == len(other.requests) == 3  # none went to the hung engine
        assert px.proxy.health()["probes"]["decode"][other.url]["state"] == "unknown"
        assert set(px.proxy.health()["left_out"]["decode"]) == {hung.url}
    finally:
        hung.close()


def test_health_probes_find_a_dead_engine_and_its_return(engines, proxies, monkeypatch):
    """An engine whose server stops is left out by its refused /health; one whose engine core died (vLLM's /health:
    503, while its API server still takes requests) too, and no request goes there, however short its time out: it
    is held out until /health answers 200. Each comes back then, once a request it is tried with is answered."""
    for name in ("EJECT_S", "EJECT_MAX_S"):  # over long before the next probe: only the hold keeps them out
        monkeypatch.setattr(balance, name, 0.01)
    p, d1, d2, d3 = engines("prefill"), engines("decode", "d1"), engines("decode", "d2"), engines("decode", "d3")
    px = proxies([p], [d1, d2, d3], health_interval_s=0.5, health_timeout_s=2.0)
    port = int(d1.url.rsplit(":", 1)[1])
    d1.close()  # the engine dies
    d2.health_status = 503  # vLLM: EngineDeadError
    deadline = time.monotonic() + 30
    while {u for u, pr in px.proxy.health()["probes"]["decode"].items() if pr["state"] == "down"} != {d1.url, d2.url}:
        assert time.monotonic() < deadline, px.proxy.health()
        time.sleep(0.05)
    probes = px.proxy.health()["probes"]["decode"]
    assert (probes[d2.url]["state"], probes[d2.url]["detail"]) == ("down", "answered 503")
    assert probes[d3.url]["state"] == "up"
    assert set(px.proxy.health()["left_out"]["decode"]) == {d1.url, d2.url}  # held, their time outs long over
    for _ in range(4):
        assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30).status_code == 200
    assert len(d3.requests) == 4 and not d2.requests  # without the probes, d2 took its share (vLLM: 500s)
    back = engines("decode", "back", port=port)  # restarted
    d2.health_status = 200
    while not (back.requests and d2.requests) or px.proxy.health()["left_out"]["decode"]:
        assert time.monotonic() < deadline, (px.proxy.health(), len(back.requests), len(d2.requests))
        assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30).status_code == 200
        time.sleep(0.05)
    tasks = list(px.proxy._probes)
    assert len(tasks) == 4  # one per engine of each pool
    px.stop()
    assert all(t.done() for t in tasks)  # stopped with the proxy


VLLM_500 = (b'{"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", '
            b'"type": "InternalServerError", "param": null, "code": 500}}', "application/json")


def test_a_dead_engine_cores_500_does_not_lift_the_hold_its_failed_probe_put_on(engines, proxies):
    """vLLM with a dead engine core answers /health 503 and each request 500 (EngineDeadError), or, once a stream
    is open, an error event. With every decode engine held out by its probe, a request is still sent to one (its own
    error reaches the client), and that 500 counted as an answer: the hold was lifted, /readyz said ready and the next
    requests went there until the next probe (60 s here). A 5xx and an error event now leave the hold on."""
    p, d = engines("prefill"), engines("decode")
    d.health_status, (d.status, d.error) = 503, (500, VLLM_500)
    px = proxies([p], [d], health_interval_s=60.0, health_timeout_s=2.0)
    deadline = time.monotonic() + 30
    while px.proxy.health()["probes"]["decode"].get(d.url, {}).get("state") != "down":
        assert time.monotonic() < deadline, px.proxy.health()
        time.sleep(0.05)
    for stream_it in (False, True):
        r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": stream_it}, timeout=30)
        assert r.status_code == 500 and "EngineCore" in r.text
        assert d.url in px.proxy.health()["left_out"]["decode"]
        ready = httpx.get(px.url + "/readyz", timeout=5)
        assert ready.status_code == 503 and "held until /health" in ready.json()["decode"][d.url]["why"]
    d.status = 200  # the API server still takes a stream, whose first event is the error
    d.error_event = json.loads(VLLM_500[0])
    _, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    assert "EngineCore" in events[0][1] and d.url in px.proxy.health()["left_out"]["decode"]
    assert httpx.get(px.url + "/readyz", timeout=5).status_code == 503
    d.error_event = None  # a real answer still brings it back, as before
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30).status_code == 200
    assert d.url not in px.proxy.health()["left_out"]["decode"]


def test_a_health_200_does_not_bring_back_an_engine_real_traffic_saw_stall(engines, proxies, monkeypatch):
    """vLLM's /health answers 200 while its API server runs and its engine core is not dead, which a stalled engine
    still is: a 200 that ended the time out would send the next requests to stall again. It lifts only the hold a
    failed probe put on; the time out runs on, and the engine is back once a real request is answered."""
    for name in ("EJECT_S", "EJECT_MAX_S"):
        monkeypatch.setattr(balance, name, 60.0)
    p, bad, good = engines("prefill"), engines("decode", "bad"), engines("decode", "good")
    bad.stall_after, bad.stall_s = 0, 5.0
    px = proxies([p], [bad, good], health_interval_s=0.1, prefill_timeout_s=0.5, decode_stall_timeout_s=0.5,
                 decode_timeout_s=10.0)
    body = {"model": "m", "prompt": "x", "stream": True}
    assert "stalled" in stream(px.url + "/v1/completions", body)[1][-1][1]  # round-robin: bad first
    seen = bad.health_gets
    deadline = time.monotonic() + 30
    while bad.health_gets < seen + 3:  # /health says 200 since
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert px.proxy.health()["probes"]["decode"][bad.url]["state"] == "up"
    assert set(px.proxy.health()["left_out"]["decode"]) == {bad.url}
    for _ in range(3):
        assert stream(px.url + "/v1/completions", body)[1][-1][1] == "[DONE]"
    assert len(bad.requests) == 1 and len(good.requests) == 3


def test_engine_pool_service_counts_what_a_request_could_use_and_not_a_single_failure():
    """Readiness (GET /readyz) asks each pool for an engine in service. A single failed call's 1 s time out is a blip:
    counted, every failed request flipped readiness. An engine out again after its next try (2 failures in a row) is
    out of service until its time out is over. With probes on, the probe decides: held (failed /health) is out, a 200
    is in, not probed yet is unknown, so out; a /health that says nothing (404) falls back to the failures."""
    now = [0.0]
    pool = EnginePool(["u1", "u2"], "round-robin", clock=lambda: now[0])
    assert all(ok for ok, _ in pool.service(probed=False).values())
    pool.failed("u1", "refused")
    ok, why = pool.service(probed=False)["u1"]
    assert ok and "1 failure" in why  # a blip: still in service
    now[0] = 1.0
    pool.failed("u1", "refused")  # its try after the time out failed too
    ok, why = pool.service(probed=False)["u1"]
    assert not ok and "2 failures in a row" in why and "2 s" in why
    now[0] = 3.0  # the time out is over: the next request tries it, so a request could use it
    assert pool.service(probed=False)["u1"][0]
    pool.answered("u1")
    assert pool.service(probed=False)["u1"] == (True, "no failure")
    # probes on
    probed = pool.service(probed=True)
    assert probed["u1"] == (False, "not probed yet") and probed["u2"] == (False, "not probed yet")
    pool.probe_ok("u1")
    pool.probe_failed("u2", "ConnectError: refused")
    probed = pool.service(probed=True)
    assert probed["u1"] == (True, "/health answers 200")
    assert not probed["u2"][0] and "ConnectError: refused" in probed["u2"][1]
    for _ in range(3):  # requests fail on u1 while its /health says 200 (a stall): the probe decides
        now[0] += 20
        pool.failed("u1", "stalled")
    assert pool.service(probed=True)["u1"][0]
    pool.probe_unknown("u2", "answered 404")  # no verdict: still held by the failed probe
    assert not pool.service(probed=True)["u2"][0]
    pool.answered("u2")  # a real answer lifts the hold; /health says nothing: the failures decide
    assert pool.service(probed=True)["u2"] == (True, "no failure")


def test_ready_is_503_naming_the_pool_when_every_decode_engine_is_down_while_health_stays_200(engines, proxies):
    """/health answered 200 {"status": "ok"} with every decode engine dead, each request a 502: a readiness probe on it
    kept sending this proxy traffic it could only fail. /readyz answers 503 with the pool and each engine's state;
    /health stays 200 (liveness: a restart would not bring the engines back) but no longer says ok. Once an engine
    is back, /readyz is 200 again."""
    p, d1, d2 = engines("prefill"), engines("decode", "d1"), engines("decode", "d2")
    px = proxies([p], [d1, d2], health_interval_s=0.1, health_timeout_s=2.0)
    deadline = time.monotonic() + 30
    while (r := httpx.get(px.url + "/readyz", timeout=5)).status_code != 200:  # once the first probes are in
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert r.json()["status"] == "ready" and r.json()["decode"][d1.url] == {"in_service": True,
                                                                           "why": "/health answers 200"}
    port = int(d1.url.rsplit(":", 1)[1])
    d1.close()  # the engine dies
    d2.health_status = 503  # vLLM: its engine core is dead
    while (r := httpx.get(px.url + "/readyz", timeout=5)).status_code != 503:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    ready = r.json()
    assert ready["status"] == "not_ready" and ready["reason"] == "no decode engine in service"
    assert not ready["decode"][d1.url]["in_service"]  # its /health refused (or cut, if a probe was on its way)
    assert ready["decode"][d1.url]["why"].startswith("held until /health answers 200 (")
    assert ready["decode"][d2.url] == {"in_service": False, "why": "held until /health answers 200 (answered 503)"}
    assert ready["prefill"][p.url]["in_service"]
    h = httpx.get(px.url + "/health", timeout=5)
    assert h.status_code == 200 and h.json()["status"] == "not_ready" and h.json()["ready"] is False
    engines("decode", "back", port=port)  # restarted
    while (r := httpx.get(px.url + "/readyz", timeout=5)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert not r.json()["decode"][d2.url]["in_service"] and r.json()["decode"][d1.url]["in_service"]
    h = httpx.get(px.url + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["ready"] is True


def test_ready_does_not_flap_on_one_failed_request_without_probes(engines, proxies):
    """Without probes, readiness has only what requests saw. One failed call leaves its engine out 1 s: counted,
    every failed request would flip readiness off and on. It turns 503 once the engine failed again on its next try
    (2 failures in a row), and 200 again when its time out is over, so that a request can try it (nothing else would:
    turn the probes on for a readiness that holds). The proxy's clock is driven by the test: no timing race."""
    p = engines("prefill")
    port = closed_port()
    px = proxies([p], [f"http://127.0.0.1:{port}"])
    now = [1000.0]
    px.proxy.decode._clock = lambda: now[0]
    body = {"model": "m", "prompt": "x"}

    def ready() -> httpx.Response:
        return httpx.get(px.url + "/readyz", timeout=5)

    assert ready().status_code == 200  # probes off: nothing known against the engines
    assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).status_code == 502
    now[0] += 0.5
    assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).status_code == 502  # the same outage
    r = ready()
    assert r.status_code == 200 and "1 failure" in r.json()["decode"][f"http://127.0.0.1:{port}"]["why"]
    now[0] += 0.5  # time out over: the next request tries it, and fails again
    assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).status_code == 502
    r = ready()
    assert r.status_code == 503 and r.json()["reason"] == "no decode engine in service"
    assert "2 failures in a row" in r.json()["decode"][f"http://127.0.0.1:{port}"]["why"]
    now[0] += 2.0
    assert ready().status_code == 200  # its time out is over: a request may try it
    engines("decode", port=port)  # back
    assert httpx.post(px.url + "/v1/completions", json=body, timeout=10).status_code == 200
    assert ready().json()["decode"][f"http://127.0.0.1:{port}"] == {"in_service": True, "why": "no failure"}


def test_many_concurrent_requests_with_clients_leaving_return_every_in_flight_count_to_zero(engines, proxies):
    """200 requests at once over asyncio, streamed and not, one in five clients leaving part-way, a dead
    engine in each pool: each that stayed is served, and no lease is kept (an engine avoided or preferred
    for ever)."""
    p1, p2, d1, d2 = engines("prefill"), engines("prefill"), engines("decode"), engines("decode")
    for d in (d1, d2):
        d.tokens, d.itl_s = 10, 0.01
    dead = f"http://127.0.0.1:{closed_port()}"
    px = proxies([p1, dead, p2], [d1, dead, d2], policy="least-loaded")

    async def one(client: httpx.AsyncClient, i: int) -> int | None:
        body = {"model": "m", "prompt": "x", "stream": i % 2 == 0}
        try:
            async with asyncio.timeout(0.05 if i % 5 == 0 else 60):
                async with client.stream("POST", px.url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        pass
                    return r.status_code
        except TimeoutError:
            return None

    async def run() -> list[int | None]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    codes = asyncio.run(run())
    assert all(code == 200 for i, code in enumerate(codes) if i % 5), codes
    deadline = time.monotonic() + 30
    while True:
        h, s = px.proxy.health()["in_flight"], scrape(px.url)
        if not any(h["prefill"].values()) and not any(h["decode"].values()) and not value(s, c.CLIENT_IN_FLIGHT.name):
            break
        assert time.monotonic() < deadline, (h, value(s, c.CLIENT_IN_FLIGHT.name))
        time.sleep(0.05)


def test_a_failing_metric_is_logged_and_the_request_still_succeeds(engines, proxies, caplog):
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])

    class Broken:
        def labels(self, *a):
            raise RuntimeError("metric backend broke")

    px.proxy.metrics.families.families[c.CLIENT_TTFT.name] = Broken()
    px.proxy.metrics.families.families[c.CLIENT_E2E.name] = Broken()
    with caplog.at_level(logging.ERROR, logger="pd_proxy.metrics"):
        r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5).status_code == 200
    assert r.status_code == 200 and len(token_times(events)) == 5 and events[-1][1] == "[DONE]"
    assert any("metric backend broke" in (rec.exc_text or "") or "metric backend broke" in str(rec.exc_info)
               for rec in caplog.records)
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 2  # the rest was still recorded
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0


def test_slo_threshold_env_adds_a_bucket_boundary():
    m = ClientMetrics("r", env={"SLA_GUARD_TPOT_SLO_S": "0.018"})
    m.request("m", time.perf_counter()).tpot(0.0, 0.036, 3)
    text = m.exposition().decode()
    assert f'{c.CLIENT_TPOT.name}_bucket{{le="0.018",model="m",pool="client",route="pd",router="r"}} 1.0' in text
    assert f'{c.CLIENT_TPOT.name}_bucket{{le="0.015",model="m",pool="client",route="pd",router="r"}} 0.0' in text


def test_sse_splitter_and_event_inspection():
    sp = legs.SseSplitter()
    stream_bytes = (b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":2}}'
                    b'\r\n\r\ndata: [DONE]\n\n')
    out = []
    for i in range(0, len(stream_bytes), 7):  # any split of the bytes gives the same events
        out += sp.feed(stream_bytes[i:i + 7])
    out += sp.flush()
    assert b"".join(out) == stream_bytes and len(out) == 3
    evs = [legs.inspect_event(e) for e in out]
    assert evs[0].token and not evs[0].usage_only
    assert evs[1].usage_only and evs[1].completion_tokens == 2 and not evs[1].token
    assert evs[2].done
    assert legs.inspect_event(b'data: {"error": {"message": "x"}}\n\n').error
    assert not legs.inspect_event(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n').token
    assert legs.inspect_event(b'data: {"choices":[{"delta":{"tool_calls":[{"id":"1"}]}}]}\n\n').token


def test_config_rejects_bad_values():
    for kw in ({"prefill": (), "decode": ("http://d",)}, {"prefill": ("ftp://p",), "decode": ("http://d",)},
               {"prefill": ("http://p",), "decode": ("http://d",), "policy": "random"},
               {"prefill": ("http://p",), "decode": ("http://d",), "max_models": 0}):
        with pytest.raises(ValueError):
            ProxyConfig(**kw)
    cfg = ProxyConfig(prefill=("http://u:secret@p:8000/",), decode=("http://d",))
    assert cfg.prefill == ("http://u:secret@p:8000",)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"decode_stall_timeout_s \(--decode-stall-timeout\) must be a positive"):
            ProxyConfig(prefill=("http://p",), decode=("http://d",), decode_stall_timeout_s=bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"health_interval_s \(--health-interval\) must be 0 \(off\) or"):
            ProxyConfig(prefill=("http://p",), decode=("http://d",), health_interval_s=bad)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"health_timeout_s \(--health-timeout\) must be a positive"):
            ProxyConfig(prefill=("http://p",), decode=("http://d",), health_timeout_s=bad)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"request_timeout_s \(--request-timeout\) must be a positive"):
            ProxyConfig(prefill=("http://p",), decode=("http://d",), request_timeout_s=bad)


def test_console_script_serves_health_and_metrics():
    port = closed_port()
    script = Path(sys.executable).parent / "sla-guard-proxy"
    assert script.exists(), "pip install -e . to create the console script"
    proc = subprocess.Popen([str(script), "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                             "--listen", f"127.0.0.1:{port}", "--router", "cli", "--policy", "least-loaded"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.1)
        assert h.json()["router"] == "cli" and h.json()["policy"] == "least-loaded"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5)
        assert r.status_code == 502
        s = scrape(f"http://127.0.0.1:{port}")
        assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error", router="cli", pool="client", route="pd") == 1
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([str(script), "--prefill", "nope", "--decode", "http://d"], capture_output=True, text=True)
    assert bad.returncode == 2 and "engine URL" in bad.stderr


@pytest.mark.slow
def test_sigterm_lets_a_stream_in_flight_finish_past_30_s(engines):
    """On SIGTERM the proxy stops accepting and lets the requests in flight finish. It gave them 30 s while a
    decode stream may run --decode-timeout (600 s): a rolling restart cut longer answers mid-way (the client
    saw the connection drop, no error event, and the request counted as the client leaving)."""
    p, d = engines("prefill"), engines("decode")
    d.tokens, d.itl_s = 70, 0.5  # 35 s of answer
    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pd_proxy", "--prefill", p.url, "--decode", d.url,
                             "--listen", f"127.0.0.1:{port}", "--log-level", "warning"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + 10
                    while True:  # no new requests once it drains
                        try:
                            httpx.get(url + "/health", timeout=1)
                        except httpx.ConnectError:
                            break
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
        assert events[-1] == "[DONE]" and len(events) == 71
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- real CPU vLLM --------------------------------------------------------------------------------

@pytest.mark.vllm
def test_real_vllm_stream_through_the_proxy(vllm_spec_engine):
    """vLLM's own SSE (completions text chunks, the usage chunk, ``[DONE]``) through the proxy. The
    shared engine (no KV connector, so prefill's ``kv_transfer_params`` is null and decode recomputes
    the prompt; its tiny model has no chat template) plays both pools; the P/D hand-off itself is
    covered with ExampleConnector in tests/test_vllm_hooks.py and tests/test_pd_e2e.py."""
    import vllm_support as vs

    eng = vllm_spec_engine.base_url
    ttft_count = c.REQUEST_TTFT.series("_count")
    before = vs.total(vs.scrape(vllm_spec_engine.metrics_url), ttft_count)
    lab = {"model": vs.MODEL_NAME, "pool": "client", "route": "pd", "router": ROUTER}
    body = {"model": vs.MODEL_NAME, "prompt": "the quick brown fox " * 8, "max_tokens": 12, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    with ProxyThread(ProxyConfig(prefill=(eng,), decode=(eng,), router=ROUTER)) as px:
        r, events, t_sent = stream(px.url + "/v1/completions", body, headers={"X-Request-Id": "px-real"}, timeout=120)
        assert r.status_code == 200 and r.headers["x-request-id"] == "px-real", events
        assert events[-1][1] == "[DONE]" and not any('"completion_tokens"' in e for _, e in events)
        toks = token_times(events)
        s = scrape(px.url)
        ttft = value(s, c.CLIENT_TTFT.name + "_sum", **lab)
        assert value(s, c.CLIENT_TTFT.name + "_count", **lab) == 1
        assert 0 < ttft <= toks[0] - t_sent  # same clock: inside what the client measured
        stages = {st: value(s, c.CLIENT_STAGE.name + "_sum", stage=st, **lab)
                  for st in ("prefill_leg", "decode_first_leg", "proxy")}
        assert stages["prefill_leg"] > 0 and stages["decode_first_leg"] > 0
        assert sum(stages.values()) == pytest.approx(ttft, abs=1e-6)
        assert value(s, c.CLIENT_TPOT.name + "_count", **lab) == 1  # completion_tokens from the usage chunk
        assert value(s, c.CLIENT_TPOT.name + "_sum", **lab) == pytest.approx((toks[-1] - toks[0]) / 11, abs=0.02)
        # asked for: the usage chunk reaches the client
        r, events, _ = stream(px.url + "/v1/completions", {**body, "stream_options": {"include_usage": True}},
                              timeout=120)
        usage = [json.loads(e)["usage"] for _, e in events if e != "[DONE]" and not json.loads(e)["choices"]]
        assert r.status_code == 200 and usage and usage[-1]["completion_tokens"] == 12
        s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok", **lab) == 2 and value(s, c.CLIENT_IN_FLIGHT.name) == 0
    # vLLM saw both legs of both requests (its stats reach the API server just after the answers)
    deadline = time.monotonic() + 20
    while vs.total(vs.scrape(vllm_spec_engine.metrics_url), ttft_count) - before < 4:
        assert time.monotonic() < deadline, "the engine did not count both legs of both requests"
        time.sleep(0.3)


def test_otlp_span_per_request_joins_by_request_id(engines, monkeypatch):
    """With SLA_GUARD_OTLP_ENDPOINT set (a real OTLP/HTTP receiver on loopback), each client request
    becomes one ``sla_guard.client_request`` span carrying the client's X-Request-Id -- the id the
    engines' own ``sla_guard.request`` spans carry -- with its legs as child spans."""
    from fixtures.otlp_receiver import OtlpReceiver, attrs

    with OtlpReceiver() as rcv:
        monkeypatch.setenv("SLA_GUARD_OTLP_ENDPOINT", rcv.endpoint)
        pre, dec = engines("prefill"), engines("decode")
        pre.delay_s, dec.first_token_s = 0.05, 0.08
        with ProxyThread(ProxyConfig(prefill=(pre.url,), decode=(dec.url,), router=ROUTER)) as px:
            r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "hi", "stream": True},
                                  headers={"X-Request-Id": "join-me"})
            assert r.status_code == 200 and events
        # the proxy's shutdown flushed its spans
        assert rcv.wait(lambda x: any(s.name == "sla_guard.client_request" for s in x.spans()))
        spans = rcv.spans()
        top = next(s for s in spans if s.name == "sla_guard.client_request")
        a = attrs(top.attributes)
        assert a["sla_guard.request_id"] == "join-me" and a["sla_guard.outcome"] == "ok"
        assert a["sla_guard.pool"] == "client" and a["sla_guard.router"] == ROUTER
        assert a["sla_guard.prefill_leg_s"] >= 0.05 and a["sla_guard.decode_first_leg_s"] >= 0.08
        assert a["sla_guard.ttft_s"] >= a["sla_guard.prefill_leg_s"] + a["sla_guard.decode_first_leg_s"]
        children = {s.name: s for s in spans if s.parent_span_id == top.span_id}
        assert set(children) == {"prefill_leg", "decode_first_leg"}
        leg = children["prefill_leg"]
        assert (leg.end_time_unix_nano - leg.start_time_unix_nano) / 1e9 == pytest.approx(
            a["sla_guard.prefill_leg_s"], abs=1e-6)
        assert pre.headers[0]["x-request-id"] == dec.headers[0]["x-request-id"] == "join-me"


def test_model_names_no_engine_serves_do_not_take_the_real_models_label(engines, proxies):
    """16 requests naming models that do not exist (the engine answers 404) used to take every
    label slot: the real model was "other" for the proxy's life and its client-scope SLO had no
    data. A slot is kept only for a model an engine served; the real model's first request after
    the flood may still be "other", the next ones carry its name."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], max_models=4)
    p.status, p.error = 404, (b'{"error": {"message": "no such model", "code": 404}}', "application/json")
    for i in range(6):
        assert httpx.post(px.url + "/v1/completions", json={"model": f"typo{i}", "prompt": "x"}, timeout=5) \
            .status_code == 404
    p.status = 200
    for _ in range(3):
        assert httpx.post(px.url + "/v1/completions", json={"model": "llama", "prompt": "x"}, timeout=5) \
            .status_code == 200
    s = scrape(px.url)
    by_model = {(dict(ls)["model"], dict(ls)["outcome"]): v for (n, ls), v in s.items()
                if n == c.CLIENT_REQUESTS.exposed}
    assert by_model[("llama", "ok")] >= 2
    assert sum(v for (m, _), v in by_model.items() if m.startswith("typo")) \
        + by_model.get(("other", "client_error"), 0) == 6
    assert len({m for m, _ in by_model}) <= 2 * 4 + 1  # still bounded: served, tentative, other


def test_a_non_streamed_answer_the_client_left_before_is_aborted_not_ok(engines, proxies):
    """The client gave up during a 2 s decode leg: the server's send of the answer vanished without
    an error and the request was counted ok with an e2e time; a streamed one was already aborted."""
    p, d = engines("prefill"), engines("decode")
    d.delay_s = 2.0
    px = proxies([p], [d])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=0.5)
    deadline = time.monotonic() + 30
    while value(s := scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="aborted") < 1:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 0 and value(s, c.CLIENT_E2E.name + "_count") == 0
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0


def test_a_body_the_legs_cannot_send_on_is_a_400_client_error_not_a_500(engines, proxies):
    """NaN (json.loads takes it, the upstream encoder refuses it), a lone surrogate (not UTF-8) and
    nesting past the recursion limit raised out of the handler: a 500, counted as the service's
    error (or, for the nesting, not counted at all)."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    for raw in (b'{"model": "m", "prompt": "x", "temperature": NaN}', b'{"model": "m", "prompt": "\\ud800"}',
                b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 100_000):
        r = httpx.post(px.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], raw[:60]
    assert p.requests == [] and d.requests == []
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error") == 4
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 0 and value(s, c.CLIENT_IN_FLIGHT.name) == 0


def test_stream_is_read_as_vllm_reads_it_and_min_tokens_stays_off_the_prefill_leg(engines, proxies):
    """vLLM reads ``"stream": "false"`` as False (pydantic, lax): the proxy read it as True and waited
    for a stream the engine never sent. A ``stream`` vLLM would refuse is the client's 400. And
    ``min_tokens`` over the prefill leg's one token made vLLM refuse the prefill."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": "false",
                                                      "min_tokens": 5}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world"
    assert d.requests[-1]["stream"] is False and d.requests[-1]["min_tokens"] == 5
    assert "min_tokens" not in p.requests[-1] and p.requests[-1]["max_tokens"] == 1
    with httpx.stream("POST", px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": "yes"},
                      timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert b"[DONE]" in r.read()
    with httpx.stream("POST", px.url + "/v1/completions", timeout=10,
                      json={"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": "false"}}
                      ) as r:  # the usage chunk the proxy asked for is dropped again: the client said no
        assert r.status_code == 200 and b'completion_tokens' not in r.read()
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": "maybe"}, timeout=10)
    assert r.status_code == 400 and "stream must be a boolean" in r.json()["error"]["message"]
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 3
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error") == 1


def test_request_id_and_authorization_with_non_ascii_bytes_are_passed_on_as_they_came(engines, proxies):
    """The server decodes header values as Latin-1 and httpx encodes a str as ASCII: an X-Request-Id
    or Authorization with a byte past 0x7f raised UnicodeEncodeError out of the handler, a 500."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    hs = {"x-request-id": "caf\xe9-1".encode("latin-1"), "authorization": b"Bearer k\xff"}
    r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, headers=hs, timeout=10)
    assert r.status_code == 200 and (b"x-request-id", b"caf\xe9-1") in r.headers.raw
    for got in (p.headers[0], d.headers[0]):  # http.server decodes them as Latin-1 too
        assert got["x-request-id"] == "caf\xe9-1" and got["authorization"] == "Bearer k\xff"
    assert value(scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="ok") == 1


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_a_client_leaving_a_non_streamed_request_ends_the_engine_call(engines, proxies, leg):
    """The client gave up while a leg was running: the proxy went on waiting for the whole answer
    (vLLM generating it, up to the decode deadline) and only then counted the request aborted; the
    upstream call is cancelled now (its connection closed: vLLM aborts the request)."""
    p, d = engines("prefill"), engines("decode")
    eng = p if leg == "prefill" else d
    eng.delay_s = 120.0  # the engine would hold the call past the wait below: only cancelling ends it
    px = proxies([p], [d])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=0.5)
    deadline = time.monotonic() + 60
    while px.proxy.health()["in_flight"][leg][eng.url] or value(scrape(px.url), c.CLIENT_REQUESTS.exposed) < 1:
        assert time.monotonic() < deadline, "the engine call outlived the client"
        time.sleep(0.05)
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="aborted") == 1 and value(s, c.CLIENT_IN_FLIGHT.name) == 0
    assert len(d.requests) == (1 if leg == "decode" else 0)


def test_a_stream_body_without_event_boundaries_is_relayed_as_it_comes(engines, proxies):
    """An engine answering a stream with a body that has no blank line (JSON, an HTML error page):
    the proxy buffered it whole, copying and re-searching the buffer on every chunk (26 MB took 17 s
    of the event loop) and the client's first byte came only at the end."""
    p = engines("prefill")
    got_first, ended = threading.Event(), threading.Event()

    class NoEvents(Engine):
        def answer(self, h, body):
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.end_headers()
            for _ in range(128):  # 8 MB, then silence until the client has its first byte (60 s at most)
                h.wfile.write(b"x" * 65536)
            h.wfile.flush()
            got_first.wait(60)
            ended.set()

    d = NoEvents("decode")
    try:
        px = proxies([p], [d])
        held, n, tail = None, 0, b""
        with httpx.stream("POST", px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                          timeout=120) as r:
            for chunk in r.iter_raw():
                if held is None:
                    held = ended.is_set()
                    got_first.set()
                n += len(chunk)
                tail = (tail + chunk)[-4096:]
        x = tail.rindex(b"x") + 1
        assert r.status_code == 200 and n - len(tail) + x == 128 * 65536  # the whole body, then (no [DONE]) an error
        assert b'"upstream_invalid"' in tail[x:]
        assert not held, "the first byte came after the engine ended its body: the proxy held it until then"
        assert value(scrape(px.url), c.CLIENT_REQUESTS.exposed, outcome="error") == 1
    finally:
        d.close()


def test_sse_splitter_searches_only_new_bytes_and_bounds_an_event():
    data = b'data: {"choices":[{"text":"a"}]}\r\n\r\ndata: x\n\n\r\rdata: [DONE]\n\n'
    for step in (1, 2, 3, 5):
        sp = legs.SseSplitter()
        out = [e for i in range(0, len(data), step) for e in sp.feed(data[i:i + step])] + sp.flush()
        assert out == [b'data: {"choices":[{"text":"a"}]}\r\n\r\n', b"data: x\n\n", b"\r\r", b"data: [DONE]\n\n"]
    sp = legs.SseSplitter(max_event_bytes=10)
    assert sp.feed(b"x" * 8) == [] and sp.feed(b"y" * 8) == [b"x" * 8 + b"y" * 8]
    assert sp.feed(b"z\n\ndata: [DONE]\n\n") == [b"z\n\n", b"data: [DONE]\n\n"]


# --- what vLLM's streams carry beyond one plain choice ----------------------------------------------

def test_several_choices_interleaved_do_not_divide_one_choices_time_by_every_choices_tokens(engines, proxies):
    """``n`` > 1 (or a list of prompts): vLLM interleaves the choices' chunks and its usage chunk counts
    the tokens of all of them, so one choice's decode time over every choice's tokens observed TPOT / n
    (n=3 at 30 ms a token: 10 ms, under a 20 ms SLO). The proxy cannot tell one choice's count: TPOT is
    not observed for such a stream; TTFT, e2e and outcome still are, and a one-choice stream's TPOT is."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    d.tokens, d.itl_s = 6, 0.03
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": "m", "stream": True, "n": 3,
                **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
        r, events, _ = stream(px.url + path, body)
        assert r.status_code == 200 and events[-1][1] == "[DONE]"
        assert {json.loads(e)["choices"][0]["index"] for _, e in events[:-1]} == {0, 1, 2}
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok", model="m") == 2
    assert value(s, c.CLIENT_TTFT.exposed + "_count") == 2
    assert value(s, c.CLIENT_TPOT.exposed + "_count") == 0
    r, events, _ = stream(px.url + "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    s = scrape(px.url)
    assert value(s, c.CLIENT_TPOT.exposed + "_count") == 1
    toks = token_times(events)
    lo, hi = tpot_bounds(d, toks[0], toks[-1])  # one choice: (last - first) / (6 - 1)
    assert lo <= value(s, c.CLIENT_TPOT.exposed + "_sum") <= hi


def test_a_decode_engine_refusing_what_the_prefill_engine_served_is_an_error_not_the_clients(engines, proxies):
    """The decode pool without the model (or LoRA adapter) the prefill pool serves, or with another API key:
    every request got the decode engine's 404 / 401 and was counted client_error, so the availability
    SLO stayed green over a deployment that answered nothing. The answer still passes through as it came;
    the outcome is error. A decode 400 stays the client's (only decode sees max_tokens)."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    missing = (b'{"error": {"message": "The model `m` does not exist.", "type": "NotFoundError", "param": "model", '
               b'"code": 404}}', "application/json")
    for status, streamed in ((404, True), (404, False), (401, True), (403, False)):
        d.status, d.error = status, missing
        r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": streamed},
                       timeout=10)
        assert r.status_code == status and r.content == missing[0]
    d.status = 400
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                      timeout=10).status_code == 400
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error", model="m") == 4
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="client_error", model="m") == 1
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0


def test_continuous_usage_stats_alone_does_not_put_usage_into_every_chunk(engines, proxies):
    """vLLM sends usage in every chunk only when ``include_usage`` is on as well. The proxy turns
    include_usage on for TPOT, which also turned on the continuous usage a client had asked for alone: its
    every chunk carried usage that vLLM would not have sent it. Asked together, both still come."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    r, events, _ = stream(px.url + "/v1/completions", body)
    assert r.status_code == 200 and len(events) == d.tokens + 1
    assert d.requests[-1]["stream_options"] == {"include_usage": True}
    assert all(json.loads(e).get("usage") is None for _, e in events[:-1])
    assert value(scrape(px.url), c.CLIENT_TPOT.exposed + "_count") == 1  # TPOT still has its token count
    body["stream_options"]["include_usage"] = True
    r, events, _ = stream(px.url + "/v1/completions", body)
    chunks = [json.loads(e) for _, e in events[:-1]]
    assert all(ch["usage"]["completion_tokens"] == i + 1 for i, ch in enumerate(chunks[:-1]))
    assert chunks[-1] == {"id": "d", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": d.tokens,
                                                               "total_tokens": 3 + d.tokens}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_engine_forcing_usage_gives_the_client_the_stream_vllm_would(engines, proxies, path):
    """A decode engine started with ``--enable-force-include-usage`` sends usage in every chunk and the usage
    chunk to every client, asked or not. The proxy dropped that final chunk from a client that had not asked
    (the chunk the proxy asks for itself, for TPOT): the client got usage in every chunk but not the usage
    chunk a client of vLLM gets. The client now sees what the engine sends it directly, forced or not, and
    TPOT still has its completion_tokens."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    d.tokens, d.itl_s, d.eos = 4, 0.05, True
    body = {"model": "m", "stream": True,
            **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
    lo = hi = 0.0
    for forced in (True, False):
        d.force_usage = forced
        _, direct, _ = stream(d.url + path, body)
        r, relayed, _ = stream(px.url + path, body)
        assert r.status_code == 200 and [e for _, e in relayed] == [e for _, e in direct], forced
        usage_chunks = [e for _, e in relayed if e != "[DONE]" and not json.loads(e)["choices"]]
        assert len(usage_chunks) == forced and d.requests[-1]["stream_options"] == {"include_usage": True}
        eos = next(t for t, e in relayed if e != "[DONE]" and json.loads(e)["choices"][0].get("finish_reason"))
        bounds = tpot_bounds(d, token_times(relayed)[0], eos)  # 5 steps (EOS too), 4 gaps
        lo, hi = lo + bounds[0], hi + bounds[1]
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 2 and value(s, c.CLIENT_TPOT.exposed + "_count") == 2
    assert lo <= value(s, c.CLIENT_TPOT.exposed + "_sum") <= hi


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_system_fingerprint_reaches_a_client_that_did_not_ask_for_usage(engines, proxies, path):
    """vLLM stamps ``system_fingerprint`` on each choice's chunk with a finish_reason, or, with include_usage on,
    only on the usage chunk. The proxy turns include_usage on (TPOT needs completion_tokens) and drops that chunk
    for a client that did not ask for it, so that client never saw the fingerprint. It gets the stream vLLM would
    send it now (the fingerprint on its last chunks), streamed or not, usage asked or not, n = 1 or 2."""
    p, d = engines("prefill"), engines("decode")
    d.tokens, d.eos, d.fingerprint = 3, True, "vllm-0.32.0-1a2b3c4d"
    px = proxies([p], [d])
    prompt = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    for n in (1, 2):
        for usage in ({}, {"stream_options": {"include_usage": True}}):
            body = {"model": "m", "stream": True, "n": n, **prompt, **usage}
            _, direct, _ = stream(d.url + path, body)
            r, relayed, _ = stream(px.url + path, body)
            want = [e if e == "[DONE]" else json.loads(e) for _, e in direct]
            assert r.status_code == 200 and [e if e == "[DONE]" else json.loads(e) for _, e in relayed] == want
            stamped = sum(e != "[DONE]" and e.get("system_fingerprint") == d.fingerprint for e in want)
            assert stamped == (1 if usage else n)  # vLLM's places: the usage chunk, or each choice's last chunk
    body = {"model": "m", **prompt}
    assert httpx.post(px.url + path, json=body, timeout=10).json()["system_fingerprint"] == d.fingerprint
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 5 and value(s, c.CLIENT_TPOT.exposed + "_count") == 2


def test_with_fingerprint_adds_the_field_and_leaves_the_rest_byte_for_byte():
    raw = b'data: {"id":"d","choices":[{"index":0,"text":"\xc3\xa9 }","finish_reason":"stop"}]}\r\n\r\n'
    out = legs.with_fingerprint(raw, "fp-1")
    head = b'data: {"id":"d","choices":[{"index":0,"text":"\xc3\xa9 }","finish_reason":"stop"}]'
    assert raw.startswith(head) and out == head + b',"system_fingerprint":"fp-1"}\r\n\r\n'
    assert legs.inspect_event(out).finished and legs.inspect_event(out).fingerprint == "fp-1"
    assert legs.with_fingerprint(raw, None) == raw  # nothing to add (an engine with --fingerprint-mode none)
    assert legs.with_fingerprint(out, "fp-2") == out  # the engine's own is kept
    multi = b'event: x\ndata: {"id":"d","choices":[]}\n\n'
    assert legs.with_fingerprint(multi, "fp-1") == multi  # not vLLM's form: left whole


@pytest.mark.parametrize("streamed", [True, False])
def test_an_answer_the_engine_aborted_is_an_error_not_ok(engines, proxies, streamed):
    """vLLM aborts in-flight requests itself on shutdown (``--shutdown-timeout`` is 0 by default: a scale-down or
    rollout of a decode engine), on an engine fault and on ``/pause`` in abort mode. The client, still connected,
    gets a 200 whose choice ends with ``finish_reason: "abort"``, then usage and ``[DONE]`` (a stream aborted before
    its first token: no text and no finish_reason at all). The proxy counted each as ok: a rollout that cut every
    answer short kept the availability SLO green."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    cases = [("/v1/completions", 2), ("/v1/chat/completions", 2), ("/v1/completions", 0), ("/v1/chat/completions", 0)]
    for path, after in cases if streamed else cases[:2]:
        d.abort_after = after
        body = {"model": "m", "stream": streamed,
                **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
        r = httpx.post(px.url + path, json=body, timeout=10)
        assert r.status_code == 200 and ('"abort"' in r.text) == bool(after or not streamed), (path, after)
    d.abort_after = None
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": streamed},
                      timeout=10).status_code == 200
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == (4 if streamed else 2)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == 1
    assert value(s, c.CLIENT_TPOT.exposed + "_count") == streamed  # only the answer that was whole
    assert value(s, c.CLIENT_TTFT.exposed + "_count") == (3 if streamed else 0)  # the two with tokens, the whole one
    assert value(s, c.CLIENT_IN_FLIGHT.name) == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tpot_ends_at_the_eos_step_whose_chunk_has_no_text(engines, proxies, path):
    """vLLM ends a generation at EOS with one more chunk: no text, finish_reason "stop", and the EOS token
    in completion_tokens. TPOT ended at the last chunk with text, a step early: a "Yes" + EOS answer
    observed TPOT 0 s, three words + EOS two thirds of the truth, pulling the client TPOT SLO toward
    good on every short answer. It ends at the EOS step now, as vLLM's own TPOT does."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    d.eos, d.itl_s = True, 0.05
    body = {"model": "m", "stream": True,
            **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
    for tokens in (1, 3):
        d.tokens = tokens
        before = scrape(px.url)
        r, events, _ = stream(px.url + path, body)
        assert r.status_code == 200 and json.loads(events[-2][1])["choices"][0]["finish_reason"] == "stop"
        after = scrape(px.url)
        name = c.CLIENT_TPOT.exposed
        assert value(after, name + "_count") - value(before, name + "_count") == 1
        tpot = value(after, name + "_sum") - value(before, name + "_sum")  # (tokens + EOS - 1) steps of itl
        lo, hi = tpot_bounds(d, token_times(events)[0], events[-2][0])  # last step: the EOS chunk
        assert lo <= tpot <= hi, (tokens, lo, tpot, hi)


def test_a_first_chunk_over_the_event_bound_still_carries_the_first_token(engines, proxies):
    """Completions with ``echo`` and ``logprobs``: vLLM's decode engine recomputes the prompt (prompt
    logprobs skip the remote KV) and its first chunk carries the prompt, its logprobs and the first token,
    past MAX_EVENT_BYTES at ~20k prompt tokens. That event is passed on in pieces, uninspected, so the
    first token was missed: TTFT was taken at the second chunk (here 0.4 s later) and TPOT was 0 s."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    d.tokens, d.itl_s = 2, 0.4
    prompt = " ".join(f"w{i}" for i in range(70_000))
    r, events, t_sent = stream(px.url + "/v1/completions",
                               {"model": "m", "prompt": prompt, "stream": True, "echo": True, "logprobs": 1})
    assert r.status_code == 200 and events[-1][1] == "[DONE]"
    assert len(events[0][1]) > legs.MAX_EVENT_BYTES  # relayed whole, in pieces
    first = json.loads(events[0][1])["choices"][0]
    assert first["text"] == prompt + "t0 " and len(first["logprobs"]["tokens"]) == 70_000
    s = scrape(px.url)
    assert value(s, c.CLIENT_TTFT.exposed + "_count") == 1
    assert value(s, c.CLIENT_TTFT.exposed + "_sum") <= events[0][0] - t_sent < events[1][0] - t_sent
    lo, hi = tpot_bounds(d, events[0][0], events[1][0])  # written 0.4 s apart, less the big chunk's relay
    tpot = value(s, c.CLIENT_TPOT.exposed + "_sum")
    assert tpot > 0 and lo <= tpot <= hi, (lo, tpot, hi)
    # a cut head is read by its structure only: text quoted inside a string (escaped) is not a key
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                       "prompt_token_ids": [1] * 10, "prompt_text": '{"text":"x", "content":"y"}'}).encode()
    assert not legs.inspect_event(b"data: " + role[:-20]).token
    assert legs.inspect_event(b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode()[:-3]).token


def test_half_open_and_dripped_requests_are_closed_after_the_request_timeout(engines, proxies):
    """uvicorn alone waits forever for a request's headers and body: 20 slowloris connections (headers
    never finished, or a body promised and never sent) were all still open 17 s later, each a socket and
    a coroutine held. Each must now deliver its request within --request-timeout or be closed, and a body
    cut short is no request: it was an "Exception in ASGI application" traceback per connection."""
    from guard_support import closed_by_server, half_open

    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d], request_timeout_s=1.0)
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    logging.getLogger("uvicorn.error").addHandler(handler)  # uvicorn's loggers do not reach the root
    socks = []
    try:
        socks = half_open(px.port, [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never finished
                                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"] * 5)
        closed = closed_by_server(socks)
        assert closed == len(socks), f"{closed} of {len(socks)} slow requests closed"
        assert p.requests == [] and d.requests == []
        # a well-behaved client is still served
        r = httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
        assert r.status_code == 200, r.text
        assert [e.getMessage() for e in errors] == []
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        for s in socks:
            s.close()


def test_a_models_failure_counters_exist_at_zero_from_its_first_request(engines, proxies):
    """Prometheus's increase() over a series that appears at 1 counts nothing: a model whose first failure
    made its outcome="error" series (or its failed-before/after-first-token counter) lost that failure to the
    availability SLI and the TTFT/TPOT misses in Prometheus mode and in the rules. They now exist at 0 from
    the model's first request, whatever it ends in."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    assert httpx.post(px.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10).status_code == 200
    got = scrape(px.url)
    def one(name: str, **labels: str) -> list[float]:  # the samples themselves: absent is not 0 here
        return [v for (n, ls), v in got.items() if n == name and set(labels.items()) <= ls]

    assert one(c.CLIENT_REQUESTS.series(), model="m", outcome=str(c.Outcome.OK)) == [1.0]
    assert one(c.CLIENT_REQUESTS.series(), model="m", outcome=str(c.Outcome.ERROR)) == [0.0]
    for m in (c.CLIENT_FAILED_BEFORE_FIRST_TOKEN, c.CLIENT_FAILED_AFTER_FIRST_TOKEN):
        assert one(m.series(), model="m") == [0.0], m.name


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_done_after_text_without_a_finish_reason_is_an_answer_cut_short(engines, proxies, path):
    """vLLM 0.32 ends every choice that generated text with a chunk carrying its finish_reason (the last text
    rides on it; ``chat_completion/serving.py`` and ``completion/serving.py`` send it whatever the delta), or with
    an error event, and only then ``[DONE]``. A ``[DONE]`` after text that no finish_reason closed is an answer
    that lost its ending on the way: the proxy relayed it as a whole answer, counted ok, TPOT observed. The client
    now gets vLLM's in-stream error form before ``[DONE]`` (an SDK stops reading at ``[DONE]``) and the request is
    an error; the engine, which ran the request to its end and answers, is not left out. Whole streams of several
    choices, with usage asked for or not (continuous too), and vLLM's EOS ending stay ok (tool calls: below)."""
    p, d = engines("prefill"), engines("decode")
    px = proxies([p], [d])
    chat = "chat" in path
    base = {"model": "m", "stream": True,
            **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    d.finish = None
    r, events, _ = stream(px.url + path, base)
    assert r.status_code == 200 and len(token_times(events)) == 5 and events[-1][1] == "[DONE]"
    err = json.loads(events[-2][1])["error"]
    assert (err["type"], err["code"], err["leg"]) == ("upstream_invalid", 502, "decode"), err
    assert "finish_reason" in err["message"], err
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1
    assert value(s, c.CLIENT_TPOT.exposed + "_count") == 0
    assert px.proxy.health()["left_out"]["decode"] == {}  # it ran the request to its end: not left out
    # legitimate endings: each choice closed by its finish_reason, n > 1, usage chunks, continuous usage
    d.finish = "length"
    cases = [{}, {"n": 3}, {"stream_options": {"include_usage": True}},
             {"n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}]
    for extra in cases:
        r, events, _ = stream(px.url + path, {**base, **extra})
        assert r.status_code == 200 and events[-1][1] == "[DONE]", extra
        assert not any('"error"' in e for _, e in events), (extra, events[-3:])
    d.finish, d.eos = None, True  # vLLM at EOS: one more step, no text, its finish_reason
    r, events, _ = stream(px.url + path, base)
    assert not any('"error"' in e for _, e in events)
    s = scrape(px.url)
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="ok") == len(cases) + 1
    assert value(s, c.CLIENT_REQUESTS.exposed, outcome="error") == 1


def test_the_end_of_a_stream_is_judged_per_choice_and_not_on_events_it_could_not_read():
    """Which choices a chunk ends (tool calls end with "tool_calls"; a list of prompts numbers its choices on),
    and an event over MAX_EVENT_BYTES, relayed in pieces unread, says nothing of endings (it is never judged)."""
    tool = {"choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                         "finish_reason": "tool_calls"}]}
    ev = legs.inspect_event(b"data: " + json.dumps(tool).encode())
    assert ev.choices == (1,) and ev.ended == (1,) and not ev.opaque
    ev = legs.inspect_event(b'data: {"choices":[{"index":4,"text":"","finish_reason":"stop"}]}')
    assert ev.choices == () and ev.ended == (4,)
    assert legs.inspect_event(b'data: {"choices":[{"index":0,"text":"a"').opaque  # a cut head
    assert legs.inspect_event(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"').opaque
    assert not legs.inspect_event(b"data: [DONE]").opaque and not legs.inspect_event(b": keep-alive").opaque
