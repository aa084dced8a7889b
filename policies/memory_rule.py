"""What an out-of-memory start teaches about other configurations (``LearningOracle``).

Memory per GPU depends on the plan, not on where it runs, so the rule is per (model,
global batch, GPU type) and plan. It reads the belief's own memory accounting: the
base oracle's ``memory_parts(spec, plans)``, per GPU the weights, gradients,
optimizer state and activations (``perfmodel.memory_parts_gb`` for the fitted
model). It never sees the memory the GPU really used, only the OOM (or the run) and
the belief.

* A configuration observed exactly: the latest observation stands (it ran: it fits;
  it ran out of memory: it does not).
* Otherwise it is ruled out when it needs at least as much of *every* part as a
  configuration that ran out of memory: by the accounting, whatever made the failed
  one too big is there too (fewer ZeRO, tp or pp shards, a lower ZeRO stage, no
  offload, a larger micro-batch, no checkpointing, more micro-batches in flight ...).
* ... unless it needs no more of any part than a configuration that ran: a success
  bounds the rule from above where the accounting ranked wrongly.
* A job's own request (the plan its owner asked for) is ruled out only by an OOM of
  that plan itself, never by inference: a wrong inference must not leave a job with
  no shape it may run in.

Part by part, not by the total (nor by states + activations): a sum ranks
configurations only as far as the accounting's parts are right relative to each
other. The belief credits ZeRO-3 with sharding the weights; if the GPU disagrees, a
ZeRO-3 OOM at a small believed total must not rule out a tensor/pipeline-parallel
plan with a larger total (it keeps more optimizer state but far fewer weights, and
fits): rubick-mt's 48-GPU llama30 requests were starved that way by a two-part rule.

A base without ``memory_parts`` (or one that cannot answer for a model) gets the
layout rule instead: the same (dp, tp, pp, ZeRO, offload), a micro-batch at least as
large, and checkpointing only where the failed plan had it.
"""

from __future__ import annotations

from typing import Any

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.protocols import MemoryModel, supports

TOL_GB = 1e-6  # parts equal to within this are equal


def _covers(big: tuple, small: tuple) -> bool:
    """Does ``big`` need at least as much of every part as ``small``?"""
    return all(b >= s - TOL_GB for b, s in zip(big, small))


def _layout_dominates(pkey: tuple, failed: tuple) -> bool:
    """Normalised plans (learning._norm): same layout, micro-batch >=, no checkpointing
    unless the failed one had it."""
    return pkey[:5] == failed[:5] and pkey[6] >= failed[6] and (failed[7] or not pkey[7])


class OomRule:
    """Keys: ``tm`` = the model (learning._model_of) + (GPU type,); ``pkey`` = the
    normalised plan (learning._norm)."""

    def __init__(self, base: Any):
        self._parts_fn = base.memory_parts if supports(base, MemoryModel) else None
        self._exact: dict[tuple, dict[tuple, bool]] = {}  # tm -> {pkey: fits} (latest observation)
        self._oom: dict[tuple, list[tuple]] = {}  # tm -> [(parts or None, pkey)] that ran out of memory
        self._ran: dict[tuple, list[tuple]] = {}  # tm -> parts that ran (maximal ones)
        # (tm, parts) -> the _ran[tm] it was found covered by (the same list object while nothing is added)
        self._covered: dict[tuple, list[tuple]] = {}
        self._parts: dict[tuple, tuple | None] = {}  # (model, pkey) -> the accounting's parts, GiB
        self._verdict: dict[tuple, dict[tuple, bool]] = {}  # tm -> {pkey: ruled out}

    def has_oom(self, tm: tuple) -> bool:
        return tm in self._oom

    # ------------------------------------------------------------ observations
    def oom(self, spec: JobSpec, tm: tuple, pkey: tuple, plan: Plan) -> bool:
        """An OOM start of (spec, plan) on GPU type tm[-1]; True if any answer changed."""
        was = self.blocked(spec, tm, pkey, plan) if tm in self._oom else False
        self._exact.setdefault(tm, {})[pkey] = False
        if was:  # already ruled out: what needs more than it was ruled out with it
            return False
        parts = self._parts_of(spec, tm, [(pkey, plan)])[0]
        self._oom.setdefault(tm, []).append((parts, pkey))
        self._verdict.pop(tm, None)
        return True

    def ran(self, spec: JobSpec, tm: tuple, pkey: tuple, plan: Plan) -> bool:
        """(spec, plan) trained on GPU type tm[-1]; True if a ruled-out answer changed."""
        exact = self._exact.setdefault(tm, {})
        was = exact.get(pkey)
        exact[pkey] = True
        parts = self._parts_of(spec, tm, [(pkey, plan)])[0]
        relaxes = False
        if parts is not None:
            ran = self._ran.setdefault(tm, [])
            if self._covered.get((tm, parts)) is ran:  # found covered by this very list, unchanged since
                pass
            elif any(_covers(s, parts) for s in ran):
                self._covered[(tm, parts)] = ran
            else:
                # a new list (the old one stays what a remembered coverage was found in)
                ran = self._ran[tm] = [s for s in ran if not _covers(parts, s)] + [parts]
                # it can free a configuration only if it needs at least as much as an OOM did
                relaxes = any(f is not None and _covers(parts, f) for f, _ in self._oom.get(tm, ()))
        if was is False or relaxes:
            self._verdict.pop(tm, None)
            return True
        return False

    # ------------------------------------------------------------ answers
    def blocked(self, spec: JobSpec, tm: tuple, pkey: tuple, plan: Plan, request: tuple | None = None) -> bool:
        return self.blocked_many(spec, tm, [(pkey, plan)], request)[0]

    def blocked_many(self, spec: JobSpec, tm: tuple, items: list[tuple[tuple, Plan]],
                     request: tuple | None = None) -> list[bool]:
        """Is each (normalised plan, plan) ruled out for this model on this GPU type?
        ``request``: the job's own plan, normalised (ruled out only by its own OOM)."""
        if tm not in self._oom:
            return [False] * len(items)
        memo = self._verdict.setdefault(tm, {})
        missing = [(k, p) for k, p in items if k not in memo]
        if missing:
            exact = self._exact.get(tm, {})
            ooms, ran = self._oom[tm], self._ran.get(tm, ())
            for (k, _), parts in zip(missing, self._parts_of(spec, tm, missing)):
                if k in exact:
                    memo[k] = not exact[k]
                elif parts is None:
                    memo[k] = any(_layout_dominates(k, fk) for _, fk in ooms)
                else:
                    memo[k] = (any(_layout_dominates(k, fk) if f is None else _covers(parts, f) for f, fk in ooms)
                               and not any(_covers(s, parts) for s in ran))
        if request is None or request in self._exact.get(tm, ()):
            return [memo[k] for k, _ in items]
        return [memo[k] and k != request for k, _ in items]

    def _parts_of(self, spec: JobSpec, tm: tuple, items: list[tuple[tuple, Plan]]) -> list[tuple | None]:
        """The belief's memory parts per GPU for each plan, remembered."""
        model = tm[:-1]
        want = [(k, p) for k, p in items if (model, k) not in self._parts]
        if want:
            got = None
            if self._parts_fn is not None:
                got = self._parts_fn(spec, [p for _, p in want])
            for i, (k, _) in enumerate(want):
                self._parts[(model, k)] = tuple(float(x) for x in got[i]) if got is not None else None
        return [self._parts[(model, k)] for k, _ in items]
