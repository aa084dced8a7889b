"""loadtest.gpu_check: skips cleanly without a driver; its probe contract
check judges real probe output (from the scripted NVML library)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from gearshift.agent.probe import NvmlProbe
from loadtest.gpu_check import probe_contract, rank_env, uuid_hex
from tests.nvml_fake import FakeGpu, ScriptedNvml

ROOT = Path(__file__).resolve().parent.parent


def test_without_a_driver_it_skips_with_a_reason_and_exit_0():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    p = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--json"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["skipped"] is True and "NVML" in out["reason"]


async def _sample(nv):
    probe = NvmlProbe(nvml=nv, visible=None, xid_poll_ms=20)
    await probe.open()
    try:
        return await probe.sample()
    finally:
        await probe.close()


async def test_probe_contract_passes_healthy_gpus_and_fails_a_lost_one():
    uuids = ["GPU-aaaaaaaa-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444"]
    good = probe_contract(await _sample(ScriptedNvml([FakeGpu(uuid=u) for u in uuids])))
    assert good["ok"] is True and len(good["gpus"]) == 2
    nv = ScriptedNvml([FakeGpu(uuid=u) for u in uuids])
    nv.gpus[1].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVMLError_GpuIsLost
    bad = probe_contract(await _sample(nv))
    assert bad["ok"] is False and any("GPU 1" in p and "lost" in p for p in bad["detail"])


async def test_a_rank_for_gpu_i_gets_nvml_uuid_of_i():
    uuids = ["GPU-aaaaaaaa-1111-2222-3333-444444444444", "MIG-bbbbbbbb-1111-2222-3333-444444444444"]
    probe = NvmlProbe(nvml=ScriptedNvml([FakeGpu(uuid=u) for u in uuids]), visible=None, xid_poll_ms=20)
    await probe.open()
    try:
        assert rank_env([1])["CUDA_VISIBLE_DEVICES"] == uuids[1]
        assert uuid_hex(uuids[1]) == "bbbbbbbb111122223333444444444444"
    finally:
        await probe.close()
