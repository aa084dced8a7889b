"""Which nodes a round may use: heard from within ``node_timeout`` by the server's
clock (the time the server stored their last report, ``views.NodesView``), never
the agent's. A node that falls silent is announced once (``node.lost``); a new
leader first gives agents one timeout to be heard."""

from __future__ import annotations

import time
from typing import Any

from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.kv import publish_event
from gearshift.bus.log import get_logger
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import NodeLost, NodeReport

log = get_logger(service="optimizer")


class NodeLiveness:
    def __init__(self, js: Any, node_timeout: float, clock: Clock = SYSTEM):
        self.js = js
        self.clock = clock  # stamps the node.lost event only; who is alive is the server's clock's call
        self.node_timeout = node_timeout
        self.lost: set[str] = set()
        self.fence: Any = None  # services.fencing.Fence of the leader: its node.lost events are fenced

    def grace_over(self, leader_since: float | None) -> bool:
        """A new leader (since ``leader_since``, monotonic) gives agents one timeout to be heard."""
        return leader_since is not None and time.monotonic() - leader_since > self.node_timeout

    async def live(self, nodes: Any, leader_since: float | None) -> list[NodeReport]:
        """The live nodes of ``nodes`` (a ``NodesView``); newly silent ones announced as lost."""
        names = await self.live_names(nodes, leader_since)
        return [nodes.entries[n][0] for n in names]

    async def live_names(self, nodes: Any, leader_since: float | None, *, strict: bool = True) -> list[str]:
        """The names of the live nodes of ``nodes`` (sorted; ``NodesView.live_names``:
        the same list while nobody came or went); newly silent ones announced as lost.
        Costs the silent and the lost nodes, not all.

        ``strict``: the view is synced with the server first (a stream-info request).
        Else it is synced only when a node not yet lost looks silent (a view that has
        not applied a node's last writes makes it look older): a node is called lost
        only by a synced view, and one called alive wrote within the timeout of the
        newest server time the view has seen (what a synced view knows, less the
        view's delivery lag)."""
        if strict:
            await nodes.sync()
        alive, silent = nodes.live_names(self.node_timeout)
        if not strict and any(n.node not in self.lost for n, _ in silent):
            await nodes.sync()
            alive, silent = nodes.live_names(self.node_timeout)
        if self.lost:
            quiet = {n.node for n, _ in silent}
            self.lost.intersection_update(quiet)  # a lost node heard from again is alive (or gone from the bucket)
        for n, age in silent:
            if n.node not in self.lost and self.grace_over(leader_since):
                self.lost.add(n.node)
                await publish_event(
                    self.js, NodeLost(ts=self.clock.now(), node=n.node, reason=f"no heartbeat for {age:.0f}s"),
                    f"node:{n.node}:lost:{n.ts:.3f}", subj.node_event(n.node, "node.lost"), self.fence,
                )
                log.warning("node lost", node=n.node, silent_s=round(age, 1))
        return alive
