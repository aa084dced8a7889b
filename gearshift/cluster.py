"""An embedded local cluster: a real nats-server, every service and N
emulated GPU nodes, each as its own process (what ``gearshift up``, the demo
and the end-to-end tests run).

Stopping sends SIGTERM to every child and waits; anything that does not leave
within the grace period is killed with its process group, so nothing is left
behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.bus.auth import connect_options, load_creds
from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import NodeList


@dataclass
class LocalCluster:
    nodes: int = 2
    gpus_per_node: int = 4
    cpus_per_node: int = 32
    gpu_memory: str = "80GiB"
    port: int = -1
    data_dir: str | None = None
    policy: str = "fifo"
    interval: float = 2.0
    heartbeat: float = 1.0
    node_timeout: float = 10.0
    grace: float = 10.0
    log_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # authorisation: one NATS user per role, credentials written to <data_dir>/auth
    auth: bool = False
    tenants: list[str] = field(default_factory=lambda: ["default"])
    dashboard: bool = True  # the live web dashboard (services.dashboard)
    real_gpus: bool = False  # agents read this host's GPUs through NVML (loadtest.gpu_check)

    def __post_init__(self) -> None:
        self._tmp: Path | None = None  # a temp data dir we made (removed on stop unless logs are kept)
        self.server: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self.auth_dir: Any = None  # services.auth.AuthDir when auth is on

    @property
    def url(self) -> str:
        assert self.server is not None and self.server.url
        return self.server.url

    def start(self, wait: bool = True) -> str:
        if self.data_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="gearshift-"))
            self.data_dir = str(self._tmp)
        root = Path(self.data_dir)
        self.log_dir = self.log_dir or str(root / "logs")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        config = None
        if self.auth:
            from gearshift.bus.auth import write_auth_dir

            self.auth_dir = write_auth_dir(root / "auth", [f"node{i}" for i in range(self.nodes)], self.tenants)
            config = self.auth_dir.config
        self.server = NatsServer(root / "jetstream", port=self.port, config=config)
        try:
            self.server.start()
        except RuntimeError as exc:
            raise RuntimeError(_server_failure(str(exc), self.port)) from None
        if self.auth_dir is not None:
            from gearshift.bus.auth import set_url

            set_url(self.auth_dir, self.url)
        _ensure_infra(self.url, self.admin_creds)  # streams and buckets exist before any process needs them
        # every process serves metrics and health on a free port and announces it in <data>/observe
        env = {**os.environ, "GEARSHIFT_NATS_URL": self.url, "GEARSHIFT_LOG_FORMAT": "json",
               "GEARSHIFT_METRICS_PORT": "0", "GEARSHIFT_OBSERVE_DIR": str(self.observe_dir), **self.extra_env}
        env.pop("GEARSHIFT_CREDS", None)
        py = sys.executable
        self._spawn("admission", [py, "-m", "gearshift.services.admission", "--max-gpus", str(self.nodes * self.gpus_per_node)],
                    self._env_for(env, "admission"))
        self._spawn(
            "optimizer",
            [py, "-m", "gearshift.services.optimizer", "--policy", self.policy, "--interval", str(self.interval),
             "--node-timeout", str(self.node_timeout), "--wait-for-models"],
            self._env_for(env, "optimizer"),
        )
        if _has_module("gearshift.services.perfmodel_service"):
            self._spawn("perfmodel", [py, "-m", "gearshift.services.perfmodel_service"], self._env_for(env, "perfmodel"))
        if _has_module("gearshift.services.profiler"):  # fits models of jobs nobody profiled yet
            self._spawn("profiler", [py, "-m", "gearshift.services.profiler"], self._env_for(env, "profiler"))
        ckpt = root / "ckpt"  # stands in for the cluster's shared storage
        for i in range(self.nodes):
            name = f"node{i}"
            self._spawn(
                name,
                [py, "-m", "gearshift.agent", "--node", name,
                 *([] if self.real_gpus else ["--fake-gpus", str(self.gpus_per_node), "--gpu-memory", self.gpu_memory]),
                 "--cpus", str(self.cpus_per_node), "--workdir", str(root / "agents" / name),
                 "--ckpt-root", str(ckpt), "--heartbeat", str(self.heartbeat), "--grace", str(self.grace)],
                self._env_for(env, f"agent-{name}"),
            )
        if self.dashboard:  # reads the bus with its own read-only identity; actions use the signed-in person's
            self._spawn("dashboard", [py, "-m", "gearshift.services.dashboard"], self._env_for(env, "dashboard"))
        if wait:
            self.wait_ready()
        return self.url

    @property
    def observe_dir(self) -> Path:
        assert self.data_dir is not None
        return Path(self.data_dir) / "observe"

    def endpoints(self) -> dict[str, dict]:
        """What each running process announced: metrics, healthz, readyz URLs (and the dashboard's page)."""
        import json

        out = {}
        for f in sorted(self.observe_dir.glob("*.json")):
            try:
                out[f.stem] = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # being replaced
        return out

    @property
    def dashboard_url(self) -> str | None:
        return self.endpoints().get("dashboard", {}).get("dashboard")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until admission and the optimizer answer and every node has reported."""
        asyncio.run(_wait_ready(self.url, self.nodes, timeout, self))

    @property
    def admin_creds(self) -> str | None:
        return str(self.auth_dir.creds("admin")) if self.auth_dir is not None else None

    def _env_for(self, env: dict[str, str], user: str) -> dict[str, str]:
        if self.auth_dir is None:
            return env
        return {**env, "GEARSHIFT_CREDS": str(self.auth_dir.creds(user))}

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        assert self.log_dir is not None
        log = open(Path(self.log_dir) / f"{name}.log", "ab")
        self._logs.append(log)
        # own session: a Ctrl-C on the terminal reaches only us, and we stop
        # the children in order
        self.procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=log, start_new_session=True)

    def check_alive(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout: float | None = None, keep_logs: bool = False) -> None:
        """Stop everything; a temp data dir is removed unless ``keep_logs``
        (a failed start: its logs say why)."""
        timeout = timeout if timeout is not None else self.grace + 5
        # agents first (they stop their jobs), then the services, then the server
        order = [n for n in self.procs if n.startswith("node")] + [n for n in self.procs if not n.startswith("node")]
        for n in order:
            p = self.procs[n]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for n in order:
            p = self.procs[n]
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        if self.server:
            self.server.stop()
            if self.log_dir:
                try:
                    (Path(self.log_dir) / "nats-server.log").write_text("".join(self.server.log))
                except OSError:
                    pass
        for f in self._logs:
            f.close()
        self._logs = []
        if self._tmp and not keep_logs:
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _server_failure(text: str, port: int) -> str:
    """One line for a nats-server that would not start."""
    if "address already in use" in text:
        return f"nats-server cannot listen on port {port}: the address is already in use (--port -1 picks a free one)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "[FTL]" in ln or "[ERR]" in ln]
    return "nats-server did not start: " + ((fatal or lines or ["no output"])[-1])


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


async def _wait_ready(url: str, nodes: int, timeout: float, cluster: "LocalCluster") -> None:
    nc = await connect(url, name="gearshift-up", retry_for=10, **_creds_options(cluster.admin_creds))
    deadline = time.monotonic() + timeout
    try:
        while True:
            dead = cluster.check_alive()
            if dead:
                raise RuntimeError(f"process(es) exited during start-up: {', '.join(dead)}; see {cluster.log_dir}")
            try:
                have = len((await call(nc, subj.ADMISSION_NODES, None, NodeList, timeout=2)).nodes)
                leader = await nc.request("$SRV.PING.optimizer", b"", timeout=1)
                if have >= nodes and leader and (not cluster.dashboard or cluster.dashboard_url):
                    return
            except Exception:  # not answering yet (no responders, timeout)
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"local cluster not ready after {timeout:.0f}s; see {cluster.log_dir}")
            await asyncio.sleep(0.2)
    finally:
        await nc.drain()


def _creds_options(path: str | None) -> dict:
    if path is None:
        return {}

    return connect_options(load_creds(path))


def _ensure_infra(url: str, creds: str | None = None) -> None:
    async def go() -> None:
        nc = await connect(url, name="gearshift-up", retry_for=10, **_creds_options(creds))
        try:
            await ensure_infra(nc)
        finally:
            await nc.drain()

    asyncio.run(go())
