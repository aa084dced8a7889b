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

from bus_schema import codec, subjects as subj
from bus_schema.messages import JobRecord, JobState
from services.admission import start_admission
from services.fencing import Deposed, Fence
from services.optimizer import PAUSE_ENV, Optimizer
from test_optimizer import _state, register_nodes, submit, wait_for


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
        old = subprocess.Popen([sys.executable, "-m", "services.optimizer", "--interval", "3600",
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
