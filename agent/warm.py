"""Warm workers: Python processes with the job's heavy imports done, kept
ready by the agent so the next generation of a job starts without paying
for ``import torch`` (1-5 s of a switch on a CPU box).

A warm worker is ``python -m gearshift.agent.warm MODULE``. It imports ``MODULE`` and the
modules that lists in ``WARM_IMPORTS`` (the reference workload: torch and the
torch.distributed APIs the plan library uses), calls its ``warm_up()`` if it has one (first-use costs:
``torch.optim``'s first constructor imports ``torch._dynamo``), then waits for
one JSON line on stdin::

    {"argv": [...], "env": {...}, "cwd": "...", "log": "..."}

and becomes that rank: the environment replaced, the working folder changed, stdout/stderr appended to ``log``, and ``MODULE`` run
as ``__main__`` with ``argv`` (``runpy``), exactly as ``python -m MODULE
argv...`` would. Its exit status is the job's.

The imports run at normal priority: at idle priority (``SCHED_IDLE``, tried
first) a busy machine starved them for minutes, so the agent starts them
after a new generation's first step instead, not while it starts up.

The agent side (``WarmPool``) keeps up to ``size`` warm workers per
(interpreter, module, the job's variables that change how Python imports:
``PYTHON*``, ``LD_*``, ``VIRTUAL_ENV``): for modules named in
``$GEARSHIFT_WARM`` from the start, and for any other ``python -m`` command
once a job launched it. A job whose env sets ``PYTHONPATH``, or whose command
names a venv's python, gets warm workers started with exactly those variables
and that interpreter, so what they imported is what the job would import; a
worker for another interpreter runs this file by its path (that interpreter
need not have gearshift installed: this file needs only the standard library).
Anything but ``[python, "-m", module, ...]`` is started cold, as before. Warm
workers get the same process group and parent-death signal as cold ones.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import runpy
import sys
from typing import Any, Callable, Mapping, Sequence

IMPORT_VARS = ("PYTHON", "LD_", "VIRTUAL_ENV")  # prefixes of variables that change what an import does
WARM_SCRIPT = os.path.abspath(__file__)


def import_env(job_env: Mapping[str, str] | None) -> dict[str, str]:
    """The job's variables that change what an import does."""
    return {k: v for k, v in (job_env or {}).items() if k.startswith(IMPORT_VARS)}


def warm_key(cmd: Sequence[str], job_env: Mapping[str, str] | None) -> tuple | None:
    """``(python, module)``, plus the job's import variables (sorted pairs)
    when it sets any, when ``cmd`` can run in a warm worker, else None."""
    if len(cmd) < 3 or cmd[1] != "-m" or not os.path.isabs(cmd[0]):
        return None
    extra = import_env(job_env)
    return (cmd[0], cmd[2], tuple(sorted(extra.items()))) if extra else (cmd[0], cmd[2])


def warm_argv(key: tuple) -> list[str]:
    """How a warm worker of ``key`` starts: ``-m`` under the agent's own
    interpreter, this file by its path under any other."""
    if key[0] == sys.executable:
        return [key[0], "-m", "gearshift.agent.warm", key[1]]
    return [key[0], WARM_SCRIPT, key[1]]


class WarmPool:
    """The agent's warm workers, per (python, module). A worker counts as
    ready once it printed ``ready`` (its imports succeeded); a module whose
    worker exits instead (import error, or no ``WARM_IMPORTS``: nothing worth
    keeping warm) is not tried again."""

    READY_TIMEOUT_S = 300.0

    def __init__(self, size: int, *, spawn: Callable[..., Any], log: Any, prewarm: Sequence[str] = (),
                 status_file: Any = None):
        self.size = max(1, size)
        self.status_file = status_file  # {"ready": {module: n}}, rewritten on every change (tools read it)
        # async (argv[, env=the job's import variables]) -> asyncio.subprocess.Process with stdin and stdout pipes
        self._spawn = spawn
        self.log = log
        self.ready: dict[tuple, list[Any]] = {}  # by warm_key
        self.starting: dict[tuple, int] = {}
        self.refused: set[tuple] = set()
        self.proven: set[tuple] = set()  # keys a worker has been ready for: filled to ``size`` at once
        self._idle: set[Any] = set()  # every warm worker not handed to a job yet
        self._closed = False
        for module in prewarm:  # asked for by the operator: filled at once
            self.ready.setdefault((sys.executable, module), [])
            self.proven.add((sys.executable, module))

    async def refill(self) -> None:
        """Start warm workers up to ``size`` for every known key; each joins
        ``ready`` when it reports its imports done. A key no worker has been ready
        for yet gets one worker first, and the rest only once that one is ready:
        a module with nothing worth keeping warm (no ``WARM_IMPORTS``) then costs one
        interpreter start per key, not ``size`` of them at once (issue 24: on a
        2-core box the agents' first fills for the emulated worker were 16
        interpreters at once, 29 of the 47 processes the first seconds of
        ``loadtest.submit_stall --steps 300`` started)."""
        waits = []
        for key in list(self.ready):
            self.ready[key] = [p for p in self.ready[key] if p.returncode is None]
            first = key not in self.proven
            want = 1 if first else self.size
            while not self._closed and key not in self.refused and \
                    len(self.ready[key]) + self.starting.get(key, 0) < want:
                try:
                    extra = dict(key[2]) if len(key) > 2 else {}
                    argv = warm_argv(key)
                    proc = await (self._spawn(argv, env=extra) if extra else self._spawn(argv))
                except OSError as exc:
                    self.log.warning("warm worker did not start", module=key[1], error=str(exc))
                    self.refused.add(key)
                    break
                self._idle.add(proc)
                self.starting[key] = self.starting.get(key, 0) + 1
                waits.append(self._first_then_rest(key, proc) if first else self._await_ready(key, proc))
        await asyncio.gather(*waits)

    async def _first_then_rest(self, key: tuple, proc: Any) -> None:
        await self._await_ready(key, proc)
        if key in self.proven and not self._closed and self.size > 1:
            await self.refill()

    async def _await_ready(self, key: tuple, proc: Any) -> None:
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.READY_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError):
            line = b""
        finally:
            self.starting[key] -= 1
        if line.strip() == b"ready" and not self._closed:
            self.proven.add(key)
            self.ready[key].append(proc)
            self._write_status()
            return
        _kill(proc)
        self._idle.discard(proc)
        code = await proc.wait()
        if not self._closed:
            self.refused.add(key)
            self.log.info("module not kept warm", module=key[1], exit_code=code)

    def take(self, cmd: Sequence[str], job_env: Mapping[str, str] | None) -> Any | None:
        """A ready warm worker for ``cmd``, or None (then start it cold). Learns the key."""
        key = warm_key(cmd, job_env)
        if key is None:
            return None
        procs = self.ready.setdefault(key, [])
        while procs:
            p = procs.pop(0)
            self._idle.discard(p)
            if p.returncode is None:
                self._write_status()
                return p
        return None

    def _write_status(self) -> None:
        if self.status_file is None:
            return
        from gearshift.agent.worker import write_json_atomic

        ready: dict[str, int] = {}
        for key, procs in self.ready.items():
            if key in self.refused:
                continue
            module = key[1]
            ready[module] = ready.get(module, 0) + sum(1 for p in procs if p.returncode is None)
        try:
            write_json_atomic(self.status_file, {"ready": ready, "size": self.size})
        except OSError:
            pass

    @staticmethod
    async def hand_off(proc: Any, cmd: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> bool:
        """Make ``proc`` this rank; False when it is gone (start the rank cold)."""
        line = json.dumps({"argv": list(cmd[3:]), "env": dict(env), "cwd": str(cwd), "log": str(log)}) + "\n"
        try:
            proc.stdin.write(line.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def close(self) -> None:
        """Kill the warm workers (starting ones too); no more are started."""
        self._closed = True
        for p in self._idle:
            _kill(p)
        self._idle.clear()
        self.ready.clear()
        self._write_status()


def _kill(proc: Any) -> None:
    """Kill a warm worker's group, and close its pipes while the loop runs: left open,
    they are closed when the process object is collected, after the loop may have
    closed (CI: "Event loop is closed" raised in ``__del__``, reported inside a later
    test's ``ast.parse``, whose traceback formatting then failed in CPython 3.11's parser
    with "AST constructor recursion depth mismatch"). asyncio's ``Process`` has no
    public close; its transport's ``close`` is the one that closes the pipes."""
    import signal

    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session)
        except OSError:
            pass
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


# ---------------------------------------------------------------- the warm process
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m gearshift.agent.warm MODULE", file=sys.stderr)
        return 2
    module = argv[0]
    by_path = bool(sys.path) and os.path.abspath(sys.path[0]) == os.path.dirname(WARM_SCRIPT)
    if by_path:
        sys.path.pop(0)  # run by its path: its own folder must not shadow the job's imports
    try:
        mod = importlib.import_module(module)
        heavy = getattr(mod, "WARM_IMPORTS", ())
        for name in heavy:
            importlib.import_module(name)
        if heavy and callable(getattr(mod, "warm_up", None)):
            mod.warm_up()  # first-use costs (lazy imports inside the libraries)
    except Exception as exc:  # the job itself will report it when started cold
        print(f"warm worker: importing {module} failed: {exc}", file=sys.stderr)
        return 1
    if not heavy:
        return 3  # nothing worth keeping warm
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # the agent closed the pool
    spec = json.loads(line)
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    if by_path:  # as `python -m` puts the working folder first
        sys.path.insert(0, spec["cwd"])
    else:
        sys.path[0] = spec["cwd"]
    sys.argv = [module, *spec["argv"]]
    sys.modules.pop(module, None)  # run it afresh as __main__ (its imports stay loaded)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
