"""The outside-tool examples, run as a tool runs them: a real nats-server
with authorisation on, the read-only ``tools`` identity, events written by
the admin the way the services write them (``Nats-Msg-Id``, per-job seq)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.bus import auth
from gearshift.bus.client import connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.kv import publish_event
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobCompleted, JobFailed, JobRunning, JobSubmitted, JobSwitched

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def authed(tmp_path):
    d = auth.write_auth_dir(tmp_path / "auth", ["node0"], ["nlp"])
    server = NatsServer(tmp_path / "js", config=d.config)
    url = server.start()
    yield url, d
    server.stop()


async def _admin(url, d):
    nc = await connect(url, retry_for=3, **auth.connect_options(auth.load_creds(d.creds("admin"))))
    await ensure_infra(nc)
    return nc


async def _publish(nc, events):
    js = nc.jetstream()
    for ev in events:
        kind = ev.__struct_config__.tag
        await publish_event(js, ev, f"{ev.job_id}:{ev.seq}", subj.job_event(ev.job_id, kind))


def _run(script, url, d, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GEARSHIFT_CREDS", None)
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--server", url, "--creds",
                        str(d.creds("tools")), *args], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p


def _switched(job_id, seq, ts):
    return JobSwitched(ts=ts, job_id=job_id, seq=seq, from_generation=1, plan=None, gpus=2, nodes=["node0"],
                       checkpoint_s=0.1, teardown_s=0.1, launch_s=0.1, restore_s=0.1, first_step_s=0.1, total_s=0.5)


async def test_follower_resumes_after_a_restart(authed):
    url, d = authed
    nc = await _admin(url, d)
    try:
        await _publish(nc, [JobSubmitted(ts=1.0 + i, job_id=f"j{i}", seq=1, name=f"n{i}", tenant="nlp", gpus=1)
                            for i in range(5)])
        first = _run("follow_events.py", url, d, "--name", "exporter", "--max", "3")
        seen1 = [json.loads(line) for line in first.stdout.splitlines()]
        assert [e["job_id"] for e in seen1] == ["j0", "j1", "j2"]
        # a restart with the same name goes on after the last acked event
        second = _run("follow_events.py", url, d, "--name", "exporter", "--idle-stop", "1")
        seen2 = [json.loads(line) for line in second.stdout.splitlines()]
        assert [e["job_id"] for e in seen2] == ["j3", "j4"]
        await _publish(nc, [JobRunning(ts=9.0, job_id="j0", seq=2)])
        third = _run("follow_events.py", url, d, "--name", "exporter", "--idle-stop", "1")
        assert [(e["job_id"], e["kind"]) for e in map(json.loads, third.stdout.splitlines())] == [("j0", "job.running")]
        # another name starts from the beginning
        other = _run("follow_events.py", url, d, "--name", "another", "--idle-stop", "1")
        assert len(other.stdout.splitlines()) == 6
    finally:
        await nc.drain()


async def test_tools_identity_may_not_write_or_touch_other_streams(authed):
    """The durable consumer right is the event stream's only: tools still cannot
    publish events or read the run reports."""
    url, d = authed
    nc = await _admin(url, d)
    await nc.drain()
    errors = []

    async def on_error(e):
        errors.append(str(e))

    tools = await connect(url, retry_for=3, error_cb=on_error, **auth.connect_options(auth.load_creds(d.creds("tools"))))
    try:
        js = tools.jetstream()
        with pytest.raises(Exception):
            await js.pull_subscribe(subj.REPORTS_SUBJECTS, durable="spy", stream=subj.REPORTS_STREAM)
        with pytest.raises(Exception):
            await js.publish("gs.evt.job.jx.completed", b"{}", timeout=1)
        assert any("permissions violation" in e.lower() for e in errors)
    finally:
        await tools.close()


async def test_csv_export_of_finished_jobs(authed, tmp_path):
    url, d = authed
    nc = await _admin(url, d)
    try:
        await _publish(nc, [
            JobSubmitted(ts=10.0, job_id="ja", seq=1, name="a", tenant="nlp", gpus=2),
            JobRunning(ts=12.0, job_id="ja", seq=2),
            _switched("ja", 3, 15.0),
            JobCompleted(ts=20.0, job_id="ja", seq=4, steps_done=100),
            JobSubmitted(ts=11.0, job_id="jb", seq=1, name="b", tenant="vision", gpus=1),
            JobRunning(ts=13.0, job_id="jb", seq=2),
            JobFailed(ts=14.0, job_id="jb", seq=3, reason="exit 1", exit_code=1),
            JobSubmitted(ts=12.0, job_id="jc", seq=1, name="c", tenant="nlp", gpus=4),  # still pending
        ])
        # a republished event (same Nats-Msg-Id) is dropped by the stream
        await _publish(nc, [JobCompleted(ts=20.0, job_id="ja", seq=4, steps_done=100)])
    finally:
        await nc.drain()
    out = tmp_path / "jobs.csv"
    p = _run("export_finished_csv.py", url, d, "--out", str(out))
    assert "2 finished jobs of 3" in p.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["job_id"] for r in rows] == ["jb", "ja"]  # by finish time
    a = rows[1]
    assert (a["state"], a["tenant"], a["gpus"], a["steps_done"], a["switches"]) == ("completed", "nlp", "2", "100", "1")
    assert float(a["wait_s"]) == 2.0 and float(a["run_s"]) == 8.0
    assert rows[0]["state"] == "failed" and rows[0]["reason"] == "exit 1"
