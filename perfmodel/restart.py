"""What a (re)start of a job costs, from the measured plan switches.

``loadtest.switch_check`` switches the reference workload three times through
a real local cluster and reports each switch by phase. On this project's
machines (2-core CPU, gloo, a 0.9M-parameter model) a switch took 9.8 s on
average: checkpoint 0.48 s, teardown 1.76 s, launch 0.005 s, restore 7.48 s
(interpreter start, ``import torch``, rendezvous, checkpoint load), first step
0.08 s. The constant terms below are those measurements; what grows with the
model is writing and reading its training state, which that tiny model does
not exercise, so it is an assumption stated here: mixed-precision Adam keeps
16 bytes per parameter (fp32 master weights, two moments, 16-bit weights),
written once and read once at ``storage_gbps`` per job.

The simulator uses this as its default restart cost (``--restart-cost
measured``); a plain number there restores a flat cost (Rubick's artifact
charged 260 s for every restart).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartCostModel:
    startup_s: float = 7.48  # measured "restore" phase: process start, import, rendezvous, load
    teardown_s: float = 1.76  # measured: SIGTERM to every rank exited and reported
    checkpoint_fixed_s: float = 0.48  # measured: agreeing on a step and writing a tiny state
    bytes_per_param: float = 16.0  # assumption: mixed-precision Adam training state
    storage_gbps: float = 2.0  # assumption: shared-storage throughput one job gets, GB/s

    def state_gb(self, params_m: float) -> float:
        return params_m * 1e6 * self.bytes_per_param / 1e9

    def seconds(self, params_m: float, step_time: float = 0.0) -> float:
        """Seconds of no progress for one (re)start of a model of ``params_m``
        million parameters: drain, write, start, read, and one step."""
        io = 2.0 * self.state_gb(params_m) / self.storage_gbps
        return self.checkpoint_fixed_s + self.teardown_s + self.startup_s + io + max(0.0, step_time)


MEASURED = RestartCostModel()


def restart_seconds(spec, model: RestartCostModel = MEASURED) -> float:
    """Restart cost of a bus ``JobSpec`` (anything with ``.model.params`` in millions)."""
    return model.seconds(float(spec.model.params), float(getattr(spec, "step_time", 0.0) or 0.0))
