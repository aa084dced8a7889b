"""Topology paths (issue 23 item 1): where a node sits, levels from coarse to fine.

A node's path is ``LEVEL=VALUE`` parts joined by ``/``, coarse first, e.g.
``zone=eu1/spine=s2/rack=r7/nvlink-domain=r7a``. Two nodes share a level when their
paths agree on every part up to and including it (rack ``r7`` of spine ``s2`` is
not rack ``r7`` of spine ``s3``). A job may *require* a level (its whole gang lies
in one group of it) or *prefer* one (the finest level that has room is chosen).

A placement spans the finest level all its nodes share (``span_level``): ``node``
for one node, ``cluster`` when they share none. The performance model prices the
inter-node links of that span by the level's bandwidth factor (``LinkFactors``,
``parse_factors``: ``cluster=0.25``). The nodes of one ``nvlink-domain`` (a
multi-node NVLink fabric, e.g. NVL72) form one NVLink island (``islands``): tensor
parallelism across them is as inside one node.

Pure: no NATS, used by the bus schema, the policies and the simulator alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

Path = tuple[tuple[str, str], ...]

LEVEL_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
VALUE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# what a path looks like on the bus (NodeReport.topology); parse_path gives the one-line reason
PATH_PATTERN = r"^$|^[a-z][a-z0-9-]*=[A-Za-z0-9_.:-]+(/[a-z][a-z0-9-]*=[A-Za-z0-9_.:-]+)*$"
NODE = "node"  # a placement on one node
CLUSTER = "cluster"  # a placement whose nodes share no level
NVLINK = "nvlink-domain"  # the level NVML fabric information fills (one NVLink island)


class TopologyError(ValueError):
    """A bad topology: ``field`` names what was wrong (one line)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_path(text: str, field: str = "topology") -> Path:
    """``"rack=r1/nvlink-domain=r1a"`` -> ``(("rack", "r1"), ("nvlink-domain", "r1a"))``;
    "" -> (). A one-line ``TopologyError`` naming ``field`` otherwise."""
    text = (text or "").strip()
    if not text:
        return ()
    out: list[tuple[str, str]] = []
    for part in text.split("/"):
        level, eq, value = part.partition("=")
        if not eq:
            raise TopologyError(field, f"{part!r} is not LEVEL=VALUE (e.g. rack=r1/nvlink-domain=r1a)")
        if not LEVEL_RE.match(level):
            raise TopologyError(field, f"level {level!r} must be lower-case letters, digits and '-'")
        if not VALUE_RE.match(value):
            raise TopologyError(field, f"value {value!r} of level {level} must be letters, digits and _.:-")
        if level in (NODE, CLUSTER):
            raise TopologyError(field, f"level name {level!r} is reserved")
        if any(level == lv for lv, _ in out):
            raise TopologyError(field, f"level {level!r} given twice")
        out.append((level, value))
    return tuple(out)


def with_level(path: Path, level: str, value: str | None) -> Path:
    """``path`` with ``level=value`` appended (finest) unless it has that level already
    (what the operator configured wins over what the hardware says) or ``value`` is None."""
    if value is None or any(lv == level for lv, _ in path):
        return path
    return path + ((level, value),)


def format_path(path: Path) -> str:
    return "/".join(f"{lv}={v}" for lv, v in path)


def check_level(name: str, field: str) -> str:
    """A job's required/preferred level name, or a one-line error naming ``field``."""
    if not LEVEL_RE.match(name) and name != NODE:
        raise TopologyError(field, f"level {name!r} must be lower-case letters, digits and '-' (e.g. rack)")
    return name


def group_key(path: Path, level: str) -> Path | None:
    """The group of ``level`` a node with ``path`` is in (its path through that level);
    None when the path has no such level. ``node`` is never a group here."""
    for i, (lv, _) in enumerate(path):
        if lv == level:
            return path[: i + 1]
    return None


def levels_of(paths: Iterable[Path]) -> list[str]:
    """The level names the nodes' paths use, coarse to fine (first seen order)."""
    seen: dict[str, None] = {}
    for p in paths:
        for lv, _ in p:
            seen.setdefault(lv, None)
    return list(seen)


def span_level(paths: Sequence[Path]) -> str:
    """The finest level every one of ``paths`` shares (their nodes are distinct):
    ``node`` for one node, ``cluster`` when they share no level."""
    if len(paths) <= 1:
        return NODE
    first = paths[0]
    best = CLUSTER
    for i, (lv, _) in enumerate(first):
        head = first[: i + 1]
        if all(p[: i + 1] == head for p in paths[1:]):
            best = lv
        else:
            break
    return best


def within(paths: Sequence[Path], level: str) -> bool:
    """Do nodes with these paths all lie in one group of ``level`` (``node``: one node)?"""
    if not paths:
        return True
    if level == NODE:
        return len(paths) == 1
    key = group_key(paths[0], level)
    return key is not None and all(group_key(p, level) == key for p in paths[1:])


class LinkFactors:
    """Bandwidth of the links between a placement's nodes, per level they span, as a
    factor of the inter-node bandwidth the model was fitted on (1.0; a level not
    named: 1.0). E.g. ``{"cluster": 0.25}``:
    across racks a quarter of in-rack."""

    def __init__(self, factors: Mapping[str, float] | None = None, field: str = "bandwidth"):
        self.factors = dict(factors or {})
        for lv, f in self.factors.items():
            if lv not in (NODE, CLUSTER):
                check_level(lv, f"{field}.{lv}")
            if not (isinstance(f, (int, float)) and 0 < f <= 100):
                raise TopologyError(f"{field}.{lv}", f"{f!r} must be a number in (0, 100]")

    def factor(self, span: str) -> float:
        """The factor for a placement spanning ``span`` (a level not named: 1.0)."""
        if span == NODE:
            return 1.0
        return float(self.factors.get(span, 1.0))


def parse_factors(text: str, field: str = "bandwidth") -> LinkFactors:
    """``"cluster=0.25,rack=1"`` -> ``LinkFactors`` (a one-line ``TopologyError`` naming
    ``field.LEVEL`` otherwise)."""
    got = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        lv, eq, v = part.strip().partition("=")
        if not eq:
            raise TopologyError(field, f"{part.strip()!r} is not LEVEL=FACTOR (e.g. cluster=0.25)")
        try:
            got[lv.strip()] = float(v)
        except ValueError:
            raise TopologyError(f"{field}.{lv.strip()}", f"{v!r} is not a number") from None
    return LinkFactors(got, field)


def island_of(path: Path) -> Path | None:
    """The NVLink island a node with ``path`` is in: its ``nvlink-domain`` group (None:
    the node is an island of its own)."""
    return group_key(path, NVLINK)


def islands(nodes: Sequence[tuple[Path, int]]) -> list[int]:
    """GPUs per NVLink island of nodes given as (path, GPUs): the nodes of one
    ``nvlink-domain`` summed, each other node alone; in first-seen order."""
    out: dict[object, int] = {}
    for i, (path, gpus) in enumerate(nodes):
        key = island_of(path)
        out[key if key is not None else ("node", i)] = out.get(key if key is not None else ("node", i), 0) + gpus
    return list(out.values())
