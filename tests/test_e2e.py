"""End to end: `gearshift up`'s processes, the CLI as a user runs it, a real
nats-server, agents running emulated workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from cli_helpers import wait_for

from gearshift.cluster import LocalCluster

GEARSHIFT = [sys.executable, "-m", "gearshift.cli"]


def run_cli(url, *args, check=True, timeout=30):
    env = {**os.environ, "GEARSHIFT_NATS_URL": url}
    p = subprocess.run([*GEARSHIFT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"gearshift {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(nodes=2, gpus_per_node=4, port=-1, data_dir=str(tmp_path_factory.mktemp("up")), interval=1.0,
                     grace=3.0)
    with c:
        wait_for(lambda: node_count(c.url) == 2)
        yield c


def node_count(url) -> int:
    p = run_cli(url, "get", "nodes", "-o", "json", check=False)
    return len(json.loads(p.stdout)) if p.returncode == 0 else 0


def job_state(url, job_id):
    jobs = json.loads(run_cli(url, "get", "jobs", "-o", "json").stdout)
    return next(j for j in jobs if j["job_id"] == job_id)


def write_spec(tmp_path, **over):
    spec = {
        "name": "e2e", "model": {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024},
        "global_batch": 16, "steps": 20, "gpus": 4, "cpus_per_gpu": 2,
        "plan": {"dp": 2, "tp": 2, "pp": 1, "zero": 1, "offload": False, "ga": 1, "micro_batch": 8, "grad_ckpt": False},
        "guaranteed": False, "priority": 1, "tenant": "team-a", "reconfigurable": True, "step_time": 0.02,
    }
    spec.update(over)
    path = tmp_path / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    return path


def test_job_lifecycle_seen_in_order_by_a_late_subscriber(cluster, tmp_path):
    job_id = run_cli(cluster.url, "submit", str(write_spec(tmp_path))).stdout.strip()
    assert job_id.startswith("j")
    done = wait_for(lambda: (j := job_state(cluster.url, job_id))["state"] == "completed" and j)
    assert done["steps_done"] == 20 and done["generation"] == 1
    # a subscriber that joins after the job ended replays everything, in order
    events = json.loads(run_cli(cluster.url, "events", "--job", job_id, "-o", "json").stdout)
    kinds = [e["kind"] for e in events]
    assert kinds == ["job.submitted", "job.scheduled", "job.running", "job.completed"]
    assert [e["seq"] for e in events] == [1, 2, 3, 4]
    assert all(e["job_id"] == job_id for e in events)
    all_events = json.loads(run_cli(cluster.url, "events", "-o", "json").stdout)
    seqs = [e["stream_seq"] for e in all_events]
    assert seqs == sorted(seqs)
    text = run_cli(cluster.url, "describe", "job", job_id).stdout
    assert "completed" in text and "job.running" in text


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone as a process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_cancel_of_running_job_ends_its_process(cluster, tmp_path):
    spec = write_spec(tmp_path, name="long", steps=100000, step_time=0.05, gpus=2,
                      plan={"dp": 2, "tp": 1, "pp": 1, "zero": 0, "offload": False, "ga": 1, "micro_batch": 8, "grad_ckpt": False})
    job_id = run_cli(cluster.url, "submit", str(spec)).stdout.strip()
    wait_for(lambda: job_state(cluster.url, job_id)["state"] == "running")

    def worker_pids():
        nodes = json.loads(run_cli(cluster.url, "get", "nodes", "-o", "json").stdout)
        return [p["pid"] for n in nodes for g in n["gpus"] for p in g["processes"]
                if any(r.startswith(job_id + "@") for r in n["running"])]

    pids = wait_for(worker_pids)
    assert all(pid_alive(p) for p in pids)
    out = run_cli(cluster.url, "cancel", job_id).stdout
    assert "cancelling" in out
    wait_for(lambda: job_state(cluster.url, job_id)["state"] == "cancelled")
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10)
    kinds = [e["kind"] for e in json.loads(run_cli(cluster.url, "events", "--job", job_id, "-o", "json").stdout)]
    assert kinds == ["job.submitted", "job.scheduled", "job.running", "job.cancel_requested", "job.cancelled"]


def test_bad_spec_file_names_the_field(cluster, tmp_path):
    bad = write_spec(tmp_path, name="bad", gpus=3)  # plan says 2*2*1 = 4
    p = run_cli(cluster.url, "submit", str(bad), check=False)
    assert p.returncode != 0 and "plan" in p.stderr and "differs from gpus" in p.stderr
    p = run_cli(cluster.url, "submit", str(write_spec(tmp_path, name="big", gpus=64, plan=None)), check=False)
    assert p.returncode != 0 and "spec.gpus" in p.stderr and "at most 8" in p.stderr
    yaml_file = tmp_path / "typo.yaml"
    yaml_file.write_text("name: x\nmodel: {name: m, params: 1, layers: 1, hidden: 1, seq_len: 1}\n"
                         "global_batch: 1\nsteps: 1\ngpus: 1\ngpu: 2\n")
    p = run_cli(cluster.url, "submit", str(yaml_file), check=False)
    assert p.returncode != 0 and "unknown field `gpu`" in p.stderr


def test_up_stops_everything_on_sigterm(tmp_path):
    data = tmp_path / "updata"
    proc = subprocess.Popen([*GEARSHIFT, "up", "--nodes", "2", "--gpus-per-node", "2", "--port", "-1", "--data-dir",
                             str(data)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    assert url.startswith("nats://127.0.0.1:")
    wait_for(lambda: node_count(url) == 2)
    spec = write_spec(tmp_path, name="running", steps=100000, step_time=0.05, gpus=2, plan=None)
    job_id = run_cli(url, "submit", str(spec)).stdout.strip()
    wait_for(lambda: job_state(url, job_id)["state"] == "running")

    def ours():
        out = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in out]

    assert len(ours()) >= 4  # server, agents (+ their workers), services
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: ours() == [], timeout=10)  # every process carrying the data dir has exited
    # the emulated workers carry the data dir only in their environment
    left = subprocess.run(["pgrep", "-f", "gearshift.agent.emulated_worker"], capture_output=True, text=True).stdout.split()
    assert not [p for p in left if pid_alive(int(p)) and str(data) in _environ(int(p))]


def _environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_tool_subcommands_take_their_own_options(tmp_path):
    """`gearshift simulate --trace ...` and `gearshift perfmodel ...` reach their own parsers."""
    out = subprocess.run([*GEARSHIFT, "simulate", "--trace", "tiresias-60", "--policies", "fifo", "--cluster", "4x4",
                          "-o", "json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "fifo" in json.dumps(doc)
    p = subprocess.run([*GEARSHIFT, "perfmodel", "nonsense"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown perfmodel command" in p.stderr
