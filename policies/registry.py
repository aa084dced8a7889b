"""Named policies, registered in one place."""

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

    register("fifo", Fifo)


_builtin()
