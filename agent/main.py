"""``python -m agent``: the node agent's command line -- options (and
``--config`` / ``GEARSHIFT_AGENT_*`` through ``services.config``), the GPU
probe (NVML, or ``--fake-gpus``), the connection, the metrics endpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from gearshift.agent.agent import DEFAULT_GRACE_S, Agent
from gearshift.agent.probe import GpuProbe
from gearshift.bus import observe
from gearshift.bus.config import NodeName, NonNegative, NonNegInt, PosInt, Positive, ServiceConfig
from gearshift.bus.config import parse_args as parse_config
from gearshift.bus.log import get_logger
from gearshift.bus_schema import subjects as subj


class AgentConfig(ServiceConfig):
    service: ClassVar[str] = "agent"
    node: NodeName | None = None  # default: the host name
    fake_gpus: NonNegInt | None = None
    gpu_memory: PosInt = 80 * 2**30
    gpu_name: str = "Fake GPU"
    cpus: PosInt | None = None
    workdir: str | None = None
    ckpt_root: str | None = None
    heartbeat: Positive = 1.0
    grace: NonNegative = 10.0
    address: str = "127.0.0.1"


def _bytes(text: str) -> int:
    """``85899345920``, ``80GiB``, ``80G`` or ``512MiB`` -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_args(argv: list[str] | None):
    import argparse
    import socket
    import tempfile

    p = argparse.ArgumentParser(prog="python -m agent", description="gearshift node agent")
    p.add_argument("--server", default=None, help="NATS URL (default: $GEARSHIFT_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--node", default=socket.gethostname().split(".")[0].replace("_", "-"), help="node name")
    p.add_argument("--fake-gpus", type=int, default=None, metavar="N", help="emulate N GPUs instead of NVML")
    p.add_argument("--gpu-memory", type=_bytes, default=80 * 2**30, help="memory per fake GPU (e.g. 80GiB)")
    p.add_argument("--gpu-name", default="Fake GPU",
                   help="name of the fake GPUs, as NVML would say it; its type (e.g. 'NVIDIA A100-SXM4-80GB' "
                        "-> a100) is the node's GPU type")
    p.add_argument("--cpus", type=int, default=None, help="CPUs to offer (default: all)")
    p.add_argument("--workdir", default=None, help="run and checkpoint directory")
    p.add_argument("--ckpt-root", default=None, help="checkpoint root shared by all nodes (default: WORKDIR/ckpt)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--address", default="127.0.0.1", help="address other nodes use to reach this one")

    args = parse_config(p, AgentConfig, argv)  # --config FILE, GEARSHIFT_AGENT_<FIELD>
    args.node = subj.token(args.node) if args.node else "node"
    if args.workdir is None:
        args.workdir = str(Path(tempfile.gettempdir()) / f"gearshift-agent-{args.node}")
    return args


async def run_agent(args, stop: asyncio.Event) -> int:
    from gearshift.agent.probe import FakeProbe, NoGpuDriver, NvmlProbe
    from gearshift.bus.client import ServerUnavailable, connect

    log = get_logger(agent=args.node)
    if args.fake_gpus is not None:
        probe: GpuProbe = FakeProbe(args.fake_gpus, args.gpu_memory, args.gpu_name, node=args.node)
    else:
        probe = NvmlProbe()
        try:
            await probe.open()  # before connecting: refuse early and in one line
        except NoGpuDriver as exc:
            log.error(f"no usable NVIDIA driver ({exc}); refusing to start: pass --fake-gpus N to emulate GPUs")
            return 2
        for note in probe.notes:  # devices skipped (cgroup, CUDA_VISIBLE_DEVICES), XIDs not watchable
            log.warning("gpu probe: " + note)
    try:
        nc = await connect(args.server, name=f"agent-{args.node}")
    except ServerUnavailable as exc:
        log.error(str(exc))
        await probe.close()
        return 3
    agent = Agent(
        nc, args.node, probe, args.workdir,
        cpus=args.cpus, heartbeat=args.heartbeat, grace=args.grace, address=args.address, ckpt_root=args.ckpt_root,
    )
    obs = None
    try:
        obs = await observe.serve_http(f"agent-{args.node}", "agent", nc, lambda: {"node": args.node})
        await agent.start()
        obs.set_ready()
        await stop.wait()
    except observe.MetricsPortBusy as exc:
        log.error(str(exc))
        return 4
    except RuntimeError as exc:  # the control plane's buckets missing, or the server silent for a minute
        log.error(str(exc))
        return 3
    finally:
        await agent.stop()
        if obs is not None:
            await obs.close()
        await nc.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    from gearshift.bus.process import run_service

    args = parse_args(argv)
    rc = 0

    async def body(stop: asyncio.Event) -> None:
        nonlocal rc
        rc = await run_agent(args, stop)

    run_service(body)
    return rc
