"""The worker side of the agent <-> worker contract; a training script imports it.

Environment (set by the agent for every process it launches)::

    WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT   torchrun names
    GEARSHIFT_JOB_ID GEARSHIFT_GENERATION GEARSHIFT_PLAN (JSON of the Plan)
    GEARSHIFT_NODE_RANK GEARSHIFT_NNODES
    GEARSHIFT_CKPT_DIR        per job, the same across generations
    GEARSHIFT_PROGRESS_FILE   where this process reports progress
    GEARSHIFT_STEPS GEARSHIFT_GLOBAL_BATCH GEARSHIFT_STEP_TIME (emulated worker)
    CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=PCI_BUS_ID

Progress channel: the worker rewrites a small JSON file atomically (temp file
+ ``os.replace``) and the agent reads it about once a second. A file, not a
pipe, because it needs nothing from the command (torchrun, shell wrappers and
forks all keep working), never blocks the trainer when the agent is slow, and
still holds the last value after the process died, which is what the agent's
exit report wants.

Signals and exit codes (reference/ecosystem.md section 6): SIGTERM asks for a
checkpoint at the next step boundary and an exit with ``EXIT_CHECKPOINTED``
(143); 0 means the job is done; ``EXIT_TEMPFAIL`` (75) a checkpoint that
failed but may be retried; anything else is a crash.

Checkpoints: rank 0 writes ``manifest.json`` in ``GEARSHIFT_CKPT_DIR`` last
and atomically, so a manifest always names a complete checkpoint; a restart
resumes from ``latest_manifest``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

EXIT_DONE = 0
EXIT_CHECKPOINTED = 143
EXIT_TEMPFAIL = 75

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class WorkerEnv:
    job_id: str
    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    plan: dict[str, Any] = field(default_factory=dict)
    ckpt_dir: Path = Path(".")
    progress_file: Path | None = None
    steps: int = 0
    global_batch: int = 0
    step_time: float = 0.1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerEnv":
        e = os.environ if env is None else env
        progress = e.get("GEARSHIFT_PROGRESS_FILE")
        return cls(
            job_id=e.get("GEARSHIFT_JOB_ID", "local"),
            generation=int(e.get("GEARSHIFT_GENERATION", "1")),
            rank=int(e.get("RANK", "0")),
            world_size=int(e.get("WORLD_SIZE", "1")),
            local_rank=int(e.get("LOCAL_RANK", "0")),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", "1")),
            node_rank=int(e.get("GEARSHIFT_NODE_RANK", "0")),
            nnodes=int(e.get("GEARSHIFT_NNODES", "1")),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(e.get("MASTER_PORT", "29500")),
            plan=json.loads(e.get("GEARSHIFT_PLAN") or "{}"),
            ckpt_dir=Path(e.get("GEARSHIFT_CKPT_DIR", ".")),
            progress_file=Path(progress) if progress else None,
            steps=int(e.get("GEARSHIFT_STEPS", "0")),
            global_batch=int(e.get("GEARSHIFT_GLOBAL_BATCH", "0")),
            step_time=float(e.get("GEARSHIFT_STEP_TIME") or 0.1),
        )


# ------------------------------------------------------------------ files
def write_json_atomic(path: Path, obj: Any) -> None:
    """Readers see the old or the new content, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: Path | None) -> dict | None:
    """The file's object, or None when absent or unreadable."""
    if path is None:
        return None
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


# ------------------------------------------------------------------ progress
class ProgressReporter:
    """Writes this process's progress file; cheap enough to call every step
    (writes are throttled to ``min_interval``; ``force`` bypasses it)."""

    def __init__(self, path: Path | None, steps: int = 0, min_interval: float = 0.1):
        self.path = path
        self.steps = steps
        self.min_interval = min_interval
        self._last = 0.0

    def report(
        self,
        step: int,
        *,
        samples_per_s: float | None = None,
        loss: float | None = None,
        phases: dict[str, float] | None = None,
        force: bool = False,
    ) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        obj: dict[str, Any] = {"step": int(step), "steps": self.steps, "ts": time.time()}
        if samples_per_s is not None:
            obj["samples_per_s"] = float(samples_per_s)
        if loss is not None:
            obj["loss"] = float(loss)
        if phases:
            obj["phases"] = phases  # seconds per phase, for the profiler (issue 6)
        write_json_atomic(self.path, obj)


# ------------------------------------------------------------------ checkpoints
def write_manifest(
    ckpt_dir: Path,
    *,
    job_id: str,
    generation: int,
    step: int,
    done: bool = False,
    fmt: str = "emulated",
    path: str = "",
    **extra: Any,
) -> dict:
    """Record a complete checkpoint. Call it after the checkpoint data is on disk."""
    manifest = {
        "job_id": job_id,
        "generation": generation,
        "step": int(step),
        "done": done,
        "format": fmt,
        "path": path,
        "wall_time": time.time(),
        **extra,
    }
    write_json_atomic(Path(ckpt_dir) / MANIFEST, manifest)
    return manifest


def latest_manifest(ckpt_dir: Path | None) -> dict | None:
    if ckpt_dir is None:
        return None
    return read_json(Path(ckpt_dir) / MANIFEST)


# ------------------------------------------------------------------ stop requests
class StopSignal:
    """SIGTERM (and SIGINT) as a flag the training loop checks at step
    boundaries, plus ``wait`` that sleeps but wakes at once on the signal.

    The handler only sets a flag and writes one byte to a pipe; ``wait``
    selects on that pipe, so no lock is ever taken inside a signal handler.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.requested = False
        self.signum: int | None = None
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s; True as soon as a stop was requested."""
        if self.requested:
            return True
        select.select([self._r], [], [], max(0.0, timeout))
        return self.requested
