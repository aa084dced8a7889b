"""The profiler service: fitted performance models for models nobody profiled yet.

For a model key with no fitted parameters in KV ``gs_models`` (and no shipped
Rubick fit), it
1. chooses at most 7 profiling plans that identify the model's parameters
   (``profiling_plans``): DP1 (compute per sample, constants), DP1+GA2+GC
   (the per-micro-step cost and the recompute ratio, told apart by the
   forward/backward phase times), DP2 (gradient sync and its overlap with
   backward), DP2+ZeRO-1 (sharded optimizer step + parameter gather), and,
   where the model allows TP/PP (heads, layers) and a node has 2 GPUs, DP1,
   DP1+GA4 (the per-micro-step cost), DP1+GC (the recompute ratio), DP2+ZeRO-1
   (the sync and the sharded step), TP2 (TP compute efficiency), PP2 and
   PP2+GA4 (a pipeline's per-sample and per-micro-batch cost, bubble
   included); without TP/PP: DP1+GA2, DP1+GC, DP2+GA2+GC and DP1+GA4 instead, and a plan the job's ``plan_support``
   rules out (T5 declares no PP) gives its place to the next of those;
   all within the GPUs one node has and the global batch allows;
2. runs each, one after the other so runs do not disturb each other's
   timings, for a few steps on an agent with enough free GPUs
   (``gs.agent.<node>.profile``: the job's real command, or the emulated
   worker), collecting the per-phase times (forward, backward+sync,
   optimizer, iteration);
3. hands the samples to ``gs.perfmodel.fit``, which stores the parameters in
   ``gs_models``; the waiting jobs get a ``job.profiled`` event and the
   optimizer (run with ``--wait-for-models``) schedules them on its next round.

Endpoints: ``gs.profiler.profile`` (profile a model now, reply with the
samples and the fit) and ``gs.profiler.status`` (what it is doing). Without
requests it watches ``gs_jobs`` for pending jobs that wait for a model.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Annotated, Any, ClassVar

import msgspec

from gearshift.bus import observe
from gearshift.bus.client import call, connect
from gearshift.bus.config import PosInt, ServiceConfig, load, option
from gearshift.bus.infra import ensure_infra
from gearshift.bus.kv import kv_snapshot
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus.server import Endpoint, RequestError, bad_request, serve
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    JobFailed,
    JobProfiled,
    JobRecord,
    JobState,
    NodeReport,
    Plan,
    PlanSupport,
    ProfileCommand,
    ProfileResult,
)
from gearshift.bus_schema.perfmodel import (
    PERFMODEL_FIT,
    FitReply,
    FitRequest,
    ProfileSample,
    ResourceSpec,
    model_kv_key,
)
from gearshift.bus_schema.plan_support import plan_refusal
from gearshift.bus_schema.profiler import (
    DEFAULT_PROFILE_STEPS,
    PROFILER_PROFILE,
    PROFILER_STATUS,
    ProfileReply,
    ProfileRequest,
    ProfilerStatus,
)
from gearshift.perfmodel.catalog import params_for_shape, shape_from_spec
from gearshift.services.jobstore import JobStore, with_event
from gearshift.services.perfmodel_service import UnshippedPendingView, unmodelled_jobs


class ProfilerConfig(ServiceConfig):
    """gearshift profiler: short profiling runs of the jobs whose model has no fitted parameters."""

    service: ClassVar[str] = "profiler"
    steps: Annotated[PosInt, option("measured steps per profiling run")] = DEFAULT_PROFILE_STEPS
    max_dp: Annotated[PosInt | None, option("largest DP degree to profile (default: node GPUs)")] = None


log = get_logger(service="profiler")

MAX_PLANS = 7
DEFAULT_STEPS = DEFAULT_PROFILE_STEPS


def profiling_plans(global_batch: int, max_dp: int, limit: int = MAX_PLANS, *, heads: int = 0,
                    layers: int = 0, support: PlanSupport | None = None) -> list[Plan]:
    """At most ``limit`` plans that together identify the model: every plan
    is valid for the global batch (dp * ga divides it). With ``heads``
    (divisible by 2) and ``layers`` (>= 2) given and 2 GPUs on a node, TP2,
    PP2 and PP2+GA4 replace three of the data-parallel cross-checks, so the
    3D terms are fitted from the job's own runs. Only plans the job's script
    runs (``support``, its ``JobSpec.plan_support``, which a model family's
    plan space fills in: ``agent.torchplan.space.declared_support``): a plan it
    rules out (say a script that declares no TP: its TP2) gives its place to the next data-parallel plan
    that still tells the parameters apart."""
    wanted = _wanted(max_dp, heads=heads, layers=layers)
    out: list[Plan] = []
    for p in wanted:
        if (p.dp <= max_dp and global_batch % (p.dp * p.ga) == 0 and p not in out
                and plan_refusal(support, p) is None):
            out.append(p)
    return out[:limit]


#: the data-parallel identifying set, in the order its plans matter most
_DP_PLANS = (Plan(dp=1), Plan(dp=1, ga=2), Plan(dp=1, grad_ckpt=True), Plan(dp=2), Plan(dp=2, zero=1),
             Plan(dp=2, ga=2, grad_ckpt=True), Plan(dp=1, ga=4))
#: with TP and PP: three of the data-parallel cross-checks give way to TP2, PP2 and PP2+GA4
# GA and GC apart (DP1+GA4, DP1+GC) rather than together (DP1+GA2+GC): fitted on the same
# 16 measured llama plans, the pair halves the held-out error (0.23 -> 0.12; the combined
# run cannot tell the per-micro-step cost from the recompute), and DP2+ZeRO-1 carries the
# gradient sync that DP2 did (loadtest.profile_accuracy, stop 30's note).
_3D_PLANS = (Plan(dp=1), Plan(dp=1, ga=4), Plan(dp=1, grad_ckpt=True), Plan(dp=2, zero=1), Plan(tp=2), Plan(pp=2),
             Plan(pp=2, ga=4))


def _wanted(max_dp: int, *, heads: int = 0, layers: int = 0) -> list[Plan]:
    """Every candidate, best first: the 3D set where the model and node allow
    it, then the data-parallel plans as substitutes for the ones refused."""
    dp_plans = list(_DP_PLANS)
    if max_dp >= 4:  # a wider DP degree says more about the sync than a second GA point
        dp_plans[-1] = Plan(dp=min(max_dp, 8))
    if max_dp >= 2 and heads and heads % 2 == 0 and layers >= 2:
        return [*_3D_PLANS, *dp_plans]
    return dp_plans


class ProfilingFailed(RequestError):
    """Every profiling run failed; ``results`` says how each did."""

    def __init__(self, message: str, results: list[ProfileResult]):
        super().__init__("500", message)
        self.results = results


def crashed(results: list[ProfileResult]) -> bool:
    """Did every run fail because the script itself failed (a non-zero exit,
    no program)? Not when it ignored the contract or ran out of time."""
    return bool(results) and all(r.error.startswith(("exit codes", "launch failed")) for r in results)


async def _first_of(timeout: float, *events: asyncio.Event) -> None:
    """Until one of ``events`` is set, or ``timeout`` seconds."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Profiler:
    def __init__(self, nc: Any, *, interval: float = 1.0, steps: int = DEFAULT_STEPS, max_dp: int | None = None,
                 run_timeout: float = 180.0, gap: float = 0.25):
        self.nc = nc
        self.js = nc.jetstream()
        self.interval = interval
        # seconds between two passes however many submits woke it: a pass (a stream-info
        # request to nats-server, the waiting jobs read) ran for each submit, 1,612 in the
        # 9 s of 3,000 sequential submits, most of the profiler's CPU per submit (issue 24);
        # a new model now waits at most this long more for its runs
        self.gap = gap
        self.steps = steps
        self.max_dp = max_dp
        self.run_timeout = run_timeout
        self.store = JobStore(nc)
        self.busy: str | None = None
        self.done: list[str] = []
        self.failed: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._run_no = 0

    async def open(self) -> "Profiler":
        await self.store.open()
        self.models_kv = await self.js.key_value(subj.MODELS_BUCKET)
        self.nodes_kv = await self.js.key_value(subj.NODES_BUCKET)
        self.alloc_kv = await self.js.key_value(subj.ALLOC_BUCKET)
        self.pending = await UnshippedPendingView(self.js).start()  # jobs that may wait for a model
        return self

    async def close(self) -> None:
        await self.pending.stop()

    # ------------------------------------------------------------ profiling
    async def _free_nodes(self) -> list[tuple[str, int, int]]:
        """(node, free GPUs, GPUs) of live nodes, most free first."""
        nodes = [codec.decode(v, NodeReport) for v, _ in (await kv_snapshot(self.nodes_kv)).values()]
        used: dict[str, int] = {}
        for k, (v, _) in (await kv_snapshot(self.alloc_kv)).items():
            if "." in k:  # per-node copies of allocations
                continue
            try:
                a = codec.decode(v, Allocation)
            except msgspec.MsgspecError:
                continue
            for p in a.placement:
                used[p.node] = used.get(p.node, 0) + len(p.gpus)
        now = time.time()
        out = [(n.node, len(n.gpus) - used.get(n.node, 0) - len(n.reserved), len(n.gpus))
               for n in nodes if now - n.ts < 15]
        return sorted(out, key=lambda t: (-t[1], t[0]))

    async def _run_one(self, req: ProfileRequest, plan: Plan, deadline: float) -> ProfileResult:
        """One plan on the first node with enough free GPUs (waits for one)."""
        while True:
            for node, free, _ in await self._free_nodes():
                if free < plan.gpus:
                    continue
                self._run_no += 1
                cmd = ProfileCommand(
                    run_id=f"prof-{os.getpid()}-{self._run_no}", plan=plan, global_batch=req.global_batch,
                    command=req.command, env=req.env, steps=req.steps,
                    # emulated worker: the one-GPU step time, spread over the plan's GPUs
                    step_time=req.step_time / plan.gpus if req.step_time else None,
                    timeout=self.run_timeout,
                )
                res = await call(self.nc, subj.agent_command(node, "profile"), cmd, ProfileResult,
                                 timeout=self.run_timeout + 15)
                if res.ok or "free" not in res.error:
                    return res
            if time.monotonic() > deadline:
                return ProfileResult(ok=False, plan=plan, error=f"no node with {plan.gpus} free GPUs")
            await asyncio.sleep(1.0)

    async def profile(self, req: ProfileRequest) -> ProfileReply:
        try:
            key = shape_from_spec(req.model).key
        except (ValueError, TypeError) as exc:
            raise bad_request(f"bad model shape: {exc}", "model") from None
        async with self._lock:  # one profile at a time: runs must not share CPUs/GPUs
            self.busy = key
            started = time.monotonic()
            try:
                nodes = await self._free_nodes()
                max_dp = req.max_dp or self.max_dp or max([g for _, _, g in nodes] or [1])
                shape = shape_from_spec(req.model)
                plans = req.plans or profiling_plans(req.global_batch, max_dp, heads=shape.n_heads,
                                                     layers=shape.layers, support=req.plan_support)
                for p in plans if req.plans else ():
                    refused = plan_refusal(req.plan_support, p)
                    if refused is not None:
                        raise bad_request(f"plans: {p.label()}: {refused[1]}", refused[0])
                if len(plans) > MAX_PLANS and req.fit:
                    raise bad_request(f"{len(plans)} plans: at most {MAX_PLANS}", "plans")
                results: list[ProfileResult] = []
                best: dict[int, ProfileResult] = {}
                deadline = time.monotonic() + 10 * req.repeats * self.run_timeout
                for _ in range(req.repeats):
                    for i, plan in enumerate(plans):
                        res = await self._run_one(req, plan, deadline)
                        results.append(res)
                        observe.PROFILE_RUNS.labels("ok" if res.ok else "failed").inc()
                        log.info("profiling run", model_key=key, plan=plan.label(), ok=res.ok,
                                 iter_ms=res.iter_ms, error=res.error or None)
                        if res.ok and res.iter_ms and (i not in best or res.iter_ms < (best[i].iter_ms or 0)):
                            best[i] = res
                samples = [ProfileSample(
                    plan=plans[i], resources=ResourceSpec(gpus_per_node=[plans[i].gpus]), iter_ms=res.iter_ms,
                    fwd_ms=res.fwd_ms or None, tcc_ms=res.bwd_ms or None, opt_ms=res.opt_ms or None,
                ) for i, res in sorted(best.items())]
                fit = None
                if req.fit:
                    if not samples:
                        raise ProfilingFailed("every profiling run failed: " +
                                              "; ".join(dict.fromkeys(r.error for r in results if r.error)), results)
                    fit = await call(self.nc, PERFMODEL_FIT,
                                     FitRequest(model=req.model, global_batch=req.global_batch, samples=samples),
                                     FitReply, timeout=900)
                    self.done.append(key)
                    self.failed.pop(key, None)
                return ProfileReply(model_key=key, samples=samples, results=results, fit=fit,
                                    wall_s=time.monotonic() - started)
            finally:
                self.busy = None

    # ------------------------------------------------------------ watching jobs
    async def _waiting_jobs(self) -> dict[str, list[JobRecord]]:
        """model key -> pending jobs whose model has no fit yet."""

        out: dict[str, list[JobRecord]] = {}
        await self.pending.sync()  # what was submitted before the wake-up is in it
        recs = self.pending.records()  # a view of the few jobs that can wait, not a scan of every job
        if not recs:
            return out
        waiting = await unmodelled_jobs(self.models_kv, recs)
        for key, rec in waiting.values():
            out.setdefault(key, []).append(rec)
        return out

    async def watch(self, stop: asyncio.Event) -> None:
        async def on_submitted(_msg: Any) -> None:
            self._wake.set()

        sub = await self.nc.subscribe("gs.evt.job.*.submitted", cb=on_submitted)
        try:
            while not stop.is_set():
                try:
                    await self._profile_waiting()
                except Exception:
                    log.exception("profiling pass failed")
                if self.gap > 0:  # the submits of the gap go into one pass
                    await _first_of(self.gap, stop)
                await _first_of(self.interval, self._wake, stop)
                self._wake.clear()
        finally:
            await sub.unsubscribe()

    async def _profile_waiting(self) -> None:
        for key, recs in (await self._waiting_jobs()).items():
            if key in self.failed:
                continue
            first = min(recs, key=lambda r: r.submitted_at)
            spec = first.spec
            req = ProfileRequest(model=spec.model, global_batch=spec.global_batch, command=spec.command,
                                 env=spec.env, step_time=(spec.step_time or 0.1) * spec.gpus, steps=self.steps,
                                 max_dp=min(spec.gpus, self.max_dp or spec.gpus) if spec.gpus > 1 else 2,
                                 plan_support=spec.plan_support)
            log.info("profiling", model_key=key, jobs=[r.job_id for r in recs])
            try:
                reply = await self.profile(req)
            except Exception as exc:
                self.failed[key] = str(exc)
                log.error("profiling failed", model_key=key, error=str(exc))
                await self._after_failure(key, recs, spec, str(exc), getattr(exc, "results", []))
                continue
            ts = time.time()
            for rec in recs:
                await self.store.update(rec.job_id, lambda r, reply=reply: with_event(
                    r, JobProfiled, ts=ts, model_key=reply.model_key, plans=len(reply.samples),
                    train_error=reply.fit.train_error if reply.fit else None) if not r.terminal else None)
            await self.nc.publish(subj.OPTIMIZER_KICK, b"")

    async def _after_failure(self, key: str, recs: list[JobRecord], spec: Any, why: str,
                             results: list[ProfileResult]) -> None:
        """No job stays pending on a model nobody could profile: when every
        run crashed the script cannot run, and its jobs fail with the reason;
        otherwise (it ignored the profiling contract, timed out, or its timings
        fit nothing) the prior model is stored for its key and its jobs are
        scheduled on it, the reason in their ``job.profiled`` event."""
        ts = time.time()
        if crashed(results):
            reason = f"profiling: {why}"
            for rec in recs:
                await self.store.update(rec.job_id, lambda r: with_event(msgspec.structs.replace(
                    r, state=JobState.FAILED, finished_at=ts, reason=reason), JobFailed, ts=ts, reason=reason)
                    if r.state == JobState.PENDING else None)
            await self.nc.publish(subj.OPTIMIZER_KICK, b"")
            return
        prior = params_for_shape(shape_from_spec(spec.model)).to_dict()
        await self.models_kv.put(model_kv_key(key), msgspec.json.encode({**prior, "source": "prior", "error": why}))
        for rec in recs:
            await self.store.update(rec.job_id, lambda r: with_event(
                r, JobProfiled, ts=ts, model_key=key, plans=0, error=why) if not r.terminal else None)
        await self.nc.publish(subj.OPTIMIZER_KICK, b"")

    async def status(self, _: None) -> ProfilerStatus:
        return ProfilerStatus(busy=self.busy, done=list(self.done), failed=dict(self.failed))

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint("profile", PROFILER_PROFILE, ProfileRequest, self.profile),
            Endpoint("status", PROFILER_STATUS, None, self.status),
        ]


async def amain(stop: asyncio.Event, args: ProfilerConfig) -> None:
    nc = await connect(args.server, name="gearshift-profiler")
    obs = await observe.serve_http("profiler", "profiler", nc)
    await ensure_infra(nc)
    prof = await Profiler(nc, steps=args.steps, max_dp=args.max_dp).open()
    svc = await serve(nc, "profiler", prof.endpoints(), "gearshift profiler")
    obs.set_ready()
    log.info("profiler ready")
    await prof.watch(stop)
    await svc.stop()
    await prof.close()
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    cfg = load(ProfilerConfig, argv)  # flags, GEARSHIFT_PROFILER_<FIELD>, --config FILE
    run_service(lambda stop: amain(stop, cfg))


if __name__ == "__main__":
    main()
