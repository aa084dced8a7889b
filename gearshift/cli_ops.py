"""Operator verbs of the ``gearshift`` command: up, explain, reconfigure,
cordon/drain/uncordon, logs, top."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from gearshift import render
from gearshift.bus.client import ServiceCallError
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import ExplainEntry, JobState, NodeShare, Plan
from gearshift.client import Client, SpecFileError


# ------------------------------------------------------------------ up
def add_up(up: argparse.ArgumentParser) -> None:
    up.add_argument("--nodes", type=int, default=2, help="emulated GPU nodes (one agent process each)")
    up.add_argument("--gpus-per-node", type=int, default=4, help="emulated GPUs per node")
    up.add_argument("--cpus-per-node", type=int, default=32, help="CPU threads per node")
    up.add_argument("--port", type=int, default=4222, help="client port of nats-server (-1: random)")
    up.add_argument("--data-dir", default=None, help="JetStream, job files and logs (default: a temp dir)")
    up.add_argument("--policy", default="fifo", help="scheduling policy (fifo, las, srtf, tiresias, antman, synergy, "
                                                     "sia, rubick)")
    up.add_argument("--interval", type=float, default=2.0, help="seconds between timer rounds")
    up.add_argument("--no-auth", action="store_true", help="no users or permissions (anyone may do anything)")
    up.add_argument("--tenants", default="default,vision,nlp,llm", help="tenants to make users for (comma-separated)")


def _last_lines(path: Path, n: int = 1) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln.strip()[:300] for ln in lines[-n:])


def cmd_up(args: argparse.Namespace) -> int:
    from gearshift.bus.log import configure_logging
    from gearshift.cluster import LocalCluster

    configure_logging("console")
    cluster = LocalCluster(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node, port=args.port,
        data_dir=args.data_dir, policy=args.policy, interval=args.interval, auth=not args.no_auth,
        tenants=args.tenants.split(","),
    )
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failed: str | None = None
    try:
        url = cluster.start()
        print(url, flush=True)
        export = f"export GEARSHIFT_NATS_URL={url}"
        if cluster.auth_dir is not None:
            from gearshift.bus.auth import well_known_file

            admin = cluster.admin_creds
            assert admin is not None
            # the CLI finds the admin credentials for this URL here when GEARSHIFT_CREDS is unset
            known = well_known_file(url)
            known.parent.mkdir(parents=True, exist_ok=True)
            known.write_text(Path(admin).read_text())
            known.chmod(0o600)
            export += f" GEARSHIFT_CREDS={admin}"
            print(f"gearshift up: authorisation on; credentials (one per role) in {cluster.auth_dir.root}",
                  file=sys.stderr, flush=True)
        print(f"gearshift up: {args.nodes} nodes x {args.gpus_per_node} GPUs, policy {args.policy}; "
              f"logs in {cluster.log_dir}. Ctrl-C stops.\n{export}", file=sys.stderr, flush=True)
        print(f"gearshift up: dashboard {cluster.dashboard_url} ; metrics and health of every process: "
              f"{cluster.observe_dir}/*.json", file=sys.stderr, flush=True)
        while not stopping:
            dead = cluster.check_alive()
            if dead:
                failed = "exited: " + "; ".join(
                    f"{n} ({_last_lines(Path(cluster.log_dir or '.') / f'{n}.log') or 'no output'})" for n in dead)
                break
            time.sleep(0.2)
    except Exception as exc:  # start-up failed: a busy port, a process that died, a time-out
        dead = cluster.check_alive()
        why = "; ".join(f"{n}: {_last_lines(Path(cluster.log_dir or '.') / f'{n}.log') or 'no output'}" for n in dead)
        failed = why or str(exc).split("\n")[0]
    finally:
        cluster.stop(keep_logs=failed is not None)
    if failed is not None:
        print(f"gearshift up: failed: {failed}", file=sys.stderr)
        print(f"gearshift up: logs kept in {cluster.log_dir}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ operator verbs
def add_operator_verbs(verb: Callable[..., argparse.ArgumentParser]) -> None:
    ex = verb("explain", "why each job waits or runs where it does (the optimizer's last round)")
    ex.add_argument("id", nargs="?", default=None, help="only this job")
    ex.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")

    rc = verb("reconfigure", "pin a job's plan (and placement) or unpin it; the optimizer switches it")
    rc.add_argument("id", help="job id")
    what = rc.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", default=None,
                      help="the plan as key=value pairs, e.g. dp=2,tp=2,pp=1,zero=1,ga=1,micro_batch=4,grad_ckpt=false,"
                           "offload=false (omitted keys: defaults), or a JSON object")
    what.add_argument("--unpin", action="store_true", help="let the policy choose the plan again")
    rc.add_argument("--on", default=None, help="placement as node:gpus pairs, e.g. node0:2,node1:2 (default: any)")
    rc.add_argument("--reason", default="", help="why (shown in the job's reason and events)")

    for name, mode, text in (("cordon", "cordoned", "no new job lands on a node; its jobs keep running"),
                             ("drain", "draining", "cordon a node and move its jobs away (they resume elsewhere "
                                                   "from their checkpoints)"),
                             ("uncordon", "active", "let a cordoned or drained node take jobs again")):
        p = verb(name, text)
        p.add_argument("node", help="node name")
        p.add_argument("--reason", default="", help="why (kept with the node's mode)")
        p.set_defaults(mode=mode)
        if name == "drain":
            p.add_argument("--wait", type=float, default=0.0,
                           help="wait up to this many seconds until no job is left on the node")

    lg = verb("logs", "print a job's rank logs (the tail of each rank's output)")
    lg.add_argument("id", help="job id")
    lg.add_argument("--rank", type=int, default=None, help="only this global rank")
    lg.add_argument("--generation", type=int, default=None, help="this generation (default: the latest)")
    lg.add_argument("--tail", type=int, default=16 * 1024, help="bytes from the end of each log (at most 65536)")

    tp = verb("top", "the cluster at a glance: nodes, GPUs and running jobs with their speed; refreshes")
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print once and exit")


def parse_plan(text: str) -> Plan:
    """``dp=2,tp=2,zero=1`` or a JSON object -> Plan; errors name the key."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecFileError(f"--plan: not valid JSON: {exc}") from None
    else:
        data = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise SpecFileError(f"--plan: {part!r} is not key=value")
            v = value.strip().lower()
            data[key.strip()] = True if v == "true" else False if v == "false" else int(v) if v.isdigit() else value
    try:
        return msgspec.convert(data, Plan)
    except msgspec.ValidationError as exc:
        raise SpecFileError(f"--plan: {codec.error_field(exc) or 'plan'}: {exc}") from None


def parse_placement(text: str | None) -> list[NodeShare]:
    if not text:
        return []
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        node, sep, gpus = part.partition(":")
        if not sep or not gpus.isdigit() or int(gpus) < 1:
            raise SpecFileError(f"--on: {part!r} is not node:gpus (e.g. node0:2)")
        try:
            out.append(msgspec.convert({"node": node, "gpus": int(gpus)}, NodeShare))
        except msgspec.ValidationError as exc:
            raise SpecFileError(f"--on: {part!r}: {exc}") from None
    return out


async def _connected(args: argparse.Namespace, fn) -> int:
    from gearshift.cli import _with_client

    return await _with_client(args, fn)


async def cmd_explain(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        rep = await c.explain()
        entries = [e for e in rep.jobs if args.id is None or e.job_id == args.id]
        if args.id is not None and not entries:  # not in the last round (finished, or new): its record says why
            j = await c.job(args.id)  # 404 if there is no such job
            entries = [ExplainEntry(job_id=j.job_id, state=j.state.value, reason=j.reason)]
        if args.output == "json":
            print(json.dumps(codec.to_builtins(msgspec.structs.replace(rep, jobs=entries)), indent=2))
            return 0
        print(f"policy {rep.policy}, round {rep.round}")
        print(render.table([[e.job_id, e.state, e.reason] for e in entries], ["JOB", "DECISION", "REASON"]))
        return 0

    return await _connected(args, go)


async def cmd_reconfigure(args: argparse.Namespace) -> int:
    plan = None if args.unpin else parse_plan(args.plan)
    placement = parse_placement(args.on)
    if args.unpin and placement:
        raise SpecFileError("--on: a placement goes with --plan, not --unpin")

    async def go(c: Client) -> int:
        r = await c.reconfigure(args.id, plan, placement, args.reason)
        print(f"{r.job_id} pinned to {plan.label()}" if plan is not None and r.pinned else f"{r.job_id} unpinned")
        return 0

    return await _connected(args, go)


async def cmd_node_mode(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        rep = await c.node_modes(args.node, args.mode, args.reason)
        entry = next((e for e in rep.nodes if e.node == args.node), None)
        if args.mode == "active":
            print(f"{args.node} active")
            return 0
        assert entry is not None
        deadline = time.monotonic() + getattr(args, "wait", 0.0)
        while entry.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            entry = next((e for e in (await c.node_modes(args.node)).nodes if e.node == args.node), entry)
        label = render._mode_label(entry)
        jobs = f"; jobs still there: {', '.join(entry.jobs)}" if entry.jobs else "; no job on it"
        print(f"{args.node} {label}{jobs}")
        return 0

    return await _connected(args, go)


async def cmd_logs(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        j = await c.job(args.id)
        nodes = [p.node for p in j.placement] or [n.node for n in (await c.nodes()).nodes]
        printed = 0
        for node in nodes:
            try:
                rep = await c.logs(node, j.job_id, rank=args.rank, generation=args.generation, tail_bytes=args.tail)
            except ServiceCallError as exc:
                if exc.code == "503":  # that node's agent is gone
                    print(f"==> {node}: no agent answers <==", file=sys.stderr)
                    continue
                raise
            for log in rep.logs:
                print(f"==> {rep.node} rank {log.rank} (generation {log.generation}, {log.size} bytes"
                      f"{', tail' if log.truncated else ''}) <==")
                sys.stdout.write(log.text if log.text.endswith("\n") or not log.text else log.text + "\n")
                printed += 1
        if not printed:
            what = f"rank {args.rank}" if args.rank is not None else "any rank"
            raise ServiceCallError("404", f"no log of {what} of {j.job_id} on {', '.join(nodes) or 'any node'}",
                                   "rank" if args.rank is not None else "job_id")
        return 0

    return await _connected(args, go)


async def cmd_top(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        tty = sys.stdout.isatty()
        while True:
            nodes = (await c.nodes()).nodes
            modes = await _modes(c)
            running = [j for j in await c.jobs(states=["scheduled", "running", "cancelling"])]
            pending = await c.jobs(states=["pending"])
            gpus = sum(len(n.gpus) for n in nodes)
            used = sum(len(p.gpus) for j in running for p in j.placement)
            out = [f"gearshift top  {time.strftime('%H:%M:%S')}  nodes {len(nodes)}  GPUs {used}/{gpus} allocated  "
                   f"running {sum(1 for j in running if j.state == JobState.RUNNING)}  pending {len(pending)}", "",
                   render.table(render.node_rows(nodes, modes), render.node_headers(nodes)), "",
                   render.table(render.job_rows(sorted(running, key=lambda j: -j.spec.gpus)), render.JOB_HEADERS)]
            if pending:
                out += ["", render.table([[j.job_id, j.spec.tenant, str(j.spec.gpus), j.reason[:80]] for j in pending[:20]],
                                        ["PENDING", "TENANT", "GPUS", "REASON"])]
            if tty and not args.once:
                sys.stdout.write("\x1b[H\x1b[2J")
            print("\n".join(out), flush=True)
            if args.once:
                return 0
            await asyncio.sleep(args.interval)

    return await _connected(args, go)


async def _modes(c: Client) -> dict[str, Any] | None:
    from gearshift.cli import _modes as modes

    return await modes(c)


ASYNC_COMMANDS = {"explain": cmd_explain, "reconfigure": cmd_reconfigure, "cordon": cmd_node_mode,
                  "drain": cmd_node_mode, "uncordon": cmd_node_mode, "logs": cmd_logs, "top": cmd_top}
