"""The ``gearshift`` command.

    gearshift up [--nodes N --gpus-per-node G --port P]
    gearshift submit FILE
    gearshift get jobs|nodes [-o json]
    gearshift describe job ID
    gearshift cancel ID
    gearshift events [--follow] [--job ID] [-o json]
    gearshift schema
    gearshift perfmodel validate [...]
    gearshift simulate [...]

The server comes from ``--server`` or ``GEARSHIFT_NATS_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bus_schema import codec
from bus_schema.messages import JobRecord, NodeReport
from services.runtime import ServerUnavailable, ServiceCallError, server_url

from .client import Client, SpecFileError, load_spec


def _print_json(obj: Any) -> None:
    print(json.dumps(codec.to_builtins(obj), indent=2))


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    for r in rows:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    return "\n".join(lines)


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else (f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h")


def job_rows(jobs: list[JobRecord]) -> list[list[str]]:
    rows = []
    for j in jobs:
        plan = j.plan.label() if j.plan else (j.spec.plan.label() if j.spec.plan else "-")
        nodes = ",".join(f"{p.node}:{len(p.gpus)}" for p in j.placement) or "-"
        rows.append([
            j.job_id, j.spec.name, j.spec.tenant, j.state.value, str(j.spec.gpus), plan, nodes,
            f"{j.steps_done}/{j.spec.steps}", _ago(j.submitted_at), j.reason[:60],
        ])
    return rows


async def _with_client(args: argparse.Namespace, fn) -> int:
    client = await Client.connect(args.server)
    try:
        return await fn(client)
    finally:
        await client.close()


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)

    async def go(c: Client) -> int:
        reply = await c.submit(spec, token=args.token)
        print(reply.job_id)
        return 0

    return await _with_client(args, go)


async def cmd_get(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        if args.what in ("jobs", "job"):
            filters: dict[str, Any] = {"all": args.all, "limit": args.page_size}
            if args.state:
                filters["states"] = args.state.split(",")
            if args.node:
                filters["node"] = args.node
            jobs = await c.jobs(tenant=args.tenant, **filters)
            if args.output == "json":
                _print_json(jobs)
            else:
                print(_table(job_rows(jobs), ["ID", "NAME", "TENANT", "STATE", "GPUS", "PLAN", "NODES", "STEPS", "AGE", "REASON"]))
        else:
            nodes = (await c.nodes()).nodes
            if args.output == "json":
                _print_json(nodes)
            else:
                print(_table(node_rows(nodes), ["NODE", "GPUS", "USED", "CPUS", "PROBE", "RUNNING", "HEARTBEAT"]))
        return 0

    return await _with_client(args, go)


def node_rows(nodes: list[NodeReport]) -> list[list[str]]:
    rows = []
    for n in nodes:
        used = sum(1 for g in n.gpus if g.processes)
        rows.append([n.node, str(len(n.gpus)), str(used), str(n.cpus), n.probe, ",".join(n.running) or "-", _ago(n.ts)])
    return rows


async def cmd_describe(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        j = await c.job(args.id)
        if args.output == "json":
            _print_json(j)
            return 0
        print(f"Job:        {j.job_id} ({j.spec.name})")
        print(f"Tenant:     {j.spec.tenant}   guaranteed: {j.spec.guaranteed}   priority: {j.spec.priority}")
        print(f"State:      {j.state.value}   reason: {j.reason}")
        print(f"Model:      {j.spec.model.name} ({j.spec.model.params:g}M params, {j.spec.model.layers} layers)")
        print(f"Request:    {j.spec.gpus} GPUs, plan {j.spec.plan.label() if j.spec.plan else 'any'}, "
              f"batch {j.spec.global_batch}, {j.spec.steps} steps")
        print(f"Allocation: generation {j.generation}, plan {j.plan.label() if j.plan else '-'}, "
              + (", ".join(f"{p.node} GPUs {p.gpus} CPUs {p.cpus}" for p in j.placement) or "none"))
        print(f"Progress:   {j.steps_done}/{j.spec.steps} steps, restarts {j.restarts}")
        for label, ts in (("Submitted", j.submitted_at), ("Scheduled", j.scheduled_at), ("Started", j.started_at),
                          ("Finished", j.finished_at)):
            if ts:
                print(f"{label + ':':<11} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))}")
        print("Events:")
        try:
            async for subject, _, ev in c.events(subject=f"gs.evt.job.{j.job_id}.>"):
                print(f"  {time.strftime('%H:%M:%S', time.localtime(ev.ts))}  {ev.__struct_config__.tag:<22} "
                      f"{getattr(ev, 'reason', '')}")
        except Exception as exc:  # a tenant identity may not read the event stream
            print(f"  (not readable with these credentials: {type(exc).__name__})")
        return 0

    return await _with_client(args, go)


async def cmd_cancel(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        j = await c.cancel(args.id)
        print(f"{j.job_id} {j.state.value}")
        return 0

    return await _with_client(args, go)


async def cmd_events(args: argparse.Namespace) -> int:
    subject = f"gs.evt.job.{args.job}.>" if args.job else "gs.evt.>"

    async def go(c: Client) -> int:
        collected = []
        async for subject_, seq, ev in c.events(follow=args.follow, subject=subject):
            item = {"stream_seq": seq, "subject": subject_, **codec.to_builtins(ev)}
            if args.output == "json" and not args.follow:
                collected.append(item)
            elif args.output == "json":
                print(json.dumps(item), flush=True)
            else:
                who = getattr(ev, "job_id", None) or getattr(ev, "node", None) or ""
                extra = getattr(ev, "reason", "") or ""
                print(f"{time.strftime('%H:%M:%S', time.localtime(ev.ts))}  {ev.__struct_config__.tag:<22} {who:<16} {extra}",
                      flush=True)
        if args.output == "json" and not args.follow:
            print(json.dumps(collected, indent=2))
        return 0

    return await _with_client(args, go)


def cmd_schema(args: argparse.Namespace) -> int:
    from bus_schema.schema import bus_schema

    print(json.dumps(bus_schema(), indent=2, sort_keys=True))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.runtime import configure_logging

    from .cluster import LocalCluster

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
    try:
        url = cluster.start()
        print(url, flush=True)
        export = f"export GEARSHIFT_NATS_URL={url}"
        if cluster.auth_dir is not None:
            from services.auth import well_known_file

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
                print(f"gearshift up: process(es) exited: {', '.join(dead)}; see {cluster.log_dir}", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gearshift", description="GPU-cluster scheduler that reconfigures training plans")
    ap.add_argument("--server", default=None, help="NATS URL (default $GEARSHIFT_NATS_URL or nats://127.0.0.1:4222)")
    ap.add_argument("--creds", default=None,
                    help="credentials file (default $GEARSHIFT_CREDS, else the one `gearshift up` left for the server)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run a local cluster: nats-server, services, emulated GPU nodes")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--gpus-per-node", type=int, default=4)
    up.add_argument("--cpus-per-node", type=int, default=32)
    up.add_argument("--port", type=int, default=4222, help="client port (-1: random)")
    up.add_argument("--data-dir", default=None, help="JetStream and job files (default: a temp dir)")
    up.add_argument("--policy", default="fifo")
    up.add_argument("--interval", type=float, default=2.0, help="seconds between timer rounds")
    up.add_argument("--no-auth", action="store_true", help="no users or permissions (anyone may do anything)")
    up.add_argument("--tenants", default="default,vision,nlp,llm", help="tenants to make users for (comma-separated)")

    s = sub.add_parser("submit", help="submit a job spec (JSON or YAML); prints the job id")
    s.add_argument("file")
    s.add_argument("--token", default=None, help="idempotency token: resubmitting returns the same job")

    g = sub.add_parser("get", help="list jobs or nodes")
    g.add_argument("what", choices=["jobs", "job", "nodes", "node"])
    g.add_argument("-o", "--output", choices=["table", "json"], default="table")
    g.add_argument("--tenant", default=None)
    g.add_argument("--all", action="store_true", help="jobs: finished ones in the history store too")
    g.add_argument("--state", default=None, help="jobs: only these states (comma-separated)")
    g.add_argument("--node", default=None, help="jobs: only those placed on this node")
    g.add_argument("--page-size", type=int, default=1000, help="jobs: how many to ask for per request")

    d = sub.add_parser("describe", help="show one job with its events")
    d.add_argument("kind", choices=["job"])
    d.add_argument("id")
    d.add_argument("-o", "--output", choices=["text", "json"], default="text")

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("id")

    e = sub.add_parser("events", help="replay the event stream from the start")
    e.add_argument("--follow", "-f", action="store_true")
    e.add_argument("--job", default=None)
    e.add_argument("-o", "--output", choices=["text", "json"], default="text")

    sub.add_parser("schema", help="print the JSON Schema of every bus message")

    pm = sub.add_parser("perfmodel", help="performance model tools", add_help=False)
    pm.add_argument("rest", nargs=argparse.REMAINDER)
    sm = sub.add_parser("simulate", help="trace-driven simulation of policies", add_help=False)
    sm.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Tools with their own parsers get their arguments untouched (argparse's
    # REMAINDER cannot take a leading option such as `simulate --trace`).
    if argv and argv[0] == "simulate":
        from sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv and argv[0] == "perfmodel":
        return _perfmodel(argv[1:])
    args = build_parser().parse_args(argv)
    if args.server:
        os.environ["GEARSHIFT_NATS_URL"] = args.server
    if args.creds:
        os.environ["GEARSHIFT_CREDS"] = args.creds
    elif args.cmd != "up" and not os.environ.get("GEARSHIFT_CREDS") and not os.environ.get("GEARSHIFT_USER"):
        from services.auth import well_known_file

        known = well_known_file(server_url())
        if known.exists():
            os.environ["GEARSHIFT_CREDS"] = str(known)
    try:
        if args.cmd == "up":
            return cmd_up(args)
        if args.cmd == "schema":
            return cmd_schema(args)
        if args.cmd == "perfmodel":
            return _perfmodel(args.rest)
        if args.cmd == "simulate":
            from sim.cli import main as sim_main

            return sim_main(args.rest)
        fn = {"submit": cmd_submit, "get": cmd_get, "describe": cmd_describe, "cancel": cmd_cancel,
              "events": cmd_events}[args.cmd]
        return asyncio.run(fn(args))
    except SpecFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServiceCallError as exc:
        print(f"error ({exc.code}): {exc.message}" + (f" [field: {exc.field}]" if exc.field else ""), file=sys.stderr)
        return 1
    except ServerUnavailable as exc:
        print(f"error: {exc} (set --server or GEARSHIFT_NATS_URL; is `gearshift up` running?)", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


def _perfmodel(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: gearshift perfmodel validate [--data DIR] [-o json]")
        return 0 if rest else 2
    if rest[0] == "validate":
        from perfmodel.validate import main as validate_main

        return validate_main(rest[1:])
    print(f"error: unknown perfmodel command {rest[0]!r} (known: validate)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
