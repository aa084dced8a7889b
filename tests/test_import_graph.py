"""The floors of the tree (issue 22), computed from the code: every import,
function-local ones included, resolved to the folder it reaches.

    gearshift (the command)  ->  services, agent  ->  bus  ->  bus_schema
                                 (peers over the bus)
    sim -> policies -> perfmodel -> bus_schema          (the pure core)

- nothing imports ``services/`` from outside it except entry points (the
  config checker's table of them) and the harness (tests, loadtest);
- no cycle between folders;
- ``perfmodel/``, ``policies/`` and ``sim/`` never import nats, the bus, a
  service or the agent; ``bus_schema/`` imports nothing else of ours.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("gearshift", "bus", "bus_schema", "services", "agent", "perfmodel", "policies", "sim")
HARNESS = ("tests", "loadtest")
#: files outside services/ that may import a service's code: entry-point tables
SERVICE_ENTRY_POINTS = {"gearshift/config_check.py"}
PURE = ("perfmodel", "policies", "sim")


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("nats", "nkeys"):
        return "nats"
    if parts[0] != "gearshift" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FOLDERS else "gearshift"


@functools.cache
def imports() -> dict[str, dict[str, set[str]]]:
    """folder -> folder it imports -> {"path:line", ...}"""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for folder in (*FOLDERS, *HARNESS):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.ImportFrom) and node.level:
                    assert False, f"{rel}:{node.lineno}: relative import; write it from gearshift.*"
                for mod in _targets(node):
                    tgt = _folder_of(mod)
                    if tgt is not None and tgt != folder:
                        graph[folder][tgt].add(f"{rel}:{node.lineno}")
                    top = mod.split(".")[0]
                    assert top not in FOLDERS[1:] or folder in HARNESS and top in HARNESS, \
                        f"{rel}:{node.lineno}: imports {mod!r}; the import root is gearshift.{mod}"
    return graph


def test_the_scan_sees_the_real_graph():
    g = imports()
    # a broken scan would pass every rule below: these edges exist
    assert g["services"]["bus"] and g["agent"]["bus"] and g["bus"]["bus_schema"] and g["sim"]["policies"]
    assert g["gearshift"]["bus"] and g["bus"]["nats"]


def test_nothing_outside_services_imports_it_but_entry_points_and_the_harness():
    g = imports()
    bad = sorted(w for folder, out in g.items() if folder not in HARNESS
                 for w in out.get("services", ()) if w.split(":")[0] not in SERVICE_ENTRY_POINTS)
    assert not bad, "imports of services/ from outside it:\n" + "\n".join(bad)


def test_no_cycle_between_folders():
    g = imports()
    edges = {f: {t for t in out if t in FOLDERS} for f, out in g.items() if f in FOLDERS}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(f: str) -> None:
        state[f] = 1
        path.append(f)
        for t in sorted(edges.get(f, ())):
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                raise AssertionError("folder cycle " + " -> ".join(cycle) + ": " +
                                     "; ".join(sorted(g[a][b])[0] for a, b in zip(cycle, cycle[1:])))
            if t not in state:
                visit(t)
        path.pop()
        state[f] = 2

    for f in FOLDERS:
        if f not in state:
            visit(f)


def test_the_core_never_reaches_the_bus():
    g = imports()
    for folder in PURE:
        for forbidden in ("nats", "bus", "services", "agent", "gearshift"):
            assert not g[folder].get(forbidden), (folder, forbidden, sorted(g[folder][forbidden]))
    assert set(g["bus_schema"]) <= set(), dict(g["bus_schema"])  # the messages import nothing else of ours
    assert set(g["bus"]) <= {"bus_schema", "nats"}, dict(g["bus"])
    assert "services" not in g["agent"], sorted(g["agent"]["services"])


def test_every_module_a_shipped_command_runs_is_importable():
    """Job commands in the shipped workloads and examples name modules under the
    import root (the demo's torch job named ``agent.reference.train`` after the move,
    and failed): every ``-m MODULE`` resolves from outside the checkout."""
    specs = [j["spec"] for j in yaml.safe_load((ROOT / "workloads" / "demo.yaml").read_text())["jobs"]]
    specs += [json.loads(p.read_text()) for p in (ROOT / "examples").glob("*.json")]
    modules = [cmd[cmd.index("-m") + 1] for s in specs if (cmd := s.get("command")) and "-m" in cmd]
    assert modules, "the demo has a real training job"
    for mod in modules:
        assert mod.split(".")[0] == "gearshift" and importlib.util.find_spec(mod) is not None, mod
