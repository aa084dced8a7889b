"""How an agent runs a job's ranks: the runner interface and the subprocess
runner (real processes, one process group each). ``agent.emulated_runner``
runs them in-process for the fleet emulator; the agent cannot tell.

A rank is a handle with ``pid``, ``returncode`` and ``wait()``; the runner
signals it (SIGTERM: checkpoint and leave; SIGUSR1: checkpoint and go on;
SIGKILL), and reads a run's progress and its latest checkpoint manifest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from . import launch, worker as wk

PIDS_FILE = "pids"


class Rank(Protocol):
    pid: int
    returncode: int | None

    async def wait(self) -> int: ...


class Runner(Protocol):
    async def start_rank(self, run: Any, spec: launch.RankSpec, env: dict[str, str]) -> Rank: ...

    def signal(self, rank: Rank, sig: int) -> None: ...

    def progress(self, run: Any) -> dict | None: ...

    def manifest(self, run: Any) -> dict | None: ...

    async def reap(self, run_root: Path, grace: float, log: Any) -> int: ...


class SubprocessRunner:
    """Real processes; progress and checkpoints through the worker's files.
    With a ``warm`` pool (agent/warm.py) a rank becomes a worker whose
    interpreter and imports are ready, when one is."""

    def __init__(self, warm: Any = None):
        self.warm = warm

    async def start_rank(self, run: Any, spec: launch.RankSpec, env: dict[str, str]) -> Rank:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.ckpt_dir.mkdir(parents=True, exist_ok=True)
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
        return proc

    def signal(self, rank: Rank, sig: int) -> None:
        signal_group(rank.pid, sig)

    def progress(self, run: Any) -> dict | None:
        return wk.read_json(run.progress_file)

    def manifest(self, run: Any) -> dict | None:
        return wk.latest_manifest(run.ckpt_dir)

    async def reap(self, run_root: Path, grace: float, log: Any) -> int:
        return await _reap_orphans(run_root, grace, log)


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
            warm = b"agent.warm" in f.read()
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    return warm and cwd.name == f"g{generation}" and cwd.parent.name == job_id


async def _reap_orphans(run_root: Path, grace: float, log: Any) -> int:
    """SIGTERM (checkpoint), then SIGKILL, every job process a previous agent
    on this workdir started and left behind; returns how many there were."""
    found: list[int] = []
    for pids_file in run_root.glob(f"*/g*/{PIDS_FILE}"):
        job_id, generation = pids_file.parent.parent.name, pids_file.parent.name[1:]
        try:
            pids = [int(x) for x in pids_file.read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            if _is_our_process(pid, job_id, generation):
                log.warning("stopping a job process left by a previous agent", job_id=job_id,
                            generation=generation, pid=pid)
                signal_group(pid, signal.SIGTERM)
                found.append(pid)
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
    return len(found)


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


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
