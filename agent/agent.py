"""The per-node agent: makes the job processes on this node match ``gs_alloc``.

Level-triggered: a KV watch keeps ``desired`` (the allocations that place a
job on this node) up to date, and every change wakes one reconcile pass that
compares it with ``runs`` (what this agent started) through the pure core
(``agent/core.py``: the run phases, what to stop and launch, fencing). A pass
never waits for a process: stops run as their own tasks and, when a process
ends, its supervisor wakes the reconciler again, so a job whose old
generation is still stopping gets its new generation on the pass after the
old one is gone. How ranks run is the runner's business (``agent/runner.py``:
processes; ``agent/emulated_runner.py``: tasks, for the fleet emulator).

Plan switches (checkpoint-restore): the optimizer withdraws generation g's
allocation; ``_begin_stop`` asks the run to checkpoint and leave (SIGTERM to
each rank's process group, ``grace`` seconds, then SIGKILL); ``_supervise``
learns how it ended and reports EXITED with the checkpoint it left
(``agent/reports.py``). The optimizer writes g+1 only once every node of g
reported EXITED (gang barrier); the agent then launches g+1, which resumes
from the manifest, and reports STARTED and, once rank 0's progress shows its
first step, STEPPED (``agent/progress.py``).

Restart: an agent killed outright leaves runs it never reported ended. Its
successor on the same workdir stops what is left of them (the runner's
``reap``), reads its allocations, and reports EXITED (and fences) each run
that is no longer allocated at its generation -- so a drain or a cancel it
was in the middle of ends now, not at the optimizer's timeout; a run still
allocated is launched again and resumes from its checkpoint.

Commands: ``stop`` (fence a generation), ``checkpoint`` (SIGUSR1: checkpoint
at the next agreed step and go on), ``profile`` (``agent/profiling.py``),
``logs``. The agent reaches the control plane only over the bus: KV watches
and writes, request-reply endpoints, the report stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from gearshift.agent import core, launch, profiling
from gearshift.agent import worker as wk
from gearshift.agent.core import Run, RunPhase
from gearshift.agent.heartbeat import Heartbeat
from gearshift.agent.logs import read_rank_logs
from gearshift.agent.probe import GpuProbe
from gearshift.agent.progress import ProgressPublisher
from gearshift.agent.reports import Reporter
from gearshift.agent.runner import Runner, SubprocessRunner
from gearshift.agent.spawn import RankSpawner
from gearshift.bus import observe
from gearshift.bus.alloc_watch import node_alloc_watch
from gearshift.bus.log import get_logger
from gearshift.bus.server import Endpoint, serve
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    AgentReply,
    Allocation,
    CheckpointCommand,
    ProfileCommand,
    ProfileResult,
    RunReportKind,
    StopCommand,
)
from gearshift.bus_schema.ops import LogsRequest

DEFAULT_GRACE_S = 10.0
# the agent's defaults, written once: AgentConfig (agent/main.py) declares its fields with them
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_ADDRESS = "127.0.0.1"
SYNC_WAIT_S = 10.0  # at most this long for the allocations before judging a predecessor's runs


class Agent:
    def __init__(self, nc: NATS, node: str, probe: GpuProbe, workdir: str | os.PathLike, *, cpus: int | None = None,
                 heartbeat: float = DEFAULT_HEARTBEAT_S, grace: float = DEFAULT_GRACE_S, address: str = DEFAULT_ADDRESS,
                 progress_interval: float = 1.0, ckpt_root: str | os.PathLike | None = None,
                 runner: Runner | None = None, alloc_watch: Any = None, topology: str = ""):
        self.nc = nc
        self.js = nc.jetstream()
        self.node = subj.token(node)
        self.probe = probe
        self.workdir = Path(workdir)
        # Checkpoints must outlive a move to another node: on a cluster this is
        # shared storage, in `gearshift up` one folder for all agents.
        self.ckpt_root = Path(ckpt_root) if ckpt_root is not None else self.workdir / "ckpt"
        self.cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        self.grace = grace
        self.address = address
        self.log = get_logger(agent=self.node)
        # how ranks run: real processes (with warm workers for the next generation,
        # agent/warm.py; $GEARSHIFT_WARM: modules to keep warm from the start), or
        # in-process for the fleet emulator
        self.runner: Runner = runner or SubprocessRunner.with_warm_pool(
            self.workdir, self.log, [m for m in os.environ.get("GEARSHIFT_WARM", "").split(",") if m])
        self._alloc_watch = alloc_watch or node_alloc_watch  # (js, node) -> watch of this node's allocations
        self.desired: dict[str, Allocation] = {}
        self.runs: dict[str, Run] = {}
        self.launched: dict[str, int] = {}
        self.reserved: set[int] = set()  # GPUs of profiling runs
        self._dirty = asyncio.Event()
        self._synced = asyncio.Event()  # the watch delivered this node's allocations as they were
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()  # stops, supervisors, reports
        self._closing = False
        self._watcher: Any = None
        self._svc: Any = None
        self._alloc_kv: Any = None
        self._nodes_kv: Any = None
        self.reports = Reporter(self.js, self.node, self.runner, self.log, lambda: self._closing)
        self.heartbeat = Heartbeat(nc, self.node, probe, cpus=self.cpus, address=address, interval=heartbeat,
                                   runs=self.runs, reserved=self.reserved, log=self.log, nodes_kv=lambda: self._nodes_kv,
                                   topology=topology)
        self.spawner = RankSpawner(self.node, address, self.runner, probe, lambda: self._nodes_kv, lambda: self._closing)
        self.progress = ProgressPublisher(nc, self.node, self.runner, self.reports, self.runs, self._spawn, self.log,
                                          progress_interval)

    # ------------------------------------------------------------ life cycle
    async def start(self) -> "Agent":
        await self.probe.open()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The buckets belong to the control plane; an agent started first waits for them.
        self._alloc_kv = await _until_it_works(lambda: _bucket(self.js, subj.ALLOC_BUCKET), "gs_alloc")
        self._nodes_kv = await _until_it_works(lambda: _bucket(self.js, subj.NODES_BUCKET), "gs_nodes")
        # capacity visible before the first allocation can arrive
        await _until_it_works(self.heartbeat.beat, "first heartbeat")
        await self.runner.open(len(await self.probe.sample()))
        self._svc = await serve(
            self.nc, f"agent-{self.node}",
            [
                Endpoint("stop", subj.agent_command(self.node, "stop"), StopCommand, self._on_stop),
                Endpoint("checkpoint", subj.agent_command(self.node, "checkpoint"), CheckpointCommand,
                         self._on_checkpoint),
                Endpoint("profile", subj.agent_command(self.node, "profile"), ProfileCommand, self._on_profile),
                Endpoint("logs", subj.agent_command(self.node, "logs"), LogsRequest,
                         lambda req: asyncio.to_thread(read_rank_logs, self.workdir / "run", self.node, req)),
            ],
            description=f"gearshift agent on {self.node}", metadata={"node": self.node},
        )
        # only this node's allocations (<node>.<job> keys): see services.auth_alloc
        self._watcher = await _until_it_works(lambda: self._alloc_watch(self.js, self.node), "allocation watch")
        self._tasks = [asyncio.create_task(self._watch_loop(), name="agent-watch")]
        # A predecessor killed outright left runs behind: stop them before launching
        # anything (or one generation would run twice), and report those that are over.
        await self._recover(await self.runner.reap(self.workdir / "run", self.grace, self.log))
        self._tasks += [
            asyncio.create_task(self._reconcile_loop(), name="agent-reconcile"),
            asyncio.create_task(self.heartbeat.loop(), name="agent-heartbeat"),
            asyncio.create_task(self.progress.loop(), name="agent-progress"),
        ]
        self.log.info("agent started", probe=self.probe.kind, gpus=len(await self.probe.sample()), cpus=self.cpus)
        return self

    async def _recover(self, leftovers: list[Any]) -> None:
        if not leftovers:
            return
        try:
            await asyncio.wait_for(self._synced.wait(), SYNC_WAIT_S)
        except asyncio.TimeoutError:
            self.log.warning("allocations not read in time: judging a predecessor's runs on what arrived")
        by_alloc = {(x.alloc.job_id, x.alloc.generation): x for x in leftovers}
        reports = []
        for alloc in core.ended_leftovers([x.alloc for x in leftovers], self.desired):
            self.launched[alloc.job_id] = max(self.launched.get(alloc.job_id, 0), alloc.generation)
            left = by_alloc[(alloc.job_id, alloc.generation)]
            if self.node not in alloc.nodes():
                continue  # not this node's (a renamed node): nothing it can say
            run = self._new_run(alloc, run_dir=left.run_dir)
            run.stopped_by_agent = True
            run.reason = "ended with the previous agent"
            code = core.leftover_exit_code(self.runner.manifest(run), alloc.job_id, left.killed)
            self.log.info("reporting a run the previous agent left", job_id=alloc.job_id,
                          generation=alloc.generation, exit_code=code)
            reports.append(self._report_exit(run, code))
        await asyncio.gather(*reports, return_exceptions=True)  # before alloc_rev moves: the drain ends on these

    async def stop(self) -> None:
        """Stop every job process (checkpoint grace included), then leave."""
        if self._closing:
            return
        self._closing = True
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:
                pass
        if len(self._tasks) > 1:  # absent when start() failed half-way
            await cancel_and_wait([self._tasks[0]])
            self._dirty.set()  # the reconciler finishes its pass (a launch in flight included) and ends
            await asyncio.gather(self._tasks[1], return_exceptions=True)
        self.runner.close()
        for run in list(self.runs.values()):
            self._begin_stop(run, "agent stopping", by_agent=True)
        while self._side_tasks:  # supervisors publish the EXITED reports
            await asyncio.gather(*list(self._side_tasks), return_exceptions=True)
        await cancel_and_wait(self._tasks)
        if self._svc is not None:
            try:
                await self._svc.stop()
            except Exception:
                pass
        try:  # a node that left on purpose is gone now, not after a timeout
            await asyncio.wait_for(self._nodes_kv.delete(self.node), 2)
        except Exception:
            pass
        await self.probe.close()
        self.log.info("agent stopped")

    def wake(self) -> None:
        self._dirty.set()

    # ------------------------------------------------------------ desired state
    async def _watch_loop(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # "initial values done" marker
                self._synced.set()
                continue
            self._apply_entry(entry.key, entry.value, entry.operation, entry.revision)

    def _apply_entry(self, key: str, value: bytes | None, op: str | None, revision: int = 0) -> None:
        self.heartbeat.applied_rev = max(self.heartbeat.applied_rev, revision)
        if op in ("DEL", "PURGE") or not value:
            gone = self.desired.pop(key, None)
            if gone is not None and key not in self.runs and gone.generation > self.launched.get(key, 0):
                never_started(self, gone)
            self._dirty.set()  # even for a key it never had (a tombstone): the heartbeat's alloc_rev follows
            return
        try:
            alloc = codec.decode(value, Allocation)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.log.error("undecodable allocation ignored", key=key, error=str(exc))
            return
        if self.node in alloc.nodes():
            self.desired[key] = alloc
        else:
            self.desired.pop(key, None)
        self._dirty.set()

    async def _reconcile_loop(self) -> None:
        self._dirty.set()  # what arrived while a predecessor's runs were recovered
        while not self._closing:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._reconcile_once()
            except Exception:  # one bad allocation must not stop the agent
                self.log.exception("reconcile failed")

    async def _reconcile_once(self) -> None:
        rev = self.heartbeat.applied_rev  # what this pass acts on: the heartbeat's alloc_rev once it has
        todo = core.reconcile(dict(self.desired), self.runs, self.launched)
        for job_id, reason in todo.stop:
            want = self.desired.get(job_id)
            if want is not None:  # a newer generation replaces the running one
                observe.reconcile_lag("replace", want)
            self._begin_stop(self.runs[job_id], reason, by_agent=True)
        for want in todo.launch:
            if self._closing:
                return
            if want.job_id in self.runs or want.generation <= self.launched.get(want.job_id, 0):
                continue  # changed while an earlier launch of this pass awaited
            await self._launch(want)
        self.heartbeat.alloc_rev = max(self.heartbeat.alloc_rev, rev)

    # ------------------------------------------------------------ launching
    def _new_run(self, alloc: Allocation, run_dir: Path | None = None) -> Run:
        node_rank = alloc.nodes().index(self.node)
        run_dir = run_dir or self.workdir / "run" / alloc.job_id / f"g{alloc.generation}"
        return Run(alloc=alloc, node_rank=node_rank, gpus=list(alloc.placement[node_rank].gpus), run_dir=run_dir,
                   ckpt_dir=self.ckpt_root / alloc.job_id,
                   progress_file=run_dir / "progress-0.json" if node_rank == 0 else None)

    async def _launch(self, alloc: Allocation) -> None:
        observe.reconcile_lag("launch", alloc)
        self.launched[alloc.job_id] = alloc.generation
        run = self._new_run(alloc)
        log = self.log.bind(job_id=alloc.job_id, generation=alloc.generation)
        self.runs[alloc.job_id] = run  # visible to a stop command while it launches
        try:
            await self.spawner.spawn(run, alloc.nodes()[0])
        except Exception as exc:
            log.error("launch failed", error=str(exc))
            for proc in run.procs:
                self.runner.signal(proc, signal.SIGKILL)
            self.probe.release(run.gpus)
            self.runs.pop(alloc.job_id, None)
            run.advance(RunPhase.EXITED)
            run.reason = f"launch failed: {exc}"
            self._spawn(self._report_exit(run, 127))
            return
        if run.phase == RunPhase.STOPPING:  # stopped while launching: reach the ranks started since
            for proc in run.procs:
                self.runner.signal(proc, signal.SIGTERM)
        else:
            run.advance(RunPhase.RUNNING)
        log.info("launched", pids=[p.pid for p in run.procs], gpus=run.gpus, plan=alloc.plan.label())
        self._spawn(self._supervise(run))

    # ------------------------------------------------------------ running and ending
    async def _supervise(self, run: Run) -> None:
        async def wait_rank(i: int, proc: Any) -> None:
            code = launch.exit_status(await proc.wait())
            run.exit_codes.append(code)
            if code != 0 and not run.stopping:
                # torchrun semantics: one rank failing ends the others
                self._begin_stop(run, f"local rank {i} exited with code {code}", by_agent=False)

        ranks = asyncio.gather(*(wait_rank(i, p) for i, p in enumerate(run.procs)))
        await self.reports.send(run, RunReportKind.STARTED)  # always before EXITED
        await ranks
        for proc in run.procs:  # leave no grandchild behind
            self.runner.signal(proc, signal.SIGKILL)
        run.advance(RunPhase.EXITED)
        self.probe.release(run.gpus)
        self.runs.pop(run.job_id, None)
        code = core.launcher_exit_code(next((c for c in run.exit_codes if c != 0), 0),
                                       launcher=launch.is_launcher(run.alloc.command), stop_sent_at=run.stop_sent_at,
                                       manifest=self.runner.manifest(run) if run.stop_sent_at else None,
                                       refused=wk.plan_refused_generation(run.run_dir) == run.generation)
        self.log.info("exited", job_id=run.job_id, generation=run.generation, exit_code=code, reason=run.reason)
        await self._report_exit(run, code)
        self._dirty.set()

    async def _report_exit(self, run: Run, code: int) -> None:
        if await self.reports.publish(self.reports.build(run, RunReportKind.EXITED, exit_code=code)):
            self.runner.forget(run)  # reported: nothing left for a successor agent to do

    def _begin_stop(self, run: Run, reason: str, *, by_agent: bool) -> None:
        if run.stopping:
            return
        run.advance(RunPhase.STOPPING)
        run.stopped_by_agent = by_agent
        run.reason = reason
        self._spawn(terminate(self, run))

    # ------------------------------------------------------------ commands
    async def _on_stop(self, cmd: StopCommand) -> AgentReply:
        # Fence first: this generation (and older) must never start again here.
        self.launched[cmd.job_id] = max(self.launched.get(cmd.job_id, 0), cmd.generation)
        run = self.runs.get(cmd.job_id)
        if run is not None and run.generation > cmd.generation:
            return AgentReply(ok=False, node=self.node, error=f"stale: running generation {run.generation}")
        if run is not None:
            self._begin_stop(run, cmd.reason or "stop command", by_agent=True)
        return AgentReply(ok=True, node=self.node)

    async def _on_checkpoint(self, cmd: CheckpointCommand) -> AgentReply:
        run = self.runs.get(cmd.job_id)
        if run is None or run.generation != cmd.generation or run.stopping:
            return AgentReply(ok=False, node=self.node, error=f"{cmd.job_id}@{cmd.generation} is not running here")
        for proc in run.procs:
            if proc.returncode is None:
                self.runner.signal(proc, signal.SIGUSR1)
        return AgentReply(ok=True, node=self.node)

    async def _on_profile(self, cmd: ProfileCommand) -> ProfileResult:
        return await profiling.profile(self, cmd)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)


async def _bucket(js: Any, name: str, wait: float = 60.0) -> Any:
    from nats.js.errors import BucketNotFoundError

    deadline = time.monotonic() + wait
    while True:
        try:
            return await js.key_value(name)
        except BucketNotFoundError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"KV bucket {name} does not exist: is the control plane up?") from None
            get_logger().info("waiting for bucket", bucket=name)
            await asyncio.sleep(0.5)


async def _until_it_works(make: Any, what: str, wait: float = 60.0) -> Any:
    """``await make()``, again while the server does not answer (a cluster
    electing a new leader after a server died): a transient timeout must not
    end the agent."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    deadline = time.monotonic() + wait
    while True:
        try:
            return await make()
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the server did not answer for {wait:g} s") from exc
            get_logger().warning("retrying", what=what, error=type(exc).__name__)
            await asyncio.sleep(0.5)


def never_started(agent: "Agent", alloc: Allocation) -> None:
    """An allocation withdrawn before ``agent`` started it (its change and its withdrawal
    came in one batch, or a remade watch replayed both): nothing of it runs there, and
    only that agent can say so. Its end is reported at once (stopped on request, exit
    143, STARTED never sent), so a drain or a cancel waiting on the node ends now rather
    than at ``--drain-timeout``; the generation is fenced."""
    agent.launched[alloc.job_id] = alloc.generation
    run = agent._new_run(alloc)
    run.advance(RunPhase.EXITED)
    run.stopped_by_agent = True
    run.reason = "withdrawn before it started"
    agent.log.info("withdrawn before it started", job_id=alloc.job_id, generation=alloc.generation)
    agent._spawn(agent._report_exit(run, 143))


async def terminate(agent: "Agent", run: Run) -> None:
    """SIGTERM (checkpoint and exit), then SIGKILL after the grace period."""
    agent.log.info("stopping", job_id=run.job_id, generation=run.generation, reason=run.reason)
    run.stop_sent_at = time.time()
    for proc in run.procs:
        if proc.returncode is None:
            agent.runner.signal(proc, signal.SIGTERM)
    grace = run.alloc.grace if run.alloc.grace is not None else agent.grace  # the job's, bounded at submit
    try:
        await asyncio.wait_for(run.done.wait(), grace)
    except asyncio.TimeoutError:
        agent.log.warning("grace period over, killing", job_id=run.job_id, grace=grace)
        run.grace_expired = True
        for proc in run.procs:
            if proc.returncode is None:
                agent.runner.signal(proc, signal.SIGKILL)
