"""The GPU path on a machine with NVIDIA GPUs: ``python -m loadtest.gpu_check --json``.

Checks, on this host's real GPUs:

1. ``probe``: the NVML probe's contract: indices 0..n-1, unique real UUIDs
   (``GPU-``/``MIG-``), every GPU healthy, 0 < total, used <= total,
   utilisation 0..100 or absent, every reported PID alive;
2. ``rank_sees_its_gpu``: a rank launched for GPU *i* (environment from
   ``agent.launch``) sees exactly one CUDA device, whose UUID
   (``torch.cuda.get_device_properties(0).uuid``) is NVML's UUID of *i*;
3. ``pid_attribution``: a process holding memory on GPU *k* is listed on GPU
   *k* only, and GPU *k*'s used memory grows;
4. ``workload_dp`` / ``workload_tp``: the reference workload (``gearshift.agent.reference.train``)
   as local ranks on the GPUs: it finishes, its ranks are seen by NVML on
   their GPUs (so it ran on CUDA), and NCCL initialised (``NCCL_DEBUG=INFO``)
   when there is more than one rank. TP needs two GPUs; a workload without TP
   support is reported as skipped with its refusal;
5. ``switch``: one plan switch of the reference workload through a real local
   cluster (nats-server, services, one agent on the real GPUs);
6. ``hf_dp`` / ``hf_fsdp`` / ``hf_tp`` / ``hf_switch``: a tiny Hugging Face LLaMA
   through the plan library (``agent/torchplan``) under DDP, FSDP2 ZeRO-3 and
   DTensor TP on NCCL, and one switch DP1 -> FSDP2 through its Distributed
   Checkpoint with the loss of an uninterrupted run.

Without a usable NVIDIA driver it prints ``{"skipped": true, "reason": ...}``
and exits 0. Exit 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.agent import launch, reference
from gearshift.agent.probe import NoGpuDriver, NvmlProbe
from gearshift.bus_schema.messages import Allocation, GpuReport, NodePlacement, Plan

CHILD_SEES = r"""
import json, re, sys
try:
    import torch
except ImportError as exc:
    print(json.dumps({"error": f"torch not importable: {exc}"})); sys.exit(0)
if not torch.cuda.is_available():
    print(json.dumps({"count": 0})); sys.exit(0)
u = torch.cuda.get_device_properties(0).uuid
raw = getattr(u, "bytes", None)
text = raw.hex() if isinstance(raw, (bytes, bytearray)) else re.sub(r"[^0-9a-f]", "", str(u).lower().replace("uuid", ""))
print(json.dumps({"count": torch.cuda.device_count(), "uuid": text}))
"""

CHILD_HOLD = r"""
import sys, torch
x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.read()
"""


def uuid_hex(uuid: str) -> str:
    return re.sub(r"[^0-9a-f]", "", uuid.lower().removeprefix("gpu-").removeprefix("mig-"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def nested_pid_namespace() -> bool:
    """NVML reports host PIDs, which do not exist inside a container's PID namespace."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) > 2
    except OSError:
        pass
    return False


def check(name: str, ok: bool | None, detail: Any = "", **extra: Any) -> dict[str, Any]:
    """One result; ``ok=None`` is a skip (``detail`` says why)."""
    return {"name": name, "ok": ok, "skipped": ok is None, "detail": detail, **extra}


def probe_contract(gpus: list[GpuReport]) -> dict[str, Any]:
    problems = []
    if [g.index for g in gpus] != list(range(len(gpus))):
        problems.append(f"indices {[g.index for g in gpus]} are not 0..{len(gpus) - 1}")
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        problems.append(f"duplicate UUIDs {uuids}")
    for g in gpus:
        tag = f"GPU {g.index} {g.uuid or '?'}"
        if not g.uuid.startswith(("GPU-", "MIG-")):
            problems.append(f"{tag}: not a real UUID")
        if not g.healthy:
            problems.append(f"{tag}: {g.health.value} ({g.health_reason})")
        if not 0 < g.memory_total or not 0 <= g.memory_used <= g.memory_total:
            problems.append(f"{tag}: memory used {g.memory_used} of total {g.memory_total}")
        if g.utilization is not None and not 0 <= g.utilization <= 100:
            problems.append(f"{tag}: utilisation {g.utilization}")
        dead = [p.pid for p in g.processes if not pid_alive(p.pid)]
        if dead and not nested_pid_namespace():
            problems.append(f"{tag}: PIDs {dead} do not exist")
    return check("probe", not problems and bool(gpus), problems or f"{len(gpus)} GPUs",
                 gpus=[{"index": g.index, "uuid": g.uuid, "name": g.name, "health": g.health.value,
                        "memory_used": g.memory_used, "memory_total": g.memory_total,
                        "utilization": g.utilization, "processes": len(g.processes)} for g in gpus])


def rank_env(gpus: list[int], rank: int = 0, world: int = 1, plan: Plan | None = None, **contract: str) -> dict:
    """The environment ``agent.launch`` gives rank ``rank`` on ``gpus``."""
    alloc = Allocation(job_id="gpucheck", generation=1, plan=plan or Plan(dp=world),
                       placement=[NodePlacement(node="gpucheck", gpus=gpus)], command=["true"], steps=1,
                       global_batch=1)
    spec = launch.rank_specs(alloc, "gpucheck")[rank]
    tmp = Path(tempfile.gettempdir())
    env = launch.environment(alloc, spec, node="gpucheck", master_addr="127.0.0.1", ckpt_dir=tmp / "gpucheck-ckpt",
                             progress_file=tmp / f"gpucheck-progress-{rank}.json")
    env.update(contract)
    return env


def ranks_see_their_gpu(gpus: list[GpuReport]) -> dict[str, Any]:
    seen, problems = [], []
    for g in gpus:
        out = subprocess.run([sys.executable, "-c", CHILD_SEES], env=rank_env([g.index]), capture_output=True,
                             text=True, timeout=120)
        try:
            got = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            problems.append(f"GPU {g.index}: child failed: {out.stderr.strip()[-300:]}")
            continue
        if "error" in got:
            return check("rank_sees_its_gpu", None, got["error"])
        seen.append({"index": g.index, "cuda_devices": got["count"], "cuda_uuid": got.get("uuid")})
        if got["count"] != 1 or got.get("uuid") != uuid_hex(g.uuid):
            problems.append(f"GPU {g.index}: rank sees {got['count']} devices, first {got.get('uuid')}, "
                            f"NVML says {g.uuid}")
    return check("rank_sees_its_gpu", not problems, problems or "every rank sees exactly its GPU", ranks=seen)


async def pid_attribution(probe: NvmlProbe, gpus: list[GpuReport], mib: int = 256) -> dict[str, Any]:
    if nested_pid_namespace():
        return check("pid_attribution", None, "nested PID namespace: NVML reports host PIDs")
    if not reference.have_torch():
        return check("pid_attribution", None, "torch is not installed (the child holds memory through it)")
    k = len(gpus) - 1
    before = (await probe.sample())[k].memory_used
    child = subprocess.Popen([sys.executable, "-c", CHILD_HOLD, str(mib)], env=rank_env([k]), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = child.stdout.readline().strip()
        if line != "READY":
            return check("pid_attribution", False, f"child did not start: {line} {child.stdout.read()[-300:]}")
        on, after = [], before
        for _ in range(40):
            now = await probe.sample()
            on = [g.index for g in now if any(p.pid == child.pid for p in g.processes)]
            after = now[k].memory_used
            if on:
                break
            await asyncio.sleep(0.25)
        grew = (after - before) / 2**20
        ok = on == [k] and grew >= 0.8 * mib
        return check("pid_attribution", ok, f"pid {child.pid} on GPUs {on} (expected [{k}]), used memory grew "
                                            f"{grew:.0f} MiB for {mib} MiB")
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


async def workload(probe: NvmlProbe, name: str, plan: Plan | dict[str, Any], gpus: list[int], steps: int,
                   cmd: list[str] | None = None, batch: int = 64, ckpt: Path | None = None) -> dict[str, Any]:
    """The reference workload (or ``cmd``) as local ranks on ``gpus``, watched through NVML."""
    plan = plan if isinstance(plan, Plan) else Plan(**plan)
    label = plan.label()
    world = len(gpus)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix=f"gpucheck-{name}-"))
    procs = []
    for r in range(world):
        env = rank_env(gpus, rank=r, world=world, plan=plan, MASTER_PORT=str(port), NCCL_DEBUG="INFO",
                       GEARSHIFT_CKPT_DIR=str(ckpt or tmp / "ckpt"), GEARSHIFT_STEPS=str(steps),
                       GEARSHIFT_GLOBAL_BATCH=str(batch), GEARSHIFT_PROGRESS_FILE=str(tmp / f"progress-{r}.json"))
        procs.append(subprocess.Popen(cmd or reference.command(), env=env, stdout=open(tmp / f"rank{r}.log", "w"),
                                      stderr=subprocess.STDOUT))
    on_gpu: dict[int, set[int]] = {}
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for g in await probe.sample():
            for p in g.processes:
                on_gpu.setdefault(p.pid, set()).add(g.index)
        await asyncio.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    logs = "".join((tmp / f"rank{r}.log").read_text(errors="replace") for r in range(world))
    if (2 in codes or 78 in codes) and ("not supported" in logs or "refused" in logs):
        return check(name, None, f"the workload refuses {label}: {logs.strip()[-300:]}")
    placed = {r: sorted(on_gpu.get(p.pid, ())) for r, p in enumerate(procs)}
    nccl = "NCCL INFO" in logs
    manifest = (ckpt or tmp / "ckpt") / "manifest.json"
    done = json.loads(manifest.read_text()) if manifest.exists() else {}
    problems = []
    if any(codes):
        problems.append(f"exit codes {codes}: {logs.strip()[-400:]}")
    if done.get("step") != steps or not done.get("done"):
        problems.append(f"final checkpoint {done or 'missing'}")
    if any(placed[r] != [gpus[r]] for r in placed):
        problems.append(f"ranks seen by NVML on GPUs {placed}, expected {gpus} (did it run on CUDA?)")
    if world > 1 and not nccl:
        problems.append("no NCCL INFO lines: not the NCCL backend")
    return check(name, not problems, problems or f"{label} on GPUs {gpus}: {steps} steps, loss {done.get('loss')}",
                 nccl=nccl, ranks_on_gpus=placed)


async def hf_checks(probe: NvmlProbe, n_gpus: int, steps: int) -> list[dict[str, Any]]:
    """A tiny HF LLaMA through the plan library (agent/torchplan) on CUDA/NCCL:
    DP (DDP), FSDP2 (ZeRO-3), TP (DTensor), and one switch DP -> FSDP2 through
    its Distributed Checkpoint, whose loss must match an uninterrupted DP run."""
    from gearshift.agent import torchplan

    cmd = torchplan.command("--model", "llama", "--ckpt-every", "100000")
    dp = min(2, n_gpus)
    out = [await workload(probe, "hf_dp", {"dp": dp}, list(range(dp)), steps, cmd, batch=16),
           await workload(probe, "hf_fsdp", {"dp": dp, "zero": 3}, list(range(dp)), steps, cmd, batch=16),
           await workload(probe, "hf_tp", {"tp": 2}, [0, 1], steps, cmd, batch=16) if n_gpus >= 2
           else check("hf_tp", None, "TP needs 2 GPUs; this machine has 1")]
    ck = Path(tempfile.mkdtemp(prefix="gpucheck-hf-switch-"))
    first = await workload(probe, "hf_switch", {"dp": 1}, [0], steps // 2, cmd, batch=16, ckpt=ck / "s")
    second = await workload(probe, "hf_switch", {"dp": dp, "zero": 3}, list(range(dp)), steps, cmd, batch=16,
                            ckpt=ck / "s")
    base = await workload(probe, "hf_switch", {"dp": 1}, [0], steps, cmd, batch=16, ckpt=ck / "b")
    if not (first["ok"] and second["ok"] and base["ok"]):
        out.append(check("hf_switch", False, [c["detail"] for c in (first, second, base) if not c["ok"]]))
        return out
    got = json.loads((ck / "s" / "manifest.json").read_text())
    ref = json.loads((ck / "b" / "manifest.json").read_text())
    diff = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    ok = got["step"] == steps and got["format"] == "gearshift-dcp-v1" and diff < 1e-6
    out.append(check("hf_switch", ok, f"DP1 -> DP{dp}+ZeRO-3 at step {steps // 2} through DCP: final loss "
                                      f"{got['loss']} vs uninterrupted {ref['loss']} (rel {diff:.1e})"))
    return out


async def one_switch(n_gpus: int, steps: int) -> dict[str, Any]:
    """Submit the reference workload as DP1 to a local cluster whose agent
    reads the real GPUs, switch it once, and see it finish."""
    from gearshift.bus.client import call
    from gearshift.bus_schema import codec
    from gearshift.bus_schema import subjects as subj
    from gearshift.bus_schema.messages import JobSpec, JobState, ReconfigureReply, ReconfigureRequest
    from gearshift.client import Client
    from gearshift.cluster import LocalCluster

    to = Plan(dp=2) if n_gpus >= 2 else Plan(dp=1, ga=2)
    with tempfile.TemporaryDirectory(prefix="gpucheck-switch-") as tmp:
        with LocalCluster(nodes=1, gpus_per_node=n_gpus, interval=1.0, grace=30.0, real_gpus=True,
                          data_dir=str(Path(tmp) / "cluster")) as cluster:
            client = await Client.connect(cluster.url, retry_for=10)
            try:
                spec = codec.convert(reference.job_spec("gpucheck-switch", steps=steps, global_batch=64, gpus=1,
                                                        plan={"dp": 1}), JobSpec)
                job_id = (await client.submit(spec, token=f"gpucheck-{int(time.time())}")).job_id
                t0, asked = time.monotonic(), False
                while True:
                    rec = await client.job(job_id)
                    if rec.terminal:
                        break
                    if not asked and rec.state == JobState.RUNNING and rec.steps_done >= steps // 3:
                        req = codec.convert({"job_id": job_id, "plan": codec.to_builtins(to),
                                             "placement": [{"node": "node0", "gpus": to.gpus}],
                                             "reason": "gpu_check"}, ReconfigureRequest)
                        await call(client.nc, subj.OPTIMIZER + ".reconfigure", req, ReconfigureReply, timeout=10)
                        asked = True
                    if time.monotonic() - t0 > 480:
                        return check("switch", False, f"job not finished after 480 s: {rec.state.value}")
                    await asyncio.sleep(0.5)
            finally:
                await client.close()
    ok = rec.state == JobState.COMPLETED and asked and rec.generation >= 2 and rec.plan == to
    return check("switch", ok, f"job {rec.state.value} at step {rec.steps_done}, generation {rec.generation}, "
                               f"plan {rec.plan.label()} (asked {to.label()}: {asked})")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    probe = NvmlProbe()
    try:
        await probe.open()
    except NoGpuDriver as exc:
        return {"ok": True, "skipped": True, "reason": f"no usable NVIDIA driver: {exc}"}
    started = time.monotonic()
    checks = []
    try:
        gpus = await probe.sample()
        if not gpus:
            return {"ok": True, "skipped": True, "reason": "NVML works but lists no GPU this process may use",
                    "notes": probe.notes}
        checks.append(probe_contract(gpus))
        checks.append(ranks_see_their_gpu(gpus))
        checks.append(await pid_attribution(probe, gpus))
        if not reference.have_torch():
            checks += [check(n, None, "torch is not installed") for n in ("workload_dp", "workload_tp", "switch")]
        else:
            dp = min(2, len(gpus))
            checks.append(await workload(probe, "workload_dp", Plan(dp=dp), list(range(dp)), args.steps))
            checks.append(await workload(probe, "workload_tp", Plan(dp=1, tp=2), [0, 1], args.steps) if len(gpus) >= 2
                          else check("workload_tp", None, "TP needs 2 GPUs; this machine has 1"))
            checks.append(await one_switch(len(gpus), args.steps * 2) if not args.no_switch
                          else check("switch", None, "--no-switch"))
            checks += await hf_checks(probe, len(gpus), args.steps)
    finally:
        await probe.close()
    failed = [c["name"] for c in checks if c["ok"] is False]
    return {"ok": not failed, "skipped": False, "failed": failed, "checks": checks, "notes": probe.notes,
            "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="steps of each workload run")
    ap.add_argument("--no-switch", action="store_true", help="skip the cluster switch (the slowest part)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    elif result.get("skipped"):
        print(f"skipped: {result['reason']}")
    else:
        for c in result["checks"]:
            mark = "SKIP" if c["skipped"] else ("PASS" if c["ok"] else "FAIL")
            print(f"{mark:4} {c['name']}: {c['detail']}")
        print("OK" if result["ok"] else f"FAILED: {result['failed']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
