"""Two tenants through the real services and through the simulator, same script
(issue 13): quota, borrowing, reclaim and a priority preemption happen in the
same order with the same outcome.

Live: ``gearshift up``'s processes (nats-server, admission, optimizer with
``GEARSHIFT_POLICY_OPTIONS`` carrying the queues, agents with emulated
workers). Simulated: ``sim.engine`` with the same policy options. Script, on
2 nodes x 4 GPUs, tenants a and b with quota 4 each in one cohort:
1. b1 (b, 4 GPUs, priority 1): within b's quota;
2. b2 (b, 4 GPUs, priority 0): borrows a's unused quota;
3. a1 (a, 4 GPUs): a reclaims its quota: b's lowest-priority job goes;
4. a2 (a, 4 GPUs, priority 5): a is at quota and lends nothing now: its own
   lower-class job a1 is preempted.
After each step the running set and the preemptions (with their kind) are
compared, for fifo and for rubick (which the sharing part also tells each
tenant's budget before it decides), with the same policy options on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec
from gearshift.cluster import LocalCluster
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.trace import ClusterSpec, Trace, TraceJob

SHARING = {"queues": {"a": {"quota": 4, "cohort": "c"}, "b": {"quota": 4, "cohort": "c"}}, "min_run_time": 0}
GPT2 = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}
SCRIPT = [("b1", "b", 1), ("b2", "b", 0), ("a1", "a", 0), ("a2", "a", 5)]


def spec(name: str, tenant: str, priority: int) -> dict:
    return {"name": name, "model": GPT2, "global_batch": 16, "steps": 1_000_000, "gpus": 4, "cpus_per_gpu": 2,
            "tenant": tenant, "priority": priority, "step_time": 0.05, "reconfigurable": False}


OPTIONS = {"sharing": SHARING, "min_run_time": 0}  # the same policy options live and simulated


def simulated(policy_name: str = "fifo") -> list[tuple[frozenset, tuple]]:
    jobs = [TraceJob(n, 100.0 * i, JobSpec(**{**spec(n, t, p), "model": ModelSpec(**GPT2)}))
            for i, (n, t, p) in enumerate(SCRIPT)]
    trace = Trace("parity", jobs, ClusterSpec(2, 4, 32))
    policy = make_policy(policy_name, **OPTIONS)
    policy.log = []
    simulate(trace, policy, trace.cluster, SimConfig(interval=60.0, restart_cost=0.0, horizon=100.0 * len(SCRIPT)))
    out, running = [], set()
    for step in range(len(SCRIPT)):
        pre = []
        for e in policy.log:
            if 100.0 * step <= e["t"] < 100.0 * (step + 1):
                for p in e["preempted"]:
                    running.discard(p["job"])
                    pre.append((p["job"], p["kind"]))
                running |= set(e["started"])
        out.append((frozenset(running), tuple(sorted(pre))))
    return out


def cli(url, *args):
    env = {**os.environ, "GEARSHIFT_NATS_URL": url}
    p = subprocess.run([sys.executable, "-m", "gearshift.cli", *args], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout


def round_no(url) -> int:
    return json.loads(cli(url, "explain", "-o", "json"))["round"]


def a_round_later(url, timeout=60.0) -> None:
    """Until a whole optimizer round begun after this call has completed (round r+2 under way)."""
    r, deadline = round_no(url), time.monotonic() + timeout
    while round_no(url) < r + 2:
        assert time.monotonic() < deadline, f"no round after {r}"
        time.sleep(0.3)


def wait_settled(url, submitted: set[str], timeout=60.0) -> dict:
    """Every submitted job is RUNNING, or PENDING after a round saw it, and nothing drains."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = {j["spec"]["name"]: j for j in json.loads(cli(url, "get", "jobs", "-o", "json"))}
        if submitted <= set(jobs) and all(
                (j["state"] == "running" or (j["state"] == "pending" and j["reason"] != "waiting: submitted"))
                and not j.get("draining") for n, j in jobs.items() if n in submitted):
            return jobs
        time.sleep(0.3)
    raise AssertionError(f"not settled: {[(n, j['state'], j['reason']) for n, j in jobs.items()]}")


def live(tmp_path, policy_name: str = "fifo") -> list[tuple[frozenset, tuple]]:
    env = {"GEARSHIFT_POLICY_OPTIONS": json.dumps(OPTIONS)}
    out, seen = [], 0
    with LocalCluster(nodes=2, gpus_per_node=4, cpus_per_node=32, data_dir=str(tmp_path), interval=1.0, grace=3.0,
                      extra_env=env, policy=policy_name) as c:
        submitted: set[str] = set()
        for name, tenant, prio in SCRIPT:
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(spec(name, tenant, prio)))
            cli(c.url, "submit", str(path))
            submitted.add(name)
            a_round_later(c.url)  # at least one round sees it
            jobs = wait_settled(c.url, submitted)
            names = {j["job_id"]: n for n, j in jobs.items()}
            events = json.loads(cli(c.url, "events", "-o", "json"))
            pre = [(names[e["job_id"]], e["reason"].split("(")[1].split(")")[0])
                   for e in events[seen:] if e["kind"] == "job.preempted"]
            seen = len(events)
            out.append((frozenset(n for n, j in jobs.items() if j["state"] == "running"), tuple(sorted(pre))))
    return out


@pytest.mark.parametrize("policy_name", ["fifo", "rubick"])
def test_live_and_simulated_sharing_agree(tmp_path, policy_name):
    # rubick too: the sharing part hands it each tenant's budget before it decides
    sim = simulated(policy_name)
    assert sim == [
        (frozenset({"b1"}), ()),
        (frozenset({"b1", "b2"}), ()),
        (frozenset({"b1", "a1"}), (("b2", "reclaim"),)),
        (frozenset({"b1", "a2"}), (("a1", "priority"),)),
    ]
    assert live(tmp_path, policy_name) == sim
