"""The contract a real training script meets (issue 20 item 8): the plans a job
declares it supports (``JobSpec.plan_support``), honoured by admission, the
policies' plan space, the profiler and ``reconfigure``; and the "plan refused"
exit code (78), which sends a job back to its last good plan and remembers the
refused one. End to end with the real optimizer, a real agent and a real script
that refuses TP=2."""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import pytest

from gearshift.agent import worker
from gearshift.bus.client import call
from gearshift.bus.client import ServiceCallError
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobPlanRefused,
    JobRecord,
    JobSpec,
    JobState,
    NodePlacement,
    PinnedPlan,
    Plan,
    PlanSupport,
    RunReport,
    RunReportKind,
    SubmitReply,
)
from gearshift.bus_schema.plan_support import EXIT_PLAN_REFUSED, model_refusal, plan_refusal, supported, with_refused
from gearshift.bus_schema.validate import SpecError, check_spec
from gearshift.policies.api import Decision, JobDecision, JobView, Placement
from gearshift.policies.candidates import CandidateSpace, _plans_for
from gearshift.policies.decision import refuse_unsupported
from gearshift.services import lifecycle
from gearshift.services.profiler import profiling_plans
from tests.test_switch import eventually, get, pin, stack, state  # noqa: F401 (fixture)

MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024, "heads": 16}


def spec(**over) -> JobSpec:
    doc = {"name": "j", "model": MODEL, "global_batch": 16, "steps": 100, "gpus": 2, **over}
    return codec.decode(json.dumps(doc).encode(), JobSpec)


def test_exit_code_is_the_same_on_both_sides_of_the_bus():
    assert worker.EXIT_PLAN_REFUSED == EXIT_PLAN_REFUSED == 78


def test_a_refusal_names_the_field_of_the_declaration():
    s = PlanSupport(tp=(1,), zero=(0, 1), offload=False, ga_max=4, dp_max=4, grad_ckpt=False)
    assert plan_refusal(s, Plan(dp=2)) is None
    assert plan_refusal(None, Plan(tp=8)) is None  # no declaration: every plan
    cases = {Plan(tp=2): "plan_support.tp", Plan(dp=8): "plan_support.dp_max", Plan(dp=2, zero=3): "plan_support.zero",
             Plan(dp=2, zero=1, offload=True): "plan_support.offload", Plan(dp=1, ga=8): "plan_support.ga_max",
             Plan(dp=1, grad_ckpt=True): "plan_support.grad_ckpt"}
    for plan, field in cases.items():
        got = plan_refusal(s, plan)
        assert got is not None and got[0] == field, (plan, got)
    refused = with_refused(spec(), [Plan(dp=1, tp=2, micro_batch=16)])
    assert refused.plan_support.exclude and not supported(refused, Plan(tp=2))  # micro-batch does not matter
    assert with_refused(refused, [Plan(tp=2)]) is refused  # already excluded: the same spec


def test_submit_refuses_a_plan_the_script_cannot_run_with_the_field_named():
    with pytest.raises(SpecError) as e:
        check_spec(spec(plan={"tp": 2}, plan_support={"tp": [1]}))
    assert e.value.field == "plan_support.tp"
    with pytest.raises(SpecError) as e:  # no plan: the default DP over its GPUs must be one
        check_spec(spec(plan_support={"dp_max": 1}))
    assert e.value.field == "plan" and "dp_max" in e.value.message
    check_spec(spec(plan={"dp": 2}, plan_support={"tp": [1]}))
    with pytest.raises(msgspec.ValidationError, match=r"plan_support.tp"):  # bounds by type
        spec(plan_support={"tp": [0]})


def test_a_plan_the_model_cannot_run_is_refused_from_its_shape_naming_the_field():
    m = spec(model={**MODEL, "heads": 12, "kv_heads": 4, "layers": 3, "hidden": 96})
    assert model_refusal(m, Plan(tp=8, pp=3)) == ("plan.tp", "tp 8 does not divide the 12 attention heads of model gpt2")
    assert model_refusal(m, Plan(tp=3))[0] == "plan.tp" and "4 key/value heads" in model_refusal(m, Plan(tp=3))[1]
    assert model_refusal(m, Plan(pp=4)) == ("plan.pp", "pp 4 is more stages than the 3 layers of model gpt2")
    assert model_refusal(m, Plan(tp=2, pp=3)) is None and model_refusal(m.model, Plan(tp=8)) is not None
    no_heads = spec(model={**MODEL, "heads": None, "hidden": 8})  # heads unknown: only the hidden size bounds tp
    assert model_refusal(no_heads, Plan(tp=3)) is None and model_refusal(no_heads, Plan(tp=16))[0] == "plan.tp"
    # the plan library's worker says the same words (agent.torchplan.space)
    from gearshift.agent.torchplan.space import ModelShape, PlanRefused, check_plan

    with pytest.raises(PlanRefused) as e:
        check_plan({"tp": 3}, ModelShape(family="x", layers=3, heads=12, kv_heads=4))
    assert e.value.field == "tp" and "tp 3 does not divide the 4 key/value heads of x" in str(e.value)


async def test_reconfigure_refuses_a_plan_the_model_cannot_run_and_changes_nothing(nc, stack):
    doc = {"name": "shaped", "model": {**MODEL, "heads": 16, "kv_heads": 4, "layers": 2}, "global_batch": 16,
           "steps": 100, "gpus": 2, "plan": {"dp": 2}}
    job = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)).job_id
    before = await get(nc, job)
    for plan, field, words in (({"tp": 8}, "plan.tp", "4 key/value heads"), ({"pp": 4}, "plan.pp", "2 layers"),
                               ({"tp": 3}, "plan.tp", "16 attention heads")):
        with pytest.raises(ServiceCallError) as e:
            await pin(nc, job, plan)
        assert e.value.code == "400" and e.value.field == field and words in e.value.message, e.value
        assert "\n" not in e.value.message
    after = await get(nc, job)
    assert after.pinned is None and after.generation == before.generation
    assert (await pin(nc, job, {"tp": 2, "dp": 1})).pinned  # one it can run is pinned


def test_the_plan_space_a_policy_searches_leaves_out_unsupported_plans():
    from gearshift.policies.oracle import PerfModelOracle

    perf = PerfModelOracle()
    shape = (Placement("a", 4, 4),)
    free = JobView(job_id="j", spec=spec(gpus=4), submitted_at=0.0)
    narrow = JobView(job_id="j", spec=spec(gpus=4, plan_support={"tp": [1], "pp": [1], "zero": [0]}), submitted_at=0.0)
    all_plans = _plans_for(free, perf, CandidateSpace(), shape)
    some = _plans_for(narrow, perf, CandidateSpace(), shape)
    assert any(p.tp > 1 or p.pp > 1 or p.zero for p in all_plans)
    assert some and all(p.tp == 1 and p.pp == 1 and p.zero == 0 for p in some)
    assert set(some) < set(all_plans)


def test_a_decision_with_an_unsupported_plan_waits_with_the_field_named():
    job = JobView(job_id="j", spec=spec(gpus=4, plan_support={"dp_max": 2}), submitted_at=0.0)
    d = Decision(allocations={"j": JobDecision((Placement("a", 4, 0),), Plan(dp=4))})
    assert refuse_unsupported(d, {"j": job}) == ["j"]
    assert not d.allocations and "plan_support.dp_max" in d.waiting["j"]


def test_the_profiler_profiles_only_supported_plans():
    full = profiling_plans(16, 2, heads=16, layers=24)
    assert any(p.tp > 1 for p in full) and any(p.pp > 1 for p in full)
    dp_only = profiling_plans(16, 2, heads=16, layers=24, support=PlanSupport(tp=(1,), pp=(1,)))
    assert dp_only and all(p.tp == 1 and p.pp == 1 for p in dp_only)
    no_gc = profiling_plans(16, 4, support=PlanSupport(grad_ckpt=False, zero=(0,)))
    assert no_gc and not any(p.grad_ckpt or p.zero for p in no_gc)


def _record(**over) -> JobRecord:
    base = dict(job_id="j", spec=spec(), state=JobState.RUNNING, generation=3, plan=Plan(tp=2),
                placement=[NodePlacement(node="a", gpus=[0, 1])], last_good_plan=Plan(dp=2))
    return JobRecord(**{**base, **over})


def _exit(code: int, gen: int = 3) -> RunReport:
    return RunReport(job_id="j", generation=gen, node="a", kind=RunReportKind.EXITED, ts=10.0, exit_code=code)


def test_exit_78_goes_back_to_the_last_good_plan_and_remembers_the_refused_one():
    op = PinnedPlan(plan=Plan(tp=2), reason="operator")
    out = lifecycle.apply_report(_record(pinned=op), _exit(78), max_retries=0, now=10.0)
    new = out.new
    assert out.ended and new.state == JobState.PENDING and new.failures == 0  # not a crash, even with 0 retries
    assert new.refused_plans == [Plan(tp=2)] and new.pinned.plan == Plan(dp=2) and not new.pinned.until_stepped
    ev = new.outbox[-1]
    assert isinstance(ev, JobPlanRefused) and ev.plan == Plan(tp=2) and ev.back_to == Plan(dp=2)
    # the policy's own choice refused: pinned back only until it ran steps there
    out = lifecycle.apply_report(_record(), _exit(78), max_retries=0, now=10.0)
    assert out.new.pinned.until_stepped
    back = msgspec.structs.replace(out.new, state=JobState.RUNNING, generation=4, plan=Plan(dp=2, micro_batch=8))
    stepped = RunReport(job_id="j", generation=4, node="a", kind=RunReportKind.STEPPED, ts=11.0)
    after = lifecycle.apply_report(back, stepped, max_retries=0, now=11.0).new
    assert after.pinned is None and after.last_good_plan == back.plan
    # any other exit code is still a crash
    crash = lifecycle.apply_report(_record(), _exit(3), max_retries=0, now=10.0).new
    assert crash.state == JobState.FAILED and not crash.refused_plans


def test_a_job_whose_script_refuses_its_only_plan_fails_with_the_reason():
    rec = _record(spec=spec(plan={"tp": 2, "dp": 1}, reconfigurable=False), last_good_plan=None, generation=1)
    out = lifecycle.apply_report(rec, _exit(78, 1), max_retries=3, now=10.0)
    assert out.new.state == JobState.FAILED and "refused" in out.new.reason and "no other plan" in out.new.reason


REFUSE_TP2 = ("import json, os, runpy, sys\n"
              "plan = json.loads(os.environ['GEARSHIFT_PLAN'])\n"
              "if plan.get('tp', 1) == 2:\n"
              "    print('this script has no tensor parallelism', file=sys.stderr)\n"
              "    sys.exit(78)\n"
              "runpy.run_module('gearshift.agent.emulated_worker', run_name='__main__')\n")


@pytest.mark.timeout(120)
async def test_a_script_that_refuses_tp2_goes_back_to_its_last_good_plan(nc, stack, tmp_path):
    opt, agent, rec = stack
    await agent("a", gpus=2)
    doc = {"name": "refuses-tp", "model": MODEL, "global_batch": 16, "steps": 100000, "gpus": 2,
           "plan": {"dp": 2}, "command": [sys.executable, "-c", REFUSE_TP2]}
    job = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)).job_id
    await eventually(lambda: _has_good(nc, job), timeout=30)
    before = await get(nc, job)
    assert (await pin(nc, job, {"tp": 2})).pinned
    ev = (await eventually(lambda: asyncio.sleep(0, [e for e in rec.of(JobPlanRefused) if e.job_id == job]),
                           timeout=30))[0]
    assert ev.plan.tp == 2 and ev.back_to == before.last_good_plan and ev.back_to.dp == 2
    back = await eventually(lambda: _running_under(nc, job, before.last_good_plan), timeout=30)
    assert back.failures == 0 and [p.tp for p in back.refused_plans] == [2]
    assert back.generation >= before.generation + 2  # the refused generation ran, then the last good one
    # asked again, the refused plan is refused at once, the field named, nothing changed
    with pytest.raises(ServiceCallError) as e:
        await pin(nc, job, {"tp": 2})
    assert e.value.field == "plan_support.exclude"
    assert (await get(nc, job)).generation == back.generation


REFUSE_TP2_RECORDED = ("import json, os, runpy, sys\n"
                       "from gearshift.agent import worker\n"
                       "env = worker.WorkerEnv.from_env()\n"
                       "if env.plan.get('tp', 1) == 2:\n"
                       "    print('this script has no tensor parallelism', file=sys.stderr)\n"
                       "    sys.exit(worker.refuse_plan(env, 'tp', 'this script has no tensor parallelism'))\n"
                       "runpy.run_module('gearshift.agent.emulated_worker', run_name='__main__')\n")


@pytest.mark.timeout(180)
async def test_under_torchrun_a_refused_plan_is_still_a_refusal_not_a_crash(nc, stack, tmp_path):
    """torchrun turns a rank's exit 78 into its own exit 1; the refusal the rank
    recorded (``worker.refuse_plan``) makes the agent report 78 again."""
    opt, agent, rec = stack
    await agent("a", gpus=2)
    script = tmp_path / "refuse_tp2.py"
    script.write_text(REFUSE_TP2_RECORDED)
    doc = {"name": "refuses-tp-torchrun", "model": MODEL, "global_batch": 16, "steps": 100000, "gpus": 2,
           "plan": {"dp": 2}, "command": [sys.executable, "-m", "torch.distributed.run", str(script)]}
    job = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": doc}).encode(), SubmitReply)).job_id
    await eventually(lambda: _has_good(nc, job), timeout=90)
    before = await get(nc, job)
    assert (await pin(nc, job, {"tp": 2})).pinned
    ev = (await eventually(lambda: asyncio.sleep(0, [e for e in rec.of(JobPlanRefused) if e.job_id == job]),
                           timeout=90))[0]
    assert ev.plan.tp == 2 and ev.back_to == before.last_good_plan
    back = await eventually(lambda: _running_under(nc, job, before.last_good_plan), timeout=90)
    assert back.failures == 0 and [p.tp for p in back.refused_plans] == [2]


async def _has_good(nc, job):
    r = await get(nc, job)
    return r if r.state == JobState.RUNNING and r.last_good_plan is not None else None


async def _running_under(nc, job, plan):
    r = await get(nc, job)
    return r if r.state == JobState.RUNNING and r.plan.tp == plan.tp and r.plan.dp == plan.dp else None
