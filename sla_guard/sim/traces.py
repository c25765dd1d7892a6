"""Request traces: JSON lines and CSV files whose columns are found by name (Mooncake, aiperf,
Azure 2023/2024, BurstGPT, benchmark logs: ``FIELDS``), and a generator of agentic coding sessions.

Every reader returns a :class:`Trace`: requests sorted by arrival (seconds from the trace's start)
with prompt/output lengths and, when the source has them, prefix-block hashes (equal hash at the
same position = shared prefix block of ``block_tokens`` tokens). Bad input raises
:class:`TraceError` naming the file, line and field.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import itertools
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from sla_guard.epoch import SECONDS_PER, epoch_unit


class TraceError(ValueError):
    """A trace that cannot be read; the message says where and what to fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # arrival, seconds from the start of the trace
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # prefix blocks; empty = no prefix information
    session: int = -1
    agent: int = -1  # generated traces: one id per (sub-)agent of a session


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int = 512  # tokens per hash block
    skipped: int = 0  # rows of the file that were no request (0 output tokens: a failed request)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0

    def scaled(self, time_scale: float = 1.0, duration_s: float | None = None,
               rate_scale: float = 1.0) -> Trace:
        """Time-scaled copy: arrival times x ``time_scale`` (0.5 = twice the rate), cut at
        ``duration_s`` (after scaling); ``rate_scale`` < 1 thins requests deterministically."""
        if time_scale <= 0:
            raise TraceError("time_scale must be > 0")
        out = []
        acc = 0.0
        for r in self.requests:
            acc += rate_scale
            if acc < 1.0:
                continue
            acc -= 1.0
            t = r.t * time_scale
            if duration_s is not None and t > duration_s:
                break
            out.append(replace(r, t=t))
        return replace(self, requests=tuple(out))

    def with_hash_offset(self, offset: int) -> Trace:
        """Copy whose prefix-block hashes are shifted by ``offset``: the same arrivals and lengths
        with prefixes no earlier copy shares. A trace replayed twice in a row is new
        conversations the second time, not the first ones again with every prefix cached."""
        if offset == 0:
            return self
        return replace(self, requests=tuple(replace(r, hash_ids=tuple(h + offset for h in r.hash_ids))
                                            for r in self.requests))

    def max_hash(self) -> int:
        """Largest prefix-block hash (-1 without prefix information)."""
        return max((max(r.hash_ids) for r in self.requests if r.hash_ids), default=-1)


# Each field of a request and the column names it is found under in the traces in use (Mooncake,
# aiperf/genai-perf mooncake_trace, Azure 2023/2024, BurstGPT, vLLM-style and generic benchmark
# logs). A column matches in any case, with or without spaces, underscores or dashes. No bare
# "time" or "duration": in benchmark logs that is often a latency, not an arrival.
FIELDS: dict[str, tuple[str, ...]] = {
    "arrival time": ("timestamp", "arrival_time", "arrival_timestamp", "timestamp_ms", "arrival_time_ms",
                     "timestamp_s", "arrival_time_s", "created_at", "created"),
    "input length": ("input_length", "input_len", "input_tokens", "prompt_tokens", "prompt_len", "prompt_length",
                     "ContextTokens", "Request tokens"),
    "output length": ("output_length", "output_len", "output_tokens", "completion_tokens", "expected_output_len",
                      "GeneratedTokens", "Response tokens"),
    "hash_ids": ("hash_ids",),
    "session": ("session_id", "session", "conversation_id"),
}
# Units per second of the time columns named with their unit; the others: _time_unit.
_TIME_UNIT = {"timestampms": 1000.0, "arrivaltimems": 1000.0, "timestamps": 1.0, "arrivaltimes": 1.0}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_ALIASES = {field: {_norm(a) for a in names} for field, names in FIELDS.items()}


def _columns(p: Path, names: list[str]) -> dict[str, str | None]:
    """The file's column for each field (None: absent). A file without lengths is refused with the
    names it has and the names accepted; two columns for one field are refused, not guessed."""
    cols: dict[str, str | None] = {}
    for field, aliases in _ALIASES.items():
        hits = [n for n in names if _norm(n) in aliases]
        if len(hits) > 1:
            raise TraceError(f"{p}: columns {hits} all read as the {field}; keep one")
        cols[field] = hits[0] if hits else None
    for field in ("input length", "output length"):
        if cols[field] is None:
            raise TraceError(f"{p}: no {field} column among {names}; name it one of {list(FIELDS[field])} "
                             f"(any case; spaces or underscores alike)")
    return cols


def _length(v: object, col: str, where: str) -> int:
    """A token count: a JSON number or a CSV cell ("472", "472.0")."""
    if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) < 19:  # the usual CSV cell, cheaply
        return int(v)
    if isinstance(v, str):
        with contextlib.suppress(ValueError):  # not a number: refused below, named
            v = float(v)
    # NaN and Infinity (which json accepts) fail the finite test, not int()'s OverflowError; an integer
    # past a float's range (json reads any number of digits) fails it too, not with math's OverflowError
    if (isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, int) and abs(v) > 2**63)
            or not math.isfinite(v) or v < 0):
        raise TraceError(f"{where}: field {col!r} must be a finite number >= 0, got {v!r}")
    return int(v)


def _time(v: object, col: str, where: str) -> tuple[float, bool]:
    """An arrival as (value, is a date-time): a number in the column's unit, or an ISO date-time in
    seconds since 1970 (fromisoformat cuts Azure 2023's 7 fractional digits to 6). Without an offset
    it is UTC, as Azure's traces are, whatever the machine's zone: read as local time, the 2024
    rows whose fraction was cut lost their +00:00 and those without a fraction kept it, hours apart."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            try:
                d = datetime.fromisoformat(v.strip())
            except ValueError:
                raise TraceError(f"{where}: field {col!r} is not a date-time or a number: {v!r}") from None
            return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp(), True
    if (isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, int) and abs(v) > 2**63)
            or not math.isfinite(v) or v < 0):
        raise TraceError(f"{where}: field {col!r} must be a finite number >= 0 or a date-time, got {v!r}")
    return float(v), False


def _time_unit(col: str, json_lines: bool, lo: float, hi: float) -> float:
    """Units per second of a numeric time column: by its name where that says the unit
    (timestamp_ms, arrival_time_s); else seconds, milliseconds, micro- or nanoseconds since 1970,
    whichever makes all its values dates of 2000-2100; else milliseconds for a JSON lines
    ``timestamp`` (Mooncake, aiperf) and seconds otherwise (BurstGPT's Timestamp, arrival_time)."""
    if _norm(col) in _TIME_UNIT:
        return _TIME_UNIT[_norm(col)]
    if (unit := epoch_unit(lo, hi)) is not None:
        return 1.0 / SECONDS_PER[unit]
    return 1000.0 if json_lines and _norm(col) == "timestamp" else 1.0


def _hashes(v: object, where: str) -> tuple[int, ...]:
    if isinstance(v, str):  # a CSV cell holding a JSON list
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: refused below, named
            v = json.loads(v)
    if not isinstance(v, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
    return tuple(v)


def _requests(p: Path, name: str, rows: Iterator[tuple[str, dict]], names: list[str] | None, json_lines: bool,
              limit: int | None, rate: float | None, seed: int) -> Trace:
    """Requests from rows of a JSON lines or CSV file, its columns found by name (``FIELDS``).
    A row with 0 output tokens is a failed request (BurstGPT's convention: its without_fails files
    leave them out): it is skipped and counted in ``Trace.skipped``, so a file and its
    without_fails twin replay the same requests. Without a time column, ``rate`` (requests/s) gives
    Poisson arrivals."""
    first = next(rows, None)
    if first is None:
        raise TraceError(f"trace {name} has no requests")
    cols = _columns(p, names if names is not None else list(first[1]))
    tcol, icol, ocol = cols["arrival time"], cols["input length"], cols["output length"]
    # optional, and in JSON lines not on every row (aiperf): looked up on each
    hcol, scol = cols["hash_ids"] or "hash_ids", cols["session"] or "session_id"
    if tcol is None and rate is None:
        raise TraceError(f"{p}: no arrival time column among {names or list(first[1])}; name it one of "
                         f"{list(FIELDS['arrival time'])}, or give requests a Poisson rate (replay --rate R)")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise TraceError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    if tcol is not None and rate is not None:
        raise TraceError(f"{p}: --rate is for traces without arrival times and this one has {tcol!r}; "
                         f"--speed scales its rate")
    times: list[float] = []  # the column's values, in its unit
    kept: list[tuple[int, int, tuple[int, ...], int]] = []  # input, output, hash_ids, session
    kinds: set[bool] = set()  # date-times (True), numbers (False)
    sessions: dict[str | int, int] = {}
    skipped = 0
    for where, row in itertools.chain([first], rows):
        for col in (icol, ocol, tcol):
            if col is not None and row.get(col) is None:  # absent, or a short CSV row
                hint = " ('delay' follows the previous answer, which a replay of arrivals lacks)" if (
                    col == tcol and "delay" in row) else ""
                raise TraceError(f"{where}: missing field {col!r}{hint}")
        inp, out = _length(row[icol], icol, where), _length(row[ocol], ocol, where)
        t = 0.0
        if tcol is not None:
            t, is_date = _time(row[tcol], tcol, where)
            kinds.add(is_date)
        if out == 0:
            skipped += 1
            continue
        hashes = _hashes(row[hcol], where) if row.get(hcol) not in (None, "") else ()
        sid = row.get(scol)
        if sid not in (None, "") and not isinstance(sid, str | int):
            raise TraceError(f"{where}: field {scol!r} must be a string or an integer, got {sid!r}")
        times.append(t)
        kept.append((max(1, inp), out, hashes, -1 if sid in (None, "") else sessions.setdefault(sid, len(sessions))))
        if limit and len(kept) >= limit:
            break
    if not kept:
        raise TraceError(f"trace {name} has no requests ({skipped} rows with 0 output tokens skipped)")
    if len(kinds) > 1:
        raise TraceError(f"{p}: field {tcol!r} mixes date-times and numbers")
    if tcol is None:
        rng, t = random.Random(seed), 0.0
        times = [t := t + rng.expovariate(rate) for _ in kept]
    else:
        lo, hi = min(times), max(times)
        per_s = 1.0 if kinds == {True} else _time_unit(tcol, json_lines, lo, hi)
        times = [(t - lo) / per_s for t in times]
    reqs = [TraceRequest(t, *rest) for t, rest in zip(times, kept, strict=True)]
    return replace(_sorted(name, reqs, 512), skipped=skipped)


def _open(p: Path) -> TextIO:
    """The file as text: gzip for .gz; utf-8-sig: a byte-order mark (a file saved on Windows, Excel)
    is no "Unexpected UTF-8 BOM" on line 1 nor part of the first column's name."""
    try:
        return (gzip.open(p, "rt", encoding="utf-8-sig", newline="") if p.suffix == ".gz"
                else p.open(encoding="utf-8-sig", newline=""))
    except OSError as err:
        raise TraceError(f"cannot read trace {p}: {err.strerror}") from None


def _json_rows(p: Path, fh: TextIO) -> Iterator[tuple[str, dict]]:
    """(where, object) for each JSON line; a file holding one JSON array (a dataset dump) gives its
    elements."""
    first = True
    for i, line in enumerate(fh, 1):
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):
            try:
                items = json.loads(line + fh.read())
            except json.JSONDecodeError as err:
                raise TraceError(f"{p}:{err.lineno}: not JSON ({err.msg})") from None
            for k, item in enumerate(items, 1):
                if not isinstance(item, dict):
                    raise TraceError(f"{p}: element {k} of the array must be a JSON object")
                yield f"{p}: element {k}", item
            return
        first = False
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceError(f"{p}:{i}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{p}:{i}: each line must be a JSON object")
        yield f"{p}:{i}", obj


def read_mooncake(path: str | Path, limit: int | None = None, rate: float | None = None, seed: int = 0) -> Trace:
    """JSON lines (``.jsonl``, ``.jsonl.gz``; a ``.json`` array too): Mooncake FAST'25 (timestamp ms,
    input_length, output_length, hash_ids), aiperf's mooncake_trace, or any columns of ``FIELDS``."""
    p = Path(path)
    try:
        with _open(p) as fh:
            return _requests(p, p.name.split(".")[0], _json_rows(p, fh), None, True, limit, rate, seed)
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a .gz that is not gzip, bytes that are not text
        raise TraceError(f"cannot read trace {p}: {err}") from None


def read_azure(path: str | Path, limit: int | None = None, rate: float | None = None, seed: int = 0) -> Trace:
    """CSV (``.csv``, ``.csv.gz``) with a header: Azure LLM inference 2023/2024 (TIMESTAMP,
    ContextTokens, GeneratedTokens), BurstGPT (Timestamp in s, Request tokens, Response tokens), or
    any columns of ``FIELDS``."""
    p = Path(path)
    try:
        with _open(p) as fh:
            reader = csv.DictReader(fh)
            rows = ((f"{p}:{reader.line_num}", row) for row in reader)
            name = Path(p.stem).stem if p.suffix == ".gz" else p.stem
            return _requests(p, name, rows, list(reader.fieldnames or []), False, limit, rate, seed)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as err:
        raise TraceError(f"cannot read trace {p}: {err}") from None


def _sorted(name: str, reqs: list[TraceRequest], block: int) -> Trace:
    if not reqs:
        raise TraceError(f"trace {name} has no requests")
    reqs.sort(key=lambda r: r.t)
    t0 = reqs[0].t
    if t0:
        reqs = [replace(r, t=r.t - t0) for r in reqs]
    return Trace(name, tuple(reqs), block)


def agentic_sessions(n_sessions: int = 40, duration_s: float = 3600.0, seed: int = 0,
                     base_context: int = 40_000, growth_per_turn: int = 600, output_mean: int = 300,
                     block_tokens: int = 512, subagent_prob: float = 0.08) -> Trace:
    """Coding-agent sessions shaped like the corpus of "Serving GLM-5.2 for Agentic Workloads on llm-d"
    (production Claude Code sessions): a long shared context that grows
    ~600 tokens per turn, ~300-token outputs, pauses of seconds to minutes between turns (tool
    runs; median ~2 s, p90 ~26 s as measured there), and bursts of concurrent sub-agents that
    share the session's system prefix but grow their own contexts."""
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    next_hash = [0]

    def new_blocks(n: int) -> list[int]:
        ids = list(range(next_hash[0], next_hash[0] + n))
        next_hash[0] += n
        return ids

    agents = [0]

    def run_agent(sid: int, start: float, prefix: list[int], ctx: int, turns: int) -> None:
        blocks = list(prefix)
        aid = agents[0]
        agents[0] += 1
        t = start
        for _ in range(turns):
            if t > duration_s:
                return
            need = ctx // block_tokens + 1
            if need > len(blocks):
                blocks += new_blocks(need - len(blocks))
            out = max(8, int(rng.lognormvariate(0, 0.6) * output_mean * 0.85))
            reqs.append(TraceRequest(t, ctx, out, tuple(blocks[:need]), sid, aid))
            ctx += growth_per_turn + out
            # Generation time + tool pause: lognormal with median 2.1 s, p90 ~26 s.
            t += out * 0.02 + rng.lognormvariate(0.74, 1.96)

    for sid in range(n_sessions):
        start = rng.uniform(0, duration_s * 0.8)
        system = new_blocks(base_context // (2 * block_tokens))
        ctx = base_context + int(rng.uniform(-0.3, 0.3) * base_context)
        turns = rng.randint(20, 120)
        run_agent(sid, start, system, ctx, turns)
        # Sub-agent fan-out: bursts of 2-5 agents sharing the system prefix.
        t = start
        while t < duration_s:
            t += rng.expovariate(1 / 300)
            if rng.random() < subagent_prob * 10:
                for _ in range(rng.randint(2, 5)):
                    run_agent(sid, t + rng.uniform(0, 1), system, len(system) * block_tokens + 2000,
                              rng.randint(3, 15))
    if not reqs:
        raise TraceError("agentic_sessions produced no requests; raise n_sessions or duration_s")
    return _sorted("agentic", reqs, block_tokens)


BUNDLED_MOONCAKE = Path(__file__).parent / "data" / "mooncake_conversation_trace.jsonl.gz"


def load_trace(path: str | Path, limit: int | None = None, rate: float | None = None, seed: int = 0) -> Trace:
    """Read a trace by its suffix (.jsonl/.json JSON lines, .csv CSV, either .gz) or ``agentic[:N]``
    for N generated sessions. ``rate`` (requests/s) gives Poisson arrivals to a file without times."""
    s = str(path)
    if s == "agentic" or s.startswith("agentic:"):  # not a file named agentic*.jsonl: that is read, not replaced
        n = s.partition(":")[2] or "40"
        if not n.isdigit() or int(n) < 1:
            raise TraceError(f"--trace {s}: N in 'agentic:N' must be a number of sessions >= 1, got {n!r}")
        if rate is not None:
            raise TraceError(f"--trace {s}: --rate is for trace files without arrival times")
        return agentic_sessions(n_sessions=int(n))
    p = Path(s)
    if p.suffix in (".jsonl", ".json") or p.name.endswith((".jsonl.gz", ".json.gz")):
        return read_mooncake(p, limit, rate, seed)
    if p.suffix == ".csv" or p.name.endswith(".csv.gz"):
        return read_azure(p, limit, rate, seed)
    raise TraceError(f"{p}: unknown trace format; use a .jsonl (JSON lines), a .csv or 'agentic[:N]'")
