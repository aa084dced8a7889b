"""KV and stream helpers every process uses: a snapshot of a bucket in one
consumer pass, and an event published with its deterministic message id."""

from __future__ import annotations

from typing import Any

from nats.js.api import DeliverPolicy, Header

from gearshift.bus.publish import publisher
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import AnyJobEvent, Event


def event_msg_id(ev: AnyJobEvent) -> str:
    return f"{ev.job_id}:{ev.seq}"


async def publish_event(js: Any, ev: Event, msg_id: str, subject: str, fence: Any = None) -> None:
    """Publish ``ev`` with its message id; through ``fence`` (``services.fencing.Fence``)
    when a leader publishes, so the server refuses it once another leader took over."""
    if fence is not None:
        await fence.publish(subject, codec.encode(ev), msg_id)
    else:
        await publisher(js._nc).publish(subject, codec.encode(ev), {Header.MSG_ID: msg_id})


async def kv_snapshot(kv: Any, keys: str = ">") -> dict[str, tuple[bytes, int]]:
    """Current value and revision of every key, in one consumer pass (a get
    per key would cost a round trip each).

    Not ``kv.watch``: its "initial values done" marker can arrive before
    values already in flight (a race in nats-py 2.16), so a snapshot taken
    with it may miss keys. Here the end is the message with nothing pending.
    """
    js = kv._js
    stream = kv._stream
    info = await js.stream_info(stream)
    out: dict[str, tuple[bytes, int]] = {}
    if info.state.messages == 0:
        return out
    prefix = kv._pre
    sub = await js.subscribe(
        f"{prefix}{keys}", stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
    )
    try:
        while True:
            msg = await sub.next_msg(timeout=5)
            op = (msg.headers or {}).get("KV-Operation")
            key = msg.subject[len(prefix):]
            if key.startswith("_"):  # fencing marks (services.fencing), not data
                pass
            elif op in ("DEL", "PURGE"):
                out.pop(key, None)
            else:
                out[key] = (msg.data, msg.metadata.sequence.stream)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out
