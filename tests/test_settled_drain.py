"""A drain no report can end: an allocation written and withdrawn while its
node's agent was down. The agent never launched it, so its successor has no
run to report; its heartbeat says it acted on the withdrawal (``alloc_rev``)
and runs nothing of the job, and the optimizer settles the drain then, not at
``--drain-timeout``. On a 3-server cluster with R3 streams and buckets (the
fenced writes' replicated path), a real agent process, the real optimizer and
admission."""

from __future__ import annotations

import asyncio
import json
import time

from test_agent_restart import DRAIN_TIMEOUT, AgentProcess, eventually, get, submit

from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra_when_ready
from gearshift.bus.views import NodesView
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobState, ReconfigureReply
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer
from loadtest.chaos import NatsFleet


async def test_an_allocation_written_and_withdrawn_while_its_agent_was_down_settles_when_it_is_back(tmp_path):
    fleet = NatsFleet(tmp_path / "nats", 3)
    fleet.start()
    nc = agent = stop = task = svc = None
    try:
        nc = await connect(fleet.url, name="test", retry_for=10)
        await ensure_infra_when_ready(nc, replicas=3)
        assert (await nc.jetstream().stream_info(f"KV_{subj.ALLOC_BUCKET}")).config.num_replicas == 3
        _, svc = await start_admission(nc)
        opt = await Optimizer(nc, interval=0.3, node_timeout=60, lease_ttl=2, drain_timeout=DRAIN_TIMEOUT).open()
        stop = asyncio.Event()
        task = asyncio.create_task(opt.run(stop))
        agent = AgentProcess(fleet.url, "a", tmp_path)
        agent.start()
        nodes = await NodesView(nc.jetstream(), subj.NODES_BUCKET).start()
        await eventually(lambda: asyncio.sleep(0, "a" in nodes.entries), timeout=60)
        await nodes.stop()
        agent.kill()  # down, but not for long enough to be called lost

        job = await submit(nc)
        rec = await eventually(lambda: _scheduled(nc, job), timeout=30)
        g = rec.generation
        req = {"job_id": job, "plan": {"dp": 1, "grad_ckpt": True}, "placement": [{"node": "a", "gpus": 1}]}
        assert (await call(nc, subj.OPTIMIZER_RECONFIGURE, json.dumps(req).encode(), ReconfigureReply)).pinned
        draining = await eventually(lambda: _draining(nc, job, g), timeout=30)
        seen = opt.round_no  # three whole rounds after the drain was written, each of which could have ended it
        await eventually(lambda: asyncio.sleep(0, opt.round_no >= seen + 4 or None), timeout=60)
        assert (await get(nc, job)).draining == draining.draining  # no report ends it while the agent is down

        t0 = time.monotonic()
        agent.start()
        switched = await eventually(lambda: _running(nc, job, g + 1), timeout=90)
        assert time.monotonic() - t0 < DRAIN_TIMEOUT / 10  # the heartbeat ended the drain, not the timeout
        assert switched.plan.grad_ckpt and not switched.draining
    finally:
        if agent is not None:
            agent.stop()
        if stop is not None:
            stop.set()
            try:
                await asyncio.wait_for(task, 20)
            except BaseException:
                task.cancel()
        if svc is not None:
            try:
                await asyncio.wait_for(svc.stop(), 20)
            except BaseException:
                pass
        if nc is not None:
            await nc.close()
        fleet.stop_all()


async def _scheduled(nc, job):
    r = await get(nc, job)
    return r if r.state == JobState.SCHEDULED and r.placement else None


async def _draining(nc, job, g):
    r = await get(nc, job)
    return r if r.generation == g + 1 and [p.node for p in r.draining] == ["a"] else None


async def _running(nc, job, generation):
    r = await get(nc, job)
    return r if r.state == JobState.RUNNING and r.generation == generation else None
