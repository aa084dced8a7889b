"""Admission against a real nats-server: submit/get/list/cancel and every bad input."""

from __future__ import annotations

import asyncio
import json

import pytest

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus.clock import ManualClock
from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import GpuReport, JobList, JobRecord, JobState, NodeReport, SubmitReply
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer

SPEC = {
    "name": "gpt2-small",
    "model": {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024},
    "global_batch": 16,
    "steps": 100,
    "gpus": 2,
}


def spec(**over):
    s = json.loads(json.dumps(SPEC))
    for k, v in over.items():
        if v is None:
            s.pop(k, None)
        else:
            s[k] = v
    return s


@pytest.fixture
async def admission(nc):
    adm, svc = await start_admission(nc, max_gpus=64)
    yield adm
    await svc.stop()


async def submit(nc, body) -> SubmitReply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await call(nc, subj.ADMISSION_SUBMIT, raw, SubmitReply)


async def jobs_state(nc) -> dict:
    kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
    return await kv_snapshot(kv)


async def test_admission_stamps_the_clock_it_is_given(nc):
    clock = ManualClock(5000.0)
    adm, svc = await start_admission(nc, max_gpus=64, clock=clock)
    try:
        reply = await submit(nc, {"spec": spec()})
        rec = await call(nc, subj.ADMISSION_GET, {"job_id": reply.job_id}, JobRecord)
        assert rec.submitted_at == 5000.0
        clock.advance(7.0)
        cancelled = await call(nc, subj.ADMISSION_CANCEL, {"job_id": reply.job_id}, JobRecord)
        assert cancelled.state == JobState.CANCELLED and cancelled.finished_at == 5007.0
    finally:
        await svc.stop()
        await adm.close()


async def test_submit_get_list_and_event(nc, admission):
    kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
    before = (await nc.jetstream().stream_info("KV_" + subj.JOBS_BUCKET)).state.last_seq
    reply = await submit(nc, {"spec": spec()})
    assert reply.created and reply.state == JobState.PENDING
    rec = await call(nc, subj.ADMISSION_GET, {"job_id": reply.job_id}, JobRecord)
    assert rec.spec.name == "gpt2-small" and rec.state == JobState.PENDING
    # one write: the record with its event in the outbox; the optimizer's leader publishes it
    assert rec.event_seq == 1 and [e.__struct_config__.tag for e in rec.outbox] == ["job.submitted"]
    assert (await kv.get(reply.job_id)).revision == before + 1
    listed = await call(nc, subj.ADMISSION_LIST, {}, JobList)
    assert [j.job_id for j in listed.jobs] == [reply.job_id]
    assert (await nc.jetstream().stream_info("GS_EVENTS")).state.messages == 0  # nobody leads: not yet out
    opt = await Optimizer(nc, interval=3600, lease_ttl=2).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        sub = await nc.jetstream().subscribe("gs.evt.job.>", ordered_consumer=True)
        msg = await sub.next_msg(timeout=10)
        ev = codec.decode_event(msg.data)
        assert ev.job_id == reply.job_id and msg.subject == f"gs.evt.job.{reply.job_id}.submitted"
        assert msg.headers["Nats-Msg-Id"] == f"{reply.job_id}:1"
        reply2 = await submit(nc, {"spec": spec(name="second")})  # while it leads: out at once
        msg = await sub.next_msg(timeout=10)
        assert msg.subject == f"gs.evt.job.{reply2.job_id}.submitted"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_submit_is_idempotent_on_token(nc, admission):
    a = await submit(nc, {"spec": spec(), "token": "tok-1"})
    b = await submit(nc, {"spec": spec(), "token": "tok-1"})
    assert a.job_id == b.job_id and a.created and not b.created
    assert len(await jobs_state(nc)) == 1
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, {"spec": spec(steps=5), "token": "tok-1"})
    assert err.value.code == "409" and err.value.field == "token"


BAD = [
    ("missing field", {"spec": spec(steps=None)}, "spec", "missing required field `steps`"),
    ("wrong type", {"spec": spec(gpus="two")}, "spec.gpus", "Expected `int`"),
    ("zero gpus", {"spec": spec(gpus=0)}, "spec.gpus", ">= 1"),
    ("negative steps", {"spec": spec(steps=-3)}, "spec.steps", ">= 1"),
    ("zero batch", {"spec": spec(global_batch=0)}, "spec.global_batch", ">= 1"),
    ("too many gpus", {"spec": spec(gpus=65)}, "spec.gpus", "at most 64"),
    ("zero out of range", {"spec": spec(gpus=2, plan={"dp": 2, "zero": 4})}, "spec.plan.zero", "<= 3"),
    ("tp out of range", {"spec": spec(plan={"dp": 1, "tp": 0, "pp": 2})}, "spec.plan.tp", ">= 1"),
    ("plan vs gpus", {"spec": spec(gpus=2, plan={"dp": 2, "tp": 2})}, "spec.plan", "differs from gpus"),
    ("micro batch", {"spec": spec(plan={"dp": 2, "micro_batch": 3})}, "spec.plan.micro_batch", "global_batch"),
    ("offload without zero", {"spec": spec(plan={"dp": 2, "offload": True})}, "spec.plan.offload", "ZeRO"),
    ("long name", {"spec": spec(name="x" * 500)}, "spec.name", "length"),
    ("bad name chars", {"spec": spec(name="a b;rm")}, "spec.name", "regex"),
    ("unknown field", {"spec": spec(gpuz=3)}, "spec", "unknown field `gpuz`"),
    ("model params", {"spec": spec(model={**SPEC["model"], "params": -1})}, "spec.model.params", "> 0"),
    ("env override", {"spec": spec(command=["python", "x.py"], env={"RANK": "3"})}, "spec.env.RANK", "set by the agent"),
    # the model's own shape (bus_schema.plan_support.model_refusal)
    ("tp vs heads", {"spec": spec(model={**SPEC["model"], "heads": 25}, plan={"dp": 1, "tp": 2})}, "spec.plan.tp",
     "tp 2 does not divide the 25 attention heads of model gpt2"),
    ("tp vs kv heads", {"spec": spec(gpus=4, model={**SPEC["model"], "heads": 16, "kv_heads": 2},
                                     plan={"dp": 1, "tp": 4})}, "spec.plan.tp", "does not divide the 2 key/value heads"),
    ("pp vs layers", {"spec": spec(gpus=4, model={**SPEC["model"], "layers": 2}, plan={"dp": 1, "pp": 4})},
     "spec.plan.pp", "pp 4 is more stages than the 2 layers"),
    ("tp vs hidden", {"spec": spec(gpus=4, model={**SPEC["model"], "hidden": 2}, plan={"dp": 1, "tp": 4})},
     "spec.plan.tp", "more than the hidden size 2"),
    ("kv heads vs heads", {"spec": spec(model={**SPEC["model"], "heads": 16, "kv_heads": 3})}, "spec.model.kv_heads",
     "must divide the 16 attention heads"),
]


@pytest.mark.parametrize("case,body,field,text", BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_rejected_and_changes_nothing(nc, admission, case, body, field, text):
    await submit(nc, {"spec": spec(name="keep")})  # one write: the bucket is still from here on
    before = await jobs_state(nc)
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, body)
    assert err.value.code == "400"
    assert err.value.field == field
    assert text in err.value.message and "\n" not in err.value.message  # one line
    assert await jobs_state(nc) == before


@pytest.mark.parametrize(
    "raw,text",
    [(b"{not json", "invalid JSON"), (b"", "empty request"), (b"[1,2]", "Expected `object`"),
     (b'{"spec": ' + b'"' + b"x" * 300_000 + b'"}', "exceeds")],
    ids=["invalid-json", "empty", "array", "oversized"],
)
async def test_malformed_requests(nc, admission, raw, text):
    before = await jobs_state(nc)
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, raw)
    assert text in err.value.message
    assert await jobs_state(nc) == before


async def test_gpus_checked_against_registered_nodes(nc):
    adm, svc = await start_admission(nc)  # no configured maximum: use the nodes
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    gpus = [GpuReport(index=i, uuid=f"GPU-{i}") for i in range(4)]
    for n in ("n0", "n1"):
        await kv.put(n, codec.encode(NodeReport(node=n, ts=0, gpus=gpus, cpus=16)))
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, {"spec": spec(gpus=9)})
    assert err.value.field == "spec.gpus" and "at most 8" in err.value.message
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, {"spec": spec(gpus=8, plan={"dp": 1, "tp": 8})})
    assert err.value.field == "spec.plan.tp"
    assert (await submit(nc, {"spec": spec(gpus=8)})).created
    # the nodes are read, not watched: one that registers later counts before a job is refused
    reads = adm.nodes_view.reads
    await kv.put("n2", codec.encode(NodeReport(node="n2", ts=0, gpus=gpus, cpus=16)))
    assert (await submit(nc, {"spec": spec(gpus=12)})).created
    assert adm.nodes_view.reads == reads + 1
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, {"spec": spec(gpus=13)})
    assert "at most 12" in err.value.message
    with pytest.raises(ServiceCallError) as err:  # refused for another reason: the nodes are not read again
        await submit(nc, {"spec": spec(gpus=1, steps=0)})
    assert adm.nodes_view.reads == reads + 2
    await svc.stop()


async def test_cancel_pending_job(nc, admission):
    r = await submit(nc, {"spec": spec()})
    rec = await call(nc, subj.ADMISSION_CANCEL, {"job_id": r.job_id}, JobRecord)
    assert rec.state == JobState.CANCELLED
    with pytest.raises(ServiceCallError) as err:
        await call(nc, subj.ADMISSION_CANCEL, {"job_id": r.job_id}, JobRecord)
    assert err.value.code == "409"
    with pytest.raises(ServiceCallError) as err:
        await call(nc, subj.ADMISSION_GET, {"job_id": "jnope"}, JobRecord)
    assert err.value.code == "404"


async def test_service_is_discoverable(nc, admission):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING.admission", b"", reply=inbox)
    msg = await sub.next_msg(timeout=2)
    assert json.loads(msg.data)["name"] == "admission"
