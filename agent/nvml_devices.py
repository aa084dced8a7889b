"""NVML as ``NvmlProbe`` uses it: which devices this agent may schedule, how
one device is read, what a failed call says about its GPU, and the XID watcher.

Every function takes the NVML module as ``nv`` (nvidia-ml-py's ``pynvml`` in
production; in tests a scripted library with pynvml's function names,
constants and exception classes), so the code paths tested are these ones.

Rules, from NVML's documentation and what fails in the field:
- GPU_IS_LOST, RESET_REQUIRED and UNKNOWN mean the GPU is unusable: the GPU is
  reported unhealthy, never as a free GPU with made-up values.
- NOT_SUPPORTED / NO_PERMISSION on one metric (MIG, vGPU, containers) only
  mean "this metric is unknown".
- UNINITIALIZED / DRIVER_NOT_LOADED mean NVML itself went away (driver reload):
  the probe re-initialises.
- FUNCTION_NOT_FOUND (and pynvml's ``NVMLLibraryMismatchError``, which is not
  an ``NVMLError``) mean an older driver: fall back to an older API version.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from gearshift.bus_schema.messages import GpuHealth, GpuProcess, GpuReport

# XIDs an application causes (illegal address, page fault, context stopped by
# the user, ...), not the GPU: the list NVIDIA's Kubernetes device plugin skips.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
MAX_PROBED_INDEX = 64  # devices tried one by one when nvmlDeviceGetCount is refused
# newest first; the unversioned name is v1 in older bindings
PROCESS_APIS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                "nvmlDeviceGetComputeRunningProcesses")


class Reinit(Exception):
    """NVML is uninitialised or lost its driver: re-initialise before the next read."""


class DeviceFailed(Exception):
    def __init__(self, health: GpuHealth, reason: str):
        super().__init__(reason)
        self.health, self.reason = health, reason


def fabric_domain(nv: Any, handle: Any) -> str | None:
    """The multi-node NVLink domain a GPU belongs to (``nvmlDeviceGetGpuFabricInfo``:
    cluster UUID and clique, once the fabric manager has registered it), as a topology
    value: GPUs with the same one are one NVLink island. None where the GPU or the
    library reports none (no NVSwitch fabric, older driver)."""
    fn = getattr(nv, "nvmlDeviceGetGpuFabricInfo", None)
    kind = getattr(nv, "c_nvmlGpuFabricInfo_t", None)
    if fn is None or kind is None:
        return None
    info = kind()
    try:
        fn(handle, info)
    except nv.NVMLError:
        return None
    if info.state != getattr(nv, "NVML_GPU_FABRIC_STATE_COMPLETED", 3) or info.status != 0:
        return None
    uuid = bytes(info.clusterUuid)
    if not any(uuid):
        return None
    return f"{uuid.hex()[:16]}.{info.cliqueId}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def health_of(nv: Any, exc: BaseException) -> GpuHealth | None:
    """What a failed call says about its GPU; None when it says only "this
    metric is unknown". Raises ``Reinit`` when NVML itself is gone."""
    if isinstance(exc, (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded)):
        raise Reinit(f"NVML: {exc}")
    if isinstance(exc, nv.NVMLError_GpuIsLost):
        return GpuHealth.LOST
    if isinstance(exc, nv.NVMLError_ResetRequired):
        return GpuHealth.RESET_REQUIRED
    if isinstance(exc, nv.NVMLError_Unknown):
        return GpuHealth.ERROR
    return None


def call(nv: Any, fn: Callable, *args: Any, **kw: Any) -> Any:
    """``fn(*args)``; None when the GPU does not support or allow it;
    ``DeviceFailed`` when the error says the GPU is unusable."""
    try:
        return fn(*args, **kw)
    except nv.NVMLError as exc:
        health = health_of(nv, exc)
        if health is None:
            return None
        raise DeviceFailed(health, f"{getattr(fn, '__name__', 'nvml')}: {exc}") from None


@dataclass
class Device:
    """One schedulable device: a whole GPU, or a MIG instance when MIG is on."""

    handle: Any
    nvml_index: int  # NVML index of the physical GPU
    uuid: str = ""
    name: str = ""
    parent_uuid: str = ""  # the physical GPU's UUID (== uuid unless MIG)
    pci_bus: str = ""
    mig: bool = False
    memory_total: int = 0
    health: GpuHealth = GpuHealth.OK  # unhealthy already when listed
    reason: str = ""
    index: int = -1  # position in the agent's table, set by ``enumerate_devices``

    def unhealthy(self, health: GpuHealth, reason: str, last: GpuReport | None = None) -> GpuReport:
        """The report of a GPU that gets no work: what is known of it, and nothing free."""
        total = self.memory_total or (last.memory_total if last else 0)
        return GpuReport(index=self.index, uuid=self.uuid, name=self.name, memory_used=total, memory_total=total,
                         utilization=None, processes=list(last.processes) if last else [],
                         health=health, health_reason=reason[:256])


class Api:
    """Which versions of the versioned calls this driver has (shared by the
    reading threads; a version is dropped once, the first time it is missing)."""

    def __init__(self, nv: Any):
        self.memory_v2 = hasattr(nv, "nvmlMemory_v2")
        self.process_fns = [getattr(nv, n) for n in PROCESS_APIS if hasattr(nv, n)]
        self._lock = threading.Lock()

    def drop_process_fn(self, fn: Callable) -> None:
        with self._lock:
            if fn in self.process_fns:
                self.process_fns.remove(fn)


def _missing_function(nv: Any) -> tuple[type, ...]:
    return (nv.NVMLError_FunctionNotFound, nv.NVMLLibraryMismatchError)


# ---------------------------------------------------------------- listing
def enumerate_devices(nv: Any, visible: str | None) -> tuple[list[Device], list[str]]:
    """The devices this agent schedules, in order, and notes on what was
    skipped. Devices outside this cgroup (NO_PERMISSION) are skipped; a MIG-mode
    GPU contributes its MIG instances; an inherited ``CUDA_VISIBLE_DEVICES``
    (``visible``) restricts the list the way CUDA would."""
    notes: list[str] = []
    devices: list[Device] = []
    for i, handle in _physical_handles(nv, notes):
        dev = Device(handle=handle, nvml_index=i)
        if isinstance(handle, _Unreachable):
            dev.health, dev.reason = handle.health, handle.reason
            devices.append(dev)
            continue
        try:
            dev.uuid = text(call(nv, nv.nvmlDeviceGetUUID, handle) or "")
            dev.parent_uuid = dev.uuid
            dev.name = text(call(nv, nv.nvmlDeviceGetName, handle) or "")
            pci = call(nv, nv.nvmlDeviceGetPciInfo, handle) if hasattr(nv, "nvmlDeviceGetPciInfo") else None
            dev.pci_bus = text(getattr(pci, "busId", "") or "").lower()
            mode = call(nv, nv.nvmlDeviceGetMigMode, handle) if hasattr(nv, "nvmlDeviceGetMigMode") else None
            if mode and mode[0] == nv.NVML_DEVICE_MIG_ENABLE:
                migs = _mig_devices(nv, dev, notes)
                devices.extend(migs)
                if not migs:
                    notes.append(f"GPU {i} ({dev.uuid}): MIG mode on but no MIG instance: nothing to schedule")
                continue
            mem = call(nv, nv.nvmlDeviceGetMemoryInfo, handle)
            dev.memory_total = int(getattr(mem, "total", 0) or 0)
        except DeviceFailed as failed:
            dev.health, dev.reason = failed.health, failed.reason
        devices.append(dev)
    devices = restrict(devices, visible, notes)
    for k, dev in enumerate(devices):
        dev.index = k
    return devices, notes


def _physical_handles(nv: Any, notes: list[str]) -> list[tuple[int, Any]]:
    try:
        indices, probing = range(nv.nvmlDeviceGetCount()), False
    except nv.NVMLError_NoPermission:
        notes.append("nvmlDeviceGetCount: no permission; trying devices one by one")
        indices, probing = range(MAX_PROBED_INDEX), True
    out = []
    for i in indices:
        try:
            out.append((i, nv.nvmlDeviceGetHandleByIndex(i)))
        except nv.NVMLError_NoPermission:
            notes.append(f"GPU {i}: no permission (outside this cgroup?): skipped")
        except (nv.NVMLError_InvalidArgument, nv.NVMLError_NotFound):
            if probing:
                break
            notes.append(f"GPU {i}: no such device: skipped")
        except nv.NVMLError as exc:
            health = health_of(nv, exc)
            if health is None:
                notes.append(f"GPU {i}: {exc}: skipped")
            else:  # listed, unusable: shown so an operator sees it, given no work
                out.append((i, _Unreachable(health, f"nvmlDeviceGetHandleByIndex: {exc}")))
    return out


class _Unreachable:
    """Stands for the handle of a GPU NVML could not open."""

    def __init__(self, health: GpuHealth, reason: str):
        self.health, self.reason = health, reason


def _mig_devices(nv: Any, parent: Device, notes: list[str]) -> list[Device]:
    out = []
    for j in range(nv.nvmlDeviceGetMaxMigDeviceCount(parent.handle)):
        try:
            mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent.handle, j)
        except nv.NVMLError_NotFound:
            continue  # an empty slot
        dev = Device(handle=mh, nvml_index=parent.nvml_index, parent_uuid=parent.uuid, pci_bus=parent.pci_bus,
                     mig=True)
        try:
            dev.uuid = text(call(nv, nv.nvmlDeviceGetUUID, mh) or "")
            dev.name = text(call(nv, nv.nvmlDeviceGetName, mh) or parent.name)
            mem = call(nv, nv.nvmlDeviceGetMemoryInfo, mh)
            dev.memory_total = int(getattr(mem, "total", 0) or 0)
        except DeviceFailed as failed:
            dev.health, dev.reason = failed.health, failed.reason
        out.append(dev)
    return out


def restrict(devices: list[Device], visible: str | None, notes: list[str]) -> list[Device]:
    """Keep what an inherited ``CUDA_VISIBLE_DEVICES`` allows, in its order.
    Entries are UUIDs (``GPU-``/``MIG-``, unique prefixes allowed) or CUDA
    indices, read in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``). Like
    CUDA, the first entry that matches nothing ends the list."""
    if visible is None:
        return devices
    physical = sorted({(d.pci_bus, d.nvml_index) for d in devices})
    out: list[Device] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < len(physical):
            key = physical[int(entry)]
            chosen = [d for d in devices if (d.pci_bus, d.nvml_index) == key]
        elif entry.upper().startswith(("GPU-", "MIG-")):
            chosen = [d for d in devices if d.uuid.lower().startswith(entry.lower())]
            if not chosen:  # a GPU UUID of a MIG-mode GPU: its instances
                chosen = [d for d in devices if d.mig and d.parent_uuid.lower().startswith(entry.lower())]
        else:
            chosen = []
        if not chosen:
            notes.append(f"CUDA_VISIBLE_DEVICES={visible!r}: {entry!r} matches no device; later entries ignored")
            break
        out.extend(d for d in chosen if d not in out)
    return out


# ---------------------------------------------------------------- reading
def read(nv: Any, dev: Device, api: Api) -> GpuReport:
    """One device's report. Raises ``Reinit`` only; every other failure is
    the GPU's health."""
    if dev.health != GpuHealth.OK:
        return dev.unhealthy(dev.health, dev.reason)
    h = dev.handle
    try:
        mem = _memory(nv, h, api)
        util = None if dev.mig else call(nv, nv.nvmlDeviceGetUtilizationRates, h)  # MIG: not supported
        procs = _processes(nv, h, api)
    except DeviceFailed as failed:
        return dev.unhealthy(failed.health, failed.reason)
    if mem is None or not dev.uuid:
        return dev.unhealthy(GpuHealth.UNREADABLE, "UUID or memory not readable through NVML")
    total = int(mem.total)
    return GpuReport(
        index=dev.index, uuid=dev.uuid, name=dev.name, memory_total=total,
        memory_used=min(int(mem.used), total),
        utilization=None if util is None else min(100.0, max(0.0, float(util.gpu))),
        processes=[
            GpuProcess(pid=int(p.pid), used_memory=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs
        ],
    )


def _memory(nv: Any, handle: Any, api: Api) -> Any:
    """v2 (``used`` without the driver's reserved memory) where the driver has it, else v1."""
    if api.memory_v2:
        try:
            return nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
        except _missing_function(nv):
            api.memory_v2 = False
        except nv.NVMLError as exc:
            health = health_of(nv, exc)
            if health is not None:
                raise DeviceFailed(health, f"nvmlDeviceGetMemoryInfo_v2: {exc}") from None
    return call(nv, nv.nvmlDeviceGetMemoryInfo, handle)


def _processes(nv: Any, handle: Any, api: Api) -> list[Any]:
    """Compute processes through the newest process API the driver has."""
    for fn in list(api.process_fns):
        try:
            return fn(handle) or []
        except _missing_function(nv):
            api.drop_process_fn(fn)
        except nv.NVMLError as exc:
            health = health_of(nv, exc)
            if health is not None:
                raise DeviceFailed(health, f"{fn.__name__}: {exc}") from None
            return []  # not supported / not allowed here: processes unknown
    return []


# ---------------------------------------------------------------- XID events
class XidWatcher:
    """Waits for critical XID events on the physical GPUs in a daemon thread
    and calls ``on_xid(parent_uuid, xid)`` ("" when the GPU cannot be told)."""

    def __init__(self, nv: Any, devices: list[Device], on_xid: Callable[[str, int], None], poll_ms: int = 1000):
        self.nv, self.on_xid, self.poll_ms = nv, on_xid, poll_ms
        self.devices = [d for d in devices if not d.mig and not isinstance(d.handle, _Unreachable)]
        self.parents = {d.parent_uuid: d for d in devices if d.mig and d.parent_uuid}
        self.note = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        nv = self.nv
        if not hasattr(nv, "nvmlEventSetCreate"):
            self.note = "no NVML event API: XID errors are not watched"
            return
        try:
            es = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            self.note = f"nvmlEventSetCreate: {exc}: XID errors are not watched"
            return
        handles = [d.handle for d in self.devices]
        # MIG instances take their events from the physical GPU
        for parent_uuid in self.parents:
            try:
                handles.append(nv.nvmlDeviceGetHandleByUUID(parent_uuid))
            except nv.NVMLError:
                pass
        registered = 0
        for h in handles:
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
                registered += 1
            except nv.NVMLError as exc:
                self.note = f"XID events not supported on some GPUs ({exc})"
        if not registered:
            nv.nvmlEventSetFree(es)
            self.note = self.note or "no GPU to watch for XID errors"
            return
        self._thread = threading.Thread(target=self._run, args=(es,), name="nvml-xid", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop, and wait (one poll at most) so the event set is freed before NVML shuts down."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.poll_ms / 1000 + 1.0)

    def _run(self, es: Any) -> None:
        nv = self.nv
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        try:
            while not self._stop.is_set():
                try:
                    data = wait(es, self.poll_ms)
                except nv.NVMLError_Timeout:
                    continue
                except (nv.NVMLError_Uninitialized, nv.NVMLError_DriverNotLoaded):
                    return  # the probe re-initialises and starts a new watcher
                except nv.NVMLError:
                    self._stop.wait(self.poll_ms / 1000)  # a lost GPU: its reads say so
                    continue
                if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                    continue
                xid = int(data.eventData)
                if xid in APPLICATION_XIDS:
                    continue
                try:
                    uuid = text(nv.nvmlDeviceGetUUID(data.device))
                except nv.NVMLError:
                    uuid = ""
                self.on_xid(uuid, xid)
        finally:
            try:
                nv.nvmlEventSetFree(es)
            except nv.NVMLError:
                pass
