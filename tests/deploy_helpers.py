"""Checks shared by the deployment tests: a command line from a unit file or a
manifest against the real argument parser of the module it runs."""

from __future__ import annotations

from pathlib import Path

from gearshift import config_check
from gearshift.bus import config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONFIG_EXAMPLES = DEPLOY / "config"


def check_command(argv: list[str]) -> tuple[str, dict, str | None]:
    """``[.../gearshift-SCRIPT, flags...]`` -> (script, options, --config path).

    Fails unless SCRIPT is a gearshift console script (an entry point, not a
    module path) and its real parser accepts every flag with a valid value (the
    config Struct's checks included)."""
    module, flags = Path(argv[0]).name, argv[1:]
    assert module in config_check.CONFIGS, \
        f"{argv}: {module} is not a gearshift entry point ({sorted(config_check.CONFIGS)})"
    ap, base = config_check.entry_parser(module)
    ns, unknown = ap.parse_known_args(flags)
    assert not unknown, f"{argv}: {module} has no option {unknown}"
    rest = [f for i, f in enumerate(flags) if f != "--config" and (i == 0 or flags[i - 1] != "--config")]
    _, cfg = config.resolve(ap, base, rest, environ={})  # raises ConfigError on a bad value
    return module, {k: getattr(cfg, k) for k in cfg.__struct_fields__}, ns.config


def example_for(module: str) -> Path:
    return CONFIG_EXAMPLES / f"{config_check.CONFIGS[module].service}.yaml"
