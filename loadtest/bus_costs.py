"""What one bus operation costs in CPU, server and client, on this machine.

``python -m loadtest.bus_costs --json``

A real nats-server (JetStream on disk) and one nats-py client; each operation
is repeated ``--ops`` times and the CPU time of both processes (``psutil``)
is divided by the count; each figure is the median of ``--repeats`` runs.
The operations are the ones a job's life is made of (issue 24): a stored
message with its acknowledgement awaited (``bus.publish.Publisher``), the
same with one and two watchers of the stream (each view of a bucket is one),
a message in an atomic batch of 1, 5, 20 and 100 (``services.fencing``; the
commit's disk sync is paid once per batch), a core publish,
and a pull consumer's message acknowledged one by one or by ``AckPolicy.ALL``.

It says what a per-job budget can hold: ``loadtest.scale`` reports the
messages stored and delivered per job (``messages_per_job``); times these
costs, they make up most of the control plane's CPU per job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable

import psutil
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gearshift.bus.client import connect
from gearshift.bus.natsd import NatsServer
from gearshift.bus.publish import publisher
from gearshift.services.fencing import enable_atomic

BODY = b"x" * 400  # about a job record's allocation; records are 1-3 KB
# An atomic commit costs the server a disk sync whatever the batch's size (here about
# 1.2 ms of CPU, most of it in the kernel): a batch pays for itself from about 10-20
# messages, and a batch of one costs about ten acknowledged publishes. Measured at each size.
BATCH_SIZES = (1, 5, 20, 100)


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def _measure(server: psutil.Process, n: int, run: Callable[[], Awaitable[None]], nc) -> tuple[float, float]:
    me = psutil.Process(os.getpid())
    s0, c0 = _cpu(server), _cpu(me)
    await run()
    await nc.flush()
    await asyncio.sleep(0.2)  # the server's work on the last messages
    return (_cpu(server) - s0) / n * 1e6, (_cpu(me) - c0) / n * 1e6


async def costs(ops: int, repeats: int) -> dict:
    store = tempfile.mkdtemp(prefix="bus-costs-")
    srv = NatsServer(store)
    srv.start()
    try:
        nc = await connect(srv.url, name="bus-costs", retry_for=5)
        js = nc.jetstream()
        server = psutil.Process(srv.proc.pid)
        pub = publisher(nc)
        await js.add_stream(name="COSTS", subjects=["costs.>"])
        await enable_atomic(nc, "COSTS")
        delivered = [0]

        async def count(_msg) -> None:
            delivered[0] += 1

        async def stored() -> None:
            for i in range(ops):
                await pub.publish(f"costs.s.{i % 500}", BODY)

        async def batched(most: int) -> None:
            for start in range(0, ops, most):
                b = uuid.uuid4().hex
                size = min(most, ops - start)
                for i in range(1, size):
                    await nc.publish(f"costs.b.{i}", BODY, headers={"Nats-Batch-Id": b, "Nats-Batch-Sequence": str(i)})
                await nc.request("costs.b.commit", BODY, timeout=5, headers={
                    "Nats-Batch-Id": b, "Nats-Batch-Sequence": str(size), "Nats-Batch-Commit": "1"})

        async def core() -> None:
            for _ in range(ops):
                await nc.publish("plain.x", BODY)

        async def pulled(policy: str):
            """A new durable on the messages stored next (not measured)."""
            psub = await js.pull_subscribe("costs.p.>", durable=f"d{uuid.uuid4().hex[:8]}", stream="COSTS",
                                           config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=(
                                               AckPolicy.ALL if policy == "all" else AckPolicy.EXPLICIT)))
            for i in range(ops):
                await pub.publish(f"costs.p.{i % 500}", BODY)
            return psub

        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(repeats):
            rows.setdefault("stored message, acknowledgement awaited", []).append(
                await _measure(server, ops, stored, nc))
            subs = [await js.subscribe("costs.s.>", stream="COSTS", ordered_consumer=True, cb=count,
                                       deliver_policy=DeliverPolicy.NEW)]
            rows.setdefault("stored message + 1 watcher", []).append(await _measure(server, ops, stored, nc))
            subs.append(await js.subscribe("costs.s.>", stream="COSTS", ordered_consumer=True, cb=count,
                                           deliver_policy=DeliverPolicy.NEW))
            rows.setdefault("stored message + 2 watchers", []).append(await _measure(server, ops, stored, nc))
            for s in subs:
                await s.unsubscribe()
            for most in BATCH_SIZES:
                rows.setdefault(f"stored message in an atomic batch of {most}", []).append(
                    await _measure(server, ops, lambda most=most: batched(most), nc))
            rows.setdefault("core publish, no subscriber", []).append(await _measure(server, ops, core, nc))
            for policy in ("explicit", "all"):
                psub = await pulled(policy)

                async def take(psub=psub, policy=policy) -> None:
                    got = 0
                    while got < ops:
                        msgs = await psub.fetch(min(500, ops - got), timeout=5)
                        if policy == "all":
                            await msgs[-1].ack()
                        else:
                            for m in msgs:
                                await m.ack()
                        got += len(msgs)

                rows.setdefault(f"pulled message, ack {policy}", []).append(await _measure(server, ops, take, nc))
                await psub.unsubscribe()
        for _ in range(50):  # the watchers' last deliveries (they were unsubscribed after the last)
            if delivered[0] >= 3 * ops * repeats:
                break
            await asyncio.sleep(0.05)
        await nc.close()
    finally:
        srv.stop()
    return {"ops": ops, "repeats": repeats, "watched": delivered[0], "us_per_op": {
        name: {"server": round(statistics.median(s for s, _ in v), 1), "client": round(statistics.median(c for _, c in v), 1)}
        for name, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2000, help="operations per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.ops < 100 or a.repeats < 1:
        ap.error("--ops must be at least 100 and --repeats at least 1")
    out = asyncio.run(costs(a.ops, a.repeats))
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for name, v in out["us_per_op"].items():
            print(f"{name:45s} server {v['server']:7.1f} us  client {v['client']:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
