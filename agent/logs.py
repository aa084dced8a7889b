"""Rank logs for ``gs.agent.<node>.logs``: the tail of each rank's output file
(``<workdir>/run/<job>/g<generation>/rank-<r>.log``), never the whole file."""

from __future__ import annotations

import re
from pathlib import Path

from gearshift.bus_schema.ops import LogsReply, LogsRequest, RankLog

_GEN = re.compile(r"^g(\d+)$")
_RANK = re.compile(r"^rank-(\d+)\.log$")


def _tail(path: Path, limit: int) -> tuple[str, bool, int]:
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - limit))
        data = f.read(limit)
    return data.decode(errors="replace"), size > limit, size


def read_rank_logs(run_root: Path, node: str, req: LogsRequest) -> LogsReply:
    """The latest generation of the job on this node (or ``req.generation``)."""
    job_dir = run_root / req.job_id
    gens = sorted(int(m.group(1)) for d in (job_dir.iterdir() if job_dir.is_dir() else ())
                  if (m := _GEN.match(d.name)))
    if req.generation is not None:
        gens = [g for g in gens if g == req.generation]
    if not gens:
        return LogsReply(node=node, logs=[])
    gen = gens[-1]
    out = []
    for f in sorted((job_dir / f"g{gen}").glob("rank-*.log"), key=lambda p: int(_RANK.match(p.name).group(1))):
        rank = int(_RANK.match(f.name).group(1))
        if req.rank is not None and rank != req.rank:
            continue
        text, truncated, size = _tail(f, req.tail_bytes)
        out.append(RankLog(rank=rank, generation=gen, text=text, truncated=truncated, size=size))
    return LogsReply(node=node, logs=out)
