"""Crash-safe state (sla_guard.state): every component's dump/load round trip goes through a real
SQLite file; a corrupt file is moved aside; retention bounds the file; the advisor with
``model: '*'`` keeps one state per model (never sums three models into one pool)."""

from __future__ import annotations

import json
import math
import sqlite3

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from guard_support import T0, Engine, drive, scrape_into
from prometheus_client import CollectorRegistry
from scale_support import Engine as ScaleEngine
from scale_support import run as scale_run
from scale_support import store as scale_store

from exporters import contract as c
from exporters.contract import Component
from exporters.prometheus import ContractMetrics, EngineRecorder
from sla_guard.config import parse_config
from sla_guard.detect import drift
from sla_guard.detect.evaluators import LeakConfig, LeakEvaluator, RateConfig, RateDriftEvaluator
from sla_guard.detect.findings import FindingsBook
from sla_guard.model import Status
from sla_guard.scale.evaluator import AdvisorEvaluator
from sla_guard.service import Guard
from sla_guard.settings.advisor import AdvisorConfig
from sla_guard.slo import SLOEvaluator
from sla_guard.state import StateStore, decode, encode
from sla_guard.store import SeriesStore

ATT = {"slos": [{"objectives": [{"name": "ttft_att", "indicator": "ttft", "objective": "attainment",
                                 "threshold_s": 2.5, "target": 0.99, "period": "1d", "min_requests": 5}]}],
       "evaluation_interval_s": 15, "staleness_s": 60}


def _roundtrip(tmp_path, name: str, comp, fresh, *, full: bool = True, records=()):
    """Dump ``comp`` into a real file, reopen the file, load into ``fresh``."""
    st = StateStore(tmp_path / "state.db")
    now = max(r["t"] for r in records) if records else None  # records are in the test's clock
    assert st.save({name: comp.state_dump(full)}, {name: list(records)} if records else {}, now=now)
    st.close()
    st2 = StateStore(tmp_path / "state.db")
    fresh.state_load(st2.load().get(name, {}), st2.tail(name, 256))
    assert st2.integrity() == "ok"
    st2.close()
    return fresh


def decode_list(items):
    from sla_guard.model import Finding

    return [decode(d, {"Finding": Finding}) for d in items]


def _slo(ev, key=("m", "decode")):
    return ev.pools[key].slos[0]


# -- the store ------------------------------------------------------------------------------------

def test_store_parts_upsert_delete_and_records_survive_reopen(tmp_path):
    st = StateStore(tmp_path / "s.db")
    assert st.save({"a": {"x": 1, "y": [1.5, None, "z"]}, "b": {"k": {"n": 2}}},
                   {"a": [{"t": 10.0, "v": 1}, {"t": 11.0, "v": 2}]}, now=100.0)
    assert st.save({"a": {"x": None, "w": True}}, {"a": [{"t": 12.0, "v": 3}]}, now=101.0)
    st.close()
    st = StateStore(tmp_path / "s.db")
    assert st.load() == {"a": {"y": [1.5, None, "z"], "w": True}, "b": {"k": {"n": 2}}}
    assert [r["v"] for r in st.tail("a", 2)] == [2, 3]
    assert st.conn_mode() == "wal"
    assert st.moved_aside is None


def test_codec_round_trips_dataclasses_tuples_sets_deques_and_int_keys():
    from collections import deque

    from sla_guard.scale.guardrails import PoolMemory

    m = PoolMemory(history=[(1.0, 3)], failed={2: (5.0, 0.7)}, start_s=12.0)
    obj = {"m": m, "s": {"a", "b"}, "q": deque([(1, 2)], maxlen=4), "k": {("x", "y"): 1.0}, "nan": math.inf}
    back = decode(encode(obj), {"PoolMemory": PoolMemory})
    assert back["m"] == m and back["s"] == {"a", "b"} and back["q"].maxlen == 4
    assert back["q"] == deque([(1, 2)]) and back["k"] == {("x", "y"): 1.0} and back["nan"] == math.inf
    with pytest.raises(ValueError):
        decode(encode(m), {})  # only named classes are ever rebuilt


def test_corrupt_file_is_moved_aside_and_the_guard_says_so(tmp_path):
    p = tmp_path / "state.db"
    p.write_bytes(b"this is not a database" * 200)
    st = StateStore(p)
    assert st.moved_aside is not None and st.moved_aside.startswith(str(p) + ".corrupt-")
    with open(st.moved_aside, "rb") as f:
        assert f.read().startswith(b"this is not a database")
    assert "unreadable" in st.problem
    assert st.save({"a": {"x": 1}}) and st.load() == {"a": {"x": 1}}
    guard = Guard(parse_config(ATT), _NullSource(), [SLOEvaluator(parse_config(ATT))], state=st)
    assert guard.status()["state"]["moved_aside"] == st.moved_aside


def test_a_second_corrupt_file_in_the_same_second_never_overwrites_the_first_one_moved_aside(tmp_path):
    """The moved-aside name was ``<name>.corrupt-<unix second>``: a second damaged file moved aside
    within that second (a restart loop on a failing disk, or a clock stepped back onto an earlier
    second) replaced the first copy, the only one left of the state it held."""
    p = tmp_path / "state.db"
    kept = []
    for body in (b"first damaged file " * 200, b"second damaged file " * 200):
        p.write_bytes(body)
        st = StateStore(p, clock=lambda: 1_700_000_000.0)
        kept.append(st.moved_aside)
        st.close()
        p.unlink()
    assert len(set(kept)) == 2
    with open(kept[0], "rb") as f:
        assert f.read().startswith(b"first damaged file")
    with open(kept[1], "rb") as f:
        assert f.read().startswith(b"second damaged file")


def test_corrupted_pages_are_detected_on_open(tmp_path):
    p = tmp_path / "state.db"
    st = StateStore(p)
    st.save({"a": {str(i): "x" * 200 for i in range(200)}})
    st.close()
    with sqlite3.connect(p) as conn:  # fold the WAL into the main file, then damage a data page
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(p.read_bytes())
    page = 4096
    for k in range(1, len(data) // page):  # every b-tree page header after the first
        data[k * page: k * page + 8] = b"\xff" * 8
    p.write_bytes(bytes(data))
    st = StateStore(p)
    assert st.moved_aside is not None
    assert st.load() == {}


def test_retention_bounds_the_file(tmp_path):
    st = StateStore(tmp_path / "s.db", max_bytes=1024 * 1024, retention_s=1000.0)
    rec = {"payload": "y" * 900}
    for i in range(3000):  # ~3 MB of records, over 1 MiB
        st.save({}, {"advisor": [{"t": 5000.0 + i, **rec}]}, now=5000.0 + i)
    assert st.live_bytes() <= 1024 * 1024 + 64 * 1024
    assert st.trimmed > 0
    newest = st.tail("advisor", 1)[0]["t"]
    assert newest == 5000.0 + 2999
    # age: records older than retention_s go at the next retention pass
    for i in range(64):
        st.save({"c": {"p": i}}, {}, now=20_000.0 + i)
    assert st.tail("advisor", 10) == []
    assert st.load()["c"] == {"p": 63}


# -- the SLO ledger -------------------------------------------------------------------------------

def _drive_att(seconds, ev=None, store=None, t0=T0, bad_every=0):
    cfg = parse_config(ATT)
    e = Engine()
    k = [0]

    def per_tick(rng, eng):
        k[0] += 1
        return [(3.0 if bad_every and (k[0] * 4 + i) % bad_every == 0 else 0.2, 0.01) for i in range(4)]

    return e, *drive([e], seconds, per_tick, cfg=cfg, ev=ev or SLOEvaluator(cfg), store=store, t0=t0)


def test_slo_ledger_round_trip_through_the_file_gives_the_same_verdicts(tmp_path):
    cfg = parse_config(ATT)
    _e, store, ev, t = _drive_att(1800, bad_every=40)
    before = _slo(ev)
    assert before.period_requests and before.period_requests > 1000
    fresh = _roundtrip(tmp_path, "slo", ev, SLOEvaluator(cfg))
    fresh.evaluate(store, t)
    ev.evaluate(store, t)
    after = _slo(fresh)
    assert after.period_requests == _slo(ev).period_requests
    assert after.budget_remaining == pytest.approx(_slo(ev).budget_remaining)
    assert after.burn_rates == pytest.approx(_slo(ev).burn_rates, nan_ok=True)
    assert after.status == _slo(ev).status


def test_incremental_dumps_rewrite_only_changed_chunks_and_add_up(tmp_path):
    cfg = parse_config(ATT)
    e, store, ev, t = _drive_att(600)
    st = StateStore(tmp_path / "s.db")
    st.save({"slo": ev.state_dump(True)})
    full_parts = len(ev.state_dump(True))
    for k in range(1, 60):  # 15 min more, saving after every tick
        for _ in range(4):
            e.request(0.2, 0.01)
        scrape_into(store, [e], t + 15 * k)
        ev.evaluate(store, t + 15 * k)
        part = ev.state_dump(False)
        assert len(part) <= 1 + 2 * 2 + 2  # meta + a new and a current chunk per tier (+ drops)
        st.save({"slo": part})
    fresh = SLOEvaluator(cfg)
    fresh.state_load(st.load()["slo"], [])
    tn = t + 15 * 59
    fresh.evaluate(store, tn + 15)
    ev.evaluate(store, tn + 15)
    assert _slo(fresh).period_requests == _slo(ev).period_requests
    assert full_parts >= 3


def test_restart_resumes_the_ledger_losing_only_the_tick_in_flight(tmp_path):
    """A restart: the ledger comes back from the file and the new process's store is empty. The
    first post-restart tick counts from its first scrape on; what the engines served between the
    last fed sample and that first scrape is the only loss."""
    cfg = parse_config(ATT)
    e, _store, ev, t = _drive_att(1800)
    held = _slo(ev).period_requests
    fresh = _roundtrip(tmp_path, "slo", ev, SLOEvaluator(cfg))
    lost = 0
    for _ in range(4):  # served while the guard was down (after its last fed sample)
        e.request(0.2, 0.01)
        lost += 1
    new_store = SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    served_after = 0
    for k in range(1, 13):
        tk = t + 60 + 5 * k
        if k > 1:
            for _ in range(4):
                e.request(0.2, 0.01)
                served_after += 1
        scrape_into(new_store, [e], tk)
        if k % 3 == 0:
            fresh.evaluate(new_store, tk)
    got = _slo(fresh).period_requests
    assert got == held + served_after  # nothing double-counted, nothing but the gap lost
    # before the fix (no state): the period restarts from zero
    nostate = SLOEvaluator(cfg)
    for k in (3, 6, 9, 12):
        nostate.evaluate(new_store, t + 60 + 5 * k)
    assert (_slo(nostate).period_requests or 0) < got - held + 1
    assert lost == 4


def test_prometheus_mode_persists_no_slo_windows():
    cfg = parse_config({**ATT, "source": {"mode": "prometheus", "url": "http://127.0.0.1:9"}})
    ev = SLOEvaluator(cfg)
    assert ev.state_dump(True) == {}
    ev.state_load({"meta": {"last_feed": 5.0}}, [])
    assert ev._last_feed is None


# -- findings and detectors -----------------------------------------------------------------------

def test_findings_book_round_trip_keeps_open_and_resolved(tmp_path):
    book = FindingsBook()
    book.raise_("leak", "leak/a", "critical", "grows", {"model": "m", "pool": "decode"}, {"eta_s": 1680.0}, 100.0)
    book.raise_("tpot_drift", "tpot_drift/m/decode", "warning", "slow", {"model": "m"}, {"after": 1.3}, 100.0)
    book.resolve("tpot_drift/m/decode", 150.0)
    fresh = _roundtrip(tmp_path, "findings", book, FindingsBook())
    (f,) = fresh.open_findings()
    assert (f.key, f.severity, f.details["eta_s"], f.opened_at) == ("leak/a", "critical", 1680.0, 100.0)
    assert [r.key for r in fresh.resolved_findings()] == ["tpot_drift/m/decode"]
    assert fresh.restored == {"leak/a"}
    # an unchanged book does not rewrite its resolved list; a change does
    assert "resolved" in fresh.state_dump(False)
    assert "resolved" not in fresh.state_dump(False)
    fresh.resolve("leak/a", 200.0)
    assert [r.key for r in decode_list(fresh.state_dump(False)["resolved"])] == ["tpot_drift/m/decode", "leak/a"]


def _written(path, at: float) -> list[str]:
    """The findings parts a save at ``at`` wrote into the file (kv.updated_at is the save's time)."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT part FROM kv WHERE component = 'findings' AND updated_at = ?", (at,)).fetchall()
    conn.close()
    return sorted(r[0] for r in rows)


def test_a_save_writes_only_the_open_findings_that_changed_and_the_file_always_holds_them_all(tmp_path):
    """Each tick's save re-encoded every open finding into one part (5,000 open: 118 ms a save,
    every tick, though a leak finding changes once per 5-min bucket). One part per open finding
    now, written when it opens or changes, deleted when it resolves. What a restart reads (the
    last commit, also after a kill -9) is still every open finding: a failed save makes the next
    one full, which also deletes the parts of findings resolved meanwhile, and a file of the
    single-part format loads and is converted."""
    from sla_guard.model import Finding

    db = tmp_path / "state.db"
    legacy = Finding(detector="leak", key="leak/old", severity="warning", summary="s", labels={}, details={},
                     opened_at=T0, updated_at=T0)
    st = StateStore(db)
    assert st.save({"findings": {"open": [encode(legacy)]}}, now=T0)  # as a guard before this change saved
    cfg = parse_config(ATT)
    guard = Guard(cfg, _NullSource(), state=st)
    book = FindingsBook()
    guard.add_state("findings", book)
    keys = [f"leak/e{i}/m/decode/0/core" for i in range(300)]
    for k in keys:
        book.raise_("leak", k, "warning", "grows", {"model": "m"}, {"z": 1.0}, T0)
    assert guard.persist(T0 + 15)
    assert "open" not in _written(db, T0 + 15) and len(_written(db, T0 + 15)) == 302  # 301 open + resolved
    book.raise_("leak", keys[7], "warning", "grows", {"model": "m"}, {"z": 2.0}, T0 + 30)  # details moved
    assert guard.persist(T0 + 30)
    assert _written(db, T0 + 30) == [f"o/{keys[7]}"]
    assert guard.persist(T0 + 45)
    assert _written(db, T0 + 45) == []
    book.resolve(keys[8], T0 + 60)
    holder = sqlite3.connect(db, isolation_level=None, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")  # this save fails: the deletion of keys[8]'s part is lost
    try:
        assert not guard.persist(T0 + 60)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    book.resolve(keys[9], T0 + 75)
    assert guard.persist(T0 + 75)  # full: every open finding, and both deletions
    st.close()
    fresh = FindingsBook()
    fresh.state_load(StateStore(db).load()["findings"], [])
    want = sorted([k for k in keys if k not in (keys[8], keys[9])] + ["leak/old"])
    assert sorted(f.key for f in fresh.open_findings()) == want
    assert fresh.get(keys[7]).details["z"] == 2.0
    assert [f.key for f in fresh.resolved_findings()] == [keys[8], keys[9]]


def _rss_store(t0: float, n: int, step: float = 30.0, value: float = 2e9) -> SeriesStore:
    st = SeriesStore(slots=2000, lookback_s=120.0)
    labels = {"model": "m", "pool": "decode", "engine": "0", "process": "engine_core", "instance": "i0"}
    for k in range(n):
        st.append(c.PROCESS_RSS.name, labels, t0 + k * step, value, group="i0")
    return st


KEY = "leak/i0/m/decode/0/engine_core"


def test_restored_leak_finding_stays_open_until_the_detector_can_judge(tmp_path):
    """After a restart the detector sees only minutes of RSS (its warm-up is 30 min): it must not
    take 'my data starts after the finding opened' for a process restart."""
    book = FindingsBook()
    book.raise_("leak", KEY, "critical", "grows", {"model": "m", "pool": "decode"}, {"eta_s": 1680.0}, T0)
    restored = _roundtrip(tmp_path, "findings", book, FindingsBook())
    ev = LeakEvaluator(restored, LeakConfig())
    store = _rss_store(T0 + 3600, 20)
    for k in range(20):
        ev.evaluate(store, T0 + 3600 + 30 * k)
    assert [f.key for f in restored.open_findings()] == [KEY]
    assert ev.verdicts[KEY].status == "unknown"
    # a real restart (a drop in the data) still resolves it
    labels = {"model": "m", "pool": "decode", "engine": "0", "process": "engine_core", "instance": "i0"}
    store.append(c.PROCESS_RSS.name, labels, T0 + 3600 + 30 * 20 + 300, 2e8, group="i0")
    ev.evaluate(store, T0 + 3600 + 30 * 20 + 300 + 301)
    assert restored.open_findings() == []
    assert restored.get(KEY).details["resolution"] == "restart"


def test_restored_leak_finding_of_a_process_that_never_returns_is_resolved():
    book = FindingsBook()
    book.raise_("leak", "leak/gone/m/decode/0/engine_core", "critical", "grows", {"model": "m"}, {}, T0)
    book.restored = {"leak/gone/m/decode/0/engine_core"}
    ev = LeakEvaluator(book, LeakConfig())
    store = _rss_store(T0 + 100, 80)  # another process reports for 40 min
    for k in range(80):
        ev.evaluate(store, T0 + 100 + 30 * k)
    assert book.open_findings() == []
    assert book.get("leak/gone/m/decode/0/engine_core").details["resolution"] == "series_gone"


def test_restored_hysteresis_clocks_of_processes_that_never_return_are_dropped():
    """The leak detector's restored ``_ok_since`` clocks were dropped only when their process was
    seen and then went: one whose process never came back stayed in memory and in every save
    (and every later restart added its own). Gone by the rule restored findings follow: other
    processes report for ``max_gap_s`` and it does not."""
    ev = LeakEvaluator(FindingsBook(), LeakConfig())
    ev.state_load({"ok_since": {f"leak/old{i}/m/decode/0/engine_core": T0 for i in range(1000)} | {KEY: T0}}, [])
    store = _rss_store(T0 + 100, 80)  # KEY's process reports for 40 min
    for k in range(80):
        ev.evaluate(store, T0 + 100 + 30 * k)
    assert set(ev.state_dump(False)["ok_since"]) <= {KEY}


def test_drift_cusum_round_trip(tmp_path):
    book = FindingsBook()
    cfg = RateConfig(warmup_s=600, interval_s=60)
    ev = RateDriftEvaluator(book, "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                            c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance")
    rng = np.random.default_rng(1)
    st = SeriesStore(slots=400, lookback_s=120.0)
    lab = {"model": "m", "pool": "decode", "engine": "0"}
    n = x = 0.0
    for k in range(60):
        t = T0 + 30 * k
        dn = 1000.0
        n += dn
        x += rng.binomial(int(dn), 0.7 if k < 40 else 0.4)
        st.append(c.SPEC_DRAFT_TOKENS.exposed, lab, t, n, group="e")
        st.append(c.SPEC_ACCEPTED_TOKENS.exposed, lab, t, x, group="e")
        ev.evaluate(st, t)
    assert book.open_findings(), "the drop was found"
    fresh_book = _roundtrip(tmp_path, "findings", book, FindingsBook())
    fresh = _roundtrip(tmp_path, "acceptance_drift", ev,
                       RateDriftEvaluator(fresh_book, "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                                          c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance"))
    (k,) = ev.cusums
    a, b = ev.cusums[k], fresh.cusums[k]
    assert isinstance(b, drift.RateCusum) and b.params is fresh.params
    assert (a.p0, a.s_down, a.alarm) == (b.p0, b.s_down, b.alarm)
    # the restored detector resolves the restored finding once the rate is back
    for k2 in range(60, 200):
        t = T0 + 30 * k2
        n += 1000
        x += rng.binomial(1000, 0.7)
        st.append(c.SPEC_DRAFT_TOKENS.exposed, lab, t, n, group="e")
        st.append(c.SPEC_ACCEPTED_TOKENS.exposed, lab, t, x, group="e")
        fresh.evaluate(st, t)
    assert fresh_book.open_findings() == []


def _json(obj) -> str:
    """``obj`` as the state file stores it (a list and a tuple alike)."""
    return json.dumps(json.loads(json.dumps(encode(obj))))


def test_drift_state_writes_each_group_once_per_turn_and_an_alarm_at_once(tmp_path):
    """Every CUSUM changes at every interval (its windows move), and the drift evaluators wrote
    one part of all their groups each interval: ~80 KB a model/pool, 8 MiB and 1-2 s of the tick
    each minute at 100 groups. Each group is its own part now, written once per DRIFT_SAVE_S
    (its turn set by a hash), at once when its alarm opens (in the save that opens the finding),
    and deleted when the group is forgotten; the file restores each group as last written, with
    its alarm, so the restored finding is still judged."""
    from sla_guard.detect.evaluators import DRIFT_SAVE_S

    book = FindingsBook()
    cfg = RateConfig(warmup_s=600, interval_s=60)

    def evaluator(b: FindingsBook) -> RateDriftEvaluator:
        return RateDriftEvaluator(b, "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                                  c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance", forget_after_s=1800)

    ev = evaluator(book)
    groups = 12
    rng = np.random.default_rng(4)
    st = SeriesStore(slots=400, lookback_s=120.0)
    state = StateStore(tmp_path / "state.db")
    n, x = np.zeros(groups), np.zeros(groups)
    written: list[set[str]] = []  # group parts written by each save
    share: list[float] = []  # bytes written by each save, of all the groups' state
    last: dict[str, object] = {}  # each group part as last written
    last_cus: dict[str, str] = {}  # each group's CUSUM when its part was last written (as ``encode`` writes it)
    drop_at, opened_in = T0 + 63 * 60, None  # its alarm opens between two of its turns
    key = "acceptance_drift/m0/decode"
    for k in range(1, 141):
        t = T0 + 60.0 * k
        for g in range(groups if k <= 100 else groups - 1):  # the last group is gone from k = 100
            lab = {"model": f"m{g}", "pool": "decode", "engine": "0"}
            n[g] += 2000
            x[g] += rng.binomial(2000, 0.4 if g == 0 and t >= drop_at else 0.7)
            st.append(c.SPEC_DRAFT_TOKENS.exposed, lab, t, n[g], group=f"e{g}")
            st.append(c.SPEC_ACCEPTED_TOKENS.exposed, lab, t, x[g], group=f"e{g}")
        was_open = book.get(key) is not None and book.get(key).open
        ev.evaluate(st, t)
        parts = ev.state_dump(k == 1)
        assert state.save({"acceptance_drift": parts, "findings": book.state_dump(k == 1)}, now=t)
        written.append({p for p, v in parts.items() if p.startswith("g/") and v is not None})
        share.append(len(json.dumps(parts)) / len(json.dumps(encode(ev.cusums))))  # of all groups' state
        last.update({p: v for p, v in parts.items() if p.startswith("g/")})
        last_cus.update({p: _json(ev.cusums[tuple(json.loads(p[2:]))]) for p, v in parts.items()
                         if p.startswith("g/") and v is not None})
        if opened_in is None and not was_open and book.get(key) is not None:
            opened_in = k
    turn = int(DRIFT_SAVE_S // 60)
    steady = written[20:60]  # past the first save and warm-up, before the drop
    assert max(share[20:60]) < 0.5, share  # each save writes a few groups, not all of them
    for j in range(len(steady) - turn + 1):  # every group once in any DRIFT_SAVE_S
        seen = [p for w in steady[j:j + turn] for p in w]
        assert sorted(seen) == sorted(set(seen)) and len(seen) == groups, j
    # the alarm is written in the save whose findings hold it open
    assert opened_in is not None and '["m0","decode"]' in "".join(written[opened_in - 1])
    # the group forgotten (its series gone for forget_after_s) is deleted from the file
    saved = state.load()["acceptance_drift"]
    assert "s" not in saved and not any(p.startswith('g/["m11"') for p in saved)
    assert {p: v for p, v in saved.items() if p.startswith("g/")} == {p: v for p, v in last.items() if v is not None}
    # a restart: each group as last written, the open finding's alarm with it
    fresh_book, both = FindingsBook(), state.load()
    state.close()
    fresh_book.state_load(both["findings"], [])
    fresh = evaluator(fresh_book)
    fresh.state_load(both["acceptance_drift"], [])
    assert set(fresh.cusums) == set(ev.cusums) and fresh._next == ev._next
    assert fresh.cusums[("m0", "decode")].alarm is not None and fresh.claims(key)
    assert fresh_book.get(key).open
    assert all(_json(fresh.cusums[tuple(json.loads(p[2:]))]) == last_cus[p] for p, v in last.items() if v is not None)



def _steady_cusums(seed: int = 5) -> tuple[drift.RateCusum, drift.LatencyDrift, list]:
    """A rate and a TPOT CUSUM with the default parameters after 4 h of 60 s intervals (the warm-up
    over, the reference hold and trend windows full), and the 60 intervals that follow, the rate
    falling 0.7 -> 0.55 and TPOT rising 30% from the 20th (so both alarm)."""
    from sla_guard.detect.evaluators import rate_params
    from sla_guard.settings.detectors import RateConfig as Rate

    rng = np.random.default_rng(seed)
    rate = drift.RateCusum(rate_params(Rate(), "both"))
    tpot = drift.LatencyDrift(drift.LatencyDriftParams())

    def interval(k: int) -> tuple:
        n = float(rng.poisson(9000))
        bad = k >= 260
        return (T0 + 60.0 * k, n, float(rng.binomial(int(n), 0.55 if bad else 0.7)),
                0.02 * (1.3 if bad else 1.0) * (1 + 0.01 * rng.normal()), 8 + rng.normal(), float(rng.poisson(40)))

    for k in range(240):
        t, n, x, tp, run, req = interval(k)
        rate.update(t, n, x)
        tpot.update(t, tp, run, req)
    return rate, tpot, [interval(k) for k in range(240, 300)]


def test_drift_state_part_of_a_group_is_its_windows_packed_and_restores_exactly():
    """A group's CUSUM was written as ``encode``'s JSON, tuple by tuple: ~13 KB per CUSUM once its
    windows are full (6.5 MiB and 1.2 s on the tick thread each minute at 1,000 groups). Its
    windows are now float64 columns, zlib and base64 (``_pack``): a rate CUSUM's part is under a
    quarter of that, TPOT's (measured floats, less to compress) under half, and every CUSUM comes
    back exactly as it was, a row that is not all floats as ``encode`` writes it. A guard before
    this refuses the part (an unknown class) instead of restoring empty windows."""
    from sla_guard.detect.evaluators import _DRIFT_CLASSES, _pack, _unpack

    def stored(cus) -> dict:
        return json.loads(json.dumps(_pack(cus)))  # as the state file holds it

    rate, tpot, _ = _steady_cusums()
    for cus, share in ((rate, 4), (tpot, 2)):
        part, before = stored(cus), len(json.dumps(encode(cus)))
        assert len(json.dumps(part)) < before / share, (type(cus).__name__, len(json.dumps(part)), before)
        back = _unpack(part, cus.params)
        assert type(back) is type(cus) and back.params is cus.params and _json(back) == _json(cus)
        assert all(type(getattr(back, f)) is type(getattr(cus, f)) and type(getattr(back, f)[0]) is tuple
                   for f in ("held", "block") if hasattr(cus, f))
        with pytest.raises(ValueError, match="unknown state class"):
            decode(part, _DRIFT_CLASSES)  # what a guard before this reads
    rate.recent.append((T0, 5, 3.0))  # an int: that window is not packed, and comes back with its int
    back = _unpack(stored(rate), rate.params)
    assert _json(back) == _json(rate) and back.recent[-1] == (T0, 5, 3.0) and type(back.recent[-1][1]) is int


def test_drift_state_written_before_packing_restores_and_decides_the_same():
    """The guard's state file outlives an upgrade: a group part written as ``encode`` wrote it
    before ``_pack`` restores exactly, and the CUSUMs restored from either form reach the same
    alarms over the next hour (a drop and a slowdown); the next save writes the packed form."""
    from sla_guard.detect.evaluators import TpotDriftEvaluator, _DriftState, _group_part

    rate, tpot, after = _steady_cusums()
    cfg = RateConfig()
    evs = [RateDriftEvaluator(FindingsBook(), "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                              c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance"), TpotDriftEvaluator(FindingsBook())]
    for ev, cus in zip(evs, (rate, tpot), strict=True):
        cus.params = ev.params
        k = ("m", "decode")
        old = json.loads(json.dumps({"next": T0, _group_part(k): encode(cus)}))
        ev.cusums[k] = cus
        ev._next = T0
        new = json.loads(json.dumps({p: v for p, v in ev.state_dump(True).items() if v is not None}))
        assert new[_group_part(k)]["__dc__"].endswith("/packed")
        restored: list[_DriftState] = []
        for parts in (old, new):
            fresh = type(ev)(FindingsBook(), *((ev.name, ev.detector, ev.trials, ev.successes, ev.cfg, "both",
                                                 ev.what) if isinstance(ev, RateDriftEvaluator) else ()))
            fresh.state_load(parts, [])
            assert _json(fresh.cusums[k]) == _json(cus)
            restored.append(fresh)
        alarms = []
        for fresh in restored:
            got = []
            for t, n, x, tp, run, req in after:
                c_ = fresh.cusums[k]
                a = c_.update(t, n, x) if isinstance(c_, drift.RateCusum) else c_.update(t, tp, run, req)
                got.append(None if a is None else (a.at, a.direction, a.after, a.statistic))
            alarms.append((got, _json(fresh.cusums[k])))
        assert alarms[0] == alarms[1] and any(alarms[0][0]), type(cus).__name__
        assert restored[0].state_dump(True)[_group_part(k)]["__dc__"].endswith("/packed")


_DRIFT_LIFE = """
import sys
from exporters import contract as c
from sla_guard.compose import compose
from sla_guard.config import parse_config
from sla_guard.ingest import build_store
from sla_guard.ingest.source import StoreSource
from sla_guard.state import StateStore

db, k0, drop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = parse_config({"evaluation_interval_s": 60, "staleness_s": 300,
                    "detectors": {"acceptance": {"warmup_s": 600, "per_position": False}}})
store = build_store(cfg)
root = compose(cfg, source=StoreSource(store), state=StateStore(db), slo=False, advisor=False)
acc = 0.0
for k in range(k0, k0 + 100000):
    t = 1.7e9 + 60.0 * k
    for g in range(16):
        lab = f'model="m{g}",pool="decode",engine="0"'
        p = 0.35 if g < 2 and k >= drop else 0.7  # two groups' acceptance drops at tick ``drop``
        acc_g = 3000.0 * 0.7 * min(k, drop) + 3000.0 * p * max(0, k - drop) + (k * 7919 * (g + 1)) % 97
        store.ingest_text(f"{c.SPEC_DRAFT_TOKENS.exposed}{{{lab}}} {3000.0 * k}\\n"
                          f"{c.SPEC_ACCEPTED_TOKENS.exposed}{{{lab}}} {acc_g}\\n"
                          f"{c.REQUESTS_RUNNING.name}{{{lab}}} 8\\n", t, {"instance": f"e{g}"}, group=f"e{g}")
    root.guard.tick(t)
    print(k, flush=True)
"""


def test_drift_state_killed_at_any_moment_restores_each_group_whole_with_its_alarm(tmp_path):
    """kill -9 of a process running the guard's drift detectors (16 model/pools, simulated 60 s
    intervals, two groups drifting) at seeded-random moments, each life restarting from the file
    the last one left: every time the file passes ``integrity_check``, every part loads (none
    unreadable), every group's CUSUM decodes whole, and every open drift finding has its group's
    alarm (the finding is judged, not resolved as ``not_configured``)."""
    import subprocess
    import sys
    import time

    from sla_guard.compose import compose
    from sla_guard.ingest import build_store
    from sla_guard.ingest.source import StoreSource

    db = tmp_path / "state.db"
    rng = np.random.default_rng(7)
    k0, lives, opened = 0, 6, 0
    for life in range(lives):
        proc = subprocess.Popen([sys.executable, "-c", _DRIFT_LIFE, str(db), str(k0), "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # restored and ticking
        assert first, proc.stderr.read()
        time.sleep(float(rng.uniform(0.5, 2.5)))
        proc.kill()
        out = first + proc.stdout.read()
        proc.wait(10)
        k0 = int(out.split()[-1]) + 5  # the next life resumes 5 min later (a restart's downtime)
        state = StateStore(db)
        assert state.integrity() == "ok"
        saved = state.load()
        assert state.unreadable == 0
        state.close()
        cfg = parse_config({"detectors": {"acceptance": {"warmup_s": 600, "per_position": False}}})
        root = compose(cfg, source=StoreSource(build_store(cfg)), slo=False, advisor=False)
        ev = root.guard.evaluator("acceptance_drift")
        ev.state_load(saved["acceptance_drift"], [])
        root.findings.state_load(saved["findings"], [])
        assert len(ev.cusums) == 16 and all(isinstance(cus, drift.RateCusum) for cus in ev.cusums.values())
        for f in root.findings.open_findings():
            assert ev.claims(f.key), (life, f.key)
            opened += 1
    assert k0 > 120 and opened > 0, (k0, opened)  # lives reached past the drop, with findings open at a kill


def test_drift_state_of_the_single_part_layout_still_loads(tmp_path):
    """A file written before one part per group (all CUSUMs in part ``s``) restores, and the next
    full save replaces that part with one per group."""
    book = FindingsBook()
    cfg = RateConfig(warmup_s=600, interval_s=60)
    ev = RateDriftEvaluator(book, "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                            c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance")
    for g in range(3):
        cus = ev.cusums.setdefault((f"m{g}", "decode"), drift.RateCusum(ev.params))
        for k in range(30):
            cus.update(T0 + 60 * k, 1000.0, 700.0 + g)
    ev._next = T0 + 1800
    state = StateStore(tmp_path / "state.db")
    assert state.save({"acceptance_drift": {"s": encode({"next": ev._next, "cusums": ev.cusums})}}, now=T0)
    fresh = RateDriftEvaluator(FindingsBook(), "acceptance_drift", "acceptance_drift", c.SPEC_DRAFT_TOKENS,
                               c.SPEC_ACCEPTED_TOKENS, cfg, "both", "acceptance")
    fresh.state_load(state.load()["acceptance_drift"], [])
    assert fresh._next == ev._next and {k: _json(v) for k, v in fresh.cusums.items()} == {
        k: _json(v) for k, v in ev.cusums.items()}
    assert state.save({"acceptance_drift": fresh.state_dump(True)}, now=T0 + 60)
    parts = state.load()["acceptance_drift"]
    assert "s" not in parts and sorted(p for p in parts if p.startswith("g/")) == [
        f'g/["m{g}","decode"]' for g in range(3)]
    state.close()


# -- the advisor ----------------------------------------------------------------------------------

PROFILE = {"profile": {"prefill_tokens_per_s": 10_000, "decode_step_base_s": 0.01,
                       "decode_step_per_request_s": 0.0002}}


def _engine(model: str, pool: str, name: str) -> ScaleEngine:
    e = ScaleEngine(pool, name, instance=f"{name}:8000")
    e.registry = CollectorRegistry()
    e.rec = EngineRecorder(ContractMetrics(e.registry, components=[Component.ENGINE]), model, pool, name)
    return e


def test_wildcard_advisor_sizes_each_model_on_its_own():
    """Three models' pools in one store (1, 2 and 3 decode replicas): with model '*' the advice
    is per model with that model's replica count, never 6 decode replicas of 'default'."""
    reg = CollectorRegistry()
    ev = AdvisorEvaluator(AdvisorConfig.model_validate(PROFILE),
                          metrics=ContractMetrics(reg, components=[Component.GUARD]))
    store = scale_store()
    engines, ticks = [], {}
    for i, model in enumerate(("llama", "qwen", "mistral")):
        engines.append(_engine(model, "prefill", f"{model}-p0"))
        ticks[f"{model}-p0"] = {"running": 1, "waiting": 0, "computed": 1000, "prefills": 1, "ttft": 0.2}
        for j in range(i + 1):
            engines.append(_engine(model, "decode", f"{model}-d{j}"))
            ticks[f"{model}-d{j}"] = {"running": 2, "waiting": 0, "steps": 100}
    scale_run(engines, store, 1000, 1060, **ticks)
    ev.evaluate(store, 1060)
    recs, _, _ = ev.recommendations()
    current = {(r.model, r.pool): r.current for r in recs}
    assert current == {("llama", "prefill"): 1, ("llama", "decode"): 1, ("qwen", "prefill"): 1,
                       ("qwen", "decode"): 2, ("mistral", "prefill"): 1, ("mistral", "decode"): 3}
    assert sorted(ev.advisors) == ["llama", "mistral", "qwen"]
    for model, n in (("llama", 1), ("qwen", 2), ("mistral", 3)):
        assert reg.get_sample_value(c.GUARD_CURRENT_REPLICAS.series(), {"model": model, "pool": "decode"}) == n
    assert reg.get_sample_value(c.GUARD_CURRENT_REPLICAS.series(), {"model": "default", "pool": "decode"}) is None
    assert {r["model"] for r in ev.history} == {"llama", "qwen", "mistral"}
    # KEDA reads one model's pools through the real API, never a mix of three
    from guard_support import UvicornThread

    from sla_guard.scale.api import advisor_router

    app = FastAPI()
    app.include_router(advisor_router(ev))
    srv = UvicornThread(app)
    try:
        for model, n in (("llama", 1), ("qwen", 2), ("mistral", 3)):
            body = httpx.get(f"{srv.url}/v1/scale/keda", params={"model": model}, timeout=5).json()
            assert body["model"] == model and body["pools"]["decode"]["current"] == n, body
            flat = httpx.get(f"{srv.url}/v1/scale/keda/decode", params={"model": model}, timeout=5).json()
            assert flat["current"] == n
        assert httpx.get(f"{srv.url}/v1/scale/keda", timeout=5).status_code == 400  # which model?
    finally:
        srv.stop()
    # bounded: a fourth model beyond max_models gets no advisor
    ev.max_models = 3
    extra = [_engine("phi", "decode", "phi-d0")]
    scale_run(engines + extra, store, 1065, 1075, **ticks, **{"phi-d0": {"running": 1, "waiting": 0, "steps": 10}})
    ev.evaluate(store, 1075)
    assert "phi" not in ev.advisors


def test_advisor_memory_and_decision_tail_round_trip(tmp_path):
    ev = AdvisorEvaluator(AdvisorConfig.model_validate(PROFILE))
    store = scale_store()
    engines = [_engine("llama", "prefill", "p0"), _engine("llama", "decode", "d0")]
    ticks = {"p0": {"running": 1, "waiting": 0, "computed": 1000, "prefills": 1, "ttft": 0.2},
             "d0": {"running": 4, "waiting": 0, "steps": 200, "tpot": 0.012}}
    for t in range(1000, 1400, 20):
        scale_run(engines, store, t, t + 15, **ticks)
        ev.evaluate(store, t + 15)
    adv = ev.advisors["llama"]
    adv.memory["decode"].failed[2] = (1300.0, 0.8)  # a size that proved too small
    records = ev.state_records()
    assert len(records) == 2 * 20
    fresh = _roundtrip(tmp_path, "advisor", ev, AdvisorEvaluator(AdvisorConfig.model_validate(PROFILE)),
                       records=records)
    got = fresh.advisors["llama"]
    assert got.learned.decode == adv.learned.decode and got.learned.decode.samples > 0
    assert got.learned.prefill == adv.learned.prefill
    # the TPOT spread behind decode's headroom (5 requests a scrape at one TPOT: learned, near 0)
    assert got.learned.tpot_spread == adv.learned.tpot_spread and adv.learned.tpot_spread.requests > 0
    assert got.memory == adv.memory and got.memory["decode"].failed == {2: (1300.0, 0.8)}
    assert got.learned.first_seen == adv.learned.first_seen
    assert list(fresh.history) == records
    assert ev.state_records() == []


# -- the guard ------------------------------------------------------------------------------------

class _NullSource:
    mode = "scrape"
    view = None

    def ready(self) -> bool:
        return True


def test_guard_persists_each_tick_and_restores_components_when_added(tmp_path):
    cfg = parse_config(ATT)
    _e, store, _ev, t = _drive_att(900)
    from sla_guard.ingest.source import StoreSource

    st = StateStore(tmp_path / "g.db")
    g = Guard(cfg, StoreSource(store), [SLOEvaluator(cfg)], state=st)
    book = FindingsBook()
    g.add_state("findings", book)
    book.raise_("leak", KEY, "critical", "grows", {"model": "m"}, {}, t)
    g.tick(t)
    assert st.saves == 1 and g.last_persist_ms is not None
    held = _slo(g.evaluator("slo")).period_requests
    st.close()
    st2 = StateStore(tmp_path / "g.db")
    g2 = Guard(cfg, StoreSource(store), [SLOEvaluator(cfg)], state=st2)
    book2 = FindingsBook()
    g2.add_state("findings", book2)
    assert [f.key for f in book2.open_findings()] == [KEY]
    g2.tick(t)  # same instant: nothing new to feed
    assert _slo(g2.evaluator("slo")).period_requests == held
    assert g2.status()["state"]["components"] == ["findings", "slo"]
    assert _slo(g2.evaluator("slo")).status in (Status.OK, Status.AT_RISK, Status.UNKNOWN)


def test_serve_wiring_opens_the_configured_file(tmp_path):
    from sla_guard.state import open_state

    assert open_state(parse_config(ATT)) is None
    st = open_state(parse_config({**ATT, "state": {"path": str(tmp_path / "x.db"), "max_bytes": 2 * 1024 * 1024}}))
    assert st is not None and st.max_bytes == 2 * 1024 * 1024
    assert st.retention_s == pytest.approx(86400.0 + 86400.0)  # longest period (1d) + a day


# -- a sound file that cannot be used, and bad restored values -------------------------------------

def test_a_locked_or_newer_file_is_refused_by_name_never_moved_aside(tmp_path):
    """Probe: a second process holding the write lock (or a downgrade to an older guard) made the
    file "unreadable": it was moved aside and a fresh one started, forgetting the error budgets."""
    from sla_guard.state import StateUnavailable

    p = tmp_path / "state.db"
    st = StateStore(p)
    assert st.save({"slo": {"meta": {"x": 1}}})
    st.close()
    holder = sqlite3.connect(p, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StateUnavailable, match=str(p)) as err:
            StateStore(p)
        assert "state.path" in str(err.value) and "locked" in str(err.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    newer = sqlite3.connect(p)
    newer.execute("PRAGMA user_version=3")
    newer.commit()
    newer.close()
    with pytest.raises(StateUnavailable, match="schema version 3"):
        StateStore(p)
    assert not list(tmp_path.glob("*.corrupt-*"))
    newer = sqlite3.connect(p)
    newer.execute("PRAGMA user_version=2")
    newer.commit()
    newer.close()
    assert StateStore(p).load() == {"slo": {"meta": {"x": 1}}}


def test_serve_exits_2_naming_the_state_file_it_cannot_use(tmp_path, capsys):
    import yaml

    from sla_guard.cli import main

    p = tmp_path / "state.db"
    StateStore(p).close()
    newer = sqlite3.connect(p)
    newer.execute("PRAGMA user_version=9")
    newer.commit()
    newer.close()
    cfg = tmp_path / "guard.yaml"
    cfg.write_text(yaml.safe_dump({**ATT, "state": {"path": str(p)},
                                   "source": {"targets": [{"url": "http://127.0.0.1:9/metrics", "pool": "decode"}]}}))
    assert main(["serve", "--config", str(cfg), "--listen", "127.0.0.1:9"]) == 2
    assert f"state file {p}" in capsys.readouterr().err


def test_a_save_while_another_process_holds_the_lock_is_counted_and_the_guard_keeps_ticking(tmp_path):
    st = StateStore(tmp_path / "state.db")
    cfg = parse_config(ATT)
    guard = Guard(cfg, _NullSource(), [SLOEvaluator(cfg)], state=st)
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        guard.tick(T0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert guard.ticks == 1 and st.errors == 1 and "locked" in (st.problem or "")
    guard.tick(T0 + 15)
    assert st.saves == 1 and guard.ticks == 2


@pytest.mark.parametrize("bad", [{"g": math.nan}, {"g": math.inf, "t": math.inf}, {"g": 1e9}, {"t": -1e9}])
def test_nan_inf_or_impossible_ledger_counts_from_the_file_are_never_judged_ok(tmp_path, bad):
    """Probe: one restored bucket with good=NaN made the period's errors NaN: budget and burn
    rates None, so a violated pool came back "ok" from the file."""
    cfg = parse_config(ATT)
    _e, store, ev, t = _drive_att(1800, bad_every=8)
    assert _slo(ev).status is Status.VIOLATED
    st = StateStore(tmp_path / "state.db")
    parts = ev.state_dump(True)
    name = next(k for k, v in parts.items() if k.startswith("ledger/c/") and v and v["b"])
    parts[name] = {**parts[name], **{k: [x] * len(parts[name]["b"]) for k, x in bad.items()}}
    st.save({"slo": parts})
    fresh = SLOEvaluator(cfg)
    fresh.state_load(st.load()["slo"], [])
    fresh.evaluate(store, t)
    assert _slo(fresh).status is not Status.OK, _slo(fresh)


def test_a_second_guard_on_the_same_state_file_is_refused_naming_the_holder(tmp_path):
    """Two guards configured with one state.path both wrote it: each restart restored a mix of
    the two guards' ledgers and findings. The second is refused (a flock on ``<name>.lock``,
    released by the kernel when the holder dies), and serve exits 2 naming the file."""
    import subprocess
    import sys

    from sla_guard.state import StateUnavailable

    p = tmp_path / "state.db"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom sla_guard.state import StateStore\n"
                               f"s = StateStore({str(p)!r}); print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StateUnavailable, match="in use by another sla-guard") as err:
            StateStore(p)
        assert f"pid {holder.pid}" in str(err.value) and "state.path" in str(err.value)
    finally:
        holder.kill()  # SIGKILL: no close(); the kernel drops the lock
        holder.wait()
    st = StateStore(p)
    assert st.save({"slo": {"meta": {"x": 1}}})
    with pytest.raises(StateUnavailable, match="in use"):
        StateStore(p)  # in-process too: a second store on an open file
    st.close()
    assert StateStore(p).load() == {"slo": {"meta": {"x": 1}}}
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_a_part_or_record_that_is_not_utf8_is_skipped_and_reported_and_the_rest_restored(tmp_path):
    """Probe: one flipped byte that left a stored value invalid UTF-8 (2 of every 30 random flips
    of a closed state file; SQLite's quick check does not read values) made ``state.load()`` raise
    ``OperationalError: Could not decode to UTF-8``: ``serve`` died with a traceback at every start."""
    p = tmp_path / "state.db"
    book = FindingsBook()
    book.raise_("leak", KEY, "critical", "grows", {"model": "m"}, {}, T0)
    st = StateStore(p)
    assert st.save({"findings": book.state_dump(True), "slo": {"meta": {"last_feed": T0}}},
                   {"advisor": [{"t": T0, "n": 1}, {"t": T0 + 1, "n": 2}]}, now=T0)
    st.close()
    with sqlite3.connect(p) as conn:
        conn.execute("UPDATE kv SET value = CAST(x'7b2261223a22ff227d' AS TEXT) WHERE component = 'slo'")
        conn.execute("UPDATE log SET value = CAST(x'7b2274223aff7d' AS TEXT) WHERE id = 1")
    st = StateStore(p)
    assert st.moved_aside is None
    cfg = parse_config(ATT)
    guard = Guard(cfg, _NullSource(), state=st)
    restored = FindingsBook()
    guard.add_state("findings", restored)
    assert [f.key for f in restored.open_findings()] == [KEY]
    assert st.tail("advisor", 10) == [{"t": T0 + 1, "n": 2}]
    state = guard.status()["state"]
    assert state["unreadable"] == 2 and "unreadable record(s) skipped reading advisor" in state["problem"]
    assert st.save({"slo": {"meta": {"last_feed": T0 + 15}}}, now=T0 + 15)  # the part is rewritten
    st.close()
    assert StateStore(p).load()["slo"] == {"meta": {"last_feed": T0 + 15}}


def test_parts_that_never_change_outlive_the_retention_of_a_long_running_guard(tmp_path):
    """Probe: retention deletes parts not written for ``retention_s`` (the longest period + 1 day),
    and a frozen stage baseline or a quiet resolved-findings list is written only when it changes:
    after 25 h of uptime (1 h period) both were gone from the file, so the next restart relearned
    the baseline from today's (grown) latencies and forgot the resolved findings."""
    from sla_guard.detect.stages import StageBreakdownEvaluator
    from sla_guard.state import open_state

    cfg = parse_config({**ATT, "slos": [{"objectives": [{**ATT["slos"][0]["objectives"][0], "period": "1h"}]}],
                        "state": {"path": str(tmp_path / "state.db")}})
    st = open_state(cfg)
    guard = Guard(cfg, _NullSource(), state=st)
    stages, book = StageBreakdownEvaluator(cfg), FindingsBook()
    stages.baseline = {"m": {"prefill": 0.2}}
    guard.add_state("ttft_breakdown", stages)
    guard.add_state("findings", book)
    book.raise_("leak", KEY, "critical", "grows", {"model": "m"}, {}, T0)
    book.resolve(KEY, T0 + 1)
    for k in range(200):  # 33 h of saves, 10 min apart
        guard.persist(T0 + 600.0 * k)
    assert st.retention_s < 600.0 * 199
    st.close()
    saved = StateStore(tmp_path / "state.db").load()
    assert saved["ttft_breakdown"] == {"baseline": {"m": {"prefill": 0.2}}}
    assert [f["f"]["key"] for f in saved["findings"]["resolved"]] == [KEY]


def test_another_programs_database_at_state_path_is_refused_and_left_untouched(tmp_path):
    """Probe: ``state.path`` naming another program's SQLite file with a ``kv`` table: the schema's
    ``IF NOT EXISTS`` took that table for the guard's, the file was switched to WAL and stamped
    ``user_version=1`` with a ``log`` table added, then ``serve`` died with a traceback (no such
    column: component) at every start."""
    from sla_guard.state import StateUnavailable

    p = tmp_path / "app.db"
    with sqlite3.connect(p) as conn:
        conn.execute("CREATE TABLE kv (k TEXT PRIMARY KEY, v TEXT)")
        conn.execute("INSERT INTO kv VALUES ('a', 'b')")
    conn.close()
    with pytest.raises(StateUnavailable, match=r"not an sla-guard state file \(it has table kv\(k, v\)\)"):
        StateStore(p)
    with sqlite3.connect(p) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["kv"]
    conn.close()
    assert not list(tmp_path.glob("*.corrupt-*"))
    st = StateStore(tmp_path / "own.db")  # the guard's own file: fresh, then reopened
    assert st.save({"a": {"x": 1}})
    st.close()
    assert StateStore(tmp_path / "own.db").load() == {"a": {"x": 1}}


def test_a_save_failure_that_ended_is_no_longer_reported(tmp_path):
    """Probe (a 3 MiB tmpfs filled under a real serve): saves failed with "database or disk is
    full", then resumed once space was freed, but ``/v1/status`` kept the failure as the state's
    ``problem`` until the next restart."""
    st = StateStore(tmp_path / "state.db")
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert not st.save({"a": {"x": 1}})
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "state save failed" in st.status()["problem"]
    assert st.save({"a": {"x": 2}})
    assert st.status()["problem"] is None and st.status()["errors"] == 1


# -- damaged values: checksums --------------------------------------------------------------------

def _real_state_file(tmp_path):
    """A closed state file as ``serve`` writes it (``Guard.persist``): a violated pool's SLO
    ledger, an open and a resolved finding, an advisor's learned state and its decision records."""
    cfg = parse_config(ATT)
    _e, _store, slo, t = _drive_att(1800, bad_every=40)
    book = FindingsBook()
    book.raise_("leak", KEY, "critical", "grows", {"model": "m", "pool": "decode"}, {"eta_s": 1680.0}, T0 + 100)
    book.raise_("tpot_drift", "tpot_drift/m/decode", "warning", "slow", {"model": "m"}, {"after": 1.3}, T0 + 100)
    book.resolve("tpot_drift/m/decode", T0 + 150)
    adv = AdvisorEvaluator(AdvisorConfig.model_validate(PROFILE))
    engines = [_engine("llama", "prefill", "p0"), _engine("llama", "decode", "d0")]
    ticks = {"p0": {"running": 1, "waiting": 0, "computed": 1000, "prefills": 1, "ttft": 0.2},
             "d0": {"running": 4, "waiting": 0, "steps": 200, "tpot": 0.012}}
    s2 = scale_store()
    for tt in range(int(T0), int(T0) + 1200, 20):
        scale_run(engines, s2, tt, tt + 15, **ticks)
        adv.evaluate(s2, tt + 15)
    p = tmp_path / "state.db"
    st = StateStore(p)
    guard = Guard(cfg, _NullSource(), state=st)
    for name, comp in (("slo", slo), ("findings", book), ("advisor", adv)):
        guard.add_state(name, comp)
    assert guard.persist(t)
    st.close()  # the last connection's close checkpoints: everything is in the one file
    return p


def _snapshot(p):
    st = StateStore(p)
    try:
        return st.load(), st.tail("advisor", 256), st.unreadable, st.moved_aside
    finally:
        st.close()


def _flip(src, dst, bit: int) -> None:
    data = bytearray(src.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    for q in dst.parent.glob(dst.name + "*"):
        q.unlink()
    dst.write_bytes(bytes(data))


def test_a_flipped_bit_anywhere_in_the_file_is_never_restored_as_a_different_value(tmp_path):
    """Probe: single random bit flips in a real closed state file: 159 of 400 loaded a different
    value with nothing reported (21 parts: an SLO ledger's counts, a finding's time, a renamed
    ledger key; 138 decision records), as a flipped digit is still valid JSON. Each part and
    record now carries a CRC32 of its names and value: a damaged one is skipped and counted in
    ``unreadable``, so after a flip the file loads unchanged, reports what it skipped, or (a
    damaged page the quick check sees) is moved aside."""
    import random

    base = _real_state_file(tmp_path)
    ref_parts, ref_recs, unreadable, moved = _snapshot(base)
    assert unreadable == 0 and moved is None and len(ref_recs) == 120 and len(ref_parts["slo"]) >= 3
    rng = random.Random(1)
    work = tmp_path / "flipped.db"
    changed, unreported, reported = [], [], 0
    for _ in range(150):
        bit = rng.randrange(base.stat().st_size * 8)
        _flip(base, work, bit)
        parts, recs, unreadable, moved = _snapshot(work)
        if moved:
            continue
        wrong = [f"{c}/{k}" for c in parts for k, v in parts[c].items() if ref_parts.get(c, {}).get(k, v) != v
                 or k not in ref_parts.get(c, {})]
        wrong += [f"record {r}" for r in recs if r not in ref_recs]
        if wrong:
            changed.append((bit, wrong[:2]))
        lost = sum(len(v) for v in ref_parts.values()) - sum(len(v) for v in parts.values()) + len(ref_recs) - len(recs)
        if lost and not unreadable:
            unreported.append(bit)
        reported += unreadable > 0
    assert changed == [] and unreported == []
    assert reported > 50  # most flips land in a stored value and are reported


def test_a_damaged_record_stream_name_or_index_entry_never_hides_records_unreported(tmp_path):
    """Probe: a flipped byte in an entry of the ``(stream, t)`` index (the quick check does not
    compare it with the table) hid every record sorted after it, 62 of 180, and one in a record's
    stream name hid that record; neither was reported."""
    src = tmp_path / "state.db"
    st = StateStore(src)
    assert st.save({"slo": {"meta": {"last_feed": T0}}},
                   {"advisor": [{"t": T0 + k, "n": k} for k in range(180)]}, now=T0 + 180)
    st.close()
    data, work = src.read_bytes(), tmp_path / "damaged.db"
    found = {}
    at = data.find(b"advisor")
    while at >= 0 and len(found) < 2:
        _flip(src, work, (at + 1) * 8 + 1)  # "advisor" -> "afvisor"
        with sqlite3.connect(work) as conn:
            ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            in_table = conn.execute("SELECT COUNT(*) FROM log NOT INDEXED WHERE stream = 'advisor'").fetchone()[0]
            by_index = conn.execute("SELECT COUNT(*) FROM log INDEXED BY log_stream_t WHERE stream = 'advisor'"
                                    ).fetchone()[0]
        conn.close()
        kind = "row" if in_table == 179 else "index" if by_index < 180 else None
        if ok and kind and kind not in found:
            found[kind] = work.read_bytes()
        at = data.find(b"advisor", at + 1)
    assert set(found) == {"row", "index"}
    for kind, damaged in found.items():
        work.write_bytes(damaged)
        st = StateStore(work)
        recs = st.tail("advisor", 256)
        assert st.moved_aside is None
        if kind == "index":
            assert [r["n"] for r in recs] == list(range(180)) and st.unreadable == 0
        else:
            assert len(recs) == 179 and st.unreadable == 1 and "unreadable record(s)" in st.problem
        st.close()


_V1_SCHEMA = """
CREATE TABLE kv (component TEXT NOT NULL, part TEXT NOT NULL, value TEXT NOT NULL,
                 updated_at REAL NOT NULL, PRIMARY KEY (component, part)) WITHOUT ROWID;
CREATE TABLE log (id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, t REAL NOT NULL, value TEXT NOT NULL);
CREATE INDEX log_stream_t ON log (stream, t);
PRAGMA user_version=1;
"""


def test_a_version_1_file_without_checksums_is_migrated_and_loads_as_before(tmp_path):
    """A file written before checksums (schema 1, as the guard before this change wrote it) is
    restored as it is; its rows get their CRC on open, so damage found later is reported too."""
    p = tmp_path / "state.db"
    conn = sqlite3.connect(p)
    conn.executescript(_V1_SCHEMA)
    conn.execute("PRAGMA journal_mode=WAL")
    with conn:
        conn.execute("INSERT INTO kv VALUES ('slo', 'meta', ?, ?)", ('{"last_feed":1700000000.0}', T0))
        conn.execute("INSERT INTO kv VALUES ('findings', 'open', '[]', ?)", (T0,))
        conn.execute("INSERT INTO log (stream, t, value) VALUES ('advisor', ?, '{\"t\":1700000000.0,\"n\":7}')",
                     (T0,))
    conn.close()
    st = StateStore(p)
    assert st.moved_aside is None
    assert st.load() == {"slo": {"meta": {"last_feed": T0}}, "findings": {"open": []}}
    assert st.tail("advisor", 10) == [{"t": T0, "n": 7}] and st.unreadable == 0
    assert st.save({"slo": {"meta": {"last_feed": T0 + 15}}}, {"advisor": [{"t": T0 + 15, "n": 8}]}, now=T0 + 15)
    st.close()
    with sqlite3.connect(p) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
        assert conn.execute("SELECT COUNT(*) FROM kv WHERE crc IS NULL").fetchone() == (0,)
        assert conn.execute("SELECT COUNT(*) FROM log WHERE crc IS NULL").fetchone() == (0,)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    st = StateStore(p)
    assert st.load()["slo"] == {"meta": {"last_feed": T0 + 15}}
    assert [r["n"] for r in st.tail("advisor", 10)] == [7, 8]
    st.close()
    data = p.read_bytes()  # a flipped digit of the migrated record: reported, not restored as "n": 6
    at = data.find(b'"n":7')
    _flip(p, tmp_path / "damaged.db", (at + 4) * 8)
    st = StateStore(tmp_path / "damaged.db")
    assert [r["n"] for r in st.tail("advisor", 10)] == [8] and st.unreadable == 1
    st.close()


def test_a_full_disk_under_a_running_guard_is_named_on_metrics_and_the_log_and_saving_resumes(tmp_path):
    """A real ``serve`` whose state file stops growing (``RLIMIT_FSIZE`` lowered on the running
    process: the writes fail as on a full disk). It kept ticking, but the only signs were the
    log line "state save failed: disk I/O error", naming neither the file nor the fix, and
    ``/v1/status`` behind the token: nothing on ``/metrics`` to alert on."""
    import resource

    from guard_support import GuardProcess, Served

    e = Engine(model="m", pool="decode")
    srv = Served(e.exposition)
    db = tmp_path / "state.db"
    cfg = {**ATT, "source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.25,
                             "targets": [{"url": srv.url, "model": "m", "pool": "decode", "name": "e0"}]},
           "evaluation_interval_s": 0.25, "staleness_s": 30, "state": {"path": str(db)}}
    g = GuardProcess(tmp_path, cfg, log_level="info")
    try:
        def state():  # and a request per look: a tick with nothing new writes nothing
            e.request(0.2, 0.01)
            return g.get("/v1/status").json()["state"]

        g.wait_for("two saves", lambda: state()["saves"] >= 2)
        size = max(db.stat().st_size, (tmp_path / "state.db-wal").stat().st_size)
        hard = resource.prlimit(g.proc.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(g.proc.pid, resource.RLIMIT_FSIZE, (size, hard))  # the file cannot grow: "full"
        failing = g.wait_for("failed saves", lambda: (s := state())["errors"] >= 2 and s)
        assert str(db) in failing["problem"] and "free disk space" in failing["problem"]
        metric = "slaguard_guard_state_save_errors_total "
        g.wait_for("the failures on /metrics", lambda: [ln for ln in g.get("/metrics", auth=False).text.splitlines()
                                                        if ln.startswith(metric) and float(ln.split()[-1]) >= 2])
        resource.prlimit(g.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        saves = failing["saves"]
        g.wait_for("saving again", lambda: (s := state())["saves"] > saves and s["problem"] is None)
    finally:
        log = g.stop()
        srv.stop()
    assert f"state save failed: state file {db}" in log and "free disk space" in log
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# -- a file that cannot be used at start: serve without persistence, retry, restore -----------------

def test_a_held_file_at_start_leaves_the_guard_serving_and_is_restored_never_overwritten_once_free(tmp_path):
    """Probe: a state file serve could not open (here held by another guard; a read-only volume,
    a full disk: the same path) made serve exit 2: on Kubernetes a crash loop with no verdicts, no
    metrics and no alerts, for a problem of persistence only. Now the guard runs with persistence
    off (said on /v1/status and /metrics), never writes the file meanwhile, and once it is free
    restores what it holds (the planted open finding) before saving again."""
    import subprocess
    import sys

    from guard_support import GuardProcess, Served

    db = tmp_path / "state.db"
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom sla_guard.detect.findings import FindingsBook\n"
                               "from sla_guard.state import StateStore\nb = FindingsBook()\n"
                               f"b.raise_('leak', {KEY!r}, 'critical', 'grows', {{'model': 'm'}}, {{}}, {T0})\n"
                               f"s = StateStore({str(db)!r}); s.save({{'findings': b.state_dump(True)}})\n"
                               "print('open', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    e = Engine(model="m", pool="decode")
    srv = Served(e.exposition)
    cfg = {**ATT, "source": {"mode": "scrape", "interval_s": 0.25, "timeout_s": 0.25,
                             "targets": [{"url": srv.url, "model": "m", "pool": "decode", "name": "e0"}]},
           "evaluation_interval_s": 0.25, "staleness_s": 30, "state": {"path": str(db)}}
    g = None
    try:
        assert holder.stdout.readline().strip() == "open"
        g = GuardProcess(tmp_path, cfg, log_level="info")
        st = g.wait_for("ticks without persistence", lambda: (s := g.get("/v1/status").json())["ticks"] >= 2 and s)
        assert st["state"]["persisting"] is False and st["state"]["saves"] == 0
        assert str(db) in st["state"]["problem"] and "persistence is off" in st["state"]["problem"]
        assert g.get("/readyz", auth=False).status_code == 200  # the verdicts are sound
        metric = "slaguard_guard_state_save_errors_total "
        assert [ln for ln in g.get("/metrics", auth=False).text.splitlines()
                if ln.startswith(metric) and float(ln.split()[-1]) >= 1]
        assert not g.get("/v1/findings").json()["findings"]
        holder.stdin.close()  # the other guard exits: the lock is free
        assert holder.wait(10) == 0
        g.wait_for("persisting again", lambda: (s := g.get("/v1/status").json()["state"])["persisting"] and
                   s["saves"] >= 1 and s["problem"] is None)
        assert [f["key"] for f in g.get("/v1/findings").json()["findings"]] == [KEY]
    finally:
        holder.kill()
        holder.wait()
        log = g.stop() if g is not None else ""
        srv.stop()
    assert f"persistence is off: state file {db}" in log and "usable again" in log
    saved = StateStore(db).load()
    assert [k for k in saved["findings"] if k.startswith("o/")] == [f"o/{KEY}"]


def test_a_detached_store_writes_nothing_and_a_restore_into_a_running_guard_counts_no_request_twice(tmp_path):
    """While detached nothing reads or writes the file (the other guard's budgets stay as they
    are); at attach the file's ledger and the one learned meanwhile are merged and the ledger feeds
    on from the later ``_last_feed``: from the file's, it counted every request of the detached
    period twice (more requests in the period than the engine served)."""
    cfg = parse_config(ATT)
    e = Engine()

    def per_tick(rng, eng):
        return [(0.2, 0.01)] * 4

    _s, ev_a, t_a = drive([e], 1800, per_tick, cfg=cfg, ev=SLOEvaluator(cfg))
    p = tmp_path / "state.db"
    other = StateStore(p)
    assert other.save({"slo": ev_a.state_dump(True)}, now=t_a)
    before = other.load()
    st = StateStore(p, retry=True)
    assert st.detached and "in use by another sla-guard" in st.problem and not st.status()["persisting"]
    assert st.load() == {} and st.tail("advisor", 10) == [] and not st.save({"slo": {"meta": {}}})
    store_b = SeriesStore(slots=400, lookback_s=cfg.staleness_s)
    ev_b = SLOEvaluator(cfg)
    from sla_guard.ingest.source import StoreSource

    guard = Guard(cfg, StoreSource(store_b), [ev_b], state=st)
    _s, _ev, t_b = drive([e], 900, per_tick, cfg=cfg, ev=ev_b, store=store_b, t0=t_a + 5)
    guard.tick(t_b + 1)  # still held: not saved, counted on /metrics
    assert guard.metrics[c.GUARD_STATE_SAVE_ERRORS]._value.get() == 1
    assert other.load() == before
    other.close()
    e.request(0.2, 0.01)
    scrape_into(store_b, [e], t_b + 5)
    guard.tick(t_b + 5)
    assert st.detached is None and st.saves == 1 and st.problem is None
    got = _slo(ev_b).period_requests
    assert _slo(ev_a).period_requests < got <= len(e.sent_ttft), (got, len(e.sent_ttft))
    st.close()
    fresh = SLOEvaluator(cfg)
    fresh.state_load(StateStore(p).load()["slo"], [])
    assert fresh._last_feed == t_b + 5


def test_a_newer_schema_or_a_path_that_cannot_be_a_file_still_refuses_to_start(tmp_path):
    """Exiting stays right where waiting cannot help: a newer guard's file (a downgrade would lose
    data) and a path under a file (the config's mistake)."""
    from sla_guard.state import StateUnavailable

    p = tmp_path / "state.db"
    StateStore(p).close()
    with sqlite3.connect(p) as newer:
        newer.execute("PRAGMA user_version=3")
    newer.close()
    with pytest.raises(StateUnavailable, match="schema version 3"):
        StateStore(p, retry=True)
    with pytest.raises(StateUnavailable, match="a part of the path is a file"):
        StateStore(p / "state.db", retry=True)
