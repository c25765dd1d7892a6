"""Trace readers on the shared traces (and the bundled Mooncake copy), and their error messages."""

from __future__ import annotations

import gzip
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
    with pytest.raises(TraceError, match="header must have columns"):
        read_azure(c)
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceError, match=r"a.csv:2: field 'TIMESTAMP'"):
        read_azure(c)
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-500,44\n")
    with pytest.raises(TraceError, match=r"a.csv:2: ContextTokens and GeneratedTokens must be >= 0"):
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
