"""The fleet emulator: N real agents in one process, like KWOK for Kubernetes.

    python -m loadtest.fleet --nodes 500 --gpus-per-node 8 [--server URL] [--duration S] [--json]

Each node is an ``agent.agent.Agent`` -- its reconcile core, fencing,
heartbeats, run reports, commands -- with two stand-ins only: the GPUs (the
scripted ``FakeProbe``) and the process runner (``EmulatedRunner``: ranks are
tasks of this process, checkpoints in one shared in-memory store). All agents
share one NATS connection, and one watch of ``gs_alloc`` fans the per-node
allocation keys (``<node>.<job>``) out to their agents, exactly as each
agent's own filtered watch would deliver them: a thousand agents polling a
thousand consumers would measure the emulator, not the control plane.

The agents start spread over one heartbeat interval, so their heartbeats
are too (real hosts boot at different times; a thousand agents beating in
the same millisecond would measure the emulator's burst, not the control
plane). What a real agent reads from its host once per beat (``/proc/meminfo``)
is read once per second for all of them: they share one host. Once the agents
are up their objects are frozen out of the garbage collector's full passes
(one process holding 2,000 agents would otherwise stall for each).

``kill(node)`` is an agent dying outright (kill -9): its tasks end, its
ranks die without a last checkpoint, nothing more is published; the node's
last heartbeat stays in ``gs_nodes`` until the optimizer calls it lost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy

import gearshift.agent.heartbeat as heartbeat_module
from gearshift.agent.agent import Agent
from gearshift.agent.emulated_runner import CheckpointStore, EmulatedRunner
from gearshift.agent.probe import FakeProbe
from gearshift.bus.alloc_watch import AllocEntry
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import subjects as subj


class _NodeWatch:
    """One agent's view of the shared watch: the node watch's interface."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = False

    def __aiter__(self) -> "_NodeWatch":
        return self

    async def __anext__(self) -> AllocEntry | None:
        if self.stopped and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        return item

    async def stop(self) -> None:
        self.stopped = True
        self.queue.put_nowait(StopAsyncIteration)


class SharedAllocWatch:
    """One ordered consumer on ``$KV.gs_alloc.*.*`` (the per-node copies),
    last value per key, then changes, fanned out by node."""

    def __init__(self, js: Any):
        self.js = js
        self.prefix = f"$KV.{subj.ALLOC_BUCKET}."
        self.current: dict[str, dict[str, AllocEntry]] = {}
        self.watches: dict[str, _NodeWatch] = {}
        self._sub: Any = None

    async def start(self) -> "SharedAllocWatch":
        self._sub = await self.js.subscribe(
            self.prefix + "*.*", stream=f"KV_{subj.ALLOC_BUCKET}", ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, cb=self._on_msg,
            pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30,
        )
        return self

    async def _on_msg(self, msg: Any) -> None:
        node, job = msg.subject[len(self.prefix):].split(".", 1)
        entry = AllocEntry(key=job, value=msg.data, operation=(msg.headers or {}).get("KV-Operation"),
                           revision=msg.metadata.sequence.stream)
        mine = self.current.setdefault(node, {})
        if entry.operation in ("DEL", "PURGE"):
            mine.pop(job, None)
        else:
            mine[job] = entry
        w = self.watches.get(node)
        if w is not None and not w.stopped:
            w.queue.put_nowait(entry)

    async def watch(self, js: Any, node: str) -> _NodeWatch:
        """What ``Agent`` calls instead of ``gearshift.bus.alloc_watch.node_alloc_watch``."""
        w = _NodeWatch()
        for entry in self.current.get(node, {}).values():
            w.queue.put_nowait(entry)
        w.queue.put_nowait(None)  # initial values done
        self.watches[node] = w
        return w

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


class SharedHostMemory:
    """The agents' host-memory sample (``agent.heartbeat.host_memory``), read
    at most once per ``every`` seconds for the whole fleet: its agents share
    one host, and 2,000 agents reading ``/proc/meminfo`` 1,000 times a second
    would load the emulator, not the control plane."""

    def __init__(self, every: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.every = every
        self.clock = clock
        self.reads = 0
        self._at: float | None = None
        self._value = (0, 0)

    def __call__(self) -> tuple[int, int]:
        t = self.clock()
        if self._at is None or t - self._at >= self.every:
            self._at, self._value = t, heartbeat_module.host_memory()
            self.reads += 1
        return self._value


class Fleet:
    def __init__(self, nc: Any, nodes: int, gpus_per_node: int, *, prefix: str = "fleet", heartbeat: float = 2.0,
                 progress_interval: float = 5.0, grace: float = 5.0, workdir: str | None = None, cpus: int = 64,
                 topology: Any = None, refresh_beats: int | None = None):
        self.nc = nc
        self.refresh_beats = refresh_beats  # agent.heartbeat.REFRESH_BEATS unless given
        self.names = [f"{prefix}-{i:05d}" for i in range(nodes)]
        self.gpus = gpus_per_node
        self.heartbeat = heartbeat
        self.progress_interval = progress_interval
        self.grace = grace
        self.cpus = cpus
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gearshift-fleet-"))
        self.store = CheckpointStore()
        self.agents: dict[str, Agent] = {}
        self.runners: dict[str, EmulatedRunner] = {}
        self.killed: set[str] = set()
        self.watch: SharedAllocWatch | None = None
        self.host_memory = SharedHostMemory()
        self.topology = topology or {}  # node name -> topology path text (bus_schema.topology)

    async def start(self, batch: int = 50) -> "Fleet":
        """Start the agents in batches spread over one heartbeat interval."""
        self.watch = await SharedAllocWatch(self.nc.jetstream()).start()
        t0 = time.monotonic()
        batches = range(0, len(self.names), batch)
        for k, i in enumerate(batches):
            await asyncio.gather(*(self._start_one(n) for n in self.names[i:i + batch]))
            wait = t0 + (k + 1) * self.heartbeat / len(batches) - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        return self

    async def _start_one(self, name: str) -> None:
        assert self.watch is not None
        runner = EmulatedRunner(self.store)
        agent = Agent(self.nc, name, FakeProbe(self.gpus, node=name), self.workdir / name, cpus=self.cpus,
                      heartbeat=self.heartbeat, grace=self.grace, progress_interval=self.progress_interval,
                      runner=runner, alloc_watch=self.watch.watch, topology=self.topology.get(name, ""))
        agent.heartbeat.memory = self.host_memory
        if self.refresh_beats is not None:
            agent.heartbeat.refresh_beats = self.refresh_beats
        await agent.start()
        self.agents[name] = agent
        self.runners[name] = runner

    async def kill(self, name: str) -> int:
        """The agent dies outright (kill -9); returns how many runs died with it."""
        agent = self.agents.pop(name)
        self.killed.add(name)
        agent._closing = True
        for t in agent._tasks:
            t.cancel()
        for t in list(agent._side_tasks):
            t.cancel()
        runs = list(agent.runs.values())
        self.runners[name].kill_all(runs)
        if agent._watcher is not None:
            await agent._watcher.stop()
        if agent._svc is not None:
            try:
                await agent._svc.stop()  # a dead process answers nothing
            except Exception:
                pass
        await cancel_and_wait([*agent._tasks, *agent._side_tasks])  # again where a cancellation was swallowed
        return len(runs)

    async def stop(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.agents.values()), return_exceptions=True)
        if self.watch is not None:
            await self.watch.stop()

    def running(self) -> int:
        return sum(len(a.runs) for a in self.agents.values())


async def amain(args: argparse.Namespace, stop: asyncio.Event) -> dict:
    from gearshift.bus.client import connect

    nc = await connect(args.server, name="gearshift-fleet", retry_for=10)
    t0 = time.monotonic()
    fleet = await Fleet(nc, args.nodes, args.gpus_per_node, heartbeat=args.heartbeat, prefix=args.prefix,
                        refresh_beats=args.refresh_beats, progress_interval=args.progress_interval).start()
    started_s = time.monotonic() - t0
    # The agents' state lives as long as the fleet: out of the collector's way.
    # Otherwise each full collection walks 2,000 agents' objects (measured: 480 ms,
    # during which no agent beats; 80 ms frozen) -- a cost one agent per host never has.
    gc.freeze()
    if not args.json:
        print(f"{args.nodes} agents of {args.gpus_per_node} GPUs up in {started_s:.1f}s", file=sys.stderr)
    try:
        await asyncio.wait_for(stop.wait(), args.duration) if args.duration else await stop.wait()
    except asyncio.TimeoutError:
        pass
    out = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "start_s": round(started_s, 2),
           "running_at_end": fleet.running(), "checkpoints": len(fleet.store.manifests)}
    await fleet.stop()
    await nc.drain()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--server", default=os.environ.get("GEARSHIFT_NATS_URL"))
    ap.add_argument("--heartbeat", type=float, default=2.0, help="seconds between each agent's heartbeats")
    ap.add_argument("--refresh-beats", type=int, default=None,
                    help="write each report to gs_nodes at least every this many beats (default: the agent's; 1: every beat)")
    ap.add_argument("--progress-interval", type=float, default=5.0,
                    help="seconds between each running job's progress lines (gs.job.<job>.progress)")
    ap.add_argument("--prefix", default="fleet", help="node names are <prefix>-00000 ...")
    ap.add_argument("--duration", type=float, default=None, help="seconds to run (default: until SIGINT/SIGTERM)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 0:
        ap.error("--nodes must be at least 1 and --gpus-per-node at least 0")
    if not args.progress_interval > 0:
        ap.error("--progress-interval must be above 0 seconds")
    from gearshift.bus.process import run_service

    result: dict = {}

    async def body(stop: asyncio.Event) -> None:
        result.update(await amain(args, stop))

    run_service(body)
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
