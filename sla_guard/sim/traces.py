"""Request traces: Mooncake JSON lines, Azure LLM CSV, and a generator of agentic coding sessions.

Every reader returns a :class:`Trace`: requests sorted by arrival (seconds from the trace's start)
with prompt/output lengths and, when the source has them, prefix-block hashes (equal hash at the
same position = shared prefix block of ``block_tokens`` tokens). Bad input raises
:class:`TraceError` naming the file, line and field.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


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
        return Trace(self.name, tuple(out), self.block_tokens)

    def with_hash_offset(self, offset: int) -> Trace:
        """Copy whose prefix-block hashes are shifted by ``offset``: the same arrivals and lengths
        with prefixes no earlier copy shares. A trace replayed twice in a row is new
        conversations the second time, not the first ones again with every prefix cached."""
        if offset == 0:
            return self
        return Trace(self.name, tuple(replace(r, hash_ids=tuple(h + offset for h in r.hash_ids))
                                      for r in self.requests), self.block_tokens)

    def max_hash(self) -> int:
        """Largest prefix-block hash (-1 without prefix information)."""
        return max((max(r.hash_ids) for r in self.requests if r.hash_ids), default=-1)


def _int_field(obj: dict, key: str, where: str, minimum: int = 0) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    # NaN and Infinity (which json accepts) fail the finite test, not int()'s OverflowError; an integer
    # past a float's range (json reads any number of digits) fails it too, not with math's OverflowError
    if (isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, int) and abs(v) > 2**63)
            or not math.isfinite(v) or v < minimum):
        raise TraceError(f"{where}: field {key!r} must be a finite number >= {minimum}, got {v!r}")
    return int(v)


def read_mooncake(path: str | Path, limit: int | None = None) -> Trace:
    """Mooncake FAST'25 JSON lines: timestamp (ms), input_length, output_length, hash_ids."""
    p = Path(path)
    try:
        return _read_mooncake(p, limit)
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a .gz that is not gzip, bytes that are not text
        raise TraceError(f"cannot read trace {p}: {err}") from None


def _read_mooncake(p: Path, limit: int | None) -> Trace:
    reqs: list[TraceRequest] = []
    try:
        # utf-8-sig: a byte-order mark (a file saved on Windows) is no "Unexpected UTF-8 BOM" on line 1
        fh = (gzip.open(p, "rt", encoding="utf-8-sig") if p.suffix == ".gz"  # noqa: SIM115 - closed by `with` below
              else p.open(encoding="utf-8-sig"))
    except OSError as err:
        raise TraceError(f"cannot read trace {p}: {err.strerror}") from None
    with fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{p}:{i}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            ts = _int_field(obj, "timestamp", where)
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
            reqs.append(TraceRequest(ts / 1000.0, max(1, _int_field(obj, "input_length", where)),
                                     max(1, _int_field(obj, "output_length", where)), tuple(hashes)))
            if limit and len(reqs) >= limit:
                break
    return _sorted(p.name.split(".")[0], reqs, 512)


def _parse_ts(text: str, where: str) -> float:
    s = text.strip()
    if "." in s:  # Azure has 7 fractional digits; datetime takes 6
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise TraceError(f"{where}: field 'TIMESTAMP' is not a date-time: {text!r}") from None


def read_azure(path: str | Path, limit: int | None = None) -> Trace:
    """Azure LLM inference trace 2023 CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    p = Path(path)
    try:
        return _read_azure(p, limit)
    except (UnicodeDecodeError, csv.Error) as err:
        raise TraceError(f"cannot read trace {p}: {err}") from None


def _read_azure(p: Path, limit: int | None) -> Trace:
    reqs: list[TraceRequest] = []
    try:
        fh = p.open(newline="", encoding="utf-8-sig")  # a byte-order mark (Excel) is not part of "TIMESTAMP"
    except OSError as err:
        raise TraceError(f"cannot read trace {p}: {err.strerror}") from None
    with fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise TraceError(f"{p}: header must have columns {sorted(need)}, got {reader.fieldnames}")
        t0 = None
        for i, row in enumerate(reader, 2):
            where = f"{p}:{i}"
            t = _parse_ts(row["TIMESTAMP"] or "", where)  # None: a short row, TIMESTAMP not in its first columns
            t0 = t if t0 is None else t0
            try:
                inp, out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError):
                raise TraceError(f"{where}: ContextTokens and GeneratedTokens must be integers") from None
            if inp < 0 or out < 0:  # as the Mooncake reader: a negative length is a broken row, not a 1
                raise TraceError(f"{where}: ContextTokens and GeneratedTokens must be >= 0, got {inp}, {out}")
            reqs.append(TraceRequest(t - t0, max(1, inp), max(1, out)))
            if limit and len(reqs) >= limit:
                break
    return _sorted(p.stem, reqs, 512)


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


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a trace by its suffix (.jsonl Mooncake, .csv Azure) or ``agentic[:N]`` for N
    generated sessions."""
    s = str(path)
    if s == "agentic" or s.startswith("agentic:"):  # not a file named agentic*.jsonl: that is read, not replaced
        n = s.partition(":")[2] or "40"
        if not n.isdigit() or int(n) < 1:
            raise TraceError(f"--trace {s}: N in 'agentic:N' must be a number of sessions >= 1, got {n!r}")
        return agentic_sessions(n_sessions=int(n))
    p = Path(s)
    if p.suffix in (".jsonl", ".json") or p.name.endswith((".jsonl.gz", ".json.gz")):
        return read_mooncake(p, limit)
    if p.suffix == ".csv":
        return read_azure(p, limit)
    raise TraceError(f"{p}: unknown trace format; use a Mooncake .jsonl, an Azure .csv or 'agentic[:N]'")
