"""The optimizer service runs the named policy from its configuration, with
the fitted performance model, and explains its decisions."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_optimizer import register_nodes, wait_for

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import ExplainReply, JobRecord, JobState, RoundReply
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer

GPT2 = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}


async def submit(nc, name, gpus, **extra):
    spec = {"name": name, "model": GPT2, "global_batch": 16, "steps": 1000, "gpus": gpus, **extra}
    from gearshift.bus_schema.messages import SubmitReply

    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


@pytest.mark.parametrize("policy", ["rubick", "tiresias", "sia"])
async def test_policy_from_configuration_schedules_and_explains(nc, policy):
    _, svc = await start_admission(nc)
    await register_nodes(nc, n=2, gpus=8, cpus=64)
    opt = await Optimizer(nc, policy=policy, interval=0.5, lease_ttl=2).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader), timeout=60)
        a = await submit(nc, "a", 4)
        b = await submit(nc, "b", 8)
        c = await submit(nc, "c", 16)  # cannot run beside the others at its request

        async def all_decided():
            reply = await call(nc, subj.OPTIMIZER_EXPLAIN, None, ExplainReply)
            return reply if {e.job_id for e in reply.jobs} >= {a, b, c} else None

        async def round_now():
            try:
                return await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply, timeout=60)
            except ServiceCallError:  # still warming up its kernels
                return None

        await wait_for(round_now, timeout=90, step=0.5)
        explain = await wait_for(all_decided, timeout=30)
        assert explain.policy == policy
        assert all(e.reason for e in explain.jobs)
        records = {j: await call(nc, subj.ADMISSION_GET, {"job_id": j}, JobRecord) for j in (a, b, c)}
        scheduled = [r for r in records.values() if r.state == JobState.SCHEDULED]
        assert scheduled, "nothing was scheduled"
        total = sum(len(p.gpus) for r in scheduled for p in r.placement)
        assert total <= 16
        for r in scheduled:
            assert r.plan is not None and r.plan.gpus == sum(len(p.gpus) for p in r.placement)
        # events carry the policy's reason (and rubick's predicted throughput)
        sub = await nc.jetstream().subscribe("gs.evt.job.*.scheduled", ordered_consumer=True)
        ev = codec.decode_event((await sub.next_msg(timeout=5)).data)
        await sub.unsubscribe()  # a consumer with messages left would hold up drain()
        assert ev.reason
        if policy == "rubick":
            assert ev.predicted_throughput and ev.predicted_throughput > 0
    finally:
        stop.set()
        await task
        await svc.stop()
