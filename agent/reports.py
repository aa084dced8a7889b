"""What an agent tells the optimizer about its runs: run reports on the
durable ``GS_REPORTS`` stream, each with a deterministic message id
(``<node>:<job>:<generation>:<kind>``), so a retry across a reconnect, or a
successor agent reporting a run its predecessor may already have reported,
is not applied twice.

- STARTED: the ranks run (always before EXITED).
- STEPPED: rank 0's progress shows its first step, with the restore and
  first-step times (the optimizer's ``job.switched`` cost by phase).
- EXITED: every rank ended, with the exit code, the checkpoint left (step and
  time from the manifest) and how far it had got.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from nats.js.api import Header

from gearshift.agent.core import Run
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import RunReport, RunReportKind


class Reporter:
    def __init__(self, js: Any, node: str, runner: Any, log: Any, closing: Callable[[], bool]):
        self.js = js
        self.node = node
        self.runner = runner
        self.log = log
        self.closing = closing  # a closing agent retries for 2 s, not 60

    def steps_done(self, run: Run, exit_code: int | None) -> int:
        """What the job has achieved: the checkpoint is what a restart resumes
        from; after a clean finish the last progress counts too."""
        manifest = self.runner.manifest(run)
        ckpt = int(manifest["step"]) if manifest and manifest.get("job_id") == run.job_id else None
        prog = self.runner.progress(run) or {}
        progress = int(prog.get("step", 0))
        if exit_code == 0:
            return max(ckpt or 0, progress)
        return ckpt if ckpt is not None else progress

    def build(self, run: Run, kind: RunReportKind, exit_code: int | None = None, **extra: Any) -> RunReport:
        exited = kind == RunReportKind.EXITED
        if exited:
            manifest = self.runner.manifest(run) or {}
            if manifest.get("job_id") == run.job_id and "step" in manifest:
                extra.update(checkpoint_step=int(manifest["step"]), checkpoint_at=manifest.get("wall_time"))
            prog = self.runner.progress(run) or {}
            extra.update(progress_step=int(prog.get("step", 0)), stop_sent_at=run.stop_sent_at,
                         grace_expired=run.grace_expired)
            if run.node_rank == 0 and prog.get("first_step_s") is not None:
                # also here: a STEPPED report may land after this one, or never
                extra.setdefault("start_step", int(prog.get("start_step") or 0))
                extra.setdefault("restore_s", prog.get("restore_s"))
                extra.setdefault("first_step_s", prog.get("first_step_s"))
        elif kind == RunReportKind.STARTED:
            extra.setdefault("launched_at", run.launched_at)
        return RunReport(
            job_id=run.job_id,
            generation=run.generation,
            node=self.node,
            kind=kind,
            ts=time.time(),
            rank0=run.node_rank == 0,
            steps_done=self.steps_done(run, exit_code) if exited else 0,
            exit_code=exit_code,
            stopped=exited and run.stopped_by_agent,
            message=run.reason if exited else "",
            **extra,
        )

    async def send(self, run: Run, kind: RunReportKind, exit_code: int | None = None, **extra: Any) -> None:
        await self.publish(self.build(run, kind, exit_code, **extra))

    def stepped(self, run: Run, prog: dict | None = None) -> RunReport | None:
        """The STEPPED report once rank 0's progress shows its first step;
        None if not due or already sent."""
        if run.stepped or run.node_rank != 0 or run.progress_file is None:
            return None
        prog = prog if prog is not None else self.runner.progress(run)
        if not prog or prog.get("first_step_s") is None:
            return None
        run.stepped = True
        return self.build(
            run, RunReportKind.STEPPED, launched_at=run.launched_at, start_step=int(prog.get("start_step") or 0),
            restore_s=prog.get("restore_s"), first_step_s=prog.get("first_step_s"),
        )

    async def publish(self, report: RunReport) -> bool:
        """Durable and deduplicated, so retrying across a reconnect is safe;
        False if it could not be published in time."""
        msg_id = f"{report.node}:{report.job_id}:{report.generation}:{report.kind.value}"
        subject = subj.run_report(report.node, report.job_id)
        delay = 0.2
        deadline = time.monotonic() + (2.0 if self.closing() else 60.0)
        while True:
            try:
                await self.js.publish(subject, codec.encode(report), headers={Header.MSG_ID: msg_id}, timeout=2)
                return True
            except Exception as exc:
                if time.monotonic() >= deadline:
                    self.log.error("run report lost", msg_id=msg_id, error=str(exc))
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
