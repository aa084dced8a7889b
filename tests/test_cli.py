"""The ``gearshift`` command as an operator runs it (issue 12's rough edges),
against `gearshift up`'s processes with authorisation on: a real
nats-server, every service, two emulated GPU nodes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import wait_for as _wait_for

from gearshift.bus import auth
from gearshift.bus.natsd import NatsServer
from gearshift.cli import build_parser
from gearshift.cluster import LocalCluster

GEARSHIFT = [sys.executable, "-m", "gearshift.cli"]


def run(url, *args, creds=None, stdin=None, check=True, timeout=60, env_extra=None):
    env = {**os.environ, "GEARSHIFT_NATS_URL": url, **(env_extra or {})}
    env.pop("GEARSHIFT_CREDS", None)
    if creds:
        env["GEARSHIFT_CREDS"] = str(creds)
    p = subprocess.run([*GEARSHIFT, *args], env=env, capture_output=True, text=True, timeout=timeout, input=stdin)
    assert "Traceback" not in p.stderr, p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"gearshift {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


def wait_for(pred, timeout=40.0):
    return _wait_for(pred, timeout, 0.3)


SPEC = {"name": "cli", "model": {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024},
        "global_batch": 16, "steps": 100000, "gpus": 2, "step_time": 0.05}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    c = LocalCluster(nodes=2, gpus_per_node=2, port=-1, data_dir=str(tmp_path_factory.mktemp("cli")), interval=1.0,
                     grace=3.0, auth=True, tenants=["default", "nlp"])
    with c:
        yield c


def admin(c):
    return c.auth_dir.creds("admin")


def job(c, job_id):
    return json.loads(run(c.url, "get", "job", job_id, "-o", "json", creds=admin(c)).stdout)


def submit(c, **over):
    return run(c.url, "submit", "-", creds=admin(c), stdin=json.dumps({**SPEC, **over})).stdout.strip()


def round_no(c) -> int:
    return json.loads(run(c.url, "explain", "-o", "json", creds=admin(c)).stdout)["round"]


def a_round_later(c) -> None:
    """Until a whole optimizer round that began after this call has completed:
    round r+2 under way (explain's number counts rounds begun, one at a time)."""
    r = round_no(c)
    wait_for(lambda: round_no(c) >= r + 2)


# ------------------------------------------------------------------ no server needed
def _actions(parser: argparse.ArgumentParser, path: str = "gearshift"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(a, argparse._HelpAction):
            yield path, a


def test_every_option_has_help():
    missing = [f"{path} {a.dest}" for path, a in _actions(build_parser()) if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, missing
    names = {path.split(" ", 1)[1] for path, _ in _actions(build_parser()) if " " in path}
    assert {"explain", "reconfigure", "drain", "cordon", "uncordon", "logs", "top"} <= names


@pytest.mark.parametrize("args", [["--server", "nats://127.0.0.1:1", "get", "jobs"],
                                  ["get", "jobs", "--server", "nats://127.0.0.1:1"]])
def test_unreachable_server_is_one_line(args):
    p = run("nats://127.0.0.1:2", *args, check=False)
    assert p.returncode == 3
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NATS server answers at nats://127.0.0.1:1 (connection refused)" in lines[0]


def test_a_bad_credentials_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    for args in (["get", "jobs", "--creds", str(bad)], ["--creds", str(tmp_path / "none.json"), "get", "jobs"]):
        p = run("nats://127.0.0.1:1", *args, check=False)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
        assert "credentials" in p.stderr or "--creds" in p.stderr


def test_schema_into_a_closed_pipe_is_quiet():
    p = subprocess.Popen([*GEARSHIFT, "schema"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=30)
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_up_on_a_busy_port_keeps_its_logs(tmp_path):
    busy = NatsServer(tmp_path / "busy")
    busy.start()
    try:
        p = subprocess.run([*GEARSHIFT, "up", "--port", str(busy.port), "--nodes", "1"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    finally:
        busy.stop()
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "address is already in use" in p.stderr
    kept = Path(p.stderr.split("logs kept in ", 1)[1].split()[0])
    assert "already in use" in (kept / "nats-server.log").read_text()


def test_up_with_an_unknown_policy_says_why_and_keeps_its_logs(tmp_path):
    p = subprocess.run([*GEARSHIFT, "up", "--port", "-1", "--nodes", "1", "--policy", "foo", "--data-dir",
                        str(tmp_path / "d")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "unknown policy 'foo'" in p.stderr
    kept = Path(p.stderr.split("logs kept in ", 1)[1].split()[0])
    assert "unknown policy" in (kept / "optimizer.log").read_text()


# ------------------------------------------------------------------ identities
def test_refused_identity_is_an_immediate_403(up):
    p = run(up.url, "get", "jobs", creds=up.auth_dir.creds("tools"), check=False)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    # the server's permission error, not the request's time-out (504)
    assert len(lines) == 1 and lines[0].startswith("error (403): permission denied: identity 'tools'"), lines


def test_unknown_key_is_one_line(up, tmp_path):
    bad = json.loads(up.auth_dir.creds("tools").read_text())
    bad["nkey_seed"] = auth.new_user_seed()  # a key the server does not know
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    p = run(up.url, "--creds", str(path), "get", "jobs", check=False)
    assert p.returncode == 3 and len(p.stderr.strip().splitlines()) == 1
    assert "refused the credentials of user 'tools'" in p.stderr


def test_tenant_submit_from_stdin_defaults_to_its_tenant(up):
    nlp = up.auth_dir.creds("tenant-nlp")
    spec = {k: v for k, v in SPEC.items() if k != "tenant"} | {"steps": 5, "gpus": 1, "name": "mine"}
    job_id = run(up.url, "submit", "-", creds=nlp, stdin=json.dumps(spec)).stdout.strip()
    rec = json.loads(run(up.url, "get", "job", job_id, "-o", "json", creds=nlp).stdout)
    assert rec["spec"]["tenant"] == "nlp"
    # YAML through stdin too, and an explicit other tenant is still refused
    p = run(up.url, "submit", "-", creds=nlp, stdin="name: x\ntenant: default\n", check=False)
    assert p.returncode == 2 and "model" in p.stderr
    p = run(up.url, "submit", "-", creds=nlp, stdin=json.dumps({**spec, "tenant": "vision"}), check=False)
    assert p.returncode == 1 and "403" in p.stderr


# ------------------------------------------------------------------ jobs
def test_listing_shows_live_progress_run_time_and_filters(up):
    job_id = submit(up, name="live")
    rec = wait_for(lambda: (j := job(up, job_id))["state"] == "running" and (j.get("live") or {}).get("steps_done")
                   and j)
    assert rec["steps_done"] == 0  # the stored record learns steps at exit: the live report is what moves
    table = run(up.url, "get", "jobs", "--state", "running", creds=admin(up)).stdout.splitlines()
    assert "RUN TIME" in table[0] and "SPEED" in table[0]
    row = next(line for line in table if line.startswith(job_id))
    steps = next(tok for tok in row.split() if "/100000" in tok)
    assert int(steps.split("/")[0]) > 0 and "/s" in row
    assert all("running" in line for line in table[1:])
    done = json.loads(run(up.url, "get", "jobs", "--state", "completed,cancelled", "-o", "json", creds=admin(up)).stdout)
    assert job_id not in {j["job_id"] for j in done} and all(j["state"] in ("completed", "cancelled") for j in done)
    p = run(up.url, "get", "jobs", "--state", "bogus", creds=admin(up), check=False)
    assert p.returncode == 2 and "--state" in p.stderr and "bogus" in p.stderr
    one = run(up.url, "get", "job", job_id, creds=admin(up)).stdout.splitlines()
    assert len(one) == 2 and one[1].startswith(job_id)
    # watch: the table, then a line each time the job's steps move
    w = run(up.url, "get", "jobs", "-w", "--interval", "0.5", "--watch-timeout", "3", "--state", "running",
            creds=admin(up)).stdout.splitlines()
    assert w[0].startswith("ID") and sum(1 for line in w if line.startswith(job_id)) >= 2
    top = run(up.url, "top", "--once", creds=admin(up)).stdout
    assert "node0" in top and "node1" in top and job_id in top
    run(up.url, "cancel", job_id, creds=admin(up))


def test_explain_reconfigure_logs(up):
    job_id = submit(up, name="pin")
    wait_for(lambda: job(up, job_id)["state"] == "running")
    assert job_id in run(up.url, "explain", job_id, creds=admin(up)).stdout
    out = run(up.url, "reconfigure", job_id, "--plan", "dp=1,ga=2", "--reason", "test", creds=admin(up)).stdout
    assert "pinned to DP1-GA2" in out
    wait_for(lambda: (j := job(up, job_id))["plan"]["ga"] == 2 and j["state"] == "running")
    assert "DP1-GA2*" in run(up.url, "get", "job", job_id, creds=admin(up)).stdout
    assert "unpinned" in run(up.url, "reconfigure", job_id, "--unpin", creds=admin(up)).stdout
    p = run(up.url, "reconfigure", job_id, "--plan", "dp=2,bogus=1", creds=admin(up), check=False)
    assert p.returncode == 2 and "bogus" in p.stderr
    logs = wait_for(lambda: (o := run(up.url, "logs", job_id, creds=admin(up)).stdout) and "resuming from" in o and o)
    assert "rank 0" in logs
    p = run(up.url, "logs", job_id, "--rank", "7", creds=admin(up), check=False)
    assert p.returncode == 1 and "404" in p.stderr
    run(up.url, "cancel", job_id, creds=admin(up))
    wait_for(lambda: job(up, job_id)["state"] == "cancelled")


def test_drain_moves_jobs_and_cordon_keeps_new_ones_away(up):
    job_id = submit(up, name="drainme")
    rec = wait_for(lambda: (j := job(up, job_id))["state"] == "running" and j)
    here = rec["placement"][0]["node"]
    other = "node1" if here == "node0" else "node0"
    out = run(up.url, "drain", here, "--reason", "maintenance", "--wait", "40", creds=admin(up)).stdout
    assert f"{here} drained" in out
    moved = wait_for(lambda: (j := job(up, job_id))["state"] == "running" and j["placement"]
                     and j["placement"][0]["node"] == other and j)
    assert moved["generation"] > rec["generation"]
    kinds = [e["kind"] for e in json.loads(run(up.url, "events", "--job", job_id, "-o", "json", creds=admin(up)).stdout)]
    assert "job.preempted" in kinds
    nodes = run(up.url, "get", "nodes", creds=admin(up)).stdout
    assert any(line.startswith(here) and "drained" in line for line in nodes.splitlines())
    # the drained node takes nothing: a second job waits, and runs there once uncordoned
    second = submit(up, name="waits")
    a_round_later(up)  # a round that saw it left it waiting
    assert job(up, second)["state"] == "pending"
    assert f"{here} active" in run(up.url, "uncordon", here, creds=admin(up)).stdout
    placed = wait_for(lambda: (j := job(up, second))["state"] == "running" and j)
    assert placed["placement"][0]["node"] == here
    # cordon: the running job stays
    assert f"{here} cordoned" in run(up.url, "cordon", here, creds=admin(up)).stdout
    a_round_later(up)  # the cordon's own round ran before its reply; and one more
    assert job(up, second)["placement"][0]["node"] == here and job(up, second)["state"] == "running"
    run(up.url, "uncordon", here, creds=admin(up))
    p = run(up.url, "drain", "nosuchnode", creds=admin(up), check=False)
    assert p.returncode == 1 and "404" in p.stderr
    for j in (job_id, second):
        run(up.url, "cancel", j, creds=admin(up))
