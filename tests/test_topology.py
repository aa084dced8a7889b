"""Topology-aware gangs (issue 23 item 1): the core rules, the simulator's pricing,
the agent's path (flag and NVML fabric information), and a small live run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import JobSpec, ModelSpec, NodeReport, Plan, SubmitRequest, TopologyRequest
from gearshift.bus_schema.topology import (
    LinkFactors, TopologyError, format_path, parse_path, span_level, with_level, within,
)
from gearshift.policies.api import AllocationError, Decision, JobDecision, JobView, NodeState, Placement
from gearshift.policies.decision import check_decision
from gearshift.policies.topology import arrange

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelSpec(name="m", params=100, layers=12, hidden=768, seq_len=512)


def cluster(racks: int = 2, per_rack: int = 4, gpus: int = 8) -> list[NodeState]:
    """``racks`` x ``per_rack`` nodes, 2 NVLink domains per rack."""
    out = []
    for r in range(racks):
        for i in range(per_rack):
            path = parse_path(f"rack=r{r}/nvlink-domain=r{r}d{i // 2}")
            out.append(NodeState(f"r{r}n{i}", gpus, gpus, 64, 64, topology=path))
    return out


def spec(gpus: int, **topology) -> JobSpec:
    return JobSpec(name="j", model=MODEL, global_batch=960, steps=10, gpus=gpus,
                   topology=TopologyRequest(**topology) if topology else None)


def alloc(*parts: tuple[str, int]) -> JobDecision:
    return JobDecision(tuple(Placement(n, g, g) for n, g in parts), Plan(dp=sum(g for _, g in parts)))


def racks_of(d: JobDecision) -> set[str]:
    return {p.node[:2] for p in d.placement}


# ---------------------------------------------------------------- paths
def test_paths_parse_and_errors_name_the_field():
    p = parse_path("zone=z1/rack=r7/nvlink-domain=r7a")
    assert format_path(p) == "zone=z1/rack=r7/nvlink-domain=r7a"
    for bad, words in (("rack", "not LEVEL=VALUE"), ("rack=r1/rack=r2", "given twice"), ("Rack=r1", "lower-case"),
                       ("rack=r 1", "value"), ("node=n1", "reserved")):
        with pytest.raises(TopologyError) as e:
            parse_path(bad, "agent.topology")
        assert str(e.value).startswith("agent.topology: ") and words in str(e.value) and "\n" not in str(e.value)
    a, b = parse_path("rack=r1/nvlink-domain=a"), parse_path("rack=r1/nvlink-domain=b")
    assert span_level([a, b]) == "rack" and span_level([a]) == "node" and span_level([a, a]) == "nvlink-domain"
    assert span_level([a, parse_path("rack=r2/nvlink-domain=a")]) == "cluster"  # same value, another rack
    assert within([a, b], "rack") and not within([a, b], "nvlink-domain")
    assert with_level(parse_path("rack=r1"), "nvlink-domain", "x") == parse_path("rack=r1/nvlink-domain=x")
    assert with_level(a, "nvlink-domain", "x") == a  # configured wins
    assert LinkFactors({"cluster": 0.25}).factor("cluster") == 0.25 and LinkFactors({}).factor("rack") == 1.0


def test_bus_fields_are_checked_with_their_path():
    good = {"name": "j", "model": msgspec.to_builtins(MODEL), "global_batch": 8, "steps": 1, "gpus": 8,
            "topology": {"required": "rack", "preferred": "nvlink-domain"}}
    got = codec.decode(json.dumps({"spec": good}).encode(), SubmitRequest)
    assert got.spec.topology == TopologyRequest(required="rack", preferred="nvlink-domain")
    with pytest.raises(msgspec.ValidationError, match=r"spec\.topology\.required"):
        codec.decode(json.dumps({"spec": {**good, "topology": {"required": "Rack!"}}}).encode(), SubmitRequest)
    with pytest.raises(msgspec.ValidationError, match=r"spec\.topology"):
        codec.decode(json.dumps({"spec": {**good, "topology": {"requird": "rack"}}}).encode(), SubmitRequest)
    rep = NodeReport(node="n", ts=0.0, gpus=[], cpus=1, topology="rack=r1/nvlink-domain=a")
    assert codec.decode(codec.encode(rep), NodeReport).topology == "rack=r1/nvlink-domain=a"
    with pytest.raises(msgspec.ValidationError, match="topology"):
        codec.decode(codec.encode(rep).replace(b"rack=r1", b"rack r1"), NodeReport)


# ---------------------------------------------------------------- arrange + check
def test_required_gang_is_moved_into_one_rack_the_finest_level_first():
    nodes = cluster()
    jobs = {"a": JobView("a", spec(16, required="rack"), 0.0)}
    d = Decision({"a": alloc(("r0n0", 8), ("r1n0", 8))})
    with pytest.raises(AllocationError, match="spans more than one rack"):
        check_decision(d, nodes, jobs)
    assert arrange(d, nodes, jobs) == ["a"]
    got = d.allocations["a"]
    assert racks_of(got) == {"r0"} and span_level([nodes[0].topology, nodes[1].topology]) == "nvlink-domain"
    assert {p.node for p in got.placement} in ({"r0n0", "r0n1"}, {"r0n2", "r0n3"})  # one NVLink domain
    check_decision(d, nodes, jobs)


def test_resize_keeps_the_required_level_and_the_jobs_own_nodes():
    nodes = cluster()
    held = (Placement("r1n2", 8, 8), Placement("r1n3", 8, 8))
    jobs = {"a": JobView("a", spec(16, required="rack"), 0.0, placement=held, plan=Plan(dp=16)),
            "b": JobView("b", spec(8), 0.0)}
    # the policy resizes a to 24 GPUs across racks, and places b on r1n0
    d = Decision({"a": alloc(("r1n2", 8), ("r1n3", 8), ("r0n0", 8)), "b": alloc(("r1n0", 8))})
    arrange(d, nodes, jobs)
    got = d.allocations["a"]
    assert racks_of(got) == {"r1"} and {"r1n2", "r1n3"} <= {p.node for p in got.placement}
    assert d.allocations["b"].placement == (Placement("r1n0", 8, 8),)  # others are not moved
    check_decision(d, nodes, jobs)


def test_no_room_keeps_what_it_holds_else_waits_for_topology():
    nodes = cluster(per_rack=2)  # racks of 2 nodes, 16 GPUs
    held = (Placement("r0n0", 8, 8),)
    jobs = {"a": JobView("a", spec(8, required="rack"), 0.0, placement=held, plan=Plan(dp=8)),
            "o1": JobView("o1", spec(8), 0.0), "o2": JobView("o2", spec(8), 0.0)}
    # the policy grows a to 16 GPUs across racks; no rack has 16 free once o1 and o2 are placed
    d = Decision({"a": alloc(("r0n0", 8), ("r1n1", 8)), "o1": alloc(("r0n1", 8)), "o2": alloc(("r1n0", 8))})
    arrange(d, nodes, jobs)
    assert d.allocations["a"].placement == held and d.allocations["a"].plan == Plan(dp=8)
    assert "waits for topology" in d.allocations["a"].reason
    check_decision(d, nodes, jobs)
    big = {"x": JobView("x", spec(24, required="rack"), 0.0)}
    d2 = Decision({"x": alloc(("r0n0", 8), ("r0n1", 8), ("r1n0", 8))})
    arrange(d2, nodes, big)
    assert not d2.allocations and d2.waiting["x"] == "waits for topology: no rack has room for 24 GPUs as 8+8+8"


def test_preferred_domain_whenever_free_and_left_alone_otherwise():
    nodes = cluster()
    jobs = {"p": JobView("p", spec(16, preferred="nvlink-domain"), 0.0),
            "f": JobView("f", spec(4), 0.0)}
    d = Decision({"p": alloc(("r0n1", 8), ("r0n2", 8)), "f": alloc(("r0n0", 4))})
    arrange(d, nodes, jobs)
    got = d.allocations["p"].placement
    assert len({nodes[[n.name for n in nodes].index(p.node)].topology for p in got}) == 1  # one NVLink domain
    assert {p.node for p in got} == {"r0n2", "r0n3"}  # the domain holding one of its nodes
    # every domain has a node with 4 GPUs used: none has room; moved into one rack instead
    busy = {f"f{i}": JobView(f"f{i}", spec(4), 0.0) for i in range(4)}
    d = Decision({"p": alloc(("r0n1", 8), ("r1n1", 8)),
                  **{f"f{i}": alloc((n, 4)) for i, n in enumerate(("r0n0", "r0n2", "r1n0", "r1n2"))}})
    jobs = {"p": JobView("p", spec(16, preferred="nvlink-domain"), 0.0), **busy}
    arrange(d, nodes, jobs)
    assert len(racks_of(d.allocations["p"])) == 1  # the finest level with room
    # no rack has room either: the policy's placement stays (a preference only)
    d = Decision({"p": alloc(("r0n1", 8), ("r1n1", 8)),
                  **{f"f{i}": alloc((n, 4)) for i, n in enumerate(("r0n0", "r0n2", "r1n0", "r1n2", "r0n3", "r1n3"))}})
    jobs.update({f"f{i}": JobView(f"f{i}", spec(4), 0.0) for i in range(6)})
    before = d.allocations["p"]
    arrange(d, nodes, jobs)
    assert d.allocations["p"] is before
    check_decision(d, nodes, jobs)


def test_without_topology_decisions_are_untouched():
    flat = [NodeState(f"n{i}", 8, 8, 64, 64) for i in range(4)]
    jobs = {"a": JobView("a", spec(16), 0.0)}
    d = Decision({"a": alloc(("n0", 8), ("n3", 8))})
    before = d.allocations["a"]
    assert arrange(d, flat, jobs) == [] and d.allocations["a"] is before
    assert arrange(d, cluster(), jobs) == [] and d.allocations["a"] is before  # no job asks: nothing moves
    # a job that requires a level on a cluster without topology waits, in words
    jobs = {"a": JobView("a", spec(16, required="rack"), 0.0)}
    arrange(d, flat, jobs)
    assert d.waiting["a"] == "waits for topology: topology.required 'rack': no node reports a topology"


# ---------------------------------------------------------------- simulator
def test_sim_topology_prices_the_span_and_counts_it():
    from gearshift.sim.topology import SimTopology, TopologyStep, load_cluster_file, split_paths

    paths = split_paths(16, [("rack", 4), ("nvlink-domain", 2)])
    assert format_path(paths[0]) == "rack=r0/nvlink-domain=r0n0" and format_path(paths[15]) == "rack=r3/nvlink-domain=r3n1"
    inter = split_paths(16, [("rack", 4), ("nvlink-domain", 2)], interleaved=True)
    assert [p[0][1] for p in inter[:4]] == ["r0", "r1", "r2", "r3"] and sorted(inter) == sorted(paths)
    with pytest.raises(TopologyError, match="^topology: 15 nodes do not split evenly"):
        split_paths(15, [("rack", 4)])
    calls = []

    def predictor(spec, plan, per_node, nic_scale=1.0):
        calls.append(nic_scale)
        return 1.0 + (len(per_node) > 1) * 0.5 / nic_scale  # communication grows as bandwidth falls

    names = [f"n{i:03d}" for i in range(16)]
    step = TopologyStep(SimTopology.split(16, "rack=4,nvlink-domain=2", "cluster=0.25"), names, predictor)
    s = spec(16)
    in_rack = (Placement("n000", 8), Placement("n002", 8))
    across = (Placement("n000", 8), Placement("n004", 8))
    assert step.price(s, Plan(dp=16), in_rack, 3.0) == 3.0
    assert step.price(s, Plan(dp=16), across, 3.0) == pytest.approx(3.0 * 3.0 / 1.5)
    assert step.spans == {"rack": 1, "cluster": 1} and 0.25 in calls
    doc = {"cluster": "8x8", "topology": {"rack": 2}, "bandwidth": {"cluster": 0.5}}
    path = Path(sys.prefix).parent / ".pytest-topology-cluster.json"
    path.write_text(json.dumps(doc))
    try:
        text, topo = load_cluster_file(str(path))
        assert text == "8x8" and len(topo.paths) == 8 and topo.links.factor("cluster") == 0.5
    finally:
        path.unlink()


def test_sim_runs_with_a_topology_and_reports_spans():
    from gearshift.policies.registry import make_policy
    from gearshift.sim import load_named, simulate
    from gearshift.sim.engine import SimConfig
    from gearshift.sim.topology import SimTopology
    from gearshift.sim.trace import parse_cluster

    trace = load_named("rubick-base", seed=0).head(25)
    for aware in (True, False):
        topo = SimTopology.split(16, "rack=4,nvlink-domain=2", "cluster=0.25", aware=aware)
        res = simulate(trace, make_policy("fifo"), parse_cluster("16x8"), SimConfig(topology=topo, full_check=True))
        assert sum(res.topology_spans.values()) == sum(r.starts for r in res.records)
        assert all(r.finish is not None for r in res.records)


# ---------------------------------------------------------------- agent
def test_agent_topology_flag_and_nvml_fabric():
    from gearshift.agent.main import parse_args
    from gearshift.agent.probe import NvmlProbe
    from tests.nvml_fake import FakeGpu, ScriptedNvml

    assert parse_args(["--topology", "rack=r1", "--fake-gpus", "2"]).topology == "rack=r1"
    bad = subprocess.run([sys.executable, "-m", "gearshift.agent", "--topology", "rack=r1/rack=r2", "--fake-gpus", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode != 0 and "level 'rack' given twice" in bad.stderr and "Traceback" not in bad.stderr
    import asyncio

    nv = ScriptedNvml([FakeGpu("GPU-a", fabric=(b"\x12\x34" + b"\0" * 14, 7)), FakeGpu("GPU-b")])
    probe = NvmlProbe(nvml=nv, visible=None)
    asyncio.run(probe.open())
    try:
        assert probe.fabric == "1234000000000000.7"
        assert with_level(parse_path("rack=r1"), "nvlink-domain", probe.fabric) == \
            parse_path("rack=r1/nvlink-domain=1234000000000000.7")
    finally:
        asyncio.run(probe.close())
    plain = NvmlProbe(nvml=ScriptedNvml([FakeGpu("GPU-c")]), visible=None)
    asyncio.run(plain.open())
    try:
        assert plain.fabric is None  # no fabric: the path stays as configured
    finally:
        asyncio.run(plain.close())


# ---------------------------------------------------------------- live
def test_loadtest_topology_live():
    """The live part of ``python -m loadtest.topology`` (real nats-server, admission,
    optimizer, 16 agents with emulated ranks): rack-required gangs stay in a rack over
    6 resizes each, NVLink-preferring ones get a free domain, a gang no rack holds waits
    and explain says so."""
    got = subprocess.run([sys.executable, "-m", "loadtest.topology", "--skip-sim", "--json"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    out = json.loads(got.stdout)
    live = out["live"]
    assert got.returncode == 0 and out["ok"] and live["ok"], got.stdout[-2000:] + got.stderr[-2000:]
    for job in live["rack_jobs"].values():
        assert job["switches_and_resizes"] >= 5 and all(len(r) == 1 for r in job["racks"])
    assert "waits for topology" in live["wide"]["explain"]


def test_get_nodes_shows_the_path_only_when_reported():
    from gearshift import render

    plain = NodeReport(node="a", ts=0.0, gpus=[], cpus=1)
    placed = NodeReport(node="b", ts=0.0, gpus=[], cpus=1, topology="rack=r1/nvlink-domain=r1d0")
    assert render.node_headers([plain]) == render.NODE_HEADERS  # unchanged without topology
    assert render.node_headers([plain, placed])[-1] == "TOPOLOGY"
    rows = render.node_rows([plain, placed])
    assert rows[0][-1] == "-" and rows[1][-1] == "rack=r1/nvlink-domain=r1d0"
