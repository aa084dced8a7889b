"""The perfmodel service against a real nats-server: fit, predict, curve, bad requests."""

from __future__ import annotations

import json

import msgspec
import pytest

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import PERFMODEL_CURVE, PERFMODEL_FIT, PERFMODEL_PREDICT, CurveReply, FitReply, PredictReply
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.perfmodel import model_kv_key as kv_key
from gearshift.perfmodel import Resources, enumerate_plans, fitted_model_for, predict, rubick_job
from gearshift.services.perfmodel_service import start_perfmodel

GPT2 = {"name": "gpt2", "params": 1557.686, "layers": 48, "hidden": 1600, "seq_len": 1024, "heads": 25}
MYSTERY = {"name": "mystery", "params": 2000.0, "layers": 24, "hidden": 2048, "seq_len": 1024, "heads": 16}


@pytest.fixture
async def perfmodel(nc):
    obj, svc = await start_perfmodel(nc)
    yield obj
    await svc.stop()


def test_messages_live_in_bus_schema():
    import gearshift.services.perfmodel_service as svc
    from gearshift.bus_schema import CurveRequest, FitRequest, PredictRequest, codec
    from gearshift.bus_schema.schema import SUBJECT_MAP, bus_schema

    assert svc.FitRequest is FitRequest and svc.PERFMODEL_FIT == PERFMODEL_FIT == "gs.perfmodel.fit"
    assert SUBJECT_MAP[PERFMODEL_PREDICT]["request"] == "PredictRequest"
    assert {"FitRequest", "PredictReply", "CurveRequest"} <= set(bus_schema()["components"]["schemas"])
    body = {"model": GPT2, "global_batch": 16}
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        codec.decode(json.dumps({**body, "max_gpus": 8, "colour": 1}).encode(), CurveRequest)
    with pytest.raises(AttributeError):
        codec.decode(json.dumps({**body, "max_gpus": 8}).encode(), CurveRequest).max_gpus = 9  # frozen
    # Replies tolerate fields a newer service may add.
    reply = msgspec.json.decode(b'{"model_key":"k","source":"kv","points":[],"saturation":null,"new":1}', type=CurveReply)
    assert reply.model_key == "k"
    assert PredictRequest.__struct_config__.forbid_unknown_fields


def _plan_dict(p):
    return {k: v for k, v in p.to_dict().items()}


async def req(nc, subject, body, reply_type):
    return await call(nc, subject, json.dumps(body).encode(), reply_type, timeout=60)


async def test_fit_then_predict_and_curve(nc, perfmodel):
    # Samples of a new model made by the gpt2 fit (as a profiler would measure them).
    shape, B = rubick_job("gpt2")
    truth = fitted_model_for("gpt2")
    samples = []
    for pl in ("2", "4", "8", "44"):
        res = Resources.from_placement(pl)
        pa = enumerate_plans(shape, B, res, with_3d=False)
        pa = pa.take(list(range(0, len(pa), max(1, len(pa) // 3))))
        pr = predict(truth, shape, B, pa, res)
        for i in range(len(pa)):
            if pr.feasible[i]:
                samples.append({"plan": _plan_dict(pa.plan(i)), "resources": {"gpus_per_node": list(res.gpus_per_node)},
                                "iter_ms": float(pr.iter_time_s[i] * 1000)})
    fit = await req(nc, PERFMODEL_FIT, {"model": MYSTERY, "global_batch": B, "samples": samples}, FitReply)
    assert fit.samples == len(samples) and fit.train_error < 0.05
    kv = await nc.jetstream().key_value(subj.MODELS_BUCKET)
    stored = await kv.get(fit.kv_key)
    assert msgspec.json.decode(stored.value)["model_key"] == fit.model_key and fit.kv_key == kv_key(fit.model_key)

    plans = [{"dp": 8, "zero": 2, "micro_batch": 2}, {"dp": 4, "tp": 2, "micro_batch": 4},
             {"dp": 8, "micro_batch": 1}]
    got = await req(nc, PERFMODEL_PREDICT, {"model": MYSTERY, "global_batch": B, "plans": plans,
                                           "resources": [{"gpus_per_node": [8]}]}, PredictReply)
    assert got.source == "kv"
    assert got.feasible[:2] == [True, True] and got.throughput[0] > 0
    assert got.feasible[2] is False and "batch" in got.reason[2] and got.iter_time_s[2] is None

    # A Rubick model needs no fit: the shipped catalog answers.
    cat = await req(nc, PERFMODEL_PREDICT, {"model": GPT2, "global_batch": B, "plans": plans[:1],
                                           "resources": [{"gpus_per_node": [8]}]}, PredictReply)
    assert cat.source == "catalog" and cat.feasible == [True]
    cur = await req(nc, PERFMODEL_CURVE, {"model": GPT2, "global_batch": B, "max_gpus": 16, "max_nodes": 2}, CurveReply)
    assert len(cur.points) == 16
    tp = [p.throughput for p in cur.points]
    assert tp == sorted(tp) and all(p.knee_gpus <= p.gpus for p in cur.points)
    assert cur.saturation is not None and cur.saturation.plan is not None


async def test_bad_requests_get_clear_errors(nc, perfmodel):
    base = {"model": MYSTERY, "global_batch": 16, "plans": [{"dp": 8}], "resources": [{"gpus_per_node": [8]}]}
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_PREDICT, base, PredictReply)
    assert e.value.code == "404" and "fit it first" in e.value.message
    bad_shape = dict(base, model=dict(MYSTERY, layers=0))
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_PREDICT, bad_shape, PredictReply)
    assert e.value.code == "400" and "layers" in (e.value.field or "")
    mism = dict(base, model=GPT2, plans=[{"dp": 8}, {"dp": 4}],
                resources=[{"gpus_per_node": [8]}, {"gpus_per_node": [4]}, {"gpus_per_node": [2]}])
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_PREDICT, mism, PredictReply)
    assert e.value.code == "400" and e.value.field == "resources"
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_PREDICT, dict(base, model=GPT2, resources=[{"gpus_per_node": [0]}]), PredictReply)
    assert e.value.code == "400"
    # Infeasible (memory) is an answer, not an error.
    llama = {"name": "llama7", "params": 6738.4, "layers": 32, "hidden": 4096, "seq_len": 2048, "heads": 32}
    oom = dict(base, model=llama, global_batch=8, plans=[{"dp": 1, "micro_batch": 8}],
               resources=[{"gpus_per_node": [1]}])
    got = await req(nc, PERFMODEL_PREDICT, oom, PredictReply)
    assert got.feasible == [False] and "memory" in got.reason[0]
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_FIT, {"model": MYSTERY, "global_batch": 16,
                                      "samples": [{"plan": {"dp": 4}, "resources": {"gpus_per_node": [8]},
                                                   "iter_ms": 10.0}]}, FitReply)
    assert e.value.code == "400" and "samples[0]" in (e.value.field or "")
    with pytest.raises(ServiceCallError) as e:
        await req(nc, PERFMODEL_FIT, {"model": MYSTERY, "global_batch": 16, "samples": []}, FitReply)
    assert e.value.code == "400"
