"""Services collect garbage less often (bus/process.py tune_gc): issue 11's submit tail."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = "import gc; from gearshift.bus.process import tune_gc; tune_gc(); print(gc.get_threshold()[0], gc.get_freeze_count() > 0)"


def _run(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GEARSHIFT_GC_THRESHOLD"}
    if value is not None:
        env["GEARSHIFT_GC_THRESHOLD"] = value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_services_default_to_a_larger_young_generation_and_freeze_start_up_objects():
    p = _run(None)
    assert p.returncode == 0 and p.stdout.split() == ["50000", "True"]


def test_zero_keeps_pythons_defaults_and_a_number_sets_it():
    default = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold()[0])"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    assert _run("0").stdout.split() == [default, "False"]
    assert _run("1234").stdout.split() == ["1234", "True"]


def test_a_bad_value_is_one_line_without_traceback():
    p = _run("lots")
    assert p.returncode != 0 and "GEARSHIFT_GC_THRESHOLD" in p.stderr and "Traceback" not in p.stderr
