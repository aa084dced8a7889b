"""How ``gearshift usage`` grows with the finished jobs in its window:
``python -m loadtest.usage_scale --json [--sizes 5000,10000,20000]``.

A real nats-server and the admission service (its own process). For each size
N the ``GS_USAGE`` stream gets, first, N rows of jobs that finished long
before the window (they must not be read), then N rows of jobs that finished
in the window (three tenants, a few models), written as the archiver writes
them: N jobs finishing over an hour are archived by 3600/interval rounds (at
most one pass per ``ARCHIVE_EVERY_S``), each pass one message per tenant.
Then ``gearshift usage --since <window start> -o json`` runs as a user would
run it (a new process: interpreter start, connect, request, print), and the
request alone is timed from here. Reports the seconds for each N, the ratios
to the smallest N, the rows the server-side read touched (the window's N, not
2N), and whether the totals equal the seeded rows' sums.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import UsageBatch, UsageReply, UsageRow
from gearshift.services.record_writer import ARCHIVE_EVERY_S

TENANTS = ("vision", "nlp", "llm")
MODELS = ("gpt2", "bert", "vit", "llama7")


def rows(n: int, finished_from: float, finished_to: float, tag: str, rng: random.Random) -> list[UsageRow]:
    out = []
    for i in range(n):
        gpus = rng.choice([1, 2, 4, 8])
        run = rng.uniform(60, 3600)
        out.append(UsageRow(
            job_id=f"{tag}{i:06d}", tenant=rng.choice(TENANTS), model=rng.choice(MODELS), gpus=gpus, state="completed",
            submitted_at=finished_from - run, finished_at=rng.uniform(finished_from, finished_to), gpu_s=gpus * run,
            productive_gpu_s=gpus * run * 0.9, wait_s=rng.uniform(0, 600), restarts=rng.randint(0, 3),
            switches=rng.randint(0, 2), switch_s=rng.uniform(0, 30), steps_lost={"switch": rng.randint(0, 50)}))
    return out


async def seed(js, rows_: list[UsageRow], per_pass: int) -> int:
    """As the archiver writes them: ``per_pass`` jobs per archive pass, one message
    per tenant of each pass (``JobStore.publish_usage``). Returns the messages."""
    msgs = []
    for k in range(0, len(rows_), per_pass):
        part = rows_[k:k + per_pass]
        for tenant in sorted({r.tenant for r in part}):
            msgs.append((subj.usage_subject(tenant), codec.encode(UsageBatch(rows=[r for r in part if r.tenant == tenant]))))
    for k in range(0, len(msgs), 500):
        await asyncio.gather(*(js.publish(s, d) for s, d in msgs[k:k + 500]))
    return len(msgs)


async def one_size(url: str, n: int, rng: random.Random, interval: float) -> dict:
    nc = await connect(url)
    js = nc.jetstream()
    try:
        await js.purge_stream(subj.USAGE_STREAM)
        now = time.time()
        # an hour of N finished jobs is archived in at most 3600/ARCHIVE_EVERY_S passes
        # (one per round, and no two within ARCHIVE_EVERY_S)
        per_pass = max(1, round(n * max(interval, ARCHIVE_EVERY_S) / 3600))
        await seed(js, rows(n, now - 30 * 86400, now - 29 * 86400, f"old{n}-", rng), per_pass)  # a month ago
        await asyncio.sleep(0.05)  # the window starts after the old rows were stored
        start = time.time()
        window = rows(n, start, start + 0.01, f"new{n}-", rng)
        messages = await seed(js, window, per_pass)
        since = start
        t = time.perf_counter()
        rep = await call(nc, subj.ADMISSION_USAGE, json.dumps({"since": since}).encode(), UsageReply, timeout=60)
        request_s = time.perf_counter() - t
    finally:
        await nc.drain()
    env = {**os.environ, "GEARSHIFT_NATS_URL": url}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "gearshift.cli", "usage", "--since", f"{since}", "-o", "json"], env=env,
                       capture_output=True, text=True, timeout=120)
    cli_s = time.perf_counter() - t
    cli = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr.strip()}
    want = sum(r.gpu_s for r in window) / 3600
    return {"n": n, "per_archive_pass": per_pass, "messages": messages, "request_s": round(request_s, 3), "cli_s": round(cli_s, 3), "rows_read": rep.rows_read,
            "jobs": rep.total.jobs, "gpu_hours": round(rep.total.gpu_hours, 3),
            "totals_exact": rep.total.jobs == n and abs(rep.total.gpu_hours - want) <= 1e-6 * want,
            "cli_jobs": cli.get("total", {}).get("jobs")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.usage_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="5000,10000,20000", help="finished jobs in the window, comma-separated")
    ap.add_argument("--interval", type=float, default=5.0,
                    help="seconds between the optimizer's rounds (each archives what finished since the last)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="gs-usage-"))
    server = NatsServer(tmp / "js")
    server.start()
    adm = None
    try:
        asyncio.run(_infra(server.url))
        env = {**os.environ, "GEARSHIFT_NATS_URL": server.url, "GEARSHIFT_METRICS_PORT": "0"}
        adm = subprocess.Popen([sys.executable, "-m", "gearshift.services.admission"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(_ready(server.url))
        rng = random.Random(1)
        results = [asyncio.run(one_size(server.url, n, rng, args.interval)) for n in sizes]
    finally:
        if adm is not None:
            adm.terminate()
            adm.wait(timeout=20)
        server.stop()
    base = results[0]
    for r in results:
        r["request_ratio"] = round(r["request_s"] / base["request_s"], 2)
        r["size_ratio"] = round(r["n"] / base["n"], 2)
    ok = all(r["totals_exact"] and r["rows_read"] == r["n"] and r["cli_jobs"] == r["n"] for r in results)
    report = {"ok": ok, "sizes": results,
              "largest_cli_under_2s": results[-1]["cli_s"] < 2.0, "largest_request_under_2s": results[-1]["request_s"] < 2.0}
    print(json.dumps(report, indent=2 if args.json else None))
    return 0 if ok else 1


async def _infra(url: str) -> None:
    nc = await connect(url)
    await ensure_infra(nc)
    await nc.drain()


async def _ready(url: str, timeout: float = 60.0) -> None:
    nc = await connect(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                await call(nc, subj.ADMISSION_USAGE, b'{"since": 0}', UsageReply, timeout=2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await nc.drain()


if __name__ == "__main__":
    sys.exit(main())
