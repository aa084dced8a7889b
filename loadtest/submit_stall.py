"""Sequential submits into a plain local cluster: does any submit stall?

    python -m loadtest.submit_stall --submits 3000 --json

Starts what ``gearshift up --nodes 2 --gpus-per-node 8`` starts (``LocalCluster``:
nats-server, admission, optimizer, perfmodel, profiler, two agents, the dashboard;
authorisation on, the admin's credentials), then submits ``--submits`` jobs one at
a time (each waits for the previous reply) through the CLI's own ``Client``, and
reports the latency distribution: p50, p99, p99 / p50 (``passed``: at most 3), how
many took over 100 ms, and the gaps between those slow ones (a timer shows as
evenly spaced stalls).

The stall this measures (issue 24: p50 5.5 ms, p99 243 ms, about 1 submit in 20
waiting ~250 ms) was the optimizer's waiting-reason writes: up to 64 records a round,
each a fenced compare-and-set, i.e. an atomic batch (``services.fencing``), and the
server syncs the stream to disk at every batch commit (25-30 ms each here, against
0.15 ms for a plain put). The admission's create of a record goes to the same
stream, ``KV_gs_jobs``, and waited behind those syncs: a plain put's p50 went from
0.55 to 15.5 ms while a leader committed fenced updates in a loop. Stopping the
optimizer (SIGSTOP) removed the stall; the reasons now go out as one batch a round
(``RecordWriter.explain``): one sync instead of 64.

What stop 34 thought was left was the same mechanism at a lower rate: each atomic
batch the leader commits to ``KV_gs_jobs`` holding up plain writes to that stream.
``--probe-streams`` measures that (``StreamProbe``): writes to ``KV_gs_jobs``
against writes to another stream on the same disk, and how many slow writes and
slow submits had a commit in flight against the share of all of them that had one.

Stop 38 measured again (2 cores, kernel 6.18, nats-server 2.15.1) and found that
the commits now set only the maximum, not p99: with every fenced compare-and-set
replaced by a plain one (an experiment, not kept) p99/p50 stayed at 14.7x (16.2x
with them), while the probe's slowest write fell from 104 to 36 ms. What goes with
p99 is the jobs' processes. An emulated rank is a real process: the agent hands
each job start a warm worker and starts another to replace it, about 80 ms of CPU
each (a fifth of it in the kernel). With 1-second jobs on 16 GPUs that is 12
process starts a second, as much CPU as all the cluster's services together, and
``perf sched`` showed the admission waiting 5-25 ms for a core 61 times in 5 s
while short-lived processes ran. With 60-second jobs (``--steps 300``) the first
seconds still hold the warm pools' first fill and the profiling runs (47
processes): 9.5-12x. The same agents running ranks in-process
(``agent.emulated_runner``, an experiment, not kept) gave 3.7x with 1-second jobs
and 2.3x with 60-second ones; stopping the optimizer (nothing placed, no process
started) gave 1.3x. Niceness 10 or SCHED_IDLE for every process but the
admission, nats-server and the client, the store on tmpfs, and an admission
without its jobs view each left it at 15-17x. ``box`` reports this: the busy
cores, the processes started, and the CPU per submit of the cluster's processes,
of the jobs' exited processes, and of the rest. Stop 38 then had the warm pool try
one worker before filling a key (``agent.warm``) and made a rank lighter (55 -> 41 ms,
``agent.worker``): 8.2-10.5x with 1-second jobs, 4.9-5.0x with 60-second ones.

Stop 45 measured what is left (ad-hoc experiments, none kept but the dashboard's):
- ``--probe-streams``: writes to ``KV_gs_jobs`` had p99 73 ms against 8.8 ms for
  another stream on the same server, and 69% of the slow ones had one of the
  optimizer's atomic commits in flight (27% by chance). On an R1 file stream an atomic
  batch commit is synced to disk, and under the jobs' own file writes a sync takes
  tens of ms; every write to the stream waits behind it. With the store on tmpfs the
  two streams' p99 were equal (8.9 and 7.9 ms), and p99/p50 was still 8.5x.
- The dashboard decoded everything it watched with no page open (0.33 ms of CPU a
  submit). It now reads the bus only while a page looks (0.00).
- The best case: ranks in-process (``agent.emulated_runner``), the store on tmpfs, no
  dashboard and no profiler gave 3.27x and 3.42x (p50 1.2 ms, 740-790 submits/s, 1.4
  busy cores); the optimizer at nice 19 on top gave 2.84x, and without it 3.19x. A
  closed loop of sequential submits runs the box as fast as the submits go, and the
  submit's own path (client, nats-server, admission) is about 1.3 ms of CPU for a
  1.2-ms p50: any other work that wants a core at that moment shows in p99. So 3x is
  at the edge even with none of the jobs' processes, syncs or idle readers.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import sys
import time
from typing import Any

import psutil

from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema.messages import JobSpec
from loadtest.optimality_gap import BATCH, MODELS
from loadtest.scale import cpu_seconds, handling_summary, request_buckets

TENANTS = ("default", "vision", "nlp", "llm")  # the admission's default limit is 1,000 live jobs a tenant
SLOW_MS = 100.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


class StreamProbe:
    """``--probe-streams``: while the submits run, a write every ``every`` seconds to
    ``KV_gs_jobs`` (key ``_probe``: keys starting with ``_`` are fencing marks to every
    reader of the bucket) and to a scratch bucket on the same disk, each waiting for
    its acknowledgement; and the times of the atomic batch commits the optimizer
    makes to ``KV_gs_jobs`` (``services.fencing``: the commit is the ``_fence``
    message with ``Nats-Batch-Commit``). ``report`` says how the two streams' writes
    compare, and how many slow writes and slow submits had a commit in flight, against
    the share of all of them that had one (what chance alone gives)."""

    SCRATCH = "gs_probe_scratch"
    WINDOW_S = 0.03  # a commit sent this long before a write started still counts as in flight

    def __init__(self, every: float = 0.02):
        self.every = every
        self.commits: list[float] = []
        self.writes: dict[str, list[tuple[float, float]]] = {"jobs_stream": [], "other_stream": []}
        self._task: asyncio.Task | None = None
        self._nc: Any = None

    async def start(self, url: str, creds: str | None) -> None:
        from gearshift.bus.auth import connect_options, load_creds
        from gearshift.bus.client import connect

        self._nc = await connect(url, name="stall-probe", retry_for=10,
                                 **(connect_options(load_creds(creds)) if creds else {}))
        js = self._nc.jetstream()
        await js.create_key_value(bucket=self.SCRATCH, history=1)

        async def on_fence(msg: Any) -> None:
            if (msg.headers or {}).get("Nats-Batch-Commit"):
                self.commits.append(time.perf_counter())

        await self._nc.subscribe("$KV.gs_jobs._fence", cb=on_fence)
        self._task = asyncio.create_task(self._loop(js))

    async def _loop(self, js: Any) -> None:
        subjects = {"jobs_stream": "$KV.gs_jobs._probe", "other_stream": f"$KV.{self.SCRATCH}._probe"}
        while True:
            for name, subject in subjects.items():
                t = time.perf_counter()
                await js.publish(subject, b"")
                self.writes[name].append((t, time.perf_counter()))
            await asyncio.sleep(self.every)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        if self._nc is not None:
            try:
                await self._nc.jetstream().delete_key_value(self.SCRATCH)
            finally:
                await self._nc.close()

    def _in_flight(self, span: tuple[float, float]) -> bool:
        i = bisect.bisect_left(self.commits, span[0] - self.WINDOW_S)
        return i < len(self.commits) and self.commits[i] <= span[1]

    def _share(self, spans: list[tuple[float, float]]) -> float | None:
        return round(sum(map(self._in_flight, spans)) / len(spans), 3) if spans else None

    def report(self, submits: list[tuple[float, float]]) -> dict[str, Any]:
        out: dict[str, Any] = {"atomic_commits_to_jobs_stream": len(self.commits)}
        for name, spans in self.writes.items():
            ms = [(b - a) * 1e3 for a, b in spans]
            out[name] = {"writes": len(ms), "p50_ms": round(pct(ms, 50), 2), "p99_ms": round(pct(ms, 99), 2),
                         "max_ms": round(max(ms), 1)} if ms else None
        for key, spans in (("jobs_stream_slow_writes", self.writes["jobs_stream"]), ("slow_submits", submits)):
            if spans:
                slow_at = 3 * pct([b - a for a, b in spans], 50)
                slow = [(a, b) for a, b in spans if b - a > slow_at]
                out[key] = {"over_3x_p50": len(slow), "with_commit_in_flight": self._share(slow),
                            "all_with_commit_in_flight": self._share(spans)}
        return out


async def submit_all(url: str, creds: str | None, n: int,
                     probe: StreamProbe | None = None, steps: int = 5) -> tuple[list[float], list[float], dict | None]:
    """Latency (ms) of each of ``n`` sequential submits, when each was sent (s since
    the first), and with ``probe`` its report."""
    from gearshift.client import Client

    client = await Client.connect(url, creds=creds, retry_for=10, timeout=30)
    lat, at, spans = [], [], []
    if probe is not None:
        await probe.start(url, creds)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            m = MODELS[i % len(MODELS)]
            spec = JobSpec(name=f"stall{i}", model=m, global_batch=BATCH[m.name], steps=steps, gpus=1, step_time=0.2,
                           tenant=TENANTS[i % len(TENANTS)])
            t = time.perf_counter()
            await client.submit(spec)
            done = time.perf_counter()
            lat.append((done - t) * 1e3)
            at.append(t - t0)
            spans.append((t, done))
    finally:
        if probe is not None:
            await probe.stop()
        await client.close()
    return lat, at, (probe.report(spans) if probe is not None else None)


def summary(lat: list[float], at: list[float]) -> dict[str, Any]:
    slow = [i for i, x in enumerate(lat) if x > SLOW_MS]
    gaps = [at[b] - at[a] for a, b in zip(slow, slow[1:])]
    p50, p99 = pct(lat, 50), pct(lat, 99)
    return {"submits": len(lat), "p50_ms": round(p50, 2), "p90_ms": round(pct(lat, 90), 2), "p99_ms": round(p99, 2),
            "max_ms": round(max(lat), 1), "p99_over_p50": round(p99 / p50, 2), "over_100ms": len(slow),
            "slow_gap_s_median": round(statistics.median(gaps), 3) if gaps else None,
            "rate_per_s": round(len(lat) / max(at[-1] + lat[-1] / 1e3, 1e-9), 1),
            "passed": p99 <= 3 * p50}


def cpu_per_submit(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Each process's CPU milliseconds per submit between two ``cpu_seconds`` samples."""
    return {k: round((after[k] - before[k]) / n * 1e3, 3) for k in sorted(after) if k in before}


class BoxCpu:
    """The CPU the whole machine spent between ``start`` and ``stop`` (``psutil.cpu_times``:
    every process and the kernel), against what the cluster's own processes spent and
    what the agents' children did (the jobs' worker processes, counted once they exit)."""

    BUSY = ("user", "nice", "system", "irq", "softirq", "steal")

    def __init__(self, pids: dict[str, int], parents: list[str]):
        self.pids = pids
        self.parents = parents  # the processes whose children are the jobs' (the agents)
        self._t0 = 0.0
        self._box0 = 0.0
        self._own0: dict[str, float] = {}
        self._jobs0 = (0.0, 0.0)
        self._forks0: int | None = None
        self.per_process: dict[str, float] = {}  # each process's CPU ms per submit (``stop``)

    def _box(self) -> float:
        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in self.BUSY)

    @staticmethod
    def forks() -> int | None:
        """Processes created on the machine since it booted (``/proc/stat``), None elsewhere."""
        try:
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("processes "):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def _jobs(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the parents' exited children."""
        user = system = 0.0
        for name in self.parents:
            try:
                t = psutil.Process(self.pids[name]).cpu_times()
            except (KeyError, psutil.Error):
                continue
            user, system = user + t.children_user, system + t.children_system
        return user, system

    def start(self) -> None:
        self._t0, self._box0 = time.perf_counter(), self._box()
        self._own0, self._jobs0 = cpu_seconds(self.pids), self._jobs()
        self._forks0 = self.forks()

    def stop(self, n: int) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        box = self._box() - self._box0
        own1 = cpu_seconds(self.pids)
        self.per_process = cpu_per_submit(self._own0, own1, n)
        own = sum(own1[k] - self._own0[k] for k in own1 if k in self._own0)
        (u1, s1), (u0, s0) = self._jobs(), self._jobs0
        jobs = (u1 - u0) + (s1 - s0)
        forks = self.forks()
        return {"cores": psutil.cpu_count(), "busy_cores": round(box / wall, 2) if wall > 0 else None,
                "processes_started": None if forks is None or self._forks0 is None else forks - self._forks0,
                "cpu_ms_per_submit": {"all": round(box / n * 1e3, 3), "cluster_processes": round(own / n * 1e3, 3),
                                      "jobs_exited": round(jobs / n * 1e3, 3),
                                      "jobs_exited_in_kernel": round((s1 - s0) / n * 1e3, 3),
                                      "rest": round(max(0.0, box - own - jobs) / n * 1e3, 3)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.submit_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--submits", type=int, default=3000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--probe-streams", action="store_true",
                    help="also time writes to KV_gs_jobs and to another stream while submitting, against the "
                         "optimizer's atomic commits (stream_probe)")
    ap.add_argument("--steps", type=int, default=5,
                    help="steps of each submitted job (0.2 s each; 5: 1-second jobs, a job starts and ends on "
                         "every GPU each second)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.submits < 2 or a.nodes < 1 or a.gpus_per_node < 1 or a.steps < 1:
        ap.error("--submits must be at least 2, --nodes, --gpus-per-node and --steps positive")
    from gearshift.cluster import LocalCluster

    cluster = LocalCluster(nodes=a.nodes, gpus_per_node=a.gpus_per_node, auth=True,
                           tenants=list(TENANTS))  # as ``gearshift up`` makes it
    try:
        url = cluster.start()
        assert cluster.server is not None and cluster.server.proc is not None
        pids = {n: p.pid for n, p in cluster.procs.items()} | {"nats-server": cluster.server.proc.pid,
                                                               "client": os.getpid()}
        load_before = [round(x, 2) for x in os.getloadavg()]
        hist0 = request_buckets(cluster.observe_dir, "admission", "submit")
        box = BoxCpu(pids, parents=[n for n in cluster.procs if n.startswith("node")])  # LocalCluster's agents
        box.start()
        lat, at, probed = asyncio.run(submit_all(url, cluster.admin_creds, a.submits,
                                                 StreamProbe() if a.probe_streams else None, a.steps))
        whole = box.stop(len(lat))
        hist1 = request_buckets(cluster.observe_dir, "admission", "submit")
        # where the CPU went while submitting: on a small box every process's work per
        # submit is time some submit waits for a core
        # the admission's own time per submit (its request histogram): a stall inside it
        # (a write waiting on the stream) shows here, one outside it (CPU, the bus) does not
        out = summary(lat, at) | {"cpu_ms_per_submit": box.per_process,
                                  "box": whole,
                                  "job_steps": a.steps,
                                  "admission_submit_handling": handling_summary(hist0, hist1, 3 * pct(lat, 50) / 1e3),
                                  "load_average_before": load_before,
                                  "load_average": [round(x, 2) for x in os.getloadavg()]}
        if probed is not None:
            out["stream_probe"] = probed
    finally:
        cluster.stop()
    print(json.dumps(out, indent=1) if a.json else
          f"{out['submits']} submits: p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms "
          f"(p99/p50 {out['p99_over_p50']}), {out['over_100ms']} over 100 ms")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
