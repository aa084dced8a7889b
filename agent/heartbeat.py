"""Heartbeats: the node's ``NodeReport`` (GPUs from the probe, CPUs, host
memory, what runs, GPUs reserved for profiling) on ``gs.node.<node>.heartbeat``
every ``interval`` seconds, and in KV ``gs_nodes`` whenever what the services
act on changed (``report_state``) and at least every ``REFRESH_BEATS`` beats.
The optimizer judges liveness by the server's timestamps of these writes, never
by ``ts``.

Why not every beat: the bucket's watchers (the optimizer) take in every write,
and at 2,000 nodes and 2 s beats that was 1,000 stored, acknowledged and
delivered messages a second, most saying only that the GPUs' utilisation moved
(issue 24). Kubernetes made the same split: the kubelet renews a small Lease
for liveness and writes the node's status only when it changed or every few
minutes (KEP-589, ``nodeStatusReportFrequency``). Here the liveness write and
the status are one: a report written at least every ``REFRESH_BEATS`` beats,
so a node timeout must be longer than that many beats (the defaults: 1-2 s
beats, a 10 s timeout). The subject still carries every beat, readings
included, for whoever follows the nodes live."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from gearshift.agent.core import Run
from gearshift.bus import VERSION, observe
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.gputypes import node_gpu_type
from gearshift.bus_schema.messages import NodeReport

REFRESH_BEATS = 2  # the KV copy is written at least every this many beats, and on every change of state


def report_state(r: NodeReport) -> tuple:
    """What the services act on in a report: all of it but the time and the
    readings that move by themselves (utilisation, memory used, GPU processes)."""
    return (tuple((g.index, g.uuid, g.name, g.memory_total, g.health, g.health_reason) for g in r.gpus),
            r.cpus, r.memory_total, r.probe, tuple(r.reserved), tuple(r.running), r.agent_version, r.started_at,
            r.address, r.gpu_type, r.topology, r.alloc_rev)


class Heartbeat:
    def __init__(self, nc: Any, node: str, probe: Any, *, cpus: int, address: str, interval: float,
                 runs: Mapping[str, Run], reserved: set[int], log: Any,
                 nodes_kv: Callable[[], Any], memory: Callable[[], tuple[int, int]] | None = None,
                 topology: str = ""):
        self.nc = nc
        self.node = node
        self.probe = probe
        self.cpus = cpus
        self.address = address
        self.interval = interval
        self.runs = runs  # the agent's, live
        self.reserved = reserved  # GPUs of profiling runs, live
        self.log = log
        self.nodes_kv = nodes_kv  # the gs_nodes bucket, once the agent has it
        # (total, used) host memory; the fleet emulator shares one sample among its agents
        self.memory = memory or host_memory
        self.started_at = time.time()
        self.topology = topology  # the node's topology path (bus_schema.topology), from --topology and NVML
        # set by the agent: the highest gs_alloc sequence applied to its desired state, and
        # acted on by a reconcile pass (NodeReport.alloc_rev)
        self.applied_rev = self.alloc_rev = 0
        self.refresh_beats = REFRESH_BEATS  # 1: every beat written (what agents did before; loadtest A/B)
        self._written: tuple | None = None  # report_state of the last report written to gs_nodes
        self._beats_since_write = 0

    async def report(self) -> NodeReport:
        mem_total, mem_used = self.memory()
        gpus = await self.probe.sample()
        return NodeReport(
            node=self.node,
            ts=time.time(),
            gpus=gpus,
            gpu_type=node_gpu_type(gpus),
            cpus=self.cpus,
            memory_total=mem_total,
            memory_used=mem_used,
            probe=self.probe.kind,
            running=[f"{r.job_id}@{r.generation}" for r in self.runs.values()],
            reserved=sorted(self.reserved),
            agent_version=VERSION,
            started_at=self.started_at,
            address=self.address,
            alloc_rev=self.alloc_rev,
            topology=self.topology,
        )

    async def beat(self) -> None:
        report = await self.report()
        observe.gpu_report(report)
        data = codec.encode(report)
        await self.nc.publish(subj.node_heartbeat(self.node), data)
        state = report_state(report)
        self._beats_since_write += 1
        if state != self._written or self._beats_since_write >= self.refresh_beats:
            await self.nodes_kv().put(self.node, data)
            self._written, self._beats_since_write = state, 0

    async def loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disconnected: the next beat tries again
                if not failing:  # one line per outage, not one per beat
                    self.log.warning("heartbeat failed", error=str(exc) or type(exc).__name__)
                failing = True
            else:
                if failing:
                    self.log.info("heartbeat restored")
                failing = False


def host_memory() -> tuple[int, int]:
    """(total, used) host bytes from /proc/meminfo; zeros where it is absent."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
        total = info.get("MemTotal", 0)
        return total, total - info.get("MemAvailable", total)
    except (OSError, ValueError, IndexError):
        return 0, 0
