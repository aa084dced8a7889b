"""What the agent knows about its GPUs: one small interface, two implementations.

``NvmlProbe`` asks the driver through nvidia-ml-py; ``FakeProbe`` serves
machines without GPUs (tests, ``gearshift up``) with scripted devices. The
agent only calls ``open``/``sample``/``close``, plus ``claim``/``release`` to
tell the probe which job processes hold which GPUs: a real driver sees that
by itself (so NVML ignores it), a fake one has to be told.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import msgspec

from gearshift.agent import nvml_devices as nd
from gearshift.bus_schema.messages import GpuHealth, GpuProcess, GpuReport

_INHERIT = object()


class NoGpuDriver(RuntimeError):
    """NVML cannot be used on this machine (no library, no driver, no permission)."""


@runtime_checkable
class GpuProbe(Protocol):
    kind: str  # "nvml" | "fake", copied into NodeReport.probe

    async def open(self) -> None: ...

    async def sample(self) -> list[GpuReport]: ...

    def claim(self, indices: list[int], pids: list[int]) -> None: ...

    def release(self, indices: list[int]) -> None: ...

    async def close(self) -> None: ...


class FakeProbe:
    """``n_gpus`` scripted GPUs. A claimed GPU reports ``busy_fraction`` of its
    memory used, full utilisation and the claiming pids; tests may script more
    through ``script`` (index -> GpuReport overriding the defaults)."""

    kind = "fake"

    def __init__(
        self,
        n_gpus: int,
        memory_bytes: int = 80 * 2**30,
        name: str = "Fake GPU",
        *,
        node: str = "fake",
        busy_fraction: float = 0.9,
    ):
        if n_gpus < 0:
            raise ValueError("n_gpus must be >= 0")
        self.n_gpus = n_gpus
        self.memory_bytes = memory_bytes
        self.name = name
        self.node = node
        self.busy_fraction = busy_fraction
        self.script: dict[int, GpuReport] = {}
        self._holders: dict[int, list[int]] = {}
        self._reports: dict[int, tuple[tuple[int, ...], GpuReport]] = {}  # index -> (holders, its report)
        self._lock = threading.Lock()

    async def open(self) -> None:
        return None

    def claim(self, indices: list[int], pids: list[int]) -> None:
        with self._lock:
            for i in indices:
                if 0 <= i < self.n_gpus:
                    self._holders[i] = list(pids)

    def release(self, indices: list[int]) -> None:
        with self._lock:
            for i in indices:
                self._holders.pop(i, None)

    async def sample(self) -> list[GpuReport]:
        with self._lock:
            holders = {i: tuple(p) for i, p in self._holders.items()}
        out = []
        for i in range(self.n_gpus):
            if i in self.script:
                out.append(self.script[i])
                continue
            pids = holders.get(i, ())
            got = self._reports.get(i)
            if got is None or got[0] != pids:  # a GPU's report changes only when its holders do
                used = int(self.memory_bytes * self.busy_fraction) if pids else 0
                got = self._reports[i] = (pids, GpuReport(
                    index=i,
                    uuid=f"GPU-fake-{self.node}-{i}",
                    name=self.name,
                    memory_used=used,
                    memory_total=self.memory_bytes,
                    utilization=100.0 if pids else 0.0,
                    processes=[GpuProcess(pid=p, used_memory=used // len(pids)) for p in pids],
                ))
            out.append(got[1])
        return out

    async def close(self) -> None:
        return None


class NvmlProbe:
    """The driver's view through nvidia-ml-py (see ``agent.nvml_devices`` for
    the rules). NVML is initialised once per probe, and again after a driver
    reload. Each GPU is read in its own daemon thread with a deadline
    (``sample_timeout``): a hung NVML call makes that GPU ``stale``, it never
    stops the heartbeat. NVML is documented thread-safe, so GPUs are read in
    parallel. ``nvml`` is the library module (pynvml when None); tests pass a
    scripted one."""

    kind = "nvml"

    def __init__(self, *, nvml: Any = None, sample_timeout: float = 0.5, open_timeout: float = 30.0,
                 xid_poll_ms: int = 1000, visible: str | None | object = _INHERIT):
        self._nv = nvml
        self.sample_timeout = sample_timeout
        self.open_timeout = open_timeout
        self.xid_poll_ms = xid_poll_ms
        # an inherited restriction (the agent started inside a slice of the host)
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is _INHERIT else visible
        self._inited = False
        self._opened = False
        self._devices: list[nd.Device] = []
        self._api: nd.Api | None = None
        self._pending: dict[int, tuple[Future, float]] = {}
        self._last: dict[int, GpuReport] = {}
        self._xids: dict[str, int] = {}  # physical GPU UUID ("" = cannot tell) -> last critical XID
        self._watcher: nd.XidWatcher | None = None
        self._gone: str | None = None  # why NVML must be re-initialised
        self._reinit: Future | None = None
        self.notes: list[str] = []  # devices skipped, APIs missing: for the agent's log
        self.fabric: str | None = None  # the NVLink domain NVML's fabric information names (None: none)

    def _module(self) -> Any:
        if self._nv is None:
            try:
                import pynvml  # lazy: machines without GPUs never need it
            except ImportError as exc:  # pragma: no cover - it is a dependency
                raise NoGpuDriver(f"nvidia-ml-py is not installed ({exc})") from None
            self._nv = pynvml
        return self._nv

    async def open(self) -> None:
        if self._opened:  # once: agent.run_agent and Agent.start both open
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(_in_thread(self._open_sync)), self.open_timeout)
        except asyncio.TimeoutError:
            raise NoGpuDriver(f"NVML did not answer within {self.open_timeout:.0f}s") from None
        self._opened = True

    def _open_sync(self) -> None:
        nv = self._module()
        try:
            nv.nvmlInit()
        except (nv.NVMLError, nv.NVMLLibraryMismatchError) as exc:
            raise NoGpuDriver(f"NVML unavailable: {exc}") from None
        self._inited = True
        try:
            devices, notes = nd.enumerate_devices(nv, self._visible)
        except (nd.Reinit, nv.NVMLError, nv.NVMLLibraryMismatchError) as exc:
            self._shutdown_sync()
            raise NoGpuDriver(f"NVML could not list the GPUs: {exc}") from None
        self._install(nv, devices, notes)

    def _install(self, nv: Any, devices: list[nd.Device], notes: list[str]) -> None:
        self._devices, self._api, self._xids, self._gone = devices, nd.Api(nv), {}, None
        self._pending.clear()
        self._watcher = nd.XidWatcher(nv, devices, self._on_xid, self.xid_poll_ms)
        self._watcher.start()
        self.notes = notes + ([self._watcher.note] if self._watcher.note else [])
        self.fabric = nd.fabric_domain(nv, devices[0].handle) if devices else None
        _set_cuda_ids(self, {d.index: d.uuid for d in devices if d.uuid})

    def _on_xid(self, uuid: str, xid: int) -> None:
        self._xids[uuid] = xid  # a plain dict store: atomic under the GIL

    def _shutdown_sync(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._inited:
            self._inited = False
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass

    def _reinit_sync(self) -> None:
        """After a driver reload: shut NVML down, start it again, list the GPUs again."""
        nv = self._nv
        self._shutdown_sync()
        try:
            nv.nvmlInit()
            self._inited = True
            devices, notes = nd.enumerate_devices(nv, self._visible)
        except (nd.Reinit, nv.NVMLError, nv.NVMLLibraryMismatchError) as exc:
            self._gone = f"NVML re-initialisation failed: {exc}"
            return
        self._install(nv, devices, notes)

    def claim(self, indices: list[int], pids: list[int]) -> None:
        return None  # the driver sees the processes itself

    def release(self, indices: list[int]) -> None:
        return None

    async def sample(self) -> list[GpuReport]:
        if not self._opened:
            raise RuntimeError("NvmlProbe.sample before open")
        if self._gone is not None:
            if self._reinit is None or self._reinit.done():  # one attempt at a time
                self._reinit = _in_thread(self._reinit_sync)
            await asyncio.wait([asyncio.wrap_future(self._reinit)], timeout=self.sample_timeout)
            gone = self._gone
            if gone is not None or not self._reinit.done():
                return [d.unhealthy(GpuHealth.NO_DRIVER, gone or "re-initialising NVML", self._last.get(d.index))
                        for d in self._devices]
        devices, nv, api = self._devices, self._nv, self._api
        now = time.monotonic()
        for d in devices:
            if d.index not in self._pending:  # a hung read is not started twice
                self._pending[d.index] = (_in_thread(nd.read, nv, d, api), now)
        waiting = [asyncio.wrap_future(self._pending[d.index][0]) for d in devices]
        if waiting:
            await asyncio.wait(waiting, timeout=self.sample_timeout)
        return [self._result(d) for d in devices]

    def _result(self, d: nd.Device) -> GpuReport:
        fut, started = self._pending[d.index]
        last = self._last.get(d.index)
        if not fut.done():
            return d.unhealthy(GpuHealth.STALE, f"NVML has not answered for {time.monotonic() - started:.1f}s", last)
        del self._pending[d.index]
        try:
            rep = fut.result()
        except nd.Reinit as exc:
            self._gone = str(exc)
            return d.unhealthy(GpuHealth.NO_DRIVER, str(exc), last)
        except Exception as exc:  # one GPU's surprise never fails the heartbeat
            rep = d.unhealthy(GpuHealth.ERROR, f"{type(exc).__name__}: {exc}", last)
        xid = self._xids.get(d.parent_uuid, self._xids.get(""))
        if xid is not None and rep.healthy:
            rep = msgspec.structs.replace(rep, health=GpuHealth.XID, health_reason=f"critical XID {xid}")
        self._last[d.index] = rep
        return rep

    async def close(self) -> None:
        if not self._opened:
            return
        self._opened = False
        _set_cuda_ids(self, None)
        fut = _in_thread(self._shutdown_sync)
        await asyncio.wait([asyncio.wrap_future(fut)], timeout=max(self.sample_timeout, 1.0))


def _in_thread(fn: Callable, *args: Any) -> Future:
    """``fn(*args)`` in a new daemon thread: one stuck in the driver never
    blocks the agent's exit, as a pool's worker would."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            fut.set_exception(exc)

    threading.Thread(target=run, name="nvml-call", daemon=True).start()
    return fut


# ---------------------------------------------------------------- CUDA ids
# NVML is process-wide state, and so is this table: the open NvmlProbe's
# device index -> UUID, which is what ranks get as CUDA_VISIBLE_DEVICES.
_cuda_ids: dict[int, str] = {}
_cuda_owner: object | None = None
_cuda_lock = threading.Lock()


def _set_cuda_ids(owner: object, ids: dict[int, str] | None) -> None:
    global _cuda_owner
    with _cuda_lock:
        if ids is None:
            if _cuda_owner is owner:
                _cuda_ids.clear()
                _cuda_owner = None
            return
        _cuda_ids.clear()
        _cuda_ids.update(ids)
        _cuda_owner = owner


def cuda_visible_devices(indices: Iterable[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a rank on these GPU indices. With an NVML
    probe open: the devices' UUIDs (``MIG-...`` for MIG instances), because
    CUDA's numbering need not follow NVML's and an index cannot name a MIG
    instance. Without one (emulated GPUs): the indices."""
    indices = list(indices)
    with _cuda_lock:
        if _cuda_owner is None:
            return ",".join(str(i) for i in indices)
        missing = [i for i in indices if i not in _cuda_ids]
        if missing:
            raise ValueError(f"GPU indices {missing} are not in this node's NVML device table")
        return ",".join(_cuda_ids[i] for i in indices)
