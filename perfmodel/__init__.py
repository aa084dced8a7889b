"""gearshift performance model (pure: never imports nats).

How fast does a job train with a given execution plan on given resources?
A white-box model after Rubick (MLSys'25), fitted per model from a few
profiling runs, with shared per-cluster constants.

Public API (for the policies, the simulator and the perfmodel service)
---------------------------------------------------------------------
Shapes and plans
  ModelShape(name, params_m, layers, hidden, seq_len, heads=0, grad_bytes=2)
      .key -> str                        stable cache key
  ConcretePlan(dp, tp, pp, zero, offload, ga, micro_batch, grad_ckpt)   (the bus Plan's fields, micro_batch concrete)
      .family -> "ga"|"gc"|"zero-dp"|"zero-offload"|"3D"
  as_plan(obj) -> ConcretePlan                   from any object/dict with the Plan fields
  PlanArray.from_plans(iterable)         column store; .plan(i), .take(idx), .to_plans()
  Resources(gpus_per_node: tuple[int,...], cpu_threads_per_gpu=4.0)
      Resources.from_placement("8888"), Resources.uniform(n_nodes, gpus_per_node)
  ResourceArray.from_resources(list) / .broadcast(res, n)
  enumerate_plans(shape, global_batch, resources) -> PlanArray   whole plan space
  memory_per_gpu_gb(shape, plans) / memory_feasible(shape, plans, gpu_mem_gb=80)
  memory_parts_gb(shape, plans) -> [plan, (weights, grads, optimizer, activations)] per GPU, GiB

Fitted parameters
  PerfParams(model_key, theta, cluster, gpu_mem_gb=80.0); .to_dict() / .from_dict()
  fitted_model_for(name) -> PerfParams   Rubick models: vit roberta bert t5 gpt2 llama7 llama30
  rubick_job(name) -> (ModelShape, global_batch); rubick_shape(name); rubick_global_batch(name)
  shipped_cluster() -> np.ndarray        cluster constants fitted once on the shipped data
  params_for_shape(shape) -> PerfParams  Rubick fit by name, else nearest Rubick model scaled
  shape_from_spec(model_spec) -> ModelShape;  sim_predictor(gpus_per_node) -> predictor(spec,
      plan, per_node) -> seconds/step (0 = does not fit): the simulator's hook
  fit(shape, samples, cluster=None) -> PerfParams     samples: Sample(plan, resources,
      global_batch, iter_ms, fwd_ms=nan, tcc_ms=nan, opt_ms=nan)
  fit_joint({name: (shape, samples)}, cluster=None) -> (cluster, {name: theta})

Prediction (vectorised; numba kernel, numpy reference via engine="numpy")
  predict(params, shape, global_batch, plans, resources) -> Prediction
      .iter_time_s, .throughput (samples/s, 0 if infeasible), .mem_gb, .feasible, .valid
      plans: PlanArray or plan-likes; resources: one Resources, a list, or a ResourceArray
  plan_throughput(params, shape, global_batch, plan, resources) -> float
      a *given* plan on a *given* offer (guarantees: requested plan on requested GPUs)
  best_plan(params, shape, global_batch, resources) -> (ConcretePlan | None, throughput)

Sensitivity curves (cached per model key + params + batch + grid)
  curve(params, shape, global_batch, max_gpus=64, gpus_per_node=8, max_nodes=8,
        threads=(1, 2, 4, 8)) -> SensitivityCurve
      .throughput(gpus, nodes=None, threads=4)   1%-knee monotone envelope (array read)
      .exact_throughput(gpus, nodes=None, threads=4), .best_plan(gpus, nodes, threads)
      .knee(gpus, nodes, threads) -> Allocation(gpus, nodes, threads, throughput, plan)
      .saturation -> Allocation  smallest allocation within 1% of the maximum
      .gpu_curve(threads) -> np.ndarray over g = 0..max_gpus; .marginal_gain(gpus, delta)
      arrays: .tput/.env/.knee_g/.knee_n/.knee_ci/.plan_idx [g, n, thread_index]

GPU types (``perfmodel/GPU_TYPES.md``)
  SPECS[type] -> GpuSpec(tflops, mem_bw_gbs, link_gbs, mem_gb); REFERENCE = "a800" (the fit's GPU)
  params_for_type(params, gpu_type) -> PerfParams   the fit moved to another GPU type

Validation: `python -m perfmodel.validate [--data DIR] [-o json]`
(= `gearshift perfmodel validate`, via `perfmodel.validate.main(argv) -> int`).

Units: iteration time in seconds from `predict`, milliseconds inside the model;
bandwidths in GB/s; parameters in millions.
"""

from gearshift.perfmodel.catalog import (
    fitted_model_for,
    params_for_shape,
    rubick_job,
    shape_from_spec,
    shipped_cluster,
    sim_predictor,
)
from gearshift.perfmodel.curve import CurveAllocation, SensitivityCurve, clear_curve_cache, curve
from gearshift.perfmodel.fit import Sample, fit, fit_joint
from gearshift.perfmodel.gputypes import REFERENCE as REFERENCE_GPU
from gearshift.perfmodel.gputypes import SPECS as GPU_SPECS
from gearshift.perfmodel.gputypes import params_for_type
from gearshift.perfmodel.memory import memory_feasible, memory_parts_gb, memory_per_gpu_gb
from gearshift.perfmodel.model import CLUSTER_NAMES, PARAM_NAMES, PerfParams
from gearshift.perfmodel.plans import FAMILIES, ConcretePlan, PlanArray, ResourceArray, Resources, as_plan, enumerate_plans
from gearshift.perfmodel.predict import Prediction, best_plan, plan_throughput, predict
from gearshift.perfmodel.rubick import MODELS as RUBICK_MODELS
from gearshift.perfmodel.rubick import rubick_global_batch, rubick_shape
from gearshift.perfmodel.shapes import ModelShape

__all__ = [
    "CurveAllocation", "CLUSTER_NAMES", "GPU_SPECS", "REFERENCE_GPU", "params_for_type", "FAMILIES", "ModelShape", "PARAM_NAMES", "PerfParams", "ConcretePlan", "PlanArray",
    "Prediction", "RUBICK_MODELS", "ResourceArray", "Resources", "Sample", "SensitivityCurve", "as_plan",
    "best_plan", "clear_curve_cache", "curve", "enumerate_plans", "fit", "fit_joint", "fitted_model_for",
    "memory_feasible", "memory_parts_gb", "memory_per_gpu_gb", "plan_throughput", "predict", "rubick_global_batch", "rubick_job",
    "rubick_shape", "shipped_cluster", "params_for_shape", "shape_from_spec", "sim_predictor",
]
