"""``gearshift-config FILE...``: validate config files offline.

Every entry point owns its config ``Struct``, from which ``gearshift.bus.config``
makes its flags; this is the one table of them, keyed by the console script
that runs each one.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gearshift.agent import main as agent_main
from gearshift.bus.config import ConfigError, ServiceConfig, file_values, parser_of, validate
from gearshift.services import admission, dashboard, optimizer, perfmodel_service, profiler

#: console script -> the module whose ``main`` it runs (pyproject.toml [project.scripts])
ENTRY_POINTS = {
    "gearshift-admission": admission,
    "gearshift-optimizer": optimizer,
    "gearshift-perfmodel": perfmodel_service,
    "gearshift-profiler": profiler,
    "gearshift-dashboard": dashboard,
    "gearshift-agent": agent_main,
}

#: console script -> its config type
CONFIGS: dict[str, type[ServiceConfig]] = {
    "gearshift-admission": admission.AdmissionConfig,
    "gearshift-optimizer": optimizer.OptimizerConfig,
    "gearshift-perfmodel": perfmodel_service.PerfmodelConfig,
    "gearshift-profiler": profiler.ProfilerConfig,
    "gearshift-dashboard": dashboard.DashboardConfig,
    "gearshift-agent": agent_main.AgentConfig,
}


def entry_parser(script: str) -> tuple[argparse.ArgumentParser, type[ServiceConfig]]:
    """The real argument parser of ``script`` (a key of ``CONFIGS``)."""
    return parser_of(ENTRY_POINTS[script].main, script)


def check_file(path: str | os.PathLike, script: str | None = None) -> ServiceConfig:
    """Validate one config file; the entry point comes from ``script`` or the file's name."""
    p = Path(path)
    if script is None:
        by_service = {c.service: s for s, c in CONFIGS.items()}
        script = by_service.get(p.stem)
        if script is None:
            raise ConfigError(f"{p}: name it after its service ({', '.join(sorted(by_service))}.yaml) or pass --service")
    _, cfg_type = entry_parser(script)
    raw = file_values(p, cfg_type)
    return validate(raw, cfg_type, {k: str(p) for k in raw})


def main(argv: list[str] | None = None) -> int:
    """``gearshift-config FILE...``: validate config files offline."""
    ap = argparse.ArgumentParser(prog="gearshift-config", description=main.__doc__)
    ap.add_argument("files", nargs="+", metavar="FILE", help="YAML files named <service>.yaml")
    ap.add_argument("--service", choices=sorted(CONFIGS), default=None,
                    help="the entry point the files configure (default: from each file's name)")
    args = ap.parse_args(argv)
    bad = 0
    for f in args.files:
        try:
            check_file(f, args.service)
            print(f"{f}: ok")
        except ConfigError as exc:
            print(f"error: {exc}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
