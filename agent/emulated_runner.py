"""Ranks that run in-process, for the fleet emulator (``loadtest.fleet``).

The same contract as ``gearshift.agent.emulated_worker`` -- resume from the latest
manifest, checkpoint and exit 143 on SIGTERM, checkpoint on SIGUSR1, exit 0
when the last step is done, periodic checkpoints -- but without a process,
a file or a wake-up per step: progress is computed from the clock when it is
read, and a rank sleeps until its last step or a signal. Checkpoints live in
one ``CheckpointStore`` shared by every agent of the fleet, as shared storage
would be on a cluster.

Scripted checkpoint behaviour, from the job's env as the worker's own knobs:
``WORKER_CKPT_INTERVAL`` (seconds between periodic checkpoints, default 5;
each is in the store, with the time it was made, once anything reads the
manifest after it), and ``WORKER_IGNORE_SIGTERM=1`` (a rank that neither
checkpoints nor leaves on SIGTERM: only the SIGKILL at the grace ends it, and
it keeps only its last periodic checkpoint).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
import time
from pathlib import Path
from typing import Any

from gearshift.agent import launch
from gearshift.agent.worker import EXIT_CHECKPOINTED, EXIT_DONE

CKPT_INTERVAL_S = 5.0
_pids = itertools.count(1_000_000)


class CheckpointStore:
    """Manifests by checkpoint folder, and an event per folder set when done."""

    def __init__(self) -> None:
        self.manifests: dict[str, dict] = {}
        self.done: dict[str, asyncio.Event] = {}

    def latest(self, ckpt_dir: Path) -> dict | None:
        return self.manifests.get(str(ckpt_dir))

    def write(self, ckpt_dir: Path, wall_time: float | None = None, **manifest: Any) -> None:
        key = str(ckpt_dir)
        old = self.manifests.get(key)
        if old is not None and old.get("step", 0) > manifest["step"] and not manifest.get("done"):
            return  # never go back
        if old is not None and old.get("step", 0) == manifest["step"] and not manifest.get("done") \
                and wall_time is not None:
            return  # a periodic checkpoint already there
        self.manifests[key] = {**manifest, "wall_time": time.time() if wall_time is None else wall_time}
        if manifest.get("done"):
            self.done_event(ckpt_dir).set()

    def done_event(self, ckpt_dir: Path) -> asyncio.Event:
        return self.done.setdefault(str(ckpt_dir), asyncio.Event())


class EmulatedRank:
    def __init__(self, run: Any, spec: launch.RankSpec, env: dict[str, str], store: CheckpointStore):
        self.pid = next(_pids)
        self.returncode: int | None = None
        self.run = run
        self.rank = spec.rank
        self.store = store
        self.ckpt_dir = run.ckpt_dir
        self.job_id = run.alloc.job_id
        self.generation = run.alloc.generation
        self.steps = run.alloc.steps
        self.step_time = max(1e-6, float(env.get("GEARSHIFT_STEP_TIME") or run.alloc.step_time or 0.1))
        self.profile_steps = int(env.get("GEARSHIFT_PROFILE_STEPS") or 0)
        self.ckpt_interval = float(env.get("WORKER_CKPT_INTERVAL") or CKPT_INTERVAL_S)
        self.ignore_sigterm = env.get("WORKER_IGNORE_SIGTERM") == "1"
        self.launched_at = time.time()
        manifest = store.latest(self.ckpt_dir) or {}
        self.start_step = int(manifest.get("step", 0)) if manifest.get("job_id") == self.job_id else 0
        self.already_done = bool(manifest.get("done"))
        self.t0 = time.monotonic()
        self.ended_step: int | None = None
        self._signal: asyncio.Queue[int] = asyncio.Queue()
        self._task = asyncio.create_task(self._main())

    # progress from the clock
    def step(self) -> int:
        if self.ended_step is not None:
            return self.ended_step
        return min(self.steps, self.start_step + int((time.monotonic() - self.t0) / self.step_time))

    def progress(self) -> dict:
        step = self.step()
        if self.profile_steps:
            if self.returncode != EXIT_DONE:
                return {"step": 0}
            ms = self.step_time * 1e3
            return {"step": self.profile_steps, "profiled": self.profile_steps, "phases": {
                "forward": 0.3 * ms, "backward": 0.6 * ms, "optimizer": 0.1 * ms, "iteration": ms}}
        out: dict[str, Any] = {"step": step, "start_step": self.start_step, "restore_s": 0.0,
                               "samples_per_s": self.run.alloc.global_batch / self.step_time}
        if step > self.start_step:
            out["first_step_s"] = self.step_time
        return out

    def _checkpoint(self, step: int, done: bool = False, wall_time: float | None = None) -> None:
        self.store.write(self.ckpt_dir, job_id=self.job_id, generation=self.generation, step=step, done=done,
                         wall_time=wall_time)

    def periodic_checkpoint(self) -> None:
        """What the periodic checkpoints would have saved by now, stamped with
        the time each was made."""
        if self.returncode is not None or self.rank != 0 or self.profile_steps:
            return
        elapsed = time.monotonic() - self.t0
        at = math.floor(elapsed / self.ckpt_interval) * self.ckpt_interval
        step = min(self.steps, self.start_step + int(at / self.step_time))
        if step > self.start_step:
            self._checkpoint(step, wall_time=self.launched_at + at)

    async def _main(self) -> None:
        if self.rank != 0:
            await self._follow()
            return
        if self.profile_steps:
            await self._until(self.profile_steps * self.step_time, on_term=EXIT_CHECKPOINTED)
            return
        if self.already_done:
            self.returncode = EXIT_DONE
            return
        left = max(0, self.steps - self.start_step) * self.step_time
        await self._until(left, on_term=EXIT_CHECKPOINTED)

    async def _until(self, seconds: float, on_term: int) -> None:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.ended_step = self.steps
                if not self.profile_steps:
                    self._checkpoint(self.steps, done=True)
                self.returncode = EXIT_DONE
                return
            try:
                sig = await asyncio.wait_for(self._signal.get(), left)
            except asyncio.TimeoutError:
                continue
            if sig == signal.SIGUSR1:
                self._checkpoint(self.step())
                continue
            if sig != signal.SIGKILL and self.ignore_sigterm:
                continue  # scripted: deaf to SIGTERM, the grace runs out
            if sig == signal.SIGKILL:
                self.periodic_checkpoint()
                self.ended_step = self.step()
                self.returncode = -signal.SIGKILL
            else:  # SIGTERM: checkpoint at the step reached, then leave
                step = self.ended_step = self.step()
                self._checkpoint(step)
                self.returncode = on_term
            return

    async def _follow(self) -> None:
        done = self.store.done_event(self.ckpt_dir)
        sig_w = asyncio.ensure_future(self._signal.get())
        done_w = asyncio.ensure_future(done.wait())
        await asyncio.wait([sig_w, done_w], return_when=asyncio.FIRST_COMPLETED)
        if done_w.done():
            sig_w.cancel()
            self.returncode = EXIT_DONE
        else:
            done_w.cancel()
            self.returncode = -signal.SIGKILL if sig_w.result() == signal.SIGKILL else EXIT_CHECKPOINTED

    async def wait(self) -> int:
        await asyncio.shield(self._task)
        assert self.returncode is not None
        return self.returncode

    def send(self, sig: int) -> None:
        if self.returncode is None:
            self._signal.put_nowait(sig)


class EmulatedRunner:
    """The runner of the fleet emulator: ranks are tasks of this process."""

    def __init__(self, store: CheckpointStore | None = None):
        self.store = store or CheckpointStore()
        self.ranks: dict[tuple[str, int], EmulatedRank] = {}  # (job, generation) -> rank 0 on this node

    async def start_rank(self, run: Any, spec: launch.RankSpec, env: dict[str, str]) -> EmulatedRank:
        rank = EmulatedRank(run, spec, env, self.store)
        if spec.rank == 0:
            run.emulated_rank0 = rank
        return rank

    def signal(self, rank: Any, sig: int) -> None:
        rank.send(sig)

    def progress(self, run: Any) -> dict | None:
        rank = getattr(run, "emulated_rank0", None)
        return None if rank is None else rank.progress()

    def manifest(self, run: Any) -> dict | None:
        rank = getattr(run, "emulated_rank0", None)
        if rank is not None:
            rank.periodic_checkpoint()  # the checkpoints made since it was last read
        return self.store.latest(run.ckpt_dir)

    async def reap(self, run_root: Path, grace: float, log: Any) -> list:
        return []  # nothing outlives the process

    def forget(self, run: Any) -> None:
        pass

    async def open(self, slots: int) -> None:
        pass

    def launched(self, run: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def kill_all(self, runs: Any) -> None:
        """An agent killed outright: every rank dies without checkpointing
        beyond the periodic ones."""
        for run in runs:
            for rank in run.procs:
                rank.send(signal.SIGKILL)
