"""Imports point one way, the way data flows (README): engine hooks -> exporters (the contract)
-> guard (ingest -> store -> evaluators -> outputs) -> generated alerts and dashboards.

Every ``.py`` under the five packages is parsed with ``ast``; every import counts: top-level,
inside functions (a late import is still a dependency, it only hides it) and under
``TYPE_CHECKING`` (a type named from an upper layer is knowledge of that layer, and becomes a
runtime import the day someone needs ``isinstance``), as does ``importlib.import_module`` /
``__import__`` with a literal name. (The guard keeps no plugin tables of module names: its
parts are wired statically in ``sla_guard.compose``.)

Rules:

1. ``ALLOWED``: what each package outside ``sla_guard`` may import (besides itself). Nothing
   imports ``engine_hooks`` (it is the vLLM plugin, a leaf).
2. ``RANK``: each part of ``sla_guard`` (a subpackage or top-level module) imports only parts of
   a strictly lower rank, so parts of one rank (the evaluators slo / detect / scale) are
   independent and no cycle between parts is possible. Every part may import ``exporters``;
   only ``sla_guard.commands`` may import ``alerts`` and ``dashboards`` (``generate``).
3. No import cycle between modules at all, counting that importing ``a.b.c`` runs
   ``a/__init__`` and ``a/b/__init__`` (so a package whose ``__init__`` imports the store cannot
   be imported by the store).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_hooks", "exporters", "pd_proxy", "sla_guard", "alerts", "dashboards")

# The guard's spec (config with its SLOs, and the burn-rate table derived from it): what the
# generated artifacts may read of sla_guard.
SPEC = frozenset({"sla_guard.config", "sla_guard.burn_windows"})
# Packages outside sla_guard: the parts each may import (itself always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "exporters": frozenset(),  # the metric contract and its exposition: the bottom
    "engine_hooks": frozenset({"exporters"}),
    "pd_proxy": frozenset({"exporters"}),  # the P/D proxy: a data source (the client scope), like the hooks
    "alerts": frozenset({"exporters"}) | SPEC,
    "dashboards": frozenset({"exporters", "alerts"}) | SPEC,
}

# Parts of sla_guard, lowest first; a part imports only parts of a lower rank.
RANK: dict[str, int] = {
    "sla_guard": 0,  # the package __init__ (runs before any submodule)
    "sla_guard.model": 0,
    "sla_guard.epoch": 0,  # the unit of numeric timestamps (trace files and recorded series)
    "sla_guard.promql": 0,
    "sla_guard.exposition": 0,  # text-exposition parser: below the store that stores what it parses
    "sla_guard.spec_base": 0,
    "sla_guard.outbound": 0,  # HTTP pushes within a total deadline (Alertmanager, the scaling webhook)
    "sla_guard.defaults": 0,  # shared default values (SLA thresholds from the contract, advisor, drift)
    "sla_guard.settings": 1,  # detectors' and advisor's settings models: below the config that types them
    "sla_guard.config": 2,
    "sla_guard.leader": 2,
    "sla_guard.burn_windows": 3,  # burn-rate table of the SLO spec
    "sla_guard.store": 3,
    "sla_guard.state": 3,
    "sla_guard.ingest": 4,  # writes into the store
    "sla_guard.slo": 5,  # evaluators read the store (through MetricsView)
    "sla_guard.detect": 5,
    "sla_guard.scale": 5,  # a library: knows nothing of the simulator
    "sla_guard.service": 6,  # the guard loop: ingest + evaluators
    "sla_guard.api": 7,
    "sla_guard.compose": 7,  # the composition root: config -> source, evaluators, routers, Guard
    "sla_guard.sim": 8,  # simulator and replay: drives the guard and the advisor offline
    "sla_guard.commands": 9,
    "sla_guard.cli": 10,
}
# Besides lower-ranked sla_guard parts and exporters.
SLA_GUARD_EXTRA: dict[str, frozenset[str]] = {"sla_guard.commands": frozenset({"alerts", "dashboards"})}


@dataclass(frozen=True, slots=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (the longest known module prefix of the name)
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.where}: {self.src} imports {self.dst}"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``pkg.mod.Class`` -> ``pkg.mod``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def _literal_import(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    f = node.func
    fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if fname not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports(root: Path) -> Iterator[Edge]:
    """Every import of one of our modules by one of our modules (see the module docstring)."""
    mods = module_names(root)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    frm = ".".join([*base, node.module] if node.module else base)
                else:
                    frm = node.module or ""
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                names = [f"{frm}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and (lit := _literal_import(node)):
                names = [lit]
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            for name in names:
                dst = _known(name, mods)
                if dst is not None and dst != mod:
                    yield Edge(mod, dst, where)


def part(mod: str) -> str:
    """The unit rules are written for: a top package, or a part of sla_guard."""
    bits = mod.split(".")
    return ".".join(bits[:2]) if bits[0] == "sla_guard" and len(bits) > 1 else bits[0]


def direction_violations(edges: list[Edge]) -> list[str]:
    """Edges against ``ALLOWED`` / ``RANK`` (an unknown sla_guard part is a violation too)."""
    bad = []
    for e in edges:
        src, dst = part(e.src), part(e.dst)
        if src == dst:
            continue
        if src in ALLOWED:
            ok = dst in ALLOWED[src]
        elif src in RANK:
            if dst in RANK:
                ok = RANK[dst] < RANK[src]
            else:
                ok = dst == "exporters" or dst in SLA_GUARD_EXTRA.get(src, frozenset())
        else:
            bad.append(f"{e}: {src} has no place in RANK/ALLOWED (add it where it belongs)")
            continue
        if dst not in ALLOWED and dst not in RANK:
            bad.append(f"{e}: {dst} has no place in RANK/ALLOWED (add it where it belongs)")
        elif not ok:
            bad.append(str(e))
    return sorted(set(bad))


def module_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected module sets of size > 1 (Tarjan), with package ``__init__`` edges."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        bits = e.dst.split(".")
        for i in range(1, len(bits) + 1):
            target = ".".join(bits[:i])
            if target != e.src and not e.src.startswith(target + "."):
                graph.setdefault(e.src, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return list(imports(ROOT))


def test_every_part_has_a_place(edges):
    parts = {part(m) for m in module_names(ROOT)}
    assert parts <= set(ALLOWED) | set(RANK), sorted(parts - set(ALLOWED) - set(RANK))


def test_imports_point_down(edges):
    assert direction_violations(edges) == []


def test_no_import_cycle(edges):
    assert module_cycles(edges) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").touch()


def test_checker_catches_upward_late_typing_and_dynamic_imports(tmp_path):
    """The rules can fail: each kind of import the docstring counts is caught."""
    _write(tmp_path, {
        "exporters/sidecar.py": "def f():\n    from engine_hooks.sampler import take\n",
        "engine_hooks/sampler.py": "take = 1\n",
        "sla_guard/scale/policies.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from sla_guard.sim.policy import Observation\n",
        "sla_guard/sim/policy.py": "import importlib\nimportlib.import_module('sla_guard.scale.policies')\n",
        "sla_guard/store.py": "from .ingest import parse\n",
        "sla_guard/ingest/parse.py": "",
        "alerts/rules.py": "from sla_guard import store\n",
    })
    bad = direction_violations(list(imports(tmp_path)))
    assert any("exporters.sidecar imports engine_hooks.sampler" in b for b in bad)
    assert any("sla_guard.scale.policies imports sla_guard.sim.policy" in b for b in bad)
    assert any("sla_guard.store imports sla_guard.ingest.parse" in b for b in bad)
    assert any("alerts.rules imports sla_guard.store" in b for b in bad)
    assert len(bad) == 4, bad  # and the downward dynamic import sim -> scale is fine


def test_checker_catches_cycles_through_package_init(tmp_path):
    _write(tmp_path, {
        "sla_guard/ingest/__init__.py": "def build():\n    from sla_guard.store import Store\n",
        "sla_guard/ingest/parse.py": "",
        "sla_guard/store.py": "from sla_guard.ingest.parse import x\nclass Store: ...\n",
    })
    assert module_cycles(list(imports(tmp_path))) == [["sla_guard.ingest", "sla_guard.store"]]
