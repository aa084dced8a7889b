"""``gearshift simulate``: replay a trace through named policies and compare them.

    python -m sim.cli --trace rubick-base --policies rubick,sia,synergy,antman,fifo
    python -m sim.cli --trace-file jobs.csv --format blox --policies fifo --cluster 32x4 -o json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Sequence

from gearshift.sim.compare import compare
from gearshift.sim.engine import SimConfig, SimResult, simulate
from gearshift.sim.loaders import FORMATS, load_named, load_trace_file, trace_names
from gearshift.sim.metrics import summarize, write_per_job_csv
from gearshift.sim.topology import SimTopology, load_cluster_file, parse_factors
from gearshift.sim.trace import parse_cluster


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gearshift simulate", description="Trace-driven simulation of scheduling policies.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help=f"a named trace: {', '.join(trace_names())} (synthetic:jobs=N,rate=R,...)")
    src.add_argument("--trace-file", help="a trace file; give its --format")
    p.add_argument("--format", choices=FORMATS, help="format of --trace-file")
    p.add_argument("--policies", default="fifo", help="comma-separated policy names (default: fifo)")
    p.add_argument("--cluster", help="[TYPE:]NODESxGPUS[:CPUS][,...], e.g. 8x8 or a100:8x8,v100:8x8 (mixed GPU "
                                     "types); default: the trace's own (rubick: 8x8)")
    p.add_argument("--topology", help="LEVEL=COUNT,... coarse to fine: the nodes split evenly, e.g. "
                   "rack=4,nvlink-domain=2 (sim/topology.py)")
    p.add_argument("--bandwidth", default="", help="LEVEL=FACTOR,...: inter-node bandwidth of a placement spanning "
                   "that level, as a factor of the fitted one, e.g. cluster=0.25 (across racks a quarter of in-rack)")
    p.add_argument("--topology-interleaved", action="store_true",
                   help="node i in the i-th coarsest group round-robin (node order tells nothing of the topology)")
    p.add_argument("--topology-flat", action="store_true",
                   help="place as if there were no topology (the links are still priced by what they span)")
    p.add_argument("--cluster-file", help='JSON: {"cluster": "16x8", "topology": {"rack": 4}, "bandwidth": {...}} '
                   'or "paths": [...] (sim/topology.py)')
    p.add_argument("--interval", type=float, default=60.0, help="seconds between scheduling rounds (default 60)")
    p.add_argument("--restart-cost", type=_restart_cost, default="measured",
                   help="seconds lost per (re)start, or 'measured' (default): the per-job model fitted to "
                        "measured plan switches (perfmodel/restart.py); Rubick's artifact used 260")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.05, help="log-normal sigma of ground truth where unmeasured")
    p.add_argument("--unmeasured-slowdown", type=float, default=1.0,
                   help="multiply ground-truth step time where nothing was measured (robustness check; default 1)")
    p.add_argument("--regime", choices=("measured", "extended"), default="measured",
                   help="measured (default): policies may choose only measured configurations or the job's "
                        "request; extended: any configuration, truth from an independent source where "
                        "nothing was measured (sim/README.md)")
    p.add_argument("--systematic", type=_nonneg, default=0.15,
                   help="extended truth: log-normal sigma of the error per (model, plan family) (default 0.15)")
    p.add_argument("--distance-slowdown", type=_nonneg, default=0.10,
                   help="extended truth: slower by this per unit of distance from measured configurations (0.10)")
    p.add_argument("--headroom", type=_fraction, default=0.10,
                   help="extended truth: out of memory when the independent estimate leaves less of the GPU free (0.10)")
    p.add_argument("--declared-noise", type=_at_least_one, default=1.0, metavar="K",
                   help="declared steps become an upper bound: true x a seeded log-uniform factor in [1, K); "
                        "policies see the declaration, jobs finish at their true steps (default 1: exact)")
    p.add_argument("--no-learning", action="store_true",
                   help="policies' oracle does not learn from what runs (ablation)")
    p.add_argument("--measured-targets", action="store_true",
                   help="give policies each guaranteed job's measured request speed as its target "
                        "(default: policies predict the request with the model)")
    p.add_argument("--jobs", type=int, help="only the first N jobs of the trace")
    p.add_argument("--horizon", type=float, help="stop at this simulated time (s); the rest is reported unfinished")
    p.add_argument("--no-event-rounds", action="store_true",
                   help="schedule only on the interval grid (Blox semantics), not on arrival/completion")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--per-job-csv", help="write one row per job and policy here")
    p.add_argument("--plots", help="write PNG plots (JCT CDF, GPU utilisation, queue length) into this folder")
    p.add_argument("--perfmodel", choices=("auto", "off"), default="auto",
                   help="auto: the fitted performance model is the policies' belief and the ground truth "
                        "where nothing was measured (if perfmodel provides one); off: tables and scaling only")
    p.add_argument("--no-progress", action="store_true", help="no progress line even on a terminal")
    p.add_argument("--policy-options", type=_policy_options, default={},
                   help='JSON keyword options for every policy, as the optimizer\'s --policy-options, e.g. '
                        '\'{"backfill": true}\' (FIFO) or \'{"sharing": {"queues": {"a": {"quota": 32, "weight": 2, '
                        '"cohort": "all"}}, "half_life": 21600}}\' (policies/sharing.py)')
    return p


def _restart_label(args: argparse.Namespace) -> str:
    if args.restart_cost == "measured":
        return f"measured model (mean {args.restart_cost_s:.0f} s)"
    return f"{args.restart_cost:g} s"


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _at_least_one(text: str) -> float:
    v = _nonneg(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _fraction(text: str) -> float:
    v = _nonneg(text)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return v


def _restart_cost(text: str) -> str | float:
    if text == "measured":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of seconds nor 'measured'") from None
    if value < 0:
        raise argparse.ArgumentTypeError("restart cost must be >= 0 seconds")
    return value


def _policy_options(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--policy-options: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--policy-options: expected a JSON object")
    return value


def make_named_policy(name: str, seed: int, restart_cost: float, options: dict | None = None, restart_model=None):
    """``policies.registry.make_policy`` with the run's restart cost and seed, for the
    policies that take them (a policy that charges restarts must know their price;
    ``restart_model``, JobSpec -> s, tells those that charge each job its own),
    plus ``options`` (``--policy-options``: sharing, backfill)."""
    from gearshift.policies.registry import make_policy

    opts = {"restart_cost": restart_cost, "seed": seed, **(options or {})}
    if restart_model is not None:
        opts["restart_model"] = restart_model
    while True:
        try:
            return make_policy(name, **opts)
        except TypeError as e:
            dropped = [k for k in opts if (repr(k) in str(e) or f"'{k}'" in str(e)) and k in ("restart_cost", "seed", "restart_model")]
            if not dropped:  # an option the user gave that this policy does not take
                import re

                m = re.search(r"keyword argument '([^']+)'", str(e))
                what = f"no option {m.group(1)!r}" if m else f"these options ({e})"
                raise ValueError(f"--policy-options: policy {name!r} takes {what}") from None
            for k in dropped:
                opts.pop(k)


def _progress_printer(policy: str, total_jobs: int):
    def show(t: float, done: int, n: int) -> None:
        width = 30
        fill = int(width * done / max(n, 1))
        sys.stderr.write(f"\r{policy:>12} [{'#' * fill}{'.' * (width - fill)}] {done}/{n} jobs, t={t / 3600:7.1f} h")
        sys.stderr.flush()

    return show


def ratios(summaries: list[dict]) -> dict[str, dict[str, float]]:
    """Per policy: best baseline's avg JCT / its avg JCT, same for makespan (>1 = better).

    Baselines are the policies not named ``rubick*``; if every policy run is a
    baseline (or none is), each is compared with the best of all.
    """
    base = [s for s in summaries if not s["policy"].startswith("rubick")] or summaries
    out = {}
    for key, name in (("avg_jct_s", "jct_x"), ("makespan_s", "makespan_x")):
        vals = [s[key] for s in base if s["unfinished"] == 0 and not math.isnan(s[key])]
        best = min(vals) if vals else math.nan
        for s in summaries:
            v = s[key]
            # A policy that left jobs unfinished has no comparable average: its
            # finished jobs alone would flatter it (the ratio is left undefined).
            ok = v and not math.isnan(v) and not math.isnan(best) and s["unfinished"] == 0
            out.setdefault(s["policy"], {})[name] = best / v if ok else math.nan
    return out


def _h(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 3600:.2f}"


def format_table(summaries: list[dict], rat: dict) -> str:
    head = ["policy", "avgJCT h", "medJCT h", "p99JCT h", "makespan h", "queue h", "util %",
            "reconf", "restartGPUh", "guar kept", "unfin", "meas %", "JCT x", "mksp x", "wall s"]
    rows = []
    for s in summaries:
        r = rat.get(s["policy"], {})
        guar = f"{s['guarantees_kept']}/{s['guaranteed_accepted']}" if s["guaranteed_jobs"] else "-"
        rows.append([s["policy"], _h(s["avg_jct_s"]), _h(s["median_jct_s"]), _h(s["p99_jct_s"]), _h(s["makespan_s"]),
                     _h(s["avg_queue_delay_s"]), f"{100 * s['gpu_util']:.1f}", str(s["reconfigurations"]),
                     f"{s['restart_lost_gpu_h']:.1f}", guar, str(s["unfinished"]),
                     "-" if math.isnan(s["measured_share"]) else f"{100 * s['measured_share']:.0f}",
                     "-" if math.isnan(r.get("jct_x", math.nan)) else f"{r['jct_x']:.2f}",
                     "-" if math.isnan(r.get("makespan_x", math.nan)) else f"{r['makespan_x']:.2f}",
                     f"{s['wall_s']:.1f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _clean(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def run(args: argparse.Namespace) -> tuple[list[SimResult], list[dict], dict]:
    if args.trace:
        trace = load_named(args.trace, seed=args.seed)
    else:
        if not args.format:
            raise ValueError("--trace-file needs --format (" + "|".join(FORMATS) + ")")
        trace = load_trace_file(args.trace_file, args.format)
    if args.jobs:
        trace = trace.head(args.jobs)
    topo = None
    if args.cluster_file:
        text, topo = load_cluster_file(args.cluster_file, (parse_cluster(args.cluster) if args.cluster
                                                           else trace.cluster).nodes)
        args.cluster = args.cluster or text
    cluster = parse_cluster(args.cluster) if args.cluster else trace.cluster
    if args.topology:
        topo = SimTopology.split(cluster.nodes, args.topology, args.bandwidth,
                                 interleaved=args.topology_interleaved)
    elif topo is not None and args.bandwidth:
        topo.links = parse_factors(args.bandwidth)
    if topo is not None:
        topo.aware = not args.topology_flat
    restart_model = None
    restart_cost = args.restart_cost
    if restart_cost == "measured":
        from gearshift.perfmodel.restart import restart_seconds

        restart_model = restart_seconds
        # policies charge one price per restart: the model's mean over this trace
        restart_cost = sum(restart_seconds(j.spec) for j in trace.jobs) / max(1, len(trace.jobs))
    args.restart_cost_s = restart_cost
    args.cfg_topology = topo
    cfg = SimConfig(interval=args.interval, restart_cost=restart_cost, restart_model=restart_model,
                    seed=args.seed, noise=args.noise,
                    horizon=args.horizon, unmeasured_slowdown=args.unmeasured_slowdown, measured_targets=args.measured_targets, round_on_arrival=not args.no_event_rounds,
                    round_on_completion=not args.no_event_rounds, regime=args.regime, systematic=args.systematic,
                    distance_slowdown=args.distance_slowdown, headroom=args.headroom, learn=not args.no_learning,
                    declared_noise=args.declared_noise, topology=topo)
    from gearshift.sim.perfmodel_bridge import find_predictor

    predictor = find_predictor(cluster.gpus_per_node) if args.perfmodel == "auto" else None
    truth_predictor = find_predictor(cluster.gpus_per_node, "in_sample") if predictor is not None else None
    tty = sys.stderr.isatty() and not args.no_progress
    results = []
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        policy = make_named_policy(name, args.seed, restart_cost, args.policy_options, restart_model)
        res = simulate(trace, policy, cluster, cfg, predictor, _progress_printer(name, len(trace.jobs)) if tty else None,
                       truth_predictor=truth_predictor)
        res.policy = name
        if tty:
            sys.stderr.write("\r" + " " * 78 + "\r")
        results.append(res)
    summaries = [summarize(r) for r in results]
    return results, summaries, ratios(summaries)


@contextlib.contextmanager
def stdout_to_stderr(on: bool):
    """While policies run, what native code writes to file descriptor 1 goes to stderr:
    HiGHS (Sia's MILP) prints solver notes there whatever ``disp`` says, and ``-o json``
    must be JSON alone."""
    if not on:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (embedded): nothing to protect
        yield
        return
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        _flush_c_stdio()  # what native code buffered meanwhile goes where it was written: stderr
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: the C library's buffered output, written out now (HiGHS prints
    through it; flushed later, at a worker's exit, its notes landed on stdout)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask: nothing buffered there
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with stdout_to_stderr(args.output == "json"):
            results, summaries, rat = run(args)
    except (ValueError, OSError) as e:
        print(f"gearshift simulate: {e}", file=sys.stderr)
        return 2
    if args.per_job_csv:
        write_per_job_csv(results, args.per_job_csv)
    if args.plots:
        from gearshift.sim.plots import write_plots

        write_plots(results, args.plots)
    if args.output == "json":
        r0 = results[0] if results else None
        doc = {
            "trace": r0.trace if r0 else None,
            "cluster": r0.cluster.label() if r0 else None,
            "config": {"interval": args.interval, "restart_cost": args.restart_cost, "restart_cost_charged_s": args.restart_cost_s,
                       "seed": args.seed,
                       "noise": args.noise, "event_rounds": not args.no_event_rounds,
                       "unmeasured_slowdown": args.unmeasured_slowdown, "perfmodel": args.perfmodel,
                       "regime": args.regime, "systematic": args.systematic,
                       "distance_slowdown": args.distance_slowdown, "headroom": args.headroom,
                       "learning": not args.no_learning, "policy_options": args.policy_options,
                       "declared_noise": args.declared_noise,
                       "topology": args.cfg_topology.label() if args.cfg_topology is not None else None},
            "results": summaries,
            "ratios_vs_best_baseline": rat,
            # per policy against the best baseline: averages, medians, per-job geometric mean,
            # per model class, makespan (sim/compare.py)
            "vs_best_baseline": compare(results, summaries),
        }
        print(json.dumps(_clean(doc), indent=2))
    else:
        r0 = results[0] if results else None
        if r0:
            print(f"trace {r0.trace}: {len(r0.records)} jobs on {r0.cluster.label()} "
                  f"({r0.cluster.gpus} GPUs), rounds every {args.interval:g} s, restart {_restart_label(args)}, seed {args.seed}, "
                  f"regime {args.regime}")
        print(format_table(summaries, rat))
        print("JCT x / mksp x: best baseline's value / this policy's (higher is better; baselines = policies not named rubick*);"
              " meas %: allocations whose speed was measured, the rest from the performance model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
