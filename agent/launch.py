"""What a node launches for an allocation: ranks, environment, command.

Pure functions (no NATS, no processes), so the rank arithmetic and the
launch contract of ``agent/worker.py`` can be checked on their own, and a plan
switch (issue 6) relaunches through exactly the same code.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from gearshift.agent.probe import cuda_visible_devices
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import Allocation

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMULATED_COMMAND = (sys.executable, "-m", "gearshift.agent.emulated_worker")
DEFAULT_STEP_TIME = 0.1


@dataclass(frozen=True)
class RankSpec:
    """One process this node starts for a job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    gpus: tuple[int, ...]  # the GPU indices it sees (CUDA_VISIBLE_DEVICES)


def master_port(job_id: str, generation: int) -> int:
    """The same on every node of the job without talking; differs per
    generation so a relaunch never races the old rendezvous socket."""
    return 20000 + zlib.crc32(f"{job_id}:{generation}".encode()) % 30000


def exit_status(returncode: int) -> int:
    """Shell convention: killed by signal N reads as 128 + N (SIGTERM -> 143)."""
    return 128 - returncode if returncode < 0 else returncode


LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_launcher(cmd: list[str] | tuple[str, ...] | None) -> bool:
    """Does ``cmd`` start the ranks itself (``torchrun``, ``python -m
    torch.distributed.run``)? Then the agent starts it once per node and tells
    it the gang's layout through its ``PET_*`` variables."""
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return len(cmd) >= 3 and cmd[1] == "-m" and cmd[2] in LAUNCHER_MODULES


def rank_specs(alloc: Allocation, node: str) -> list[RankSpec]:
    """The processes ``node`` starts: one per GPU slot (torchrun style; a node
    placed without GPUs counts as one slot), or a single one for the emulated
    worker, which stands for all the node's slots to spare CPUs, and for a
    launcher (``is_launcher``), which starts the node's ranks itself. Global
    ranks follow the placement order, so rank 0 is on the first node."""
    slots = [max(1, len(p.gpus)) for p in alloc.placement]
    node_rank = alloc.nodes().index(node)
    gpus = tuple(alloc.placement[node_rank].gpus)
    first, local = sum(slots[:node_rank]), slots[node_rank]
    common = dict(world_size=sum(slots), local_world_size=local, node_rank=node_rank, nnodes=len(slots))
    if alloc.command is None or is_launcher(alloc.command):
        return [RankSpec(rank=first, local_rank=0, gpus=gpus, **common)]
    return [RankSpec(rank=first + i, local_rank=i, gpus=gpus[i: i + 1], **common) for i in range(local)]


def command(alloc: Allocation) -> list[str]:
    return list(alloc.command) if alloc.command else list(EMULATED_COMMAND)


def environment(
    alloc: Allocation,
    spec: RankSpec,
    *,
    node: str,
    master_addr: str,
    ckpt_dir: Path,
    progress_file: Path,
    base: Mapping[str, str] | None = None,
    launched_at: float | None = None,
) -> dict[str, str]:
    """The environment of one rank: the agent's own, then the job's ``env``,
    then the contract variables, which a job's env may not override."""
    env = dict(os.environ if base is None else base)
    env.update(alloc.env or {})
    if alloc.command is None:  # the emulated worker must import this package
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env.update(
        WORLD_SIZE=str(spec.world_size),
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port(alloc.job_id, alloc.generation)),
        GEARSHIFT_JOB_ID=alloc.job_id,
        GEARSHIFT_GENERATION=str(alloc.generation),
        GEARSHIFT_PLAN=codec.encode(alloc.plan).decode(),
        GEARSHIFT_NODE=node,
        GEARSHIFT_NODE_RANK=str(spec.node_rank),
        GEARSHIFT_NNODES=str(spec.nnodes),
        GEARSHIFT_CKPT_DIR=str(ckpt_dir),
        GEARSHIFT_PROGRESS_FILE=str(progress_file),
        GEARSHIFT_STEPS=str(alloc.steps),
        GEARSHIFT_GLOBAL_BATCH=str(alloc.global_batch),
        GEARSHIFT_STEP_TIME=str(alloc.step_time or DEFAULT_STEP_TIME),
        GEARSHIFT_LAUNCHED_AT=repr(launched_at if launched_at is not None else time.time()),
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        # UUIDs from the node's NVML probe (indices when its GPUs are emulated)
        CUDA_VISIBLE_DEVICES=cuda_visible_devices(spec.gpus),
    )
    if is_launcher(alloc.command):
        # torchrun reads each option's default from PET_<OPTION>; what the job's
        # command line sets itself still wins
        env.update(PET_NPROC_PER_NODE=str(spec.local_world_size), PET_NNODES=str(spec.nnodes),
                   PET_NODE_RANK=str(spec.node_rank), PET_MASTER_ADDR=master_addr,
                   PET_MASTER_PORT=env["MASTER_PORT"])
    return env
