"""deploy/systemd: one unit per service, the agent and nats-server; each
ExecStart runs a real entry point with flags its real parser accepts, reads
the config file the examples provide, and an identity named <role>.creds."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from deploy_helpers import DEPLOY, check_command, example_for

from gearshift import config_check as config
from gearshift.bus.natsd import nats_server_binary

UNITS = DEPLOY / "systemd"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's format: [Section], Key=Value, repeated keys kept in order."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None and "=" in line, f"{path.name}:{n}: not Key=Value in a section: {line!r}"
        key, value = line.split("=", 1)
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def env_of(unit: dict, instance: str = "") -> dict[str, str]:
    env = {}
    for item in unit["Service"].get("Environment", []):
        for kv in shlex.split(item.replace("%i", instance)):
            k, v = kv.split("=", 1)
            env[k] = v
    return env


def units() -> dict[str, dict]:
    return {p.name: parse_unit(p) for p in sorted(UNITS.glob("*.service"))}


def test_every_entry_point_and_nats_server_have_a_unit():
    ran = {}
    for name, unit in units().items():
        for key in ("Unit", "Service", "Install"):
            assert key in unit, (name, key)
        assert unit["Install"]["WantedBy"] == ["multi-user.target"], name
        (start,) = unit["Service"]["ExecStart"]
        argv = shlex.split(start)
        assert argv[1:2] != ["-m"], (name, "a unit names the console script, not python -m")
        ran[name] = Path(argv[0]).name
    assert set(ran.values()) == set(config.CONFIGS) | {"nats-server"}, ran


@pytest.mark.parametrize("name", [n for n in sorted(p.name for p in UNITS.glob("gearshift-*.service"))])
def test_service_units_match_the_real_parsers(name):
    unit = units()[name]
    svc = unit["Service"]
    (start,) = svc["ExecStart"]
    instance = "gpu-17"
    argv = shlex.split(start.replace("%i", instance))
    # units run the console scripts the wheel installs, never a module path
    assert Path(argv[0]).parent == Path("/opt/gearshift/.venv/bin"), argv
    module, opts, cfg_path = check_command(argv)

    # the config file is the example of that service, and it is valid for it
    assert cfg_path == f"/etc/gearshift/{config.CONFIGS[module].service}.yaml", (name, cfg_path)
    assert config.check_file(example_for(module), module)

    env = env_of(unit, instance)
    role = f"agent-{instance}" if module == "gearshift-agent" else config.CONFIGS[module].service
    assert env["GEARSHIFT_CREDS"] == f"/etc/gearshift/auth/{role}.creds"
    assert env["GEARSHIFT_TLS_CA"] == "/etc/gearshift/tls/ca.pem"
    assert not any(k in env for k in ("GEARSHIFT_PASSWORD", "GEARSHIFT_USER")), "no clear passwords in units"
    assert svc["Restart"] == ["always"]
    if module == "gearshift-agent":
        assert opts["node"] == instance  # the instance name is the node
        assert svc["KillMode"] == ["control-group"]  # job processes die with their agent
        assert float(svc["TimeoutStopSec"][0]) > 60.0  # the agent's grace (deploy/config/agent.yaml) fits
    elif module == "gearshift-dashboard":
        # read-only: it creates no stream or bucket, so it needs no replica count
        assert "GEARSHIFT_REPLICAS" not in env
        # actions with the signed-in person's credentials (the dashboard's own identity may not act)
        assert config.check_file(example_for(module), module).require_login is True
    else:
        assert env["GEARSHIFT_REPLICAS"] == "3"


def test_nats_server_unit_runs_the_shipped_config():
    unit = units()["nats-server.service"]
    svc = unit["Service"]
    argv = shlex.split(svc["ExecStart"][0])
    assert Path(argv[0]).name == "nats-server" and argv[1:] == ["-c", "/etc/gearshift/nats-server.conf"]
    assert shlex.split(svc["ExecStartPre"][0])[1:] == ["-t", "-c", "/etc/gearshift/nats-server.conf"]
    assert svc["KillSignal"] == ["SIGUSR2"]  # lame duck: clients move before the server stops
    # the binary really has those options
    out = subprocess.run([nats_server_binary(), "--help"], capture_output=True, text=True, timeout=20)
    assert "Test configuration and exit" in out.stdout + out.stderr
    # JetStream's store lies in the unit's StateDirectory
    assert 'store_dir: "/var/lib/nats/' in (DEPLOY / "nats-server.conf").read_text()
    assert svc["StateDirectory"] == ["nats"]
