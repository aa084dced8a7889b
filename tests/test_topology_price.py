"""Topology in the performance policies are told (issue 23 item 1, parts 2-4): the
shared pricing (``policies.topology_price``) the simulator and the optimizer both
use, the live perfmodel's bandwidth scaling, an nvlink-domain as one NVLink island,
and the waiting reason of a job requiring a level no node has."""

from __future__ import annotations

import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan, TopologyRequest
from gearshift.bus_schema.topology import LinkFactors, TopologyError, islands, parse_factors, parse_path
from gearshift.bus_schema.validate import SpecError, check_spec
from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, Placement
from gearshift.policies.topology_price import TopologyPricedOracle, ratio_slowdown

# 32 heads: tensor parallelism up to 32 is a valid split of this model
WIDE = ModelSpec(name="m16", params=1300, layers=24, hidden=2048, seq_len=1024, heads=32)
PATHS = {f"r{r}n{i}": parse_path(f"rack=r{r}/nvlink-domain=r{r}d{i // 2}") for r in range(2) for i in range(4)}


def job(gpus: int = 16, **topology) -> JobView:
    spec = JobSpec(name="j", model=WIDE, global_batch=64, steps=10, gpus=gpus,
                   topology=TopologyRequest(**topology) if topology else None)
    return JobView("a", spec, 0.0)


def on(*parts: tuple[str, int]) -> tuple[Placement, ...]:
    return tuple(Placement(n, g, 4 * g) for n, g in parts)


class Flat:
    """A base oracle whose answer is the same anywhere: 100 samples/s."""

    calls: list = []

    def throughput(self, job, plan, placement):
        self.calls.append(placement)
        return 100.0


def slow(spec, plan, per_node, factor):  # communication: half the step at the fitted bandwidth
    return 0.5 + 0.5 / factor


def test_the_coarsest_spanned_level_prices_the_links():
    o = TopologyPricedOracle(Flat(), parse_factors("cluster=0.25,rack=0.5"), slow, PATHS)
    j, p = job(), Plan(dp=16)
    assert o.throughput(j, p, on(("r0n0", 16))) == 100.0  # one node: no inter-node links
    assert o.throughput(j, p, on(("r0n0", 8), ("r0n1", 8))) == 100.0  # one nvlink-domain: not named, 1.0
    assert o.throughput(j, p, on(("r0n0", 8), ("r0n2", 8))) == pytest.approx(100 / 1.5)  # a rack: 0.5
    assert o.throughput(j, p, on(("r0n0", 8), ("r1n0", 8))) == pytest.approx(100 / 2.5)  # across racks: 0.25
    # a hypothetical shape: the best level a gang of that many nodes has
    assert o.level_of(on(("_n0", 8), ("_n1", 8))) == "nvlink-domain"
    assert o.level_of(on(*((f"_n{i}", 4) for i in range(4)))) == "rack"
    assert o.level_of(on(*((f"_n{i}", 4) for i in range(5)))) == "cluster"


def test_a_shape_is_priced_by_the_room_the_round_has():
    o = TopologyPricedOracle(Flat(), parse_factors("cluster=0.25"), slow, PATHS)
    j, p, pair = job(), Plan(dp=16), on(("_n0", 8), ("_n1", 8))
    assert not hasattr(o, "spec_key")  # the base has none: none is made up
    assert o.throughput(j, p, pair) == 100.0
    # every rack has one node with 8 GPUs free: a 2x8 gang must cross racks
    free = {n: (8 if n in ("r0n0", "r1n0") else 2) for n in PATHS}
    o.set_free(free)
    assert o.level_of(pair) == "cluster" and o.throughput(j, p, pair) == pytest.approx(40.0)
    assert o.level_of(on(("_n0", 2), ("_n1", 2))) == "nvlink-domain"  # 2 GPUs fit next to each other
    v = o.version
    o.set_free(dict(free))
    assert o.version == v  # the same room: cached curves stay
    o.set_free({n: 8 for n in PATHS})
    assert o.version > v and o.level_of(pair) == "nvlink-domain"


def test_changed_paths_change_the_keys_policies_cache_by():
    class Keyed(Flat):
        def spec_key(self, spec):
            return ("k", spec.model.name)

        def answers_token(self):
            return 7

    o = TopologyPricedOracle(Keyed(), LinkFactors(), slow, PATHS)
    j = job()
    assert o.spec_key(j.spec) == ("k", "m16") and o.answers_token() == 7  # as the base's until a change
    o.set_paths({**PATHS, "r0n0": parse_path("rack=r9/nvlink-domain=r9d0")})
    assert o.spec_key(j.spec) != ("k", "m16") and o.answers_token() != 7


def test_the_live_perfmodel_scales_communication_by_the_span():
    """The optimizer's oracle (``LiveModels``): the fitted model, its inter-node
    bandwidth times the spanned level's factor (``perfmodel.catalog.with_nic_scale``,
    as the simulator's predictor)."""
    from gearshift.perfmodel.catalog import sim_predictor
    from gearshift.policies.oracle import PerfModelOracle
    from gearshift.services.policy_bridge import LiveModels

    models = LiveModels(None, parse_factors("cluster=0.25"))
    models.priced.set_paths(PATHS)
    j, p = job(), Plan(dp=16, micro_batch=4)
    in_rack = models.oracle.throughput(j, p, on(("r0n0", 8), ("r0n2", 8)))
    across = models.oracle.throughput(j, p, on(("r0n0", 8), ("r1n0", 8)))
    base = PerfModelOracle()
    assert in_rack == pytest.approx(base.throughput(j, p, on(("r0n0", 8), ("r0n2", 8))))
    r = base.slowdown(j.spec, p, (8, 8), 0.25)
    assert r > 1.05 and across == pytest.approx(in_rack / r)  # DP16's all-reduce over 1/4 of the bandwidth
    assert base.slowdown(j.spec, p, (16,), 0.25) == 1.0  # one node: no inter-node traffic
    # the simulator's predictor scales the same term by the same factor
    pred = sim_predictor(8)
    sim_r = ratio_slowdown(pred)(j.spec, p, (8, 8), 0.25)
    assert sim_r > 1.05 and sim_r == pytest.approx(r, rel=0.25)
    unpriced = LiveModels(None)  # no bandwidth configured: the fitted model's answer
    unpriced.priced.set_paths(PATHS)
    assert unpriced.oracle.throughput(j, p, on(("r0n0", 8), ("r1n0", 8))) == pytest.approx(
        base.throughput(j, p, on(("r0n0", 8), ("r1n0", 8))))


def test_optimizer_bandwidth_config_errors_name_the_field():
    from gearshift.services.optimizer import OptimizerConfig

    assert OptimizerConfig(bandwidth="cluster=0.25").bandwidth == "cluster=0.25"
    for bad, field in (("cluster=x", "bandwidth.cluster"), ("cluster", "bandwidth"), ("rack=0", "bandwidth.rack")):
        with pytest.raises(ValueError) as e:
            OptimizerConfig(bandwidth=bad)
        assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value)


# ---------------------------------------------------------------- NVLink islands
def test_an_nvlink_domain_is_one_island_for_tensor_parallelism():
    from gearshift.policies.oracle import PerfModelOracle

    base = PerfModelOracle()
    o = TopologyPricedOracle(base, parse_factors("cluster=0.25"), base.slowdown, PATHS, islands=True)
    j = job()
    same_domain = on(("r0n0", 8), ("r0n1", 8))
    two_domains = on(("r0n0", 8), ("r0n2", 8))
    one_node = on(("r0n0", 16))
    tp16 = next(p for p in base.plans(j, one_node) if p.tp == 16 and not p.grad_ckpt)
    assert base.throughput(j, tp16, two_domains) == 0.0  # TP across a NIC: not a plan
    assert o.throughput(j, tp16, two_domains) == 0.0
    got = o.throughput(j, tp16, same_domain)
    assert got > 0 and got == pytest.approx(base.throughput(j, tp16, one_node))  # as inside one node
    assert max(p.tp for p in o.plans(j, same_domain)) == 16
    assert max(p.tp for p in o.plans(j, two_domains)) == 8
    dp = Plan(dp=16, micro_batch=4)  # a DP all-reduce inside the island pays no NIC either
    assert o.throughput(j, dp, same_domain) > o.throughput(j, dp, two_domains)
    # hypothetical shapes are not merged: their nodes may land in any domain
    assert o.island_view(on(("_n0", 8), ("_n1", 8))) == on(("_n0", 8), ("_n1", 8))


def test_admission_allows_tp_up_to_the_largest_island():
    assert islands([(PATHS["r0n0"], 8), (PATHS["r0n1"], 8), (PATHS["r0n2"], 8), ((), 8)]) == [16, 8, 8]
    from gearshift.bus.views import _GpuCounts

    counts = _GpuCounts()
    counts._init_counts()
    counts._count("a", 8)
    counts._count("b", 8)
    assert counts.capacity() == (16, 8)
    counts._count("a", 8, "rack=r0/nvlink-domain=d0")
    counts._count("b", 8, "rack=r0/nvlink-domain=d0")
    assert counts.capacity() == (16, 16)
    spec = JobSpec(name="j", model=WIDE, global_batch=64, steps=10, gpus=16, plan=Plan(tp=16))
    check_spec(spec, max_gpus=16, max_gpus_per_node=16)
    with pytest.raises(SpecError) as e:
        check_spec(spec, max_gpus=16, max_gpus_per_node=8)
    assert e.value.field == "plan.tp" and "nvlink-domain" in str(e.value)


# ---------------------------------------------------------------- a level nobody has
def test_a_required_level_no_node_reports_waits_naming_the_field():
    from gearshift.policies.topology import arrange

    nodes = [NodeState(n, 8, 8, 64, 64, topology=p) for n, p in PATHS.items()]
    jobs = {"a": job(16, required="spine")}
    d = Decision({"a": JobDecision(on(("r0n0", 8), ("r0n1", 8)), Plan(dp=16))})
    assert arrange(d, nodes, jobs) == ["a"] and "a" not in d.allocations
    assert d.waiting["a"] == ("waits for topology: topology.required 'spine' is a level no node reports "
                              "(they report: rack, nvlink-domain)")


def test_bad_factors_are_one_line():
    with pytest.raises(TopologyError, match=r"^bandwidth: 'cluster' is not LEVEL=FACTOR"):
        parse_factors("cluster")


def test_sim_counts_gpu_time_lost_to_slow_links():
    from gearshift.sim.topology import SimTopology, TopologyStep

    def predictor(spec, plan, per_node, nic_scale=1.0):
        return 1.0 + (len(per_node) > 1) * 0.5 / nic_scale

    names = [f"n{i:03d}" for i in range(16)]
    step = TopologyStep(SimTopology.split(16, "rack=4,nvlink-domain=2", "cluster=0.25"), names, predictor)
    s, p = job().spec, Plan(dp=16)
    assert step.price(s, p, on(("n000", 8), ("n002", 8)), 3.0, ("in", 10.0)) == 3.0
    assert step.price(s, p, on(("n000", 8), ("n004", 8)), 3.0, ("x", 10.0)) == pytest.approx(6.0)
    step.released("in", 110.0)
    step.released("x", 110.0)
    step.released("never-granted", 110.0)
    assert step.slow_gpu_s == pytest.approx(100 * 16 * (1 - 1 / 2.0))  # half its GPU time lost
