"""The worker side of the agent <-> worker contract; a training script imports it.

Environment (set by the agent for every process it launches)::

    WORLD_SIZE RANK LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT   torchrun names
    GEARSHIFT_JOB_ID GEARSHIFT_GENERATION GEARSHIFT_PLAN (JSON of the Plan)
    GEARSHIFT_NODE_RANK GEARSHIFT_NNODES
    GEARSHIFT_CKPT_DIR        per job, the same across generations
    GEARSHIFT_PROGRESS_FILE   where this process reports progress
    GEARSHIFT_STEPS GEARSHIFT_GLOBAL_BATCH GEARSHIFT_STEP_TIME (emulated worker)
    GEARSHIFT_PROFILE_STEPS   set only for a profiling run (below)
    CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=PCI_BUS_ID

Profiling contract: a model nobody profiled yet is first run for a few steps
under up to 7 plans (``services/profiler.py``), each with
``GEARSHIFT_PROFILE_STEPS=N``. The script then trains N steps under
``GEARSHIFT_PLAN`` (after a warm-up step or two of its own choosing), writes
``phases`` -- ms per step: ``forward``, ``backward`` (backward + gradient
sync), ``optimizer``, ``iteration`` (``PhaseTimer``) -- and ``profiled: N``
into its progress file (``ProgressReporter.report(..., phases=...,
force=True)``), and exits 0 without writing a checkpoint. A script that
ignores the variable is caught (``agent/profiling.py``): once its progress
passes N by 10 steps without phase times, or it exits without them, the run
ends and says "the script ignores GEARSHIFT_PROFILE_STEPS". If every run of a
model fails, its jobs do not wait: a script that crashed every run fails them
with the reason; one that ran but gave no timings is scheduled on the prior
model (the nearest Rubick model, scaled), the reason in its ``job.profiled``
event. A plan the script cannot run exits ``EXIT_PLAN_REFUSED`` there too.

Progress channel: the worker rewrites a small JSON file atomically (temp file
+ ``os.replace``) and the agent reads it about once a second. A file, not a
pipe, because it needs nothing from the command (torchrun, shell wrappers and
forks all keep working), never blocks the trainer when the agent is slow, and
still holds the last value after the process died, which is what the agent's
exit report wants.

Signals and exit codes (reference/ecosystem.md section 6): SIGTERM asks for a
checkpoint at the next step boundary and an exit with ``EXIT_CHECKPOINTED``
(143); SIGUSR1 (what the agent sends for a ``gs.agent.<node>.checkpoint`` bus
command) asks for a checkpoint at the next step boundary and keeps training;
0 means the job is done; ``EXIT_TEMPFAIL`` (75) a checkpoint that failed but
may be retried; ``EXIT_PLAN_REFUSED`` (78) "this plan cannot run this model":
the job goes back to the plan it last ran steps under and the refused plan is
never chosen for it again (a job declares the plans it supports up front in
``JobSpec.plan_support``; under a launcher such as torchrun, which turns a
rank's 78 into its own 1, exit through ``refuse_plan``, which also records the
refusal where the agent reads it); anything else is a crash (the optimizer retries the
job from its last checkpoint up to a limit).

Agreement: a signal reaches the ranks at slightly different times, so a
multi-rank script turns its local flags into one decision per step with a
collective (``StopSignal.flags()`` -> all-reduce MAX -> ``agreed``); every
rank then checkpoints after the same step and none trains past it.

Checkpoints: data goes into ``step-<n>.tmp-*`` and is renamed to
``step-<n>`` (``CheckpointWriter``); then rank 0 writes ``manifest.json`` in
``GEARSHIFT_CKPT_DIR`` last and atomically, so a manifest always names a
complete checkpoint; a restart resumes from ``latest_manifest``. Older step
folders are pruned, the newest ``keep`` stay.

Progress fields the agent understands: ``step``, ``steps``, ``loss``,
``samples_per_s``, ``phases`` (ms per step: ``forward``, ``backward``
(backward + gradient sync), ``optimizer``, ``iteration``), ``start_step``
(the step this process resumed from), ``restore_s`` (launch -> state
restored), ``first_step_s`` (restored -> first step done).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple

EXIT_DONE = 0
EXIT_CHECKPOINTED = 143
EXIT_TEMPFAIL = 75
EXIT_PLAN_REFUSED = 78  # the plan cannot run this model (sysexits EX_CONFIG)

MANIFEST = "manifest.json"
#: beside the progress files: which generation's plan a rank refused. A launcher
#: (torchrun) turns a rank's exit 78 into its own exit 1; the agent reads this
#: file to tell "plan refused" from a crash.
PLAN_REFUSED_FILE = "plan-refused.json"


class WorkerEnv(NamedTuple):
    """The rank's contract from its environment (``from_env``). A ``NamedTuple``, not a
    dataclass: every emulated rank is a new interpreter, and ``dataclasses`` (with the
    ``inspect`` it imports and the class it generates) and ``tempfile`` were 13-18 ms
    of the worker's ~36 ms of imports (``python -S -X importtime``; issue 24)."""

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
    plan: dict[str, Any]  # the bus Plan as JSON
    ckpt_dir: Path = Path(".")
    progress_file: Path | None = None
    steps: int = 0
    global_batch: int = 0
    step_time: float = 0.1
    launched_at: float = 0.0  # wall time the agent spawned this process
    profile_steps: int = 0  # > 0: a profiling run, measure this many steps and exit

    # plan accessors (the bus Plan as JSON; absent fields take their defaults)
    @property
    def dp(self) -> int:
        return int(self.plan.get("dp") or 1)

    @property
    def ga(self) -> int:
        return int(self.plan.get("ga") or 1)

    @property
    def zero(self) -> int:
        return int(self.plan.get("zero") or 0)

    @property
    def grad_ckpt(self) -> bool:
        return bool(self.plan.get("grad_ckpt"))

    @property
    def micro_batch(self) -> int:
        """Samples per micro-step per replica; derived from the fixed global batch."""
        mb = self.plan.get("micro_batch")
        if mb:
            return int(mb)
        return max(1, self.global_batch // (self.dp * self.ga))

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
            launched_at=float(e.get("GEARSHIFT_LAUNCHED_AT") or 0.0),
            profile_steps=int(e.get("GEARSHIFT_PROFILE_STEPS") or 0),
        )


def refuse_plan(env: "WorkerEnv", field_name: str, reason: str) -> int:
    """The exit status of a rank that cannot run its plan: ``EXIT_PLAN_REFUSED``,
    after recording the refusal (field and reason, for this generation) where the
    agent finds it even when a launcher rewrites the exit code.
    ``sys.exit(refuse_plan(env, "tp", "4 heads are not divisible by 3"))``."""
    if env.progress_file is not None:
        try:
            write_json_atomic(env.progress_file.parent / PLAN_REFUSED_FILE,
                              {"generation": env.generation, "rank": env.rank, "field": field_name,
                               "reason": reason, "plan": env.plan})
        except OSError:
            pass  # the exit status still says it without a launcher
    return EXIT_PLAN_REFUSED


def plan_refused_generation(run_dir: Path) -> int | None:
    """The generation whose plan a rank refused in ``run_dir`` (``refuse_plan``), if any."""
    rec = read_json(Path(run_dir) / PLAN_REFUSED_FILE)
    gen = rec.get("generation") if rec else None
    return gen if isinstance(gen, int) else None


# ------------------------------------------------------------------ files
_TMP_IDS = itertools.count()


def _fresh(folder: Path, prefix: str, make: Any) -> tuple[Any, str]:
    """``make(name)`` on a name in ``folder`` nobody holds (``O_EXCL``, ``mkdir``), as
    ``tempfile`` would, without importing it: (what ``make`` returned, the name)."""
    while True:
        name = os.path.join(folder, f"{prefix}{os.getpid()}-{next(_TMP_IDS)}")
        try:
            return make(name), name
        except FileExistsError:
            continue


def write_json_atomic(path: Path, obj: Any) -> None:
    """Readers see the old or the new content, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _fresh(path.parent, f".{path.name}.",
                     lambda name: os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
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
        **extra: Any,
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
            obj["phases"] = phases  # ms per step by phase, for the profiler
        obj.update(extra)
        write_json_atomic(self.path, obj)


class PhaseTimer:
    """Time per phase, accumulated over a step and averaged over steps:
    ``with timer("forward"): ...``; ``end_step()`` closes a step.

    ``clock="wall"`` (default) measures elapsed time; ``clock="cpu"`` this
    thread's CPU time (``time.thread_time``), which other processes on a
    shared machine do not inflate; it leaves out time spent waiting (for
    example on a collective another thread runs), so use it only where the
    compute dominates."""

    def __init__(self, clock: str = "wall") -> None:
        self.clock = time.thread_time if clock == "cpu" else time.perf_counter
        self.current: dict[str, float] = {}
        self.total: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.steps = 0
        self._t0 = self.clock()

    def __call__(self, phase: str):
        timer = self

        class _Ctx:
            def __enter__(self_inner):
                self_inner.t = timer.clock()

            def __exit__(self_inner, *exc):
                timer.current[phase] = timer.current.get(phase, 0.0) + timer.clock() - self_inner.t

        return _Ctx()

    def start_step(self) -> None:
        self.current = {}
        self._t0 = self.clock()

    def end_step(self) -> dict[str, float]:
        """This step's phases in ms (``iteration`` = the whole step)."""
        self.current["iteration"] = self.clock() - self._t0
        for k, v in self.current.items():
            self.total[k] = self.total.get(k, 0.0) + v
        self.history.append(dict(self.current))
        self.steps += 1
        return {k: v * 1e3 for k, v in self.current.items()}

    def mean_ms(self) -> dict[str, float]:
        return {k: v * 1e3 / max(1, self.steps) for k, v in self.total.items()}

    def median_ms(self) -> dict[str, float]:
        """Per-phase medians over the steps since ``reset``: robust to the odd
        step another process on the machine slowed down."""
        return self.quantile_ms(0.5)

    def quantile_ms(self, q: float) -> dict[str, float]:
        """Per-phase ``q``-quantiles (ms) over the steps since ``reset``.
        Interference only ever adds time, so a low quantile estimates the
        undisturbed time better than the mean."""
        keys = {k for h in self.history for k in h}
        out = {}
        for k in keys:
            xs = sorted(h.get(k, 0.0) for h in self.history)
            pos = q * (len(xs) - 1)
            lo = int(pos)
            hi = min(lo + 1, len(xs) - 1)
            out[k] = (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)) * 1e3
        return out

    def reset(self) -> None:
        self.total = {}
        self.history = []
        self.steps = 0


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


class CheckpointWriter:
    """Atomic checkpoint folders: ``with writer.stage(step) as tmp: write into tmp``
    renames ``tmp`` to ``step-<n>`` only when the block succeeds, then prunes."""

    def __init__(self, ckpt_dir: Path, keep: int = 2):
        self.ckpt_dir = Path(ckpt_dir)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{int(step):08d}"

    def stage(self, step: int):
        writer = self

        class _Stage:
            def __enter__(self_inner) -> Path:
                writer.ckpt_dir.mkdir(parents=True, exist_ok=True)
                _, name = _fresh(writer.ckpt_dir, f"step-{int(step):08d}.tmp-", lambda n: os.mkdir(n, 0o700))
                self_inner.tmp = Path(name)
                return self_inner.tmp

            def __exit__(self_inner, exc_type, exc, tb) -> None:
                import shutil

                if exc_type is not None:
                    shutil.rmtree(self_inner.tmp, ignore_errors=True)
                    return
                writer.commit(step, self_inner.tmp)

        return _Stage()

    def shared_stage(self, step: int, tag: str) -> Path:
        """A temp folder with a name every rank can compute (``tag``: e.g. the
        generation), for checkpoints each rank writes a part of; one rank
        creates it, all write, one ``commit``s."""
        return self.ckpt_dir / f"step-{int(step):08d}.tmp-{tag}"

    def commit(self, step: int, tmp: Path) -> Path:
        """Rename a complete temp folder to ``step-<n>`` (replacing an older one of the same step)."""
        import shutil

        final = self.path(step)
        if final.exists():  # the same step again (a repeated stop): replace it
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def prune(self, current: int) -> None:
        """Remove step folders older than the newest ``keep`` (never ``current``)
        and temp folders a crash left behind."""
        import shutil

        if not self.ckpt_dir.exists():
            return
        steps = sorted(p for p in self.ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step-"))
        done = [p for p in steps if ".tmp-" not in p.name]
        for p in done[: -self.keep] if self.keep else []:
            if p != self.path(current):
                shutil.rmtree(p, ignore_errors=True)
        for p in steps:
            if ".tmp-" in p.name and not p.name.startswith(f"step-{int(current):08d}."):
                shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------ stop requests
class StopSignal:
    """SIGTERM (and SIGINT) as a flag the training loop checks at step
    boundaries, plus ``wait`` that sleeps but wakes at once on the signal.
    SIGUSR1 sets ``checkpoint_requested`` (checkpoint, keep running).

    The handler only sets a flag and writes one byte to a pipe; ``wait``
    selects on that pipe, so no lock is ever taken inside a signal handler.
    """

    def __init__(
        self,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
        checkpoint_signals: tuple[int, ...] = (signal.SIGUSR1,),
    ):
        self.requested = False
        self.checkpoint_requested = False
        self.signum: int | None = None
        self.requested_at: float | None = None  # wall time of the first stop request
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        for s in signals:
            signal.signal(s, self._handle)
        for s in checkpoint_signals:
            signal.signal(s, self._handle_checkpoint)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum
        if self.requested_at is None:
            self.requested_at = time.time()
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass

    def _handle_checkpoint(self, signum, frame) -> None:
        self.checkpoint_requested = True

    def flags(self) -> tuple[int, int]:
        """(stop, checkpoint) as ints, to all-reduce with MAX across ranks."""
        return int(self.requested), int(self.checkpoint_requested)

    def agreed(self, stop: int, checkpoint: int) -> None:
        """Adopt the all-ranks decision (a rank that missed the signal stops too)."""
        if stop and not self.requested:
            self.requested = True
            self.requested_at = self.requested_at or time.time()
        if not checkpoint:
            return
        self.checkpoint_requested = True

    def checkpoint_done(self) -> None:
        self.checkpoint_requested = False

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s; True as soon as a stop was requested."""
        if self.requested:
            return True
        select.select([self._r], [], [], max(0.0, timeout))
        return self.requested
