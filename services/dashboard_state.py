"""What the dashboard shows, built from what it watches on the bus (pure: no NATS).

``DashboardState`` is the dashboard's state, folded from job records (KV ``gs_jobs``),
node reports (KV ``gs_nodes``), live progress (``gs.job.*.progress``) and the
recent events (``GS_EVENTS``). ``snapshot()`` turns it into the JSON the page
renders. Lists are bounded: the page gets at most ``PAGE`` jobs per list and
the last ``EVENTS`` events; switch timelines keep the last ``SWITCHES`` per job.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobProgress,
    JobReconfigured,
    JobRecord,
    JobState,
    JobSwitched,
    NodeReport,
)

PAGE = 200
EVENTS = 200
SWITCHES = 10
PHASES = ("checkpoint", "teardown", "launch", "restore", "first_step")


def _plan(plan: Any) -> str:
    return plan.label() if plan is not None else "-"


class DashboardState:
    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.nodes: dict[str, NodeReport] = {}
        self.progress: dict[str, JobProgress] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS)
        self.switches: dict[str, deque[dict[str, Any]]] = {}
        self.version = 0  # bumped on every change: the page is told to refresh

    # ------------------------------------------------------------ feeding
    def put_job(self, rec: JobRecord | None, job_id: str) -> None:
        if rec is None:
            self.jobs.pop(job_id, None)
            self.progress.pop(job_id, None)
        else:
            self.jobs[job_id] = rec
            if rec.state in TERMINAL_STATES:
                self.progress.pop(job_id, None)
        self.version += 1

    def put_node(self, rep: NodeReport | None, node: str) -> None:
        if rep is None:
            self.nodes.pop(node, None)
        else:
            self.nodes[node] = rep
        self.version += 1

    def put_progress(self, prog: JobProgress) -> None:
        rec = self.jobs.get(prog.job_id)
        if rec is not None and rec.state in TERMINAL_STATES:
            return
        self.progress[prog.job_id] = prog
        self.version += 1

    def put_event(self, stream_seq: int, subject: str, ev: Any) -> dict[str, Any]:
        item = {"stream_seq": stream_seq, "subject": subject, **codec.to_builtins(ev)}
        self.events.append(item)
        if isinstance(ev, JobReconfigured):
            self._switch(ev.job_id, ev.generation)
            self.switches[ev.job_id][-1].update(
                started=ev.ts, from_plan=_plan(ev.previous_plan), plan=_plan(ev.plan), from_gpus=ev.previous_gpus,
                gpus=sum(len(p.gpus) for p in ev.placement), reason=ev.reason,
            )
        elif isinstance(ev, JobSwitched):
            sw = self._switch(ev.job_id, ev.generation)
            # what the reconfiguration already said stays when this event leaves it out
            if ev.from_plan is not None or "from_plan" not in sw:
                sw.update(from_plan=_plan(ev.from_plan), from_gpus=ev.from_gpus)
            if ev.plan is not None or "plan" not in sw:
                sw.update(plan=_plan(ev.plan), gpus=ev.gpus)
            sw.update(
                done=ev.ts, phases={p: round(getattr(ev, f"{p}_s"), 3) for p in PHASES}, total_s=round(ev.total_s, 3),
                steps_lost=ev.steps_lost, resumed_step=ev.resumed_step,
            )
            sw.setdefault("started", ev.ts - ev.total_s)
        self.version += 1
        return item

    def _switch(self, job_id: str, generation: int) -> dict[str, Any]:
        rows = self.switches.setdefault(job_id, deque(maxlen=SWITCHES))
        for sw in rows:
            if sw["generation"] == generation:
                return sw
        sw: dict[str, Any] = {"job_id": job_id, "generation": generation}
        rows.append(sw)
        return sw

    # ------------------------------------------------------------ rendering
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        jobs = sorted(self.jobs.values(), key=lambda r: (r.submitted_at, r.job_id))
        active = [r for r in jobs if r.state in (*ACTIVE_STATES, JobState.CANCELLING)]
        queue = [r for r in jobs if r.state == JobState.PENDING]
        return {
            "ts": now,
            "version": self.version,
            "nodes": self._nodes(active),
            "queue": [self._queued(r, now) for r in queue[:PAGE]],
            "queue_total": len(queue),
            "running": [self._running(r, now) for r in active[:PAGE]],
            "running_total": len(active),
            "finished": [self._finished(r) for r in [r for r in jobs if r.state in TERMINAL_STATES][-20:]],
            "switches": [dict(sw) for rows in self.switches.values() for sw in rows if "phases" in sw or "started" in sw],
            "tenants": self._tenants(jobs),
            "events": list(self.events)[-50:][::-1],
        }

    def _nodes(self, active: list[JobRecord]) -> list[dict[str, Any]]:
        owner: dict[tuple[str, int], str] = {}
        draining: dict[tuple[str, int], str] = {}
        for r in active:
            for p in r.placement:
                for g in p.gpus:
                    owner[(p.node, g)] = r.job_id
            for p in r.draining:
                for g in p.gpus:
                    draining[(p.node, g)] = r.job_id
        out = []
        for name in sorted(self.nodes):
            n = self.nodes[name]
            gpus = []
            for g in n.gpus:
                gpus.append({
                    "index": g.index, "job": owner.get((name, g.index)), "draining": draining.get((name, g.index)),
                    "util": g.utilization, "mem_used_mib": round(g.memory_used / 2**20),
                    "mem_total_mib": round(g.memory_total / 2**20), "processes": len(g.processes),
                    "reserved": g.index in n.reserved,
                })
            out.append({"node": name, "probe": n.probe, "cpus": n.cpus, "heartbeat_age_s": round(max(0.0, time.time() - n.ts), 1),
                        "gpus": gpus})
        return out

    @staticmethod
    def _queued(r: JobRecord, now: float) -> dict[str, Any]:
        return {"job_id": r.job_id, "name": r.spec.name, "tenant": r.spec.tenant, "gpus": r.spec.gpus,
                "priority": r.spec.priority, "guaranteed": r.spec.guaranteed, "reason": r.reason,
                "waiting_s": round(max(0.0, now - r.submitted_at), 1)}

    def _running(self, r: JobRecord, now: float) -> dict[str, Any]:
        prog = self.progress.get(r.job_id)
        steps = max(r.steps_done, prog.steps_done if prog and prog.generation == r.generation else 0)
        return {
            "job_id": r.job_id, "name": r.spec.name, "tenant": r.spec.tenant, "state": r.state.value,
            "plan": _plan(r.plan), "generation": r.generation, "gpus": sum(len(p.gpus) for p in r.placement),
            "placement": [f"{p.node}:{','.join(map(str, p.gpus))}" for p in r.placement],
            "steps_done": steps, "steps": r.spec.steps,
            "progress": round(steps / r.spec.steps, 4) if r.spec.steps else 0.0,
            "samples_per_s": round(prog.samples_per_s, 2) if prog else None,
            "run_time_s": round(now - r.started_at, 1) if r.started_at else None,
            "restarts": r.restarts, "reason": r.reason, "switching": bool(r.draining or r.switch),
        }

    @staticmethod
    def _finished(r: JobRecord) -> dict[str, Any]:
        return {"job_id": r.job_id, "name": r.spec.name, "tenant": r.spec.tenant, "state": r.state.value,
                "steps_done": r.steps_done, "steps": r.spec.steps, "reason": r.reason}

    def _tenants(self, jobs: list[JobRecord]) -> list[dict[str, Any]]:
        total = sum(len(n.gpus) for n in self.nodes.values()) or 1
        out: dict[str, dict[str, Any]] = {}
        for r in jobs:
            t = out.setdefault(r.spec.tenant, {"tenant": r.spec.tenant, "gpus": 0, "running": 0, "pending": 0,
                                               "finished": 0})
            if r.state in (*ACTIVE_STATES, JobState.CANCELLING):
                t["running"] += 1
                t["gpus"] += sum(len(p.gpus) for p in r.placement)
            elif r.state == JobState.PENDING:
                t["pending"] += 1
            else:
                t["finished"] += 1
        for t in out.values():
            t["share"] = round(t["gpus"] / total, 4)
        return sorted(out.values(), key=lambda t: (-t["gpus"], t["tenant"]))
