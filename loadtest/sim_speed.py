"""Simulator speed on Blox's own workload: the load-8 job list under FIFO.

Same setup as Blox's baseline run (blox.md §4): 128 one-GPU slots as 32 nodes x 4,
300 s rounds on a fixed grid (no rounds on arrival/completion), no restart cost,
FIFO, run until every tracked job (ids 3000-4000) has finished. Blox's own simulator
took 7.4 minutes for this; the target here is under 10 s.

    python -m loadtest.sim_speed [--json] [--policy fifo] [--trace rubick-base]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

BLOX_SECONDS = 7.4 * 60


def blox_load8(policy_name: str = "fifo") -> dict:
    from gearshift.policies.registry import make_policy
    from gearshift.sim import SimConfig, load_named, simulate, summarize

    t0 = time.perf_counter()
    trace = load_named("blox-load8")
    load_s = time.perf_counter() - t0
    cfg = SimConfig(interval=300, restart_cost=0, noise=0, round_on_arrival=False, round_on_completion=False)
    t1 = time.perf_counter()
    c1 = time.process_time()
    res = simulate(trace, make_policy(policy_name), config=cfg)
    sim_s = time.perf_counter() - t1
    cpu_s = time.process_time() - c1
    s = summarize(res)
    return {
        "benchmark": "blox-load8", "policy": policy_name, "cluster": "32x4", "interval_s": 300, "restart_cost_s": 0,
        "tracked_jobs": s["jobs"], "tracked_finished": s["finished"],
        "jobs_arrived": sum(1 for r in res.records if r.state is not None),
        "rounds": res.rounds, "events": res.events, "sim_time_h": res.end_time / 3600,
        "avg_jct_h": s["avg_jct_s"] / 3600, "gpu_util": s["gpu_util"],
        "load_s": round(load_s, 3), "simulate_s": round(sim_s, 3), "simulate_cpu_s": round(cpu_s, 3),
        "total_s": round(load_s + sim_s, 3),
        "blox_s": BLOX_SECONDS, "speedup_vs_blox": round(BLOX_SECONDS / (load_s + sim_s), 1),
        "target_s": 10, "ok": load_s + sim_s < 10,
    }


def named_trace(trace_name: str, policy_name: str) -> dict:
    from gearshift.policies.registry import make_policy
    from gearshift.sim import SimConfig, load_named, simulate, summarize

    t0 = time.perf_counter()
    res = simulate(load_named(trace_name), make_policy(policy_name), config=SimConfig())
    wall = time.perf_counter() - t0
    s = summarize(res)
    return {"benchmark": trace_name, "policy": policy_name, "jobs": s["jobs"], "finished": s["finished"],
            "rounds": res.rounds, "events": res.events, "total_s": round(wall, 3),
            "target_s": 60, "ok": wall < 60}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--policy", default="fifo")
    p.add_argument("--trace", help="instead of the Blox check, time a named trace (e.g. rubick-base) at defaults")
    args = p.parse_args(argv)
    out = named_trace(args.trace, args.policy) if args.trace else blox_load8(args.policy)
    out["python"] = platform.python_version()
    out["machine"] = platform.machine()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>18}: {v}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
