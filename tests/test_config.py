"""Service config (bus/config.py, each entry point's own Struct): the flags
generated from the Struct (nothing declared twice, every default in the Struct),
precedence flag > env > file > older variable > default on the services' real
parsers, errors that name the field, and a bad value ending the real process
with one line (exit 2, no traceback)."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec
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
        flags = {a.dest for a in ap._actions if a.option_strings} - {"help"}
        # every declared field is a real flag, and every flag a field (or --config)
        assert flags == set(base.__struct_fields__) | {"config"}, (module, flags ^ set(base.__struct_fields__))
        assert ap.prog == module


ENTRY_SOURCES = sorted((ROOT / "services").glob("*.py")) + sorted((ROOT / "agent").glob("*.py"))


@pytest.mark.parametrize("path", ENTRY_SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_entry_points_write_no_flag_by_hand(path):
    """The parsers are generated from the Structs (bus/config.py): no service or
    agent module builds a parser or adds an argument itself."""
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("add_argument", "ArgumentParser")]
    assert not calls, f"{path}: hand-written flags at lines {[c.lineno for c in calls]}"


@pytest.mark.parametrize("script", sorted(config_check.ENTRY_POINTS))
def test_entry_points_read_no_environment_for_options(script):
    """No default is computed from the environment in a ``main``: an older
    variable is declared on its field (``option(env=...)``)."""
    tree = ast.parse(Path(config_check.ENTRY_POINTS[script].__file__).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in ("main", "parse_args"):
            env = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "environ"]
            assert not env, f"{path}:{fn.name} reads os.environ at lines {env}"


@pytest.mark.parametrize("module", sorted(config_check.CONFIGS))
def test_every_default_lives_only_in_the_struct(module):
    ap, base = config_check.entry_parser(module)
    # the parser holds none: a flag not given is not in the namespace (--config: None, no value)
    held = {a.dest: a.default for a in ap._actions if a.dest not in ("help", "config") and a.default is not argparse.SUPPRESS}
    assert not held, (module, held)
    assert vars(ap.parse_args([])) == {"config": None}
    # so with nothing set, every option is the Struct's default
    args, cfg = config.resolve(ap, base, [], environ={})
    assert cfg == base()
    assert {k: getattr(args, k) for k in base.__struct_fields__} == msgspec.structs.asdict(base())
    # and every field is documented; the help shows a default only as the Struct has it
    for o in config.options(base):
        assert o.help
        action = next(a for a in ap._actions if a.dest == o.name)
        if o.default not in (None, False) and "show" not in o.extra and "(default" not in o.help:
            assert f"{o.default})" in action.help, (module, o.name, action.help)


class Toy(config.ServiceConfig):
    """a toy service"""

    service: ClassVar[str] = "toy"
    rate: Annotated[config.Positive, config.option("things a second")] = 2.5
    count: Annotated[config.PosInt | None, config.option("how many", metavar="N")] = None
    size: Annotated[int, config.option("bytes", parse=lambda t: int(t.removesuffix("k")) * 1024)] = 4096
    name: Annotated[str, config.option("what it is called", env="TOY_NAME")] = "toy"
    login: Annotated[bool | None, config.option("ask who it is", negative="--anonymous",
                                                negative_help="ask nobody")] = None
    fast: Annotated[bool, config.option("go fast")] = False


def test_the_parser_is_generated_from_the_struct():
    ap = config.build_parser(Toy)
    assert ap.prog == "gearshift-toy" and ap.description == "a toy service"
    by_flag = {s: a for a in ap._actions for s in a.option_strings}
    assert set(by_flag) == {"-h", "--help", "--config", "--rate", "--count", "--size", "--name", "--login",
                            "--anonymous", "--fast", "--no-fast", "--server"}
    assert by_flag["--rate"].type is float and by_flag["--rate"].help == "things a second (default: 2.5)"
    assert by_flag["--count"].type is int and by_flag["--count"].metavar == "N"
    assert by_flag["--name"].help == "what it is called (default: $TOY_NAME, else toy)"
    assert by_flag["--fast"].help == "go fast (default: off)" and by_flag["--anonymous"].help == "ask nobody"
    assert ap.format_help()  # renders

    def cfg(argv, env=None):
        return config.resolve(ap, Toy, argv, environ=env or {})[1]

    assert cfg([]) == Toy()
    assert cfg(["--rate", "3", "--count", "2", "--size", "2k", "--fast"]) == Toy(rate=3.0, count=2, size=2048, fast=True)
    assert cfg([], {"GEARSHIFT_TOY_SIZE": "1k", "GEARSHIFT_TOY_FAST": "yes"}) == Toy(size=1024, fast=True)
    for argv, env, want in (([], {}, None), (["--anonymous"], {}, False), (["--login"], {}, True),
                            ([], {"GEARSHIFT_TOY_LOGIN": "yes"}, True),
                            (["--login", "--anonymous"], {}, False), (["--anonymous"], {"GEARSHIFT_TOY_LOGIN": "1"}, False)):
        assert cfg(argv, env).login is want, (argv, env)
    # the older variable sits below the file and the service's own variable; empty is unset
    assert cfg([], {"TOY_NAME": "old"}).name == "old"
    assert cfg([], {"TOY_NAME": ""}).name == "toy"
    assert cfg([], {"TOY_NAME": "old", "GEARSHIFT_TOY_NAME": "new"}).name == "new"
    with pytest.raises(config.ConfigError, match=r"^toy\.count: Expected `int` >= 1 \(from --count\)"):
        cfg(["--count", "0"])


def test_a_field_needs_help_and_a_flag_type():
    class Undocumented(config.ServiceConfig):
        service: ClassVar[str] = "u"
        rate: float = 1.0

    with pytest.raises(TypeError, match=r"Undocumented\.rate: no help"):
        config.build_parser(Undocumented)

    class Listy(config.ServiceConfig):
        service: ClassVar[str] = "l"
        names: Annotated[list[str], config.option("names")] = []

    with pytest.raises(TypeError, match=r"Listy\.names: a flag is a bool, int, float or str"):
        config.build_parser(Listy)


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


def test_older_variables_still_work_below_the_file(tmp_path):
    # GEARSHIFT_POLICY & co. (what loadtest.chaos, gearshift up and older deployments set)
    env = {"GEARSHIFT_POLICY": "las", "GEARSHIFT_POLICY_OPTIONS": '{"restart_cost": 5}',
           "GEARSHIFT_WAIT_FOR_MODELS": "1", "GEARSHIFT_NATS_URL": "nats://old:4222"}
    _, cfg = resolve("gearshift-optimizer", [], env)
    assert (cfg.policy, cfg.policy_options, cfg.wait_for_models, cfg.server) == \
        ("las", '{"restart_cost": 5}', True, "nats://old:4222")
    f = tmp_path / "o.yaml"
    f.write_text("policy: srtf\n")
    _, cfg = resolve("gearshift-optimizer", ["--config", str(f)], env)
    assert cfg.policy == "srtf"
    _, cfg = resolve("gearshift-optimizer", ["--server", "nats://new:4222"], {**env, "GEARSHIFT_OPTIMIZER_POLICY": "srtf"})
    assert (cfg.policy, cfg.server) == ("srtf", "nats://new:4222")
    _, cfg = resolve("gearshift-admission", [], {"GEARSHIFT_MAX_JOBS_PER_TENANT": "7"})
    assert cfg.max_jobs_per_tenant == 7
    _, cfg = resolve("gearshift-agent", [], {"GEARSHIFT_NATS_URL": "nats://old:4222"})
    assert cfg.server == "nats://old:4222"
    # an empty one is unset; a bad one is named
    _, cfg = resolve("gearshift-admission", [], {"GEARSHIFT_MAX_JOBS_PER_TENANT": "", "GEARSHIFT_NATS_URL": ""})
    assert (cfg.max_jobs_per_tenant, cfg.server) == (1000, None)
    with pytest.raises(config.ConfigError, match=r"^admission\.max_jobs_per_tenant: invalid int value 'many' "
                                                 r"\(from GEARSHIFT_MAX_JOBS_PER_TENANT\)"):
        resolve("gearshift-admission", [], {"GEARSHIFT_MAX_JOBS_PER_TENANT": "many"})


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


def test_agent_memory_units_and_host_defaults(monkeypatch):
    _, cfg = resolve("gearshift-agent", ["--gpu-memory", "24GiB"])
    assert cfg.gpu_memory == 24 * 2**30
    _, cfg = resolve("gearshift-agent", [], {"GEARSHIFT_AGENT_GPU_MEMORY": "512MiB"})
    assert cfg.gpu_memory == 512 * 2**20
    with pytest.raises(config.ConfigError, match=r"^agent\.gpu_memory: invalid bytes value 'lots' \(from GEARSHIFT_AGENT_GPU"):
        resolve("gearshift-agent", [], {"GEARSHIFT_AGENT_GPU_MEMORY": "lots"})
    # the node name and the work directory come from the host when nobody sets them
    from gearshift.agent import main as agent_main

    for var in ("GEARSHIFT_AGENT_NODE", "GEARSHIFT_AGENT_WORKDIR", "GEARSHIFT_AGENT_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(agent_main.socket, "gethostname", lambda: "gpu_7.example.org")
    cfg = agent_main.parse_args([])
    assert cfg.node == "gpu-7" and Path(cfg.workdir).name == "gearshift-agent-gpu-7"
    cfg = agent_main.parse_args(["--node", "n1", "--workdir", "/w"])
    assert (cfg.node, cfg.workdir) == ("n1", "/w")


def test_agent_node_must_be_a_subject_token(tmp_path):
    with pytest.raises(config.ConfigError, match=r"^agent\.node: Expected `str` matching"):
        resolve("gearshift-agent", [], {"GEARSHIFT_AGENT_NODE": "gpu.1"})


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
        "gearshift-dashboard: error: dashboard.port: invalid int value 'http' (from GEARSHIFT_DASHBOARD_PORT)"]
