"""Tenant queues through the real services (issue 13): the cluster config seeds
KV ``gs_queues``, admission's ``queues`` / ``setqueue`` endpoints read and change
them, admission refuses a job its tenant's quota can never hold, and the
optimizer's sharing policy picks a change up at its next round."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_optimizer import MODEL, register_nodes, wait_for

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobRecord, JobState, QueueList, RoundReply, SubmitReply
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer

SHARING = {"queues": {"a": {"quota": 4, "weight": 2, "cohort": "c"}, "b": {"quota": 4, "cohort": "c", "lend_limit": 0}},
           "min_run_time": 0}


async def submit(nc, name, gpus, tenant):
    spec = {"name": name, "model": MODEL, "global_batch": 8, "steps": 1000, "gpus": gpus, "tenant": tenant}
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def round_now(nc):
    try:
        return await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply, timeout=30)
    except ServiceCallError:  # leader still starting its endpoints
        return None


async def test_queues_from_config_then_changed_at_run_time(nc):
    _, svc = await start_admission(nc)
    await register_nodes(nc, n=2, gpus=4, cpus=32)
    opt = await Optimizer(nc, policy="fifo", interval=60, lease_ttl=2, policy_options={"sharing": SHARING}).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        got = await call(nc, subj.ADMISSION_QUEUES, None, QueueList)
        assert {(q.tenant, q.quota, q.weight, q.cohort) for q in got.queues} == {("a", 4, 2.0, "c"), ("b", 4, 1.0, "c")}
        # b lends nothing: a can never hold more than 4
        with pytest.raises(ServiceCallError) as err:
            await submit(nc, "too-big", 8, "a")
        assert err.value.field == "spec.gpus" and "can ever hold" in err.value.message
        # bad queue input names the field and changes nothing
        with pytest.raises(ServiceCallError) as err:
            await call(nc, subj.ADMISSION_SET_QUEUE, json.dumps({"tenant": "a", "quota": -2}).encode(), QueueList)
        assert err.value.field == "quota"
        assert {q.quota for q in (await call(nc, subj.ADMISSION_QUEUES, None, QueueList)).queues} == {4}
        # a job within quota runs; a second one waits on the quota
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader), timeout=30)
        a1 = await submit(nc, "a1", 4, "a")
        a2 = await submit(nc, "a2", 4, "a")
        await wait_for(lambda: round_now(nc), timeout=60, step=0.2)
        r1 = await call(nc, subj.ADMISSION_GET, {"job_id": a1}, JobRecord)
        r2 = await call(nc, subj.ADMISSION_GET, {"job_id": a2}, JobRecord)
        assert r1.state == JobState.SCHEDULED and r2.state == JobState.PENDING
        assert "quota 4" in r2.reason
        # raising a's quota at run time lets the optimizer start it at its next round
        new = await call(nc, subj.ADMISSION_SET_QUEUE,
                         json.dumps({"tenant": "a", "quota": 8, "weight": 2, "cohort": "c"}).encode(), QueueList)
        assert next(q for q in new.queues if q.tenant == "a").quota == 8
        await wait_for(lambda: round_now(nc), timeout=60, step=0.2)
        r2 = await call(nc, subj.ADMISSION_GET, {"job_id": a2}, JobRecord)
        assert r2.state == JobState.SCHEDULED
        assert opt.policy.cfg.queue("a").quota == 8
        # a restarted optimizer does not overwrite the changed queue with its config, and
        # goes on from the saved fair-share memory
        await wait_for(lambda: round_now(nc), timeout=60, step=0.2)
        opt2 = await Optimizer(nc, policy="fifo", interval=60, lease_ttl=2, policy_options={"sharing": SHARING}).open()
        assert (await opt2.queues.config(opt2.share_base)).queue("a").quota == 8
        assert opt2.policy.fair.usage.get("a", 0) > 0 and opt2.policy.fair.usage == opt.policy.fair.usage
    finally:
        stop.set()
        await task
        await svc.stop()


async def test_a_new_leader_goes_on_from_the_starvation_timer(nc):
    """The starvation timer lives with the fair-share memory in ``gs_queues``: a standby
    that opened before the job was submitted takes over with the first leader's timer."""
    _, svc = await start_admission(nc)
    await register_nodes(nc, n=2, gpus=4, cpus=32)
    sharing = dict(SHARING, starvation_wait=3600)
    opt = await Optimizer(nc, policy="fifo", interval=60, lease_ttl=2, policy_options={"sharing": sharing}).open()
    standby = await Optimizer(nc, policy="fifo", interval=60, lease_ttl=2, policy_options={"sharing": sharing}).open()
    stop, stop2 = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    task2 = None
    try:
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader), timeout=30)
        await submit(nc, "a1", 4, "a")
        a2 = await submit(nc, "a2", 4, "a")  # waits on a's quota of 4
        await wait_for(lambda: round_now(nc), timeout=60, step=0.2)
        since = opt.policy.wait_since[a2]
        assert a2 not in standby.policy.wait_since
        stop.set()
        await task
        task2 = asyncio.create_task(standby.run(stop2))
        await wait_for(lambda: asyncio.sleep(0, standby.is_leader), timeout=30)
        await wait_for(lambda: round_now(nc), timeout=60, step=0.2)
        assert standby.policy.wait_since[a2] == since
    finally:
        stop.set()
        stop2.set()
        await task
        if task2 is not None:
            await task2
        await svc.stop()


async def gearshift(url, *args):
    import os
    import sys

    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "gearshift.cli", *args,
                                             env={**os.environ, "GEARSHIFT_NATS_URL": url},
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode, out.decode(), err.decode()


async def test_cli_get_and_set_queue(nc, nats_url):
    _, svc = await start_admission(nc)
    try:
        rc, out, err = await gearshift(nats_url, "set", "queue", "vision", "--weight", "2")
        assert rc == 2 and "give --quota" in err
        rc, out, err = await gearshift(nats_url, "set", "queue", "vision", "--quota", "16", "--weight", "2",
                                       "--cohort", "all")
        assert rc == 0, err
        assert "vision" in out and "16" in out
        # a later change keeps the fields it does not give
        rc, out, err = await gearshift(nats_url, "set", "queue", "vision", "--quota", "24")
        assert rc == 0, err
        rc, out, err = await gearshift(nats_url, "get", "queues", "-o", "json")
        assert rc == 0, err
        assert json.loads(out) == [{"tenant": "vision", "quota": 24, "weight": 2.0, "cohort": "all",
                                    "borrow_limit": None, "lend_limit": None}]
        rc, out, err = await gearshift(nats_url, "set", "queue", "vision", "--weight", "-1")
        assert rc == 1 and "weight" in err and "Traceback" not in err
    finally:
        await svc.stop()
