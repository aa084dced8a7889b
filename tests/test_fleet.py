"""The fleet emulator: real agents (emulated runner) against real services."""

from __future__ import annotations

import asyncio
import json

import gearshift.agent.heartbeat as heartbeat_module
from gearshift.bus.client import call
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobList, JobState, ListRequest, SubmitReply
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer
from loadtest.fleet import Fleet
from tests.wait import eventually

MODEL = {"name": "m", "params": 100, "layers": 4, "hidden": 64, "seq_len": 128}


async def submit(nc, name, gpus, steps, step_time):
    spec = {"name": name, "model": MODEL, "global_batch": 8, "steps": steps, "gpus": gpus, "step_time": step_time}
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def states(nc):
    jobs = (await call(nc, subj.ADMISSION_LIST, ListRequest(all=True), JobList)).jobs
    return {j.job_id: j for j in jobs}


async def until(pred, timeout):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")


async def test_fleet_runs_jobs_to_completion_and_survives_killed_agents(nc, tmp_path):
    _, svc = await start_admission(nc)
    fleet = await Fleet(nc, 12, 4, heartbeat=0.5, progress_interval=0.5, grace=1.0, workdir=str(tmp_path)).start()
    opt = await Optimizer(nc, interval=0.5, node_timeout=2.0, lease_ttl=2).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        ids = [await submit(nc, f"j{i}", gpus=1 + i % 4, steps=40, step_time=0.05) for i in range(30)]

        async def some_running():
            return fleet.running() >= 6

        await until(some_running, 60)
        victims = [n for n, a in fleet.agents.items() if a.runs][:2]
        died = [await fleet.kill(n) for n in victims]
        assert sum(died) >= 1  # runs died with their agents

        async def all_done():
            got = await states(nc)
            return got if all(got[j].state == JobState.COMPLETED for j in ids) else None

        done = await until(all_done, 120)
        requeued = [j for j in ids if done[j].restarts > 0]
        assert requeued, "no job was on a killed node"
        assert all(done[j].steps_done == 40 for j in ids)
        assert not set(victims) & {p.node for j in requeued for p in done[j].placement}
        assert {n for n in opt.lost_nodes} >= set(victims)
    finally:
        stop.set()
        await task
        await fleet.stop()
        await svc.stop()


async def test_the_fleets_agents_share_one_host_memory_sample(nc, tmp_path, monkeypatch):
    """One host: /proc/meminfo is read once per interval for all agents, not
    once per agent and beat (2,000 agents would read it 1,000 times a second)."""
    reads = []
    monkeypatch.setattr(heartbeat_module, "host_memory", lambda: reads.append(1) or (64 * 2**30, 2**30))
    beats = []

    async def got(msg):
        beats.append(msg)

    sub = await nc.subscribe("gs.node.*.heartbeat", cb=got)
    fleet = Fleet(nc, 6, 2, heartbeat=0.05, workdir=str(tmp_path))
    fleet.host_memory.clock = lambda: 0.0  # the interval never ends: one read, however many beats
    await fleet.start(batch=6)
    try:
        await eventually(lambda: len(beats) >= 6 * 4, timeout=20)
        assert len(reads) == 1
        assert all(b"\"memory_total\":68719476736" in m.data for m in beats)
    finally:
        await sub.unsubscribe()
        await fleet.stop()
