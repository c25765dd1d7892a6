"""Process sampler, run directory and snapshot collector on real local processes (no vLLM)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporters import contract as c
from exporters.process_collector import MultiprocessMirror, SnapshotCollector, read_snapshots, snapshot_rows
from exporters.process_sampler import (
    FreezeCount,
    ProcessSampler,
    classify_title,
    interval_from_env,
    parse_proc_status,
    take_snapshot,
    write_snapshot,
)


@pytest.mark.parametrize(("title", "expected"), [
    ("VLLM::EngineCore_DP1", ("engine_core", "EngineCore_DP1", 1)),
    ("VLLM::EngineCore", ("engine_core", "EngineCore", None)),
    ("VLLM::Worker_DP0_TP1", ("worker", "Worker_DP0_TP1", 0)),
    ("VLLM::APIServer_2", ("api_server", "APIServer_2", None)),
    ("VLLM::DPCoordinator", ("dp_coordinator", "DPCoordinator", None)),
    ("python -m vllm.entrypoints.openai.api_server", ("main", "main", None)),
    ("python -m vllm.entrypoints.openai.api_server --host ::", ("main", "main", None)),
    ("vllm serve tiny --host :: ", ("main", "main", None)),
])
def test_classify_title(title, expected):
    assert classify_title(title) == expected


def test_untitled_stat_logger_process_is_the_api_server():
    assert classify_title("python -m vllm.entrypoints.openai.api_server", api_server=True)[:2] == (
        "api_server", "APIServer")


def test_process_whose_command_line_ends_in_double_colon_is_sampled():
    """``vllm serve ... --host ::`` (IPv6 wildcard) leaves an untitled API server's title ending in "::":
    classify_title raised IndexError, so that process was never sampled, and the sidecar, sampling the
    whole tree in one go, lost every process's series (hook_errors{kind="process"} each scrape)."""
    from exporters.sidecar import SidecarCollector

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--port", "8000", "--host", "::"])
    try:
        deadline = time.monotonic() + 10  # under load /proc/<pid>/cmdline can read empty just after the exec
        while not psutil.Process(proc.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(proc.pid).cmdline()[-1] == "::"
        snap = take_snapshot(proc.pid, api_server=True)
        assert (snap.role, snap.process) == ("api_server", "APIServer")
        col = SidecarCollector("http://127.0.0.1:9/metrics", "m", "decode", proc.pid, timeout_s=0.5)
        rss = [s for f in col.collect() if f.name == c.PROCESS_RSS.name for s in f.samples]
        assert [s.labels["process"] for s in rss] == ["APIServer"] and "process" not in col.errors
    finally:
        proc.kill()
        proc.wait()


def test_parse_proc_status_of_this_process():
    parsed = parse_proc_status(Path("/proc/self/status").read_text())
    assert {"rss", "anon", "file", "shmem"} <= parsed.keys()
    assert parsed["rss"] == parsed["anon"] + parsed["file"] + parsed["shmem"]
    assert parse_proc_status("VmRSS:\tgarbage\nName: x") == {}


CHILD = r"""
import os, sys, time
from engine_hooks import process_plugin
process_plugin.register()
pid = os.fork()
if pid == 0:          # forked child: the at-fork hook must restart the sampler
    data = bytearray(64 * 2**20)  # grow RSS so the child differs from the parent
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
time.sleep(30)
"""


@pytest.fixture
def sampled_pair(tmp_path):
    env = {**os.environ, "SLA_GUARD_RUN_DIR": str(tmp_path), "SLA_GUARD_SAMPLE_INTERVAL_S": "0.2"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        yield tmp_path, proc.pid, child
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)


def _wait_snapshots(run_dir: Path, pids: set[int], timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = read_snapshots(run_dir, stale_after_s=30)
        if pids <= {s.pid for s in snaps}:
            return snaps
        time.sleep(0.1)
    raise AssertionError(f"no snapshots for {pids} in {list(run_dir.iterdir())}")


def test_sampler_survives_fork_and_collector_matches_psutil(sampled_pair):
    run_dir, parent, child = sampled_pair
    _wait_snapshots(run_dir, {parent, child})
    time.sleep(0.5)  # let the child's 64 MiB show up in a sample
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(run_dir, "m", "decode", 1, stale_after_s=30))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    info = {s.labels["process_pid"]: s.labels for s in families[c.PROCESS_INFO.name].samples}
    assert {str(parent), str(child)} <= info.keys()
    assert all(lab["model"] == "m" and lab["pool"] == "decode" for lab in info.values())
    rss = {s.labels["process"]: s.value for s in families[c.PROCESS_RSS.name].samples}
    for pid in (parent, child):
        now = psutil.Process(pid).memory_info().rss
        sampled = [s.value for s in families[c.PROCESS_RSS.name].samples
                   if s.labels["process"] == info[str(pid)]["process"]]
        assert sampled and abs(sampled[0] - now) / now < 0.10, (pid, sampled, now, rss)
    frozen = {s.value for s in families[c.PROCESS_GC_FROZEN.name].samples}
    assert frozen, "gc freeze count must be exported"
    assert families[c.PROCESS_GC_COLLECTIONS.name].type == "counter"


def test_forked_helper_does_not_rename_its_parents_series(sampled_pair):
    """A helper forked from EngineCore or a worker (vLLM's cuda_get_device_properties forks one, so does
    any fork pool) inherits its title and its sampler. Both processes got a PID suffix, so the parent's
    own series was renamed for as long as the helper lived (the leak detector read its series as gone
    and started a new one without history). The oldest keeps the name; the helper gets the suffix."""
    run_dir, parent, child = sampled_pair
    snaps = _wait_snapshots(run_dir, {parent, child})
    names = {labels[5]: labels[4] for m, labels, _ in snapshot_rows(snaps, "m", "decode", 1) if m is c.PROCESS_INFO}
    assert names == {str(parent): "main", str(child): f"main_pid{child}"}, names


ZOMBIE = r"""
import os, sys, time
pid = os.fork()
if pid == 0:  # exits when the test closes stdin; the parent never reaps it
    sys.stdin.buffer.read()
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_zombie_process_snapshot_is_dropped(tmp_path):
    """A process that exited but was not reaped yet (a worker the OOM killer ended, before its parent
    waits for it) still has its PID and start time: its last snapshot was exported as a live process
    until it went stale. A zombie is dead: its file is removed."""
    root = subprocess.Popen([sys.executable, "-c", ZOMBIE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(root.stdout.readline())
        write_snapshot(tmp_path, take_snapshot(child))
        assert [s.pid for s in read_snapshots(tmp_path, 30)] == [child]
        root.stdin.close()
        deadline = time.monotonic() + 10
        while psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert read_snapshots(tmp_path, 30) == []
        assert not list(tmp_path.glob("proc-*.json"))
    finally:
        root.kill()
        root.wait(10)


def test_dead_process_snapshots_are_dropped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_snapshot(tmp_path, take_snapshot(proc.pid))
        assert [s.pid for s in read_snapshots(tmp_path, 30)] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert read_snapshots(tmp_path, 30) == []
    assert not list(tmp_path.glob("proc-*.json"))
    (tmp_path / "proc-1.json").write_text("{not json")
    assert read_snapshots(tmp_path, 30) == []  # garbage is skipped, never raised


def test_stale_snapshot_is_skipped(tmp_path):
    snap = take_snapshot()
    snap.ts -= 3600
    write_snapshot(tmp_path, snap)
    assert read_snapshots(tmp_path, stale_after_s=60) == []


def test_multiprocess_mirror_leader_sets_contract_series(tmp_path):
    """One API server mirrors, the others wait; a new leader takes over the same files. Counters are
    the snapshots' totals: the old mirror added them as increments into its own per-PID file, so
    a new leader counted every process's GC collections again beside the old leader's."""
    from prometheus_client.multiprocess import MultiProcessCollector

    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    write_snapshot(tmp_path, take_snapshot())
    a = MultiprocessMirror(tmp_path, mp_dir, "m", "mixed", 1, 1.0, 30)
    b = MultiprocessMirror(tmp_path, mp_dir, "m", "mixed", 1, 1.0, 30)
    assert a.leader() and not b.leader()  # one API server mirrors, the others wait
    a.mirror_once()
    a.mirror_once()

    def served() -> tuple[str, float]:
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(mp_dir))
        text = generate_latest(reg).decode()
        gen0 = [s.value for f in text_string_to_metric_families(text) if f.name == c.PROCESS_GC_COLLECTIONS.name
                for s in f.samples if s.name.endswith("_total") and s.labels["generation"] == "0"]
        assert len(gen0) == 1, text
        return text, gen0[0]

    text, gen0 = served()
    assert c.PROCESS_RSS.name in text and f'process_pid="{os.getpid()}"' in text
    filed = json.loads((tmp_path / f"proc-{os.getpid()}.json").read_text())["gc_collections"][0]
    assert gen0 == filed
    os.close(a._lock_fd)  # the leader's API server dies: its flock goes with it
    assert b.leader()
    b.mirror_once()
    assert served()[1] == filed  # not twice


MIRROR_CHURN = r"""
import json, os, sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from engine_hooks import stat_logger
from exporters import contract as c
from exporters.process_sampler import take_snapshot, write_snapshot

run_dir = Path(os.environ["SLA_GUARD_RUN_DIR"])
stat_logger._export_process_samples("m", "decode", 1)  # what vLLM's API server does, several of them running
mirror = stat_logger._process_exporters["mirror"]
mirror.stop()
mirror._thread.join(10)  # its first round done; the rounds below are the test's
assert mirror.leader()
write_snapshot(run_dir, take_snapshot())

def served():
    reg = CollectorRegistry()
    MultiProcessCollector(reg)  # what /metrics serves with several API servers
    fams = {f.name: f for f in reg.collect()}
    return sorted({s.labels["process"] for s in fams[c.PROCESS_RSS.name].samples}), \
        sorted(s.labels["process_pid"] for s in fams[c.PROCESS_INFO.name].samples)

seen = []
for _ in range(int(sys.argv[1])):  # helpers forked, sampled, exited and reaped, one after another
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        write_snapshot(run_dir, take_snapshot())  # a forked helper inherits its parent's title
        os.write(w1, b"x")
        os.read(r2, 1)
        os._exit(0)
    os.read(r1, 1)
    mirror.mirror_once()
    seen.append(served())
    os.write(w2, b"x")
    os.waitpid(pid, 0)
    mirror.mirror_once()
print(json.dumps({"while_alive": seen, "after": served(), "me": os.getpid()}))
"""


def test_multiprocess_mirror_forgets_processes_that_exited(tmp_path):
    """Several API servers: the mirror wrote into prometheus_client's per-PID mmap files, which
    cannot forget a label set, so each forked helper that exited kept its ``main_pid<PID>`` RSS
    series and its process_info in /metrics until vLLM restarted (50 helpers, one at a time: 51
    RSS series for one live process; 500: 419, the files 1.5 MB and growing). Real forked
    helpers, the real MultiProcessCollector: only live processes are served."""
    mp_dir, run_dir = tmp_path / "mp", tmp_path / "run"
    mp_dir.mkdir()
    run_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir), "SLA_GUARD_RUN_DIR": str(run_dir),
           "SLA_GUARD_SAMPLE_INTERVAL_S": "3600"}
    out = subprocess.run([sys.executable, "-c", MIRROR_CHURN, "20"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    me = got["me"]
    for rss, info in got["while_alive"]:  # each helper served while it lived, beside its parent
        assert len(rss) == 2 and "main" in rss and len(info) == 2 and str(me) in info, (rss, info)
    assert len({tuple(rss) for rss, _ in got["while_alive"]}) == 20  # 20 distinct helpers
    assert got["after"] == [["main"], [str(me)]]


def test_freeze_count_is_read_every_sample_while_cheap_and_rarely_once_it_walks():
    """gc.get_freeze_count() walks the permanent generation under the GIL (~250 ms in a frozen
    vLLM process): once a read costs, reads back off (doubling, >= cost / budget, <= max gap).
    A read's cost is charged to a fake timer: a real sleep(0) took over the 1 ms "cheap" mark on
    a starved CI host and the first reads already backed off."""
    now, reads, cost, spent = [0.0], [], [0.0], [0.0]

    def read() -> int:
        spent[0] += cost[0]
        reads.append(now[0])
        return len(reads)

    fc = FreezeCount(5.0, budget=0.001, cheap_s=0.001, max_gap_s=3600.0, clock=lambda: now[0], read=read,
                     timer=lambda: spent[0])
    for t in range(0, 30, 5):  # nothing frozen yet: each sample reads
        now[0] = float(t)
        fc()
    assert reads == [0, 5, 10, 15, 20, 25]
    cost[0] = 0.02  # a frozen heap: 20 ms per walk -> gap >= 20 s, then doubling
    seen = []
    for t in range(30, 20000, 5):
        now[0] = float(t)
        seen.append(fc())
    gaps = np.diff([r for r in reads if r >= 30])
    assert gaps[0] >= 20 and all(b >= a for a, b in itertools.pairwise(gaps)), gaps
    assert max(gaps) <= 3600 + 5 and len(reads) <= 6 + 13, reads  # 30 s, then gaps 20, 40, ... 2560, 3600 x4
    assert seen[-1] == len(reads)  # the last value read is reported between reads


def test_freeze_count_reads_a_real_frozen_heap_rarely():
    """The real walk in a subprocess with ~2M frozen objects (as after vLLM's start-up
    gc.freeze()): over 60 simulated 5 s samples the value is right and, when the walk costs
    (>= 1 ms), it runs at most a handful of times instead of 60."""
    code = """
import gc, json
from exporters.process_sampler import FreezeCount
junk = [[i] for i in range(2_000_000)]
gc.freeze()
now, walks = [0.0], []
fc = FreezeCount(5.0, clock=lambda: now[0], read=lambda: walks.append(1) or gc.get_freeze_count())
values = []
for i in range(60):
    now[0] = 5.0 * i
    values.append(fc())
print(json.dumps({"values": sorted(set(values)), "truth": gc.get_freeze_count(), "cost": fc.last_cost_s,
                  "walks": len(walks)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    got = json.loads(out)
    assert got["values"] == [got["truth"]] and got["truth"] >= 2_000_000, got
    assert got["walks"] <= (5 if got["cost"] >= 0.001 else 60), got


@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_infinite_or_huge_sample_interval_keeps_the_sampler_alive_and_its_snapshot_ageing(tmp_path, value):
    """SLA_GUARD_SAMPLE_INTERVAL_S=inf (or 1e10): Event.wait() raised OverflowError after the first
    sample, the thread died, and the staleness limit (6 intervals) was infinite, so that one snapshot
    was exported as the process's current RSS for ever. Now bounded: the thread lives, the file ages."""
    interval = interval_from_env({"SLA_GUARD_SAMPLE_INTERVAL_S": value})
    assert 0 < interval <= 3600
    sampler = ProcessSampler(tmp_path, interval).start()
    try:
        deadline = time.monotonic() + 5
        while not (tmp_path / f"proc-{os.getpid()}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # past the first wait() call
        assert sampler.alive
        assert read_snapshots(tmp_path, max(30.0, 6 * interval), now=time.time() + 7 * 86400) == []
    finally:
        sampler.stop()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)")
def test_process_of_another_user_is_sampled_without_its_fd_count():
    """A sampler (the sidecar) running as another user than vLLM: /proc/<pid>/fd needs ptrace access,
    so psutil's num_fds() raised AccessDenied and the whole snapshot was dropped, RSS included (which
    is world-readable), with nothing counted. Reproduced with a process of uid 65534 sampled by root
    without capabilities; the fd count is now absent (unknown), the rest is there."""
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "30"])
    code = """
import json, sys
from exporters import contract as c
from exporters.process_collector import snapshot_rows
from exporters.process_sampler import take_snapshot
snap = take_snapshot(int(sys.argv[1]))
rows = {m.name for m, _, _ in snapshot_rows([snap], "m", "decode", 1)}
print(json.dumps({"rss": snap.rss, "fds": snap.fds, "rss_row": c.PROCESS_RSS.name in rows,
                  "fds_row": c.PROCESS_OPEN_FDS.name in rows}))
"""
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(other.pid).uids().real != 65534 and time.monotonic() < deadline:
            time.sleep(0.02)  # setpriv has not exec'd sleep as the other user yet
        out = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", code,
                              str(other.pid)], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parent.parent)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        assert got == {"rss": got["rss"], "fds": None, "rss_row": True, "fds_row": False} and got["rss"] > 0
    finally:
        other.kill()
        other.wait(10)


def _can_pick_pids() -> bool:
    """root with unshare(1) and a writable ns_last_pid in a new PID namespace (PID reuse on demand)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = "echo 100 > /proc/sys/kernel/ns_last_pid && sh -c 'echo $$'"
    try:
        out = subprocess.run(
            ["unshare", "-p", "-f", "--mount-proc", "sh", "-c", probe], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "101"


SIDECAR_PID_REUSE = """
import json, subprocess, sys, time
from pathlib import Path
from exporters import contract as c
from exporters.sidecar import SidecarCollector
import psutil
vllm = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); print(1, flush=True); "
                         "import time; time.sleep(60)"], stdout=subprocess.PIPE)
vllm.stdout.readline()  # its 64 MiB are resident
while time.time() - psutil.Process(vllm.pid).create_time() < 1.5:  # PIDs are told apart by start times 1 s apart
    time.sleep(0.05)
col = SidecarCollector("http://127.0.0.1:9/metrics", "m", "decode", vllm.pid, timeout_s=0.2)
def rss():
    return [s.value for f in col.collect() if f.name == c.PROCESS_RSS.name for s in f.samples]
before = rss()
vllm.kill()
vllm.wait()
Path("/proc/sys/kernel/ns_last_pid").write_text(str(vllm.pid - 1))
other = subprocess.Popen(["sleep", "30"])
after = rss()
other.kill()
print(json.dumps({"reused": other.pid == vllm.pid, "before": before, "after": after,
                  "process_errors": col.errors.get("process", 0)}))
"""


@pytest.mark.skipif(not _can_pick_pids(), reason="needs root, unshare(1) and a PID namespace")
def test_sidecar_does_not_follow_a_reused_pid():
    """vLLM exited and its PID went to an unrelated process (here made to happen at once in a private
    PID namespace): the sidecar sampled the stranger as vLLM's API server (a 64 MiB process read
    as 1 MiB: a fake restart, then someone else's memory followed). Now its series are absent and
    counted as kind="process"."""
    out = subprocess.run(
        ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", SIDECAR_PID_REUSE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["reused"] and len(got["before"]) == 1 and got["before"][0] > 64 * 2**20, got
    assert got["after"] == [] and got["process_errors"] >= 1, got
