"""What the agent knows about its GPUs: one small interface, two implementations.

``NvmlProbe`` asks the driver through nvidia-ml-py; ``FakeProbe`` serves
machines without GPUs (tests, ``gearshift up``) with scripted devices. The
agent only calls ``open``/``sample``/``close``, plus ``claim``/``release`` to
tell the probe which job processes hold which GPUs: a real driver sees that
by itself (so NVML ignores it), a fake one has to be told.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Protocol, runtime_checkable

from bus_schema.messages import GpuProcess, GpuReport


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
            holders = {i: list(p) for i, p in self._holders.items()}
        out = []
        for i in range(self.n_gpus):
            if i in self.script:
                out.append(self.script[i])
                continue
            pids = holders.get(i, [])
            used = int(self.memory_bytes * self.busy_fraction) if pids else 0
            out.append(
                GpuReport(
                    index=i,
                    uuid=f"GPU-fake-{self.node}-{i}",
                    name=self.name,
                    memory_used=used,
                    memory_total=self.memory_bytes,
                    utilization=100.0 if pids else 0.0,
                    processes=[GpuProcess(pid=p, used_memory=used // len(pids)) for p in pids],
                )
            )
        return out

    async def close(self) -> None:
        return None


class NvmlProbe:
    """The driver's view through nvidia-ml-py. Every call runs in a thread
    (NVML calls block); a metric a GPU does not support reads as None/empty
    instead of failing the whole sample."""

    kind = "nvml"

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list = []
        self._lock = threading.Lock()  # NVML handles are not documented thread-safe

    async def open(self) -> None:
        await asyncio.to_thread(self._open_sync)

    def _open_sync(self) -> None:
        try:
            import pynvml  # lazy: machines without GPUs never need it
        except ImportError as exc:  # pragma: no cover - it is a dependency
            raise NoGpuDriver(f"nvidia-ml-py is not installed ({exc})") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpuDriver(f"NVML unavailable: {exc}") from None
        self._nvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def claim(self, indices: list[int], pids: list[int]) -> None:
        return None  # the driver sees the processes itself

    def release(self, indices: list[int]) -> None:
        return None

    async def sample(self) -> list[GpuReport]:
        return await asyncio.to_thread(self._sample_sync)

    def _maybe(self, fn, *args):
        """``fn(*args)``, or None when this GPU does not support/allow it."""
        nv = self._nvml
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            if isinstance(exc, nv.NVMLError_Uninitialized):
                raise
            return None

    def _sample_sync(self) -> list[GpuReport]:
        nv = self._nvml
        if nv is None:
            raise RuntimeError("NvmlProbe.sample before open")
        out = []
        with self._lock:
            for i, h in enumerate(self._handles):
                uuid = self._maybe(nv.nvmlDeviceGetUUID, h) or f"GPU-index-{i}"
                name = self._maybe(nv.nvmlDeviceGetName, h) or ""
                mem = self._maybe(nv.nvmlDeviceGetMemoryInfo, h)
                util = self._maybe(nv.nvmlDeviceGetUtilizationRates, h)
                procs = self._maybe(nv.nvmlDeviceGetComputeRunningProcesses, h) or []
                out.append(
                    GpuReport(
                        index=i,
                        uuid=_text(uuid),
                        name=_text(name),
                        memory_used=int(getattr(mem, "used", 0) or 0),
                        memory_total=int(getattr(mem, "total", 0) or 0),
                        utilization=None if util is None else float(util.gpu),
                        processes=[
                            GpuProcess(
                                pid=int(p.pid),
                                # None when NVML cannot tell (e.g. no permission, MIG)
                                used_memory=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                            )
                            for p in procs
                        ],
                    )
                )
        return out

    async def close(self) -> None:
        if self._nvml is not None:
            nv, self._nvml = self._nvml, None
            try:
                await asyncio.to_thread(nv.nvmlShutdown)
            except nv.NVMLError:
                pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
