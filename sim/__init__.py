"""Trace-driven discrete-event simulator for gearshift policies (pure: no NATS).

    from gearshift.sim import load_named, simulate, SimConfig, summarize
    res = simulate(load_named("rubick-base"), make_policy("fifo"), config=SimConfig(seed=1))
    print(summarize(res))

See sim/README.md for the model, the trace mappings and every ground-truth fallback.
"""

from gearshift.sim.engine import InvariantError, SimConfig, SimResult, Simulator, simulate
from gearshift.sim.loaders import load_named, load_trace_file, trace_names
from gearshift.sim.metrics import per_job_rows, summarize, write_per_job_csv
from gearshift.sim.trace import ClusterSpec, Trace, TraceJob, parse_cluster

__all__ = [
    "ClusterSpec", "InvariantError", "SimConfig", "SimResult", "Simulator", "Trace", "TraceJob",
    "load_named", "load_trace_file", "parse_cluster", "per_job_rows", "simulate", "summarize",
    "trace_names", "write_per_job_csv",
]
