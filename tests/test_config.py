"""Service config files (bus/config.py, each entry point's own Struct): precedence flag > env > file >
default on the services' real parsers, errors that name the field, and a
bad value ending the real process with one line (exit 2, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift import config_check
from gearshift.bus import config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "deploy" / "config"


def resolve(module: str, argv: list[str], env: dict[str, str] | None = None):
    ap, base = config_check.entry_parser(module)
    return config.resolve(ap, base, argv, environ=env or {})


def test_every_service_reads_its_options_through_the_helper():
    for module, base in config_check.CONFIGS.items():
        ap, got = config_check.entry_parser(module)
        assert got is base
        flags = {a.dest for a in ap._actions if a.option_strings}
        # every declared field is a real flag (a renamed flag would leave a dead field)
        assert set(base.__struct_fields__) <= flags, (module, set(base.__struct_fields__) - flags)
        assert "config" in flags


@pytest.mark.parametrize("module", sorted(config_check.CONFIGS))
def test_struct_defaults_match_the_parsers_defaults(module, monkeypatch):
    for var in ("GEARSHIFT_POLICY", "GEARSHIFT_POLICY_OPTIONS", "GEARSHIFT_WAIT_FOR_MODELS",
                "GEARSHIFT_MAX_JOBS_PER_TENANT", "GEARSHIFT_NATS_URL"):
        monkeypatch.delenv(var, raising=False)
    ap, base = config_check.entry_parser(module)
    for name in base.__struct_fields__:
        if module == "gearshift-agent" and name in ("node", "workdir"):
            continue  # computed from the host at parse time
        default = base.__struct_defaults__[base.__struct_fields__.index(name)]
        # the default parse_args uses: the first action of the dest (argparse's
        # get_default answers the last non-None one, wrong for a --x/--no-x pair)
        assert config._options(ap)[name].default == default, (module, name)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "optimizer.yaml"
    f.write_text("interval: 7.5\nnode_timeout: 20\nmax_retries: 5\n")
    env = {"GEARSHIFT_OPTIMIZER_NODE_TIMEOUT": "30", "GEARSHIFT_OPTIMIZER_MAX_RETRIES": "6"}

    args, cfg = resolve("gearshift-optimizer", ["--config", str(f), "--max-retries", "9"], env)
    assert args.drain_timeout == 120.0       # default
    assert args.interval == 7.5              # file
    assert args.node_timeout == 30.0         # env beats file
    assert args.max_retries == 9             # flag beats env and file
    assert cfg.max_retries == 9 and isinstance(cfg, config_check.CONFIGS["gearshift-optimizer"])

    # the file may come from the environment too; a flag still wins
    args, _ = resolve("gearshift-optimizer", ["--interval", "1"], {"GEARSHIFT_OPTIMIZER_CONFIG": str(f)})
    assert (args.interval, args.node_timeout) == (1.0, 20.0)


def test_file_values_use_the_flags_types_and_booleans(tmp_path):
    f = tmp_path / "agent.yaml"
    f.write_text("gpu_memory: 40GiB\nfake_gpus: 4\nnode: gpu-7\n")
    args, _ = resolve("gearshift-agent", ["--config", str(f)])
    assert (args.gpu_memory, args.fake_gpus, args.node) == (40 * 2**30, 4, "gpu-7")
    args, _ = resolve("gearshift-optimizer", [], {"GEARSHIFT_OPTIMIZER_WAIT_FOR_MODELS": "true"})
    assert args.wait_for_models is True
    args, _ = resolve("gearshift-optimizer", ["--wait-for-models"], {"GEARSHIFT_OPTIMIZER_WAIT_FOR_MODELS": "0"})
    assert args.wait_for_models is True


def test_older_variables_still_work_below_the_file(tmp_path, monkeypatch):
    # GEARSHIFT_POLICY is the parser's default (what loadtest.chaos and gearshift up set)
    monkeypatch.setenv("GEARSHIFT_POLICY", "las")
    args, _ = resolve("gearshift-optimizer", [])
    assert args.policy == "las"
    f = tmp_path / "o.yaml"
    f.write_text("policy: srtf\n")
    args, _ = resolve("gearshift-optimizer", ["--config", str(f)])
    assert args.policy == "srtf"


@pytest.mark.parametrize("text,env,argv,expected", [
    ("interval: -1\n", {}, [], "optimizer.interval: Expected `float` > 0.0 (from {f})"),
    ("intervall: 3\n", {}, [], "optimizer.intervall: unknown field (from {f})"),
    ("interval: fast\n", {}, [], "optimizer.interval: invalid float value 'fast' (from {f})"),
    ("max_retries: 2.5\n", {}, [], "optimizer.max_retries: Expected `int`, got `float` (from {f})"),
    ("", {"GEARSHIFT_OPTIMIZER_NODE_TIMEOUT": "soon"}, [],
     "optimizer.node_timeout: invalid float value 'soon' (from GEARSHIFT_OPTIMIZER_NODE_TIMEOUT)"),
    ("", {}, ["--max-retries", "-1"], "optimizer.max_retries: Expected `int` >= 0 (from --max-retries)"),
    ("", {}, ["--policy-options", "[1]"], "optimizer.policy_options: expected a JSON object (from --policy-options)"),
    ("policy: rubik\n", {}, [], "optimizer.policy: unknown policy 'rubik'; known: "),
    ("", {}, ["--policy-options", '{"restart_cots": 1}'],
     "optimizer.policy_options: Fifo.__init__() got an unexpected keyword argument 'restart_cots'"),
    ("- a\n- b\n", {}, [], "optimizer config {f}: expected a mapping"),
    ("a: [\n", {}, [], "optimizer config {f}: not valid YAML at line 2"),
])
def test_bad_values_name_the_field_and_the_source(tmp_path, text, env, argv, expected):
    f = tmp_path / "optimizer.yaml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        resolve("gearshift-optimizer", ["--config", str(f), *argv], env)
    assert str(err.value).startswith(expected.format(f=f)), str(err.value)


def test_agent_node_must_be_a_subject_token(tmp_path):
    with pytest.raises(config.ConfigError, match=r"^agent\.node: Expected `str` matching"):
        resolve("gearshift-agent", [], {"GEARSHIFT_AGENT_NODE": "gpu.1"})


def test_a_flag_without_a_declared_field_is_still_configurable():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--metrics-port", type=int, default=None)
    config.add_config_flag(ap, "optimizer")
    args, cfg = config.resolve(ap, config_check.CONFIGS["gearshift-optimizer"], [], {"GEARSHIFT_OPTIMIZER_METRICS_PORT": "9100"})
    assert args.metrics_port == 9100 and cfg.metrics_port == 9100
    with pytest.raises(config.ConfigError, match=r"optimizer\.metrics_port: invalid int value 'x'"):
        config.resolve(ap, config_check.CONFIGS["gearshift-optimizer"], [], {"GEARSHIFT_OPTIMIZER_METRICS_PORT": "x"})


def test_example_files_are_valid():
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert {f.stem for f in files} == {b.service for b in config_check.CONFIGS.values()}
    for f in files:
        cfg = config_check.check_file(f)
        assert cfg.server and cfg.server.startswith("tls://"), f


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_a_bad_field_ends_the_real_process_with_one_line(tmp_path):
    f = tmp_path / "optimizer.yaml"
    f.write_text("interval: -1\n")
    # the server is unreachable on purpose: the error must come before any connection attempt
    r = _run("gearshift.services.optimizer", "--config", str(f), "--server", "nats://127.0.0.1:1")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        f"gearshift-optimizer: error: optimizer.interval: Expected `float` > 0.0 (from {f})"

    r = _run("gearshift.agent", "--fake-gpus", "2", env={"GEARSHIFT_AGENT_HEARTBEAT": "often"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "agent.heartbeat: invalid float value 'often' (from GEARSHIFT_AGENT_HEARTBEAT)" in r.stderr


def test_check_command_validates_files(tmp_path):
    bad = tmp_path / "profiler.yaml"
    bad.write_text("steps: 0\n")
    r = _run("gearshift.config_check", str(EXAMPLES / "profiler.yaml"), str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert f"{EXAMPLES / 'profiler.yaml'}: ok" in r.stdout
    assert f"error: profiler.steps: Expected `int` >= 1 (from {bad})" in r.stdout


def test_two_flags_sharing_a_destination():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--login", dest="login", action="store_true", default=None)
    ap.add_argument("--no-login", dest="login", action="store_false")
    config.add_config_flag(ap, "perfmodel")
    before = [a.default for a in ap._actions]
    for argv, env, want in (([], {}, None), (["--no-login"], {}, False), (["--login"], {}, True),
                            ([], {"GEARSHIFT_PERFMODEL_LOGIN": "yes"}, True)):
        args, _ = config.resolve(ap, config_check.CONFIGS["gearshift-perfmodel"], argv, env)
        assert args.login is want, (argv, env)
    # the parser is left as it was: its defaults are back
    assert [a.default for a in ap._actions] == before


def test_dashboard_real_parser_login_pair_and_page_port(tmp_path):
    """The dashboard's real parser: its --require-login/--no-login pair from
    flag, environment and file, and the page's address checked."""
    f = tmp_path / "dashboard.yaml"
    f.write_text("host: 0.0.0.0\nport: 8080\nrequire_login: false\n")
    args, cfg = resolve("gearshift-dashboard", ["--config", str(f)])
    assert isinstance(cfg, config_check.CONFIGS["gearshift-dashboard"])
    assert (args.host, args.port, args.require_login) == ("0.0.0.0", 8080, False)  # file
    args, _ = resolve("gearshift-dashboard", ["--config", str(f)], {"GEARSHIFT_DASHBOARD_REQUIRE_LOGIN": "yes"})
    assert args.require_login is True  # env beats file
    args, _ = resolve("gearshift-dashboard", ["--config", str(f), "--no-login"],
                      {"GEARSHIFT_DASHBOARD_REQUIRE_LOGIN": "yes"})
    assert args.require_login is False  # flag beats env
    args, _ = resolve("gearshift-dashboard", ["--require-login"], {"GEARSHIFT_DASHBOARD_PORT": "9000"})
    assert (args.require_login, args.port, args.host) == (True, 9000, "127.0.0.1")
    args, _ = resolve("gearshift-dashboard", [])
    assert args.require_login is None  # decided at start: on when the dashboard has credentials
    f.write_text("port: 70000\n")
    with pytest.raises(config.ConfigError, match=rf"^dashboard\.port: Expected `int` <= 65535 \(from {f}\)"):
        resolve("gearshift-dashboard", ["--config", str(f)])
    with pytest.raises(config.ConfigError, match=r"^dashboard\.require_login: expected a boolean.*GEARSHIFT_DASHBOARD"):
        resolve("gearshift-dashboard", [], {"GEARSHIFT_DASHBOARD_REQUIRE_LOGIN": "maybe"})


def test_a_bad_dashboard_value_ends_the_real_process_with_one_line():
    r = _run("gearshift.services.dashboard", "--server", "nats://127.0.0.1:1", env={"GEARSHIFT_DASHBOARD_PORT": "http"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m services.dashboard: error: dashboard.port: invalid int value 'http' (from GEARSHIFT_DASHBOARD_PORT)"]
