"""Pollux's genetic search over allocation matrices (jobs x nodes -> GPUs).

Written from the Pollux paper (section 4.2) and the authors' code, not copied from it:
``petuum/adaptdl`` ``osdi21-artifact`` ``simulator/pollux.py`` (``PolluxPolicy.optimize``,
``Problem``). What each part follows:

- fitness (``Problem._evaluate``): each job's speedup on its (nodes, GPUs), scaled so one
  node's worth of GPUs gives 1 (x GPUs per node... ``speedup x dominant share x nodes``);
  a job whose row differs from its current one is multiplied by the restart factor
  ``max(age - restarts x delay, 0) / (age + delay)`` (delay = 30 s in Pollux's simulator);
  the power mean with ``p = -1`` of ``speedup + 1e-3`` over all jobs (more negative = fairer).
- crossover (``_crossover``): one point over the jobs, two parents, two children.
- mutation (``_mutation``): a job's row goes back to its current allocation with
  probability 0.1; with probability 0.1 a job loses each of its entries w.p. 0.1; an entry
  is raised to a uniform count up to the node's size with probability prob1 + prob2 -
  prob1 x prob2 (prob1: 1 over the jobs that fit in the node's free GPUs, prob2: the same
  over those that already hold some there).
- repair (``_repair``): at most one distributed (multi-node) job per node, the earliest in
  job order keeping it; no job above its largest replica count (GPUs dropped from
  randomly ordered nodes); at most 16 nodes per job; node capacity given to jobs in order
  (the caller orders them by attained service, then submission, as ``optimize`` does).
- search (``PolluxPolicy.optimize``): population 100, 100 generations, started from last
  round's population carried over to this round's jobs (new jobs start empty), the first
  round from the current allocation.
- minimum replicas (``min_replicas``: not in the OSDI'21 simulator, whose jobs all run on
  one GPU, but in the authors' production policy, ``petuum/adaptdl``
  ``sched/adaptdl_sched/policy/pollux.py``): a job that cannot run on fewer than ``m > 1``
  GPUs has a lower bound per node, ``m`` filled over the nodes in order up to each node's
  size (``Problem.__init__``'s ``_min_replicas``); every mutated state holds at least that
  (``_mutation``: ``np.maximum(states, self._min_replicas)``); repair zeroes a job left
  below ``m`` (``_repair``: "Only choose solutions which have at least min_replicas
  allocations"); and the caller orders jobs by ``m`` first (``optimize``'s sort), so jobs
  that need less go first. Without it a 40-GPU job that runs only as 5 x 8 is never
  reached by random raises: on rubick-base (measured) 28 such llama30 jobs waited on an
  empty 64-GPU cluster until the run stalled. With every ``m`` at 0 nothing changes.

One difference, said here and in docs: Pollux runs pymoo's NSGA-II with a second objective
(cluster utility, used only for autoscaling, which its simulator turns off) and then picks
the Pareto-front member with the best first objective. We run the same operators with
binary tournaments and (mu + lambda) survival on the first objective alone, which is the
criterion Pollux's final pick uses. Two smaller ones follow from that: pymoo drops
duplicate offspring (NSGA-II's default) and carries its result set (the Pareto front) to
the next round; we keep duplicates and carry the whole final population.
"""

from __future__ import annotations

import numpy as np
from numba import njit

POP_SIZE = 100
GENERATIONS = 100
RESTART_DELAY = 30.0  # s: Pollux's simulator (rescale_time and the factor's delay)
FAIRNESS_P = -1.0
MAX_NODES_PER_JOB = 16


class AllocationSearch:
    """One round's problem. ``speedup``: (jobs, max nodes + 1, max GPUs + 1) table, the
    speedup of a job on n nodes and r GPUs (0 at r = 0); ``base``: (jobs, nodes), the
    current allocation; ``capacity``: GPUs per node; ``max_replicas``: per job."""

    def __init__(self, speedup: np.ndarray, base: np.ndarray, capacity: np.ndarray, max_replicas: np.ndarray,
                 ages: np.ndarray, restarts: np.ndarray, rng: np.random.Generator, delay: float = RESTART_DELAY,
                 p: float = FAIRNESS_P, min_replicas: np.ndarray | None = None):
        self.speedup = speedup
        self.base = base.astype(np.int64)
        self.capacity = capacity.astype(np.int64)
        self.max_replicas = max_replicas.astype(np.int64)
        self.rng = rng
        self.p = p
        self.jobs, self.nodes = base.shape
        total = int(self.capacity.sum())
        self.scale = self.nodes / max(total, 1)  # dominant share (1 GPU / total) x nodes
        self.factor = np.maximum(ages - restarts * delay, 0.0) / (ages + delay)
        self.node_cap = np.broadcast_to(self.capacity, base.shape)
        # adaptdl's lower bounds (module docstring): None when no job has one
        self.min_replicas = None if min_replicas is None or not np.any(min_replicas) else \
            np.asarray(min_replicas, dtype=np.int64)
        self.min_layout = None if self.min_replicas is None else min_layout(self.min_replicas, self.capacity)

    # ---------------------------------------------------------------- fitness
    def fitness(self, states: np.ndarray) -> np.ndarray:
        """Power mean of scaled speedups per state; larger is better."""
        if self.jobs == 0:
            return np.zeros(len(states))
        n = np.minimum(np.count_nonzero(states, axis=2), self.speedup.shape[1] - 1)
        r = np.minimum(states.sum(axis=2), self.speedup.shape[2] - 1)
        j = np.broadcast_to(np.arange(self.jobs), n.shape)
        s = self.speedup[j, n, r] * self.scale
        moved = np.any(states != self.base, axis=2)
        s = np.where(moved, s * self.factor, s)
        if self.p == 0:
            return np.exp(np.mean(np.log(np.maximum(s, 1e-3)), axis=1))
        return np.mean((s + 1e-3) ** self.p, axis=1) ** (1.0 / self.p)

    # ---------------------------------------------------------------- operators
    def crossover(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        points = self.rng.integers(0, max(self.jobs, 1), size=(len(a), 1))
        mask = (np.arange(self.jobs) < points)[:, :, None]
        return np.where(mask, b, a), np.where(mask, a, b)

    def mutate(self, states: np.ndarray) -> np.ndarray:
        # the reference's draws in the reference's order (none depends on the arithmetic
        # between them but the last), the arithmetic in numba
        rng = self.rng
        k = len(states)
        reset = rng.random((k, self.jobs)) < 0.1
        lose = rng.random((k, self.jobs)) < 0.1
        drop = rng.random(states.shape)
        pick = rng.random(states.shape)
        states, m = _mutate_kernel(np.ascontiguousarray(states, dtype=np.int64), self.base, reset, lose, drop, pick,
                                   self.capacity)
        raised = rng.integers(states, self.node_cap + 1)
        out = np.where(m, raised, states)
        return out if self.min_layout is None else np.maximum(out, self.min_layout)

    def mutate_numpy(self, states: np.ndarray) -> np.ndarray:
        """The reference the kernel is tested against."""
        rng = self.rng
        k = len(states)
        reset = rng.random((k, self.jobs)) < 0.1
        states = np.where(reset[:, :, None], self.base, states)
        prob = np.where(rng.random((k, self.jobs)) < 0.1, 0.1, 0.0)
        states = np.where(rng.random(states.shape) < prob[:, :, None], 0, states)
        free = self.capacity - states.sum(axis=1)  # (k, nodes)
        fits = np.broadcast_to((free >= 1)[:, None, :], states.shape)
        p1 = fits / np.maximum(fits.sum(axis=1, keepdims=True), 1)
        holds = np.logical_and(states > 0, fits)
        p2 = holds / np.maximum(holds.sum(axis=1, keepdims=True), 1)
        m = rng.random(states.shape) < p1 + p2 - p1 * p2
        raised = rng.integers(states, self.node_cap + 1)
        out = np.where(m, raised, states)
        return out if self.min_layout is None else np.maximum(out, self.min_layout)

    def repair(self, states: np.ndarray) -> np.ndarray:
        # the same random draw and order as :meth:`repair_numpy`; the integer passes in numba
        shuffle = np.argsort(self.rng.random(states.shape), axis=2)
        out = _repair_kernel(np.ascontiguousarray(states, dtype=np.int64), shuffle.astype(np.int64, copy=False),
                             self.max_replicas, self.capacity, MAX_NODES_PER_JOB)
        return self._at_least_min(out)

    def _at_least_min(self, states: np.ndarray) -> np.ndarray:
        """A job left below its minimum replicas gets none (adaptdl's ``_repair``)."""
        if self.min_replicas is not None:
            states[states.sum(axis=2) < self.min_replicas[None, :]] = 0
        return states

    def repair_numpy(self, states: np.ndarray) -> np.ndarray:
        """The reference the kernel is tested against (same rules, vectorised)."""
        states = states.copy()
        # at most one distributed job per node
        distributed = np.count_nonzero(states, axis=2) > 1
        mask = (states * distributed[:, :, None]) > 0
        states[np.cumsum(mask, axis=1) > 1] = 0
        # at most max_replicas GPUs per job, taken from randomly ordered nodes; at most 16 nodes
        shuffle = np.argsort(self.rng.random(states.shape), axis=2)
        s = np.take_along_axis(states, shuffle, axis=2)
        s = np.diff(np.minimum(np.cumsum(s, axis=2), self.max_replicas[None, :, None]), axis=2, prepend=0)
        used = np.diff(np.minimum(np.cumsum(s > 0, axis=2), MAX_NODES_PER_JOB), axis=2, prepend=0)
        s[used == 0] = 0
        states = np.take_along_axis(s, np.argsort(shuffle, axis=2), axis=2)
        # node capacity, in job order
        states = np.diff(np.minimum(np.cumsum(states, axis=1), self.capacity[None, None, :]), axis=1, prepend=0)
        return self._at_least_min(states)

    # ---------------------------------------------------------------- search
    def run(self, initial: np.ndarray, pop_size: int = POP_SIZE, generations: int = GENERATIONS) -> tuple[np.ndarray, np.ndarray]:
        """The best state and the final population (to seed the next round)."""
        pop = self.repair(np.asarray(initial, dtype=np.int64))
        fit = self.fitness(pop)
        rng = self.rng
        for _ in range(generations):
            half = (pop_size + 1) // 2
            picks = rng.integers(0, len(pop), size=(2, 2 * half))
            winners = np.where(fit[picks[0]] >= fit[picks[1]], picks[0], picks[1])
            a, b = pop[winners[:half]], pop[winners[half:]]
            c1, c2 = self.crossover(a, b)
            kids = self.repair(self.mutate(np.concatenate([c1, c2])[:pop_size]))
            pop = np.concatenate([pop, kids])
            fit = np.concatenate([fit, self.fitness(kids)])
            keep = np.argsort(-fit, kind="stable")[:pop_size]
            pop, fit = pop[keep], fit[keep]
        best = int(np.argmax(fit))
        return pop[best], pop


def min_layout(min_replicas: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """(jobs, nodes): each job's minimum filled over the nodes in order, at most each
    node's size (adaptdl's ``Problem._min_replicas``)."""
    out = np.zeros((len(min_replicas), len(capacity)), dtype=np.int64)
    for j, m in enumerate(min_replicas.tolist()):
        for n, c in enumerate(capacity.tolist()):
            if m <= 0:
                break
            out[j, n] = min(m, c)
            m -= out[j, n]
    return out


def carry_population(prev: np.ndarray | None, prev_jobs: list[str], jobs: list[str], nodes: int) -> np.ndarray | None:
    """Last round's population on this round's jobs (rows of new jobs empty)."""
    if prev is None or prev.shape[2] != nodes:
        return None
    out = np.zeros((len(prev), len(jobs), nodes), dtype=np.int64)
    at = {k: i for i, k in enumerate(prev_jobs)}
    for i, k in enumerate(jobs):
        src = at.get(k)
        if src is not None:
            out[:, i, :] = prev[:, src, :]
    return out


@njit(cache=True)
def _repair_kernel(states, shuffle, max_replicas, capacity, max_nodes):  # pragma: no cover - compiled
    """:meth:`AllocationSearch.repair_numpy` per state, in loops (integers only, so exact)."""
    k, jobs, nodes = states.shape
    out = states.copy()
    for a in range(k):
        # at most one distributed job per node: the earliest in job order keeps it (and, as the
        # reference's cumulative count does, every entry below a second distributed one goes)
        dist = np.zeros(jobs, np.bool_)
        for j in range(jobs):
            used = 0
            for n in range(nodes):
                if states[a, j, n] > 0:
                    used += 1
            dist[j] = used > 1
        for n in range(nodes):
            count = 0
            for j in range(jobs):
                if dist[j] and states[a, j, n] > 0:
                    count += 1
                if count > 1:
                    out[a, j, n] = 0
        # at most max_replicas GPUs per job (counted before the node limit, as the reference
        # does), then at most max_nodes nodes, in the shuffled node order
        for j in range(jobs):
            total = 0
            spans = 0
            for i in range(nodes):
                n = shuffle[a, j, i]
                v = out[a, j, n]
                if v <= 0:
                    continue
                take = min(total + v, max_replicas[j]) - total
                total += take
                if take <= 0:
                    out[a, j, n] = 0
                    continue
                spans += 1
                out[a, j, n] = take if spans <= max_nodes else 0
        # node capacity, given to jobs in order
        for n in range(nodes):
            held = 0
            for j in range(jobs):
                v = out[a, j, n]
                take = min(held + v, capacity[n]) - min(held, capacity[n])
                held += v
                out[a, j, n] = take
    return out


@njit(cache=True)
def _mutate_kernel(states, base, reset, lose, drop, pick, capacity):  # pragma: no cover - compiled
    """:meth:`AllocationSearch.mutate_numpy` up to its last draw: the states after the reset
    and the drops, and which entries are raised (the same float operations, so exact)."""
    k, jobs, nodes = states.shape
    out = np.empty_like(states)
    m = np.zeros(states.shape, np.bool_)
    for a in range(k):
        for j in range(jobs):
            p = 0.1 if lose[a, j] else 0.0
            for n in range(nodes):
                v = base[j, n] if reset[a, j] else states[a, j, n]
                out[a, j, n] = 0 if drop[a, j, n] < p else v
        for n in range(nodes):
            held = 0
            for j in range(jobs):
                held += out[a, j, n]
            if capacity[n] - held < 1:
                continue  # the node is full: no job may be raised there (p1 = p2 = 0)
            fits = jobs  # every job fits where the node has a free GPU
            holders = 0
            for j in range(jobs):
                if out[a, j, n] > 0:
                    holders += 1
            p1 = 1.0 / max(fits, 1)
            for j in range(jobs):
                p2 = (1.0 / max(holders, 1)) if out[a, j, n] > 0 else 0.0
                m[a, j, n] = pick[a, j, n] < (p1 + p2) - (p1 * p2)
    return out, m
