"""Metrics and health endpoints (services.observe) and the dashboard's view,
with a real nats-server and real HTTP; no browser here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.bus import observe
from gearshift.bus_schema.messages import (
    GpuReport,
    JobReconfigured,
    JobRecord,
    JobScheduled,
    JobSpec,
    JobState,
    JobSwitched,
    ModelSpec,
    NodePlacement,
    NodeReport,
    Plan,
)
from gearshift.services.dashboard_state import DashboardState
from gearshift.services.jobstore import JobStore, with_event


async def fetch(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as r:
        return r.status, await r.text()


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def spec(tenant: str = "nlp") -> JobSpec:
    return JobSpec(name="t", tenant=tenant, gpus=2, global_batch=16, steps=100,
                   model=ModelSpec(name="gpt2", params=1560, layers=24, hidden=1920, seq_len=1024))


async def test_two_processes_get_their_own_port_health_follows_the_connection(nc, nats_url, tmp_path, monkeypatch):
    from gearshift.bus.client import connect

    monkeypatch.setenv("GEARSHIFT_OBSERVE_DIR", str(tmp_path))
    a = await observe.Observer("admission", "admission", nc).start()
    other = await connect(nats_url, name="other", retry_for=2)
    b = await observe.Observer("agent-n1", "agent", other).start()
    try:
        assert a.url != b.url  # port 0: no collision on one host
        announced = json.loads((tmp_path / "agent-n1.json").read_text())
        assert announced["metrics"] == b.url + "/metrics" and announced["pid"] > 0
        async with aiohttp.ClientSession() as s:
            assert (await fetch(s, a.url + "/healthz"))[0] == 200
            code, body = await fetch(s, a.url + "/readyz")
            assert code == 503 and json.loads(body)["checks"]["started"] is False
            a.set_ready()
            code, body = await fetch(s, a.url + "/readyz")
            assert code == 200 and json.loads(body)["checks"]["nats"] == "connected"
            b.set_ready()
            await other.close()  # lost its bus: alive, not ready
            code, body = await fetch(s, b.url + "/readyz")
            assert code == 503 and json.loads(body)["checks"]["nats"] == "disconnected"
            assert (await fetch(s, b.url + "/healthz"))[0] == 200
            # each role serves its own families
            fa = families((await fetch(s, a.url + "/metrics"))[1])
            fb = families((await fetch(s, b.url + "/metrics"))[1])
        assert "gearshift_requests" in fa and "DCGM_FI_DEV_GPU_UTIL" not in fa
        assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "gearshift_agent_reconcile_lag_seconds"} <= set(fb)
        assert "gearshift_decisions" not in fb
    finally:
        await a.close()
        await b.close()
    assert not (tmp_path / "agent-n1.json").exists()  # withdrawn on close


async def test_a_busy_port_is_one_clear_error(nc):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(observe.MetricsPortBusy, match=f"127.0.0.1:{port}.*GEARSHIFT_METRICS_PORT"):
            await observe.Observer("x", "admission", nc).start(port=port)


def test_a_service_on_a_busy_port_exits_with_one_line_and_no_traceback(nats_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"GEARSHIFT_NATS_URL": nats_url, "GEARSHIFT_METRICS_PORT": str(taken.getsockname()[1]),
               "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
        p = subprocess.run([sys.executable, "-m", "gearshift.services.perfmodel_service"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert p.returncode == 4
    assert "cannot serve metrics" in p.stderr and "Traceback" not in p.stderr


async def test_job_events_feed_decisions_wait_switches_and_steps_lost(nc):
    store = await JobStore(nc).open()
    before = families(observe.generate_latest_for("optimizer"))
    rec = JobRecord(job_id="jobs1", spec=spec(), submitted_at=100.0)
    await store.create(rec)
    plan = Plan(dp=2, tp=1, pp=1)
    place = [NodePlacement(node="n0", gpus=[0, 1])]

    def schedule(r):
        r = msgspec.structs.replace(r, state=JobState.SCHEDULED, generation=1, steps_done=40)
        r = with_event(r, JobScheduled, ts=104.0, generation=1, plan=plan, placement=place, reason="FIFO first fit on n0:2")
        r = with_event(r, JobReconfigured, ts=110.0, generation=2, plan=plan, placement=place, reason="pinned by operator: x")
        return with_event(r, JobSwitched, ts=112.0, generation=2, checkpoint_s=0.5, teardown_s=0.25, launch_s=1.0,
                          restore_s=0.2, first_step_s=0.05, total_s=2.0, steps_lost=3)

    await store.update("jobs1", schedule)
    after = families(observe.generate_latest_for("optimizer"))

    def value(fams, name, sample, **labels):
        return sum(s.value for s in fams.get(name, []) if s.name == sample
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    d = lambda *a, **kw: value(after, *a, **kw) - value(before, *a, **kw)  # noqa: E731
    assert d("gearshift_decisions", "gearshift_decisions_total", kind="scheduled", reason="fifo first fit") == 1
    assert d("gearshift_decisions", "gearshift_decisions_total", kind="reconfigured", reason="pinned by operator") == 1
    assert d("gearshift_admission_wait_seconds", "gearshift_admission_wait_seconds_sum", tenant="nlp") == pytest.approx(4.0)
    assert d("gearshift_switch_duration_seconds", "gearshift_switch_duration_seconds_sum", phase="launch") == 1.0
    assert d("gearshift_switch_duration_seconds", "gearshift_switch_duration_seconds_count", phase="total") == 1
    assert d("gearshift_steps_lost", "gearshift_steps_lost_total", cause="switch") == 3
    assert d("gearshift_job_events", "gearshift_job_events_total", kind="job.switched") == 1


def test_jobs_gauge_sets_states_that_emptied_to_zero():
    running = JobRecord(job_id="g1", spec=spec("cv"), state=JobState.RUNNING)
    observe.job_states([running])
    observe.job_states([msgspec.structs.replace(running, state=JobState.COMPLETED)])
    fams = families(observe.generate_latest_for("optimizer"))
    got = {(s.labels["state"], s.labels["tenant"]): s.value for s in fams["gearshift_jobs"]}
    assert got[("running", "cv")] == 0 and got[("completed", "cv")] == 1


def test_dcgm_gauges_from_a_node_report():
    rep = NodeReport(node="n7", ts=1.0, cpus=8, running=["a@1"], gpus=[
        GpuReport(index=0, uuid="GPU-0", name="H100", memory_used=3 * 2**30, memory_total=80 * 2**30, utilization=55.0)])
    observe.gpu_report(rep)
    fams = families(observe.generate_latest_for("agent"))
    labels = {"gpu": "0", "UUID": "GPU-0", "modelName": "H100", "Hostname": "n7"}
    assert [s.value for s in fams["DCGM_FI_DEV_GPU_UTIL"] if s.labels == labels] == [55.0]
    assert [s.value for s in fams["DCGM_FI_DEV_FB_USED"] if s.labels == labels] == [3072.0]
    assert [s.value for s in fams["DCGM_FI_DEV_FB_FREE"] if s.labels == labels] == [77 * 1024.0]


def test_dcgm_gauges_follow_each_beat_and_look_their_labels_up_once(monkeypatch):
    """A beat sets the GPU's gauges through children looked up once: the fleet
    emulator's 2,000 agents beat 1,000 times a second, and ``labels()`` per
    gauge and GPU cost about 0.1 ms a beat."""
    calls = []
    for m in (observe.GPU_UTIL, observe.FB_USED, observe.FB_FREE, observe.GPU_PROCS):
        monkeypatch.setattr(m, "labels", lambda *a, _l=m.labels: calls.append(a) or _l(*a))

    def beat(used_gib: int, util: float) -> None:
        observe.gpu_report(NodeReport(node="n8", ts=1.0, cpus=8, gpus=[
            GpuReport(index=i, uuid=f"GPU-8-{i}", name="H100", memory_used=used_gib * 2**30, memory_total=80 * 2**30,
                      utilization=util) for i in range(2)]))

    beat(3, 55.0)
    beat(5, 70.0)
    beat(7, 90.0)
    assert len(calls) == 2 * 4  # two GPUs, four gauges, once
    fams = families(observe.generate_latest_for("agent"))
    labels = {"gpu": "1", "UUID": "GPU-8-1", "modelName": "H100", "Hostname": "n8"}
    assert [s.value for s in fams["DCGM_FI_DEV_GPU_UTIL"] if s.labels == labels] == [90.0]
    assert [s.value for s in fams["DCGM_FI_DEV_FB_USED"] if s.labels == labels] == [7 * 1024.0]


def test_reason_labels_stay_bounded():
    assert observe.reason_label("FIFO first fit on node0:4") == "fifo first fit"
    assert observe.reason_label("retry 1/3: exit 1") == "retry"
    assert observe.reason_label("rubick: grew to 8 GPUs") == "rubick"
    assert observe.reason_label("") == "none"


def test_dashboard_view_places_jobs_on_gpus_and_times_switches():
    v = DashboardState()
    v.put_node(NodeReport(node="n0", ts=1.0, cpus=8, gpus=[GpuReport(index=i, uuid=f"u{i}") for i in range(4)]), "n0")
    plan = Plan(dp=2, tp=1, pp=1)
    run = JobRecord(job_id="a1", spec=spec(), state=JobState.RUNNING, plan=plan, generation=2, started_at=10.0,
                    placement=[NodePlacement(node="n0", gpus=[1, 2])])
    v.put_job(run, "a1")
    v.put_job(JobRecord(job_id="b1", spec=spec("cv"), reason="waiting: behind a1 in FIFO order"), "b1")
    v.put_event(1, "gs.evt.job.a1.reconfigured", JobReconfigured(
        ts=20.0, job_id="a1", seq=3, generation=2, plan=plan, placement=run.placement, previous_plan=Plan(dp=4, tp=1, pp=1)))
    v.put_event(2, "gs.evt.job.a1.switched", JobSwitched(ts=23.0, job_id="a1", seq=4, generation=2, checkpoint_s=1.0,
                                                          teardown_s=0.5, launch_s=1.0, restore_s=0.4, first_step_s=0.1,
                                                          total_s=3.0, steps_lost=2))
    s = v.snapshot(now=30.0)
    assert [g["job"] for g in s["nodes"][0]["gpus"]] == [None, "a1", "a1", None]
    assert s["queue"][0]["reason"] == "waiting: behind a1 in FIFO order"
    assert s["running"][0]["run_time_s"] == 20.0 and s["running"][0]["plan"] == "DP2"
    sw = s["switches"][0]
    assert sw["from_plan"] == "DP4" and sw["plan"] == "DP2" and sw["started"] == 20.0
    assert sw["phases"]["checkpoint"] == 1.0 and sw["total_s"] == 3.0 and sw["steps_lost"] == 2
    assert {t["tenant"]: (t["gpus"], t["pending"]) for t in s["tenants"]} == {"nlp": (2, 0), "cv": (0, 1)}
    assert s["events"][0]["kind"] == "job.switched"  # newest first


def test_grafana_dashboard_queries_only_served_families():
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[1] / "deploy" / "grafana" / "gearshift.json").read_text())
    served = {m._name for fams in observe.ROLE_FAMILIES.values() for m in fams}
    suffixes = ("_total", "_bucket", "_sum", "_count")
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for expr in exprs:
        for name in re.findall(r"\b((?:gearshift|DCGM)_\w+)", expr):
            base = next((name[: -len(s)] for s in suffixes if name.endswith(s) and name[: -len(s)] in served), name)
            assert base in served, f"{name} in {expr!r} is not served by any process"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
