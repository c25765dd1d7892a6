"""Trace readers on the shared traces (and the bundled Mooncake copy), and their error messages."""

from __future__ import annotations

import gzip
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sla_guard.sim.traces import BUNDLED_MOONCAKE, TraceError, load_trace, read_azure, read_mooncake

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"
AZURE = SHARED / "azure_llm_2023_conv.csv"


def test_bundled_mooncake_is_the_release():
    tr = read_mooncake(BUNDLED_MOONCAKE)
    assert len(tr.requests) == 12_031
    assert 3500 < tr.duration_s < 3600
    mean_in = sum(r.input_len for r in tr.requests) / len(tr.requests)
    mean_out = sum(r.output_len for r in tr.requests) / len(tr.requests)
    assert 11_900 < mean_in < 12_200 and 330 < mean_out < 360  # README: mean input 12,035, output 343
    assert tr.block_tokens == 512
    # hash blocks cover the prompt: ceil(input / 512) blocks
    assert all(len(r.hash_ids) == -(-r.input_len // 512) for r in tr.requests[:500])


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not present (../shared/traces)")
def test_shared_mooncake_matches_bundled():
    a, b = read_mooncake(MOONCAKE), read_mooncake(BUNDLED_MOONCAKE)
    assert a.requests == b.requests


@pytest.mark.skipif(not AZURE.exists(), reason="shared traces not present (../shared/traces)")
def test_shared_azure():
    tr = load_trace(AZURE)
    assert len(tr.requests) == 19_366
    assert 3400 < tr.duration_s < 3700
    assert tr.requests[0].t == 0 and all(a.t <= b.t for a, b in zip(tr.requests, tr.requests[1:], strict=False))
    assert all(not r.hash_ids for r in tr.requests)


def test_scaling_and_cut():
    tr = read_mooncake(BUNDLED_MOONCAKE)
    half = tr.scaled(time_scale=0.5, duration_s=600)
    assert half.duration_s <= 600
    assert len(half.requests) == sum(1 for r in tr.requests if r.t * 0.5 <= 600)
    thin = tr.scaled(rate_scale=0.25, duration_s=600)
    assert abs(len(thin.requests) - len(tr.scaled(duration_s=600).requests) / 4) <= 1


def test_errors_name_line_and_field(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                 '{"timestamp": 5, "input_length": "x", "output_length": 5}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: field 'input_length' must be a finite number"):
        read_mooncake(p)
    for bad in ("Infinity", "NaN"):  # json takes both; int() overflowed on one and gave no line on the other
        p.write_text(f'{{"timestamp": 0, "input_length": {bad}, "output_length": 5}}\n')
        with pytest.raises(TraceError, match=r"t.jsonl:1: field 'input_length' must be a finite number"):
            read_mooncake(p)
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceError, match=r"cannot read trace .*bad.jsonl.gz"):
        read_mooncake(tmp_path / "bad.jsonl.gz")
    p.write_bytes(b"\xff\xfe\x00 not text\n")
    with pytest.raises(TraceError, match=r"cannot read trace .*t.jsonl"):
        read_mooncake(p)
    p.write_text("not json\n")
    with pytest.raises(TraceError, match=r":1: not JSON"):
        read_mooncake(p)
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write('{"timestamp": 1000, "input_length": 10, "output_length": 5}\n')
    assert load_trace(gz).requests[0].input_len == 10
    c = tmp_path / "a.csv"
    c.write_text("TIMESTAMP,Context\n2023-11-16 18:15:46.6805900,374\n")
    with pytest.raises(TraceError, match=r"no input length column among \['TIMESTAMP', 'Context'\]; name it one of"):
        read_azure(c)
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceError, match=r"a.csv:2: field 'TIMESTAMP'"):
        read_azure(c)
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-500,44\n")
    with pytest.raises(TraceError, match=r"a.csv:2: field 'ContextTokens' must be a finite number >= 0"):
        read_azure(c)  # clamped to 1 before, where the Mooncake reader refused the same row
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(tmp_path / "x.parquet")
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")


def test_a_looped_pass_gets_its_own_prefixes():
    """The demo loops the trace: each pass shifts the prefix hashes past the previous pass's, so
    the second hour is not served from the first hour's cache."""
    tr = load_trace(str(BUNDLED_MOONCAKE)).scaled(duration_s=300)
    second = tr.with_hash_offset(tr.max_hash() + 1)
    assert [r.t for r in second.requests] == [r.t for r in tr.requests]
    assert [r.input_len for r in second.requests] == [r.input_len for r in tr.requests]
    first_hashes = {h for r in tr.requests for h in r.hash_ids}
    assert first_hashes and not first_hashes & {h for r in second.requests for h in r.hash_ids}
    assert tr.with_hash_offset(0) is tr


# The same five requests (one a failure: 0 output tokens) as each source writes them.
ROWS = [(5, 472, 18), (45, 1087, 231), (118, 417, 0), (134, 1360, 195), (134, 90, 7)]


def _mooncake(tmp_path: Path) -> list:
    """The reference: the requests as a Mooncake file gives them (the failed one left out)."""
    p = tmp_path / "ref.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t * 1000, "input_length": i, "output_length": o}) + "\n"
                         for t, i, o in ROWS if o))
    return list(read_mooncake(p).requests)


def test_burstgpt_reads_as_its_mooncake_twin_and_counts_failures(tmp_path):
    """BurstGPT's CSV (Timestamp in s from the start; a failed request has 0 Response tokens, which its
    without_fails files leave out) was refused for its column names."""
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    full, clean = tmp_path / "BurstGPT_1.csv", tmp_path / "BurstGPT_without_fails_1.csv"
    full.write_text(head + "".join(f"{t},ChatGPT,{i},{o},{i + o},Conversation log\n" for t, i, o in ROWS))
    clean.write_text(head + "".join(f"{t},GPT-4,{i},{o},{i + o},API log\n" for t, i, o in ROWS if o))
    a, b = load_trace(full), load_trace(clean)
    assert list(a.requests) == list(b.requests) == _mooncake(tmp_path)
    assert (a.skipped, b.skipped) == (1, 0)
    assert a.scaled(duration_s=100).skipped == 1  # carried through the replay's cut


def test_azure_2024_reads_as_2023_in_any_time_zone(tmp_path, monkeypatch):
    """Azure 2024 writes TIMESTAMP with +00:00, without a fraction when it is 0. The reader cut the
    fraction with the offset and read the rest in the machine's zone: in New York the rows without
    a fraction came 4 hours after the others (14399 s)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        base = datetime(2024, 5, 10, 0, 0, 0, tzinfo=UTC)
        rows = [r for r in ROWS if r[2]]
        at = [base + timedelta(seconds=t, microseconds=9930 if k % 2 else 0) for k, (t, _, _) in enumerate(rows)]
        new, old = tmp_path / "AzureLLMInferenceTrace_code_1week.csv", tmp_path / "AzureLLMInferenceTrace_code.csv"
        new.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                       + "".join(f"{d},{i},{o}\n" for d, (_, i, o) in zip(at, rows, strict=True)))
        old.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"{d.replace(tzinfo=None).isoformat(' ', 'microseconds')}0,{i},{o}\n"  # 7 digits, no offset
            for d, (_, i, o) in zip(at, rows, strict=True)))
        a, b = load_trace(new), load_trace(old)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert "2024-05-10 00:00:05+00:00" in new.read_text()  # as Python writes a time without a fraction
    assert [(round(r.t, 5), r.input_len, r.output_len) for r in a.requests] == sorted(
        (t + (0.00993 if k % 2 else 0) - 5, i, o) for k, (t, i, o) in enumerate(rows))
    assert a.requests == b.requests and a.duration_s < 130


@pytest.mark.parametrize(("name", "text"), [
    # Mooncake's toolagent / arxiv traces and aiperf's mooncake_trace: timestamp in ms
    ("toolagent_trace.jsonl", lambda t, i, o: {"timestamp": t * 1000, "input_length": i, "output_length": o}),
    ("aiperf.jsonl", lambda t, i, o: {"session_id": f"s{i % 2}", "timestamp": t * 1000, "input_length": i,
                                      "output_length": o, "hash_ids": []}),
    # benchmark logs: epoch seconds, ms, or a date-time, under their own names
    ("log.jsonl", lambda t, i, o: {"timestamp": 1_717_000_000 + t, "prompt_tokens": i, "completion_tokens": o}),
    ("log_ms.jsonl", lambda t, i, o: {"arrival_time_ms": 1_717_000_000_000 + t * 1000, "input_tokens": i,
                                      "output_tokens": o}),
    ("dates.jsonl", lambda t, i, o: {"created_at": f"2024-06-01T10:{t // 60:02d}:{t % 60:02d}Z", "input_len": i,
                                     "output_len": o}),
    ("generic.csv", "arrival_time,input_tokens,output_tokens\n{t}.0,{i},{o}\n"),
    ("ms.csv", "timestamp_ms,prompt_tokens,completion_tokens\n{t}000,{i},{o}\n"),
    ("epoch.csv", "Arrival Timestamp,Prompt Tokens,Completion Tokens\n{e}.25,{i},{o}\n"),
    ("array.json", None),  # one JSON array, as dataset dumps are
])
def test_other_sources_read_as_their_mooncake_twin(tmp_path, name, text):
    """Columns named as other generators and datasets name them were refused ("missing field
    'input_length'", "header must have columns ..."); now each reads as the same requests."""
    p = tmp_path / name
    if text is None:
        p.write_text(json.dumps([{"timestamp": t * 1000, "input_length": i, "output_length": o} for t, i, o in ROWS]))
    elif isinstance(text, str):
        head, row = text.splitlines()
        p.write_text(head + "\n" + "".join(row.format(t=t, i=i, o=o, e=1_717_000_000 + t) + "\n" for t, i, o in ROWS))
    else:
        p.write_text("".join(json.dumps(text(t, i, o)) + "\n" for t, i, o in ROWS))
    tr = load_trace(p)
    assert [(r.t, r.input_len, r.output_len) for r in tr.requests] == [
        (r.t, r.input_len, r.output_len) for r in _mooncake(tmp_path)]
    assert tr.skipped == 1
    if name == "aiperf.jsonl":
        assert [r.session for r in tr.requests] == [0, 1, 0, 0]  # s0, s1, s0, s0


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("vllm.jsonl", '{"prompt_len": 300, "output_len": 40}\n',
     r"no arrival time column among \['prompt_len', 'output_len'\]; name it one of \['timestamp', "
     r"'arrival_time'.*Poisson rate \(replay --rate R\)"),
    ("t.csv", "ts,isl,osl\n0,10,5\n",
     r"no input length column among \['ts', 'isl', 'osl'\]; name it one of \['input_length', .*'Request tokens'\]"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 10, "max_tokens": 5}\n',
     r"no output length column among \['timestamp', 'input_length', 'max_tokens'\]"),
    ("two.csv", "timestamp,arrival_time,input_tokens,output_tokens\n0,0,10,5\n",
     r"columns \['timestamp', 'arrival_time'\] all read as the arrival time; keep one"),
    ("delay.jsonl", '{"session_id": "a", "timestamp": 0, "input_length": 9, "output_length": 5}\n'
                    '{"session_id": "a", "delay": 2000, "input_length": 9, "output_length": 5}\n',
     r"delay.jsonl:2: missing field 'timestamp' \('delay' follows the previous answer"),
    ("mixed.csv", "created_at,input_tokens,output_tokens\n2024-05-10 00:00:01,10,5\n7,10,5\n",
     r"field 'created_at' mixes date-times and numbers"),
    ("portal.csv", "timestamp,input_tokens,output_tokens\n\"8/18/2025, 12:00:38.941 AM\",10,5\n",
     r"portal.csv:2: field 'timestamp' is not a date-time or a number: '8/18/2025"),
    ("fails.csv", "Timestamp,Request tokens,Response tokens\n1,10,0\n", r"no requests \(1 rows with 0 output"),
])
def test_traces_it_cannot_read_are_refused_naming_fields(tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    with pytest.raises(TraceError, match=needle):
        load_trace(tmp_path / name)


def test_rate_gives_a_trace_without_times_poisson_arrivals(tmp_path):
    """vLLM-style benchmark rows (prompt_len, output_len) have no arrival times: ``rate`` places them."""
    p = tmp_path / "vllm.jsonl"
    p.write_text("".join(json.dumps({"prompt_len": 100 + k, "output_len": 10}) + "\n" for k in range(2000)))
    tr = load_trace(p, rate=4.0)
    assert [r.input_len for r in tr.requests] == list(range(100, 2100))  # in file order
    assert tr.requests[0].t == 0 and all(a.t < b.t for a, b in zip(tr.requests, tr.requests[1:], strict=False))
    assert 0.23 < tr.duration_s / 1999 < 0.27  # mean gap 1/4 s
    assert load_trace(p, rate=4.0).requests == tr.requests != load_trace(p, rate=4.0, seed=1).requests
    with pytest.raises(TraceError, match=r"--rate is for traces without arrival times and this one has 'timestamp'"):
        load_trace(BUNDLED_MOONCAKE, rate=4.0)
