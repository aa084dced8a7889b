"""NvmlProbe against a scripted NVML library (tests/nvml_fake.py): every defect
of issue 14's review, through the probe's real code; and an unhealthy GPU
given no work by the real optimizer over a real nats-server."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pynvml
import pytest

from gearshift.agent import launch
from gearshift.agent.probe import FakeProbe, NvmlProbe, cuda_visible_devices
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    GpuHealth,
    GpuProcess,
    GpuReport,
    JobState,
    NodePlacement,
    NodeReport,
    Plan,
)
from tests.nvml_fake import FakeGpu, GiB, ScriptedNvml

U = [f"GPU-{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]


def gpus(n: int = 2, **kw) -> list[FakeGpu]:
    return [FakeGpu(uuid=U[i], **kw) for i in range(n)]


async def opened(nv: ScriptedNvml, visible: str | None = None, sample_timeout: float = 5.0, **kw) -> NvmlProbe:
    # a generous deadline: a loaded machine must not make a healthy GPU read late
    probe = NvmlProbe(nvml=nv, visible=visible, xid_poll_ms=20, sample_timeout=sample_timeout, **kw)
    await probe.open()
    return probe


async def until(probe: NvmlProbe, pred, timeout: float = 10.0) -> list[GpuReport]:
    deadline = time.monotonic() + timeout
    while True:
        reps = await probe.sample()
        if pred(reps):
            return reps
        assert time.monotonic() < deadline, f"not reached: {reps}"
        await asyncio.sleep(0.02)


async def test_healthy_gpus_report_real_uuids_v2_memory_and_processes():
    g = gpus(2)
    g[0].used, g[0].procs = 3 * GiB, [(4242, 3 * GiB)]
    nv = ScriptedNvml(g)
    probe = await opened(nv)
    try:
        r0, r1 = await probe.sample()
        assert [r0.index, r1.index] == [0, 1] and (r0.uuid, r1.uuid) == (U[0], U[1])
        assert r0.healthy and r1.healthy and r0.name == "NVIDIA H200"
        # v2: the driver's reserved memory is not "used"; v1 would say 3.5 GiB
        assert r0.memory_used == 3 * GiB and r1.memory_used == 0 and r0.memory_total == 141 * GiB
        assert [(p.pid, p.used_memory) for p in r0.processes] == [(4242, 3 * GiB)] and not r1.processes
        assert r0.utilization == 7.0
        rep = NodeReport(node="n", ts=time.time(), gpus=[r0, r1], cpus=4)
        assert codec.decode(codec.encode(rep), NodeReport) == rep
    finally:
        await probe.close()


@pytest.mark.parametrize("error, health", [
    (pynvml.NVMLError_GpuIsLost, GpuHealth.LOST),
    (pynvml.NVMLError_ResetRequired, GpuHealth.RESET_REQUIRED),
    (pynvml.NVMLError_Unknown, GpuHealth.ERROR),
])
async def test_a_gpu_failing_after_open_is_unhealthy_with_its_real_identity(error, health):
    nv = ScriptedNvml(gpus(2))
    probe = await opened(nv)
    try:
        nv.gpus[1].fail["nvmlDeviceGetMemoryInfo"] = error
        r0, r1 = await probe.sample()
        assert r0.healthy and r1.health == health and not r1.healthy
        assert r1.uuid == U[1] and "nvmlDeviceGetMemoryInfo" in r1.health_reason
        assert r1.memory_total == 141 * GiB and r1.memory_used == r1.memory_total  # nothing free on it
    finally:
        await probe.close()


async def test_a_gpu_lost_before_open_is_listed_unhealthy_without_a_made_up_uuid():
    nv = ScriptedNvml(gpus(3))
    nv.gpus[1].fail["nvmlDeviceGetUUID"] = pynvml.NVMLError_GpuIsLost
    nv.handle_errors[2] = pynvml.NVMLError_GpuIsLost
    probe = await opened(nv)
    try:
        reps = await probe.sample()
        assert [r.health for r in reps] == [GpuHealth.OK, GpuHealth.LOST, GpuHealth.LOST]
        assert [r.uuid for r in reps] == [U[0], "", ""]
        assert not any(r.uuid.startswith("GPU-index") for r in reps)
    finally:
        await probe.close()


async def test_restricted_cgroup_skips_devices_without_permission():
    nv = ScriptedNvml(gpus(3))
    nv.handle_errors[1] = pynvml.NVMLError_NoPermission
    probe = await opened(nv)
    try:
        reps = await probe.sample()
        assert [(r.index, r.uuid) for r in reps] == [(0, U[0]), (1, U[2])]
        assert any("GPU 1: no permission" in n for n in probe.notes)
    finally:
        await probe.close()
    # nvmlDeviceGetCount itself refused: devices are tried one by one
    nv = ScriptedNvml(gpus(3))
    nv.count_error = pynvml.NVMLError_NoPermission
    nv.handle_errors[0] = pynvml.NVMLError_NoPermission
    probe = await opened(nv)
    try:
        assert [r.uuid for r in await probe.sample()] == [U[1], U[2]]
    finally:
        await probe.close()


async def test_old_driver_falls_back_to_v2_processes_and_v1_memory():
    g = gpus(1)
    g[0].used, g[0].procs = GiB, [(77, GiB)]
    nv = ScriptedNvml(g)
    nv.missing |= {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMemoryInfo_v2"}
    probe = await opened(nv)
    try:
        for _ in range(2):
            (r,) = await probe.sample()
            assert r.healthy and [p.pid for p in r.processes] == [77]
            assert r.memory_used == GiB + GiB // 2  # v1 counts the reserved memory
        assert nv.calls["nvmlDeviceGetComputeRunningProcesses"] == 3  # v3 tried once, then v2 each time
        # no process API at all: the unversioned call raises NVMLLibraryMismatchError (not an NVMLError)
        nv.missing.add("nvmlDeviceGetComputeRunningProcesses_v2")
        (r,) = await probe.sample()
        assert r.healthy and r.processes == [] and r.memory_total == 141 * GiB
    finally:
        await probe.close()


async def test_critical_xid_makes_its_gpu_unhealthy_and_application_xids_do_not():
    nv = ScriptedNvml(gpus(2))
    probe = await opened(nv)
    try:
        assert sorted(nv.registered) == [U[0], U[1]]
        nv.xid(U[0], 13)  # graphics engine exception: the application's fault
        nv.xid(U[1], 79)  # fallen off the bus
        r0, r1 = await until(probe, lambda r: not r[1].healthy)
        assert r1.health == GpuHealth.XID and "79" in r1.health_reason and r0.healthy
    finally:
        await probe.close()


async def test_a_hung_nvml_call_makes_the_gpu_stale_not_the_heartbeat():
    nv = ScriptedNvml(gpus(2))
    probe = await opened(nv, sample_timeout=1.0)
    try:
        await probe.sample()
        release = threading.Event()
        nv.gpus[1].hang = release
        r0, r1 = await probe.sample()  # returns: GPU 1's call is stuck in its thread
        assert r0.healthy and r1.health == GpuHealth.STALE and r1.uuid == U[1]
        stuck = ("nvmlDeviceGetMemoryInfo", U[1])
        assert nv.calls[stuck] == 3  # listing, the healthy sample, now (hung)
        r0, r1 = await probe.sample()
        assert r1.health == GpuHealth.STALE and "not answered" in r1.health_reason
        assert nv.calls[stuck] == 3  # not started again while the first call hangs
        nv.gpus[1].hang = None
        release.set()
        await until(probe, lambda r: r[1].healthy)
    finally:
        await probe.close()


async def test_nvml_is_initialised_once_and_again_after_a_driver_reload():
    nv = ScriptedNvml(gpus(2))
    probe = await opened(nv)
    await probe.open()  # agent.run_agent and Agent.start both open
    assert nv.init_calls == 1
    try:
        nv.unload_driver()
        reps = await until(probe, lambda r: all(g.health == GpuHealth.NO_DRIVER for g in r))
        assert [r.uuid for r in reps] == U[:2]
        nv.load_driver()
        await until(probe, lambda r: all(g.healthy for g in r))
        assert nv.init_calls >= 2
    finally:
        await probe.close()
    assert nv.refcount == 0  # every successful nvmlInit was shut down
    await probe.close()  # closing twice is harmless
    assert nv.refcount == 0


async def test_init_and_shutdown_balance():
    nv = ScriptedNvml(gpus(1))
    probe = await opened(nv)
    await probe.open()
    assert nv.refcount == 1
    await probe.close()
    assert (nv.init_calls, nv.shutdown_calls, nv.refcount) == (1, 1, 0)


def _rank_env(gpu_indices: list[int], base: dict | None = None) -> dict:
    alloc = Allocation(job_id="j", generation=1, plan=Plan(dp=len(gpu_indices)),
                       placement=[NodePlacement(node="n", gpus=gpu_indices)], command=["true"], steps=1,
                       global_batch=1)
    return {spec.local_rank: launch.environment(alloc, spec, node="n", master_addr="127.0.0.1",
                                                ckpt_dir=Path("/tmp/c"), progress_file=Path("/tmp/p"),
                                                base=base or {})
            for spec in launch.rank_specs(alloc, "n")}


async def test_ranks_get_uuids_and_mig_instances_get_mig_uuids():
    g = gpus(2)
    g[1].mig = [FakeGpu(uuid="MIG-1111aaaa-0000-0000-0000-000000000001", name="H200 1g.18gb", total=18 * GiB),
                FakeGpu(uuid="MIG-1111aaaa-0000-0000-0000-000000000002", name="H200 1g.18gb", total=18 * GiB)]
    nv = ScriptedNvml(g)
    probe = await opened(nv)
    try:
        reps = await probe.sample()
        assert [r.uuid for r in reps] == [U[0], g[1].mig[0].uuid, g[1].mig[1].uuid]
        assert reps[1].memory_total == 18 * GiB and reps[1].utilization is None and reps[1].healthy
        envs = _rank_env([0, 2])
        assert [envs[i]["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == [U[0], g[1].mig[1].uuid]
        assert U[1] in nv.registered  # XIDs of MIG instances come from their GPU
        with pytest.raises(ValueError, match=r"\[5\]"):
            cuda_visible_devices([5])
    finally:
        await probe.close()
    assert _rank_env([0, 1])[1]["CUDA_VISIBLE_DEVICES"] == "1"  # no NVML probe open: emulated GPUs


@pytest.mark.parametrize("visible, want", [
    ("1", [1]), ("2,0", [2, 0]), (U[3][:12], [3]), (f"{U[2]},bogus,{U[0]}", [2]), ("", []),
])
async def test_an_inherited_cuda_visible_devices_restricts_the_gpus(visible, want):
    g = gpus(4)
    for i, pci in enumerate(["0000:40:00.0", "0000:10:00.0", "0000:80:00.0", "0000:C0:00.0"]):
        g[i].pci = pci  # NVML order is not PCI order here: CUDA indices follow the PCI order
    pci_order = [1, 0, 2, 3]
    nv = ScriptedNvml(g)
    probe = await opened(nv, visible=visible)
    try:
        reps = await probe.sample()
        expect = [U[pci_order[w]] if visible[:1].isdigit() else U[w] for w in want]
        assert [r.uuid for r in reps] == expect and [r.index for r in reps] == list(range(len(want)))
    finally:
        await probe.close()


async def test_unhealthy_gpu_gets_no_work_from_the_optimizer(nc):
    """Probe report -> gs_nodes -> the real optimizer: a job that fits only
    with the lost GPU waits; a smaller one lands on healthy GPUs only."""
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer
    from tests.test_optimizer import _state, job, submit, wait_for

    nv = ScriptedNvml(gpus(4))
    nv.gpus[2].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVMLError_GpuIsLost
    probe = await opened(nv)
    try:
        reps = await probe.sample()
    finally:
        await probe.close()
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    _, svc = await start_admission(nc)
    opt = await Optimizer(nc, interval=0.2, lease_ttl=2, max_retries=1).open()
    stop = asyncio.Event()

    async def heartbeat():
        while not stop.is_set():
            await kv.put("n0", codec.encode(NodeReport(node="n0", ts=time.time(), gpus=reps, cpus=32)))
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(heartbeat()), asyncio.create_task(opt.run(stop))]
    try:
        small = await submit(nc, "three", 3)
        rec = await wait_for(lambda: _state(nc, small, JobState.SCHEDULED))
        assert rec.placement[0].gpus == [0, 1, 3]
        one = await submit(nc, "one", 1)  # only the lost GPU 2 is unused
        for _ in range(3):
            await opt.round()
        assert (await job(nc, one)).state == JobState.PENDING
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await svc.stop()


async def test_fake_probe_reports_scripted_health():
    probe = FakeProbe(2, 1000, node="x")
    probe.script[1] = GpuReport(index=1, uuid="GPU-fake-x-1", memory_total=1000, memory_used=1000,
                                health=GpuHealth.XID, health_reason="critical XID 48")
    reps = await probe.sample()
    assert reps[0].healthy and not reps[1].healthy


def test_old_reports_without_health_decode_as_healthy():
    old = b'{"node":"n","ts":1.0,"cpus":1,"gpus":[{"index":0,"uuid":"GPU-x","memory_total":5}]}'
    (g,) = codec.decode(old, NodeReport).gpus
    assert g.health == GpuHealth.OK and g.healthy


async def test_fake_probe_follows_claims_and_reuses_unchanged_reports():
    """The fleet emulator samples 16,000 fake GPUs every 2 s: a GPU's report is
    built again only when its holders change."""
    probe = FakeProbe(2, memory_bytes=100, busy_fraction=0.5, node="n")
    first = await probe.sample()
    probe.claim([1], [41, 42])
    second = await probe.sample()
    assert second[0] is first[0]  # unchanged: the same report
    assert second[1].processes == [GpuProcess(pid=41, used_memory=25), GpuProcess(pid=42, used_memory=25)]
    assert second[1].memory_used == 50 and second[1].utilization == 100.0
    probe.release([1])
    third = await probe.sample()
    assert third[1].processes == [] and third[1].memory_used == 0 and third[1].utilization == 0.0
