"""Follow gearshift's events with a durable consumer that resumes after a restart.

    python examples/follow_events.py --server nats://127.0.0.1:4222 --creds tools.creds --name my-tool

Each event is printed as one JSON line and then acknowledged. The consumer
``--name`` lives on the server (stream ``GS_EVENTS``), which remembers the
last acknowledged event: stop this program (or let it crash) and start it
again with the same name, and it goes on with the first event it had not
acknowledged. Delivery is at least once: an event printed but not acked
before a crash comes again, so de-duplicate on ``(job_id, seq)`` (job events)
or the stream sequence. ``gearshift.client`` is the public client it uses;
the ``tools`` identity may own such consumers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

from gearshift.bus_schema import codec
from gearshift.client import Client


async def follow(args: argparse.Namespace) -> int:
    client = await Client.connect(args.server, creds=args.creds)
    n = 0
    try:
        events = client.durable_events(args.name, subject=args.subject, idle_stop=args.idle_stop)
        async with contextlib.aclosing(events):  # a break hands unacked events back before we close
            async for item in events:
                print(json.dumps({"stream_seq": item.stream_seq, "subject": item.subject,
                                  **codec.to_builtins(item.event)}), flush=True)
                await item.ack()  # after handling it: a crash before here sees it again
                n += 1
                if args.max is not None and n >= args.max:
                    break
    finally:
        await client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, help="NATS URL (default $GEARSHIFT_NATS_URL)")
    ap.add_argument("--creds", default=None, help="credentials file (default $GEARSHIFT_CREDS), e.g. tools.creds")
    ap.add_argument("--name", default="example-follower", help="durable consumer name: the same name resumes")
    ap.add_argument("--subject", default="gs.evt.>", help="which events, e.g. gs.evt.job.> or gs.evt.job.*.completed")
    ap.add_argument("--max", type=int, default=None, help="stop after this many events (default: never)")
    ap.add_argument("--idle-stop", type=float, default=None, help="stop after this many seconds without new events")
    args = ap.parse_args(argv)
    try:
        return asyncio.run(follow(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
