"""What the optimizer hands its policy: job views built from records, and a
performance oracle fed with the fitted models in KV ``gs_models``.

Kept apart from ``optimizer.py`` so the service stays a thin shell: the
policy sees the same ``JobView``/``PerfOracle`` shapes the simulator gives it.
"""

from __future__ import annotations

from typing import Any

from bus_schema.messages import ACTIVE_STATES as ACTIVE, JobRecord
from policies import JobView, Placement

from .jobstore import kv_snapshot



def job_view(rec: JobRecord, now: float) -> JobView:
    """The policy's view of one job; running jobs carry their holding."""
    running = rec.state in ACTIVE
    placement = tuple(Placement(p.node, len(p.gpus), p.cpus) for p in rec.placement) if running else ()
    # GPU-seconds received: finished segments are not tracked one by one in
    # the record, so this counts the current segment plus a lower bound for
    # earlier ones from the steps done (enough for LAS/Tiresias ordering).
    held = sum(p.gpus for p in placement)
    since = rec.scheduled_at if running and rec.scheduled_at else None
    attained = held * max(0.0, now - since) if since else 0.0
    return JobView(
        job_id=rec.job_id,
        spec=rec.spec,
        submitted_at=rec.submitted_at,
        steps_done=rec.steps_done,
        placement=placement,
        plan=rec.plan if running else None,
        attained_service=attained,
        restarts=rec.restarts,
        last_switch_at=(rec.scheduled_at if running else None),
        started_at=rec.started_at,
    )


class ModelOracle:
    """A ``PerfModelOracle`` whose parameters follow ``gs_models``.

    Falls back to perfmodel's own parameters (the shipped Rubick fits, or the
    nearest one scaled) for models that were never profiled.
    """

    def __init__(self, models_kv: Any):
        from policies.oracle import PerfModelOracle

        self.kv = models_kv
        self.oracle = PerfModelOracle()
        self._revisions: dict[str, int] = {}

    async def refresh(self, records: list[JobRecord]) -> int:
        """Load parameters that changed since the last round; returns how many."""
        import msgspec

        import perfmodel
        from perfmodel.model import PerfParams

        from .perfmodel_service import kv_key

        snap = await kv_snapshot(self.kv)
        loaded = 0
        for rec in records:
            name = rec.spec.model.name
            key = kv_key(perfmodel.shape_from_spec(rec.spec.model).key)
            got = snap.get(key)
            if got is None or self._revisions.get(name) == got[1]:
                continue
            self.oracle.set_params(name, PerfParams.from_dict(msgspec.json.decode(got[0])))
            self._revisions[name] = got[1]
            loaded += 1
        return loaded
