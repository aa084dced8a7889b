"""The leader's scheduling round, with work in proportion to what changed.

One round: read the jobs and the live nodes, requeue the jobs of lost nodes,
settle drains and cancels no report will end, apply operators' node modes,
work out the GPUs held outside any decision and each node's state, gate jobs
on their dependencies, ask the policy, write its decision, bring ``gs_alloc``
in line, write stale waiting reasons. Finished jobs are archived between
rounds (``Optimizer.archive``): that is work per finished job, not a decision,
and a round that waited for it decided later.

Each of those steps looks at the jobs and nodes it concerns, found in indexes
kept from round to round (``services.round_state``), and the policy's views are
kept likewise (``PolicyStep.kept_views``): what a round costs beyond the policy's
own call grows with the jobs and nodes that changed, not with all live ones. A
full round (every ``reconcile_every`` s, on taking the lease and after a failed
round) looks at everything again, as a round did before: it rebuilds the indexes
from scratch, counts any difference from the kept ones (``mismatches``) and
makes every view again.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from gearshift.bus import observe
from gearshift.bus.kv import publish_event
from gearshift.bus.log import get_logger
from gearshift.bus.process import GcClock, OwnCpu
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobPreempted, RoundCompleted, RoundReply
from gearshift.services import node_modes
from gearshift.services.round_state import InUse, JobIndex, NodeIndex, RoundRecords, held_by_jobs, merge_held

if TYPE_CHECKING:
    from gearshift.services.optimizer import Optimizer

log = get_logger(service="optimizer")


class _AliveReports:
    """node -> its last report, for the live nodes only (``settle_drains`` asks of a few)."""

    def __init__(self, view: Any, alive: set[str]):
        self.view, self.alive = view, alive

    def get(self, node: str, default: Any = None) -> Any:
        return self.view.get(node) if node in self.alive else default


class Rounds:
    def __init__(self, opt: "Optimizer"):
        self.opt = opt
        self.jobs_index = JobIndex()
        self.nodes_index = NodeIndex()
        self.full_next = True  # the first round (as leader) looks at everything
        self.mismatches = 0  # full rounds whose rebuilt indexes differed from the kept ones
        self._alive: tuple[list[str], set[str]] = ([], set())  # (live names, as a set), last round's
        self._meter: OwnCpu | None = None  # the running round's own CPU

    def _take_changes(self, records: RoundRecords, full: bool) -> tuple[set[str], bool]:
        """The jobs whose record changed since the last round (the jobs view's marks),
        the job index brought up to date, and whether the round is a full one: a full
        round (or one after more changes than the view keeps marks of) rebuilds the
        index from scratch, counting any difference from the kept one."""
        changed = self.opt.jobs.dirty.take()
        if not full and changed is not None:
            self.jobs_index.apply(records, changed)
            return changed, False
        fresh = JobIndex.of(records)
        if changed is not None:
            self.jobs_index.apply(records, changed)
            if self.jobs_index.differences(fresh):
                self.mismatches += 1
                log.warning("kept job index differed from a rebuild", parts=self.jobs_index.differences(fresh))
        self.jobs_index = fresh
        return changed or set(), True

    def _take_node_changes(self, full: bool) -> None:
        """The node index brought up to date with the nodes view's marks (taken after
        the view's sync: every live node has its facts); rebuilt in a full round."""
        opt = self.opt
        changed = opt.nodes.dirty.take()
        if full or changed is None:
            # from the facts the view worked out as each report came in (``NodesView``, on every
            # report, marked or not): a rebuild that does not read every node's GPUs again
            fresh = NodeIndex.of({k: e[0] for k, e in opt.nodes.entries.items()}, opt.nodes.facts)
            if changed is not None:
                self.nodes_index.update(opt.nodes, changed, opt.nodes.facts)
                if self.nodes_index.differences(fresh):
                    self.mismatches += 1
                    log.warning("kept node index differed from a rebuild", parts=self.nodes_index.differences(fresh))
            self.nodes_index = fresh
        else:
            self.nodes_index.update(opt.nodes, changed, opt.nodes.facts)
        opt.models.node_type = self.nodes_index.node_type  # what ran teaches the oracle per GPU type

    def _note(self, records: RoundRecords, written: set[str]) -> None:
        """Records the round replaced since the last note: into the index, and remembered."""
        if records.touched:
            self.jobs_index.apply(records, records.touched)
            written |= records.touched
            records.touched = set()

    async def run(self, flush: bool = False, strict: bool = False) -> RoundReply:
        """One round, with the cycle collector held off until it ends: its collections
        then run in the pacer's rest, not in a round (a busy round at 5,000-10,000 live jobs
        spent 40-550 ms in them; ``bus.process.tune_gc``). Reference counting frees
        what a round drops meanwhile; only cycles wait."""
        was = gc.isenabled()
        gc.disable()
        try:
            self._meter = OwnCpu(self._run(flush, strict))  # the round's own CPU (``own_cpu_ms``)
            return await self._meter
        finally:
            if was:
                gc.enable()

    async def _run(self, flush: bool, strict: bool) -> RoundReply:
        opt = self.opt
        started, cpu_started = time.perf_counter(), time.process_time()
        gc_before, conflicts_before = GcClock.total, opt.store.conflicts
        opt.round_no += 1
        full = self.full_next or time.monotonic() >= opt._reconcile_at
        self.full_next = False
        # Which views are synced with the server (a stream-info request each): in a full
        # round and one asked for, all; else only the jobs (others write them: the admission
        # its submits and cancels). The nodes' is synced when a node looks silent
        # (``NodeLiveness.live_names``), gs_alloc's view waits for this leader's own last
        # write (``AllocWriter.reconcile``), and the modes' and models' are used as they are
        # (the leader syncs the modes' after writing one; a new model kicks a round).
        strict = strict or flush or full
        await opt.jobs.sync()
        records = RoundRecords(opt.jobs.live)  # O(live jobs), a copy: finished ones are not here
        changed, full = self._take_changes(records, full)
        index, written = self.jobs_index, set()
        names = await opt.liveness.live_names(opt.nodes, opt.leader_since, strict=strict)
        self._take_node_changes(full)
        if names is not self._alive[0]:
            self._alive = (names, set(names))
        alive = self._alive[1]
        if opt.liveness.grace_over(opt.leader_since):
            changes = await opt.records.requeue_lost(records, alive, None if full else index.on_nodes_not_in(alive))
        else:
            changes = 0
        self._note(records, written)
        changes += await opt.records.settle_drains(
            records, alive, _AliveReports(opt.nodes, alive), None if full else index.draining,
            None if full else index.cancelling)
        self._note(records, written)
        # Operators' cordons and drains (services.node_modes).
        if strict:
            await opt.modes.sync()
        modes = opt.modes.modes()
        changes += await opt.records.changed(records, [
            (rec.job_id, opt.records.back_to_queue(rec, why, JobPreempted))
            for rec, why in node_modes.to_move(records.values(), modes)])
        self._note(records, written)
        opt.records_seen = records

        held = merge_held(held_by_jobs(records, index.holders), self.nodes_index.node_held())
        seen_held = merge_held(held_by_jobs(records, index.holders, for_policy=True), self.nodes_index.node_held())
        if modes:
            live_reports = [opt.nodes.get(n) for n in names]
            for node, gpus in node_modes.cordon_held(live_reports, records.values(), modes).items():
                held.setdefault(node, set()).update(gpus)
                seen_held.setdefault(node, set()).update(gpus)
        node_states = self.nodes_index.node_states(names, seen_held)
        changes += await opt.deps.gate(records, None if full else index.waiting_on_deps)
        self._note(records, written)
        blocked = opt.deps.blocked
        decision, views, t_policy = await opt.policy_step.decide(
            records, node_states, alive, skip=blocked, changed=None if full else changed | written,
            active=index.holding.keys(), on_dead=index.on_nodes_not_in(alive), pinned=index.pinned, strict=strict)
        decision.waiting.update(blocked)
        opt.pause_if_asked()

        t_write = time.perf_counter()
        changes += await opt.records.apply(decision, records, _GpuCount(self.nodes_index), held,
                                           used=InUse(records, index, held), holding=index.holding)
        t_write = time.perf_counter() - t_write
        self._note(records, written)
        t_rest = time.perf_counter()
        # gs_alloc follows the records: each changed job's allocation every round
        # (cancels withdraw theirs this way); every live job's, and the pass over
        # every node copy, on taking the lease, after a failed round, and every
        # ``reconcile_every`` s -- a round's own writes fail the round if any fails.
        if full:
            opt._reconcile_at = float("inf")  # until this round has ended well
        await opt.writer.reconcile(records, copies=full, jobs=None if full else changed | written)
        opt.last_explain = await opt.records.explain(decision, records, flush=flush)
        self._note(records, written)
        t_rest = time.perf_counter() - t_rest

        if opt._reconcile_at == float("inf"):
            opt._reconcile_at = time.monotonic() + opt.reconcile_every
        pending = len(views) - sum(1 for v in views if v.job_id in decision.allocations)
        # what changed: records that moved since the last round (the jobs view's marks)
        # and those this round wrote -- the cost's unit (loadtest.scale)
        changed_jobs = len((changed | written) & records.keys())
        ms = (time.perf_counter() - started) * 1e3
        cpu_ms = (time.process_time() - cpu_started) * 1e3
        # its own: its steps on the loop's thread and its policy's thread, not the heartbeats
        # and reports the loop handled while the round waited (those grow with the nodes)
        steps_cpu = self._meter.so_far() if self._meter is not None else 0.0
        own_cpu_ms = (steps_cpu + opt.policy_step.policy_cpu) * 1e3
        observe.ROUND_SECONDS.labels(opt.policy.name).observe(ms / 1e3)
        observe.round_cpu(own_cpu_ms / 1e3, changes > 0)
        log.debug("round", round=opt.round_no, ms=round(ms, 1), policy_ms=round(t_policy * 1e3, 1),
                  policy_cpu_ms=round(opt.policy_step.policy_cpu * 1e3, 1), learned=opt.policy_step.learned,
                  write_ms=round(t_write * 1e3, 1), after_ms=round(t_rest * 1e3, 1),
                  gc_ms=round((GcClock.total - gc_before) * 1e3, 1), cas_conflicts=opt.store.conflicts - conflicts_before,
                  cpu_ms=round(cpu_ms, 1), own_cpu_ms=round(own_cpu_ms, 1), changed_jobs=changed_jobs, full=full,
                  live=len(records), nodes=len(names), changes=changes)
        observe.job_counts(index.counts)  # the live jobs (finished ones leave the round's view)
        if changes:
            ev = RoundCompleted(
                ts=opt.clock.now(), round=opt.round_no, policy=opt.policy.name, pending=pending,
                running=len(decision.allocations), changes=changes, duration_ms=ms, cpu_ms=cpu_ms,
                changed_jobs=changed_jobs, own_cpu_ms=own_cpu_ms,
            )
            await publish_event(opt.js, ev, f"round:{opt.instance}:{opt.round_no}",
                                subj.round_event(ev.__struct_config__.tag), opt.leadership.fence)
        return RoundReply(round=opt.round_no, allocations=len(decision.allocations), pending=pending, duration_ms=ms)


class _GpuCount:
    """node -> its GPUs (``capacity.assign`` reads the nodes its decisions use)."""

    def __init__(self, nodes: NodeIndex):
        self.nodes = nodes

    def __getitem__(self, node: str) -> int:
        return self.nodes.gpu_count(node)
