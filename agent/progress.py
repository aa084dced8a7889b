"""Job progress: every ``interval`` the agent of each job's rank 0 publishes
``JobProgress`` (steps, samples/s, loss) on core NATS -- lossy by design, the
next one replaces it -- and, once the first step shows, the run's STEPPED
report (durable, through ``Reporter``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from gearshift.agent.core import Run
from gearshift.agent.reports import Reporter
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobProgress


class ProgressPublisher:
    def __init__(self, nc: Any, node: str, runner: Any, reporter: Reporter, runs: Mapping[str, Run],
                 spawn: Callable[[Any], None], log: Any, interval: float):
        self.nc = nc
        self.node = node
        self.runner = runner
        self.reporter = reporter
        self.runs = runs  # the agent's, live
        self.spawn = spawn
        self.log = log
        self.interval = interval
        self._last: dict[tuple[str, int], tuple[int, float]] = {}  # (job, generation) -> (step, time)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.once()

    async def once(self) -> None:
        for run in list(self.runs.values()):
            if run.node_rank != 0 or run.progress_file is None:
                continue
            prog = self.runner.progress(run)
            if prog is None:
                continue
            stepped = self.reporter.stepped(run, prog)
            if stepped is not None:
                self.spawn(self.reporter.publish(stepped))
            msg = self.message(run, prog, time.time())
            try:
                await self.nc.publish(subj.job_progress(run.job_id), codec.encode(msg))
            except Exception as exc:
                self.log.warning("progress publish failed", error=str(exc))
        live = {(r.job_id, r.generation) for r in self.runs.values()}
        for key in [k for k in self._last if k not in live]:
            del self._last[key]

    def message(self, run: Run, prog: dict, now: float) -> JobProgress:
        """The progress line; samples/s from the worker, else from the steps
        made since the last line."""
        step = int(prog.get("step", 0))
        rate = prog.get("samples_per_s")
        key = (run.job_id, run.generation)
        if rate is None and key in self._last and now > self._last[key][1]:
            prev_step, prev_ts = self._last[key]
            rate = max(0, step - prev_step) * run.alloc.global_batch / (now - prev_ts)
        self._last[key] = (step, now)
        manifest = self.runner.manifest(run) or {}  # each checkpoint's step and time, as it is made
        ours = manifest.get("job_id") == run.job_id and "step" in manifest
        return JobProgress(
            job_id=run.job_id, generation=run.generation, node=self.node, ts=now, steps_done=step,
            steps=run.alloc.steps, samples_per_s=float(rate or 0.0), loss=prog.get("loss"),
            checkpoint_step=int(manifest["step"]) if ours else None,
            checkpoint_at=manifest.get("wall_time") if ours else None,
        )
