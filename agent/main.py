"""``gearshift-agent``: the node agent's command line -- options (and
``--config`` / ``GEARSHIFT_AGENT_*`` through ``bus.config``), the GPU
probe (NVML, or ``--fake-gpus``), the connection, the metrics endpoint."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import tempfile
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec

from gearshift.agent.agent import DEFAULT_ADDRESS, DEFAULT_GRACE_S, DEFAULT_HEARTBEAT_S, Agent
from gearshift.agent.probe import FakeProbe, GpuProbe, NoGpuDriver, NvmlProbe
from gearshift.bus import observe
from gearshift.bus.client import ServerUnavailable, connect
from gearshift.bus.config import NodeName, NonNegative, NonNegInt, PosInt, Positive, ServiceConfig, load, option
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.topology import NVLINK, TopologyError, format_path, parse_path, with_level


def _bytes(text: str) -> int:
    """``85899345920``, ``80GiB``, ``80G`` or ``512MiB`` -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _bytes_text(n: int) -> str:
    """Bytes as ``--gpu-memory`` takes them: ``80GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _topology(text: str) -> str:
    """A topology path (``bus_schema.topology``), checked: the reason in one line."""
    try:
        return format_path(parse_path(text, "topology"))
    except TopologyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class AgentConfig(ServiceConfig):
    """gearshift node agent"""

    service: ClassVar[str] = "agent"
    node: Annotated[NodeName | None, option("node name (default: the host name)")] = None
    fake_gpus: Annotated[NonNegInt | None, option("emulate N GPUs instead of NVML", metavar="N")] = None
    gpu_memory: Annotated[PosInt, option(
        "memory per fake GPU, e.g. 24GiB", parse=_bytes, show=_bytes_text)] = 80 * 2**30
    gpu_name: Annotated[str, option(
        "name of the fake GPUs, as NVML would say it; its type (e.g. 'NVIDIA A100-SXM4-80GB' "
        "-> a100) is the node's GPU type")] = "Fake GPU"
    cpus: Annotated[PosInt | None, option("CPUs to offer (default: all)")] = None
    workdir: Annotated[str | None, option(
        "run and checkpoint directory (default: $TMPDIR/gearshift-agent-NODE)")] = None
    ckpt_root: Annotated[str | None, option("checkpoint root shared by all nodes (default: WORKDIR/ckpt)")] = None
    heartbeat: Annotated[Positive, option("seconds between heartbeats")] = DEFAULT_HEARTBEAT_S
    grace: Annotated[NonNegative, option("seconds from SIGTERM to SIGKILL")] = DEFAULT_GRACE_S
    address: Annotated[str, option("address other nodes use to reach this one")] = DEFAULT_ADDRESS
    topology: Annotated[str, option(
        "where the node sits, coarse to fine, e.g. rack=r1/nvlink-domain=r1a; NVML's fabric information "
        "adds nvlink-domain where the GPUs report one (default: none)", parse=_topology, metavar="PATH")] = ""


def parse_args(argv: list[str] | None) -> AgentConfig:
    """The agent's options, the node name and the work directory filled in from the host."""
    cfg = load(AgentConfig, argv)  # flags, GEARSHIFT_AGENT_<FIELD>, --config FILE
    node = cfg.node or re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0].replace("_", "-"))[:128]
    node = subj.token(node) if node else "node"
    workdir = cfg.workdir or str(Path(tempfile.gettempdir()) / f"gearshift-agent-{node}")
    return msgspec.structs.replace(cfg, node=node, workdir=workdir)


async def run_agent(args, stop: asyncio.Event) -> int:
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
    path = with_level(parse_path(args.topology), NVLINK, getattr(probe, "fabric", None))
    agent = Agent(
        nc, args.node, probe, args.workdir,
        cpus=args.cpus, heartbeat=args.heartbeat, grace=args.grace, address=args.address, ckpt_root=args.ckpt_root,
        topology=format_path(path),
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
    args = parse_args(argv)
    rc = 0

    async def body(stop: asyncio.Event) -> None:
        nonlocal rc
        rc = await run_agent(args, stop)

    run_service(body)
    return rc
