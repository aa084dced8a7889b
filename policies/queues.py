"""Tenant queues and fair share: the data parts of cluster sharing (issue 13).

- ``Queue``: a tenant's nominal GPU quota, weight, cohort, borrowing limit
  (how far past its quota it may go on the cohort's unused quota) and lending
  limit (how much of its own unused quota others may borrow). Kueue's
  ClusterQueue/cohort model, reduced to GPUs.
- ``ShareConfig``: the queues plus the fair-share half-life, the starvation
  limit and the minimum run time; parsed from plain data (the cluster config,
  ``--policy-options``, the ``gs_queues`` bucket) with an error naming the
  field for bad input.
- ``QuotaBook``: per round, what each tenant holds and may still take.
  An owner's demand within its own quota is *claimed* before anyone may
  borrow it, so lent GPUs are exactly what owners do not want now.
- ``FairShare``: usage decayed with a half-life (Slurm's fair-share memory),
  normalised by weight: the smaller, the sooner a tenant's work goes.

Pure: no NATS, no clock (callers pass ``now``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

UNLIMITED = 1 << 30


class ShareConfigError(ValueError):
    """Bad sharing configuration; the message names the field."""


@dataclass(frozen=True, slots=True)
class Queue:
    tenant: str
    quota: int
    weight: float = 1.0
    cohort: str = ""  # "" = a cohort of its own (no borrowing, no lending)
    borrow_limit: int | None = None  # None: as much as the cohort lends
    lend_limit: int | None = None  # None: all of its unused quota

    def to_dict(self) -> dict:
        return {"tenant": self.tenant, "quota": self.quota, "weight": self.weight, "cohort": self.cohort,
                "borrow_limit": self.borrow_limit, "lend_limit": self.lend_limit}


def _int(d: dict, key: str, where: str, default=None, allow_none: bool = False):
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise ShareConfigError(f"{where}.{key}: expected a whole number >= 0, got {v!r}")
    return int(v)


def _num(d: dict, key: str, where: str, default, *, positive: bool = True, allow_none: bool = False):
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ShareConfigError(f"{where}.{key}: expected a number > 0, got {v!r}")
    return float(v)


_QUEUE_KEYS = {"quota", "weight", "cohort", "borrow_limit", "lend_limit", "tenant"}
_TOP_KEYS = {"queues", "half_life", "starvation_wait", "min_run_time"}


def queue_from_dict(tenant: str, d: dict, where: str = "queues") -> Queue:
    where = f"{where}.{tenant}"
    if not isinstance(d, dict):
        raise ShareConfigError(f"{where}: expected an object with quota/weight/cohort, got {type(d).__name__}")
    unknown = set(d) - _QUEUE_KEYS
    if unknown:
        raise ShareConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(_QUEUE_KEYS))}")
    if "quota" not in d:
        raise ShareConfigError(f"{where}.quota: required")
    cohort = d.get("cohort", "")
    if not isinstance(cohort, str):
        raise ShareConfigError(f"{where}.cohort: expected a name, got {cohort!r}")
    return Queue(tenant, _int(d, "quota", where), _num(d, "weight", where, 1.0), cohort,
                 _int(d, "borrow_limit", where, allow_none=True), _int(d, "lend_limit", where, allow_none=True))


@dataclass(frozen=True, slots=True)
class ShareConfig:
    queues: dict[str, Queue] = field(default_factory=dict)
    half_life: float = 6 * 3600.0  # fair-share memory
    starvation_wait: float | None = 4 * 3600.0  # a job waiting longer is served before its share says
    min_run_time: float = 600.0  # preemption (other than reclaim) waits this long after a (re)start

    @classmethod
    def from_dict(cls, d: dict | None) -> "ShareConfig":
        d = d or {}
        if not isinstance(d, dict):
            raise ShareConfigError(f"sharing: expected an object, got {type(d).__name__}")
        unknown = set(d) - _TOP_KEYS
        if unknown:
            raise ShareConfigError(f"sharing: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(_TOP_KEYS))}")
        raw = d.get("queues", {})
        if isinstance(raw, list):  # [{"tenant": "a", ...}]
            raw = {q.get("tenant") if isinstance(q, dict) else None: q for q in raw}
        if not isinstance(raw, dict) or any(not isinstance(k, str) or not k for k in raw):
            raise ShareConfigError("queues: expected {tenant: {quota, weight, cohort, ...}}")
        queues = {t: queue_from_dict(t, {k: v for k, v in q.items() if k != "tenant"} if isinstance(q, dict) else q)
                  for t, q in raw.items()}
        return cls(queues, _num(d, "half_life", "sharing", 6 * 3600.0),
                   _num(d, "starvation_wait", "sharing", 4 * 3600.0, allow_none=True),
                   _num(d, "min_run_time", "sharing", 600.0, positive=False))

    def with_queue(self, q: Queue) -> "ShareConfig":
        return replace(self, queues={**self.queues, q.tenant: q})

    def to_dict(self) -> dict:
        return {"queues": {t: {k: v for k, v in q.to_dict().items() if k != "tenant"} for t, q in self.queues.items()},
                "half_life": self.half_life, "starvation_wait": self.starvation_wait,
                "min_run_time": self.min_run_time}

    def queue(self, tenant: str) -> Queue:
        """A tenant without a queue has no quota limit and weight 1 (it shares only by fair share)."""
        q = self.queues.get(tenant)
        return q if q is not None else Queue(tenant, UNLIMITED)


class QuotaBook:
    """What tenants use and may take in one round.

    ``use``: GPUs of running jobs plus what this round already admitted.
    ``claim(t, g)`` admits within ``t``'s own nominal quota; owners claim
    before anyone borrows, so what is lent is what owners do not want now.
    ``borrow(t, g)`` admits past the quota while the cohort's unused,
    lendable quota (minus what members already borrow) and ``t``'s borrowing
    limit allow.
    """

    def __init__(self, cfg: ShareConfig, held: dict[str, int]):
        self.cfg = cfg
        self.use = dict(held)

    def quota(self, t: str) -> int:
        return self.cfg.queue(t).quota

    def borrowed(self, t: str) -> int:
        return max(0, self.use.get(t, 0) - self.quota(t))

    def members(self, cohort: str) -> list[str]:
        return sorted(t for t, q in self.cfg.queues.items() if cohort and q.cohort == cohort)

    def lendable(self, t: str) -> int:
        q = self.cfg.queue(t)
        free = max(0, q.quota - self.use.get(t, 0))
        return free if q.lend_limit is None else min(free, q.lend_limit)

    def borrowable(self, t: str) -> int:
        """How many more GPUs past its quota ``t`` may take now."""
        q = self.cfg.queue(t)
        if q.quota >= UNLIMITED:
            return UNLIMITED
        cohort = self.members(q.cohort)
        # what the others lend, less what the whole cohort (t included) borrows already
        room = max(0, sum(self.lendable(m) for m in cohort if m != t) - sum(self.borrowed(m) for m in cohort))
        if q.borrow_limit is not None:
            room = min(room, max(0, q.borrow_limit - self.borrowed(t)))
        return room

    def within_quota(self, t: str, gpus: int) -> bool:
        return self.use.get(t, 0) + gpus <= self.quota(t)

    def claim(self, t: str, gpus: int) -> bool:
        if not self.within_quota(t, gpus):
            return False
        self.add(t, gpus)
        return True

    def borrow(self, t: str, gpus: int) -> bool:
        need = self.use.get(t, 0) + gpus - self.quota(t)
        if need > 0 and need - self.borrowed(t) > self.borrowable(t):
            return False
        self.add(t, gpus)
        return True

    def add(self, t: str, gpus: int) -> None:
        self.use[t] = self.use.get(t, 0) + gpus

    def over_limit(self) -> list[str]:
        """Borrowing tenants whose cohort lends less than its members borrow, or
        past their own borrowing limit (checked on a round's final holdings)."""
        out = []
        for t in sorted(self.use):
            b = self.borrowed(t)
            q = self.cfg.queue(t)
            if b == 0 or q.quota >= UNLIMITED:
                continue
            cohort = self.members(q.cohort)
            lent = sum(self.lendable(m) for m in cohort)
            if not cohort or sum(self.borrowed(m) for m in cohort) > lent or (
                    q.borrow_limit is not None and b > q.borrow_limit):
                out.append(t)
        return out


class FairShare:
    """Per-tenant usage (GPU-seconds) decayed with a half-life.

    ``update(now, held)`` integrates ``held`` GPUs since the last update under
    the decay (exact for a constant holding); ``standing(t)`` is usage /
    weight, normalised so the best-served tenant has the largest number.
    State is plain data (``state()``/``load()``) so a service can keep it.
    """

    def __init__(self, half_life: float):
        self.half_life = half_life
        self.usage: dict[str, float] = {}
        self.at: float | None = None

    def update(self, now: float, held: dict[str, int]) -> None:
        if self.at is None or now <= self.at:
            self.at = now if self.at is None else self.at
            return
        dt = now - self.at
        k = math.log(2) / self.half_life
        decay = math.exp(-k * dt)
        gain = (1 - decay) / k  # integral of the decay over dt, per GPU
        for t in set(self.usage) | set(held):
            self.usage[t] = self.usage.get(t, 0.0) * decay + held.get(t, 0) * gain
        self.at = now

    def standing(self, t: str, weight: float) -> float:
        return self.usage.get(t, 0.0) / weight

    def state(self) -> dict:
        return {"usage": dict(self.usage), "at": self.at}

    def load(self, state: dict) -> None:
        self.usage = {str(k): float(v) for k, v in state.get("usage", {}).items()}
        self.at = state.get("at")


def entitlement(demand: dict[str, int], weight: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` over ``demand`` (water-filling)."""
    out = {t: 0.0 for t in demand}
    left = {t for t, d in demand.items() if d > 0}
    cap = float(capacity)
    while left and cap > 1e-9:
        wsum = sum(weight[t] for t in left)
        fill = {t: cap * weight[t] / wsum for t in left}
        done = {t for t in left if demand[t] - out[t] <= fill[t]}
        if not done:
            for t in left:
                out[t] += fill[t]
            break
        for t in done:
            cap -= demand[t] - out[t]
            out[t] = float(demand[t])
        left -= done
    return out


def most_gpus(cfg: ShareConfig, tenant: str) -> int:
    """The most GPUs ``tenant`` could ever hold: its quota plus what its cohort could
    lend if nobody else used anything (``UNLIMITED`` for a tenant without a queue)."""
    q = cfg.queues.get(tenant)
    if q is None or q.quota >= UNLIMITED:
        return UNLIMITED
    lend = sum(o.quota if o.lend_limit is None else min(o.quota, o.lend_limit)
               for o in cfg.queues.values() if q.cohort and o.cohort == q.cohort and o.tenant != tenant)
    if q.borrow_limit is not None:
        lend = min(lend, q.borrow_limit)
    return q.quota + lend


def fair_entitlement(cfg: ShareConfig, demand: dict[str, int], capacity: float) -> dict[str, float]:
    """Each tenant's fair share of ``capacity`` GPUs now: weighted max-min (water-filling
    by queue weight) over what its live jobs ask for, each tenant capped by its demand
    and by the most its queue may hold. The one definition both ``Shared`` enforces
    and ``loadtest.fairness`` measures against."""
    capped = {t: min(d, most_gpus(cfg, t)) for t, d in demand.items()}
    return entitlement(capped, {t: cfg.queue(t).weight for t in demand}, capacity)
