"""Fault injection (loadtest.chaos) with real processes: a short single-server
run in make test, the full two-scenario 50-job run in the slow set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def chaos(*args: str, timeout: float) -> dict:
    p = subprocess.run([sys.executable, "-m", "loadtest.chaos", "--json", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert p.stdout, p.stderr[-3000:]
    return json.loads(p.stdout)


def assert_correct(s: dict) -> None:
    assert s["lost_jobs"] == 0 and s["submit_failed"] == 0
    assert s["duplicate_events"] == 0 and s["event_gaps"] == 0 and s["kv_event_mismatches"] == 0
    assert s["jobs_without_exactly_one_terminal_event"] == 0
    assert s["two_generations_at_once"] == 0 and s["same_generation_twice_on_a_node"] == 0
    assert s["failed"] == 0


@pytest.mark.timeout(300)
def test_small_run_survives_service_kills_and_a_server_restart():
    report = chaos("--jobs", "8", "--scenario", "single", "--submit-over", "8", "--kills", "1", "--deadline", "150",
                   timeout=280)
    s = report["summary"]
    assert_correct(s)
    assert s["jobs"] == 8 and s["completed"] + s["cancelled"] == 8
    for kind in ("kill_admission", "kill_optimizer", "kill_perfmodel", "restart_nats_server", "kill_agent_mid_switch"):
        assert s["faults"].get(kind, 0) >= 1, s["faults"]
    assert s["auth"] and not s["fault_kinds_missing"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_run_every_fault_kind():
    report = chaos("--jobs", "50", timeout=1700)
    s = report["summary"]
    assert_correct(s)
    assert s["ok"] and not s["fault_kinds_missing"], s
