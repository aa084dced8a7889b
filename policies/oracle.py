"""Performance oracles that policies can be handed.

``AnalyticOracle`` is a small self-contained roofline-style model (compute,
data-parallel sync with NVLink vs network bandwidth, tensor/pipeline costs,
ZeRO-Offload on CPU threads, input pipeline on CPU threads, a GPU-memory
limit). It exists so that policies, tests and load tests run without a fitted
model; it has the shapes that matter to a scheduler (knees, saturation, CPU
and locality sensitivity, plans that stop fitting in memory) but no fitted
numbers. The optimizer service and the simulator should pass the fitted
model instead (``PerfModelOracle`` once ``perfmodel`` exposes predict).
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift import perfmodel
from gearshift.bus_schema.messages import Plan
from gearshift.perfmodel.gputypes import REFERENCE, compute_slowdown, spec_of
from gearshift.policies.api import JobView, Placement, placement_type


@dataclass(slots=True)
class AnalyticOracle:
    gpu_flops: float = 120e12  # sustained FLOP/s per GPU
    gpu_mem_gb: float = 80.0
    nvlink_gbs: float = 200.0
    net_gbs: float = 12.5  # per node, inter-node
    pcie_gbs: float = 16.0
    hbm_gbs: float = 1500.0
    cpu_opt_s_per_param: float = 2.0e-9  # CPU Adam step, per parameter per thread
    data_s_per_sample: float = 0.004  # input pipeline, per sample per thread
    gpus_per_node: int = 8
    calls: int = 0

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        self.calls += 1
        t = placement_type(placement)
        if t:
            return self._typed(t).throughput(job, plan, tuple(Placement(p.node, p.gpus, p.cpus) for p in placement))
        spec = job.spec
        m = spec.model
        gpus = sum(p.gpus for p in placement)
        if gpus != plan.gpus or gpus == 0:
            return 0.0
        nodes = len(placement)
        cpus = sum(p.cpus for p in placement)
        cpg = max(cpus / gpus, 0.25)
        P = m.params * 1e6
        B = spec.global_batch
        dp, tp, pp, ga = plan.dp, plan.tp, plan.pp, plan.ga
        if B % (dp * ga):
            return 0.0
        mb = B // (dp * ga)
        per_node = gpus // nodes if gpus % nodes == 0 else max(p.gpus for p in placement)
        shard = P / (tp * pp)
        if sum(_memory(m, mb, plan)) > self.gpu_mem_gb * 1e9 * 0.92:
            return 0.0
        # --- compute
        tokens_mb = mb * m.seq_len
        eff = tokens_mb / (tokens_mb + 1024.0)  # small micro-batches use the GPU poorly
        flops = 6.0 * P * m.seq_len * B / gpus
        t_comp = flops / (self.gpu_flops * eff) * (1.33 if plan.grad_ckpt else 1.0)
        t_fwd_bwd = t_comp
        if tp > 1:
            # Narrower GEMMs run less efficiently, and every layer all-reduces
            # its activations (4 per layer, forward and backward).
            w = m.hidden / tp
            t_fwd_bwd *= (m.hidden / (m.hidden + 256.0)) / (w / (w + 256.0))
            bw = self.nvlink_gbs if tp <= per_node else self.net_gbs
            vol = 4.0 * (m.layers / pp) * B / dp * m.seq_len * m.hidden * 2.0 * 2.0 * (tp - 1) / tp
            t_fwd_bwd += vol / (bw * 1e9)
        if pp > 1:
            t_fwd_bwd *= 1.0 + (pp - 1) / ga  # pipeline bubble
            if nodes > 1:
                t_fwd_bwd += ga * mb * m.seq_len * m.hidden * 2 * 2 * (pp - 1) / (self.net_gbs * 1e9)
        # --- data-parallel gradient sync, overlapped with backward
        t_sync = 0.0
        if dp > 1:
            bytes_ = 2.0 * shard * 2.0 * (dp - 1) / dp
            # Pipeline stages split across nodes keep each DP group inside a node.
            cross = nodes > 1 and pp % nodes != 0
            bw = self.net_gbs / max(per_node / tp, 1.0) if cross else self.nvlink_gbs
            t_ar = bytes_ / (bw * 1e9)
            if plan.zero >= 2:
                t_ar *= 1.15
            t_sync = max(0.0, t_ar - 0.5 * t_fwd_bwd)
        # --- optimizer step
        if plan.offload:
            threads = max(cpg, 0.25)
            t_opt = (shard / dp) * self.cpu_opt_s_per_param / threads * 10 + 4 * shard / dp / (self.pcie_gbs * 1e9)
        else:
            div = dp if plan.zero >= 1 else 1
            t_opt = 16 * shard / div / (self.hbm_gbs * 1e9)
        t_gpu = t_fwd_bwd + t_sync + t_opt + 0.01
        # --- input pipeline on the host overlaps the GPU work
        t_data = (B / gpus) * self.data_s_per_sample / cpg
        t_iter = max(t_gpu, t_data) + 0.1 * min(t_gpu, t_data)
        return B / t_iter

    def memory_parts(self, spec, plans) -> list[tuple[float, ...]]:
        """This model's memory per GPU (GB): (weights, grads, optimizer state,
        activations) per plan."""
        B = spec.global_batch
        return [tuple(x / 1e9 for x in _memory(spec.model, max(1, B // (p.dp * p.ga)), p))
                for p in plans]

    def _typed(self, gpu_type: str) -> "AnalyticOracle":
        """This oracle's numbers moved to another GPU type by its specifications."""

        ref, s = spec_of(REFERENCE), spec_of(gpu_type)
        return AnalyticOracle(self.gpu_flops / compute_slowdown(gpu_type), s.mem_gb,
                              self.nvlink_gbs * s.link_gbs / ref.link_gbs, self.net_gbs, self.pcie_gbs,
                              self.hbm_gbs * s.mem_bw_gbs / ref.mem_bw_gbs, self.cpu_opt_s_per_param,
                              self.data_s_per_sample, self.gpus_per_node)


def _memory(m, mb: int, plan: Plan) -> tuple[float, float, float, float]:
    """AnalyticOracle's memory per GPU (bytes): weights, grads, optimizer state, activations."""
    shard = m.params * 1e6 / (plan.tp * plan.pp)
    if plan.offload:
        w, g, opt = shard * 2, shard * 2 / plan.dp, 0.0
    elif plan.zero >= 1:
        w, g, opt = shard * 2, shard * 2, shard * 12 / plan.dp
    else:
        w, g, opt = shard * 2, shard * 2, shard * 12
    act = mb * m.seq_len * m.hidden * (m.layers / plan.pp) * 34 / plan.tp
    if plan.grad_ckpt:
        act *= 2.0 / max(2.0, m.layers / plan.pp)
    return w, g, opt, act


class PerfModelOracle:
    """``PerfOracle`` backed by the fitted performance model (``perfmodel``).

    Parameters come from ``perfmodel.params_for_shape`` (the Rubick fit by
    model name, else the nearest Rubick model scaled) unless a fitted
    ``PerfParams`` is registered for the model with ``set_params`` (what the
    optimizer service should do with the parameters in KV ``gs_models``).
    CPU threads per GPU = the placement's CPUs / GPUs (the request's, or 4,
    when the placement carries no CPUs). Plans come from
    ``perfmodel.enumerate_plans``, so plan choice and memory feasibility are
    the model's.
    """

    def __init__(self, gpu_mem_gb: float | None = None, default_threads: float = 4.0, max_ga: int | None = 16):
        self._pm = perfmodel
        self.default_threads = default_threads
        self.max_ga = max_ga
        self.gpu_mem_gb = gpu_mem_gb
        self._params: dict = {}
        self._shapes: dict = {}
        self._plans: dict = {}
        self._version: dict[str, int] = {}
        self._fits = 0  # set_params calls: any answer may have changed

    def answers_token(self) -> int:
        """Changes whenever any answer may change (a new fit; ``policies.api``)."""
        return self._fits

    def set_params(self, model_name: str, params) -> None:
        """Use ``params`` for this model from now on (a new fit, e.g. from
        ``gs_models``): cached shapes and plans of the model are dropped, and
        ``spec_key`` changes so policies' curve caches miss."""
        self._params[model_name] = params
        self._version[model_name] = self._version.get(model_name, 0) + 1
        self._fits += 1
        for cache in (self._shapes, self._plans):
            for k in [k for k in cache if _model_name(k) == model_name]:
                del cache[k]

    def spec_key(self, spec) -> object:
        """What this oracle's answers depend on: the model, the batch and
        which fit of the model is in use."""
        return (spec.model, spec.global_batch, self._version.get(spec.model.name, 0))

    def _model(self, spec, gpu_type: str = ""):
        key = (spec.model, gpu_type) if gpu_type else spec.model
        got = self._shapes.get(key)
        if got is None:
            shape = self._pm.shape_from_spec(spec.model)
            params = self._params.get(spec.model.name) or self._pm.params_for_shape(shape)
            if self.gpu_mem_gb is not None:
                params = self._pm.PerfParams(params.model_key, params.theta, params.cluster, self.gpu_mem_gb)
            # the fit is the reference GPU's; another type's from its specifications
            params = self._pm.params_for_type(params, gpu_type)
            got = (shape, params)
            self._shapes[key] = got
        return got

    def _resources(self, job: JobView, placement: tuple[Placement, ...]):
        shares = tuple(int(p.gpus) for p in placement if p.gpus > 0)
        g = sum(shares)
        cpus = sum(p.cpus for p in placement)
        threads = cpus / g if cpus > 0 and g else float(job.spec.cpus_per_gpu or self.default_threads)
        return self._pm.Resources(shares, max(threads, 0.25))

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        if sum(p.gpus for p in placement) != plan.gpus:
            return 0.0
        return float(self.throughput_many(job, [plan], placement)[0])

    def throughput_many(self, job: JobView, plans, placement: tuple[Placement, ...], nic_scale: float = 1.0):
        """``nic_scale``: the inter-node bandwidth as a factor of the fitted one (the
        topology level the placement spans, ``policies.topology_price``)."""
        shape, params = self._model(job.spec, placement_type(placement))
        if nic_scale != 1.0:
            from gearshift.perfmodel.catalog import with_nic_scale

            params = with_nic_scale(params, nic_scale)
        res = self._resources(job, placement)
        B = int(job.spec.global_batch)
        pm_plans = [self._pm.as_plan(p, B) for p in plans]
        return self._pm.predict(params, shape, B, pm_plans, res).throughput

    def slowdown(self, spec, plan: Plan, per_node: tuple[int, ...], factor: float) -> float:
        """Step time of ``plan`` on ``per_node`` GPUs with the inter-node bandwidth times
        ``factor``, over its step time at the fitted bandwidth (1.0 where it does not fit):
        the ``Slowdown`` the optimizer's ``TopologyPricedOracle`` is given."""
        job = JobView(job_id="", spec=spec, submitted_at=0.0)
        where = tuple(Placement(f"_n{i}", g, 0) for i, g in enumerate(per_node))
        base, slow = (float(v[0]) for v in (self.throughput_many(job, [plan], where),
                                            self.throughput_many(job, [plan], where, nic_scale=factor)))
        return base / slow if base > 0 and slow > 0 else 1.0

    def memory_parts(self, spec, plans) -> list[tuple[float, ...]]:
        """The model's memory accounting per GPU (GiB): (weights, grads, optimizer
        state, activations) for each plan (``perfmodel.memory_parts_gb``); what the
        learning oracle's OOM rule compares."""
        shape, _ = self._model(spec)
        B = int(spec.global_batch)
        parts = self._pm.memory_parts_gb(shape, self._pm.PlanArray.from_plans([self._pm.as_plan(p, B) for p in plans]))
        return [tuple(row) for row in parts.tolist()]

    def plans(self, job: JobView, placement: tuple[Placement, ...]) -> list[Plan]:
        shape, _ = self._model(job.spec)
        res = self._resources(job, placement)
        key = (shape.key, job.spec.global_batch, res.gpus_per_node)  # plan space: not the type's
        got = self._plans.get(key)
        if got is None:
            pa = self._pm.enumerate_plans(shape, int(job.spec.global_batch), res, max_ga=self.max_ga)
            got = [
                Plan(dp=p.dp, tp=p.tp, pp=p.pp, zero=p.zero, offload=p.offload, ga=p.ga, micro_batch=p.micro_batch,
                     grad_ckpt=p.grad_ckpt)
                for p in pa.to_plans()
            ]
            self._plans[key] = got
        return got


def _model_name(key) -> str | None:
    """The model name inside a cache key (a ModelSpec, or a tuple holding one)."""
    if hasattr(key, "name") and hasattr(key, "params"):
        return key.name
    if isinstance(key, tuple):
        for part in key:
            name = _model_name(part)
            if name is not None:
                return name
    return None
