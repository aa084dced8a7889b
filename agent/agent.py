"""The per-node agent: makes the job processes on this node match ``gs_alloc``.

Level-triggered: a KV watch keeps ``desired`` (the allocations that place a
job on this node) up to date, and every change wakes one reconcile pass that
compares it with ``runs`` (what this agent started). A pass never waits for a
process: stops run as their own tasks and, when a process ends, its
supervisor wakes the reconciler again, so a job whose old generation is still
stopping gets its new generation on the pass after the old one is gone.

Fencing: ``launched`` holds the highest generation this agent started (or
was told to stop) per job; a generation at or below it is never launched, so a
stale allocation, a replay of an old value, or one that already ran to its
end cannot start anything.

Plan switches (checkpoint-restore): the optimizer withdraws generation g's
allocation; ``_begin_stop`` asks the run to checkpoint and leave (SIGTERM to
each rank's process group, ``grace`` seconds, then SIGKILL); ``_supervise``
learns how it ended and reports EXITED with the checkpoint it left (step and
time from the manifest) and how far it had got. The optimizer writes g+1
only once every node of g reported EXITED (gang barrier), so all ranks stop
before any restarts; the agent then launches g+1, which resumes from the
manifest, and reports STARTED and, once rank 0's progress file shows its
first step, STEPPED with the restore and first-step times. The optimizer
turns those timestamps into a ``job.switched`` event with the cost by phase.

Commands: ``stop`` (fence a generation), ``checkpoint`` (SIGUSR1: checkpoint
at the next agreed step and go on), ``profile`` (run a plan for a few steps
on free GPUs, reply with its per-phase times; those GPUs show as
``reserved`` in the heartbeats so the optimizer does not hand them out).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import Header

from bus_schema.gputypes import node_gpu_type
from bus_schema import codec, subjects as subj
from bus_schema.messages import (
    AgentReply,
    Allocation,
    CheckpointCommand,
    JobProgress,
    NodePlacement,
    NodeReport,
    ProfileCommand,
    ProfileResult,
    RunReport,
    RunReportKind,
    StopCommand,
)
from services import observe
from bus_schema.ops import LogsRequest
from services.auth_alloc import node_alloc_watch
from services.runtime import VERSION, Endpoint, get_logger, serve

from . import core, launch, worker as wk
from .logs import read_rank_logs
from .warm import WarmPool
from .probe import GpuProbe
from .runner import Runner, SubprocessRunner, _die_with_agent

DEFAULT_GRACE_S = 10.0


@dataclass
class Run:
    """One job@generation on this node: its processes and how it is ending."""

    alloc: Allocation
    node_rank: int
    gpus: list[int]
    run_dir: Path
    ckpt_dir: Path
    procs: list[Any] = field(default_factory=list)  # runner.Rank handles
    progress_file: Path | None = None  # global rank 0's, when it runs here
    stopping: bool = False  # SIGTERM sent (by the agent, or after a rank failed)
    stopped_by_agent: bool = False
    reason: str = ""
    exit_codes: list[int] = field(default_factory=list)  # in the order the ranks ended
    done: asyncio.Event = field(default_factory=asyncio.Event)
    launched_at: float | None = None
    stop_sent_at: float | None = None
    stepped: bool = False  # STEPPED reported

    @property
    def job_id(self) -> str:
        return self.alloc.job_id

    @property
    def generation(self) -> int:
        return self.alloc.generation


class Agent:
    def __init__(
        self,
        nc: NATS,
        node: str,
        probe: GpuProbe,
        workdir: str | os.PathLike,
        *,
        cpus: int | None = None,
        heartbeat: float = 1.0,
        grace: float = DEFAULT_GRACE_S,
        address: str = "127.0.0.1",
        progress_interval: float = 1.0,
        ckpt_root: str | os.PathLike | None = None,
        runner: Runner | None = None,
        alloc_watch: Any = None,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.node = subj.token(node)
        self.probe = probe
        self.workdir = Path(workdir)
        # Checkpoints must outlive a move to another node: on a cluster this is
        # shared storage, in `gearshift up` one folder for all agents.
        self.ckpt_root = Path(ckpt_root) if ckpt_root is not None else self.workdir / "ckpt"
        self.cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        self.heartbeat = heartbeat
        self.grace = grace
        self.address = address
        self.progress_interval = progress_interval
        self.log = get_logger(agent=self.node)
        # how ranks run: real processes (with warm workers for the next generation,
        # agent/warm.py; $GEARSHIFT_WARM: modules to keep warm from the start), or
        # in-process for the fleet emulator
        self.warm: WarmPool | None = None
        if runner is None:
            self.warm = WarmPool(1, spawn=self._spawn_warm, log=self.log, status_file=self.workdir / "warm.json",
                                 prewarm=[m for m in os.environ.get("GEARSHIFT_WARM", "").split(",") if m])
            runner = SubprocessRunner(self.warm)
        self.runner: Runner = runner
        self._alloc_watch = alloc_watch or node_alloc_watch  # (js, node) -> watch of this node's allocations
        self.desired: dict[str, Allocation] = {}
        self.runs: dict[str, Run] = {}
        self.launched: dict[str, int] = {}
        self.started_at = time.time()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()  # stops and supervisors
        self._closing = False
        self._watcher: Any = None
        self._svc: Any = None
        self._alloc_kv: Any = None
        self._nodes_kv: Any = None
        self.reserved: set[int] = set()  # GPUs of profiling runs
        self._gpu_count = 0

    # ------------------------------------------------------------ life cycle
    async def start(self) -> "Agent":
        await self.probe.open()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The buckets belong to the control plane; an agent started first waits for them.
        self._alloc_kv = await _bucket(self.js, subj.ALLOC_BUCKET)
        self._nodes_kv = await _bucket(self.js, subj.NODES_BUCKET)
        await self._beat()  # capacity visible before the first allocation can arrive
        if self.warm is not None:
            self.warm.size = max(1, len(await self.probe.sample()))
            self._spawn(self.warm.refill())
        self._svc = await serve(
            self.nc,
            f"agent-{self.node}",
            [
                Endpoint("stop", subj.agent_command(self.node, "stop"), StopCommand, self._on_stop),
                Endpoint("checkpoint", subj.agent_command(self.node, "checkpoint"), CheckpointCommand,
                         self._on_checkpoint),
                Endpoint("profile", subj.agent_command(self.node, "profile"), ProfileCommand, self._on_profile),
                Endpoint("logs", subj.agent_command(self.node, "logs"), LogsRequest,
                         lambda req: asyncio.to_thread(read_rank_logs, self.workdir / "run", self.node, req)),
            ],
            description=f"gearshift agent on {self.node}",
            metadata={"node": self.node},
        )
        # A predecessor killed with SIGKILL left its job processes running: stop
        # them before launching anything, or one generation would run twice.
        await self.runner.reap(self.workdir / "run", self.grace, self.log)
        # only this node's allocations (<node>.<job> keys): see services.auth_alloc
        self._watcher = await self._alloc_watch(self.js, self.node)
        self._tasks = [
            asyncio.create_task(self._watch_loop(), name="agent-watch"),
            asyncio.create_task(self._reconcile_loop(), name="agent-reconcile"),
            asyncio.create_task(self._heartbeat_loop(), name="agent-heartbeat"),
            asyncio.create_task(self._progress_loop(), name="agent-progress"),
        ]
        self.log.info("agent started", probe=self.probe.kind, gpus=len(await self.probe.sample()), cpus=self.cpus)
        return self

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
        if self._tasks:  # absent when start() failed half-way
            self._tasks[0].cancel()
            self._dirty.set()  # the reconciler finishes its pass (a launch in flight included) and ends
            await asyncio.gather(self._tasks[1], return_exceptions=True)
        if self.warm is not None:
            self.warm.close()
        for run in list(self.runs.values()):
            self._begin_stop(run, "agent stopping", by_agent=True)
        while self._side_tasks:  # supervisors publish the EXITED reports
            await asyncio.gather(*list(self._side_tasks), return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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

    # ------------------------------------------------------------ desired state
    async def _watch_loop(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # "initial values done" marker
                continue
            self._apply_entry(entry.key, entry.value, entry.operation)

    def _apply_entry(self, key: str, value: bytes | None, op: str | None) -> None:
        if op in ("DEL", "PURGE") or not value:
            if self.desired.pop(key, None) is not None:
                self._dirty.set()
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
        while not self._closing:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._reconcile_once()
            except Exception:  # one bad allocation must not stop the agent
                self.log.exception("reconcile failed")

    async def _reconcile_once(self) -> None:
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

    # ------------------------------------------------------------ launching
    async def _launch(self, alloc: Allocation) -> None:
        observe.reconcile_lag("launch", alloc)
        self.launched[alloc.job_id] = alloc.generation
        nodes = alloc.nodes()
        node_rank = nodes.index(self.node)
        mine = alloc.placement[node_rank]
        run = Run(
            alloc=alloc,
            node_rank=node_rank,
            gpus=list(mine.gpus),
            run_dir=self.workdir / "run" / alloc.job_id / f"g{alloc.generation}",
            ckpt_dir=self.ckpt_root / alloc.job_id,
        )
        log = self.log.bind(job_id=alloc.job_id, generation=alloc.generation)
        self.runs[alloc.job_id] = run  # visible to a stop command while it launches
        try:
            await self._spawn_ranks(run, nodes[0])
        except Exception as exc:
            log.error("launch failed", error=str(exc))
            for proc in run.procs:
                self.runner.signal(proc, signal.SIGKILL)
            self.probe.release(run.gpus)
            self.runs.pop(alloc.job_id, None)
            run.done.set()
            self._spawn(self._report_launch_failure(run, exc))
            return
        if run.stopping:  # stopped while launching: reach the ranks started since
            for proc in run.procs:
                self.runner.signal(proc, signal.SIGTERM)
        log.info("launched", pids=[p.pid for p in run.procs], gpus=run.gpus, plan=alloc.plan.label())
        self._spawn(self._supervise(run))

    async def _spawn_ranks(self, run: Run, first_node: str, extra_env: dict[str, str] | None = None) -> None:
        alloc = run.alloc
        master = await self._master_addr(first_node)
        run.launched_at = time.time()
        cmd = launch.command(alloc)
        for spec in launch.rank_specs(alloc, self.node):
            progress_file = run.run_dir / f"progress-{spec.rank}.json"
            if spec.rank == 0:
                run.progress_file = progress_file
            env = launch.environment(
                alloc, spec, node=self.node, master_addr=master, ckpt_dir=run.ckpt_dir, progress_file=progress_file,
                launched_at=run.launched_at,
            )
            env.update(extra_env or {})
            proc = await self.runner.start_rank(run, spec, env)  # a warm worker if one is ready (SubprocessRunner)
            run.procs.append(proc)
            self.probe.claim(list(spec.gpus), [proc.pid])
        if not self._closing and self.warm is not None:
            self._spawn(self._refill_warm(run))  # ready for the next generation

    async def _refill_warm(self, run: Run, wait: float = 60.0) -> None:
        """Start warm workers once ``run`` made its first step (or ended): not
        while its own start-up needs the CPUs."""
        deadline = time.monotonic() + wait
        while not self._closing and not run.done.is_set() and time.monotonic() < deadline:
            prog = wk.read_json(run.progress_file or next(run.run_dir.glob("progress-*.json"), None)) or {}
            if prog.get("first_step_s") is not None or prog.get("phases"):
                break
            await asyncio.sleep(0.2)
        if not self._closing:
            await self.warm.refill()

    async def _spawn_warm(self, argv: list[str]) -> asyncio.subprocess.Process:
        with open(self.workdir / "warm.log", "ab") as out:
            return await asyncio.create_subprocess_exec(
                *argv, cwd=self.workdir, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=out,
                start_new_session=True, preexec_fn=_die_with_agent)

    async def _master_addr(self, first_node: str) -> str:
        if first_node == self.node:
            return self.address
        try:
            entry = await self._nodes_kv.get(first_node)
            addr = codec.decode(entry.value, NodeReport).address
        except Exception:
            addr = ""
        return addr or "127.0.0.1"

    # ------------------------------------------------------------ running and ending
    async def _supervise(self, run: Run) -> None:
        async def wait_rank(i: int, proc: Any) -> None:
            code = launch.exit_status(await proc.wait())
            run.exit_codes.append(code)
            if code != 0 and not run.stopping:
                # torchrun semantics: one rank failing ends the others
                self._begin_stop(run, f"local rank {i} exited with code {code}", by_agent=False)

        ranks = asyncio.gather(*(wait_rank(i, p) for i, p in enumerate(run.procs)))
        await self._report(run, RunReportKind.STARTED)  # always before EXITED
        await ranks
        for proc in run.procs:  # leave no grandchild behind
            self.runner.signal(proc, signal.SIGKILL)
        run.done.set()
        self.probe.release(run.gpus)
        self.runs.pop(run.job_id, None)
        code = next((c for c in run.exit_codes if c != 0), 0)
        self.log.info("exited", job_id=run.job_id, generation=run.generation, exit_code=code, reason=run.reason)
        await self._report(run, RunReportKind.EXITED, exit_code=code)
        self._dirty.set()

    def _begin_stop(self, run: Run, reason: str, *, by_agent: bool) -> None:
        if run.stopping:
            return
        run.stopping = True
        run.stopped_by_agent = by_agent
        run.reason = reason
        self._spawn(self._terminate(run))

    async def _terminate(self, run: Run) -> None:
        """SIGTERM (checkpoint and exit), then SIGKILL after the grace period."""
        self.log.info("stopping", job_id=run.job_id, generation=run.generation, reason=run.reason)
        run.stop_sent_at = time.time()
        for proc in run.procs:
            if proc.returncode is None:
                self.runner.signal(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(run.done.wait(), self.grace)
        except asyncio.TimeoutError:
            self.log.warning("grace period over, killing", job_id=run.job_id, grace=self.grace)
            for proc in run.procs:
                if proc.returncode is None:
                    self.runner.signal(proc, signal.SIGKILL)

    def _steps_done(self, run: Run, exit_code: int | None) -> int:
        """What the job has achieved: the checkpoint is what a restart resumes
        from; after a clean finish the last progress counts too."""
        manifest = self.runner.manifest(run)
        ckpt = int(manifest["step"]) if manifest and manifest.get("job_id") == run.job_id else None
        prog = self.runner.progress(run) or {}
        progress = int(prog.get("step", 0))
        if exit_code == 0:
            return max(ckpt or 0, progress)
        return ckpt if ckpt is not None else progress

    async def _report(self, run: Run, kind: RunReportKind, exit_code: int | None = None, **extra: Any) -> None:
        exited = kind == RunReportKind.EXITED
        if exited:
            manifest = self.runner.manifest(run) or {}
            if manifest.get("job_id") == run.job_id and "step" in manifest:
                extra.update(checkpoint_step=int(manifest["step"]), checkpoint_at=manifest.get("wall_time"))
            prog = self.runner.progress(run) or {}
            extra.update(progress_step=int(prog.get("step", 0)), stop_sent_at=run.stop_sent_at)
            if run.node_rank == 0 and prog.get("first_step_s") is not None:
                # also here: a STEPPED report may land after this one, or never
                extra.setdefault("start_step", int(prog.get("start_step") or 0))
                extra.setdefault("restore_s", prog.get("restore_s"))
                extra.setdefault("first_step_s", prog.get("first_step_s"))
        elif kind == RunReportKind.STARTED:
            extra.setdefault("launched_at", run.launched_at)
        report = RunReport(
            job_id=run.job_id,
            generation=run.generation,
            node=self.node,
            kind=kind,
            ts=time.time(),
            rank0=run.node_rank == 0,
            steps_done=self._steps_done(run, exit_code) if exited else 0,
            exit_code=exit_code,
            stopped=exited and run.stopped_by_agent,
            message=run.reason if exited else "",
            **extra,
        )
        await self._publish_report(report)

    async def _report_launch_failure(self, run: Run, exc: Exception) -> None:
        run.reason = f"launch failed: {exc}"
        await self._report(run, RunReportKind.EXITED, exit_code=127)

    async def _publish_report(self, report: RunReport) -> None:
        """Durable and deduplicated, so retrying across a reconnect is safe."""
        msg_id = f"{report.node}:{report.job_id}:{report.generation}:{report.kind.value}"
        subject = subj.run_report(report.node, report.job_id)
        delay = 0.2
        deadline = time.monotonic() + (2.0 if self._closing else 60.0)
        while True:
            try:
                await self.js.publish(subject, codec.encode(report), headers={Header.MSG_ID: msg_id}, timeout=2)
                return
            except Exception as exc:
                if time.monotonic() >= deadline:
                    self.log.error("run report lost", msg_id=msg_id, error=str(exc))
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------ periodic
    async def _heartbeat_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disconnected: the next beat tries again
                if not failing:  # one line per outage, not one per beat
                    self.log.warning("heartbeat failed", error=str(exc) or type(exc).__name__)
                failing = True
            else:
                if failing:
                    self.log.info("heartbeat restored")
                failing = False

    async def node_report(self) -> NodeReport:
        mem_total, mem_used = _host_memory()
        gpus = await self.probe.sample()
        return NodeReport(
            node=self.node,
            ts=time.time(),
            gpus=gpus,
            gpu_type=node_gpu_type(gpus),
            cpus=self.cpus,
            memory_total=mem_total,
            memory_used=mem_used,
            probe=self.probe.kind,
            running=[f"{r.job_id}@{r.generation}" for r in self.runs.values()],
            reserved=sorted(self.reserved),
            agent_version=VERSION,
            started_at=self.started_at,
            address=self.address,
        )

    async def _beat(self) -> None:
        report = await self.node_report()
        observe.gpu_report(report)
        data = codec.encode(report)
        await self.nc.publish(subj.node_heartbeat(self.node), data)
        await self._nodes_kv.put(self.node, data)

    def _stepped_report(self, run: Run, prog: dict | None = None):
        """The STEPPED report (restore and first-step times) once rank 0's
        progress shows its first step; None if not due or already sent."""
        if run.stepped or run.node_rank != 0 or run.progress_file is None:
            return None
        prog = prog if prog is not None else self.runner.progress(run)
        if not prog or prog.get("first_step_s") is None:
            return None
        run.stepped = True
        return self._report(
            run, RunReportKind.STEPPED, launched_at=run.launched_at, start_step=int(prog.get("start_step") or 0),
            restore_s=prog.get("restore_s"), first_step_s=prog.get("first_step_s"),
        )

    async def _progress_loop(self) -> None:
        last: dict[tuple[str, int], tuple[int, float]] = {}
        while True:
            await asyncio.sleep(self.progress_interval)
            for run in list(self.runs.values()):
                if run.node_rank != 0 or run.progress_file is None:
                    continue
                prog = self.runner.progress(run)
                if prog is None:
                    continue
                stepped = self._stepped_report(run, prog)
                if stepped is not None:
                    self._spawn(stepped)
                step, now = int(prog.get("step", 0)), time.time()
                rate = prog.get("samples_per_s")
                key = (run.job_id, run.generation)
                if rate is None and key in last and now > last[key][1]:
                    prev_step, prev_ts = last[key]
                    rate = max(0, step - prev_step) * run.alloc.global_batch / (now - prev_ts)
                last[key] = (step, now)
                msg = JobProgress(
                    job_id=run.job_id,
                    generation=run.generation,
                    node=self.node,
                    ts=now,
                    steps_done=step,
                    steps=run.alloc.steps,
                    samples_per_s=float(rate or 0.0),
                    loss=prog.get("loss"),
                )
                try:
                    await self.nc.publish(subj.job_progress(run.job_id), codec.encode(msg))
                except Exception as exc:
                    self.log.warning("progress publish failed", error=str(exc))
            live = {(r.job_id, r.generation) for r in self.runs.values()}
            for key in list(last):
                if key not in live:
                    del last[key]

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

    def _free_gpus(self) -> list[int]:
        """GPU indices no run, allocation or profiling run of this node uses."""
        busy = set(self.reserved)
        for run in self.runs.values():
            busy.update(run.gpus)
        for a in self.desired.values():
            for p in a.placement:
                if p.node == self.node:
                    busy.update(p.gpus)
        return [i for i in range(self._gpu_count) if i not in busy]

    async def _on_profile(self, cmd: ProfileCommand) -> ProfileResult:
        """Run one plan for a few steps on GPUs no allocation uses; reply with
        the per-phase means (ms per step) from rank 0's progress file."""
        need = cmd.plan.dp * cmd.plan.tp * cmd.plan.pp
        gpus_now = await self.probe.sample()
        self._gpu_count = len(gpus_now)
        free = [i for i in self._free_gpus() if gpus_now[i].healthy]
        if len(free) < need:
            return ProfileResult(ok=False, node=self.node, plan=cmd.plan,
                                 error=f"{need} GPUs wanted, {len(free)} free on {self.node}")
        gpus = free[:need]
        self.reserved.update(gpus)
        alloc = Allocation(
            job_id=cmd.run_id, generation=1, plan=cmd.plan, placement=[NodePlacement(node=self.node, gpus=gpus)],
            command=cmd.command, env=cmd.env, step_time=cmd.step_time, steps=10**9, global_batch=cmd.global_batch,
        )
        run = Run(alloc=alloc, node_rank=0, gpus=gpus, run_dir=self.workdir / "profile" / cmd.run_id,
                  ckpt_dir=self.workdir / "profile" / cmd.run_id / "ckpt")
        t0 = time.monotonic()
        log = self.log.bind(profile=cmd.run_id, plan=cmd.plan.label())
        try:
            await self._beat()  # the reservation is visible before the run starts
            try:
                await self._spawn_ranks(run, self.node, {"GEARSHIFT_PROFILE_STEPS": str(cmd.steps)})
            except (OSError, ValueError) as exc:  # no such program, name too long, NUL byte (tests/test_fuzz.py)
                return ProfileResult(ok=False, node=self.node, plan=cmd.plan, gpus=gpus, error=f"launch failed: {exc}",
                                     wall_s=time.monotonic() - t0)
            waits = [asyncio.create_task(p.wait()) for p in run.procs]
            done, pending = await asyncio.wait(waits, timeout=cmd.timeout)
            codes = [launch.exit_status(p.returncode) for p in run.procs if p.returncode is not None]
            if pending or any(codes):
                why = "timed out" if pending else f"exit codes {codes}"
                log.warning("profiling run failed", error=why)
                return ProfileResult(ok=False, node=self.node, plan=cmd.plan, gpus=gpus, error=why,
                                     wall_s=time.monotonic() - t0)
            prog = self.runner.progress(run) or {}
            ph = prog.get("phases") or {}
            if "iteration" not in ph:
                return ProfileResult(ok=False, node=self.node, plan=cmd.plan, gpus=gpus,
                                     error="the run reported no phase times", wall_s=time.monotonic() - t0)
            log.info("profiled", iter_ms=round(ph["iteration"], 2))
            return ProfileResult(
                ok=True, node=self.node, plan=cmd.plan, gpus=gpus, steps=int(prog.get("profiled") or cmd.steps),
                iter_ms=ph.get("iteration"), fwd_ms=ph.get("forward"), bwd_ms=ph.get("backward"),
                opt_ms=ph.get("optimizer"), wall_s=time.monotonic() - t0,
            )
        finally:
            for proc in run.procs:
                self.runner.signal(proc, signal.SIGKILL)
            for proc in run.procs:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    pass
            self.probe.release(gpus)
            self.reserved.difference_update(gpus)
            self._dirty.set()

    # ------------------------------------------------------------ helpers
    def _spawn(self, coro) -> None:
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


def _host_memory() -> tuple[int, int]:
    """(total, used) host bytes from /proc/meminfo; zeros where it is absent."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
        total = info.get("MemTotal", 0)
        return total, total - info.get("MemAvailable", total)
    except (OSError, ValueError, IndexError):
        return 0, 0



# ------------------------------------------------------------------ entry point
def _bytes(text: str) -> int:
    """``85899345920``, ``80GiB``, ``80G`` or ``512MiB`` -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_args(argv: list[str] | None):
    import argparse
    import socket
    import tempfile

    p = argparse.ArgumentParser(prog="python -m agent", description="gearshift node agent")
    p.add_argument("--server", default=None, help="NATS URL (default: $GEARSHIFT_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--node", default=socket.gethostname().split(".")[0].replace("_", "-"), help="node name")
    p.add_argument("--fake-gpus", type=int, default=None, metavar="N", help="emulate N GPUs instead of NVML")
    p.add_argument("--gpu-memory", type=_bytes, default=80 * 2**30, help="memory per fake GPU (e.g. 80GiB)")
    p.add_argument("--gpu-name", default="Fake GPU",
                   help="name of the fake GPUs, as NVML would say it; its type (e.g. 'NVIDIA A100-SXM4-80GB' "
                        "-> a100) is the node's GPU type")
    p.add_argument("--cpus", type=int, default=None, help="CPUs to offer (default: all)")
    p.add_argument("--workdir", default=None, help="run and checkpoint directory")
    p.add_argument("--ckpt-root", default=None, help="checkpoint root shared by all nodes (default: WORKDIR/ckpt)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--address", default="127.0.0.1", help="address other nodes use to reach this one")
    from services.config import AgentConfig, parse_args as parse_config

    args = parse_config(p, AgentConfig, argv)  # --config FILE, GEARSHIFT_AGENT_<FIELD>
    args.node = subj.token(args.node) if args.node else "node"
    if args.workdir is None:
        args.workdir = str(Path(tempfile.gettempdir()) / f"gearshift-agent-{args.node}")
    return args


async def run_agent(args, stop: asyncio.Event) -> int:
    from services.runtime import ServerUnavailable, connect

    from .probe import FakeProbe, NoGpuDriver, NvmlProbe

    log = get_logger(agent=args.node)
    if args.fake_gpus is not None:
        probe: GpuProbe = FakeProbe(args.fake_gpus, args.gpu_memory, args.gpu_name, node=args.node)
    else:
        probe = NvmlProbe()
        try:
            await probe.open()  # before connecting: refuse early and in one line
        except NoGpuDriver as exc:
            log.error(f"no usable NVIDIA driver ({exc}); refusing to start: pass --fake-gpus N to emulate GPUs")
            return 2
        for note in probe.notes:  # devices skipped (cgroup, CUDA_VISIBLE_DEVICES), XIDs not watchable
            log.warning("gpu probe: " + note)
    try:
        nc = await connect(args.server, name=f"agent-{args.node}")
    except ServerUnavailable as exc:
        log.error(str(exc))
        await probe.close()
        return 3
    agent = Agent(
        nc, args.node, probe, args.workdir,
        cpus=args.cpus, heartbeat=args.heartbeat, grace=args.grace, address=args.address, ckpt_root=args.ckpt_root,
    )
    obs = None
    try:
        obs = await observe.serve_http(f"agent-{args.node}", "agent", nc, lambda: {"node": args.node})
        await agent.start()
        obs.set_ready()
        await stop.wait()
    except observe.MetricsPortBusy as exc:
        log.error(str(exc))
        return 4
    finally:
        await agent.stop()
        if obs is not None:
            await obs.close()
        await nc.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.runtime import run_service

    args = parse_args(argv)
    rc = 0

    async def body(stop: asyncio.Event) -> None:
        nonlocal rc
        rc = await run_agent(args, stop)

    run_service(body)
    return rc
