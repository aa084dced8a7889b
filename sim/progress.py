"""The running jobs' progress, accounted on arrays: one row per running job.

Every round every running job's steps and service move (``sim.engine.advance``). A
pass over the records in Python costs about a microsecond a job; the same float
operations on arrays (numpy, elementwise IEEE arithmetic: the same bits) cost a few
microseconds a round. So while a job runs its accounting lives here: steps done,
attained service, GPU-seconds, run time and "accounted up to", with what they grow
by (productive from, rate, GPUs held, steps). The record gets them back when
anything else reads or changes them (``detach``: before a release, a completion's
own accounting, a stop that outlasts its grace, the end of the run); ``SimViews``
sets its ``steps_done`` from its row before it builds a view of it. ``attach`` at
every grant.

``advance(t)`` is ``sim.engine.advance`` for every row, expression for expression:
``start = max(updated, productive from)``; if ``t > start`` and the rate is positive,
``steps += (t - start) x rate``, clamped to the job's steps (refused beyond rounding);
then ``attained += dt x GPUs``, the same for GPU-seconds, ``run time += dt``,
``updated = t``; nothing for a row whose ``dt`` is not positive. It runs as one numba
kernel (``_advance``: the same scalar expressions, in the same order, compiled without
fast-math, so the same IEEE results as the numpy expressions it replaced, which stay as
``advance_numpy``, the reference a test holds it to): some 25 numpy calls a round cost
more than the arithmetic on a few hundred rows. The fields are the rows of one array
(``RunningRows.data``), so a kernel takes them as one argument (a numba call's cost
grows with its arguments).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

_FIELDS = ("upd", "pf", "rate", "steps", "gh", "sd", "att", "gsec", "rt", "vab", "vg", "vsince")


@njit(cache=True)
def _advance(t, n, data, check):
    """``RunningRows.advance_numpy`` row by row (``data``: the fields, one row each, in
    ``_FIELDS`` order); the first row past its steps beyond rounding (with ``check``),
    else -1 (the caller then raises: the rows' state after that does not matter, and the
    run ends)."""
    upd, pf, rate, steps, gh, sd, att, gsec, rt = data[0], data[1], data[2], data[3], data[4], data[5], data[6], \
        data[7], data[8]
    bad = -1
    for i in range(n):
        dt = t - upd[i]
        if not dt > 0:
            continue
        start = pf[i] if pf[i] > upd[i] else upd[i]
        if t > start and rate[i] > 0:
            sd[i] = sd[i] + (t - start) * rate[i]
            if sd[i] > steps[i]:
                if check and bad < 0 and sd[i] > steps[i] * (1 + 1e-6) + 1e-6:
                    bad = i  # left unclamped: the error names what it reached
                else:
                    sd[i] = steps[i]
        g = dt * gh[i]
        att[i] = att[i] + g
        gsec[i] = gsec[i] + g
        rt[i] = rt[i] + dt
        upd[i] = t
    return bad


@njit(cache=True)
def _service(t, n, data):
    """``RunningRows.service_numpy`` row by row."""
    vab, vg, vsince = data[9], data[10], data[11]
    out = np.empty(n)
    for i in range(n):
        dt = t - vsince[i]
        out[i] = vab[i] + vg[i] * (dt if dt > 0.0 else 0.0)
    return out


class RunningRows:
    """Rows of the running jobs (records ``sim.engine.SimJob``), in no particular order."""

    __slots__ = ("slot", "recs", "views", "unviewed", "n", "check", "error", "left", "data", *_FIELDS)

    def __init__(self, check: bool = True, error: type[Exception] = AssertionError, size: int = 64):
        self.slot: dict[str, int] = {}  # job id -> row
        self.recs: list[Any] = []  # row -> record
        # row -> the policy's kept view of it (None: to be found or built, ``set_view``), with
        # what its attained service is made of (vab + vg x time since vsince: KeptViews.refresh)
        self.views: list[Any] = []
        self.unviewed: dict[str, None] = {}  # the jobs whose row's view is None, in the order they attached
        # jobs detached since ``SimViews`` last looked (every stop detaches: a release, a
        # completion), whether or not a round saw them run (a launch that failed before it)
        self.left: set[str] = set()
        self.n = 0
        self.check = check
        self.error = error
        self.data = np.zeros((len(_FIELDS), 0))
        self._grow(size)

    def _grow(self, size: int) -> None:
        """Room for ``size`` rows: ``data`` holds every field (one row each, ``_FIELDS``, so a
        kernel takes them as one argument), and each field is a view of its row."""
        data = np.zeros((len(_FIELDS), size))
        data[:, :self.data.shape[1]] = self.data
        self.data = data
        for k, f in enumerate(_FIELDS):
            setattr(self, f, data[k])

    def attach(self, r: Any) -> None:
        """``r`` was granted: its accounting moves here."""
        jid = r.job.job_id
        if jid in self.slot:
            self.detach(r)
        i = self.n
        if i == len(self.sd):
            self._grow(2 * i)
        self.data[:9, i] = (r.updated_at, r.productive_from, r.rate, r.job.spec.steps, r.gpus_held,  # (_FIELDS' order)
                            r.steps_done, r.attained, r.gpu_seconds, r.run_time)
        self.slot[jid] = i
        self.recs.append(r)
        self.views.append(None)
        self.unviewed[jid] = None
        self.n = i + 1

    def detach(self, r: Any) -> None:
        """Hand ``r``'s accounting back to its record and forget its row (nothing if it has none)."""
        i = self.slot.pop(r.job.job_id, None)
        if i is None:
            return
        self.left.add(r.job.job_id)
        self._pull(r, i)
        self.unviewed.pop(r.job.job_id, None)
        last = self.n - 1
        if i != last:  # the last row takes its place
            self.data[:, i] = self.data[:, last]
            moved = self.recs[i] = self.recs[last]
            self.views[i] = self.views[last]
            self.slot[moved.job.job_id] = i
        self.recs.pop()
        self.views.pop()
        self.n = last

    def detach_all(self) -> None:
        for r in list(self.recs):
            self.detach(r)

    def _pull(self, r: Any, i: int) -> None:
        r.steps_done, r.attained, r.gpu_seconds, r.run_time, r.updated_at = (
            float(self.sd[i]), float(self.att[i]), float(self.gsec[i]), float(self.rt[i]), float(self.upd[i]))

    def advance(self, t: float) -> np.ndarray:
        """Every row's progress up to ``t`` (``sim.engine.advance``); the steps done, by row."""
        n = self.n
        bad = _advance(t, n, self.data, self.check)
        if bad >= 0:
            spec = self.recs[bad].job.spec
            raise self.error(f"job {self.recs[bad].job.job_id}: {float(self.sd[bad])} steps done of {spec.steps}")
        return self.sd[:n]

    def advance_numpy(self, t: float) -> np.ndarray:
        """``advance`` on numpy expressions: the reference ``_advance`` is held to."""
        n = self.n
        upd, sd = self.upd[:n], self.sd[:n]
        dt = t - upd
        moves = dt > 0
        start = np.where(self.pf[:n] > upd, self.pf[:n], upd)
        rate = self.rate[:n]
        grows = moves & (t > start) & (rate > 0)
        np.add(sd, (t - start) * rate, out=sd, where=grows)
        steps = self.steps[:n]
        over = grows & (sd > steps)
        if over.any():
            if self.check:
                bad = np.flatnonzero(over & (sd > steps * (1 + 1e-6) + 1e-6))
                if len(bad):
                    i = int(bad[0])
                    spec = self.recs[i].job.spec
                    raise self.error(f"job {self.recs[i].job.job_id}: {float(sd[i])} steps done of {spec.steps}")
            np.copyto(sd, steps, where=over)
        g = dt * self.gh[:n]
        np.add(self.att[:n], g, out=self.att[:n], where=moves)
        np.add(self.gsec[:n], g, out=self.gsec[:n], where=moves)
        np.add(self.rt[:n], dt, out=self.rt[:n], where=moves)
        np.copyto(upd, t, where=moves)
        return sd

    def set_view(self, i: int, view: Any, attained_before: float, gpus: int, since: float) -> None:
        """Row ``i``'s kept view, refreshed by ``service`` while it is kept."""
        jid = self.recs[i].job.job_id
        if view is None:
            self.unviewed[jid] = None
        else:
            self.unviewed.pop(jid, None)
        self.views[i] = view
        self.vab[i], self.vg[i], self.vsince[i] = attained_before, gpus, since

    def service(self, t: float) -> np.ndarray:
        """Each row's view's attained service at ``t``: attained before + GPUs x the time since
        its allocation began, not below 0 (``KeptViews.refresh``: the same sum and product;
        ``service_numpy`` on numpy expressions)."""
        return _service(t, self.n, self.data)

    def service_numpy(self, t: float) -> np.ndarray:
        n = self.n
        dt = t - self.vsince[:n]
        return self.vab[:n] + self.vg[:n] * np.where(dt > 0.0, dt, 0.0)
