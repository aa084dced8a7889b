"""Per-node allocation keys, so an agent can be allowed to read only its own.

``gs_alloc`` holds each allocation twice: under the job id (what the
optimizer reconciles and tools read) and under ``<node>.<job>`` for every
node of its placement (what the agent of that node watches). An agent's
NATS user may create consumers on ``KV_gs_alloc`` only with the filter
``$KV.gs_alloc.<node>.>``; the server checks the filter because the watch
uses the named create form ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``
(nats-py's ``kv.watch`` uses the unnamed form, whose filter the server cannot
check, so agents do not use it).

The per-node keys are derived: ``reconcile`` makes them mirror the job keys,
so a crash between the writes heals on the next round. The agent's side, the
watch of its own node's keys, is ``gearshift.bus.alloc_watch``.
"""

from __future__ import annotations

from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gearshift.bus.alloc_watch import node_key
from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import Allocation


async def _node_keys_of(kv: Any, job_id: str) -> list[str]:
    return list(await kv_snapshot(kv, f"*.{subj.token(job_id)}"))


async def put(kv: Any, job_id: str, data: bytes, nodes: list[str]) -> None:
    """Write the allocation under each node of its placement; drop the nodes it left."""
    for node in nodes:
        await kv.put(node_key(node, job_id), data)
    keep = {node_key(n, job_id) for n in nodes}
    for key in await _node_keys_of(kv, job_id):
        if key not in keep:
            await _delete(kv, key)


async def delete(kv: Any, job_id: str) -> None:
    for key in await _node_keys_of(kv, job_id):
        await _delete(kv, key)


async def _delete(kv: Any, key: str) -> None:
    try:
        await kv.delete(key)
    except Exception:
        pass


async def reconcile(kv: Any) -> int:
    """Make the ``<node>.<job>`` keys mirror the job keys; returns the writes made.

    Every write is a compare-and-set against what the snapshot saw, and a
    missing copy is only made while its job key is still the one seen: the
    optimizer may put a newer allocation meanwhile (a drain settling on a run
    report), and a stale snapshot must never delete or overwrite it (found by
    loadtest.chaos: a deleted copy stopped a generation the agent then
    refused to start again)."""
    snap = await kv_snapshot(kv)
    jobs = {k: v for k, v in snap.items() if "." not in k}
    nodes = {k: v for k, v in snap.items() if "." in k}
    want: dict[str, tuple[bytes, str, int]] = {}  # node key -> (value, job key, job revision)
    for job_id, (data, rev) in jobs.items():
        try:
            alloc = codec.decode(data, Allocation)
        except Exception:
            continue
        for node in alloc.nodes():
            want[node_key(node, job_id)] = (data, job_id, rev)
    writes = 0
    for key, (data, job_id, job_rev) in want.items():
        have = nodes.get(key)
        if have is not None and have[0] == data:
            continue
        try:
            current = await kv.get(job_id)
            if current.revision != job_rev:
                continue  # the job moved on since the snapshot: its own put writes the copies
        except KeyNotFoundError:
            continue
        try:
            if have is None:
                await kv.create(key, data)
            else:
                await kv.update(key, data, last=have[1])
            writes += 1
        except KeyWrongLastSequenceError:
            pass  # written meanwhile: newer than what we saw
    for key in nodes.keys() - want.keys():
        try:
            await kv.delete(key, last=nodes[key][1])
            writes += 1
        except Exception:
            pass  # written meanwhile: newer than what we saw
    return writes
