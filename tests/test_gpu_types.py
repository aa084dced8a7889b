"""Mixed GPU types: NVML names -> node types -> the optimizer's node view; jobs'
accepted types; per-type model; simulator placement by type; heterogeneity-aware
gavel, sia and rubick on hand-computed cases."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np
import pytest

from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.gputypes import gpu_type_of, node_gpu_type
from gearshift.bus_schema.messages import GpuReport, JobSpec, JobState, ModelSpec, NodeReport, Plan, SubmitReply
from gearshift.bus_schema.validate import SpecError, check_spec
from gearshift.policies.api import AllocationError, Decision, JobDecision, JobView, NodeState, Placement, placement_type
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import SimConfig, Simulator, simulate
from gearshift.sim.trace import ClusterSpec, NodeGroup, Trace, TraceJob, parse_cluster

GAIN = ModelSpec(name="gainer", params=100, layers=8, hidden=512, seq_len=128)
FLAT = ModelSpec(name="flat", params=100, layers=8, hidden=512, seq_len=128)


# ---------------------------------------------------------------- names and specs
@pytest.mark.parametrize("name,want", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("Tesla K80", "k80"), ("Tesla P100-PCIE-16GB", "p100"), ("Tesla T4", "t4"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "a100"), ("NVIDIA A10", ""), ("Fake GPU", ""),
])
def test_nvml_names_normalise_to_types(name, want):
    assert gpu_type_of(name) == want


def spec(**kw) -> JobSpec:
    base = dict(name="j", model=GAIN, global_batch=64, steps=10, gpus=4)
    return JobSpec(**{**base, **kw})


@pytest.mark.parametrize("types,field,words", [
    (("z100",), "gpu_types[0]", "unknown GPU type 'z100'"),
    (("a100", "v100", "a100"), "gpu_types[2]", "listed twice"),
])
def test_bad_accepted_types_name_the_field(types, field, words):
    with pytest.raises(SpecError) as e:
        check_spec(spec(gpu_types=types))
    assert e.value.field == field and words in e.value.message
    check_spec(spec(gpu_types=("a100", "v100")))  # fine
    check_spec(spec())  # absent: any type


async def test_admission_refuses_an_unknown_type_and_keeps_nothing(nc):
    from gearshift.bus.client import ServiceCallError, call
    from gearshift.services.admission import start_admission

    _, svc = await start_admission(nc)
    try:
        doc = {"name": "bad", "model": {"name": "m", "params": 100, "layers": 4, "hidden": 64, "seq_len": 128},
               "global_batch": 8, "steps": 10, "gpus": 1, "gpu_types": ["a100", "b200"]}
        with pytest.raises(ServiceCallError) as e:
            await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)
        assert "gpu_types[1]" in str(e.value) and "b200" in str(e.value)
        doc["gpu_types"] = ["A100"]  # not a type name at all: the decoder names the field
        with pytest.raises(ServiceCallError) as e:
            await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)
        assert "gpu_types" in str(e.value)
        kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
        assert [k for k in await _keys(kv) if not k.startswith("_")] == []
    finally:
        await svc.stop()


async def _keys(kv):
    try:
        return await kv.keys()
    except Exception:  # no keys at all
        return []


def test_cluster_strings():
    c = parse_cluster("a100:8x8,v100:4x4:32")
    assert c.label() == "a100:8x8,v100:4x4:32" and c.gpus == 80 and c.gpu_types == ("a100", "v100")
    nodes = c.node_list()
    assert nodes[0] == ("n000", "a100", 8, 96) and nodes[-1] == ("n011", "v100", 4, 32)
    assert parse_cluster("8x8") == ClusterSpec(8, 8, 96)
    for bad, words in (("a100:2x8,2x8", "needs its GPU type"), ("b200:2x8", "unknown GPU type"), ("8by8", "expected")):
        with pytest.raises(ValueError, match=words):
            parse_cluster(bad)


# ---------------------------------------------------------------- agents -> node view
async def test_fake_probe_type_reaches_the_optimizers_node_view(nc, nats_url, tmp_path):
    from gearshift.services.capacity import node_states
    from tests.test_agent import eventually, node_report

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gearshift.agent", "--server", nats_url, "--node", "v1", "--fake-gpus", "2",
        "--gpu-name", "Tesla V100-SXM2-32GB", "--heartbeat", "0.2", "--workdir", str(tmp_path / "v1"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        rep = await eventually(lambda: node_report(nc, "v1"), timeout=15)
        assert rep.gpu_type == "v100" and rep.gpus[0].name == "Tesla V100-SXM2-32GB"
        (state,) = node_states([rep], {})
        assert state.gpu_type == "v100" and state.gpus_total == 2
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.communicate(), 15)
    # an older agent's report (no gpu_type) is typed from its GPUs' names
    old = NodeReport(node="o", ts=0.0, cpus=4, gpus=[GpuReport(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB")])
    assert node_states([old], {})[0].gpu_type == "a100"


async def test_nvml_probe_names_give_the_node_type():
    from gearshift.agent.probe import NvmlProbe
    from tests.nvml_fake import FakeGpu, ScriptedNvml

    nv = ScriptedNvml([FakeGpu(uuid=f"GPU-{i}", name="NVIDIA A100-SXM4-80GB") for i in range(2)])
    probe = NvmlProbe(nvml=nv, sample_timeout=5.0)
    await probe.open()
    try:
        reps = await probe.sample()
    finally:
        await probe.close()
    assert node_gpu_type(reps) == "a100"


async def test_optimizer_places_a_job_only_on_a_type_it_accepts(nc):
    from gearshift.bus.client import call
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer
    from tests.test_optimizer import _state, wait_for

    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    names = {"a": "NVIDIA A100-SXM4-80GB", "v": "Tesla V100-SXM2-32GB"}
    _, svc = await start_admission(nc)
    opt = await Optimizer(nc, interval=0.2, lease_ttl=2, max_retries=1).open()
    stop = asyncio.Event()

    async def heartbeat():
        while not stop.is_set():
            for node, name in names.items():
                gpus = [GpuReport(index=g, uuid=f"GPU-{node}-{g}", name=name) for g in range(4)]
                await kv.put(node, codec.encode(NodeReport(node=node, ts=time.time(), gpus=gpus, cpus=32,
                                                           gpu_type=gpu_type_of(name))))
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(heartbeat()), asyncio.create_task(opt.run(stop))]
    try:
        ids = []
        for i, types in enumerate((["v100"], ["v100"])):
            doc = {"name": f"j{i}", "model": {"name": "m", "params": 100, "layers": 4, "hidden": 64, "seq_len": 128},
                   "global_batch": 8, "steps": 10, "gpus": 2, "gpu_types": types}
            ids.append((await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)).job_id)
        for jid in ids:  # both fit on the A100 node first in order, but accept only V100s
            rec = await wait_for(lambda: _state(nc, jid, JobState.SCHEDULED))
            assert [p.node for p in rec.placement] == ["v"]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await svc.stop()


# ---------------------------------------------------------------- the model per type
def test_perfmodel_types_change_speed_and_memory_feasibility():
    from gearshift import perfmodel
    from gearshift.policies.oracle import PerfModelOracle

    o = PerfModelOracle()
    gpt2 = JobView("g", JobSpec(name="g", model=ModelSpec(name="gpt2", params=1500, layers=48, hidden=1600,
                                                           seq_len=1024), global_batch=32, steps=10, gpus=8), 0.0)
    plan = Plan(dp=8, zero=1)

    def on(t, pl=plan, job=gpt2):
        return o.throughput(job, pl, tuple(Placement(f"x{i}", 8, 32, t) for i in range(1)))

    assert on("h100") > on("a100") >= on("") > on("v100") > 0
    assert on("k80") < on("v100")  # 12 GB: out of memory (0) or slower
    llama = JobView("l", JobSpec(name="l", model=ModelSpec(name="llama7", params=6738, layers=32, hidden=4096,
                                                            seq_len=2048), global_batch=64, steps=10, gpus=8), 0.0)
    shape, _ = o._model(llama.spec)
    plans = o.plans(llama, (Placement("x", 8, 32),))
    mem = perfmodel.memory_per_gpu_gb(shape, perfmodel.PlanArray.from_plans([perfmodel.as_plan(p, 64) for p in plans]))
    mid = [p for p, m in zip(plans, mem) if 36 < m < 70]
    assert mid, "a plan that needs more than a V100's 32 GB and less than an A100's 80 GB"
    assert on("a100", mid[0], llama) > 0 and on("v100", mid[0], llama) == 0


# ---------------------------------------------------------------- simulator
def tjob(jid, submit, gpus, steps, types=None, model=FLAT) -> TraceJob:
    s = JobSpec(name=jid, model=model, global_batch=8, steps=steps, gpus=gpus, plan=Plan(dp=gpus), step_time=1.0,
                gpu_types=types)
    return TraceJob(jid, submit, s)


@pytest.mark.parametrize("policy", ["fifo", "rubick", "sia", "gavel", "tiresias"])
def test_sim_places_jobs_only_on_types_they_accept(policy):
    # the V100-only jobs arrive first, when the A100 node (listed first) is free too
    jobs = [tjob("v1", 0, 4, 200, ("v100",)), tjob("v2", 0, 2, 100, ("v100",)), tjob("a1", 5, 4, 100, ("a100",)),
            tjob("any", 6, 2, 100)]
    t = Trace("mixed", jobs, parse_cluster("a100:1x4,v100:1x4"))
    res = simulate(t, make_policy(policy, restart_cost=10), config=SimConfig(restart_cost=10, noise=0))
    by = {r.job.job_id: r for r in res.records}
    assert all(r.finish is not None for r in res.records)
    for jid in ("v1", "v2"):  # every allocation of theirs was on V100s: the truth says so per allocation
        assert by[jid].truth_sources and all(src.endswith("@v100") for src in by[jid].truth_sources)
    assert not any("@" in src for src in by["a1"].truth_sources)  # A100 = the reference type: no tag


class Spanner:
    name = "spanner"

    def __init__(self, placement):
        self.placement = placement

    def schedule(self, now, nodes, jobs, perf):
        return Decision({jobs[0].job_id: JobDecision(self.placement, Plan(dp=sum(p.gpus for p in self.placement)))})


@pytest.mark.parametrize("placement,words", [
    ((Placement("n000", 2), Placement("n001", 2)), "spans GPU types"),
    ((Placement("n000", 4),), "accepts v100"),
])
def test_sim_refuses_a_job_across_types_or_on_a_type_it_refuses(placement, words):
    t = Trace("mixed", [tjob("x", 0, 4, 10, ("v100",))], parse_cluster("a100:1x4,v100:1x4"))
    with pytest.raises(AllocationError, match=words):
        Simulator(t, Spanner(placement), config=SimConfig(restart_cost=0)).run()


def test_sim_refuses_a_job_no_accepted_type_can_hold():
    t = Trace("mixed", [tjob("x", 0, 8, 10, ("v100",))], ClusterSpec.mixed([NodeGroup("a100", 2, 8, 96),
                                                                            NodeGroup("v100", 1, 4, 48)]))
    with pytest.raises(ValueError, match="the cluster has 4 of the types it accepts"):
        Simulator(t, make_policy("fifo"))


def test_truth_per_type_is_measured_not_the_belief():
    from gearshift.perfmodel.gputypes import compute_slowdown
    from gearshift.sim import gputruth

    v100, src = gputruth.speed_factor("v100", "gpt2")
    assert src == "measured-ratio" and 0.55 < v100 < 0.75  # ElasticFlow A100 vs Gavel V100, ResNet-50
    k80, _ = gputruth.speed_factor("k80", "gpt2")
    assert k80 < v100 * 0.5  # Gavel: K80 is 2-6x slower than V100 on the Transformer rows
    assert abs(1 / v100 - compute_slowdown("v100")) > 0.3  # not the belief's spec-based factor


# ---------------------------------------------------------------- heterogeneity-aware policies by hand
class SpeedOracle:
    """Hand-set samples/s per GPU for (model, type); linear in GPUs, any plan."""

    SPEED = {("gainer", "a100"): 3.0, ("gainer", "v100"): 1.0, ("flat", "a100"): 1.0, ("flat", "v100"): 1.0}

    def throughput(self, job, plan, placement):
        g = sum(p.gpus for p in placement)
        return self.SPEED[(job.spec.model.name, placement_type(placement))] * g if g == plan.gpus else 0.0


def two_types() -> list[NodeState]:
    return [NodeState("a", 4, 4, 32, 32, gpu_type="a100"), NodeState("v", 4, 4, 32, 32, gpu_type="v100")]


def views() -> list[JobView]:
    # the flat job came first: a type-blind first fit would give it the A100s
    return [JobView("flat", spec(name="flat", model=FLAT, plan=Plan(dp=4)), 0.0),
            JobView("gain", spec(name="gain", model=GAIN, plan=Plan(dp=4)), 1.0)]


def test_hetero_gavel_gives_the_fast_type_to_the_job_that_gains_most():
    # T = [[4, 4], [12, 4]] samples/s (flat, gainer x a100, v100); equal share: each job
    # half of each type, eq = [4, 8]. Max-min: flat is at 1 wherever it runs; the gainer
    # reaches 1 with >= half its time on A100s; spare capacity then maximises
    # 4(Xfa+Xfv)/4 + (12 Xga + 4 Xgv)/8 -> gainer all on A100, flat all on V100.
    pol = make_policy("gavel")
    perf = SpeedOracle()
    X = pol.hetero_shares(pol.throughput_matrix(views(), two_types(), perf, ["a100", "v100"]),
                          np.array([4.0, 4.0]), np.array([4.0, 4.0]))
    assert X == pytest.approx(np.array([[0.0, 1.0], [1.0, 0.0]]), abs=1e-6)
    d = pol.schedule(10.0, two_types(), views(), perf)
    assert [p.node for p in d.allocations["gain"].placement] == ["a"]
    assert [p.node for p in d.allocations["flat"].placement] == ["v"]


def test_hetero_sia_gives_the_fast_type_to_the_job_that_gains_most():
    # Utilities (goodput / the job's smallest goodput, 1 GPU on V100) ^ -0.5, minimised:
    # gainer on 4 A100s 12^-0.5 = 0.289, on 4 V100s 0.5; flat 4^-0.5 = 0.5 on either.
    # gainer->A100 + flat->V100 = 0.789 beats the swap (1.0) and any smaller split.
    d = make_policy("sia").schedule(10.0, two_types(), views(), SpeedOracle())
    assert [(p.node, p.gpus) for p in d.allocations["gain"].placement] == [("a", 4)]
    assert [(p.node, p.gpus) for p in d.allocations["flat"].placement] == [("v", 4)]


def test_rubick_chooses_the_type_with_its_model():
    # LP over (job, type), value = speed on the type / its best: gainer 1 on A100, 1/3 on
    # V100; flat 1 on either; 4 GPUs per type -> gainer A100, flat V100.
    pol = make_policy("rubick", min_run_time=0)
    d = pol.schedule(10.0, two_types(), views(), SpeedOracle())
    assert pol.last_types == {"gain": "a100", "flat": "v100"}
    assert {p.node for p in d.allocations["gain"].placement} == {"a"}
    assert {p.node for p in d.allocations["flat"].placement} == {"v"}
    assert all(p.gpu_type == "a100" for p in d.allocations["gain"].placement)


def test_type_blind_policies_still_respect_accepted_types_and_one_type_per_job():
    jobs = [JobView("v", spec(name="v", gpus=8, plan=Plan(dp=8), gpu_types=("v100",)), 0.0),
            JobView("x", spec(name="x", gpus=8, plan=Plan(dp=8)), 1.0)]
    for name in ("fifo", "las", "synergy", "antman"):
        d = make_policy(name).schedule(0.0, two_types(), jobs, None)
        assert not d.allocations and "v100" in d.waiting["v"]  # 8 V100s do not exist
        assert "x" in d.waiting  # 8 GPUs of one type do not exist either


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_rubick_budget_is_split_across_types_so_the_parts_add_up():
    # one instance per type, each told its part of a tenant's budget (the sharing part's
    # share): with 2 GPUs for tenant x, the two types together give x at most 2, not 2 each
    pol = make_policy("rubick", min_run_time=0)
    pol.budget = {"x": 2.0}
    jobs = [JobView(j.job_id, j.spec.__class__(**{**{f: getattr(j.spec, f) for f in j.spec.__struct_fields__},
                                                  "tenant": "x"}), j.submitted_at) for j in views()]
    d = pol.schedule(10.0, two_types(), jobs, SpeedOracle())
    assert sum(p.gpus for a in d.allocations.values() for p in a.placement) == 2
    assert len(d.allocations) == 2  # one GPU each: both still run
    unbudgeted = make_policy("rubick", min_run_time=0).schedule(10.0, two_types(), jobs, SpeedOracle())
    # unbudgeted they take more (their requests, 3, and, since issue 21's utility grows jobs
    # into idle GPUs, what else is free)
    assert sum(p.gpus for a in unbudgeted.allocations.values() for p in a.placement) >= 3
