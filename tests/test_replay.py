"""`sla-guard replay`: one JSON line of results on both shared traces, policies, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sla_guard.cli import main
from sla_guard.sim.traces import BUNDLED_MOONCAKE

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"
KEYS = {"requests", "slo_attainment", "ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "gpu_hours",
        "scaling_actions", "finished", "aborted", "unfinished"}


def _replay(capsys, *args: str) -> dict:
    assert main(["replay", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # exactly one line
    return json.loads(out[0])


def test_replay_mooncake_json_line(capsys, tmp_path):
    line = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "300", "--out", str(tmp_path))
    assert set(line) >= KEYS
    assert line["requests"] == line["finished"] > 500
    assert 0 < line["slo_attainment"] <= 1
    assert 0 < line["ttft_p50_s"] <= line["ttft_p90_s"]
    assert 0 < line["tpot_mean_s"] < 0.05
    # 4 replicas x 16 GPUs for 300 s of trace + 600 s drain
    assert line["gpu_hours"] == pytest.approx(4 * 16 * 900 / 3600, rel=1e-3)
    assert line["scaling_actions"] == 0 and line["policy"] == "static"
    assert line["guard_status"] in ("ok", "at_risk", "violated", "unknown")
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == line["requests"]
    assert (tmp_path / "timeline.csv").read_text().startswith("t_s,")


def test_replay_is_deterministic_and_speed_scales_load(capsys):
    a = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "200", "--no-metrics")
    b = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "200", "--no-metrics")
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    fast = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "200", "--speed", "2", "--no-metrics")
    assert fast["requests"] > 1.7 * a["requests"]


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_replay_azure(capsys):
    line = _replay(capsys, "--trace", str(AZURE), "--duration", "300")
    assert line["requests"] == line["finished"] > 1000
    assert line["slo_attainment"] > 0.9  # short conversation prompts on 2P2D of the default profile


def test_replay_policy_can_scale(capsys):
    """A policy that acts is applied with cold start and counted; ``queue`` is the advisor's KEDA baseline."""
    line = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "600", "--policy", "queue",
                   "--prefill", "1", "--decode", "1")
    assert line["policy"] == "queue"
    assert line["requests"] == line["finished"] + line["aborted"] + line["unfinished"]


def test_replay_bad_input(capsys, tmp_path):
    assert main(["replay", "--trace", str(BUNDLED_MOONCAKE), "--policy", "nope"]) == 2
    assert "unknown policy 'nope'; choose one of:" in capsys.readouterr().err
    assert main(["replay", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["replay", "--trace", str(BUNDLED_MOONCAKE), "--fault", '{"kind": "meteor"}']) == 2
    assert "fault kind 'meteor' unknown" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "needle"), [
    (["--speed", "inf"], "--speed: 'inf': must be a finite number > 0"),  # a traceback before
    (["--speed", "nan"], "--speed: 'nan': must be a finite number > 0"),  # exit 0, nothing replayed
    (["--scrape-interval", "0"], "--scrape-interval: '0'"),  # ZeroDivisionError
    (["--scrape-interval", "-1"], "--scrape-interval: '-1'"),  # never ended
    (["--drain-s", "-1000"], "--drain-s: '-1000': must be a finite number >= 0"),
    (["--max-replicas", "0"], "--max-replicas: '0'"),
    (["--min-replicas", "5", "--max-replicas", "2"], "--min-replicas 5 is over --max-replicas 2"),
    # the start ran over the limits until the policy first changed that pool
    (["--prefill", "5", "--max-replicas", "2"], "--prefill 5 is outside --min-replicas 1 .. --max-replicas 2"),
    (["--gpu-budget", "32"], "the start (2P2D x 16 GPUs = 64) is over --gpu-budget 32"),
    (["--slo-ttft", "2500"], "--slo-ttft: threshold_s 2500 is over 160 s"),  # ms for s: every breach "ok"
    (["--slo-tpot", "20"], "a 20 ms threshold is threshold_s: 0.02"),
])
def test_replay_refuses_numbers_it_cannot_replay(capsys, args, needle):
    try:
        code = main(["replay", "--trace", str(BUNDLED_MOONCAKE), "--duration", "60", *args])
    except SystemExit as stop:  # argparse's own refusal
        code = stop.code
    assert code == 2 and needle in capsys.readouterr().err


def test_prompts_over_max_model_len_are_refused_at_once_as_vllm_does(capsys, tmp_path):
    """vLLM answers a prompt plus max_tokens over max_model_len (the default profile's 400k) with a
    400 before any work. The simulator used to queue and prefill them: minutes of TTFT charged to
    the SLA and to the scaling decision. Now they count apart (``rejected``), outside attainment."""
    rows = [{"timestamp": 1000 * i, "input_length": 500_000 if i % 3 == 0 else 2000, "output_length": 100,
             "hash_ids": []} for i in range(30)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _replay(capsys, "--trace", str(tmp_path / "t.jsonl"))
    assert line["rejected"] == 10 and line["finished"] == 20 and line["unfinished"] == 0
    assert line["ttft_p90_s"] < 1.0 and line["slo_attainment"] == 1.0


def _trace_rows(n: int = 20) -> str:
    return "".join(json.dumps({"timestamp": 1000 * i, "input_length": 2000, "output_length": 100, "hash_ids": [i]})
                   + "\n" for i in range(n))


def test_replay_reads_a_file_named_agentic(capsys, tmp_path, monkeypatch):
    """`--trace agentic_runs.jsonl` (a relative path) was taken for 'agentic' and replaced, without
    a word, by 40 generated sessions; a missing agentic-old.csv replayed them with exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agentic_runs.jsonl").write_text(_trace_rows(20))
    line = _replay(capsys, "--trace", "agentic_runs.jsonl", "--no-metrics", "--drain-s", "60")
    assert line["trace"] == "agentic_runs" and line["requests"] == 20
    assert main(["replay", "--trace", "agentic-old.csv", "--no-metrics"]) == 2
    assert "cannot read trace agentic-old.csv" in capsys.readouterr().err
    assert main(["replay", "--trace", "agentic:many", "--no-metrics"]) == 2  # int()'s ValueError before
    assert "N in 'agentic:N' must be a number of sessions >= 1, got 'many'" in capsys.readouterr().err


def test_replay_reads_traces_with_a_byte_order_mark(capsys, tmp_path):
    """A trace saved with a byte-order mark was refused: line 1 "not JSON", or an Azure header
    without 'TIMESTAMP'."""
    (tmp_path / "bom.jsonl").write_text("\ufeff" + _trace_rows(20))
    (tmp_path / "bom.csv").write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:{i:02d}.1234567,1000,100\n" for i in range(30)))
    assert _replay(capsys, "--trace", str(tmp_path / "bom.jsonl"), "--no-metrics", "--drain-s", "60")["requests"] == 20
    assert _replay(capsys, "--trace", str(tmp_path / "bom.csv"), "--no-metrics", "--drain-s", "60")["requests"] == 30


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("big.jsonl", '{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 5}\n',
     "big.jsonl:1: field 'timestamp' must be a finite number"),  # OverflowError
    ("short.csv", "ContextTokens,GeneratedTokens,TIMESTAMP\n10,5,2023-11-16 18:00:00\n10,5\n",
     "short.csv:3: missing field 'TIMESTAMP'"),  # AttributeError on None
])
def test_replay_bad_trace_rows_are_named_not_a_traceback(capsys, tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    assert main(["replay", "--trace", str(tmp_path / name), "--no-metrics"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(("fault", "needle"), [
    ("[1]", "must be a JSON object"),  # passed over: the replay ran without a fault
    ('"leak"', "must be a JSON object"),
    ('{"kind": "leak", "replica": "d0", "mib_per_hour": "lots"}', "field 'mib_per_hour' must be a finite number"),
    ('{"kind": "leak", "replica": "d0", "mib_per_hour": NaN}', "field 'mib_per_hour' must be a finite number"),
    ('{"kind": "crash", "replica": 0, "at_s": 30}', "field 'replica' must be a string"),
    # matched no replica or process: the replay ran without them
    ('{"kind": "leak", "replica": "decode-0"}', "replica 'decode-0' is no replica of the deployment"),
    ('{"kind": "crash", "replica": "D0", "at_s": 5}', "name one as p0, p1, d0, d1"),
    ('{"kind": "acceptance_drift", "replica": "p0", "start_s": 0, "end_s": 9}', "'p0' is no decode replica"),
    ('{"kind": "leak", "replica": "d0", "role": "enginecore"}', "role 'enginecore' is no process of profile"),
    # each request copied that often up front: 1e300 ran until memory ran out
    ('{"kind": "load_spike", "start_s": 0, "end_s": 9, "factor": 1001}', "factor 1001 is over 1000"),
])
def test_replay_refuses_a_fault_it_would_not_inject(capsys, tmp_path, fault, needle):
    (tmp_path / "t.jsonl").write_text(_trace_rows(5))
    assert main(["replay", "--trace", str(tmp_path / "t.jsonl"), "--fault", fault, "--duration", "10"]) == 2
    assert needle in capsys.readouterr().err


def test_replay_refuses_an_out_it_cannot_write_before_replaying(capsys, tmp_path):
    """--out naming a file was a FileExistsError traceback after the replay, its results lost."""
    (tmp_path / "t.jsonl").write_text(_trace_rows(5))
    (tmp_path / "out").write_text("")
    assert main(["replay", "--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "out"), "--no-metrics"]) == 2
    captured = capsys.readouterr()
    assert "--out" in captured.err and "cannot make this directory" in captured.err and captured.out == ""


def test_replay_guard_can_say_ok(capsys):
    """Every objective met must read ok: the simulated guard judges TTFT at the client and TPOT on
    decode, leaving the prefill pool without objectives. That pool was unknown, and so was the
    overall verdict on every tick of every run (all objectives ok, 40 ticks of 40 unknown): a pool
    without objectives now has no say in the verdict (``SLOEvaluator.overall``)."""
    line = _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "600", "--drain-s", "0",
                   "--slo-ttft", "40", "--slo-tpot", "0.1")
    assert line["guard_status"] == "ok" and line["guard_ticks"]["ok"] > 30, line  # the first: no data yet


def test_replay_burstgpt_file_counts_failed_rows(capsys, tmp_path):
    """A BurstGPT CSV (Timestamp in s, Request/Response tokens) was refused for its column names; its
    failed requests (0 Response tokens) are skipped and counted in rows_skipped."""
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{2 * k},ChatGPT,{600 + k},{0 if k % 10 == 3 else 150},{750 + k},Conversation log\n" for k in range(60)))
    line = _replay(capsys, "--trace", str(p), "--duration", "60", "--policy", "static", "--drain-s", "60")
    assert line["trace"] == "BurstGPT_1" and line["policy"] == "static"
    assert line["rows_skipped"] == 6  # k = 3, 13, ..., 53: of the whole file
    assert line["requests"] == line["finished"] == 31 - 3  # t = 0..60 s, less the failed k = 3, 13, 23
    assert _replay(capsys, "--trace", str(BUNDLED_MOONCAKE), "--duration", "10", "--no-metrics")["rows_skipped"] == 0


def test_replay_rate_places_a_trace_without_times(capsys, tmp_path):
    """prompt_len/output_len rows have no arrival times: refused with the fix, replayed with --rate."""
    p = tmp_path / "vllm.jsonl"
    p.write_text("".join(json.dumps({"prompt_len": 1000, "output_len": 100}) + "\n" for _ in range(40)))
    assert main(["replay", "--trace", str(p), "--no-metrics"]) == 2
    assert "no arrival time column among ['prompt_len', 'output_len']" in capsys.readouterr().err
    line = _replay(capsys, "--trace", str(p), "--rate", "2", "--no-metrics", "--drain-s", "60")
    assert line["requests"] == line["finished"] == 40
    assert main(["replay", "--trace", str(BUNDLED_MOONCAKE), "--rate", "2", "--no-metrics"]) == 2
    assert "--rate is for traces without arrival times" in capsys.readouterr().err


def test_replay_help_names_every_policy(capsys, monkeypatch):
    """--help named 4 of the 8 policies; the names are spelled out there (no simulator import at start)."""
    from sla_guard.sim.policy import policy_names

    monkeypatch.setenv("COLUMNS", "1000")  # argparse would break "planner-throughput" at its hyphen
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    missing = [n for n in policy_names() if n not in text]
    assert not missing, missing
