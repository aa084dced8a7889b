"""Named policies, registered in one place.

``make_policy(name, **options)``; every policy accepts ``restart_cost`` and
``min_run_time`` (seconds) so callers can pass one set of options to all.
"""

from __future__ import annotations

from typing import Callable

from .api import Policy

_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy]) -> None:
    _REGISTRY[name] = factory


def make_policy(name: str, **options) -> Policy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**options)


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _builtin() -> None:
    from .fifo import Fifo
    from .priority import Tiresias, make_antman, make_las, make_srtf
    from .rubick import Rubick

    def fifo(restart_cost: float = 0.0, min_run_time: float = 0.0, **kw):
        return Fifo(**kw)

    register("fifo", fifo)
    register("las", make_las)
    register("srtf", make_srtf)
    register("tiresias", Tiresias)
    register("antman", make_antman)
    register("rubick", lambda **kw: Rubick(name="rubick", **kw))
    register("rubick-n", lambda **kw: Rubick(name="rubick-n", vary_plan=False, **kw))
    register("rubick-r", lambda **kw: Rubick(name="rubick-r", vary_cpu=False, vary_locality=False, **kw))
    try:
        from .sia import Sia

        register("sia", Sia)
    except ImportError:
        pass
    try:
        from .synergy import Synergy

        register("synergy", Synergy)
    except ImportError:
        pass
    try:
        from .gavel import Gavel

        register("gavel", Gavel)
    except ImportError:
        pass


_builtin()
