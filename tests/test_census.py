"""The object census on plain Python object graphs (engine_hooks/census.py), its exposition
(exporters/process_collector.py) and what the guard does with it (sla_guard/detect/census.py,
the Alertmanager description, ``sla-guard analyze leak --census``)."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest

from engine_hooks import census as cs
from exporters import contract as c
from exporters.process_collector import census_rows, read_census, snapshot_rows
from exporters.process_sampler import take_snapshot, write_snapshot
from sla_guard.commands import analyze
from sla_guard.detect.alertmanager import describe
from sla_guard.detect.census import CensusEvaluator, attribute, census_summary
from sla_guard.detect.findings import FindingsBook
from sla_guard.store import SeriesStore

ROOT = Path(__file__).resolve().parents[1]


class Manager:
    def __init__(self) -> None:
        self.new_block_ids: list[int] = []
        self.free = deque(range(50))


class Coordinator:
    def __init__(self) -> None:
        self.single_type_managers = (Manager(), Manager())


class Slotted:
    __slots__ = ("cache", "name")

    def __init__(self) -> None:
        self.cache = {f"k{i}": i for i in range(20)}
        self.name = "x"


class Scheduler:
    def __init__(self) -> None:
        self.coordinator = Coordinator()
        self.requests: dict[str, object] = {}
        self.slotted = Slotted()


class Engine:
    def __init__(self) -> None:
        self.scheduler = Scheduler()


def walk(roots, limits=cs.Limits(), **kw) -> cs.Walk:
    w = cs.Walk(started=time.time())
    assert cs.run_sliced(cs.walk_steps(roots, limits, w, **kw), w, budget=1.0)
    w.finished = time.time()
    return w


def test_paths_are_readable_and_cover_slots_tuples_and_dicts():
    eng = Engine()
    eng.scheduler.coordinator.single_type_managers[0].new_block_ids.extend(range(100))
    for i in range(3):  # per-request containers share one path: [*] for request-id keys
        eng.scheduler.requests[f"cmpl-{i:08x}deadbeef"] = [0] * 10
    w = walk([("Engine", eng)])
    got = {p: r[:2] for p, r in w.containers.items()}
    assert got["Engine.scheduler.coordinator.single_type_managers[0].new_block_ids"] == [100, 1]
    assert got["Engine.scheduler.coordinator.single_type_managers[0].free"] == [50, 1]
    assert got["Engine.scheduler.slotted.cache"] == [20, 1]
    assert got["Engine.scheduler.requests[*]"] == [30, 3]  # summed over the 3 request lists
    assert "Engine.scheduler.coordinator.single_type_managers[1].new_block_ids" not in got  # empty: below min_len


def test_objects_hidden_by_gc_freeze_are_found():
    """Built before gc.freeze() (like vLLM's engine): gc.get_objects() no longer lists the
    container, the census still finds it from the roots."""
    code = textwrap.dedent("""
        import gc, json, sys, time
        sys.path.insert(0, sys.argv[1])
        from engine_hooks import census as cs

        class Holder:
            def __init__(self):
                self.leaky = list(range(64))

        holder = Holder()
        gc.collect()
        gc.freeze()
        hidden = not any(o is holder.leaky for o in gc.get_objects())
        w = cs.Walk()
        assert cs.run_sliced(cs.walk_steps(cs.module_roots, cs.Limits(), w), w, budget=1.0)
        print(json.dumps({"frozen": gc.get_freeze_count(), "hidden": hidden,
                          "found": {p: r[0] for p, r in w.containers.items() if "leaky" in p}}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 0 and got["hidden"] is True
    assert got["found"] == {"__main__.holder.leaky": 64}


def test_frame_roots_name_the_busy_loops_self():
    eng = Engine()
    eng.scheduler.coordinator.single_type_managers[0].new_block_ids.extend(range(10))
    stop = threading.Event()

    class EngineCoreProc:
        def __init__(self, inner):
            self.scheduler = inner.scheduler

        def run_busy_loop(self):
            while not stop.is_set():
                time.sleep(0.005)

    th = threading.Thread(target=EngineCoreProc(eng).run_busy_loop, daemon=True)
    th.start()
    try:
        time.sleep(0.05)
        roots = cs.frame_roots(threading.get_ident())
        assert "EngineCoreProc" in [n for n, _ in roots]
        w = walk(roots)
        assert "EngineCoreProc.scheduler.coordinator.single_type_managers[0].new_block_ids" in w.containers
    finally:
        stop.set()
        th.join(2)


def test_the_walk_never_runs_subclass_code():
    class Lazy(OrderedDict):
        def __len__(self):
            raise AssertionError("__len__ called")

        def items(self):
            raise AssertionError("items() called")

        def __iter__(self):
            raise AssertionError("__iter__ called")

    class Prop:
        def __init__(self):
            self.data = list(range(10))

        @property
        def boom(self):
            raise AssertionError("property called")

        def __getattr__(self, name):
            raise AssertionError(f"__getattr__({name}) called")

    lazy = Lazy()
    for i in range(12):
        OrderedDict.__setitem__(lazy, f"k{i}", i)
    w = walk([("lazy", lazy), ("prop", Prop())])
    assert w.containers["lazy"][0] == 12 and w.containers["prop.data"][0] == 10


def test_bounds_objects_depth_and_path_length():
    chain: list = []
    node = chain
    for _ in range(100):  # a 100-deep chain of lists of 8
        nxt: list = []
        node.extend([nxt, *range(7)])
        node = nxt
    w = walk([("chain", chain)], cs.Limits(max_depth=5, max_path_len=20))
    assert w.objects <= 7 and all(len(p) <= 20 for p in w.containers)
    big = [[i] * 10 for i in range(1000)]
    w = walk([("big", big)], cs.Limits(max_objects=50, max_children=100))
    assert w.objects == 50 and w.truncated


def test_the_walk_queues_no_more_than_it_can_expand():
    """Breadth first, what is queued beyond ``max_objects`` is never expanded. Queuing it anyway
    made a wide graph hold its whole frontier at once (here 65 536 objects for a walk of 1 000;
    a 2M-object process: 240 MiB and a 100 ms GIL stall), whatever ``max_objects`` said."""

    class Node:
        def __init__(self) -> None:
            self.tags = [1, 2]

    wide = [[Node() for _ in range(256)] for _ in range(256)]
    limits = cs.Limits(max_objects=1000)
    w = walk([("wide", wide)], limits)
    assert w.objects == limits.max_objects and w.truncated
    assert w.max_queued <= limits.max_objects
    assert cs.walk_stats(w)["max_queued"] == w.max_queued
    n = 1 + 2 + 2 * 256 * 2  # wide[:2]: the outer list, 2 lists, 512 nodes and their tags lists
    whole = walk([("wide", wide[:2])], cs.Limits(max_objects=n))  # exactly enough: not truncated
    assert not whole.truncated and whole.objects == n
    short = walk([("wide", wide[:2])], cs.Limits(max_objects=n - 1))
    assert short.truncated and short.objects == n - 1


def test_a_metaclass_neither_runs_nor_stops_the_walk():
    """``t.__mro__``, ``t.__dictoffset__``, ``vars(t)``, ``t.__name__`` go through the metaclass:
    one class whose metaclass raises there made every walk of the process fail (nothing named)."""
    ran: list[str] = []

    class Meta(type):
        def __getattribute__(cls, name):
            ran.append(name)
            if name in ("__mro__", "__dictoffset__", "__dict__", "__name__"):
                raise RuntimeError(f"lazy proxy class: {name}")
            return super().__getattribute__(name)

    class Proxy(metaclass=Meta):
        def __init__(self) -> None:
            self.cache = list(range(12))

        def serve(self, serving: threading.Event, stop: threading.Event) -> None:
            serving.set()
            stop.wait(30)

    class Holder:
        def __init__(self) -> None:
            self.proxy = Proxy()
            self.growing = list(range(50))

    holder = Holder()
    serving, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=holder.proxy.serve, args=(serving, stop), daemon=True)
    t.start()
    try:
        assert serving.wait(30)
        ran.clear()
        w = walk([("holder", holder)])
        roots = dict(cs.frame_roots(threading.get_ident()))
    finally:
        stop.set()
        t.join()
    assert {p: r[0] for p, r in w.containers.items()} == {"holder.growing": 50, "holder.proxy.cache": 12}
    assert roots.get("Proxy") is holder.proxy
    assert ran == []


def test_a_walk_keeps_no_class_alive():
    """Classes made per request (pydantic ``create_model``, a namedtuple factory) die with their
    instances; the walk's type cache used to keep every class it had seen (up to 50 000, with
    their class attributes) for the life of the process."""
    requests = {}
    classes = []
    for i in range(20):
        cls = type(f"Schema{i}", (), {"schema": bytes(1000)})
        classes.append(weakref.ref(cls))
        requests[f"r{i}"] = cls()
    del cls
    walk([("requests", requests)])
    requests.clear()
    gc.collect()
    assert [r for r in classes if r() is not None] == []


def test_slices_are_bounded_and_the_budget_holds():
    """A walk of a big graph built before gc.freeze(), as vLLM's is: the GIL slices stay under
    5 ms (99th percentile of the thread's CPU time per slice; a young-generation GC pass that the
    walk's allocations trigger can land in a slice, hence the looser bound on the maximum), and
    with a 1 % budget the thread sleeps 99 times what it worked."""
    graph = [{f"n{i}": Manager() for i in range(200)} for _ in range(200)]
    for part in graph:
        for m in part.values():
            m.new_block_ids.extend(range(10))
    gc.collect()
    gc.freeze()
    try:
        w = cs.Walk()
        slept: list[float] = []
        steps = cs.walk_steps([("graph", graph)], cs.Limits(), w)
        assert cs.run_sliced(steps, w, slice_s=cs.DEFAULT_SLICE_S, budget=0.01,
                             wait=lambda s: slept.append(s) or False)
    finally:
        gc.unfreeze()
    assert w.objects > 40_000 and w.slices > 5
    cpu = sorted(w.slice_cpu)
    assert cpu[int(0.99 * (len(cpu) - 1))] <= cs.MAX_SLICE_S, cpu[-5:]
    assert w.max_slice_cpu_s <= 4 * cs.MAX_SLICE_S, cpu[-5:]
    busy_but_last = w.busy_s - w.slice_durations[-1]
    assert sum(slept) == pytest.approx(99 * busy_but_last, rel=1e-6)


def test_growth_rates_and_steadiness():
    tr = cs.GrowthTracker()
    leaky, queue = [], []
    for k in range(6):
        leaky.extend([b"x" * 100] * 50)  # +50 per walk
        queue[:] = [0] * (20 if k % 2 else 40)  # fills and drains: not a leak
        w = cs.Walk(started=1000.0 + 60 * k)
        w.containers = {"E.leaky": [len(leaky), 1, 108.0, 1000.0 + 60 * k, 0],
                        "E.queue": [len(queue), 1, 8.0, 1000.0 + 60 * k, 0]}
        w.finished = w.started
        tr.add(w, rss=1e9 + k * 60 * 2000.0)  # RSS +2000 B/s
    (g,) = tr.growers()
    assert g.owner == "E.leaky" and g.growth_per_h == pytest.approx(50 / 60 * 3600)
    assert g.bytes_per_h == pytest.approx(50 / 60 * 3600 * 108.0)
    share, rest = cs.explained([g], tr.rss_slope_per_h())
    assert share == pytest.approx(50 / 60 * 108 / 2000) and rest == pytest.approx(7.2e6 - g.bytes_per_h)
    assert cs.steady_growth([(0, 10), (1, 12), (2, 11), (3, 14)])  # one dip, still steady
    assert not cs.steady_growth([(0, 10), (1, 12)])  # too few walks
    assert not cs.steady_growth([(0, 10), (1, 50), (2, 20), (3, 60)])  # falls by more than 10 %


def test_a_frames_walk_keeps_module_paths():
    tr = cs.GrowthTracker()
    full = cs.Walk(started=0.0, full=True)
    full.containers = {"mod.cache": [10, 1, 8.0, 0.0, 1], "E.x": [10, 1, 8.0, 0.0, 1]}
    tr.add(full)
    frames = cs.Walk(started=1.0)
    frames.containers = {"E.y": [10, 1, 8.0, 1.0, 0]}
    tr.add(frames)
    assert {"mod.cache", "E.x", "E.y"} <= tr.series.keys()
    tr.add(cs.Walk(started=2.0, full=True))
    assert set(tr.series) == {"E.y"}


def test_census_thread_measures_a_growing_list_at_its_rate(tmp_path):
    """The whole thread: a list grows at 200 elements/s; walks every 0.5 s; the census file
    names it with its rate (within 20 %: the growing thread itself can lag on a busy machine)."""
    eng = Engine()
    ids = eng.scheduler.coordinator.single_type_managers[0].new_block_ids
    stop = threading.Event()

    class EngineCoreProc:
        def __init__(self, inner):
            self.scheduler = inner.scheduler

        def run_busy_loop(self):
            t0 = time.monotonic()
            while not stop.is_set():
                due = int(200 * (time.monotonic() - t0))
                ids.extend(range(due - len(ids)))
                time.sleep(0.002)

    th = threading.Thread(target=EngineCoreProc(eng).run_busy_loop, daemon=True)
    th.start()
    thread = cs.CensusThread(tmp_path, interval_s=5, start_delay_s=0, budget=0.5, env={})
    try:
        for _ in range(5):
            time.sleep(0.5)
            assert thread.walk_once() is not None
        data = thread.result()
        thread.write()
    finally:
        stop.set()
        th.join(2)
    top = data["growers"][0]
    assert top["owner"] == "EngineCoreProc.scheduler.coordinator.single_type_managers[0].new_block_ids"
    assert top["growth_per_h"] / 3600 == pytest.approx(200, rel=0.2)
    on_disk = json.loads((tmp_path / f"census-{thread.pid}.json").read_text())
    assert on_disk["growers"][0]["owner"] == top["owner"] and on_disk["walk"]["objects"] > 0


def test_requests_shorten_the_interval(tmp_path):
    req = tmp_path / "census-request.json"
    thread = cs.CensusThread(tmp_path, interval_s=600, fast_interval_s=60, env={})
    assert thread.current_interval(1000.0) == 600
    cs.write_request(req, 30, until=2000.0)
    assert thread.current_interval(1000.0) == 30 and thread.current_interval(2001.0) == 600
    req.write_text("garbage")
    assert thread.current_interval(1000.0) == 600
    cs.write_request(req, 0.1, until=2000.0)
    assert thread.current_interval(1000.0) == cs.MIN_INTERVAL_S
    assert cs.request_file(tmp_path, {"SLA_GUARD_CENSUS_REQUEST_FILE": "/x/y.json"}) == Path("/x/y.json")
    cs.write_request(req, 30, until=2000.0, pause=True)
    assert thread.current_interval(1000.0) == math.inf and thread.current_interval(2001.0) == 600


CENSUS_FILE = {"pid": 0, "ts": 1.0, "walk": {"busy_s": 0.02, "max_slice_s": 0.003, "objects": 1500},
               "explained_ratio": 0.8, "rss_bytes_per_h": 50 * 2**20,
               "growers": [{"owner": "EngineCoreProc.scheduler.x", "length": 5000, "growth_per_h": 72000.0,
                            "bytes_per_h": 40 * 2**20, "walks": 6},
                           {"owner": "EngineCoreProc.scheduler.y", "length": 100, "growth_per_h": 360.0,
                            "bytes_per_h": 2**20, "walks": 6}]}


def test_census_files_become_contract_metrics(tmp_path):
    snap = take_snapshot()
    write_snapshot(tmp_path, snap)
    (tmp_path / f"census-{snap.pid}.json").write_text(json.dumps({**CENSUS_FILE, "pid": snap.pid}))
    (tmp_path / "census-999999999.json").write_text("{}")  # no live snapshot: removed
    got = read_census(tmp_path, [snap.pid])
    assert list(got) == [snap.pid] and not (tmp_path / "census-999999999.json").exists()
    rows = {(m.name, labels[-1] if m.name.startswith("slaguard_census_container") else ""): v
            for m, labels, v in snapshot_rows([snap], "m", "decode", 1, got) if m.name.startswith("slaguard_census")}
    assert rows[(c.CENSUS_CONTAINER_GROWTH.name, "EngineCoreProc.scheduler.x")] == pytest.approx(20.0)
    assert rows[(c.CENSUS_CONTAINER_BYTES.name, "EngineCoreProc.scheduler.x")] == pytest.approx(40 * 2**20 / 3600)
    assert rows[(c.CENSUS_CONTAINER_LENGTH.name, "EngineCoreProc.scheduler.y")] == 100
    assert rows[(c.CENSUS_WALK_SECONDS.name, "")] == 0.02 and rows[(c.CENSUS_OBJECTS.name, "")] == 1500
    assert rows[(c.CENSUS_RSS_EXPLAINED.name, "")] == 0.8
    many = {**CENSUS_FILE, "growers": [{"owner": f"o{i}", "length": 1} for i in range(100)]}
    owners = {lab[-1] for m, lab, _ in census_rows(many, ("a",) * 5) if m is c.CENSUS_CONTAINER_LENGTH}
    assert len(owners) == 20  # cardinality bound, whatever the file says
    garbled = {"walk": "x", "growers": [{"owner": "a", "length": "many"}, "junk", {"owner": "b", "length": 3}]}
    assert [lab[-1] for m, lab, _ in census_rows(garbled, ("a",) * 5) if m is c.CENSUS_CONTAINER_LENGTH] == ["b"]



def test_failing_walks_are_counted_in_the_census_file_and_its_metric(tmp_path):
    """A walk that raised was caught and counted in ``CensusThread.errors``, but the count went
    nowhere and, no walk having completed, no census file was written: the exporter showed no
    census series at all, indistinguishable from a census not asked for. The file is written
    with ``errors`` after a failure and exported as ``slaguard_census_errors_total``."""

    class Failing(cs.CensusThread):
        def start_walk(self, full: bool, write: bool = True):
            raise RuntimeError("walk broke")  # as a bug in the walk would

    snap = take_snapshot()
    write_snapshot(tmp_path, snap)
    thread = Failing(tmp_path, interval_s=5, start_delay_s=0, env={}).start()
    path = tmp_path / f"census-{thread.pid}.json"
    try:
        for _ in range(600):  # until the thread has run once, however slow the machine
            if path.exists():
                break
            time.sleep(0.05)
    finally:
        thread.stop()
    data = json.loads(path.read_text())
    assert data["errors"] == thread.errors >= 1 and data["walks"] == 0 and data["walk"] is None
    rows = [(m, v) for m, _, v in snapshot_rows([snap], "m", "decode", 1, read_census(tmp_path, [snap.pid]))
            if m.name.startswith("slaguard_census")]
    assert rows == [(c.CENSUS_ERRORS, float(data["errors"]))]
    assert c.CENSUS_ERRORS.kind is c.Kind.COUNTER


def _store_with_census(now: float) -> SeriesStore:
    store = SeriesStore()
    labels = {"instance": "d0", "model": "m", "pool": "decode", "engine": "0", "role": "engine_core",
              "process": "EngineCore_DP0"}
    samples = []
    for g in CENSUS_FILE["growers"]:
        lab = {**labels, "owner": g["owner"]}
        samples += [(c.CENSUS_CONTAINER_BYTES.name, lab, g["bytes_per_h"] / 3600),
                    (c.CENSUS_CONTAINER_GROWTH.name, lab, g["growth_per_h"] / 3600),
                    (c.CENSUS_CONTAINER_LENGTH.name, lab, float(g["length"]))]
    store.ingest_samples(samples, now, group="d0")
    return store


def test_evaluator_attaches_the_census_to_the_open_leak_finding(tmp_path):
    now = 10_000.0
    book = FindingsBook()
    labels = {"model": "m", "pool": "decode", "instance": "d0", "process": "EngineCore_DP0", "engine": "0",
              "role": "engine_core"}
    book.raise_("leak", "leak/d0/m/decode/0/EngineCore_DP0", "warning", "grows", labels,
                {"slope_mib_per_h": 50.0, "slope_bytes_per_s": 50 * 2**20 / 3600}, now)
    req = tmp_path / "census-request.json"
    ev = CensusEvaluator(book, request_file=req, fast_interval_s=30)
    ev.evaluate(_store_with_census(now), now)
    (f,) = book.open_findings()
    assert f.details["slope_mib_per_h"] == 50.0  # the leak's own details are kept
    assert f.details["census_top_owner"] == "EngineCoreProc.scheduler.x"
    assert f.details["census_top_growth_per_h"] == pytest.approx(72000.0)
    assert f.details["census_top_mib_per_h"] == pytest.approx(40.0)
    assert f.details["census_explained_ratio"] == pytest.approx(41 / 50)
    assert f.details["census_unexplained_mib_per_h"] == pytest.approx(9.0)
    text = describe(f)
    assert "EngineCoreProc.scheduler.x" in text and "82% of the RSS slope" in text and "9.0 MiB/h unexplained" in text
    assert json.loads(req.read_text())["interval_s"] == 30  # the engines are asked for frequent walks
    assert cs.read_request(req, now) == 30


def test_attribute_without_a_slope_and_without_growers():
    assert attribute([], 1e9) == {}
    d = attribute(CENSUS_FILE["growers"], None)
    assert d["census_explained_ratio"] is None and d["census_top_owner"] == "EngineCoreProc.scheduler.x"
    s = census_summary(CENSUS_FILE, None)
    assert s["census_rss_slope_source"] == "census_file" and s["census_explained_ratio"] == pytest.approx(41 / 50)


def test_analyze_leak_with_a_census_file(tmp_path, capsys):
    t = np.arange(0, 12 * 3600, 60.0)
    rss = 6e9 + t * (48 * 2**20 / 3600) + np.random.default_rng(1).normal(0, 2e6, len(t))
    csv = tmp_path / "rss.csv"
    csv.write_text("timestamp,rss_bytes\n" + "\n".join(f"{a},{b}" for a, b in zip(t, rss, strict=True)))
    cf = tmp_path / "census.json"
    cf.write_text(json.dumps(CENSUS_FILE))
    from sla_guard import cli

    assert cli.main(["analyze", "leak", str(csv), "--census", str(cf)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["detected"] and out["census_top_owner"] == "EngineCoreProc.scheduler.x"
    assert out["census_rss_slope_source"] == "analysis"
    assert out["census_explained_ratio"] == pytest.approx(41 / out["slope_mib_per_h"], rel=1e-3)
    (tmp_path / "bad.json").write_text("[]")
    assert cli.main(["analyze", "leak", str(csv), "--census", str(tmp_path / "bad.json")]) == 2
    assert "not a census file" in capsys.readouterr().err
    assert analyze is not None


def test_gc_is_left_alone():
    frozen = gc.get_freeze_count()
    walk([("x", Engine())], more_roots=cs.module_roots)
    assert gc.get_freeze_count() == frozen and gc.isenabled()


def test_composition_runs_the_census_evaluator_after_the_leak_detector():
    from sla_guard.compose import compose
    from sla_guard.config import GuardConfig
    from sla_guard.ingest.source import StoreSource

    root = compose(GuardConfig(), source=StoreSource(SeriesStore()), slo=False, advisor=False)
    names = [e.name for e in root.guard.evaluators]
    assert "census" in names and names.index("leak") < names.index("census")
    root.guard.tick(10_000.0)
    assert root.guard.last_tick.errors == {}


def test_simulated_leak_names_its_container_and_the_guard_attaches_it():
    """The simulator's leak fault exports what the census would (a synthetic owner path), so the
    demo shows the whole story: RSS grows, the leak is found, the container is named."""
    from sla_guard.sim.deployment import Deployment
    from sla_guard.sim.faults import FaultSchedule, Leak
    from sla_guard.sim.harness import ClosedLoop, make_store
    from sla_guard.sim.profile import load_profile
    from sla_guard.sim.traces import BUNDLED_MOONCAKE, load_trace

    dep = Deployment(load_profile("default"), 1, 1,
                     faults=FaultSchedule([{"kind": "leak", "replica": "d0", "mib_per_hour": 288},
                                           {"kind": "leak", "replica": "p0", "mib_per_hour": 10, "owner": ""}]))
    dep.submit(load_trace(BUNDLED_MOONCAKE).scaled(duration_s=300))
    store = make_store(interval_s=15)
    ClosedLoop(dep, store=store, scrape_interval_s=15)
    dep.run_until(120)
    now = dep.epoch + 120
    got = store.instant(c.CENSUS_CONTAINER_BYTES.name, {}, now)
    assert [dict(k)["instance"] for k in got] == ["d0"]  # p0's leak is native: nothing to name
    labels = {"model": "glm-5.2", "pool": "decode", "instance": "d0", "process": "EngineCore_DP0", "engine": "d0",
              "role": "engine_core"}
    book = FindingsBook()
    book.raise_("leak", "leak/d0", "warning", "grows", labels,
                {"slope_mib_per_h": 288.0, "slope_bytes_per_s": 288 * 2**20 / 3600}, now)
    CensusEvaluator(book).evaluate(store, now)
    d = book.open_findings()[0].details
    assert d["census_top_owner"] == Leak("d0").owner
    assert d["census_explained_ratio"] == pytest.approx(1.0) and d["census_top_mib_per_h"] == pytest.approx(288.0)
