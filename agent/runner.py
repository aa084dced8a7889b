"""How an agent runs a job's ranks: the runner interface and the subprocess
runner (real processes, one process group each). ``agent.emulated_runner``
runs them in-process for the fleet emulator; the agent cannot tell.

A rank is a handle with ``pid``, ``returncode`` and ``wait()``; the runner
signals it (SIGTERM: checkpoint and leave; SIGUSR1: checkpoint and go on;
SIGKILL), and reads a run's progress and its latest checkpoint manifest.

What outlives an agent: each run's folder keeps its allocation
(``alloc.json``, written before the first rank starts) and its ranks' pids
(``pids``) until the agent has reported the run's end (``forget``). A
successor agent on the same workdir reaps every run still listed there: it
stops what is left of it and hands back its allocation, so the runs the dead
agent never reported get reported.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from gearshift.agent import launch
from gearshift.agent import worker as wk
from gearshift.agent.warm import WARM_SCRIPT, WarmPool
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import Allocation

PIDS_FILE = "pids"
ALLOC_FILE = "alloc.json"


@dataclass
class Leftover:
    """A run a previous agent started and did not report ended; stopped now."""

    alloc: Allocation
    run_dir: Path
    killed: bool  # a rank ignored SIGTERM for the grace period: SIGKILLed


class Rank(Protocol):
    pid: int
    returncode: int | None

    async def wait(self) -> int: ...


class Runner(Protocol):
    async def start_rank(self, run: Any, spec: launch.RankSpec, env: dict[str, str]) -> Rank: ...

    def signal(self, rank: Rank, sig: int) -> None: ...

    def progress(self, run: Any) -> dict | None: ...

    def manifest(self, run: Any) -> dict | None: ...

    async def reap(self, run_root: Path, grace: float, log: Any) -> list[Leftover]: ...

    def forget(self, run: Any) -> None: ...

    async def open(self, slots: int) -> None: ...

    def launched(self, run: Any) -> None: ...

    def close(self) -> None: ...


class SubprocessRunner:
    """Real processes; progress and checkpoints through the worker's files.
    With a ``warm`` pool (agent/warm.py) a rank becomes a worker whose
    interpreter and imports are ready, when one is; the pool is refilled
    once a new generation made its first step, not while it starts up."""

    def __init__(self, warm: Any = None):
        self.warm = warm
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._launchers: set[int] = set()  # pids of launchers (torchrun): a checkpoint signal skips them
        self._groups: dict[int, set[int]] = {}  # rank pid -> process groups of its descendants seen

    @classmethod
    def with_warm_pool(cls, workdir: Path, log: Any, prewarm: list[str]) -> "SubprocessRunner":
        async def spawn(argv: list[str], env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
            with open(workdir / "warm.log", "ab") as out:
                return await asyncio.create_subprocess_exec(
                    *argv, cwd=workdir, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=out,
                    env={**os.environ, **env} if env else None, start_new_session=True, preexec_fn=_die_with_agent)

        return cls(WarmPool(1, spawn=spawn, log=log, status_file=workdir / "warm.json", prewarm=prewarm))

    async def open(self, slots: int) -> None:
        if self.warm is not None:
            self.warm.size = max(1, slots)
            self._background(self.warm.refill())

    def launched(self, run: Any) -> None:
        if self.warm is not None and not self._closing:
            self._background(self._refill_after_first_step(run))  # ready for the next generation

    async def _refill_after_first_step(self, run: Any, wait: float = 60.0) -> None:
        deadline = time.monotonic() + wait
        while not self._closing and not run.done.is_set() and time.monotonic() < deadline:
            prog = wk.read_json(run.progress_file or next(run.run_dir.glob("progress-*.json"), None)) or {}
            if prog.get("first_step_s") is not None or prog.get("phases"):
                break
            await asyncio.sleep(0.2)
        if not self._closing:
            await self.warm.refill()

    def _background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self.warm is not None:
            self.warm.close()

    async def start_rank(self, run: Any, spec: launch.RankSpec, env: dict[str, str]) -> Rank:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if spec.local_rank == 0:  # before any rank exists: a successor must know what it was
            (run.run_dir / ALLOC_FILE).write_bytes(codec.encode(run.alloc))
        cmd = launch.command(run.alloc)
        log_path = run.run_dir / f"rank-{spec.rank}.log"
        proc = self.warm.take(cmd, run.alloc.env) if self.warm is not None else None
        if proc is not None and not await self.warm.hand_off(proc, cmd, env, str(run.run_dir), str(log_path)):
            proc = None
        if proc is None:
            with open(log_path, "ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    env=env,
                    cwd=run.run_dir,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,  # own process group: one signal reaches its children
                    preexec_fn=_die_with_agent,  # no orphan outlives a crashed agent
                )
        _remember_pid(run.run_dir, proc.pid)
        if launch.is_launcher(cmd):
            self._launchers.add(proc.pid)
        return proc

    def signal(self, rank: Rank, sig: int) -> None:
        """``sig`` to the rank's process group and to every group its
        descendants started: torchrun starts each worker in a session of its
        own, so a signal to torchrun's group alone reaches no rank, and a
        SIGKILL at the grace left the workers running. SIGUSR1 (checkpoint,
        go on) skips a launcher itself: torchrun does not handle it and would
        die of it. Groups seen once are remembered, so a SIGKILL after the
        launcher exited still reaches its workers."""
        groups = self._groups.setdefault(rank.pid, set())
        if rank.returncode is None:  # not reaped: its pid is still its own (no reuse)
            groups.update(descendant_groups(rank.pid))
        if not (sig == signal.SIGUSR1 and rank.pid in self._launchers):
            signal_group(rank.pid, sig)
        for g in groups:
            signal_group(g, sig)
        if sig == signal.SIGKILL and rank.returncode is not None:
            self._groups.pop(rank.pid, None)
            self._launchers.discard(rank.pid)

    def progress(self, run: Any) -> dict | None:
        return wk.read_json(run.progress_file)

    def manifest(self, run: Any) -> dict | None:
        return wk.latest_manifest(run.ckpt_dir)

    async def reap(self, run_root: Path, grace: float, log: Any) -> list[Leftover]:
        return await _reap_orphans(run_root, grace, log)

    def forget(self, run: Any) -> None:
        """The run's end is reported: a successor has nothing to do for it."""
        for name in (ALLOC_FILE, PIDS_FILE):
            try:
                (run.run_dir / name).unlink()
            except OSError:
                pass


def _remember_pid(run_dir: Path, pid: int) -> None:
    with open(run_dir / PIDS_FILE, "a") as f:
        f.write(f"{pid}\n")


def _is_our_process(pid: int, job_id: str, generation: str) -> bool:
    """Guards against pid reuse: the process must carry the job's contract variables."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: trust the pid file
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    if f"GEARSHIFT_JOB_ID={job_id}".encode() in env and f"GEARSHIFT_GENERATION={generation}".encode() in env:
        return True
    # a warm worker (agent/warm.py) keeps the agent's environment: it moved into the run's folder
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
            warm = b"gearshift.agent.warm" in cmdline or WARM_SCRIPT.encode() in cmdline
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    return warm and cwd.name == f"g{generation}" and cwd.parent.name == job_id


async def _reap_orphans(run_root: Path, grace: float, log: Any) -> list[Leftover]:
    """SIGTERM (checkpoint), then SIGKILL, every job process a previous agent
    on this workdir started and left behind, and wait until they are gone;
    returns every run it had not reported ended, alive or not."""
    found: list[int] = []
    runs: list[tuple[Path, list[int]]] = []
    run_dirs = {f.parent for name in (ALLOC_FILE, PIDS_FILE) for f in run_root.glob(f"*/g*/{name}")}
    for run_dir in sorted(run_dirs):
        job_id, generation = run_dir.parent.name, run_dir.name[1:]
        pids_file = run_dir / PIDS_FILE
        try:
            pids = [int(x) for x in pids_file.read_text().split()]
        except (OSError, ValueError):
            pids = []
        ours = [p for p in pids if _is_our_process(p, job_id, generation)]
        for pid in ours:
            log.warning("stopping a job process left by a previous agent", job_id=job_id,
                        generation=generation, pid=pid)
            signal_group(pid, signal.SIGTERM)
        found += ours
        runs.append((run_dir, ours))
        try:
            pids_file.unlink()
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while found and time.monotonic() < deadline:
        found = [p for p in found if _pid_alive(p)]
        await asyncio.sleep(0.05)
    for pid in found:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0  # a process in uninterruptible sleep takes a moment
    while any(_pid_alive(p) for p in found) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out = []
    for run_dir, ours in runs:
        try:
            alloc = codec.decode((run_dir / ALLOC_FILE).read_bytes(), Allocation)
        except (OSError, msgspec.MsgspecError):
            log.warning("a previous agent's run has no readable allocation: not reported", run_dir=str(run_dir))
            continue
        out.append(Leftover(alloc=alloc, run_dir=run_dir, killed=bool(set(ours) & set(found))))
    return out


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _die_with_agent() -> None:
    """In the child before exec: SIGTERM (checkpoint and leave) when the agent
    dies, as systemd's KillMode=control-group would; an agent killed with
    SIGKILL must not leave a generation running that nobody fences."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: the next agent's _reap_orphans stops them


def descendant_groups(pid: int) -> set[int]:
    """Process groups of ``pid``'s descendants other than its own (psutil)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return set()
    out = set()
    for c in children:
        try:
            g = os.getpgid(c.pid)
        except OSError:
            continue
        if g != pid and g == c.pid:  # a leader of a group of its own (start_new_session)
            out.add(g)
    return out


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
