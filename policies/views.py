"""Job views kept across rounds, by the optimizer (``services.policy_bridge``) and
the simulator (``sim.views``) alike.

A round hands its policy one ``JobView`` per live job. Building every view again
every round is work proportional to the queue, most of it for jobs nothing
happened to. So a view is built (``make_job_view``, by the caller's ``build``) only
when what it was built from changed, which the caller tells by a *token*: the
record object itself live (a new record per KV revision), the record's version in
the simulator. Otherwise the kept view is refreshed in place, only in what moves
with time, exactly as ``make_job_view`` computes it: a running job's steps done and
its attained service (GPU-seconds of ended allocations + the current one's GPUs x
time since it started). A pending job's view does not move.

Keeping the same view objects also lets policies' caches keyed by a view's parts
(``policies.rubick_problem``) hold while nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gearshift.policies.api import JobView

Kept = tuple  # (token, moves, attained_before, view, gpus, since): see KeptViews


class KeptViews:
    """job id -> (token, moves, attained_before, view, gpus, since): the view built
    from ``token``; ``moves``: its steps done and attained service move with time (it
    runs); ``gpus``/``since``: its placement's GPUs and ``last_switch_at``, 0/None when
    its attained service does not grow (``attained_service``'s terms, kept)."""

    __slots__ = ("_kept", "get")

    def __init__(self) -> None:
        self._set({})

    def _set(self, kept: dict[str, Kept]) -> None:
        self._kept = kept
        # get(job_id) -> the kept entry of ``job_id`` (see the class), None if none is
        # kept: the dict's own lookup, as callers ask it for every running job every round
        self.get = kept.get

    def view(self, job_id: str, token: Any, now: float, steps_done: float, attained_before: float, moves: bool,
             build: Callable[[], JobView]) -> JobView:
        """The view of ``job_id`` at ``now``: the kept one if it was built from ``token``
        (its steps set to ``steps_done`` and attained service to ``now`` if it moves),
        else ``build()``, kept under ``token``."""
        hit = self._kept.get(job_id)
        if hit is None or not (hit[0] is token or hit[0] == token):
            return self.put(job_id, token, moves, attained_before, build())
        return self.refresh(hit, now, steps_done)

    @staticmethod
    def refresh(hit: Kept, now: float, steps_done: float) -> JobView:
        """A kept view (``get``'s entry) at ``now``: if it moves, its steps are
        ``steps_done`` and its attained service what ``attained_service`` (and so
        ``make_job_view``) computes, bit for bit: the same sum and product."""
        v = hit[3]
        if hit[1]:
            v.steps_done = steps_done
            if hit[5] is not None:
                dt = now - hit[5]
                v.attained_service = hit[2] + hit[4] * (dt if dt > 0.0 else 0.0)
        return v

    def put(self, job_id: str, token: Any, moves: bool, attained_before: float, view: JobView) -> JobView:
        """Keep ``view``, built from ``token``."""
        grows = bool(view.placement) and view.last_switch_at is not None
        self._kept[job_id] = (token, moves, attained_before, view, sum(p.gpus for p in view.placement) if grows else 0,
                              view.last_switch_at if grows else None)
        return view

    def drop(self, job_ids: Iterable[str]) -> None:
        """Forget the views of these jobs."""
        for job_id in job_ids:
            self._kept.pop(job_id, None)

    def keep(self, job_ids: set[str] | dict) -> None:
        """Forget the views of jobs not in ``job_ids`` (ended, archived)."""
        if len(self._kept) > len(job_ids):
            self._set({k: v for k, v in self._kept.items() if k in job_ids})

    def __len__(self) -> int:
        return len(self._kept)
