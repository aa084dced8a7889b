"""The node agent against a real nats-server, with real child processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
from nats.js.api import DeliverPolicy

from gearshift.agent.agent import Agent
from gearshift.agent.launch import master_port
from gearshift.agent.probe import FakeProbe
from gearshift.bus import alloc_watch
from gearshift.bus.client import call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    AgentReply,
    Allocation,
    JobProgress,
    NodePlacement,
    NodeReport,
    Plan,
    RunReport,
    RunReportKind,
    StopCommand,
)
from gearshift.services import auth_alloc
from tests.wait import eventually

PY = sys.executable
STARTED, EXITED = RunReportKind.STARTED, RunReportKind.EXITED

# Writes its whole environment to $OUT_DIR/env-<RANK>.json.
DUMP_ENV = (
    "import json, os; "
    "json.dump(dict(os.environ), open(os.path.join(os.environ['OUT_DIR'], 'env-%s.json' % os.environ['RANK']), 'w'))"
)
# Sleeps until signalled; writes pid-<generation> first so tests know it runs.
SLEEPER = (
    "import os, time; "
    "open(os.path.join(os.environ['OUT_DIR'], 'pid-' + os.environ['GEARSHIFT_GENERATION']), 'w')"
    ".write(str(os.getpid())); time.sleep(60)"
)
STUBBORN = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(os.path.join(os.environ['OUT_DIR'], 'ready'), 'w').write('1'); time.sleep(60)"
)


class Reports:
    """Every RunReport on GS_REPORTS, with its message id, from the start."""

    def __init__(self) -> None:
        self.items: list[tuple[RunReport, str]] = []

    async def open(self, nc) -> "Reports":
        async def on_msg(msg):
            self.items.append((codec.decode(msg.data, RunReport), msg.headers.get("Nats-Msg-Id")))

        self.sub = await nc.jetstream().subscribe(
            "gs.report.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, cb=on_msg
        )
        return self

    def find(self, job: str, kind: RunReportKind, gen: int, node: str | None = None) -> list[RunReport]:
        return [
            r for r, _ in self.items
            if r.job_id == job and r.kind == kind and r.generation == gen and (node is None or r.node == node)
        ]

    async def wait(self, job: str, kind: RunReportKind, gen: int, node: str | None = None, timeout: float = 5.0):
        found = await eventually(lambda: self.find(job, kind, gen, node), timeout)
        return found[0]


@pytest.fixture
async def reports(nc):
    r = await Reports().open(nc)
    yield r
    await r.sub.unsubscribe()


@pytest.fixture
async def agents(nc, tmp_path):
    """Factory of started in-process agents; all are stopped at the end."""
    started: list[Agent] = []

    async def make(node: str = "n1", gpus: int = 4, **kw) -> Agent:
        kw.setdefault("heartbeat", 0.1)
        kw.setdefault("grace", 5.0)
        kw.setdefault("progress_interval", 0.1)
        probe = FakeProbe(gpus, 16 * 2**30, "Fake H100", node=node)
        kw.setdefault("ckpt_root", tmp_path / "ckpt")  # shared, as on a cluster's shared storage
        agent = Agent(nc, node, probe, tmp_path / "work" / node, cpus=8, **kw)
        count_passes(agent)
        await agent.start()
        started.append(agent)
        return agent

    yield make
    for a in started:  # bounded: a stop stalled on a loaded box must not hang the suite
        try:
            await asyncio.wait_for(a.stop(), 20)
        except (asyncio.TimeoutError, Exception):
            pass


def count_passes(agent: Agent) -> None:
    """Count the watch entries ``agent`` applies (``entries``) and, at the end of
    each reconcile pass, how many it had applied when the pass began
    (``acted_on``): a "nothing happened" check waits for a pass that saw its put."""
    agent.entries, agent.acted_on = 0, 0
    apply_entry, reconcile_once = agent._apply_entry, agent._reconcile_once

    def counted_apply(*args):
        agent.entries += 1
        return apply_entry(*args)

    async def counted_pass():
        seen = agent.entries  # read before the pass's first await: entries it acts on
        await reconcile_once()
        agent.acted_on = max(agent.acted_on, seen)

    agent._apply_entry, agent._reconcile_once = counted_apply, counted_pass


async def put_and_settle(nc, a: Allocation, *agents: Agent) -> None:
    """``put``, then wait until each agent applied it and finished a reconcile pass that saw it."""
    before = [ag.entries for ag in agents]
    await put(nc, a)
    for ag, n in zip(agents, before):
        seen = await eventually(lambda ag=ag, n=n: ag.entries > n and ag.entries)
        await eventually(lambda ag=ag, seen=seen: ag.acted_on >= seen)


def alloc(job: str, gen: int, placement: list[tuple[str, list[int]]], command=None, **kw) -> Allocation:
    gpus = sum(len(g) for _, g in placement)
    return Allocation(
        job_id=job,
        generation=gen,
        plan=kw.pop("plan", Plan(dp=gpus)),
        placement=[NodePlacement(node=n, gpus=g, cpus=2) for n, g in placement],
        command=command,
        **kw,
    )


async def put(nc, a: Allocation) -> None:
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    data = codec.encode(a)
    await kv.put(a.job_id, data)
    await auth_alloc.put(kv, a.job_id, data, a.nodes())  # what agents watch: <node>.<job>


async def delete(nc, job: str) -> None:
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    await kv.delete(job)
    await auth_alloc.delete(kv, job)


async def node_report(nc, node: str) -> NodeReport | None:
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    try:
        entry = await kv.get(node)
    except Exception:
        return None
    return codec.decode(entry.value, NodeReport) if entry.value else None


# ------------------------------------------------------------------ heartbeats
async def test_heartbeats_land_in_gs_nodes_and_on_the_subject(nc, agents):
    sub = await nc.subscribe(subj.node_heartbeat("n1"))
    await agents("n1", gpus=4)
    msg = await sub.next_msg(timeout=2)
    await sub.unsubscribe()  # a callback-less sub with pending messages would stall drain
    live = codec.decode(msg.data, NodeReport)
    assert live.node == "n1" and len(live.gpus) == 4
    rep = await eventually(lambda: node_report(nc, "n1"))
    assert rep.probe == "fake" and rep.cpus == 8 and rep.address == "127.0.0.1"
    assert [g.index for g in rep.gpus] == [0, 1, 2, 3]
    assert all(g.memory_total == 16 * 2**30 and g.memory_used == 0 and g.name == "Fake H100" for g in rep.gpus)
    assert len({g.uuid for g in rep.gpus}) == 4
    assert rep.memory_total > 0 and rep.running == []
    first_ts = rep.ts
    await eventually(lambda: _newer(nc, "n1", first_ts))


async def _newer(nc, node, ts):
    rep = await node_report(nc, node)
    return rep is not None and rep.ts > ts


# ------------------------------------------------------------------ launch contract
async def test_allocation_launches_every_rank_with_the_contract_environment(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    a1 = await agents("n1")
    a2 = await agents("n2")
    job = alloc(
        "envjob", 1, [("n1", [2]), ("n2", [1, 3])], [PY, "-c", DUMP_ENV],
        env={"OUT_DIR": str(out), "FOO": "bar", "RANK": "99"}, steps=7, global_batch=32, plan=Plan(dp=3, ga=2),
    )
    await put(nc, job)
    for node in ("n1", "n2"):
        ex = await reports.wait("envjob", EXITED, 1, node)
        assert ex.exit_code == 0 and not ex.stopped and ex.rank0 == (node == "n1")
        assert reports.find("envjob", STARTED, 1, node)
    ids = {mid for _, mid in reports.items}
    assert {"n1:envjob:1:started", "n1:envjob:1:exited", "n2:envjob:1:started", "n2:envjob:1:exited"} <= ids

    envs = {r: json.loads((out / f"env-{r}.json").read_text()) for r in range(3)}
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs.values()} == {"2", "1", "3"}
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "2" and envs[0]["LOCAL_WORLD_SIZE"] == "1"
    assert [envs[r]["LOCAL_RANK"] for r in (1, 2)] == ["0", "1"]
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in (1, 2)] == ["1", "3"]
    for r, e in envs.items():
        assert e["RANK"] == str(r)  # the job's env cannot override the contract
        assert e["WORLD_SIZE"] == "3" and e["GEARSHIFT_NNODES"] == "2"
        assert e["GEARSHIFT_NODE_RANK"] == ("0" if r == 0 else "1")
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["MASTER_PORT"] == str(master_port("envjob", 1))
        assert e["GEARSHIFT_JOB_ID"] == "envjob" and e["GEARSHIFT_GENERATION"] == "1"
        assert json.loads(e["GEARSHIFT_PLAN"])["ga"] == 2 and json.loads(e["GEARSHIFT_PLAN"])["dp"] == 3
        assert e["GEARSHIFT_STEPS"] == "7" and e["GEARSHIFT_GLOBAL_BATCH"] == "32"
        assert e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and e["FOO"] == "bar"
        assert e["GEARSHIFT_CKPT_DIR"] == str(tmp_path / "ckpt" / "envjob")
        assert e["GEARSHIFT_PROGRESS_FILE"].endswith(f"g1/progress-{r}.json")
    # an allocation that ran to its end is not started again: not by a pass that saw it again
    await put_and_settle(nc, job, a1, a2)
    assert len(reports.find("envjob", STARTED, 1)) == 2 and a1.runs == {} and a2.runs == {}


# ------------------------------------------------------------------ stopping
async def test_deleting_the_allocation_stops_the_process_and_frees_its_gpus(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    await agents("n1")
    await put(nc, alloc("sleepy", 1, [("n1", [0, 2])], [PY, "-c", SLEEPER], env={"OUT_DIR": str(out)}))
    await reports.wait("sleepy", STARTED, 1)
    await eventually(lambda: len(list(out.glob("pid-1"))) == 1)

    async def gpus_held():
        rep = await node_report(nc, "n1")
        return rep if rep and rep.running == ["sleepy@1"] else None

    rep = await eventually(gpus_held)
    held = {g.index: g for g in rep.gpus if g.processes}
    assert set(held) == {0, 2} and all(g.memory_used > 0 for g in held.values())
    assert len({g.processes[0].pid for g in held.values()}) == 2  # one rank per GPU
    pids = [g.processes[0].pid for g in held.values()]

    await delete(nc, "sleepy")
    ex = await reports.wait("sleepy", EXITED, 1)
    assert ex.stopped and ex.exit_code == 143 and ex.message == "allocation removed"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    async def gpus_free():
        rep = await node_report(nc, "n1")
        return rep and rep.running == [] and all(g.memory_used == 0 and not g.processes for g in rep.gpus)

    await eventually(gpus_free)


async def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    await agents("n1", grace=0.5)
    await put(nc, alloc("stubborn", 1, [("n1", [1])], [PY, "-c", STUBBORN], env={"OUT_DIR": str(out)}))
    await eventually(lambda: (out / "ready").exists())
    t0 = time.monotonic()
    await delete(nc, "stubborn")
    ex = await reports.wait("stubborn", EXITED, 1)
    assert ex.exit_code == 137 and ex.stopped  # 128 + SIGKILL
    assert time.monotonic() - t0 >= 0.5


async def test_stop_command_stops_and_fences_its_generation(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = await agents("n1")
    job = alloc("cmd", 2, [("n1", [0])], [PY, "-c", SLEEPER], env={"OUT_DIR": str(out)})
    await put(nc, job)
    await reports.wait("cmd", STARTED, 2)
    stale = await call(nc, subj.agent_command("n1", "stop"), StopCommand(job_id="cmd", generation=1), AgentReply)
    assert not stale.ok and "stale" in stale.error
    reply = await call(nc, subj.agent_command("n1", "stop"), StopCommand(job_id="cmd", generation=2, reason="cancel"),
                       AgentReply)
    assert reply.ok and reply.node == "n1"
    ex = await reports.wait("cmd", EXITED, 2)
    assert ex.stopped and ex.exit_code == 143 and ex.message == "cancel"
    # the allocation is still in KV, but the stopped generation never comes back
    await put_and_settle(nc, job, agent)
    assert len(reports.find("cmd", STARTED, 2)) == 1 and "cmd" not in agent.runs


async def test_one_failing_rank_ends_the_others_and_reports_its_code(nc, agents, reports, tmp_path):
    await agents("n1")
    crash_rank1 = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    await put(nc, alloc("crashy", 1, [("n1", [0, 1])], [PY, "-c", crash_rank1]))
    ex = await reports.wait("crashy", EXITED, 1)
    assert ex.exit_code == 3 and not ex.stopped and "exited with code 3" in ex.message


async def test_a_command_that_cannot_start_is_reported_as_exited(nc, agents, reports, tmp_path):
    await agents("n1")
    await put(nc, alloc("nocmd", 1, [("n1", [0])], [str(tmp_path / "no-such-program")]))
    ex = await reports.wait("nocmd", EXITED, 1)
    assert ex.exit_code == 127 and not ex.stopped and "launch failed" in ex.message
    assert not reports.find("nocmd", STARTED, 1)


# ------------------------------------------------------------------ generations
async def test_stale_generation_is_ignored_and_a_newer_one_replaces_the_old(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = await agents("n1")
    cmd = [PY, "-c", SLEEPER]
    await put(nc, alloc("gens", 2, [("n1", [0])], cmd, env={"OUT_DIR": str(out)}))
    await reports.wait("gens", STARTED, 2)
    await eventually(lambda: (out / "pid-2").exists())

    await put_and_settle(nc, alloc("gens", 1, [("n1", [0])], cmd, env={"OUT_DIR": str(out)}), agent)
    assert not reports.find("gens", STARTED, 1) and not reports.find("gens", EXITED, 2)
    assert agent.runs["gens"].generation == 2 and not agent.runs["gens"].stopping  # the pass that saw it left it be

    await put(nc, alloc("gens", 3, [("n1", [1])], cmd, env={"OUT_DIR": str(out)}))
    await reports.wait("gens", STARTED, 3)
    ex = await reports.wait("gens", EXITED, 2)
    assert ex.stopped and ex.exit_code == 143
    order = [(r.generation, r.kind) for r, _ in reports.items if r.job_id == "gens"]
    assert order.index((2, EXITED)) < order.index((3, STARTED))  # old one gone before the new one starts
    rep = await eventually(lambda: _running(nc, "n1", ["gens@3"]))
    assert [g.index for g in rep.gpus if g.processes] == [1]


async def test_allocation_moved_to_another_node_stops_here_and_starts_there(nc, agents, reports, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    await agents("n1")
    n2 = await agents("n2")
    cmd = [PY, "-c", SLEEPER]
    await put(nc, alloc("mover", 1, [("n1", [0])], cmd, env={"OUT_DIR": str(out)}))
    await reports.wait("mover", STARTED, 1, "n1")
    await put(nc, alloc("mover", 2, [("n2", [0])], cmd, env={"OUT_DIR": str(out)}))
    assert (await reports.wait("mover", EXITED, 1, "n1")).stopped
    await reports.wait("mover", STARTED, 2, "n2")
    await n2.stop()  # an agent that stops takes its processes with it, and says so
    ex = await reports.wait("mover", EXITED, 2, "n2")
    assert ex.stopped and ex.exit_code == 143 and ex.message == "agent stopping"


async def _running(nc, node, expected):
    rep = await node_report(nc, node)
    return rep if rep and rep.running == expected else None


# ------------------------------------------------------------------ emulated worker
async def test_emulated_worker_reports_progress_checkpoints_and_resumes(nc, agents, reports, tmp_path):
    await agents("n1")
    await agents("n2")
    progress: list[JobProgress] = []

    async def on_progress(msg):
        progress.append(codec.decode(msg.data, JobProgress))

    psub = await nc.subscribe(subj.job_progress("emu"), cb=on_progress)
    job = alloc("emu", 1, [("n1", [0, 1]), ("n2", [0])], None, steps=60, global_batch=8, step_time=0.02)
    await put(nc, job)
    await eventually(lambda: any(p.steps_done >= 10 for p in progress))
    assert all(p.node == "n1" and p.steps == 60 for p in progress)  # only rank 0's node reports
    assert any(p.samples_per_s > 0 for p in progress)
    await delete(nc, "emu")
    ex1 = await reports.wait("emu", EXITED, 1, "n1")
    assert ex1.exit_code == 143 and ex1.stopped and 10 <= ex1.steps_done < 60
    assert (await reports.wait("emu", EXITED, 1, "n2")).exit_code == 143
    manifest = json.loads((tmp_path / "ckpt/emu/manifest.json").read_text())
    assert manifest["step"] == ex1.steps_done and not manifest["done"]

    await put(nc, alloc("emu", 2, [("n1", [2, 3]), ("n2", [1])], None, steps=60, global_batch=8, step_time=0.02))
    ex2 = await reports.wait("emu", EXITED, 2, "n1")
    assert ex2.exit_code == 0 and not ex2.stopped and ex2.steps_done == 60
    follower = await reports.wait("emu", EXITED, 2, "n2")  # saw rank 0's manifest say done
    assert follower.exit_code == 0 and not follower.stopped
    log = (tmp_path / "work/n1/run/emu/g2/rank-0.log").read_text()
    assert f"resuming from step {ex1.steps_done} of 60" in log
    await psub.unsubscribe()
    gen2 = [p.steps_done for p in progress if p.generation == 2]
    assert gen2 and min(gen2) >= ex1.steps_done


# ------------------------------------------------------------------ entry point
def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


async def test_agent_without_driver_refuses_in_one_line_unless_fake(nats_url):
    if _nvml_works():
        pytest.skip("this machine has an NVIDIA driver")
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "gearshift.agent", "--server", nats_url, "--node", "nodriver",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "GEARSHIFT_LOG_LEVEL": "INFO"},
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 20)
    lines = [ln for ln in stderr.decode().splitlines() if ln.strip()]
    assert proc.returncode == 2
    assert len(lines) == 1 and "--fake-gpus" in lines[0] and "NVIDIA driver" in lines[0]


async def test_agent_command_runs_with_fake_gpus_and_leaves_on_sigterm(nc, nats_url, tmp_path):
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "gearshift.agent", "--server", nats_url, "--node", "cli1", "--fake-gpus", "2", "--gpu-memory", "24GiB",
        "--heartbeat", "0.2", "--workdir", str(tmp_path / "cli1"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        rep = await eventually(lambda: node_report(nc, "cli1"), timeout=15)
        assert len(rep.gpus) == 2 and rep.gpus[0].memory_total == 24 * 2**30 and rep.probe == "fake"
    finally:
        proc.terminate()
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert await node_report(nc, "cli1") is None  # left on purpose: gone at once


async def test_a_watch_the_server_does_not_answer_at_start_is_tried_again(nc, agents, reports, tmp_path):
    """A cluster electing a new leader times requests out for a while: the agent waits, it does not crash."""
    from nats.errors import TimeoutError as NatsTimeout

    tries = []

    async def slow_server(js, node):
        tries.append(node)
        if len(tries) < 3:
            raise NatsTimeout
        return await alloc_watch.node_alloc_watch(js, node)

    await agents("n1", alloc_watch=slow_server)
    assert tries == ["n1"] * 3
    await put(nc, alloc("after", 1, [("n1", [0])], [PY, "-c", "pass"]))
    assert (await reports.wait("after", EXITED, 1)).exit_code == 0  # and it works


class _HeldWatch:
    """The agent's real watch, whose next ``n`` changes are handed over together (as one
    fetch's batch is): the agent applies them all before its reconcile pass runs."""

    def __init__(self, inner):
        self.inner, self.hold_for, self.buf = inner, 0, []

    def hold(self, n: int) -> None:
        self.hold_for = n

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self.buf or self.hold_for:
            self.buf.append(await self.inner.__anext__())
            if len([e for e in self.buf if e is not None]) >= self.hold_for:
                self.hold_for = 0
        return self.buf.pop(0)

    async def stop(self):
        await self.inner.stop()


async def test_an_allocation_withdrawn_before_the_agent_started_it_is_reported_at_once(nc, agents, reports, tmp_path):
    """Its write and its withdrawal reach the agent together (one batch, or a resynced
    watch replaying both): nothing of it ever runs, and only the agent can say so. It
    reports that generation's end at once (stopped on request, 143), so a drain or a
    cancel waiting on this node does not wait out --drain-timeout; the generation is
    fenced, and the next one runs."""
    watches = {}

    async def held(js, node):
        watches[node] = _HeldWatch(await alloc_watch.node_alloc_watch(js, node))
        return watches[node]

    await agents("n1", alloc_watch=held)
    watches["n1"].hold(2)
    await put(nc, alloc("quick", 1, [("n1", [0])], [PY, "-c", SLEEPER], env={"OUT_DIR": str(tmp_path)}))
    await delete(nc, "quick")
    r = await reports.wait("quick", EXITED, 1)
    assert r.stopped and r.exit_code == 143 and r.node == "n1" and "withdrawn before it started" in r.message
    assert not reports.find("quick", STARTED, 1) and not (tmp_path / "pid-1").exists()
    await put(nc, alloc("quick", 2, [("n1", [0])], [PY, "-c", "pass"]))
    assert (await reports.wait("quick", EXITED, 2)).exit_code == 0
    assert reports.find("quick", STARTED, 2) and len(reports.find("quick", EXITED, 1)) == 1
