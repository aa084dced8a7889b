"""Checks shared by the deployment tests: a command line from a unit file or a
manifest against the real argument parser of the module it runs."""

from __future__ import annotations

from pathlib import Path

from services import config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONFIG_EXAMPLES = DEPLOY / "config"


def check_command(argv: list[str]) -> tuple[str, dict, str | None]:
    """``[.../python, -m, MODULE, flags...]`` -> (module, options, --config path).

    Fails unless MODULE is a gearshift entry point and the real parser of that
    module accepts every flag with a valid value (the config Struct's checks
    included)."""
    assert Path(argv[0]).name.startswith("python"), f"{argv}: not a python command"
    assert argv[1] == "-m", f"{argv}: expected python -m MODULE"
    module, flags = argv[2], argv[3:]
    assert module in config.CONFIGS, f"{argv}: {module} is not a gearshift entry point ({sorted(config.CONFIGS)})"
    ap, base = config.parser_of(module)
    ns, unknown = ap.parse_known_args(flags)
    assert not unknown, f"{argv}: python -m {module} has no option {unknown}"
    rest = [f for i, f in enumerate(flags) if f != "--config" and (i == 0 or flags[i - 1] != "--config")]
    _, cfg = config.resolve(ap, base, rest, environ={})  # raises ConfigError on a bad value
    return module, {k: getattr(cfg, k) for k in cfg.__struct_fields__}, ns.config


def example_for(module: str) -> Path:
    return CONFIG_EXAMPLES / f"{config.CONFIGS[module].service}.yaml"
