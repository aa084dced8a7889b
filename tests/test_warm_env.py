"""Warm workers for a job's own environment (issue 20 item 8): a job env that
sets PYTHONPATH, or a command naming a venv's python, still runs in a warm
worker, one started with that interpreter and those variables; a job without
them never gets it. Real processes, a real venv."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from gearshift.agent.warm import WARM_SCRIPT, WarmPool, warm_argv, warm_key

MODULE = '''import json, os, sys
WARM_IMPORTS = ("json",)
if __name__ == "__main__":
    with open(os.environ["OUT"], "w") as f:
        json.dump({"pid": os.getpid(), "exe": sys.executable, "prefix": sys.prefix, "path": sys.path,
                   "argv": sys.argv, "file": __file__}, f)
'''


class Log:
    def info(self, *a, **k):
        pass

    warning = info


async def spawn(argv, env=None):
    return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                env={**os.environ, **env} if env else None, start_new_session=True)


def test_the_key_holds_the_variables_that_change_imports_and_only_those():
    base = [sys.executable, "-m", "m"]
    assert warm_key(base, {"FOO": "1"}) == (sys.executable, "m")
    k = warm_key(base, {"PYTHONPATH": "/a", "LD_LIBRARY_PATH": "/l", "FOO": "1"})
    assert k == (sys.executable, "m", (("LD_LIBRARY_PATH", "/l"), ("PYTHONPATH", "/a")))
    assert warm_key(base, {"PYTHONPATH": "/b"}) != k
    assert warm_argv((sys.executable, "m")) == [sys.executable, "-m", "gearshift.agent.warm", "m"]
    assert warm_argv(("/venv/bin/python", "m")) == ["/venv/bin/python", WARM_SCRIPT, "m"]


async def _run_warm(pool, cmd, job_env, tmp_path, name):
    assert pool.take(cmd, job_env) is None  # first launch: cold, and the key is learnt
    await pool.refill()
    proc = pool.take(cmd, job_env)
    assert proc is not None
    out = tmp_path / f"{name}.json"
    env = {**os.environ, **job_env, "OUT": str(out)}
    assert await pool.hand_off(proc, cmd, env, str(tmp_path), str(tmp_path / f"{name}.log"))
    assert await asyncio.wait_for(proc.wait(), 60) == 0, (tmp_path / f"{name}.log").read_text()
    got = json.loads(out.read_text())
    assert got["pid"] == proc.pid  # it ran in the warm worker
    return got


@pytest.mark.timeout(120)
async def test_a_job_that_sets_pythonpath_runs_in_a_warm_worker_with_it(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "usermod.py").write_text(MODULE)
    pool = WarmPool(1, spawn=spawn, log=Log())
    cmd = [sys.executable, "-m", "usermod", "--x"]
    got = await _run_warm(pool, cmd, {"PYTHONPATH": str(lib)}, tmp_path, "pp")
    assert got["file"] == str(lib / "usermod.py") and str(lib) in got["path"] and got["argv"][1:] == ["--x"]
    assert got["path"][0] == str(tmp_path)  # the working folder first, as python -m puts it
    await pool.refill()
    assert pool.take(cmd, {}) is None  # a job without that PYTHONPATH never gets its worker
    pool.close()


@pytest.mark.timeout(120)
async def test_a_venvs_python_gets_warm_workers_without_gearshift_installed_there(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "usermod.py").write_text(MODULE)
    r = subprocess.run([python, "-c", "import gearshift"], capture_output=True, timeout=30, cwd=tmp_path)
    assert r.returncode != 0  # the venv really lacks gearshift
    pool = WarmPool(1, spawn=spawn, log=Log())
    got = await _run_warm(pool, [python, "-m", "usermod"], {"PYTHONPATH": str(lib)}, tmp_path, "venv")
    assert got["prefix"] == str(venv) and os.path.dirname(WARM_SCRIPT) not in got["path"]
    pool.close()


@pytest.mark.timeout(120)
async def test_a_new_module_gets_one_warm_worker_first_and_the_rest_only_once_it_is_ready(tmp_path):
    """A module with nothing worth keeping warm costs one interpreter per key, not a
    whole pool's worth at once; one that is worth it is filled to the pool's size."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "usermod.py").write_text(MODULE)  # WARM_IMPORTS: worth keeping warm
    (lib / "plainmod.py").write_text("print('hi')\n")  # nothing to keep warm
    started: list[list[str]] = []

    async def counting(argv, env=None):
        started.append(argv)
        return await spawn(argv, env)

    env = {"PYTHONPATH": str(lib)}
    pool = WarmPool(4, spawn=counting, log=Log())
    plain = [sys.executable, "-m", "plainmod"]
    assert pool.take(plain, env) is None  # first launch: cold, the key is learnt
    await pool.refill()
    assert len(started) == 1 and warm_key(plain, env) in pool.refused  # one tried, not four
    await pool.refill()
    assert len(started) == 1  # and never again

    cmd = [sys.executable, "-m", "usermod"]
    assert pool.take(cmd, env) is None
    await pool.refill()
    assert len(started) == 1 + 4  # the first, then the other three once it was ready
    assert len(pool.ready[warm_key(cmd, env)]) == 4
    workers = list(pool.ready[warm_key(cmd, env)])
    pool.close()
    # killed with their pipes closed while the loop runs (left open, a pipe is closed
    # when its process object is collected, maybe after the loop: "Event loop is closed")
    assert all(p.stdin.is_closing() and p._transport.get_pipe_transport(1).is_closing() for p in workers)
    assert [await asyncio.wait_for(p.wait(), 30) for p in workers] == [-9] * 4
