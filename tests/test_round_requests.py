"""What a round asks the server (issue 24): a paced round syncs only the jobs' view
with a stream-info request; gs_alloc's view catches up to the leader's own last
acknowledged write (``Fence.written``, ``KvView.catch_up``), the nodes' view is
synced only when a node looks silent, and the modes' and models' views are read as
they are. A round asked for (``strict``) and a full round sync every view.

The requests are counted by a client subscribed to ``$JS.API.STREAM.INFO.>`` on the
same real nats-server: it sees each one as the server does."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from test_optimizer import leading_optimizer, submit, wait_for

from gearshift.bus.views import KvView
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobState
from gearshift.services.fencing import Fence
from gearshift.services.liveness import NodeLiveness
from gearshift.services.optimizer import Optimizer

VIEWS = ("KV_gs_nodes", "KV_gs_alloc", "KV_gs_node_modes", "KV_gs_models")


async def _count_stream_info(nc) -> tuple[Counter, object]:
    asked: Counter = Counter()

    async def seen(msg) -> None:
        asked[msg.subject.rsplit(".", 1)[1]] += 1

    return asked, await nc.subscribe("$JS.API.STREAM.INFO.>", cb=seen)


async def test_a_view_catches_up_to_the_fences_own_writes_without_asking_the_server(nc):
    fence = Fence(nc, [subj.ALLOC_BUCKET], "leader")
    await fence.take()
    view = await KvView(nc.jetstream(), subj.ALLOC_BUCKET, bytes).start()
    try:
        asked, sub = await _count_stream_info(nc)
        seq = await fence.put(subj.ALLOC_BUCKET, "j1", b"a")
        assert fence.written[subj.ALLOC_BUCKET] == seq
        await fence.batch(subj.ALLOC_BUCKET, [("j2", b"b"), ("n0.j2", b"b")])
        after_batch = fence.written[subj.ALLOC_BUCKET]
        assert after_batch > seq + 1  # the batch's commit, after both its keys
        assert await view.catch_up(after_batch) >= after_batch
        assert {k: e[0] for k, e in view.entries.items()} == {"j1": b"a", "j2": b"b", "n0.j2": b"b"}
        await nc.flush()
        assert asked["KV_gs_alloc"] == 0  # no request: the fence knew the sequence
        await view.sync()
        await nc.flush()
        await asyncio.sleep(0.05)
        assert asked["KV_gs_alloc"] == 1  # sync asks (what another writer's writes need)
        await sub.unsubscribe()
    finally:
        await view.stop()


class _Nodes:
    """What ``live_names`` reads of a ``NodesView``: its verdict before and after a sync."""

    def __init__(self, before, after):
        self.before, self.after, self.synced = before, after, 0

    async def sync(self) -> None:
        self.synced += 1

    def live_names(self, timeout):
        return self.after if self.synced else self.before


class _Rep:
    def __init__(self, node):
        self.node = node


async def test_the_nodes_view_is_synced_only_when_a_node_not_yet_lost_looks_silent():
    live = NodeLiveness(js=None, node_timeout=10.0)
    quiet = _Nodes((["a", "b"], []), (["a", "b"], []))
    assert await live.live_names(quiet, None, strict=False) == ["a", "b"] and quiet.synced == 0
    # b looks silent in a view that fell behind; synced, it is alive: nobody is lost
    behind = _Nodes((["a"], [(_Rep("b"), 12.0)]), (["a", "b"], []))
    assert await live.live_names(behind, None, strict=False) == ["a", "b"] and behind.synced == 1
    assert live.lost == set()
    # a node already lost and still silent: no sync each round for it
    live.lost = {"c"}
    gone = _Nodes((["a"], [(_Rep("c"), 60.0)]), None)
    assert await live.live_names(gone, None, strict=False) == ["a"] and gone.synced == 0
    strict = _Nodes((["a"], []), (["a"], []))
    await live.live_names(strict, None)
    assert strict.synced == 1  # strict (the default): always


async def test_a_paced_round_asks_only_for_the_jobs_and_a_strict_round_for_every_view(nc):
    async with leading_optimizer(nc, interval=60.0) as opt:
        opt.reconcile_every = 3600.0  # one full round (the first as leader), then none
        first = await submit(nc, "a", 2)  # the first round as leader: a full one
        await wait_for(lambda: _scheduled(opt, first))
        # ... and that round ended: its record is written before its gs_alloc sync
        await wait_for(lambda: asyncio.sleep(0, time.monotonic() < opt._reconcile_at < float("inf")))
        asked, sub = await _count_stream_info(nc)
        rounds = opt.round_no
        second = await submit(nc, "b", 2)  # kicks a paced round, not a full one
        await wait_for(lambda: _scheduled(opt, second))
        assert opt.round_no > rounds
        assert time.monotonic() < opt._reconcile_at  # (no full round was due)
        await nc.flush()
        assert {v: asked[v] for v in VIEWS} == dict.fromkeys(VIEWS, 0)
        assert asked["KV_gs_jobs"] >= 1
        assert (await opt.allocs.catch_up(opt.leadership.fence.written[subj.ALLOC_BUCKET])) and \
            second in opt.allocs.jobs()  # the allocation it wrote, in the view it caught up
        asked.clear()
        await opt.round(strict=True)
        await nc.flush()
        await asyncio.sleep(0.05)
        assert all(asked[v] >= 1 for v in ("KV_gs_nodes", "KV_gs_node_modes", "KV_gs_models", "KV_gs_jobs"))
        await sub.unsubscribe()


async def _scheduled(opt: Optimizer, job_id: str) -> bool:
    rec = opt.jobs.get(job_id)
    return rec is not None and rec.state == JobState.SCHEDULED
