"""Tenant queues kept in KV ``gs_queues`` (tenant -> ``QueueSpec``), shared by
admission (``get queues`` / ``set queue`` endpoints, the submit check) and the
optimizer (reads them every round into ``policies.sharing.Shared``).

Queues first come from the cluster config (the optimizer's
``--policy-options {"sharing": {"queues": ...}}``): the optimizer writes each
one that the bucket does not hold yet, so a queue changed at run time is not
overwritten by a restart. The bucket is small (one key per tenant).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import QueueList, QueueSpec
from gearshift.policies.queues import Queue, ShareConfig
from gearshift.policies.queues import most_gpus as core_most_gpus

USAGE_KEY = "fairshare.usage"


def to_core(q: QueueSpec) -> Queue:
    return Queue(q.tenant, q.quota, q.weight, q.cohort, q.borrow_limit, q.lend_limit)


def from_core(q: Queue) -> QueueSpec:
    return QueueSpec(tenant=q.tenant, quota=q.quota, weight=q.weight, cohort=q.cohort,
                     borrow_limit=q.borrow_limit, lend_limit=q.lend_limit)


class QueueStore:
    def __init__(self, nc: Any):
        self.nc = nc
        self.kv: Any = None

    async def open(self) -> "QueueStore":
        self.kv = await self.nc.jetstream().key_value(subj.QUEUES_BUCKET)
        return self

    async def all(self) -> list[QueueSpec]:
        snap = await kv_snapshot(self.kv)
        # tenant names have no dots; dotted keys are the optimizer's own state
        return sorted((codec.decode(v, QueueSpec) for k, (v, _) in snap.items() if "." not in k), key=lambda q: q.tenant)

    async def save_usage(self, state: dict) -> None:
        """The fair-share memory (decayed usage, starvation timers), so a new leader goes on from it."""
        await self.kv.put(USAGE_KEY, msgspec.json.encode(state))

    async def load_usage(self) -> dict | None:
        try:
            entry = await self.kv.get(USAGE_KEY)
        except Exception:  # nats KeyNotFoundError: nothing saved yet
            return None
        return msgspec.json.decode(entry.value) if entry and entry.value else None

    async def put(self, q: QueueSpec) -> None:
        await self.kv.put(subj.token(q.tenant), msgspec.json.encode(q))

    async def seed(self, cfg: ShareConfig) -> None:
        """Write the configured queues the bucket does not hold yet."""
        have = {q.tenant for q in await self.all()}
        for q in cfg.queues.values():
            if q.tenant not in have:
                try:
                    await self.kv.create(subj.token(q.tenant), msgspec.json.encode(from_core(q)))
                except Exception:  # another process created it first: keep theirs
                    pass

    async def config(self, base: ShareConfig) -> ShareConfig:
        """``base`` with the bucket's queues (the bucket wins)."""
        cfg = base
        for q in await self.all():
            cfg = cfg.with_queue(to_core(q))
        return cfg


def most_gpus(cfg: ShareConfig, tenant: str) -> int | None:
    """The most GPUs ``tenant`` could ever hold (None: the tenant has no queue)."""
    return None if tenant not in cfg.queues else core_most_gpus(cfg, tenant)


async def queue_list(store: QueueStore) -> QueueList:
    return QueueList(queues=await store.all())
