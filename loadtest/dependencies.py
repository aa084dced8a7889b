"""Job dependencies and arrays end to end: ``python -m loadtest.dependencies --json``.

A local cluster of real processes (nats-server with authorisation, admission,
two optimizers -- a leader and a standby --, emulated GPU agents), and
everything submitted and cancelled through the ``gearshift`` command as a
tenant user:

- a 3-stage pipeline (pretrain -> eval -> finetune, each ``after`` the one
  before, ``on: completed``);
- a 20-task array whose tasks write the ``GEARSHIFT_ARRAY_INDEX`` their agent
  launched them with, and a fan-in after the array and the pipeline's end;
- a pipeline whose first stage fails (its command exits 1, retries used up):
  its ``completed`` dependent is cancelled with the reason, and that one's
  ``finished`` dependent with it (cascade);
- refusals: a job that names itself (a cycle: the id its token gives), an
  unknown id, and another tenant's job -- each one line naming the field, and
  no record written;
- while the first stage runs and its dependents wait, the leading optimizer
  is killed (SIGKILL); the standby takes the lease and releases them.

It waits on the event stream and records (every wait bounded), never on
fixed sleeps, and checks from the events: each stage's ``job.scheduled`` is
not before the terminal event of each job it waits on. Prints ``ok`` and the
evidence; exit code 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import subjects as subj
from gearshift.cluster import LocalCluster
from gearshift.services.admission import job_id_for

TENANT, OTHER = "team-a", "team-b"
MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}  # a shipped fit: no profiling
TERMINAL = {"job.completed", "job.failed", "job.cancelled"}
WAIT_S = 240.0  # the bound on every wait (a busy 2-core box is slow, never this slow)


def spec(name: str, gpus: int = 2, steps: int = 30, step_time: float = 0.1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": MODEL, "global_batch": 16, "steps": steps, "gpus": gpus, "step_time": step_time,
            "plan": {"dp": gpus}, "reconfigurable": False, **extra}


class Run:
    def __init__(self, cluster: LocalCluster, work: Path):
        self.cluster = cluster
        self.work = work
        self.events: dict[str, list[Any]] = {}
        self.changed = asyncio.Event()
        self.cli_calls = 0

    # ------------------------------------------------------------ the CLI
    def cli(self, *args: str, tenant: str | None = TENANT, check: bool = True) -> subprocess.CompletedProcess:
        creds = self.cluster.auth_dir.creds(f"tenant-{tenant}" if tenant else "admin")
        env = {**os.environ, "GEARSHIFT_NATS_URL": self.cluster.url, "GEARSHIFT_CREDS": str(creds)}
        self.cli_calls += 1
        p = subprocess.run([sys.executable, "-m", "gearshift.cli", *args], env=env, capture_output=True, text=True,
                           timeout=120)
        if check and p.returncode != 0:
            raise RuntimeError(f"gearshift {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
        return p

    def submit(self, body: dict[str, Any], token: str | None = None, tenant: str = TENANT,
               check: bool = True) -> subprocess.CompletedProcess:
        path = self.work / f"spec-{self.cli_calls}.json"
        path.write_text(json.dumps(body))
        return self.cli("submit", str(path), *(["--token", token] if token else []), tenant=tenant, check=check)

    def submit_id(self, body: dict[str, Any], token: str | None = None) -> str:
        return self.submit(body, token).stdout.split()[0]

    # ------------------------------------------------------------ events
    async def follow(self, client: Any) -> None:
        async for _, _, ev in client.events(follow=True, subject="gs.evt.job.>"):
            self.events.setdefault(ev.job_id, []).append(ev)
            self.changed.set()

    def kinds(self, job_id: str) -> list[str]:
        return [e.__struct_config__.tag for e in self.events.get(job_id, [])]

    def ts(self, job_id: str, kind: str) -> float | None:
        return next((e.ts for e in self.events.get(job_id, []) if e.__struct_config__.tag == kind), None)

    def end(self, job_id: str) -> Any:
        return next((e for e in self.events.get(job_id, []) if e.__struct_config__.tag in TERMINAL), None)

    async def until(self, what: str, pred, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 2.0))
            except asyncio.TimeoutError:
                pass


async def leader_pid(client: Any) -> int | None:
    kv = await client.nc.jetstream().key_value(subj.LEASE_BUCKET)
    try:
        holder = (await kv.get("optimizer")).value.split(b" ", 1)[0].decode()
    except Exception:
        return None
    try:
        return int(holder.rsplit("-", 2)[1])
    except (IndexError, ValueError):
        return None


async def scenario(run: Run) -> dict[str, Any]:
    from gearshift.client import Client

    c = run.cluster
    admin = await Client.connect(c.url, creds=c.admin_creds)
    follower = asyncio.create_task(run.follow(admin))
    out: dict[str, Any] = {"checks": {}}
    checks = out["checks"]
    try:
        marks = run.work / "marks"
        marks.mkdir()
        # ---- refusals first (nothing may be written by them)
        before = len(await admin.jobs(all=True))
        own = job_id_for(TENANT, "self-ref")
        cyc = run.submit(spec("cycle", after=[{"job": own}]), token="self-ref", check=False)
        unknown = run.submit(spec("unknown", after=[{"job": "jdoesnotexist"}]), check=False)
        b_job = run.cli("submit", str(_write(run.work / "b.json", spec("theirs", gpus=1, steps=5))),
                        tenant=OTHER).stdout.split()[0]
        foreign = run.submit(spec("foreign", after=[{"job": b_job}]), check=False)
        refusals = {"cycle": cyc, "unknown": unknown, "other_tenant": foreign}
        out["refused"] = {k: {"exit": p.returncode, "stderr": p.stderr.strip()} for k, p in refusals.items()}
        checks["refusals_name_the_field"] = all(
            p.returncode == 1 and "[field: spec.after[0].job]" in p.stderr and len(p.stderr.strip().splitlines()) == 1
            for p in refusals.values())
        checks["cycle_refused"] = "cycle" in cyc.stderr
        checks["refusals_wrote_nothing"] = len(await admin.jobs(all=True)) == before + 1  # team-b's own job only

        # ---- the pipeline, the array, the fan-in, the failing pipeline
        s1 = run.submit_id(spec("pretrain", gpus=4, steps=150, step_time=0.1), token="s1")
        s2 = run.submit_id(spec("eval", steps=20, after=[{"job": s1}]), token="s2")
        s3 = run.submit_id(spec("finetune", steps=20, after=[{"job": s2}]), token="s3")
        task = ("import os, pathlib; pathlib.Path(os.environ['MARKS'], os.environ['GEARSHIFT_JOB_ID'])"
                ".write_text(os.environ['GEARSHIFT_ARRAY_INDEX'])")
        arr = run.submit_id(spec("sweep", gpus=1, array=20, command=[sys.executable, "-c", task],
                                 env={"MARKS": str(marks)}), token="arr")
        again = run.submit(spec("sweep", gpus=1, array=20, command=[sys.executable, "-c", task],
                                env={"MARKS": str(marks)}), token="arr").stdout.split()[0]
        fan = run.submit_id(spec("fan-in", steps=10, after=[{"job": arr}, {"job": s3}]), token="fan")
        f1 = run.submit_id(spec("broken", gpus=1, command=[sys.executable, "-c", "import sys; sys.exit(1)"]),
                           token="f1")
        f2 = run.submit_id(spec("after-broken", steps=5, after=[{"job": f1}]), token="f2")
        f3 = run.submit_id(spec("after-after", steps=5, after=[{"job": f2, "on": "finished"}]), token="f3")
        elements = [f"{arr}-{i}" for i in range(20)]
        checks["array_idempotent_on_token"] = again == arr
        listed = json.loads(run.cli("get", "jobs", "--array", arr, "-o", "json").stdout)
        checks["array_listed_by_prefix"] = sorted(j["job_id"] for j in listed) == sorted(elements)
        fan_rec = json.loads(run.cli("get", "job", fan, "-o", "json").stdout)
        checks["fan_in_expands_the_array"] = len(fan_rec["after"]) == 21

        # ---- kill the leader while the first stage runs and its dependents wait
        await run.until(f"{s1} running", lambda: "job.running" in run.kinds(s1))
        explain = json.loads(run.cli("explain", s2, "-o", "json", tenant=None).stdout)["jobs"]
        out["explain_before_kill"] = explain[0]["reason"] if explain else ""
        checks["explain_says_what_it_waits_for"] = f"waiting for dependencies: {s1}" in out["explain_before_kill"]
        pid = await leader_pid(admin)
        procs = {p.pid: n for n, p in c.procs.items() if n.startswith("optimizer")}
        checks["leader_found"] = pid in procs
        killed_at = time.time()
        if pid in procs:
            os.kill(pid, signal.SIGKILL)
            c.procs[procs[pid]].wait(timeout=10)
        out["killed"] = {"process": procs.get(pid), "pid": pid, "s1_done_when_killed": run.end(s1) is not None}
        checks["killed_before_s1_ended"] = run.end(s1) is None

        everything = [s1, s2, s3, fan, f1, f2, f3, *elements]
        await run.until("every job's end", lambda: all(run.end(j) is not None for j in everything))
        new_pid = await leader_pid(admin)
        out["new_leader"] = {"process": procs.get(new_pid), "pid": new_pid}
        checks["standby_took_over"] = new_pid in procs and new_pid != pid

        # ---- evidence
        ends = {j: run.end(j).__struct_config__.tag for j in everything}
        checks["pipeline_completed"] = all(ends[j] == "job.completed" for j in (s1, s2, s3, fan, *elements))
        order = []
        for child, parents in ((s2, [s1]), (s3, [s2]), (fan, [s3, *elements])):
            start = run.ts(child, "job.scheduled")
            last = max(run.end(p).ts for p in parents)
            order.append({"job": child, "scheduled": start, "last_dependency_end": last})
        out["order"] = order
        checks["each_stage_after_its_dependencies"] = all(
            o["scheduled"] is not None and o["scheduled"] >= o["last_dependency_end"] for o in order)
        checks["released_after_the_kill"] = (run.ts(s2, "job.scheduled") or 0) > killed_at
        idx = {p.name: p.read_text() for p in marks.iterdir()}
        out["array_env"] = {"tasks": len(idx), "indices": sorted(int(v) for v in idx.values())}
        checks["array_index_in_env"] = idx == {f"{arr}-{i}": str(i) for i in range(20)}
        f2_end, f3_end = run.end(f2), run.end(f3)
        out["failure"] = {"f1": ends[f1], "f2": getattr(f2_end, "reason", ""), "f3": getattr(f3_end, "reason", "")}
        checks["failed_stage_cancels_dependents_with_reason"] = (
            ends[f1] == "job.failed" and ends[f2] == "job.cancelled"
            and f2_end.reason == f"cancelled: dependency {f1} ended failed, needed completed"
            and ends[f3] == "job.cancelled" and f3_end.reason == f"cancelled: dependency {f2} was cancelled")
        checks["cancelled_dependents_never_scheduled"] = all(
            "job.scheduled" not in run.kinds(j) for j in (f2, f3))
        out["jobs"] = len(everything)
        out["cli_calls"] = run.cli_calls
    finally:
        await cancel_and_wait([follower])
        await admin.close()
    out["ok"] = all(checks.values())
    return out


def _write(path: Path, body: dict[str, Any]) -> Path:
    path.write_text(json.dumps(body))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.dependencies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the cluster's data dir (logs) after the run")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gs-deps-"))
    cluster = LocalCluster(nodes=4, gpus_per_node=4, interval=1.0, dashboard=False, auth=True,
                           tenants=[TENANT, OTHER], data_dir=str(work / "cluster"),
                           extra_env={"GEARSHIFT_OPTIMIZER_LEASE_TTL": "3"})
    t0 = time.monotonic()
    try:
        cluster.start(wait=False)
        o = cluster.procs["optimizer"]
        env = {**os.environ, "GEARSHIFT_NATS_URL": cluster.url, "GEARSHIFT_LOG_FORMAT": "json",
               "GEARSHIFT_OPTIMIZER_LEASE_TTL": "3", "GEARSHIFT_METRICS_PORT": "0", "GEARSHIFT_CREDS": str(cluster.auth_dir.creds("optimizer"))}
        cluster._spawn("optimizer-standby", list(o.args), env)  # the same command: a standby on the lease
        cluster.wait_ready(timeout=120)
        report = asyncio.run(scenario(Run(cluster, work)))
    except Exception as exc:  # one line, and the logs kept
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "logs": str(work / "cluster" / "logs")}
        args.keep = True
    finally:
        cluster.stop(keep_logs=args.keep)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    verdict = "ok" if report.get("ok") else "FAILED"
    if args.json:  # stdout is the JSON alone (what outside checks parse); the verdict goes to stderr
        print(verdict, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(verdict)
        print(json.dumps(report.get("checks", report)))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
