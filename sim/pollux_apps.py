"""The six Pollux applications as measured (``sim/data/pollux-profiles``): ground truth for
the Pollux workload replay (``sim.pollux_replay``).

Each application's truth follows the Pollux authors' simulator (``petuum/adaptdl``
``osdi21-artifact``, ``simulator/applications.py``), written anew:
- step and sync seconds of a placement and atomic batch (``get_throughput``): the placement
  is read as its smallest rotation (``22`` = 2 nodes x 2 GPUs); a measured placement is
  interpolated linearly in the atomic batch; any other one linearly over (nodes, replicas,
  atomic batch) among the per-(nodes, replicas, batch) means of the placement rows and the
  scalability rows, nodes capped at 16. Outside the measured hull (AdaptDL asserts it never
  happens) we take the nearest measured point and count it in ``outside_hull``.
- gradient statistics and iterations per epoch (``get_grad_stats``, ``get_iteration``):
  linear between the two validated batch sizes around the batch.
- progress at the end of an epoch (``get_progress``): the least over validated batches.
- a job completes after ``max_epochs`` epochs (no target metric is set for any of them:
  ``get_completion_epoch`` returns ``max_epochs - 1``); ``max_epochs`` per application and
  yolov3's largest atomic batch of 8 as in ``APPLICATIONS``.
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

from gearshift.policies.pollux_goodput import BatchLimits

PROFILES = Path(__file__).parent / "data" / "pollux-profiles"
MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
MAX_ATOMIC = {"yolov3": 8}


def _read(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}


class Application:
    def __init__(self, name: str, folder: Path = PROFILES):
        d = folder / name
        self.name = name
        self.validation: dict[int, dict[str, np.ndarray]] = {}
        for p in sorted(d.glob("validation-*.csv")):
            self.validation[int(p.stem.split("-")[-1])] = _read(p)
        self.validation = dict(sorted(self.validation.items()))
        self.bsizes = np.array(list(self.validation))
        pl = _read(d / "placements.csv")
        with open(d / "placements.csv", newline="") as f:
            ids = [r["placement"].strip() for r in csv.DictReader(f)]
        self._by_placement: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for pid in sorted(set(ids)):
            m = np.array([i == pid for i in ids])
            order = np.argsort(pl["local_bsz"][m])
            self._by_placement[pid] = (pl["local_bsz"][m][order], pl["step_time"][m][order], pl["sync_time"][m][order])
        nodes = np.array([len(i) for i in ids], dtype=float)
        reps = np.array([sum(int(c) for c in i) for i in ids], dtype=float)
        groups: dict[tuple, list[int]] = {}
        for k, key in enumerate(zip(nodes, reps, pl["local_bsz"])):
            groups.setdefault(key, []).append(k)
        pts = [list(k) for k in groups]
        vals = [[pl["step_time"][v].mean(), pl["sync_time"][v].mean()] for v in groups.values()]
        sc = _read(d / "scalability.csv")
        pts += [list(x) for x in zip(sc["num_nodes"], sc["num_replicas"], sc["local_bsz"])]
        vals += [list(x) for x in zip(sc["step_time"], sc["sync_time"])]
        self._lin = LinearNDInterpolator(np.array(pts), np.array(vals))
        self._near = NearestNDInterpolator(np.array(pts), np.array(vals))
        self.outside_hull = 0
        self.limits = BatchLimits(
            init_batch=int(self.bsizes.min()), max_batch=int(self.bsizes.max()),
            min_atomic=int(pl["local_bsz"].min()), max_atomic=int(MAX_ATOMIC.get(name, pl["local_bsz"].max())))
        self.max_epochs = MAX_EPOCHS[name]
        self._throughput: dict[tuple, tuple[float, float]] = {}

    # ---------------------------------------------------------------- throughput
    def throughput(self, placement: tuple[int, ...], atomic: int) -> tuple[float, float]:
        """(step seconds, sync seconds) of one step at ``atomic`` samples per GPU."""
        key = (placement, atomic)
        hit = self._throughput.get(key)
        if hit is None:
            hit = self._throughput[key] = self._compute(placement, atomic)
        return hit

    def _compute(self, placement: tuple[int, ...], atomic: int) -> tuple[float, float]:
        p = tuple(c for c in placement if c)
        p = min(p[i:] + p[:i] for i in range(len(p)))
        pid = "".join(map(str, p))
        rows = self._by_placement.get(pid)
        if rows is not None:
            bs, st, sy = rows
            return float(np.interp(atomic, bs, st)), float(np.interp(atomic, bs, sy))
        x = [[min(len(p), 16), sum(p), atomic]]
        v = self._lin(x)[0]
        if not np.all(np.isfinite(v)):
            self.outside_hull += 1
            v = self._near(x)[0]
        return float(v[0]), float(v[1])

    # ---------------------------------------------------------------- statistics
    def _around(self, batch: float) -> tuple[int, int]:
        b = self.bsizes
        lo = b[b <= batch + 1e-9]
        hi = b[b >= batch - 1e-9]
        if not len(lo) or not len(hi):
            raise ValueError(f"{self.name}: batch {batch} outside the validated {b.min()}..{b.max()}")
        return int(lo.max()), int(hi.min())

    def _lerp(self, column: str, batch: float, epoch: int) -> float:
        lo, hi = self._around(batch)
        a = self.validation[lo][column][epoch]
        if lo == hi:
            return float(a)
        b = self.validation[hi][column][epoch]
        return float(((batch - lo) * b + (hi - batch) * a) / (hi - lo))

    def grad_stats(self, batch: float, epoch: int) -> tuple[float, float]:
        return self._lerp("grad_sqr", batch, epoch), self._lerp("grad_var", batch, epoch)

    def iteration(self, batch: float, epoch: int) -> float:
        """Iterations done at the end of ``epoch`` with ``batch``."""
        return self._lerp("iteration", batch, epoch)

    @lru_cache(maxsize=None)
    def progress(self, epoch: int) -> float:
        """Progress (initial-batch-equivalent samples) at the end of epoch ``epoch - 1``."""
        if epoch == 0:
            return 0.0
        return float(min(v["progress"][epoch - 1] for v in self.validation.values()))


@lru_cache(maxsize=None)
def application(name: str) -> Application:
    if name not in MAX_EPOCHS:
        raise ValueError(f"unknown Pollux application {name!r}; known: {', '.join(sorted(MAX_EPOCHS))}")
    return Application(name)


__all__ = ["Application", "application", "MAX_EPOCHS", "PROFILES"]
