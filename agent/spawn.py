"""Starting a run's ranks on this node: the launch contract's environment
(``agent/launch.py``) for each rank, the rendezvous address of the job's
first node (from its heartbeat in ``gs_nodes``), the runner's start, the
GPUs claimed in the probe. Used for job runs and for profiling runs alike."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gearshift.agent import launch
from gearshift.agent.core import Run
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import NodeReport


class RankSpawner:
    def __init__(self, node: str, address: str, runner: Any, probe: Any, nodes_kv: Callable[[], Any],
                 closing: Callable[[], bool]):
        self.node = node
        self.address = address
        self.runner = runner
        self.probe = probe
        self.nodes_kv = nodes_kv  # the gs_nodes bucket, once the agent has it
        self.closing = closing

    async def spawn(self, run: Run, first_node: str, extra_env: dict[str, str] | None = None) -> None:
        """Start this node's ranks of ``run``; each joins ``run.procs`` as it starts."""
        alloc = run.alloc
        master = await self.master_addr(first_node)
        run.launched_at = time.time()
        for spec in launch.rank_specs(alloc, self.node):
            progress_file = run.run_dir / f"progress-{spec.rank}.json"
            if spec.rank == 0:
                run.progress_file = progress_file
            env = launch.environment(
                alloc, spec, node=self.node, master_addr=master, ckpt_dir=run.ckpt_dir, progress_file=progress_file,
                launched_at=run.launched_at,
            )
            env.update(extra_env or {})
            proc = await self.runner.start_rank(run, spec, env)  # a warm worker if one is ready (SubprocessRunner)
            run.procs.append(proc)
            self.probe.claim(list(spec.gpus), [proc.pid])
        if not self.closing():
            self.runner.launched(run)

    async def master_addr(self, first_node: str) -> str:
        if first_node == self.node:
            return self.address
        try:
            entry = await self.nodes_kv().get(first_node)
            addr = codec.decode(entry.value, NodeReport).address
        except Exception:
            addr = ""
        return addr or "127.0.0.1"
