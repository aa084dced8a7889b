"""Fault injection with real processes: ``python -m loadtest.chaos --jobs 50 --json``.

Two scenarios, each a full emulated run of ``--jobs`` jobs:

- ``single``: one nats-server (JetStream on disk). Every service is killed
  with SIGKILL several times at random moments, the server is restarted
  mid-run, and an agent is killed in the middle of a plan switch.
- ``cluster``: a 3-server NATS cluster, streams and buckets with 3 replicas
  (``GEARSHIFT_REPLICAS=3``). The same service kills, one server killed with
  SIGKILL (and brought back later), and an agent killed mid-switch.

Authorisation is on (``--no-auth`` turns it off): every service and agent
connects as its own user (``services.auth``), jobs are submitted and
cancelled by tenant users, the checker reads as the admin.

The plan switches are not left to the policy: the first jobs are long, and
the checker pins a new plan on one of them through ``gs.optimizer.reconfigure``
and kills an agent of the job in the middle of that switch, twice per
scenario. The first time the agent is frozen (SIGSTOP) before the pin, so it
dies exactly between the new allocation and any reaction to it; the second
time it dies at a random moment of the changeover.

A supervisor restarts whatever died (what systemd's ``Restart=always`` does
in a deployment). The client submits with idempotency tokens and retries
until it has an answer, and cancels a few jobs. At the end it checks:

- every acknowledged job reached exactly one terminal state (record and
  events agree, one terminal event);
- no job ever ran under two generations at once: a sampler reads
  ``/proc/*/environ`` of the worker processes every few milliseconds and
  records which generations of each job are alive together;
- per job the event stream has sequence numbers 1..n without a gap or a
  duplicate, and n is the record's ``event_seq`` with an empty outbox;
- the record's state and generation are what its events say.

Accounting (``loadtest.usage_check``): the optimizer's ``/metrics`` is scraped
every 0.25 s as Prometheus would, and once every job is archived ``gearshift
usage --since 1h -o json`` (as the admin) must give each tenant's GPU-hours
within 1% of ``gearshift_gpu_seconds_total`` summed over the optimizer's
lifetimes (``accounting``, ``accounting_ok``; a counter increment made less
than a scrape before a SIGKILL is lost, as it is to Prometheus).

The JSON report counts kills, restarts, jobs, lost jobs, duplicate events,
and says whether every fault kind was injected at least once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gearshift.bus.natsd import NatsServer
from gearshift.bus.tasks import cancel_and_wait
from loadtest.usage_check import CounterScraper, compare, wait_archived
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    TERMINAL_STATES,
    JobRecord,
    JobRef,
    JobSpec,
    JobState,
    ModelSpec,
    NodeList,
    ReconfigureReply,
    ReconfigureRequest,
    SubmitReply,
    SubmitRequest,
)

SERVICE_KINDS = ("admission", "optimizer", "perfmodel")
TENANTS = ("vision", "nlp", "llm")
NODE_TIMEOUT = 10  # seconds without a heartbeat before the optimizer calls a node lost
# A drain ends when every node of the old generation reported its exit; an agent killed
# mid-switch is restarted by the supervisor and its successor reports the run it reaped
# (agent/agent.py, "Restart"). The drain timeout (120 s by default) is only the backstop
# for a node that never reports; here jobs last seconds, so 30 s. The report counts the
# drains that ended by it (``drains_settled_by_timeout``, from the optimizer's log).
DRAIN_TIMEOUT = 30
SWITCH_TARGETS = 2  # the first jobs run long: the forced switches happen on them
FAULT_KINDS = (
    "kill_admission", "kill_optimizer", "kill_perfmodel", "restart_nats_server", "kill_cluster_server",
    "kill_agent_mid_switch",
)
EVENT_STATE = {
    "job.submitted": "pending", "job.scheduled": "scheduled", "job.reconfigured": "scheduled",
    "job.running": "running", "job.preempted": "pending", "job.requeued": "pending",
    "job.cancel_requested": "cancelling", "job.cancelled": "cancelled", "job.completed": "completed",
    "job.failed": "failed",
}
TERMINAL_KINDS = {"job.cancelled", "job.completed", "job.failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes
@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    paused: bool = False  # not restarted while set

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()  # SIGKILL to the service only: its children (job processes) are orphaned
            self.proc.wait()
            self.kills += 1

    def stop(self, timeout: float = 15) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class NatsFleet:
    """One server, or a 3-server cluster, on fixed ports so a restarted server comes back where it was."""

    def __init__(self, root: Path, size: int, config: Path | None = None):
        self.root = root
        self.size = size
        self.config = config  # authorisation (services.auth) when set
        self.ports = [free_port() for _ in range(size)]
        self.cluster_ports = [free_port() for _ in range(size)] if size > 1 else []
        self.servers: list[NatsServer | None] = [None] * size
        self.restarts = 0
        self.kills = 0

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def _make(self, i: int) -> NatsServer:
        extra: list[str] = []
        if self.size > 1:
            routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.cluster_ports)
            extra = ["--cluster", f"nats://127.0.0.1:{self.cluster_ports[i]}", "--cluster_name", "gschaos",
                     "--routes", routes]
        return NatsServer(self.root / f"js{i}", port=self.ports[i], extra_args=extra, name=f"gs{i}",
                          config=self.config)

    def start(self, i: int | None = None) -> None:
        for k in ([i] if i is not None else range(self.size)):
            srv = self._make(k)
            srv.start(timeout=30)
            self.servers[k] = srv

    def stop(self, i: int, kill: bool = False) -> None:
        srv = self.servers[i]
        if srv is not None:
            srv.stop(kill=kill)
            self.servers[i] = None

    def stop_all(self) -> None:
        for i in range(self.size):
            self.stop(i)


# ------------------------------------------------------------------ the generation sampler
class GenerationSampler(threading.Thread):
    """Reads the environment of every emulated worker of this run, often, and
    records the generations of each job that were alive at the same moment."""

    def __init__(self, run_id: str, period: float = 0.02):
        super().__init__(daemon=True)
        self.run_id = run_id.encode()
        self.period = period
        self.stop_flag = threading.Event()
        self.samples = 0
        self.seen: dict[str, set[int]] = defaultdict(set)
        self.overlaps: list[dict[str, Any]] = []  # two generations alive together
        self.doubles: list[dict[str, Any]] = []  # one generation twice on one node
        self._pids_cache: dict[int, tuple[str, int, str] | None] = {}

    def _identify(self, pid: int) -> tuple[str, int, str] | None:
        if pid in self._pids_cache:
            return self._pids_cache[pid]
        ident = None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if b"emulated_worker" in cmd:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                if env.get(b"GEARSHIFT_CHAOS_RUN") == self.run_id:
                    ident = (env[b"GEARSHIFT_JOB_ID"].decode(), int(env[b"GEARSHIFT_GENERATION"]),
                             env[b"GEARSHIFT_NODE"].decode())
        except (OSError, KeyError, ValueError):
            return None  # gone, or a zombie: not running
        self._pids_cache[pid] = ident
        return ident

    def _alive(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except OSError:
            return False

    def run(self) -> None:
        while not self.stop_flag.is_set():
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
            live = set(pids)
            for old in list(self._pids_cache):
                if old not in live:
                    del self._pids_cache[old]
            gens: dict[str, set[int]] = defaultdict(set)
            per_node: Counter = Counter()
            for pid in pids:
                ident = self._identify(pid)
                if ident is None or not self._alive(pid):
                    continue
                job, gen, node = ident
                gens[job].add(gen)
                per_node[(job, gen, node)] += 1
                self.seen[job].add(gen)
            t = time.time()
            for job, g in gens.items():
                if len(g) > 1 and len(self.overlaps) < 1000:
                    self.overlaps.append({"job_id": job, "generations": sorted(g), "ts": t})
            for (job, gen, node), n in per_node.items():
                if n > 1 and len(self.doubles) < 1000:
                    self.doubles.append({"job_id": job, "generation": gen, "node": node, "processes": n, "ts": t})
            self.samples += 1
            self.stop_flag.wait(self.period)


# ------------------------------------------------------------------ the run
@dataclass
class Scenario:
    name: str
    servers: int
    replicas: int
    jobs: int
    nodes: int = 3
    gpus_per_node: int = 4
    policy: str = "rubick"
    seed: int = 1
    submit_over: float = 30.0  # seconds over which the jobs arrive
    deadline: float = 300.0
    service_kills: int = 3  # per service kind, at least
    cancel_fraction: float = 0.1
    auth: bool = True


@dataclass
class Outcome:
    scenario: str
    faults: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


def workload(n: int, rng: random.Random, gpus_per_node: int) -> list[JobSpec]:
    models = [
        ModelSpec(name="gpt2", params=1560, layers=24, hidden=1920, seq_len=1024),
        ModelSpec(name="bert", params=336, layers=24, hidden=1536, seq_len=1024),
        ModelSpec(name="vit", params=86, layers=12, hidden=768, seq_len=197),
        ModelSpec(name="llama7", params=6740, layers=32, hidden=4096, seq_len=2048),
    ]
    specs = []
    for i in range(n):
        gpus = rng.choice([1, 1, 2, 2, 4, 2 * gpus_per_node])
        specs.append(JobSpec(
            name=f"chaos-{i:03d}", model=rng.choice(models), global_batch=16, steps=rng.randint(80, 160),
            gpus=gpus, tenant=rng.choice(TENANTS), step_time=round(rng.uniform(0.04, 0.08), 3),
        ))
    for i in range(min(SWITCH_TARGETS, n)):  # ~40 s each: long enough to be switched twice while running
        specs[i] = msgspec.structs.replace(specs[i], steps=800, gpus=2, step_time=0.05)
    return specs


def switch_targets(acked: dict[str, str]) -> list[str]:
    """Job ids of the long jobs the forced switches use, in submission order."""
    names = {f"chaos-{i:03d}" for i in range(SWITCH_TARGETS)}
    return [j for j, n in acked.items() if n in names]


class MidSwitchKiller:
    """The fault "agent killed in the middle of a plan switch", forced: the
    switch is pinned through ``gs.optimizer.reconfigure`` on a long target
    job instead of waiting for the policy to choose one."""

    def __init__(self, run: "ChaosRun"):
        self.run = run

    async def _running_target(self, nc: Any, give_up: float) -> JobRecord | None:
        """A target job that runs (with steps still to go) and is not switching."""
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline and not self.run.done:
            for job_id in switch_targets(self.run.acked):
                try:
                    rec = await self.run.request(nc, subj.ADMISSION_GET, JobRef(job_id=job_id), JobRecord, give_up=10)
                except Exception:
                    continue
                if (rec.state == JobState.RUNNING and not rec.draining and rec.plan is not None
                        and rec.steps_done < rec.spec.steps - 100):
                    return rec
            await asyncio.sleep(0.5)
        return None

    async def _generation_after(self, nc: Any, job_id: str, generation: int, give_up: float) -> JobRecord | None:
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            try:
                rec = await self.run.request(nc, subj.ADMISSION_GET, JobRef(job_id=job_id), JobRecord, give_up=5)
                if rec.generation > generation or rec.terminal:
                    return rec
            except Exception:
                pass
            await asyncio.sleep(0.1)
        return None

    async def _pin_and_wait(self, nc: Any, req: ReconfigureRequest, generation: int) -> JobRecord | None:
        """Pin, then wait for the job's next generation (the switch decided)."""
        await self.run.request(nc, subj.OPTIMIZER + ".reconfigure", req, ReconfigureReply)
        return await self._generation_after(nc, req.job_id, generation, give_up=60)

    async def __call__(self, nc: Any, wanted: int = 2) -> None:
        """Pin a new plan on a running target job (``gs.optimizer.reconfigure``,
        the same GPUs per node, activation checkpointing flipped) and kill -9
        an agent of the job in the middle of the switch. The first agent is
        frozen (SIGSTOP) before the pin and killed once the new generation is
        decided, so it dies between the new allocation and any reaction to
        it; the next ones die at a random moment of the changeover."""
        killed = attempts = 0
        while killed < wanted and not self.run.done and attempts < 3 * wanted:
            attempts += 1
            rec = await self._running_target(nc, give_up=120)
            if rec is None or rec.plan is None:
                self.run.outcome.notes.append("no running target job to switch")
                return
            node = self.run.rng.choice([p.node for p in rec.placement])
            agent = self.run.services[node]
            frozen = killed == 0 and agent.alive()
            plan = msgspec.structs.replace(rec.plan, grad_ckpt=not rec.plan.grad_ckpt)
            req = ReconfigureRequest(job_id=rec.job_id, plan=plan, reason=f"chaos: switch {killed + 1}",
                                     placement=[{"node": p.node, "gpus": len(p.gpus)} for p in rec.placement])  # type: ignore[misc]
            req = codec.convert(codec.to_builtins(req), ReconfigureRequest)
            if frozen:
                assert agent.proc is not None
                agent.proc.send_signal(signal.SIGSTOP)
            try:
                new = None
                try:  # frozen for less than the node timeout, or the node is lost instead
                    new = await asyncio.wait_for(self._pin_and_wait(nc, req, rec.generation),
                                                 NODE_TIMEOUT - 3 if frozen else 60)
                except asyncio.TimeoutError:
                    pass
                if new is None and frozen:  # the optimizer is restarting: go on unfrozen, kill at the decision
                    assert agent.proc is not None
                    agent.proc.send_signal(signal.SIGCONT)
                    frozen = False
                    self.run.outcome.notes.append(f"{rec.job_id}: no switch decision within {NODE_TIMEOUT - 3} s; agent thawed")
                    try:
                        new = await asyncio.wait_for(self._pin_and_wait(nc, req, rec.generation), 60)
                    except asyncio.TimeoutError:
                        pass
                elif not frozen:
                    await asyncio.sleep(self.run.rng.uniform(0.0, 0.4))
                if new is None or new.terminal:
                    self.run.outcome.notes.append(f"{rec.job_id}: the pinned switch did not start")
                    continue
                self.run.switches_seen += 1
                agent.kill9()  # SIGKILL ends a stopped process too
            finally:
                if frozen and agent.alive():
                    assert agent.proc is not None
                    agent.proc.send_signal(signal.SIGCONT)
            killed += 1
            self.run.outcome.faults["kill_agent_mid_switch"] += 1
            self.run.log("kill -9 agent mid-switch", node, rec.job_id, "gen", rec.generation, "->", new.generation,
                     "frozen" if frozen else "")
            await asyncio.sleep(3)


async def read_events(nc: Any) -> list[tuple[str, Any]]:
    """Every job event in GS_EVENTS, in stream order."""
    from nats.js.api import DeliverPolicy

    js = nc.jetstream()
    info = await js.stream_info(subj.EVENTS_STREAM)
    out: list[tuple[str, Any]] = []
    if info.state.messages == 0:
        return out
    sub = await js.subscribe("gs.evt.job.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        last = info.state.last_seq
        while True:
            msg = await sub.next_msg(timeout=10)
            out.append((msg.subject, codec.decode_event(msg.data)))
            if msg.metadata.sequence.stream >= last or msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out

def describe_unended(job_id: str, rec: JobRecord | None, evs: list[Any]) -> dict[str, Any]:
    """What a job that never ended looked like: stuck (a record in a live
    state, and why) or lost (no record)."""
    if rec is None:
        return {"job_id": job_id, "record": None}
    return {"job_id": job_id, "state": rec.state.value, "generation": rec.generation, "reason": rec.reason,
            "placement": [f"{p.node}:{list(p.gpus)}" for p in rec.placement],
            "draining": [f"{p.node}:{list(p.gpus)}" for p in rec.draining], "steps_done": rec.steps_done,
            "outbox": len(rec.outbox), "last_events": [e.__struct_config__.tag for e in
                                                       sorted(evs, key=lambda e: e.seq)[-5:]]}

def audit(run: "ChaosRun", recs: dict[str, JobRecord], events: list[tuple[str, Any]]) -> dict[str, Any]:
    """What the run left: lost jobs, duplicate or missing events, records that disagree with their events."""
    by_job: dict[str, list[Any]] = defaultdict(list)
    for _, ev in events:
        by_job[ev.job_id].append(ev)
    lost = sorted(j for j in run.acked if j not in recs or recs[j].state not in TERMINAL_STATES)
    duplicates = gaps = mismatches = multi_terminal = 0
    problems: list[str] = []
    for job_id in run.acked:
        evs = by_job.get(job_id, [])
        seqs = Counter(e.seq for e in evs)
        dup = sum(n - 1 for n in seqs.values() if n > 1)
        duplicates += dup
        want = set(range(1, max(seqs, default=0) + 1))
        gap = len(want - set(seqs))
        gaps += gap
        if dup or gap:
            problems.append(f"{job_id}: events seq {sorted(seqs.elements())}")
        terminal = [e for e in evs if e.__struct_config__.tag in TERMINAL_KINDS]
        if len(terminal) != 1:
            multi_terminal += 1
            problems.append(f"{job_id}: {len(terminal)} terminal events")
        rec = recs.get(job_id)
        if rec is None or not evs:
            continue
        ordered = sorted(evs, key=lambda e: e.seq)
        state = EVENT_STATE.get(ordered[-1].__struct_config__.tag)
        gen = max(e.generation for e in ordered)
        if (state != rec.state.value or gen != rec.generation or ordered[-1].seq != rec.event_seq
                or rec.outbox):
            mismatches += 1
            problems.append(f"{job_id}: record {rec.state.value} g{rec.generation} seq{rec.event_seq} "
                            f"outbox{len(rec.outbox)} vs events {state} g{gen} seq{ordered[-1].seq}")
    states = Counter(r.state.value for r in recs.values())
    return dict(
        jobs=len(run.acked), submit_failed=len(run.submit_failed), completed=states.get("completed", 0),
        cancelled=states.get("cancelled", 0), failed=states.get("failed", 0), lost_jobs=len(lost),
        lost=lost[:20], lost_detail=[describe_unended(j, recs.get(j), by_job.get(j, [])) for j in lost[:10]],
        duplicate_events=duplicates, event_gaps=gaps, kv_event_mismatches=mismatches,
        jobs_without_exactly_one_terminal_event=multi_terminal,
        two_generations_at_once=len({o["job_id"] for o in run.sampler.overlaps}),
        same_generation_twice_on_a_node=len({o["job_id"] for o in run.sampler.doubles}),
        overlap_examples=run.sampler.overlaps[:5], double_examples=run.sampler.doubles[:5],
        problems=problems[:20], events=len(events), sampler_samples=run.sampler.samples,
        reconfigurations=sum(1 for _, e in events if e.__struct_config__.tag == "job.reconfigured"),
        restarts_of_jobs=sum(r.restarts for r in recs.values()),
    )


class ChaosRun:
    def __init__(self, sc: Scenario, root: Path, verbose: bool = False):
        self.sc = sc
        self.root = root
        self.verbose = verbose
        self.rng = random.Random(sc.seed)
        self.auth = None
        if sc.auth:
            from gearshift.bus.auth import write_auth_dir

            self.auth = write_auth_dir(root / "auth", [f"node{i}" for i in range(sc.nodes)], list(TENANTS))
        self.fleet = NatsFleet(root / "nats", sc.servers, self.auth.config if self.auth else None)
        self.services: dict[str, Service] = {}
        self.outcome = Outcome(sc.name)
        self.run_id = f"{sc.name}-{os.getpid()}-{sc.seed}"
        self.sampler = GenerationSampler(self.run_id)
        self.acked: dict[str, str] = {}  # job id -> name
        self.submit_failed: list[str] = []
        self.cancelled: set[str] = set()
        self.switches_seen = 0
        self.done = False
        self.tenant_nc: dict[str, Any] = {}

    def log(self, *msg: Any) -> None:
        if self.verbose:
            print(f"[{time.strftime('%H:%M:%S')} {self.sc.name}]", *msg, file=sys.stderr, flush=True)

    # ------------------------------------------------------------ setup
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        env.update(
            GEARSHIFT_NATS_URL=self.fleet.url, GEARSHIFT_LOG_FORMAT="json", GEARSHIFT_LOG_LEVEL="INFO",
            GEARSHIFT_REPLICAS=str(self.sc.replicas), GEARSHIFT_CHAOS_RUN=self.run_id,
            GEARSHIFT_CKPT_INTERVAL="1", GEARSHIFT_METRICS_PORT="0", GEARSHIFT_OBSERVE_DIR=str(self.root / "observe"),
            # finished jobs move to the history store (and their accounts out) during the faults too
            GEARSHIFT_OPTIMIZER_ARCHIVE_AFTER="5",
            # cheap restarts make the policy switch plans often: the switches are what we break
            GEARSHIFT_POLICY_OPTIONS=json.dumps({"restart_cost": 1.0, "min_run_time": 2.0}),
        )
        return env

    def _add(self, name: str, argv: list[str], user: str) -> None:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = self._env()
        if self.auth is not None:
            env["GEARSHIFT_CREDS"] = str(self.auth.creds(user))
        self.services[name] = Service(name, argv, env, logs / f"{name}.log")

    def _creds(self, user: str) -> dict[str, Any]:
        """nats-py connect options of ``user`` (none with authorisation off)."""
        if self.auth is None:
            return {}
        from gearshift.bus.auth import connect_options, load_creds

        return connect_options(load_creds(self.auth.creds(user)))

    async def setup(self) -> None:
        self.fleet.start()
        if self.auth is not None:
            from gearshift.bus.auth import set_url

            set_url(self.auth, self.fleet.url)
        from gearshift.bus.client import connect
        from gearshift.bus.infra import ensure_infra

        deadline = time.monotonic() + 60
        while True:  # a fresh cluster elects its JetStream meta leader first
            try:
                nc = await connect(self.fleet.url, name="chaos-setup", retry_for=10, **self._creds("admin"))
                try:
                    await ensure_infra(nc, replicas=self.sc.replicas)
                finally:
                    await nc.close()
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JetStream not ready: {exc}") from exc
                await asyncio.sleep(0.5)
        py = sys.executable
        total = self.sc.nodes * self.sc.gpus_per_node
        self._add("admission", [py, "-m", "gearshift.services.admission", "--max-gpus", str(total)], "admission")
        self._add("optimizer", [py, "-m", "gearshift.services.optimizer", "--policy", self.sc.policy, "--interval", "1",
                                "--node-timeout", str(NODE_TIMEOUT), "--drain-timeout", str(DRAIN_TIMEOUT)],
                  "optimizer")
        self._add("perfmodel", [py, "-m", "gearshift.services.perfmodel_service"], "perfmodel")
        for i in range(self.sc.nodes):
            name = f"node{i}"
            self._add(name, [py, "-m", "gearshift.agent", "--node", name, "--fake-gpus", str(self.sc.gpus_per_node),
                             "--cpus", "32", "--workdir", str(self.root / "agents" / name),
                             "--ckpt-root", str(self.root / "ckpt"), "--heartbeat", "0.5", "--grace", "5"],
                      f"agent-{name}")
        for s in self.services.values():
            s.start()
        self.sampler.start()

    async def supervise(self) -> None:
        """Restart what died, after a short pause (systemd Restart=always)."""
        while not self.done:
            for s in self.services.values():
                if not s.alive() and not s.paused:
                    await asyncio.sleep(0.3)
                    if not s.alive() and not s.paused:
                        self.log("restart", s.name)
                        s.start()
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------ client
    async def client(self) -> Any:
        from gearshift.bus.client import connect

        return await connect(self.fleet.url, name="chaos-client", retry_for=30, **self._creds("admin"))

    async def as_tenant(self, tenant: str) -> tuple[Any, str]:
        """The connection of ``tenant``'s user and its subject suffix (the admin's, unsuffixed, with auth off)."""
        if self.auth is None:
            return self.tenant_nc.setdefault("", await self.client()), ""
        if tenant not in self.tenant_nc:
            from gearshift.bus.client import connect

            self.tenant_nc[tenant] = await connect(self.fleet.url, name=f"chaos-{tenant}", retry_for=30,
                                                   **self._creds(f"tenant-{tenant}"))
        return self.tenant_nc[tenant], "." + subj.token(tenant)

    async def request(self, nc: Any, subject: str, body: Any, reply_type: Any, give_up: float = 90) -> Any:
        from gearshift.bus.client import ServiceCallError, call

        deadline = time.monotonic() + give_up
        while True:
            try:
                return await call(nc, subject, body, reply_type, timeout=3)
            except ServiceCallError as exc:
                if exc.code not in ("503", "504", "500") or time.monotonic() > deadline:
                    raise
            except Exception:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.3)

    async def submit_all(self, nc: Any) -> None:
        specs = workload(self.sc.jobs, self.rng, self.sc.gpus_per_node)
        gap = self.sc.submit_over / max(1, len(specs))
        tenant_of: dict[str, str] = {}
        for spec in specs:
            tnc, suffix = await self.as_tenant(spec.tenant)
            try:
                reply = await self.request(tnc, subj.ADMISSION_SUBMIT + suffix,
                                            SubmitRequest(spec=spec, token=f"{self.run_id}-{spec.name}"), SubmitReply)
                self.acked[reply.job_id] = spec.name
                tenant_of[reply.job_id] = spec.tenant
            except Exception as exc:
                self.submit_failed.append(f"{spec.name}: {exc}")
            if self.rng.random() < self.sc.cancel_fraction and self.acked:
                victim = self.rng.choice(sorted(self.acked))
                if victim not in self.cancelled and victim not in switch_targets(self.acked):
                    tnc, suffix = await self.as_tenant(tenant_of[victim])
                    try:
                        await self.request(tnc, subj.ADMISSION_CANCEL + suffix, JobRef(job_id=victim), JobRecord)
                        self.cancelled.add(victim)
                    except Exception as exc:  # 409: it had finished already
                        self.log("cancel", victim, exc)
            await asyncio.sleep(gap * self.rng.uniform(0.5, 1.5))

    # ------------------------------------------------------------ faults
    async def kill_services(self, duration: float) -> None:
        """Each service kind killed ``service_kills`` times at random moments."""
        plan = [(self.rng.uniform(2, duration), k) for k in SERVICE_KINDS for _ in range(self.sc.service_kills)]
        plan.sort()
        t0 = time.monotonic()
        for at, kind in plan:
            await asyncio.sleep(max(0, at - (time.monotonic() - t0)))
            s = self.services[kind]
            for _ in range(100):  # wait for the restart of the previous kill
                if s.alive():
                    break
                await asyncio.sleep(0.1)
            s.kill9()
            self.outcome.faults[f"kill_{kind}"] += 1
            self.log("kill -9", kind)

    async def nats_fault(self, at: float) -> None:
        await asyncio.sleep(at)
        if self.sc.servers == 1:
            self.log("restarting nats-server")
            self.fleet.stop(0)
            await asyncio.sleep(1.0)
            self.fleet.start(0)
            self.fleet.restarts += 1
            self.outcome.faults["restart_nats_server"] += 1
        else:
            victim = self.rng.randrange(self.sc.servers)
            self.log("kill -9 nats server", victim)
            self.fleet.stop(victim, kill=True)
            self.fleet.kills += 1
            self.outcome.faults["kill_cluster_server"] += 1
            await asyncio.sleep(8.0)  # the cluster runs on two for a while
            self.fleet.start(victim)
            self.fleet.restarts += 1

    # ------------------------------------------------------------ end
    async def wait_terminal(self, nc: Any) -> dict[str, JobRecord]:
        from gearshift.bus_schema.messages import JobList, ListRequest

        deadline = time.monotonic() + self.sc.deadline
        recs: dict[str, JobRecord] = {}
        while time.monotonic() < deadline:
            try:
                jobs, cursor = [], None
                while True:  # finished jobs move to the history store: list them too, page by page
                    page = await self.request(nc, subj.ADMISSION_LIST, ListRequest(all=True, cursor=cursor), JobList)
                    jobs += page.jobs
                    if (cursor := page.next_cursor) is None:
                        break
                recs = {j.job_id: j for j in jobs if j.job_id in self.acked}
                live = [j for j in recs.values() if j.state not in TERMINAL_STATES or j.outbox]
                if len(recs) == len(self.acked) and not live:
                    return recs
                self.log(f"{len(recs)}/{len(self.acked)} known, {len(live)} not terminal")
            except Exception as exc:
                self.log("list failed", exc)
            await asyncio.sleep(2)
        return recs

    def drains_timed_out(self) -> int:
        """Drains the optimizer ended at ``--drain-timeout`` instead of on reports."""
        n = 0
        for line in self.services["optimizer"].log_path.read_text(errors="replace").splitlines():
            if "drain settled without reports" in line:
                try:
                    n += bool(json.loads(line).get("timed_out"))
                except ValueError:
                    pass
        return n

    async def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        await self.setup()
        scraper = CounterScraper(self.root / "observe")  # the GPU-seconds counter, as Prometheus reads it
        scraper.start()
        accounting: dict[str, Any] = {}
        sup = asyncio.create_task(self.supervise())
        nc = await self.client()
        try:
            await self.request(nc, subj.ADMISSION_NODES, None, NodeList)  # admission is up
            fault_window = self.sc.submit_over + 15
            tasks = [
                asyncio.create_task(self.kill_services(fault_window)),
                asyncio.create_task(self.nats_fault(self.rng.uniform(0.3, 0.6) * self.sc.submit_over)),
                asyncio.create_task(MidSwitchKiller(self)(nc)),
            ]
            await self.submit_all(nc)
            await asyncio.gather(tasks[0], tasks[1])
            recs = await self.wait_terminal(nc)
            self.done = True
            await cancel_and_wait([tasks[2]])
            events = await read_events(nc)
            if await wait_archived(nc, list(recs)):  # the accounts are written as jobs are archived
                creds = str(self.auth.creds("admin")) if self.auth is not None else None
                accounting = await asyncio.to_thread(compare, scraper, self.fleet.url, creds)
            else:
                accounting = {"ok": False, "error": "finished jobs were not all archived in time"}
        finally:
            scraper.stop_flag.set()
            self.done = True
            self.sampler.stop_flag.set()
            await nc.close()
            for tnc in self.tenant_nc.values():
                await tnc.close()
            await asyncio.gather(sup, return_exceptions=True)
            for s in self.services.values():
                s.paused = True
            for name in [n for n in self.services if n.startswith("node")] + list(SERVICE_KINDS):
                self.services[name].stop()
            self.fleet.stop_all()
        result = audit(self, recs, events)
        result["drains_settled_by_timeout"] = self.drains_timed_out()
        faults = dict(self.outcome.faults)
        result.update(
            scenario=self.sc.name, nats_servers=self.sc.servers, replicas=self.sc.replicas, policy=self.sc.policy,
            faults=faults, kills={n: s.kills for n, s in self.services.items() if s.kills},
            service_restarts={n: s.starts - 1 for n, s in self.services.items() if s.starts > 1},
            nats_restarts=self.fleet.restarts, nats_kills=self.fleet.kills, switches_seen=self.switches_seen,
            forced_switches=self.switches_seen, auth=self.auth is not None, notes=self.outcome.notes,
            duration_s=round(time.monotonic() - t0, 1), accounting=accounting,
        )
        return result


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    faults: Counter = Counter()
    for r in results:
        faults.update(r["faults"])
    total = lambda k: sum(r[k] for r in results)  # noqa: E731
    summary = dict(
        jobs=total("jobs"), lost_jobs=total("lost_jobs"), duplicate_events=total("duplicate_events"),
        event_gaps=total("event_gaps"), kv_event_mismatches=total("kv_event_mismatches"),
        two_generations_at_once=total("two_generations_at_once"),
        same_generation_twice_on_a_node=total("same_generation_twice_on_a_node"),
        jobs_without_exactly_one_terminal_event=total("jobs_without_exactly_one_terminal_event"),
        submit_failed=total("submit_failed"), completed=total("completed"), cancelled=total("cancelled"),
        failed=total("failed"), drains_settled_by_timeout=total("drains_settled_by_timeout"), kills=sum(sum(r["kills"].values()) for r in results) + total("nats_kills"),
        restarts=sum(sum(r["service_restarts"].values()) for r in results) + total("nats_restarts"),
        faults=dict(faults), auth=all(r.get("auth") for r in results),
        lost_detail=[d for r in results for d in r.get("lost_detail", [])],
        # gearshift usage --since 1h against the scraped gearshift_gpu_seconds_total, per scenario
        accounting={r["scenario"]: r.get("accounting", {}) for r in results},
        accounting_ok=all(r.get("accounting", {}).get("ok") for r in results),
    )
    kinds = {r["scenario"] for r in results}
    expected = [k for k in FAULT_KINDS if not (k == "restart_nats_server" and "single" not in kinds)
                and not (k == "kill_cluster_server" and "cluster" not in kinds)]
    summary["fault_kinds_missing"] = [k for k in expected if faults.get(k, 0) < 1]
    # forced, so every scenario has it (the other kinds are per scenario by construction)
    summary["fault_kinds_missing"] += [f"kill_agent_mid_switch@{r['scenario']}" for r in results
                                       if r["faults"].get("kill_agent_mid_switch", 0) < 1
                                       and "kill_agent_mid_switch" not in summary["fault_kinds_missing"]]
    summary["ok"] = (
        summary["lost_jobs"] == 0 and summary["duplicate_events"] == 0 and summary["event_gaps"] == 0
        and summary["kv_event_mismatches"] == 0 and summary["two_generations_at_once"] == 0
        and summary["same_generation_twice_on_a_node"] == 0 and summary["jobs_without_exactly_one_terminal_event"] == 0
        and summary["submit_failed"] == 0 and not summary["fault_kinds_missing"]
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=50, help="jobs per scenario")
    ap.add_argument("--scenario", choices=["single", "cluster", "both"], default="both")
    ap.add_argument("--policy", default="rubick")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--submit-over", type=float, default=30.0, help="seconds over which jobs arrive")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs per service kind and scenario")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds to wait for every job to end")
    ap.add_argument("--keep", default=None, help="keep data and logs in this folder")
    ap.add_argument("--no-auth", action="store_true", help="anonymous connections (authorisation off)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("GEARSHIFT_LOG_LEVEL", "WARNING")
    names = ["single", "cluster"] if args.scenario == "both" else [args.scenario]
    results = []
    for i, name in enumerate(names):
        sc = Scenario(
            name=name, servers=1 if name == "single" else 3, replicas=1 if name == "single" else 3, jobs=args.jobs,
            policy=args.policy, seed=args.seed + i, submit_over=args.submit_over, service_kills=args.kills,
            deadline=args.deadline, auth=not args.no_auth,
        )
        if args.keep:
            root = Path(args.keep) / name
            root.mkdir(parents=True, exist_ok=True)
            results.append(asyncio.run(ChaosRun(sc, root, args.verbose).run()))
        else:
            with tempfile.TemporaryDirectory(prefix=f"gs-chaos-{name}-") as tmp:
                results.append(asyncio.run(ChaosRun(sc, Path(tmp), args.verbose).run()))
    summary = summarise(results)
    report = {"summary": summary, "scenarios": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            print(f"{r['scenario']}: jobs {r['jobs']} completed {r['completed']} cancelled {r['cancelled']} "
                  f"failed {r['failed']} lost {r['lost_jobs']} dup events {r['duplicate_events']} "
                  f"gaps {r['event_gaps']} overlaps {r['two_generations_at_once']} faults {r['faults']} "
                  f"in {r['duration_s']}s")
        print("ok" if summary["ok"] else f"FAILED: {summary}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
