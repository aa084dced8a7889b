"""Named policies, registered in one place.

``make_policy(name, **options)``; every policy accepts ``restart_cost`` and
``min_run_time`` (seconds) so callers can pass one set of options to all.
"""

from __future__ import annotations

from typing import Callable

from gearshift.policies.api import Policy
from gearshift.policies.protocols import ChargesRestarts, PinsRuns, TypeAwarePolicy

_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy]) -> None:
    _REGISTRY[name] = factory


def make_policy(name: str, **options) -> Policy:
    """Options ``sharing`` (tenant queues, fair share, priorities: ``policies.sharing``)
    and ``backfill`` (FIFO only: EASY backfill) compose sharing parts around any policy."""
    sharing = options.pop("sharing", None)
    backfill = options.pop("backfill", None)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    if backfill is not None and name not in ("fifo", "fifo-easy"):
        raise ValueError(f"backfill: only the FIFO family backfills, not {name!r}")

    def build():
        if name == "fifo" and (backfill is not None or sharing is not None):
            # the key-ordered FIFO (same strict head-of-line order) so sharing can rank its queue
            from gearshift.policies.backfill import EasyFifo

            return EasyFifo(backfill=bool(backfill), restart_cost=options.get("restart_cost", 0.0),
                            name="fifo-easy" if backfill else "fifo")
        return factory(**options)

    policy = build()
    if not (isinstance(policy, TypeAwarePolicy) and policy.hetero):
        # GPU types: one instance per type (policies.hetero); rubick picks types by its model
        from gearshift.policies.hetero import by_type

        policy = by_type(build, policy.name, "model" if name.startswith("rubick") else "balance",
                         restart_cost=(policy.restart_cost if isinstance(policy, ChargesRestarts) else 0.0) or 0.0,
                         min_run_time=(policy.min_run_time if isinstance(policy, PinsRuns) else 0.0) or 0.0,
                         primary=policy)
    if sharing is None or sharing is False:
        return policy
    from gearshift.policies.queues import ShareConfig
    from gearshift.policies.sharing import Shared

    raw = {} if sharing is True else dict(sharing)
    if "min_run_time" not in raw and "min_run_time" in options:
        raw["min_run_time"] = options["min_run_time"]
    return Shared(policy, ShareConfig.from_dict(raw))


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _builtin() -> None:
    from gearshift.policies.fifo import Fifo
    from gearshift.policies.priority import Tiresias, make_antman, make_las, make_srtf
    from gearshift.policies.rubick import Rubick

    def fifo(restart_cost: float = 0.0, min_run_time: float = 0.0, **kw):
        return Fifo(**kw)

    register("fifo", fifo)

    def fifo_easy(restart_cost: float = 0.0, min_run_time: float = 0.0, **kw):
        from gearshift.policies.backfill import EasyFifo

        return EasyFifo(backfill=True, restart_cost=restart_cost, **kw)

    register("fifo-easy", fifo_easy)
    register("las", make_las)
    register("srtf", make_srtf)
    register("tiresias", Tiresias)
    register("antman", make_antman)
    register("rubick", lambda **kw: Rubick(name="rubick", **kw))
    register("rubick-n", lambda **kw: Rubick(name="rubick-n", vary_plan=False, **kw))
    register("rubick-r", lambda **kw: Rubick(name="rubick-r", vary_cpu=False, vary_locality=False, **kw))
    try:
        from gearshift.policies.sia import Sia

        register("sia", Sia)
    except ImportError:
        pass
    try:
        from gearshift.policies.synergy import Synergy

        register("synergy", Synergy)
        # the SRTF base order, as the Synergy paper evaluates it (issue 21)
        register("synergy-srtf", lambda **kw: Synergy(**{"order": "srtf", "name": "synergy-srtf", **kw}))
    except ImportError:
        pass
    from gearshift.policies.optimus import Optimus
    from gearshift.policies.pollux import Pollux

    register("pollux", Pollux)
    register("optimus", Optimus)
    try:
        from gearshift.policies.gavel import Gavel

        register("gavel", Gavel)
    except ImportError:
        pass


_builtin()
