"""The ``gearshift`` command.

    gearshift up [--nodes N --gpus-per-node G --port P --policy NAME]
    gearshift submit FILE|-
    gearshift get jobs [--state S --tenant T --array ID -w] | get job ID | get nodes | get node NAME
    gearshift get queues | set queue TENANT --quota N [--weight W --cohort C --borrow-limit N --lend-limit N]
    gearshift describe job ID
    gearshift cancel ID [--no-cascade]
    gearshift events [--follow] [--job ID] [-o json]
    gearshift usage [--since T] [--until T] [--by tenant|job|model] [-o json|csv]
    gearshift explain [ID]
    gearshift reconfigure ID --plan dp=2,tp=2 [--on node0:4] | --unpin
    gearshift cordon|drain|uncordon NODE
    gearshift logs ID [--rank R]
    gearshift top
    gearshift schema
    gearshift perfmodel validate [...]
    gearshift simulate [...]

The server comes from ``--server`` or ``GEARSHIFT_NATS_URL``; ``--server``
and ``--creds`` go before or after the verb. Every failure is one line on
stderr and an exit code (1: refused by the cluster, 2: bad input, 3: no
server or credentials refused), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gearshift import render
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import JobRecord, JobState
from gearshift.spec_file import SpecFileError, load_spec

if TYPE_CHECKING:
    from gearshift.client import Client

# nats-py imports aiohttp (half a second or more) for ws:// servers only;
# the bus verbs skip it unless a websocket URL is in play (see main)
_NO_WEBSOCKET_VERBS = {"submit", "get", "describe", "cancel", "events", "explain", "reconfigure", "cordon", "drain",
                       "uncordon", "logs", "top", "usage"}

# a CLI that cannot reach its server says so fast (the issue: under 2 s)
CONNECT_WITHIN_S = 0.5


def _print_json(obj: Any) -> None:
    print(json.dumps(codec.to_builtins(obj), indent=2))


async def _with_client(args: argparse.Namespace, fn) -> int:
    from gearshift.client import Client

    client = await Client.connect(args.server, retry_for=CONNECT_WITHIN_S)
    try:
        return await fn(client)
    finally:
        try:
            await asyncio.wait_for(client.close(), 2.0)
        except Exception:  # closing must not turn a result into an error
            pass


# ------------------------------------------------------------------ jobs
async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)

    async def go(c: Client) -> int:
        reply = await c.submit(spec, token=args.token)
        # an array: its id prefix, then the ids of its jobs (<prefix>-0 .. <prefix>-<N-1>)
        print(reply.job_id if not reply.array else f"{reply.job_id} ({reply.array} jobs: {reply.job_id}-0 .. "
              f"{reply.job_id}-{reply.array - 1})")
        return 0

    return await _with_client(args, go)


def _states(text: str | None) -> list[str] | None:
    if not text:
        return None
    states = [s.strip() for s in text.split(",") if s.strip()]
    known = {s.value for s in JobState}
    bad = [s for s in states if s not in known]
    if bad:
        raise SpecFileError(f"--state: unknown state(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    return states


async def cmd_get(args: argparse.Namespace) -> int:
    from gearshift.bus.client import ServiceCallError

    states = _states(args.state)

    async def go(c: Client) -> int:
        if args.what in ("jobs", "job"):
            if args.name:
                jobs = [await c.job(args.name)]
            elif args.watch:
                return await _watch_jobs(c, args, states)
            else:  # paged: as many requests as it takes (--all: the history store too)
                jobs = await c.jobs(tenant=args.tenant, states=states, limit=args.limit, all=args.all, node=args.node,
                                    **({"array": args.array} if args.array else {}))
            if args.output == "json":
                _print_json(jobs[0] if args.name else jobs)
            else:
                print(render.table(render.job_rows(jobs), render.JOB_HEADERS))
            return 0
        if args.what in ("queues", "queue"):
            queues = await c.queues()
            if args.output == "json":
                _print_json(queues)
            else:
                print(render.table(queue_rows(queues), QUEUE_HEADERS))
            return 0
        nodes = (await c.nodes()).nodes
        if args.name:
            nodes = [n for n in nodes if n.node == args.name]
            if not nodes:
                raise ServiceCallError("404", f"no node {args.name} has reported", "node")
        if args.output == "json":
            _print_json(nodes[0] if args.name else nodes)
        else:
            modes = await _modes(c)
            print(render.table(render.node_rows(nodes, modes), render.node_headers(nodes)))
        return 0

    return await _with_client(args, go)


async def _modes(c: Client) -> dict[str, Any] | None:
    """Cordoned and draining nodes, or None when this identity may not ask."""
    from gearshift.bus.client import ServiceCallError

    try:
        return {e.node: e for e in (await c.node_modes()).nodes}
    except ServiceCallError:
        return None


async def _watch_jobs(c: Client, args: argparse.Namespace, states: list[str] | None) -> int:
    """kubectl's -w: the table once, then a line for every job that changed."""
    seen: dict[str, tuple] = {}
    first = True
    deadline = time.monotonic() + args.watch_timeout if args.watch_timeout else None
    while deadline is None or time.monotonic() < deadline:
        jobs = await c.jobs(tenant=args.tenant, states=states, limit=args.limit)
        changed = []
        for j in jobs:
            key = (j.state, render.steps_done(j), j.generation, j.plan, j.reason)
            if seen.get(j.job_id) != key:
                seen[j.job_id] = key
                changed.append(j)
        if args.output == "json":
            for j in changed:
                print(json.dumps(codec.to_builtins(j)), flush=True)
        elif first:
            print(render.table(render.job_rows(changed), render.JOB_HEADERS), flush=True)
        elif changed:
            # keep the columns of a fixed-width header: each line padded like the table
            print(render.table(render.job_rows(changed), render.JOB_HEADERS).split("\n", 1)[1], flush=True)
        first = False
        await asyncio.sleep(args.interval)
    return 0


QUEUE_HEADERS = ["TENANT", "QUOTA", "WEIGHT", "COHORT", "BORROW LIMIT", "LEND LIMIT"]


def queue_rows(queues) -> list[list[str]]:
    dash = lambda v: "-" if v is None or v == "" else str(v)
    return [[q.tenant, str(q.quota), f"{q.weight:g}", dash(q.cohort), dash(q.borrow_limit), dash(q.lend_limit)]
            for q in queues]


async def cmd_set(args: argparse.Namespace) -> int:
    """``set queue``: fields not given keep their current value (a new queue needs --quota)."""
    async def go(c: Client) -> int:
        old = next((q for q in await c.queues() if q.tenant == args.tenant), None)
        queue = codec.to_builtins(old) if old is not None else {"tenant": args.tenant}
        for key in ("quota", "weight", "cohort", "borrow_limit", "lend_limit"):
            value = getattr(args, key)
            if value is not None:
                queue[key] = value
        if "quota" not in queue:
            print(f"error: queue {args.tenant} is new: give --quota", file=sys.stderr)
            return 2
        print(render.table(queue_rows(await c.set_queue(queue)), QUEUE_HEADERS))
        return 0

    return await _with_client(args, go)


async def cmd_describe(args: argparse.Namespace) -> int:
    from gearshift.bus.client import ServiceCallError

    async def go(c: Client) -> int:
        j = await c.job(args.id)
        if args.output == "json":
            _print_json(j)
            return 0
        print(describe_text(j))
        print("Events:")
        try:
            async for _, _, ev in c.events(subject=f"gs.evt.job.{j.job_id}.>"):
                print(f"  {time.strftime('%H:%M:%S', time.localtime(ev.ts))}  {ev.__struct_config__.tag:<22} "
                      f"{getattr(ev, 'reason', '')}")
        except ServiceCallError as exc:  # a tenant identity may not read the event stream
            print(f"  (not readable with these credentials: {exc.message})")
        return 0

    return await _with_client(args, go)


def describe_text(j: JobRecord) -> str:
    lines = [
        f"Job:        {j.job_id} ({j.spec.name})",
        f"Tenant:     {j.spec.tenant}   guaranteed: {j.spec.guaranteed}   priority: {j.spec.priority}",
        f"State:      {j.state.value}   reason: {j.reason}",
        f"Model:      {j.spec.model.name} ({j.spec.model.params:g}M params, {j.spec.model.layers} layers)",
        f"Request:    {j.spec.gpus} GPUs, plan {j.spec.plan.label() if j.spec.plan else 'any'}, "
        f"batch {j.spec.global_batch}, {j.spec.steps} steps",
        f"Allocation: generation {j.generation}, plan {j.plan.label() if j.plan else '-'}, "
        + (", ".join(f"{p.node} GPUs {p.gpus} CPUs {p.cpus}" for p in j.placement) or "none"),
        f"Progress:   {render.steps_done(j)}/{j.spec.steps} steps, speed {render.speed(j)}, run time "
        f"{render.run_time(j)}, restarts {j.restarts}, last checkpoint at step {j.checkpoint_step}",
    ]
    if j.after:
        met = set(j.after_met)
        lines.append("Waits on:   " + ", ".join(f"{d.job} ({d.on.value}{', met' if d.job in met else ''})"
                                                for d in j.after[:8]) + (f", +{len(j.after) - 8} more" if len(j.after) > 8 else ""))
    if j.array_index is not None:
        lines.append(f"Array:      element {j.array_index} of {j.spec.array} (GEARSHIFT_ARRAY_INDEX={j.array_index})")
    if j.pinned is not None:
        lines.append(f"Pinned:     {j.pinned.plan.label()}"
                     + (f" on {', '.join(f'{s.node}:{s.gpus}' for s in j.pinned.placement)}" if j.pinned.placement else "")
                     + (f" ({j.pinned.reason})" if j.pinned.reason else ""))
    for label, ts in (("Submitted", j.submitted_at), ("Scheduled", j.scheduled_at), ("Started", j.started_at),
                      ("Finished", j.finished_at)):
        if ts:
            lines.append(f"{label + ':':<11} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))}")
    return "\n".join(lines)


async def cmd_cancel(args: argparse.Namespace) -> int:
    async def go(c: Client) -> int:
        j = await c.cancel(args.id, cascade=not args.no_cascade)
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
    from gearshift.bus_schema.schema import bus_schema

    print(json.dumps(bus_schema(), indent=2, sort_keys=True))
    return 0


# ------------------------------------------------------------------ parser
def _common(p: argparse.ArgumentParser, top: bool = False) -> None:
    """--server and --creds, accepted before and after the verb."""
    default = None if top else argparse.SUPPRESS
    p.add_argument("--server", default=default,
                   help="NATS URL, or a comma-separated list (default $GEARSHIFT_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--creds", default=default,
                   help="credentials file (default $GEARSHIFT_CREDS, else the one `gearshift up` left for the server)")


def build_parser() -> argparse.ArgumentParser:
    from gearshift import cli_ops

    ap = argparse.ArgumentParser(prog="gearshift", description="GPU-cluster scheduler that reconfigures training plans")
    _common(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def verb(name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, **kw)
        _common(p)
        return p

    cli_ops.add_up(verb("up", "run a local cluster: nats-server, services, emulated GPU nodes"))

    s = verb("submit", "submit a job spec (JSON or YAML); prints the job id")
    s.add_argument("file", help="the spec file; - reads it from standard input")
    s.add_argument("--token", default=None, help="idempotency token: resubmitting returns the same job")

    g = verb("get", "list jobs, nodes or tenant queues, or show one")
    g.add_argument("what", choices=["jobs", "job", "nodes", "node", "queues", "queue"], help="what to list")
    g.add_argument("name", nargs="?", default=None, help="one job id or node name")
    g.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")
    g.add_argument("--tenant", default=None, help="only this tenant's jobs")
    g.add_argument("--state", default=None,
                   help="only jobs in these states, comma-separated (pending,scheduled,running,cancelling,...)")
    g.add_argument("--node", default=None, help="only jobs placed on this node")
    g.add_argument("--array", default=None, help="only the jobs of this array (the id its submit printed)")
    g.add_argument("--all", action="store_true", help="finished jobs moved to the history store too")
    g.add_argument("--limit", type=int, default=None, help="at most this many jobs (oldest first)")
    g.add_argument("-w", "--watch", action="store_true", help="keep watching: a line for every job that changes")
    g.add_argument("--interval", type=float, default=1.0, help="seconds between looks while watching")
    g.add_argument("--watch-timeout", type=float, default=None, help="stop watching after this many seconds")

    d = verb("describe", "show one job with its allocation, progress and events")
    d.add_argument("kind", choices=["job"], help="what to describe")
    d.add_argument("id", help="job id")
    d.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")

    sq = verb("set", "change a tenant's queue (admin)")
    sq.add_argument("what", choices=["queue"], help="what to change")
    sq.add_argument("tenant", help="the tenant whose queue changes (created when new)")
    sq.add_argument("--quota", type=int, default=None, help="nominal GPU quota")
    sq.add_argument("--weight", type=float, default=None, help="fair-share weight")
    sq.add_argument("--cohort", default=None, help="cohort whose members borrow each other's unused quota")
    sq.add_argument("--borrow-limit", type=int, default=None, help="most GPUs it may borrow")
    sq.add_argument("--lend-limit", type=int, default=None, help="most of its unused GPUs others may borrow")

    c = verb("cancel", "cancel a job (its processes checkpoint and stop)")
    c.add_argument("id", help="job id")
    c.add_argument("--no-cascade", action="store_true",
                   help="leave the jobs that wait on it to their condition (default: cancel them too)")

    e = verb("events", "replay the event stream from the start")
    e.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    e.add_argument("--job", default=None, help="only this job's events")
    e.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")

    cli_ops.add_operator_verbs(verb)
    from gearshift import cli_usage

    cli_usage.add_usage(verb("usage", "GPU-hours, waits, restarts, switches and steps lost over a window (like sacct)"))

    verb("schema", "print the JSON Schema of every bus message and the subject table")
    sub.add_parser("perfmodel", help="performance model tools (gearshift perfmodel --help)", add_help=False)
    sub.add_parser("simulate", help="trace-driven simulation of policies (gearshift simulate --help)", add_help=False)
    return ap


def _split_tool(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(global options, tool verb, its arguments) for the verbs with their own
    parsers, which get their arguments untouched."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--server", "--creds"):
            i += 2
            continue
        if a.startswith(("--server=", "--creds=")):
            i += 1
            continue
        if a in ("simulate", "perfmodel"):
            return argv[:i], a, argv[i + 1:]
        return argv, None, []
    return argv, None, []


def _set_env(args: argparse.Namespace) -> None:
    if args.server:
        os.environ["GEARSHIFT_NATS_URL"] = args.server
    if args.creds:
        if not os.path.exists(args.creds):
            raise SpecFileError(f"--creds: {args.creds}: no such file")
        os.environ["GEARSHIFT_CREDS"] = args.creds
    if args.cmd != "up" and os.environ.get("GEARSHIFT_CREDS"):
        from gearshift.bus.auth import load_creds

        try:
            load_creds(os.environ["GEARSHIFT_CREDS"])
        except ValueError as exc:
            raise SpecFileError(f"credentials: {exc}") from None
    elif args.cmd != "up" and not os.environ.get("GEARSHIFT_CREDS") and not os.environ.get("GEARSHIFT_USER"):
        from gearshift.bus.auth import well_known_file
        from gearshift.bus.client import server_url

        known = well_known_file(server_url())
        if known.exists():
            os.environ["GEARSHIFT_CREDS"] = str(known)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:  # `gearshift schema | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130


def _skip_websocket_transport(argv: list[str]) -> None:
    verb = next((a for a in argv if a in _NO_WEBSOCKET_VERBS or a in ("up", "schema", "simulate", "perfmodel")), None)
    urls = " ".join([os.environ.get("GEARSHIFT_NATS_URL", ""), *argv])
    if verb in _NO_WEBSOCKET_VERBS and "ws://" not in urls and "wss://" not in urls and "aiohttp" not in sys.modules:
        # only nats-py's transport module is loaded without it (its import of
        # aiohttp fails, so it leaves websockets out); anything else that
        # imports aiohttp later still gets it
        sys.modules["aiohttp"] = None  # type: ignore[assignment]
        try:
            import nats.aio.transport  # noqa: F401
        finally:
            del sys.modules["aiohttp"]


def _main(argv: list[str]) -> int:
    _skip_websocket_transport(argv)
    from gearshift import cli_ops
    from gearshift.bus.client import NotAuthorized, ServerUnavailable, ServiceCallError

    _, tool, rest = _split_tool(argv)
    if tool == "simulate":
        from gearshift.sim.cli import main as sim_main

        return sim_main(rest)
    if tool == "perfmodel":
        return _perfmodel(rest)
    args = build_parser().parse_args(argv)
    try:
        _set_env(args)
        if args.cmd == "up":
            return cli_ops.cmd_up(args)
        if args.cmd == "schema":
            return cmd_schema(args)
        from gearshift.cli_usage import cmd_usage

        fn = {"submit": cmd_submit, "get": cmd_get, "describe": cmd_describe, "cancel": cmd_cancel,
              "events": cmd_events, "set": cmd_set, "usage": cmd_usage, **cli_ops.ASYNC_COMMANDS}[args.cmd]
        return asyncio.run(fn(args))
    except SpecFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServiceCallError as exc:
        print(f"error ({exc.code}): {exc.message}" + (f" [field: {exc.field}]" if exc.field else ""), file=sys.stderr)
        return 1
    except NotAuthorized as exc:
        creds = os.environ.get("GEARSHIFT_CREDS")
        print(f"error: {exc}" + (f"; credentials from {creds}" if creds else ""), file=sys.stderr)
        return 3
    except ServerUnavailable as exc:
        print(f"error: {exc} (set --server or GEARSHIFT_NATS_URL; is `gearshift up` running?)", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:  # a bug: one line, not a traceback; GEARSHIFT_DEBUG=1 shows it
        if os.environ.get("GEARSHIFT_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc} (GEARSHIFT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _perfmodel(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: gearshift perfmodel validate [--data DIR] [-o json]")
        return 0 if rest else 2
    if rest[0] == "validate":
        from gearshift.perfmodel.validate import main as validate_main

        return validate_main(rest[1:])
    print(f"error: unknown perfmodel command {rest[0]!r} (known: validate)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
