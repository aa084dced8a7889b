"""One import root (issue 22): the built wheel installs only ``gearshift``,
without the harness (``loadtest``, ``tests``), with a console script per entry
point, and ``gearshift-agent --help`` runs from a virtualenv that has only that
wheel (its dependencies come from this environment's site-packages through
``PYTHONPATH``, which does not process the editable install's ``.pth`` hook)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: no download; this environment has setuptools (pyproject's build-system)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("gearshift-*.whl")
    return whl


def test_the_wheels_only_top_level_package_is_gearshift(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gearshift"}, sorted(tops)
    for folder in ("bus", "bus_schema", "services", "agent", "agent/reference", "perfmodel", "policies", "sim"):
        assert f"gearshift/{folder}/__init__.py" in names, folder
    assert not any(n.startswith(("gearshift/loadtest", "gearshift/tests", "loadtest/", "tests/")) for n in names)
    # data the code reads at run time travels with it
    assert any(n.startswith("gearshift/sim/data/") for n in names)
    assert any(n.startswith("gearshift/perfmodel/data/") for n in names)
    assert any(n.startswith("gearshift/services/dashboard_static/") for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in declared.items():
        assert f"{name} = {target}" in scripts, name
    assert {"gearshift-admission", "gearshift-optimizer", "gearshift-agent"} <= set(declared)


def test_gearshift_agent_help_from_a_venv_with_only_the_wheel(wheel, tmp_path):
    env_dir = tmp_path / "clean"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    deps = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GEARSHIFT_", "NUMBA_"))}
    env["PYTHONPATH"] = deps
    env["HOME"] = str(tmp_path)
    r = subprocess.run([str(env_dir / "bin" / "gearshift-agent"), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--node" in r.stdout and "--config" in r.stdout
    # the code ran from the wheel, not from this checkout
    r = subprocess.run([str(py), "-c", "import gearshift.agent, gearshift; print(gearshift.agent.__file__); "
                        "print(gearshift.numba_cache_dir())"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=env)
    agent_file, cache = r.stdout.split()
    assert str(env_dir) in agent_file and str(ROOT) not in agent_file
    # numba's cache goes to the user's cache directory, not into site-packages
    assert cache == str(tmp_path / ".cache" / "gearshift" / "numba")
