"""Optional capabilities of policies and performance oracles, declared (issue 22).

A policy must have ``schedule`` and ``name`` (``api.Policy``); an oracle must have
``throughput`` (``api.PerfOracle``). What some of them offer besides is declared
here, so a part that uses a capability names the Protocol instead of probing for
an attribute by its name:

- ``supports(obj, Proto)`` answers "does ``obj`` offer ``Proto``" from the members the
  Protocol declares (``hasattr`` on each: what ``isinstance`` on a runtime-checkable
  Protocol does in Python 3.11, some 30x cheaper, so oracles wrapped per call and
  per-job paths may ask it);
- ``isinstance(obj, Proto)`` (all are ``runtime_checkable``) where it runs once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Callable, Protocol, runtime_checkable

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.api import JobView, PerfOracle, Placement

OrderKey = Callable[[JobView, float, PerfOracle | None], tuple]  # smaller runs first


# ---------------------------------------------------------------- oracles
@runtime_checkable
class PlanningOracle(Protocol):
    """Names the candidate plans for a shape (else ``policies.plans.candidate_plans``)."""

    def plans(self, job: JobView, placement: tuple[Placement, ...]) -> Sequence[Plan]: ...


@runtime_checkable
class BatchOracle(Protocol):
    """Answers many plans on one shape at once (else one ``throughput`` call each)."""

    def throughput_many(self, job: JobView, plans: Sequence[Plan], placement: tuple[Placement, ...]) -> Sequence[float]: ...


@runtime_checkable
class KeyedOracle(Protocol):
    """Says what its answers for a spec depend on: jobs of equal keys share cached curves."""

    def spec_key(self, spec: JobSpec) -> Hashable: ...


@runtime_checkable
class RevisedOracle(Protocol):
    """Learns: ``revision`` moves whenever an answer may have changed."""

    revision: int


@runtime_checkable
class TokenedOracle(Protocol):
    """Vouches for its answers: ``answers_token()`` is a hashable that changes
    whenever any answer may change (None: it cannot tell). A policy may remember
    answers while it stays equal (``ordering.RequestSpeeds``)."""

    def answers_token(self) -> Hashable | None: ...


@runtime_checkable
class ObservingOracle(Protocol):
    """Learns from what runs (``policies.learning.LearningOracle``)."""

    def observe(self, job: JobView | JobSpec, plan: Plan, placement: tuple[Placement, ...], *,
                step_time: float | None = None, oom: bool = False) -> bool: ...


@runtime_checkable
class MemoryModel(Protocol):
    """Tells a plan's memory parts (GiB), so an OOM rules out the plans that need more."""

    def memory_parts(self, spec: JobSpec, plans: list[Plan]) -> Any: ...


# ---------------------------------------------------------------- ordering keys
@runtime_checkable
class BatchOrderKey(Protocol):
    """An ordering key that also answers for many jobs at once: ``many(jobs, now, perf)``
    is ``[key(j, now, perf) for j in jobs]``, the same tuples (``classes.by_class``'s
    keys; ``policies.priority`` asks it once per round)."""

    def many(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> list[tuple]: ...


@runtime_checkable
class ClassedBatchKey(Protocol):
    """A base ordering key that answers for many jobs with the class already in front:
    ``many_by_class(jobs, now, perf)`` is ``[by_class(key)(j, now, perf) for j in jobs]``,
    the same tuples (``ordering.SrtfKey``: the oracle's token read once per round)."""

    def many_by_class(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> list[tuple]: ...


@runtime_checkable
class BatchOrder(Protocol):
    """An ordering key that also orders many jobs at once: ``order(jobs, now, perf)`` is
    the positions of ``jobs`` sorted by their keys (``sorted(range(n), key=keys)``), a
    list or a 1-d integer array, or None when it cannot tell (the caller sorts the keys
    itself)."""

    def order(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> Sequence[int] | None: ...


@runtime_checkable
class ClassedBatchOrder(Protocol):
    """A base ordering key that orders many jobs with the class in front:
    ``order_by_class(jobs, now, perf)`` is what ``BatchOrder.order`` is for
    ``by_class(key)``, or None (``ordering.SrtfKey``, on arrays: ``policies.array_order``)."""

    def order_by_class(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> Sequence[int] | None: ...


@runtime_checkable
class SteadyKey(Protocol):
    """An ordering key (with the class in front, ``classes.by_class``) that stays the
    same while a job waits and never rises while it runs, as long as the oracle's
    answers stand: ``keeps_steady()`` (``ordering.SrtfKey``: seconds left at the
    request's speed; a waiting job's steps do not move, a running job's only grow)."""

    def keeps_steady(self) -> bool: ...


# ---------------------------------------------------------------- policies
@runtime_checkable
class SteadyPolicy(Protocol):
    """Settles while nothing moves: ``steady_until()`` is the time before which the same
    jobs, holding what its last decision gave them, on the same nodes, with the oracle's
    answers standing, would get a decision from it that changes nothing (every running
    job kept as it holds, none started, none stopped); -inf when it cannot say. The
    simulator then need not ask it (``sim.engine``)."""

    def steady_until(self) -> float: ...


@runtime_checkable
class BudgetedPolicy(Protocol):
    """Plans within per-tenant GPU budgets, told before each round by ``sharing.Shared``
    (``Rubick``); None: no budgets."""

    def set_budget(self, budget: dict[str, float] | None) -> None: ...


@runtime_checkable
class KeyOrderedPolicy(Protocol):
    """Walks jobs in the order of ``key`` (the priority family, EASY FIFO, synergy):
    ``sharing.Shared`` puts tenants' standing in front of it."""

    key: OrderKey


@runtime_checkable
class TypeAwarePolicy(Protocol):
    """Models GPU types itself (``hetero = True``: Sia, Gavel); others are run once
    per type by ``policies.hetero.ByType``."""

    hetero: bool


@runtime_checkable
class ChargesRestarts(Protocol):
    """Charges every (re)start ``restart_cost`` seconds when it compares options (``api.SchedOptions``)."""

    restart_cost: float


@runtime_checkable
class PinsRuns(Protocol):
    """Does not switch a job that (re)started less than ``min_run_time`` ago (``api.SchedOptions``)."""

    min_run_time: float


def _members(proto: type) -> tuple[str, ...]:
    names = {n for n in vars(proto) if not n.startswith("_")} | set(vars(proto).get("__annotations__", {}))
    return tuple(sorted(names))


_MEMBERS: dict[type, tuple[str, ...]] = {}


def supports(obj: object, proto: type) -> bool:
    """Does ``obj`` offer every member ``proto`` declares?"""
    names = _MEMBERS.get(proto)
    if names is None:
        names = _MEMBERS[proto] = _members(proto)
    for n in names:
        if not hasattr(obj, n):
            return False
    return True
