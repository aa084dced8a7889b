"""A scripted NVML library for the probe's tests: the GPU is the one part the
project rules allow to be a stand-in.

It has pynvml's function names and signatures, and pynvml's own constants and
exception classes (the real ``NVMLError_GpuIsLost``, ``NVMLLibraryMismatchError``
...), so ``NvmlProbe(nvml=ScriptedNvml(...))`` runs the probe's real code. A test
scripts GPUs, failures per function, missing functions (an older driver), hung
calls, XID events and a driver reload.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

GiB = 2**30


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 141 * GiB
    used: int = 0  # what applications hold (v2 "used")
    reserved: int = GiB // 2  # the driver's own (v1 "used" counts it)
    util: int = 7
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    pci: str = ""
    fail: dict[str, type] = field(default_factory=dict)  # function name -> pynvml error class it raises
    hang: threading.Event | None = None  # set: calls block until it is set
    hang_on: str = "nvmlDeviceGetMemoryInfo"
    mig: list["FakeGpu"] | None = None  # MIG instances: MIG mode is on
    fabric: tuple[bytes, int] | None = None  # (cluster UUID, clique) of its multi-node NVLink domain


class _Handle:
    def __init__(self, gpu: FakeGpu, parent: FakeGpu | None = None):
        self.gpu, self.parent = gpu, parent


class ScriptedNvml:
    """Instances stand where the ``pynvml`` module would."""

    def __init__(self, gpus: list[FakeGpu]):
        for name in dir(pynvml):  # the real constants and exception classes
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlMemory_v")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError
        self.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
        self.c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t
        self.gpus = gpus
        for i, g in enumerate(gpus):
            g.pci = g.pci or f"00000000:{0x18 + i * 0x10:02X}:00.0"
        self.count_error: type | None = None
        self.handle_errors: dict[int, type] = {}
        self.missing: set[str] = set()  # C symbols this "driver" lacks
        self.init_calls = self.shutdown_calls = self.refcount = 0
        self.driver_loaded = True
        self._live = False  # initialised since the driver (re)loaded
        self.calls: dict = {}  # function name -> calls, and (name, uuid) -> calls on that GPU
        self.events: queue.Queue = queue.Queue()
        self.registered: list[str] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ scripting
    def unload_driver(self) -> None:
        self.driver_loaded, self._live = False, False

    def load_driver(self) -> None:
        self.driver_loaded = True

    def xid(self, uuid: str, xid: int) -> None:
        gpu = next(g for g in self.gpus if g.uuid == uuid)
        self.events.put(SimpleNamespace(device=_Handle(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError,
                                        eventData=xid, gpuInstanceId=0, computeInstanceId=0))

    # ------------------------------------------------------------ plumbing
    def _enter(self, fn: str, handle: _Handle | None = None, symbol: str | None = None) -> FakeGpu | None:
        with self._lock:
            self.calls[fn] = self.calls.get(fn, 0) + 1
        if (symbol or fn) in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if not self._live:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = handle.gpu
        with self._lock:
            self.calls[(fn, gpu.uuid)] = self.calls.get((fn, gpu.uuid), 0) + 1
        for g in (handle.parent, gpu):
            if g is not None and fn in g.fail:
                raise g.fail[fn]()
        if gpu.hang is not None and fn == gpu.hang_on:
            gpu.hang.wait()
        return gpu

    # ------------------------------------------------------------ pynvml's API
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._live = True
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self.refcount = max(0, self.refcount - 1)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        if self.count_error:
            raise self.count_error()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if i in self.handle_errors:
            raise self.handle_errors[i]()
        if not 0 <= i < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(self.gpus[i])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle:
        self._enter("nvmlDeviceGetHandleByUUID")
        for g in self.gpus:
            if g.uuid == uuid:
                return _Handle(g)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._enter("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetGpuFabricInfo(self, h: _Handle, info) -> int:
        gpu = self._enter("nvmlDeviceGetGpuFabricInfo", h)
        if gpu.fabric is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        uuid, clique = gpu.fabric
        info.clusterUuid[:] = list(uuid.ljust(16, b"\0")[:16])
        info.cliqueId, info.status, info.state = clique, 0, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        return 0

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._enter("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: _Handle):
        return SimpleNamespace(busId=self._enter("nvmlDeviceGetPciInfo", h).pci.encode())

    def nvmlDeviceGetMigMode(self, h: _Handle):
        g = self._enter("nvmlDeviceGetMigMode", h)
        if g.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        return 7 if self._enter("nvmlDeviceGetMaxMigDeviceCount", h).mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, j: int) -> _Handle:
        g = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if g.mig is None or j >= len(g.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(g.mig[j], parent=g)

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version=None):
        g = self._enter("nvmlDeviceGetMemoryInfo", h, "nvmlDeviceGetMemoryInfo_v2" if version else None)
        if version:
            return SimpleNamespace(version=version, total=g.total, reserved=g.reserved, used=g.used,
                                   free=g.total - g.reserved - g.used)
        return SimpleNamespace(total=g.total, used=g.used + g.reserved, free=g.total - g.used - g.reserved)

    def nvmlDeviceGetUtilizationRates(self, h: _Handle):
        g = self._enter("nvmlDeviceGetUtilizationRates", h)
        if h.parent is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # as on a MIG instance
        return SimpleNamespace(gpu=g.util, memory=0)

    def _procs(self, fn: str, h: _Handle):
        g = self._enter("nvmlDeviceGetComputeRunningProcesses", h, fn)
        return [SimpleNamespace(pid=p, usedGpuMemory=m, gpuInstanceId=0, computeInstanceId=0) for p, m in g.procs]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: _Handle):
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: _Handle):
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", h)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle):
        # pynvml 12+: the unversioned call is v3 behind throwOnVersionMismatch
        try:
            return self.nvmlDeviceGetComputeRunningProcesses_v3(h)
        except pynvml.NVMLError_FunctionNotFound:
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does "
                                                  "not match the NVML lib version") from None

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, h: _Handle, types: int, es) -> None:
        g = self._enter("nvmlDeviceRegisterEvents", h)
        self.registered.append(g.uuid)

    def nvmlEventSetWait_v2(self, es, timeout_ms: int):
        self._enter("nvmlEventSetWait_v2")
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, es) -> None:
        pass
