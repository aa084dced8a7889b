"""Metrics, health and the dashboard of a real ``gearshift up``.

    python -m loadtest.observability [--json] [--out DIR]

Starts ``gearshift up`` (2 nodes x 4 emulated GPUs, authorisation on) as a
user would, finds every process's metrics and health endpoints in
``<data>/observe/*.json``, scrapes them all before the run, every 0.5 s
during it and after it, and runs a small workload:

1. a job across all 8 GPUs (both agents launch a rank: every agent's GPU
   gauges and reconcile lag move; the run waits until it has seen both
   agents' GPUs in use, so it holds on any machine);
2. a job of a model nobody profiled (the profiler runs it on the agents, the
   perfmodel service fits it, then it runs);
3. the dashboard's browser tests against this cluster
   (``tests/test_dashboard_browser.py`` in headless Chromium): a job appears
   and runs, one plan switch forced with ``gs.optimizer.reconfigure`` shows on
   the timeline, a cancel from the page is refused for ``tools`` and another
   tenant and works for its own tenant.

Nothing waits on a timer: each step waits for the event it needs. It reports
for every service and agent its endpoints, the families it serves, which of
the expected ones changed (and any that did not), the health answers, and
the browser tests' result with the screenshot paths. Exit 0 when all hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
BROWSER_TESTS = ROOT / "tests" / "test_dashboard_browser.py"
NODES, GPUS = 2, 4
SERVICES = ("admission", "optimizer", "perfmodel", "profiler", "dashboard")

# what each role must show moving during this workload
EXPECTED = {
    "admission": ["gearshift_requests", "gearshift_request_duration_seconds", "gearshift_job_events"],
    "optimizer": ["gearshift_jobs", "gearshift_admission_wait_seconds", "gearshift_round_duration_seconds",
                  "gearshift_decisions", "gearshift_switch_duration_seconds", "gearshift_steps_lost",
                  "gearshift_job_events", "gearshift_requests"],
    "perfmodel": ["gearshift_requests", "gearshift_request_duration_seconds"],
    "profiler": ["gearshift_profile_runs", "gearshift_job_events"],
    "agent": ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "gearshift_gpu_processes",
              "gearshift_agent_reconcile_lag_seconds", "gearshift_agent_runs"],
    "dashboard": ["gearshift_dashboard_actions", "gearshift_dashboard_stream_clients"],
}


def http_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def scrape(url: str) -> dict[str, frozenset]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {f.name: frozenset((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples)
            for f in text_string_to_metric_families(text)}


class Watcher:
    """Scrapes every process; remembers which families differed from the first scrape."""

    def __init__(self, endpoints: dict[str, dict]):
        self.endpoints = endpoints
        self.before = {name: scrape(ep["metrics"]) for name, ep in endpoints.items()}
        self.changed: dict[str, set[str]] = {name: set() for name in endpoints}
        self.scrapes = 1
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def poll(self) -> dict[str, dict[str, frozenset]]:
        now = {}
        for name, ep in self.endpoints.items():
            try:
                fams = scrape(ep["metrics"])
            except OSError as exc:
                self.errors.append(f"{name}: {exc}")
                continue
            now[name] = fams
            with self._lock:
                self.changed[name].update(f for f, samples in fams.items() if samples != self.before[name].get(f))
        with self._lock:
            self.scrapes += 1
        return now

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.poll()

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------ the cluster
def start_up(data: Path, log) -> tuple[subprocess.Popen, dict[str, dict]]:
    cmd = [sys.executable, "-m", "gearshift.cli", "up", "--port", "-1", "--data-dir", str(data / "up"),
           "--nodes", str(NODES), "--gpus-per-node", str(GPUS), "--interval", "1"]
    env = {**os.environ, "GEARSHIFT_LOG_LEVEL": "INFO"}
    env.pop("GEARSHIFT_CREDS", None)
    out = open(data / "gearshift-up.out", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    want = {*SERVICES, *(f"agent-node{i}" for i in range(NODES))}
    observe = data / "up" / "observe"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gearshift up exited with {proc.returncode}; see {data / 'gearshift-up.out'}")
        found = {f.stem: json.loads(f.read_text()) for f in observe.glob("*.json")} if observe.exists() else {}
        if want <= found.keys() and "dashboard" in found["dashboard"] and "dashboard" in (data / "gearshift-up.out").read_text():
            if all(http_json(found[n]["readyz"])[0] == 200 for n in want):
                log(f"gearshift up ready: {len(found)} processes announced")
                return proc, {n: found[n] for n in sorted(want)}
        time.sleep(0.5)
    raise TimeoutError(f"gearshift up not ready in 180 s; see {data / 'gearshift-up.out'}")


def stop_up(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ------------------------------------------------------------------ the workload
def _spec(name: str, tenant: str, gpus: int, plan: dict, steps: int, step_time: float, model: dict | None = None):
    from gearshift.bus_schema import codec
    from gearshift.bus_schema.messages import JobSpec

    return codec.convert({
        "name": name, "tenant": tenant, "gpus": gpus, "global_batch": 16, "steps": steps, "step_time": step_time,
        "plan": plan, "model": model or {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024},
    }, JobSpec)


async def workload(data: Path, watcher: Watcher, log) -> dict[str, Any]:
    from gearshift.bus.auth import connect_options, load_creds
    from gearshift.bus.client import connect
    from gearshift.client import Client

    admin = load_creds(data / "up" / "auth" / "admin.creds")
    client = Client(await connect(admin["url"], name="observability", retry_for=10, **connect_options(admin)))
    jobs: dict[str, str] = {}
    try:
        async def until(job_id: str, states: set[str], timeout: float = 300) -> str:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                state = (await client.job(job_id)).state.value
                if state in states:
                    return state
                await asyncio.sleep(0.3)
            raise TimeoutError(f"job {job_id} not {states} in {timeout:.0f} s")

        # 1. one job over both nodes: every agent launches a rank
        wide = await client.submit(_spec("obs-wide", "vision", NODES * GPUS, {"dp": NODES * GPUS}, 200, 0.05))
        jobs["wide"] = wide.job_id
        await until(wide.job_id, {"running"})
        agents = [n for n in watcher.endpoints if n.startswith("agent-")]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the GPU gauges of every agent showed the job (heartbeats)
            now = await asyncio.to_thread(watcher.poll)
            busy = {a for a in agents if any(v > 0 for n, _, v in now.get(a, {}).get("DCGM_FI_DEV_FB_USED", ()))}
            if busy == set(agents):
                break
            await asyncio.sleep(0.3)
        log("wide job seen on every agent's GPUs")
        await until(wide.job_id, {"completed"})
        # 2. a model nobody profiled: profiler runs, perfmodel fits
        fresh = await client.submit(_spec("obs-fresh", "default", 2, {"dp": 2}, 20, 0.02, model={
            "name": "obs-probe", "params": 350, "layers": 24, "hidden": 1024, "seq_len": 512}))
        jobs["fresh"] = fresh.job_id
        await until(fresh.job_id, {"completed"}, timeout=600)
        log("unprofiled job profiled, fitted and completed")
        return {"jobs": {k: (await client.job(v)).state.value for k, v in jobs.items()}, "job_ids": jobs}
    finally:
        await client.close()


def browser_tests(data: Path, out: Path, log) -> dict[str, Any]:
    shots = out / "screenshots"
    junit = out / "dashboard-tests.xml"
    env = {**os.environ, "GEARSHIFT_DASHBOARD_CLUSTER": str(data / "up"), "GEARSHIFT_SCREENSHOT_DIR": str(shots),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(BROWSER_TESTS),
                        f"--junitxml={junit}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    (out / "dashboard-tests.out").write_text(p.stdout + p.stderr)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    cases = []
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in counts}
        for case in suite.iter("testcase"):
            bad = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
            cases.append({"test": case.get("name"), "result": bad[0] if bad else "passed"})
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    log(f"dashboard browser tests: {passed}/{counts['tests']} passed")
    return {"ok": p.returncode == 0 and passed == counts["tests"] > 0, "passed": passed, **counts, "cases": cases,
            "screenshots": sorted(str(s) for s in shots.glob("*.png")), "output": str(out / "dashboard-tests.out")}


# ------------------------------------------------------------------ report
def run(out: Path, log) -> dict[str, Any]:
    data = out
    proc, endpoints = start_up(data, log)
    report: dict[str, Any] = {"gearshift_up": {"data_dir": str(data / "up"),
                                               "dashboard": endpoints["dashboard"].get("dashboard")}}
    try:
        with Watcher(endpoints) as watcher:
            health_before = {n: http_json(ep["readyz"]) for n, ep in endpoints.items()}
            report["workload"] = asyncio.run(workload(data, watcher, log))
            report["dashboard_tests"] = browser_tests(data, out, log)
            watcher.poll()
        processes = {}
        for name, ep in endpoints.items():
            role = ep["role"]
            served = sorted(watcher.before[name])
            changed = watcher.changed[name]
            live = http_json(ep["healthz"])
            ready = http_json(ep["readyz"])
            processes[name] = {
                "role": role, "metrics": ep["metrics"], "healthz": ep["healthz"], "readyz": ep["readyz"],
                "families": served,
                "expected_changed": {f: f in changed for f in EXPECTED[role]},
                "missing_changes": [f for f in EXPECTED[role] if f not in changed],
                "also_changed": sorted(changed - set(EXPECTED[role])),
                "health": {"healthz": {"status": live[0], "body": live[1]},
                           "readyz_before_run": {"status": health_before[name][0], "body": health_before[name][1]},
                           "readyz": {"status": ready[0], "body": ready[1]}},
            }
        report["processes"] = processes
        report["scrapes"] = watcher.scrapes
        report["scrape_errors"] = watcher.errors[:10]
    finally:
        report["gearshift_up"]["exit_code"] = stop_up(proc)
    problems = []
    for name, p in report.get("processes", {}).items():
        problems += [f"{name}: {f} did not change" for f in p["missing_changes"]]
        if p["health"]["healthz"]["status"] != 200 or p["health"]["readyz"]["status"] != 200:
            problems.append(f"{name}: not healthy and ready after the run")
    wl = report.get("workload", {}).get("jobs", {})
    problems += [f"job {k} ended {v}" for k, v in wl.items() if v != "completed"]
    if not report.get("dashboard_tests", {}).get("ok"):
        problems.append("dashboard browser tests did not all pass")
    if report["gearshift_up"]["exit_code"] != 0:
        problems.append(f"gearshift up exited with {report['gearshift_up']['exit_code']}")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.observability", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--out", default=None, help="folder for the cluster, logs and screenshots (default: a new temp dir)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gearshift-observability-")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[observability] {msg}", file=sys.stderr, flush=True)

    try:
        report = run(out, log)
    except (RuntimeError, TimeoutError, OSError) as exc:
        report = {"ok": False, "problems": [f"{type(exc).__name__}: {exc}"], "out": str(out)}
    report["out"] = str(out)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for name, p in report.get("processes", {}).items():
            moved = sum(p["expected_changed"].values())
            print(f"{name:<12} {p['metrics']:<36} {len(p['families'])} families, {moved}/{len(p['expected_changed'])} "
                  f"expected moved, readyz {p['health']['readyz']['status']}")
        dt = report.get("dashboard_tests", {})
        print(f"dashboard tests: {dt.get('passed')}/{dt.get('tests')} passed; screenshots: {dt.get('screenshots')}")
        print("OK" if report["ok"] else "PROBLEMS:\n  " + "\n  ".join(report["problems"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
