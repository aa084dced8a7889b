"""The perfmodel service: fit, predict and sensitivity curves over NATS.

  gs.perfmodel.fit      samples -> fitted parameters, stored in KV `gs_models`
  gs.perfmodel.predict  plans x resources -> iteration time, throughput, memory, feasibility
  gs.perfmodel.curve    a job's best throughput / plan / knee over GPUs

A thin shell over `perfmodel`: decode, look the model up (KV first, then the
shipped Rubick fits), call the core, reply.  Unknown model keys, bad shapes
and bad resources become error replies; infeasible plans are answered with
`feasible=false` and a reason per plan.

The request/reply structs are in `bus_schema.perfmodel`.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import msgspec
import numpy as np

from gearshift.bus import observe
from gearshift.bus.client import connect
from gearshift.bus.config import ServiceConfig, load
from gearshift.bus.infra import ensure_infra
from gearshift.bus.kv import kv_snapshot
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus.server import Endpoint, RequestError, bad_request, serve
from gearshift.bus.views import KvView
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobRecord, JobState, ModelSpec, Plan

# The request/reply structs live in bus_schema; re-exported for callers that
# import them from the service module.
from gearshift.bus_schema.perfmodel import (
    PERFMODEL_CURVE,
    PERFMODEL_FIT,
    PERFMODEL_PREDICT,
    CurvePoint,
    CurveReply,
    CurveRequest,
    FitReply,
    FitRequest,
    PredictReply,
    PredictRequest,
    ResourceSpec,
    model_kv_key,
)
from gearshift.perfmodel.catalog import params_for_shape, shape_from_spec
from gearshift.perfmodel.curve import curve
from gearshift.perfmodel.fit import Sample, fit
from gearshift.perfmodel.kernels import warm_up
from gearshift.perfmodel.model import PerfParams
from gearshift.perfmodel.plans import PlanArray, ResourceArray, Resources, as_plan
from gearshift.perfmodel.predict import plan_validity, predict
from gearshift.perfmodel.rubick import MODELS


class PerfmodelConfig(ServiceConfig):
    """gearshift performance model: fits profiling samples, predicts throughput and resource curves."""

    service: ClassVar[str] = "perfmodel"


log = get_logger(service="perfmodel")


async def unmodelled_jobs(models_kv: Any, records: Any, have: Any = None) -> dict[str, tuple[str, Any]]:
    """Pending jobs whose model has neither a fit in ``gs_models`` nor a shipped
    one: job id -> (model key, record). Shared by the optimizer (which holds
    such jobs back) and the profiler (which profiles their models). ``have``: the
    bucket's keys, where the caller holds them already (else read here)."""

    if have is None:
        have = set(await kv_snapshot(models_kv))  # not kv.keys(): its watcher can miss keys
    out: dict[str, tuple[str, Any]] = {}
    for rec in records:
        if rec.state != JobState.PENDING or rec.spec.model.name in MODELS:
            continue
        try:
            key = shape_from_spec(rec.spec.model).key
        except (ValueError, TypeError):
            continue
        if model_kv_key(key) not in have:
            out[rec.job_id] = (key, rec)
    return out


class _ModelName(msgspec.Struct, frozen=True):
    name: str = ""


class _SpecModel(msgspec.Struct, frozen=True):
    model: _ModelName = _ModelName()


class _StateAndModel(msgspec.Struct):
    """What of a ``JobRecord`` says whether it may wait for a model (the rest is skipped)."""

    state: str = ""
    spec: _SpecModel = _SpecModel()


_STATE_AND_MODEL = msgspec.json.Decoder(_StateAndModel)


class UnshippedPendingView(KvView[bytes]):
    """``gs_jobs`` as the profiler needs it: the pending jobs whose model has no
    shipped fit (the only ones that can wait for a model), kept current by a watch.
    Each revision is read for its state and model name only, and only those jobs'
    records are kept (and decoded when asked for). It replaced a snapshot of the
    whole bucket on every submit and every second: a per-submit scan of every job,
    in the profiler and in nats-server (issue 24)."""

    def __init__(self, js: Any):
        super().__init__(js, subj.JOBS_BUCKET, self._keep)

    @staticmethod
    def _keep(data: bytes) -> bytes:
        """The record if its job may wait for a model, else b"" (nothing kept)."""
        try:
            got = _STATE_AND_MODEL.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return b""
        return data if got.state == JobState.PENDING.value and got.spec.model.name not in MODELS else b""

    def records(self) -> list[JobRecord]:
        out = []
        for raw, _, _ in self.entries.values():
            if raw:
                try:
                    out.append(codec.decode(raw, JobRecord))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
        return out


def _shape(model: ModelSpec):
    try:
        return shape_from_spec(model)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"bad model shape: {exc}", "model") from None


def _resources(specs: list[ResourceSpec]):
    return [Resources(tuple(r.gpus_per_node), float(r.cpu_threads_per_gpu)) for r in specs]


def _bus_plan(p) -> Plan:
    return Plan(dp=p.dp, tp=p.tp, pp=p.pp, zero=p.zero, offload=p.offload, ga=p.ga,
                micro_batch=p.micro_batch, grad_ckpt=p.grad_ckpt)


def _floats(obj: Any) -> list[float]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _floats(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _floats(v)]
    return [float(obj)] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


class PerfmodelService:
    def __init__(self, nc: Any):
        self.nc = nc
        self.kv: Any = None

    async def open(self) -> "PerfmodelService":
        self.kv = await self.nc.jetstream().key_value(subj.MODELS_BUCKET)

        warm_up()  # compile before answering
        return self

    async def _params(self, shape):
        """(params, source): the KV entry for this model key, else the shipped fit."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(model_kv_key(shape.key))
            if entry is not None and entry.value:
                return PerfParams.from_dict(msgspec.json.decode(entry.value)), "kv"
        except KeyNotFoundError:
            pass
        if shape.name in MODELS:
            return params_for_shape(shape), "catalog"
        raise RequestError("404", f"unknown model key {shape.key!r}: fit it first ({PERFMODEL_FIT})", "model")

    # ------------------------------------------------------------ endpoints
    async def fit(self, req: FitRequest) -> FitReply:
        shape = _shape(req.model)
        samples = []
        for i, s in enumerate(req.samples):
            plan = as_plan(s.plan, req.global_batch)
            res = _resources([s.resources])[0]
            ok = plan_validity(shape, req.global_batch, PlanArray.from_plans([plan]), ResourceArray.broadcast(res, 1))
            if not ok[0]:
                raise bad_request(
                    f"sample {i}: plan {plan.summary} is not valid for global batch {req.global_batch} "
                    f"on {res.n_gpus} GPUs {list(res.gpus_per_node)}", f"samples[{i}].plan")
            nan = float("nan")
            samples.append(Sample(plan, res, req.global_batch, s.iter_ms, s.fwd_ms or nan, s.tcc_ms or nan, s.opt_ms or nan))
        try:
            params = await asyncio.to_thread(fit, shape, samples)
        except (ValueError, FloatingPointError, ArithmeticError, np.linalg.LinAlgError) as exc:
            # extreme or inconsistent timings (found by tests/test_fuzz.py): the client's data, not a crash
            raise bad_request(f"samples: the model cannot be fitted to these timings: {exc}", "samples") from None
        pr = predict(params, shape, req.global_batch, [s.plan for s in samples], [s.resources for s in samples])
        y = np.array([s.iter_ms for s in samples]) / 1000.0
        err = float(np.mean(np.abs(pr.iter_time_s - y) / y))
        if not np.isfinite(err) or not all(np.isfinite(v) for v in _floats(params.to_dict())):
            # extreme timings fit to nothing usable (found by tests/test_fuzz.py): refuse, store nothing
            raise bad_request("samples: these timings give no finite model", "samples")
        key = model_kv_key(shape.key)
        rev = await self.kv.put(key, msgspec.json.encode(params.to_dict()))
        d = params.to_dict()
        log.info("fitted", model_key=shape.key, samples=len(samples), train_error=round(err, 4))
        return FitReply(model_key=shape.key, kv_key=key, revision=int(rev), samples=len(samples),
                        params=d["params"], cluster=d["cluster"], train_error=err)

    async def predict(self, req: PredictRequest) -> PredictReply:
        shape = _shape(req.model)
        if len(req.resources) not in (1, len(req.plans)):
            raise bad_request(f"{len(req.resources)} resources for {len(req.plans)} plans: give 1 or one per plan",
                              "resources")
        params, source = await self._params(shape)
        res = _resources(req.resources)
        res_arg = res[0] if len(res) == 1 else res
        pr = predict(params, shape, req.global_batch, req.plans, res_arg)
        reasons: list[str | None] = []
        for i in range(len(pr)):
            r = res[0] if len(res) == 1 else res[i]
            p = req.plans[i]
            if pr.feasible[i]:
                reasons.append(None)
            elif not pr.valid[i]:
                reasons.append(f"plan uses {p.dp * p.tp * p.pp} GPUs and batch "
                               f"{p.dp * p.ga * (p.micro_batch or max(1, req.global_batch // (p.dp * p.ga)))}; "
                               f"offer has {r.n_gpus} GPUs (max {max(r.gpus_per_node)}/node), "
                               f"global batch is {req.global_batch}")
            else:
                reasons.append(f"does not fit in GPU memory: {pr.mem_gb[i]:.1f} GiB > {params.gpu_mem_gb:.0f} GiB")
        return PredictReply(
            model_key=shape.key, source=source,
            iter_time_s=[float(t) if np.isfinite(t) else None for t in pr.iter_time_s],
            throughput=pr.throughput.tolist(), mem_gb=pr.mem_gb.tolist(), feasible=pr.feasible.tolist(),
            reason=reasons,
        )

    async def curve(self, req: CurveRequest) -> CurveReply:
        shape = _shape(req.model)
        params, source = await self._params(shape)
        c = await asyncio.to_thread(curve, params, shape, req.global_batch, max_gpus=req.max_gpus,
                                    gpus_per_node=req.gpus_per_node, max_nodes=req.max_nodes,
                                    threads=sorted({1.0, 2.0, 4.0, 8.0, float(req.cpu_threads_per_gpu)}))
        th = float(req.cpu_threads_per_gpu)
        points = []
        for g in range(1, c.max_gpus + 1):
            k = c.knee(g, threads=th)
            points.append(CurvePoint(gpus=g, throughput=c.throughput(g, threads=th),
                                     knee_gpus=k.gpus if k else 0, knee_nodes=k.nodes if k else 0,
                                     plan=_bus_plan(k.plan) if k and k.plan else None))
        s = c.saturation
        sat = None if s is None else CurvePoint(gpus=s.gpus, throughput=s.throughput, knee_gpus=s.gpus,
                                               knee_nodes=s.nodes, plan=_bus_plan(s.plan) if s.plan else None)
        return CurveReply(model_key=shape.key, source=source, points=points, saturation=sat)

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint("fit", PERFMODEL_FIT, FitRequest, self.fit),
            Endpoint("predict", PERFMODEL_PREDICT, PredictRequest, self.predict),
            Endpoint("curve", PERFMODEL_CURVE, CurveRequest, self.curve),
        ]


async def start_perfmodel(nc: Any) -> tuple[PerfmodelService, Any]:
    await ensure_infra(nc)
    svc_obj = await PerfmodelService(nc).open()
    svc = await serve(nc, "perfmodel", svc_obj.endpoints(), "gearshift performance model")
    return svc_obj, svc


async def amain(stop: asyncio.Event, url: str | None = None) -> None:
    nc = await connect(url, name="gearshift-perfmodel")
    obs = await observe.serve_http("perfmodel", "perfmodel", nc)
    _, svc = await start_perfmodel(nc)
    obs.set_ready()
    log.info("perfmodel ready", url=nc.connected_url.geturl() if nc.connected_url else url)
    await stop.wait()
    await svc.stop()
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    cfg = load(PerfmodelConfig, argv)  # flags, GEARSHIFT_PERFMODEL_<FIELD>, --config FILE
    run_service(lambda stop: amain(stop, cfg.server))


if __name__ == "__main__":
    main()
