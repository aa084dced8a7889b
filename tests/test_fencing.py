"""Fencing: a deposed leader's writes are refused by the server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from nats.js.errors import KeyWrongLastSequenceError
from test_optimizer import _state, register_nodes, submit, wait_for

from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobRecord, JobState
from gearshift.services.admission import start_admission
from gearshift.services.fencing import Deposed, Fence
from gearshift.services.optimizer import PAUSE_ENV, Optimizer


async def test_fence_refuses_puts_and_cas_of_an_old_epoch(nc):
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    old, new = Fence(nc, [subj.ALLOC_BUCKET], "old"), Fence(nc, [subj.ALLOC_BUCKET], "new")
    await old.take()
    rev = await old.put(subj.ALLOC_BUCKET, "k", b"1")
    rev = await old.update(subj.ALLOC_BUCKET, "k", b"2", rev)
    assert (await kv.get("k")).value == b"2"
    with pytest.raises(KeyWrongLastSequenceError):  # a plain CAS conflict is still a conflict
        await old.update(subj.ALLOC_BUCKET, "k", b"x", rev - 1)
    await new.take()
    with pytest.raises(Deposed):
        await old.put(subj.ALLOC_BUCKET, "k", b"3")
    with pytest.raises(Deposed):
        await old.update(subj.ALLOC_BUCKET, "k", b"3", rev)
    with pytest.raises(Deposed):
        await old.delete(subj.ALLOC_BUCKET, "k")
    assert (await kv.get("k")).value == b"2" and old.refused == 3
    await new.put(subj.ALLOC_BUCKET, "k", b"4")
    assert (await kv.get("k")).value == b"4"


async def _events_on(js, subject: str) -> list[bytes]:
    sub = await js.subscribe(subject, stream=subj.EVENTS_STREAM, ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                out.append((await sub.next_msg(timeout=0.5)).data)
            except Exception:
                return out
    finally:
        await sub.unsubscribe()


async def test_a_deposed_leaders_events_are_refused_and_event_readers_never_see_the_marks(nc):
    js = nc.jetstream()
    fence = subj.events_fence("optimizer")
    old, new = (Fence(nc, [subj.ALLOC_BUCKET], who, events=fence) for who in ("old", "new"))
    await old.take()
    await old.publish("gs.evt.round.completed", b"old-1", "round:old:1")
    await old.publish("gs.evt.round.completed", b"old-1", "round:old:1")  # a retry: the stream drops it
    await new.take()
    with pytest.raises(Deposed):
        await old.publish("gs.evt.round.completed", b"old-2", "round:old:2")
    await new.publish("gs.evt.round.completed", b"new-1", "round:new:1")
    assert old.refused == 1
    assert await _events_on(js, "gs.evt.>") == [b"old-1", b"new-1"]  # no epoch mark among the events
    assert len(await _events_on(js, "gs.fence.>")) == 2  # one mark per leader


async def test_leader_paused_mid_round_is_deposed_and_its_writes_refused(nc, nats_url, tmp_path):
    """The leader decides a round, is stopped (SIGSTOP) before writing, a
    standby takes over; when it continues, the server refuses its writes:
    the job it had decided stays untouched until the new leader schedules it."""
    _, svc = await start_admission(nc)
    await register_nodes(nc)
    pause = tmp_path / "pause"
    env = {**os.environ, "GEARSHIFT_NATS_URL": nats_url, PAUSE_ENV: str(pause), "GEARSHIFT_LOG_LEVEL": "INFO"}
    log_path = tmp_path / "leader.log"
    with open(log_path, "wb") as log:
        old = subprocess.Popen([sys.executable, "-m", "gearshift.services.optimizer", "--interval", "3600",
                                "--lease-ttl", "2"], env=env, stderr=log)
    standby = None
    stop = asyncio.Event()
    task = None
    try:
        lease_kv = await nc.jetstream().key_value(subj.LEASE_BUCKET)

        async def leased():
            try:
                return await lease_kv.get("optimizer")
            except Exception:
                return None

        await wait_for(leased, timeout=30)
        await wait_for(lambda: asyncio.sleep(0, b"leading" in log_path.read_bytes()), timeout=30)
        pause.write_text("")
        job = await submit(nc, "a", 2)  # its round decides, then stops itself before writing

        async def paused():  # kick until a round runs (the kick subscription starts after "leading")
            await nc.publish(subj.OPTIMIZER + ".kick", b"")
            return (tmp_path / "pause.paused").exists()

        await wait_for(paused, timeout=30, step=0.3)
        jobs_kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
        before = await jobs_kv.get(job)

        standby = await Optimizer(nc, interval=3600, lease_ttl=2).open()  # runs no round until kicked
        task = asyncio.create_task(standby.run(stop))
        await wait_for(lambda: asyncio.sleep(0, standby.is_leader and standby._svc is not None), timeout=20)

        old.send_signal(signal.SIGCONT)  # the old leader wakes up mid-round and writes
        await wait_for(lambda: asyncio.sleep(0, b"deposed" in log_path.read_bytes()), timeout=20)
        after = await jobs_kv.get(job)
        assert after.revision == before.revision, "the deposed leader's record write went through"
        assert codec.decode(after.value, JobRecord).state == JobState.PENDING
        alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
        with pytest.raises(Exception):
            await alloc_kv.get(job)  # no allocation was written either
        standby.kick.set()  # the new leader schedules it
        rec = await wait_for(lambda: _state(nc, job, JobState.SCHEDULED), timeout=20)
        assert rec.generation == 1
        assert (await lease_kv.get("optimizer")).value.split()[0].decode() == standby.instance
    finally:
        if old.poll() is None:
            old.send_signal(signal.SIGCONT)
            old.kill()
        old.wait()
        stop.set()
        if task is not None:
            await task
        await svc.stop()


async def test_fence_on_a_replicated_bucket(tmp_path):
    """On a 3-server cluster with R3 buckets the server reports a failed
    expected-sequence check as 10164 and refuses a write while another one
    on the same expected subject (``_epoch``) is in flight: concurrent fenced
    writes of one leader all land, a stale CAS is a key conflict, and only an
    epoch that really moved is a deposition."""
    from gearshift.bus.client import connect
    from gearshift.bus.infra import ensure_infra_when_ready
    from loadtest.chaos import NatsFleet

    fleet = NatsFleet(tmp_path, 3)
    fleet.start()
    nc = None
    try:
        nc = await connect(fleet.url, name="test", retry_for=10)
        await ensure_infra_when_ready(nc, replicas=3)
        kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
        assert (await nc.jetstream().stream_info(f"KV_{subj.ALLOC_BUCKET}")).config.num_replicas == 3
        old, new = Fence(nc, [subj.ALLOC_BUCKET], "old"), Fence(nc, [subj.ALLOC_BUCKET], "new")
        await old.take()
        revs = await asyncio.gather(*[old.put(subj.ALLOC_BUCKET, f"k{i}", b"1") for i in range(40)])
        assert len(set(revs)) == 40 and old.refused == 0
        revs = await asyncio.gather(*[old.update(subj.ALLOC_BUCKET, f"k{i}", b"2", r) for i, r in enumerate(revs)],
                                    return_exceptions=True)
        # a CAS the server refused only for contention is a key conflict (the caller re-reads), never a crash
        assert all(isinstance(r, int) or isinstance(r, KeyWrongLastSequenceError) for r in revs), revs
        rev = (await kv.get("k0")).revision
        with pytest.raises(KeyWrongLastSequenceError):
            await old.update(subj.ALLOC_BUCKET, "k0", b"x", rev - 1)
        await asyncio.gather(*[old.delete(subj.ALLOC_BUCKET, f"k{i}") for i in range(1, 40)])
        assert old.refused == 0
        await new.take()
        with pytest.raises(Deposed):
            await old.put(subj.ALLOC_BUCKET, "k0", b"3")
        with pytest.raises(Deposed):
            await old.update(subj.ALLOC_BUCKET, "k0", b"3", rev)
        assert old.refused == 2 and (await kv.get("k0")).revision == rev
        # events: one leader's concurrent fenced publishes all land on R3; a deposed one's are refused
        fence = subj.events_fence("optimizer")
        ev_old, ev_new = (Fence(nc, [subj.ALLOC_BUCKET], who, events=fence) for who in ("old", "new"))
        await ev_old.take()
        await asyncio.gather(*[ev_old.publish(f"gs.evt.job.j{i}.submitted", b"e", f"j{i}:1") for i in range(20)])
        assert ev_old.refused == 0 and len(await _events_on(nc.jetstream(), "gs.evt.>")) == 20
        await ev_new.take()
        with pytest.raises(Deposed):
            await ev_old.publish("gs.evt.round.completed", b"late", "round:old:9")
        assert len(await _events_on(nc.jetstream(), "gs.evt.>")) == 20
    finally:
        if nc is not None:
            await nc.close()
        fleet.stop_all()
