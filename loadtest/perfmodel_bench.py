"""Predictions per second of the throughput model on 100,000 candidates,
numpy reference vs numba kernel, in one run.

    python -m loadtest.perfmodel_bench [--json] [-n 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np


def _candidates(n: int, seed: int = 0):
    from gearshift.perfmodel.plans import PlanArray, ResourceArray, Resources, enumerate_plans
    from gearshift.perfmodel.rubick import rubick_shape

    shape = rubick_shape("gpt2")
    parts, res = [], []
    for pl in ("1", "2", "4", "8", "44", "35", "2222", "88", "8888", "11111111", "88888888"):
        for threads in (1.0, 2.0, 4.0, 8.0):
            r = Resources.from_placement(pl, threads)
            pa = enumerate_plans(shape, 16, r)
            parts.append(pa)
            res.append(ResourceArray.broadcast(r, len(pa)))
    pool = PlanArray.concat(parts)
    rpool = ResourceArray(*[np.concatenate([getattr(r, c) for r in res]) for c in ResourceArray.__slots__])
    idx = np.random.default_rng(seed).integers(0, len(pool), size=n)
    return shape, pool.take(idx), rpool.take(idx)


def run(n: int = 100_000, repeat: int = 5) -> dict:
    from gearshift.perfmodel.catalog import fitted_model_for
    from gearshift.perfmodel.kernels import iteration_time_ms_numba, warm_up
    from gearshift.perfmodel.model import iteration_time_ms, shape_consts

    shape, plans, res = _candidates(n)
    params = fitted_model_for("gpt2")
    consts = shape_consts(shape)
    t0 = time.perf_counter()
    warm_up()
    warm_s = time.perf_counter() - t0

    def best(fn):
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            out = fn(params.theta, params.cluster, consts, plans, res)
            times.append(time.perf_counter() - t)
        return min(times), out

    import numba

    t_np, a = best(iteration_time_ms)
    t_nb, b = best(iteration_time_ms_numba)  # what predict() uses: serial or parallel by size and threads
    t_ser, c = best(lambda *args: iteration_time_ms_numba(*args, parallel=False))
    t_par, d = best(lambda *args: iteration_time_ms_numba(*args, parallel=True))
    return {
        "candidates": n,
        "repeat": repeat,
        "numpy_s": t_np,
        "numba_s": t_nb,
        "numpy_per_s": n / t_np,
        "numba_per_s": n / t_nb,
        "speedup": t_np / t_nb,
        "numba_serial_s": t_ser,
        "speedup_serial": t_np / t_ser,
        "numba_parallel_s": t_par,
        "speedup_parallel": t_np / t_par,
        "numba_threads": numba.get_num_threads(),
        "max_rel_diff": float(max(np.max(np.abs(a - x) / a) for x in (b, c, d))),
        "numba_warm_up_s": warm_s,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.perfmodel_bench")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-n", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    rep = run(args.n, args.repeat)
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"{rep['candidates']} candidates: numpy {rep['numpy_per_s']:,.0f}/s, numba {rep['numba_per_s']:,.0f}/s "
              f"({rep['speedup']:.1f}x; serial kernel {rep['speedup_serial']:.1f}x, parallel "
              f"{rep['speedup_parallel']:.1f}x on {rep['numba_threads']} threads), "
              f"max rel diff {rep['max_rel_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
