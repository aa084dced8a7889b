"""A stand-in for training when a job has no command: a real process that
advances ``GEARSHIFT_STEPS`` steps at ``GEARSHIFT_STEP_TIME`` seconds each.

It keeps the whole worker contract so the agent cannot tell it from a real
job: progress through the progress file, resume from the manifest in
``GEARSHIFT_CKPT_DIR``, checkpoint + exit 143 on SIGTERM, exit 0 when done.
The agent runs one per node (not one per GPU) to spare CPUs. Only rank 0
advances; the others wait until stopped or until rank 0's manifest says done.
"""

from __future__ import annotations

import os
import sys
import time

from gearshift.agent.worker import (
    EXIT_CHECKPOINTED,
    EXIT_DONE,
    ProgressReporter,
    StopSignal,
    WorkerEnv,
    latest_manifest,
    write_manifest,
)

# Periodic checkpoints bound what a crash or a lost node costs.
CKPT_INTERVAL_S = float(os.environ.get("WORKER_CKPT_INTERVAL") or os.environ.get("GEARSHIFT_CKPT_INTERVAL") or "5")
# Testing: seconds rank 0 takes to checkpoint after a stop request.
STOP_DELAY_S = float(os.environ.get("WORKER_STOP_DELAY", "0"))


def run_profile(env: WorkerEnv, stop: StopSignal) -> int:
    """A profiling run: the step time split 30/60/10 into forward, backward+sync, optimizer."""
    reporter = ProgressReporter(env.progress_file, steps=env.profile_steps)
    for _ in range(env.profile_steps):
        if stop.wait(env.step_time):
            return EXIT_CHECKPOINTED
    ms = env.step_time * 1e3
    reporter.report(env.profile_steps, phases={"forward": 0.3 * ms, "backward": 0.6 * ms, "optimizer": 0.1 * ms,
                                               "iteration": ms}, profiled=env.profile_steps, force=True)
    return EXIT_DONE


def run_rank0(env: WorkerEnv, stop: StopSignal) -> int:
    manifest = latest_manifest(env.ckpt_dir) or {}
    step = int(manifest.get("step", 0))
    start_step = step
    ready = time.time()
    restore_s = ready - env.launched_at if env.launched_at else None
    first_step_s = None
    crash_at = int(os.environ.get("WORKER_CRASH_AT") or 0)
    steps = env.steps
    reporter = ProgressReporter(env.progress_file, steps=steps)
    rate = env.global_batch / env.step_time if env.step_time > 0 else 0.0
    print(f"rank 0 of {env.job_id}@{env.generation}: resuming from step {step} of {steps}", flush=True)

    def checkpoint(done: bool = False) -> None:
        write_manifest(env.ckpt_dir, job_id=env.job_id, generation=env.generation, step=step, done=done,
                       requested_at=stop.requested_at)

    def report(force: bool = False, **kw) -> None:
        reporter.report(step, start_step=start_step, restore_s=restore_s, first_step_s=first_step_s, force=force, **kw)

    report(samples_per_s=0.0, force=True)
    last_ckpt = time.monotonic()
    next_at = time.monotonic() + env.step_time
    while step < steps:
        # sleep to the next step boundary on an absolute schedule, so the rate
        # holds even when writes take time
        if stop.wait(next_at - time.monotonic()):
            time.sleep(STOP_DELAY_S)  # a slow checkpoint, for tests of the gang barrier
            checkpoint()
            report(samples_per_s=0.0, force=True)
            return EXIT_CHECKPOINTED
        if crash_at and step == crash_at:
            marker = env.ckpt_dir / f".crashed-at-{step}"
            if not marker.exists():  # crash once, so a retry gets past it
                marker.write_text("x")
                print(f"crashing on purpose at step {step}", file=sys.stderr, flush=True)
                return 1
        step += 1
        next_at += env.step_time
        first = first_step_s is None
        if first:
            first_step_s = time.time() - ready
        report(samples_per_s=rate, force=step == steps or first)
        if time.monotonic() - last_ckpt >= CKPT_INTERVAL_S or stop.checkpoint_requested:
            checkpoint()
            stop.checkpoint_done()
            last_ckpt = time.monotonic()
    checkpoint(done=True)
    return EXIT_DONE


def run_follower(env: WorkerEnv, stop: StopSignal) -> int:
    while not stop.wait(0.2):
        if (latest_manifest(env.ckpt_dir) or {}).get("done"):
            return EXIT_DONE
    return EXIT_CHECKPOINTED


def main() -> int:
    stop = StopSignal()
    env = WorkerEnv.from_env()
    env.ckpt_dir.mkdir(parents=True, exist_ok=True)
    if env.profile_steps:
        return run_profile(env, stop) if env.rank == 0 else EXIT_DONE
    if (latest_manifest(env.ckpt_dir) or {}).get("done"):
        return EXIT_DONE  # an earlier generation finished the job
    return run_rank0(env, stop) if env.rank == 0 else run_follower(env, stop)


if __name__ == "__main__":
    sys.exit(main())
