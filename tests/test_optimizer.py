"""Optimizer against a real nats-server: rounds, allocations, reports, leases.

Agents are stood in for by writing their node reports and run reports on
the bus, exactly as an agent would (the agent itself has its own tests and
the end-to-end test runs both).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gearshift.bus.client import call
from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    ExplainReply,
    GpuReport,
    JobRecord,
    JobState,
    NodeReport,
    RoundCompleted,
    RoundReply,
    RunReport,
    RunReportKind,
    SubmitReply,
)
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer

MODEL = {"name": "m", "params": 100, "layers": 4, "hidden": 64, "seq_len": 128}


async def register_nodes(nc, n=2, gpus=4, cpus=32):
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    for i in range(n):
        rep = NodeReport(node=f"n{i}", ts=time.time(), gpus=[GpuReport(index=g, uuid=f"GPU-{i}-{g}") for g in range(gpus)], cpus=cpus)
        await kv.put(f"n{i}", codec.encode(rep))


async def submit(nc, name, gpus, steps=10):
    spec = {"name": name, "model": MODEL, "global_batch": 8, "steps": steps, "gpus": gpus}
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def report(nc, job_id, gen, node, kind, **kw):
    r = RunReport(job_id=job_id, generation=gen, node=node, kind=kind, ts=time.time(), **kw)
    await nc.jetstream().publish(subj.run_report(node, job_id), codec.encode(r),
                                 headers={"Nats-Msg-Id": f"{node}:{job_id}:{gen}:{kind.value}"})


async def wait_for(pred, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(step)
    raise AssertionError("condition not met in time")


async def job(nc, job_id) -> JobRecord:
    return await call(nc, subj.ADMISSION_GET, {"job_id": job_id}, JobRecord)


@contextlib.asynccontextmanager
async def leading_optimizer(nc, interval: float = 0.5):
    """An admission, two nodes' reports and an optimizer that leads, stopped after."""
    _, svc = await start_admission(nc)
    await register_nodes(nc)
    opt = await Optimizer(nc, interval=interval, lease_ttl=2, max_retries=1).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader))
        yield opt
    finally:
        stop.set()
        await task
        await svc.stop()


@pytest.fixture
async def cluster(nc):
    async with leading_optimizer(nc) as opt:
        yield opt


async def test_fifo_schedules_in_order_and_reports_move_states(nc, cluster):
    a = await submit(nc, "a", 4)
    b = await submit(nc, "b", 8)  # cannot fit beside a: waits (head of line)
    c = await submit(nc, "c", 2)  # behind b in FIFO order
    rec_a = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))
    assert rec_a.generation == 1 and len(rec_a.placement) == 1 and len(rec_a.placement[0].gpus) == 4
    alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)

    async def alloc_of_a():  # written right after the record
        try:
            return await alloc_kv.get(a)
        except Exception:
            return None

    alloc = codec.decode((await wait_for(alloc_of_a)).value, Allocation)
    assert alloc.generation == 1 and alloc.plan.dp == 4 and alloc.steps == 10
    await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply)
    assert (await job(nc, b)).state == JobState.PENDING
    rec_c = await job(nc, c)
    assert rec_c.state == JobState.PENDING and "behind" in rec_c.reason
    explain = await call(nc, subj.OPTIMIZER_EXPLAIN, None, ExplainReply)
    assert any(e.job_id == b and "needs 8 GPUs" in e.reason for e in explain.jobs)

    node = rec_a.placement[0].node
    await report(nc, a, 1, node, RunReportKind.STARTED)
    await wait_for(lambda: _state(nc, a, JobState.RUNNING))
    await report(nc, a, 1, node, RunReportKind.EXITED, exit_code=0, steps_done=10)
    done = await wait_for(lambda: _state(nc, a, JobState.COMPLETED))
    assert done.steps_done == 10
    # completion frees the GPUs: b then c get scheduled, allocation of a is gone
    await wait_for(lambda: _state(nc, b, JobState.SCHEDULED))
    await wait_for(lambda: _state(nc, c, JobState.SCHEDULED)) if False else None
    snap = await kv_snapshot(alloc_kv)
    assert a not in snap and b in snap


async def test_a_round_reports_its_own_cpu_within_the_process_s(nc, cluster):
    """``round.completed`` carries the round's own CPU (its steps and its policy's
    thread, ``bus.process.OwnCpu``) beside the process's over the round: a part of it.
    Every round's own CPU is also counted, by whether it changed anything
    (``gearshift_round_cpu_seconds_total{changed}``, ``gearshift_rounds_total{changed}``,
    read as the harness reads them): a round asked for with nothing new changes nothing,
    publishes no event, and is counted as such."""
    before = _round_counts()
    seen: list[RoundCompleted] = []

    async def on(msg):
        seen.append(codec.decode(msg.data, RoundCompleted))

    sub = await nc.subscribe(subj.round_event("round.completed"), cb=on)
    try:
        await submit(nc, "a", 4)
        await wait_for(lambda: asyncio.sleep(0, seen))
        ev = seen[0]
        assert ev.changes >= 1 and 0 < ev.own_cpu_ms <= ev.cpu_ms + 0.1  # 0.1: the two clocks' rounding
        mid = _round_counts()
        assert mid["gearshift_rounds_total", "true"] > before.get(("gearshift_rounds_total", "true"), 0)
        assert mid["gearshift_round_cpu_seconds_total", "true"] >= ev.own_cpu_ms / 1e3 - 1e-9
        n = len(seen)
        await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply)  # nothing new: it changes nothing
        await nc.flush()
        after = _round_counts()
        assert after["gearshift_rounds_total", "false"] >= mid.get(("gearshift_rounds_total", "false"), 0) + 1
        assert after["gearshift_round_cpu_seconds_total", "false"] > \
            mid.get(("gearshift_round_cpu_seconds_total", "false"), 0)
        assert len(seen) == n
    finally:
        await sub.unsubscribe()


def _round_counts() -> dict:
    """(family sample, changed) -> value of the optimizer's round counters, from the text it serves."""
    from prometheus_client.parser import text_string_to_metric_families

    from gearshift.bus import observe

    return {(smp.name, smp.labels["changed"]): smp.value
            for f in text_string_to_metric_families(observe.generate_latest_for("optimizer")) for smp in f.samples
            if smp.name in ("gearshift_rounds_total", "gearshift_round_cpu_seconds_total")}


async def test_stale_generation_report_is_ignored_and_crash_fails_job(nc, cluster):
    a = await submit(nc, "a", 2)
    rec = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))
    node = rec.placement[0].node
    await report(nc, a, 7, node, RunReportKind.EXITED, exit_code=0)  # not its generation
    await report(nc, a, 1, node, RunReportKind.STARTED)
    await wait_for(lambda: _state(nc, a, JobState.RUNNING))
    await report(nc, a, 1, node, RunReportKind.EXITED, exit_code=3, message="boom", checkpoint_step=4)
    # a crash is retried from the last checkpoint (max_retries=1 here) ...
    again = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED, generation=2))
    assert again.failures == 1 and again.checkpoint_step == 4 and not again.draining
    node = again.placement[0].node
    await report(nc, a, 2, node, RunReportKind.EXITED, exit_code=3, message="boom")
    # ... then the job fails with the reason
    failed = await wait_for(lambda: _state(nc, a, JobState.FAILED))
    assert "code 3" in failed.reason and "after 1 retries" in failed.reason and failed.exit_code == 3


async def test_cancel_running_job_deletes_allocation_then_cancelled_on_exit(nc, cluster):
    a = await submit(nc, "a", 4)
    rec = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))
    node = rec.placement[0].node
    await report(nc, a, 1, node, RunReportKind.STARTED)
    await wait_for(lambda: _state(nc, a, JobState.RUNNING))
    assert (await call(nc, subj.ADMISSION_CANCEL, {"job_id": a}, JobRecord)).state == JobState.CANCELLING
    alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)

    async def alloc_gone():
        return a not in await kv_snapshot(alloc_kv)

    await wait_for(alloc_gone)
    # its GPUs stay held until the process exits: an 8-GPU job cannot start yet
    b = await submit(nc, "b", 8)
    await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply)
    assert (await job(nc, b)).state == JobState.PENDING
    await report(nc, a, 1, node, RunReportKind.EXITED, exit_code=143, stopped=True)
    await wait_for(lambda: _state(nc, a, JobState.CANCELLED))
    await wait_for(lambda: _state(nc, b, JobState.SCHEDULED))


async def test_allocation_rewritten_when_missing(nc, cluster):
    """The record is the truth: a lost allocation write heals next round."""
    a = await submit(nc, "a", 2)
    await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))
    alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    await alloc_kv.delete(a)
    await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply)
    assert a in await kv_snapshot(alloc_kv)


async def _state(nc, job_id, state, generation=None):
    rec = await job(nc, job_id)
    return rec if rec.state == state and generation in (None, rec.generation) else None


async def test_standby_takes_over_when_active_is_killed(nc, nats_url):
    _, svc = await start_admission(nc)
    await register_nodes(nc)
    env = {**os.environ, "GEARSHIFT_NATS_URL": nats_url}
    active = subprocess.Popen([sys.executable, "-m", "gearshift.services.optimizer", "--interval", "0.5"], env=env)
    try:
        lease_kv = await nc.jetstream().key_value(subj.LEASE_BUCKET)

        async def leased():
            try:
                return await lease_kv.get("optimizer")
            except Exception:
                return None

        first = await wait_for(leased, timeout=15)
        standby = await Optimizer(nc, interval=0.5).open()  # default ttl 6 s
        stop = asyncio.Event()
        task = asyncio.create_task(standby.run(stop))
        # it tried for the lease and found it held (and renewed since): it stays a standby
        seen = await wait_for(lambda: asyncio.sleep(0, standby.lease._seen), timeout=15)
        await wait_for(lambda: asyncio.sleep(0, standby.lease._seen[0] > seen[0]), timeout=15)
        assert not standby.is_leader
        await register_nodes(nc)
        a = await submit(nc, "a", 2)
        await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))  # the subprocess schedules
        active.send_signal(signal.SIGKILL)
        active.wait()
        killed_at = time.monotonic()
        await wait_for(lambda: asyncio.sleep(0, standby.is_leader), timeout=12)
        took = time.monotonic() - killed_at
        assert took < 10, f"takeover took {took:.1f}s"
        assert (await lease_kv.get("optimizer")).value.split()[0].decode() == standby.instance != first.value.split()[0].decode()
        await register_nodes(nc)  # the agents' heartbeats go on (a loaded machine can take > node timeout)
        b = await submit(nc, "b", 2)
        await wait_for(lambda: _state(nc, b, JobState.SCHEDULED))  # the new leader schedules
        stop.set()
        await task
    finally:
        if active.poll() is None:
            active.kill()
        await svc.stop()


async def test_every_round_compared_with_a_rebuild_finds_the_kept_state_right(nc):
    """Rounds that do only what changed (issue 24): with a full round every round, each
    one brings the kept indexes up to date from what changed, rebuilds them from
    scratch and counts any difference (``Rounds.mismatches``): none, through arrivals,
    starts, a crash and its retry, completions and a cancel."""
    adm, svc = await start_admission(nc)
    await register_nodes(nc)
    opt = await Optimizer(nc, interval=0.2, lease_ttl=2, max_retries=1).open()
    opt.reconcile_every = 0.0  # every round is a full one
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader))
        jobs = [await submit(nc, f"x{i}", g) for i, g in enumerate([4, 2, 8, 2, 1])]
        first = await wait_for(lambda: _state(nc, jobs[0], JobState.SCHEDULED))
        node = first.placement[0].node
        await report(nc, jobs[0], 1, node, RunReportKind.STARTED)
        await report(nc, jobs[0], 1, node, RunReportKind.EXITED, exit_code=3, message="boom")
        again = await wait_for(lambda: _state(nc, jobs[0], JobState.SCHEDULED, generation=2))
        await report(nc, jobs[0], 2, again.placement[0].node, RunReportKind.EXITED, exit_code=0, steps_done=10)
        await wait_for(lambda: _state(nc, jobs[0], JobState.COMPLETED))
        await call(nc, subj.ADMISSION_CANCEL, {"job_id": jobs[4]}, JobRecord)
        seen = opt.round_no
        await wait_for(lambda: asyncio.sleep(0, opt.round_no >= seen + 3))
        assert opt.round_no >= 5 and opt.rounds.mismatches == 0
    finally:
        stop.set()
        await task
        await svc.stop()


async def test_the_leader_archives_between_rounds_outside_their_paced_time():
    """``round_loop``: each round is followed by an archive pass, after the pacer took the
    round's time (the pass is not a round's time, so it neither lengthens the pause before
    the next round nor the round's own latency). A failed pass is logged and the rounds go
    on; a deposed one ends the loop."""
    from gearshift.services.fencing import Deposed
    from gearshift.services.optimizer import round_loop
    from gearshift.services.pacing import RoundPacer

    order: list[str] = []

    class Leadership:
        def deposed(self, exc):
            order.append("deposed")

    class Opt:
        is_leader = True
        interval = 0.0
        kick = asyncio.Event()
        pacer = RoundPacer(gap=0.0, duty=0.5)
        leadership = Leadership()
        _reconcile_at = 1.0

        async def round(self):
            order.append("round")
            await asyncio.sleep(0.02)

        async def archive(self):
            order.append(f"archive after {self.pacer.took:.2f}")
            passes = sum(1 for o in order if o.startswith("archive"))
            await asyncio.sleep(0.2)  # ten times the round: the pacer must not have counted it
            if passes == 2:
                raise RuntimeError("history store unavailable")
            if passes == 3:
                raise Deposed("a newer leader")

    opt = Opt()
    await asyncio.wait_for(round_loop(opt), timeout=10)
    assert [o.split(" ")[0] for o in order] == ["round", "archive", "round", "archive", "round", "archive", "deposed"]
    for o in order:
        if o.startswith("archive"):
            assert 0.0 < float(o.split()[-1]) < 0.15  # the round's 0.02 s (and scheduling), not the pass's 0.2
    assert opt._reconcile_at == 1.0  # a failed archive is not a failed round: no full round forced


async def test_a_round_holds_the_cycle_collector_off_and_gives_it_back_even_when_it_fails():
    """Collections wait for the round's end (they run in the pacer's rest); a failed round
    does not leave the collector off, and a process that had it off keeps it off."""
    import gc

    from gearshift.services.rounds import Rounds

    seen: list[bool] = []

    async def failing(flush: bool, strict: bool):
        seen.append(gc.isenabled())
        raise RuntimeError("a write failed")

    rounds = Rounds.__new__(Rounds)
    rounds._run = failing
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        await rounds.run()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError):
            await rounds.run()
        assert not gc.isenabled()
    finally:
        gc.enable()
