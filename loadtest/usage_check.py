"""Accounting against Prometheus in a chaos run (``loadtest.chaos`` calls this).

``CounterScraper`` does what Prometheus does: it scrapes the optimizer's
``/metrics`` (the address its process announces in ``GEARSHIFT_OBSERVE_DIR``)
every ``every`` seconds and sums ``gearshift_gpu_seconds_total{kind="held"}``
per tenant over the processes' lifetimes (a restarted process starts its
counters at 0, as ``increase()`` reads them). ``compare`` runs
``gearshift usage --since 1h -o json`` as the admin, once every finished job
has moved to the history store, and sets the GPU-hours per tenant beside the
counters'.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

_SAMPLE = re.compile(r'^gearshift_gpu_seconds_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')


def parse(text: str) -> dict[str, float]:
    """Held GPU-seconds per tenant in one scrape."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        if labels.get("kind") == "held":
            out[labels["tenant"]] = float(m.group("value"))
    return out


class CounterScraper(threading.Thread):
    def __init__(self, observe_dir: Path, name: str = "optimizer", every: float = 0.25):
        super().__init__(daemon=True)
        self.path = Path(observe_dir) / f"{name}.json"
        self.every = every
        self.last: dict[str, dict[str, float]] = {}  # process's metrics URL -> its latest values
        self.scrapes = 0
        self.stop_flag = threading.Event()

    def scrape(self) -> None:
        try:
            url = json.loads(self.path.read_text())["metrics"]
        except (OSError, ValueError, KeyError):
            return  # not announced (yet, or being replaced)
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                got = parse(r.read().decode())
        except OSError:
            return  # killed, or restarting
        self.last[url] = got
        self.scrapes += 1

    def run(self) -> None:
        while not self.stop_flag.wait(self.every):
            self.scrape()

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for values in self.last.values():
            for tenant, v in values.items():
                out[tenant] = out.get(tenant, 0.0) + v
        return out


async def wait_archived(nc: Any, job_ids: list[str], within: float = 120.0) -> bool:
    """Every one of ``job_ids`` moved to the history store (``archive_after`` after its end)."""
    import asyncio

    from gearshift.bus_schema import subjects as subj

    kv = await nc.jetstream().key_value(subj.HISTORY_BUCKET)
    left = set(job_ids)
    deadline = time.monotonic() + within
    while left and time.monotonic() < deadline:
        for job_id in list(left):
            try:
                await kv.get(job_id)
                left.discard(job_id)
            except Exception:
                pass
        if left:
            await asyncio.sleep(1.0)
    return not left


def compare(scraper: CounterScraper, url: str, creds: str | None, tolerance: float = 0.01) -> dict[str, Any]:
    scraper.scrape()  # the last word, after the archive passes
    env = {**os.environ, "GEARSHIFT_NATS_URL": url}
    if creds:
        env["GEARSHIFT_CREDS"] = creds
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "gearshift.cli", "usage", "--since", "1h", "-o", "json"], env=env,
                       capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr.strip()}
    rep = json.loads(p.stdout)
    usage = {g["key"]: g["gpu_hours"] for g in rep["groups"]}
    counters = {k: v / 3600 for k, v in scraper.totals().items()}
    per = {}
    for tenant in sorted(set(usage) | set(counters)):
        u, c = usage.get(tenant, 0.0), counters.get(tenant, 0.0)
        per[tenant] = {"usage_gpu_hours": round(u, 6), "counter_gpu_hours": round(c, 6),
                       "rel_diff": round(abs(u - c) / max(c, u, 1e-12), 6)}
    return {"ok": bool(per) and all(v["rel_diff"] <= tolerance for v in per.values()), "tenants": per,
            "jobs": rep["total"]["jobs"], "rows_read": rep["rows_read"], "live": rep["live"],
            "usage_cli_s": round(took, 3), "scrapes": scraper.scrapes, "optimizer_lifetimes": len(scraper.last)}
