"""Provisioning: the streams and KV buckets, created or updated (idempotent)."""

from __future__ import annotations

import asyncio
import os
import time

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import MAX_MESSAGE_BYTES

STREAMS = {
    subj.EVENTS_STREAM: dict(subjects=[subj.EVENTS_SUBJECTS, subj.EVENTS_FENCE_PREFIX + ".>"], duplicate_window=3600.0),
    subj.REPORTS_STREAM: dict(subjects=[subj.REPORTS_SUBJECTS], duplicate_window=3600.0),
    # finished jobs' accounts, in the order they were archived: a window of time is a
    # range of the stream (read from its start time), kept as long as the history
    subj.USAGE_STREAM: dict(subjects=[subj.USAGE_SUBJECTS], duplicate_window=3600.0),
    # lossy by design, as the lines themselves: in memory, the last line of each job, and
    # a job's line goes PROGRESS_KEPT_S after its last one (services.progress_lines)
    subj.PROGRESS_STREAM: dict(subjects=[subj.PROGRESS_SUBJECTS], storage=StorageType.MEMORY,
                               max_msgs_per_subject=1, max_age=subj.PROGRESS_KEPT_S, duplicate_window=60.0,
                               allow_direct=True),
}
RETAINED = (subj.USAGE_STREAM, subj.HISTORY_BUCKET)  # what GEARSHIFT_HISTORY_RETENTION_S sets


def retention_s() -> float:
    """Seconds finished jobs are kept (history store and usage rows): 7 days, or
    ``GEARSHIFT_HISTORY_RETENTION_S``. Export them before they expire
    (``examples/export_finished_csv.py``, ``gearshift usage -o csv``)."""
    return float(os.environ.get("GEARSHIFT_HISTORY_RETENTION_S") or subj.HISTORY_RETENTION_S)
BUCKETS = {
    subj.JOBS_BUCKET: dict(history=5),
    subj.NODES_BUCKET: dict(history=1),
    subj.ALLOC_BUCKET: dict(history=5),
    subj.MODELS_BUCKET: dict(history=5),
    subj.LEASE_BUCKET: dict(history=1),
    subj.HISTORY_BUCKET: dict(history=1, ttl=subj.HISTORY_RETENTION_S),
    subj.NODE_MODES_BUCKET: dict(history=1),
    subj.QUEUES_BUCKET: dict(history=5),
}


def default_replicas() -> int:
    """Stream and bucket replicas: 1, or 3 on a NATS cluster (``GEARSHIFT_REPLICAS``)."""
    return int(os.environ.get("GEARSHIFT_REPLICAS") or 1)


async def ensure_infra(nc: NATS, replicas: int | None = None) -> None:
    """Create or update the streams and buckets; safe to call from every service."""
    replicas = replicas or default_replicas()
    js = nc.jetstream()
    for name, cfg in STREAMS.items():
        config = StreamConfig(
            name=name,
            retention=RetentionPolicy.LIMITS,
            num_replicas=replicas,
            max_msg_size=MAX_MESSAGE_BYTES,
            **({"max_age": retention_s()} if name in RETAINED else {}),
            **{"storage": StorageType.FILE, **cfg},
        )
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    for bucket, cfg in BUCKETS.items():
        try:
            await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            try:
                extra = {"ttl": retention_s()} if bucket in RETAINED else {}
                await js.create_key_value(
                    KeyValueConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas, **{**cfg, **extra})
                )
            except BadRequestError:
                pass  # another service created it first


async def ensure_infra_when_ready(nc: NATS, replicas: int | None = None, timeout: float = 60.0) -> None:
    """``ensure_infra`` on a cluster that may be fresh: it elects its JetStream
    meta leader first, and until then every stream request fails; retried every
    0.5 s until ``timeout``, then the last error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await ensure_infra(nc, replicas)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
