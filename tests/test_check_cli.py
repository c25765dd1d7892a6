"""`sla-guard check` as a user runs it (a subprocess), against engines served on real loopback
HTTP: the table's numbers come from what the engines recorded; exit codes 0 / 1 / 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from guard_support import Engine, Served, free_port

ROOT = Path(__file__).resolve().parent.parent


def _check(cfg: dict, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    f = tmp_path / "guard.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f), *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def _cfg(servers, min_requests=5):
    objectives = [
        {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5,
         "min_requests": min_requests},
        {"name": "tpot_mean", "indicator": "tpot", "objective": "mean", "threshold_s": 0.02,
         "min_requests": min_requests},
        {"name": "ttft_p90", "indicator": "ttft", "objective": "percentile", "threshold_s": 5.0,
         "percentile": 0.9, "min_requests": min_requests},
        {"name": "ttft_attainment", "indicator": "ttft", "objective": "attainment", "threshold_s": 2.5,
         "target": 0.99, "min_requests": min_requests},
    ]
    return {"source": {"mode": "scrape", "timeout_s": 2,
                       "targets": [{"url": s.url, "model": "m", "pool": pool} for s, pool in servers]},
            "slos": [{"objectives": objectives}]}


def _rows(stdout: str, key: tuple[int, int] = (1, 2)) -> dict[tuple[str, str], list[str]]:
    """The table's cells by (pool, slo), or by the columns ``key`` names."""
    lines = stdout.strip().splitlines()
    head = lines[0]
    cols = [head.index(h) for h in ("MODEL", "POOL", "SLO", "OBJECTIVE", "VALUE", "REQUESTS", "WINDOW", "BUDGET",
                                     "STATUS", "NOTE")]
    out = {}
    for ln in lines[1:-1]:
        cells = [ln[a:b].strip() for a, b in zip(cols, [*cols[1:], None], strict=True)]
        out[(cells[key[0]], cells[key[1]])] = cells
    return out


def test_check_ok_table_matches_recorded_values(tmp_path):
    e0, e1 = Engine(pool="decode", engine="0"), Engine(pool="decode", engine="1")
    for i in range(10):
        e0.request(0.1 + 0.01 * i, 0.010)
        e1.request(0.3, 0.012)
    servers = [Served(e0.exposition), Served(e1.exposition)]
    try:
        r = _check(_cfg([(servers[0], "decode"), (servers[1], "decode")]), tmp_path)
    finally:
        for s in servers:
            s.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(r.stdout)
    sent = e0.sent_ttft + e1.sent_ttft
    assert rows[("decode", "ttft_mean")][4] == f"{sum(sent) / len(sent) * 1000:.1f} ms"
    assert rows[("decode", "ttft_mean")][5] == "20"
    assert rows[("decode", "tpot_mean")][4] == f"{(0.010 * 10 + 0.012 * 10) / 20 * 1000:.1f} ms"
    assert rows[("decode", "ttft_attainment")][4] == "100.00%"
    assert all(cells[8] == "ok" for cells in rows.values())
    assert r.stdout.strip().endswith("overall: ok")


def test_check_violation_exits_1(tmp_path):
    e = Engine(pool="prefill")
    for _ in range(10):
        e.request(4.0, 0.01)
    s = Served(e.exposition)
    try:
        r = _check(_cfg([(s, "prefill")]), tmp_path)
    finally:
        s.stop()
    assert r.returncode == 1, r.stdout + r.stderr
    rows = _rows(r.stdout)
    assert rows[("prefill", "ttft_mean")][8] == "violated"
    assert rows[("prefill", "ttft_mean")][4] == "4.000 s"


def test_check_unknown_exits_2(tmp_path):
    e = Engine()
    e.request(0.1, 0.01)  # 1 request < min_requests
    s = Served(e.exposition)
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    try:
        r = _check(_cfg([(s, "decode")]), tmp_path)
        assert r.returncode == 2 and "unknown" in r.stdout and "need >= 5" in r.stdout
        cfg = _cfg([(s, "decode")])
        cfg["source"]["targets"].append({"url": dead, "model": "m", "pool": "prefill"})
        r = _check(cfg, tmp_path)
        assert r.returncode == 2 and "1 of 1 targets down" in r.stdout and "down" in r.stderr
    finally:
        s.stop()


def test_check_note_counts_requests_over_the_window_it_judged(tmp_path):
    """A one-shot check judges each engine since its start (the WINDOW column says so); the NOTE
    said "1.0 requests in 5m", a window nothing was counted over, so an operator waited 5 minutes
    for more traffic that the next check would not have read either."""
    e = Engine()
    e.request(0.1, 0.01)
    s = Served(e.exposition)
    try:
        r = _check(_cfg([(s, "decode")]), tmp_path)
    finally:
        s.stop()
    row = _rows(r.stdout)[("decode", "ttft_mean")]
    assert row[6] == "since engine start" and row[9] == "1.0 requests since engine start, need >= 5", r.stdout


def test_a_named_set_with_the_default_slas_judges_a_prefill_pool_on_ttft(tmp_path):
    """``slos: [{model: m}]`` (objectives left out: the default SLAs) gave a prefill pool the TPOT
    objectives too; its engines emit one token per request, so they stayed unknown and every check
    of a P/D deployment exited 2. The defaults give prefill the TTFT objectives only, as without
    ``slos:`` (docs/guard.md)."""
    e = Engine(pool="prefill")
    for _ in range(25):
        e.request(0.2, 0.0, tokens=1)
    s = Served(e.exposition)
    try:
        r = _check(
            {"source": {"targets": [{"url": s.url, "model": "m", "pool": "prefill"}]}, "slos": [{"model": "m"}]},
            tmp_path,
        )
    finally:
        s.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(slo for _pool, slo in _rows(r.stdout)) == ["ttft_attainment", "ttft_mean", "ttft_p90"]


def test_top_level_help_says_what_the_tool_does():
    """``sla-guard --help`` opened with the module's note for developers, cut mid-sentence
    ("Each subcommand lives in ``sla_guard/commands/<name>.py`` with")."""
    r = subprocess.run(
        [sys.executable, "-m", "sla_guard.cli", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0
    description = r.stdout.split("\n\n")[1]
    assert "sla_guard/" not in description and description.rstrip().endswith("."), description
    assert "SLA" in description


@pytest.mark.parametrize("content, fragment", [
    ("source: {mode: scrape, interval_s: -1}\n", "source.scrape.interval_s"),
    ("slos: [{objectives: [{name: x, indicator: ttft, objective: percentile, threshold_s: 1}]}]\n", "percentile"),
    ("nonsense: 1\n", "nonsense: unknown field"),
])
def test_check_bad_config_exits_2_naming_the_field(tmp_path, content, fragment):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and fragment in r.stderr, r.stderr


def test_check_json_output(tmp_path):
    import json

    e = Engine()
    for _ in range(6):
        e.request(0.2, 0.01)
    s = Served(e.exposition)
    try:
        r = _check(_cfg([(s, "decode")]), tmp_path, "--json")
    finally:
        s.stop()
    body = json.loads(r.stdout)
    assert body["status"] == "ok" and body["pools"][0]["slos"][0]["value"] == pytest.approx(0.2)
    assert body["targets_down"] == [] and body["evaluator_errors"] == {}


def test_check_json_says_unknown_on_stdout_when_there_is_no_verdict(tmp_path):
    """A script reading --json's stdout got nothing to parse when the config was wrong, and the
    down targets only on stderr; now an object with status unknown, the error, and the targets."""
    import json

    f = tmp_path / "bad.yaml"
    f.write_text("nonsense: 1\n")
    r = subprocess.run([sys.executable, "-m", "sla_guard.cli", "check", "--config", str(f), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    body = json.loads(r.stdout)
    assert r.returncode == 2 and body["status"] == "unknown" and "nonsense: unknown field" in body["error"]
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    r = _check(_cfg([]) | {"source": {"mode": "scrape", "timeout_s": 2,
                                      "targets": [{"url": dead, "model": "m", "pool": "decode"}]}}, tmp_path, "--json")
    body = json.loads(r.stdout)
    assert r.returncode == 2 and body["status"] == "unknown" and [t["url"] for t in body["targets_down"]] == [dead]


def test_check_wait_uses_promql_windows_over_live_traffic(tmp_path):
    import threading
    import time

    e = Engine()
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            e.request(0.5, 0.01)
            time.sleep(0.05)

    th = threading.Thread(target=traffic, daemon=True)
    s = Served(e.exposition)
    th.start()
    try:
        r = _check(_cfg([(s, "decode")]), tmp_path, "--wait", "2")
    finally:
        stop.set()
        th.join(2)
        s.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    row = _rows(r.stdout)[("decode", "ttft_mean")]
    assert row[4] == "500.0 ms" and row[6] == "5m"
    assert 10 <= float(row[5]) <= 400  # requests over the 2 s between the scrapes, extrapolated


def test_check_prometheus_error_text_cannot_forge_log_lines_or_flood(tmp_path):
    """A Prometheus (or a proxy in front of it) answering 400 with an ``error`` holding a newline, an
    escape sequence and 100 KB: the text was logged verbatim for every query, so it forged log
    lines, repainted the terminal and wrote megabytes per check (per tick in ``serve``)."""
    import http.server
    import json
    import threading

    forged = "2026-01-01 00:00:00,000 CRITICAL sla_guard.slo: every SLO ok"
    body = json.dumps({"status": "error", "errorType": "bad_data",
                       "error": f"parse error\n{forged}\x1b[2J" + "A" * 100_000}).encode()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = {"source": {"mode": "prometheus", "url": f"http://127.0.0.1:{server.server_address[1]}", "timeout_s": 2},
           "slos": [{"objectives": [{"name": "ttft_mean", "indicator": "ttft", "objective": "mean",
                                     "threshold_s": 2.5, "window": "10s", "min_requests": 1}]}]}
    try:
        r = _check(cfg, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    assert "HTTP 400: parse error" in r.stderr  # the server's words are still shown, escaped
    assert not any(line.startswith(forged) for line in r.stderr.splitlines())
    assert "\x1b" not in r.stderr + r.stdout
    n = r.stderr.count("HTTP 400")
    assert len(r.stderr) < 1000 * n, f"{len(r.stderr)} bytes of stderr for {n} failed queries"


def run_into_closed_reader(cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd | head -c 0``, ordered: the reader (a real ``head``) has exited, closing the pipe, before
    ``cmd`` writes its first byte, so every write of ``cmd`` meets a pipe nobody reads."""
    r, w = os.pipe()
    try:
        subprocess.run(["head", "-c", "0"], stdin=r, timeout=10, check=True)
        os.close(r)
        r = -1
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(w)
        if r >= 0:
            os.close(r)


@pytest.mark.parametrize("extra", [(), ("--json",), ("validate-config",)])
def test_a_reader_that_closes_early_ends_the_command_quietly(tmp_path, extra):
    """`sla-guard check ... | head -1`: the table met a closed pipe and Python printed a
    BrokenPipeError traceback. It now stops as a tool SIGPIPE ended does: nothing on stderr, exit 141."""
    e = Engine()
    for _ in range(6):
        e.request(0.2, 0.01)
    s = Served(e.exposition)
    f = tmp_path / "guard.yaml"
    f.write_text(yaml.safe_dump(_cfg([(s, "decode")])))
    cmd = ["validate-config", str(f)] if extra == ("validate-config",) else ["check", "--config", str(f), *extra]
    try:
        r = run_into_closed_reader([sys.executable, "-m", "sla_guard.cli", *cmd])
    finally:
        s.stop()
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_check_says_why_each_pool_is_unknown(tmp_path):
    """The table said "1 of 1 targets down" for a pool whose target timed out, served a malformed
    page or went over a series limit; the cause was only on stderr, one line per target, apart
    from the pool. Each pool's NOTE (and ``--json``'s reason) names its target's failure and fix,
    and the exit is 2, never 0."""
    e = Engine()
    for _ in range(10):
        e.request(0.2, 0.01)
    slow, bad, big = Served(e.exposition), Served(lambda: "slaguard_oops{{{ 1\n"), Served(e.exposition)
    slow.mode, slow.slow_s = "slow", 2.0
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    cfg = _cfg([])
    cfg["source"]["timeout_s"] = 0.5
    cfg["source"]["targets"] = [{"url": u, "model": m, "pool": "decode", "name": m} for u, m in (
        (slow.url, "slow"), (bad.url, "bad"), (big.url, "big"), (dead, "dead"))]
    cfg["retention"] = {"max_series_per_target": 10}
    try:
        for extra in ((), ("--json",)):
            r = _check(cfg, tmp_path, *extra)
            assert r.returncode == 2, r.stdout + r.stderr
            if extra:
                import json

                why = {p["model"]: p["reason"] for p in json.loads(r.stdout)["pools"]}
            else:
                why = {m: cells[9] for (m, _), cells in _rows(r.stdout, (0, 2)).items()}
            assert why["slow"] == "1 of 1 targets down (slow: timeout: no complete answer within 0.5s)", why
            assert why["bad"].startswith("1 of 1 targets down (bad: parse: malformed exposition"), why
            assert "slaguard_oops{{{" in why["bad"], why
            assert why["big"].startswith("1 of 1 targets down (big: series_limit: "), why
            assert "retention.max_series_per_target (10)" in why["big"], why
            assert why["dead"].startswith("1 of 1 targets down (dead: connect: "), why
    finally:
        for s in (slow, bad, big):
            s.stop()



def test_an_availability_row_reads_as_a_share_of_requests_without_a_threshold(tmp_path):
    """`sla-guard check` on a proxy's page: the availability objective has no latency threshold, so its
    row names the target and the indicator ("99.9% availability"), the value is the share not failed,
    and REQUESTS counts ok + error only (the clients' own 4xx and aborts are in neither part)."""
    from guard_support import Router

    r = Router()
    for _ in range(10):
        r.request(0.1, 0.01)
    r.failed(2, 0)
    r.ended("client_error", 5)
    r.ended("aborted", 3)
    s = Served(r.exposition)
    cfg = {"source": {"mode": "scrape", "timeout_s": 2, "targets": [{"url": s.url, "model": "m", "pool": "client"}]},
           "slos": [{"pool": "client", "objectives": [
               {"name": "ttft_mean", "indicator": "ttft", "objective": "mean", "threshold_s": 2.5, "min_requests": 5},
               {"name": "availability", "indicator": "availability", "objective": "attainment", "target": 0.999,
                "min_requests": 5}]}]}
    try:
        out = _check(cfg, tmp_path)
    finally:
        s.stop()
    assert out.returncode == 1, out.stdout + out.stderr
    row = _rows(out.stdout)[("client", "availability")]
    assert row[3:6] == ["99.9% availability", f"{100 * 10 / 12:.2f}%", "12"], row
    assert row[8] == "violated" and "2 of 12 requests failed by the service (outcome=error)" in row[9], row


def _vllm_beside(e: Engine, *, hook_records: bool) -> Served:
    """A plugin page: the hook's contract series (``e``) beside vLLM's own token counter, which
    rises at every scrape; the hook records those steps only if ``hook_records``."""
    tokens = [0]

    def page() -> str:
        tokens[0] += 80
        if hook_records:
            for _ in range(10):
                e.request(0.5, 0.01)
        return e.exposition() + ("# TYPE vllm:generation_tokens counter\n"
                                 f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens[0]}\n')

    return Served(page)


@pytest.mark.parametrize("hook_records", [False, True])
def test_check_wait_sees_a_hook_that_stopped_recording(tmp_path, hook_records):
    """``check --wait`` scraped twice, and the scraper's ``hook_stalled`` check needs three good
    scrapes (the last ``HOOK_LAG_S`` after the second): vLLM's counter rising while the hook's stood
    still read as an idle engine ("too few requests"), the frozen hook never named. A wait over
    ``CHECK_STALL_WAIT_S`` scrapes a third time: the target is down, ``hook_stalled``, naming why.
    A hook that records the same steps is no stall: ok."""
    from exporters import contract as c
    from sla_guard.service import CHECK_STALL_WAIT_S

    e = Engine()
    for _ in range(10):
        e.request(0.5, 0.01)
    s = _vllm_beside(e, hook_records=hook_records)
    try:
        r = _check(_cfg([(s, "decode")]), tmp_path, "--wait", f"{CHECK_STALL_WAIT_S + 1:g}")
        hits = s.hits
    finally:
        s.stop()
    if hook_records:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "hook_stalled" not in r.stdout + r.stderr
    else:
        assert r.returncode == 2, r.stdout + r.stderr
        assert "down: hook_stalled: the hook stopped recording" in r.stderr, r.stdout + r.stderr
        assert f"{c.GENERATION_TOKENS.series()} did not move" in r.stderr or c.ENGINE_STEPS.series() in r.stderr
        row = _rows(r.stdout)[("decode", "ttft_mean")]
        assert row[8] == "unknown" and "1 of 1 targets down" in r.stdout and "hook_stalled" in r.stdout, r.stdout
    assert hits == 3, hits


def test_a_quick_check_scrapes_once_and_a_short_wait_twice(tmp_path):
    """The third scrape costs no time and only comes with a wait that leaves room for it."""
    from sla_guard.service import CHECK_STALL_WAIT_S

    e = Engine()
    for _ in range(10):
        e.request(0.5, 0.01)
    s = _vllm_beside(e, hook_records=True)
    try:
        hits = []
        for wait in ("0", f"{CHECK_STALL_WAIT_S:g}"):
            r = _check(_cfg([(s, "decode")]), tmp_path, "--wait", wait)
            assert r.returncode == 0, r.stdout + r.stderr
            hits.append(s.hits - sum(hits))
    finally:
        s.stop()
    assert hits == [1, 2]
