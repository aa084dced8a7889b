"""One YAML config file per process, with environment and flags on top.

Each entry point (a service, the agent) owns its config ``Struct``; ``parse_args``
adds ``--config PATH`` to it and fills every option from, in order of
precedence:

1. the flag on the command line;
2. the environment: ``GEARSHIFT_<SERVICE>_<FIELD>`` (``GEARSHIFT_OPTIMIZER_INTERVAL=2``);
3. the file (``--config`` or ``GEARSHIFT_<SERVICE>_CONFIG``): a YAML mapping of
   field names (the flags' names with ``_``: ``node_timeout: 10``);
4. the parser's default (which still honours the older variables such as
   ``GEARSHIFT_POLICY``).

The merged values are validated by the service's ``msgspec.Struct`` below:
an error names the field and where the bad value came from
(``optimizer.interval: Expected `float` > 0.0 (from GEARSHIFT_OPTIMIZER_INTERVAL)``)
and the process exits 2 with that one line, before it connects anywhere.

A flag a service has but its Struct does not declare (added later) is still
accepted in the file and the environment, typed from the flag; the Struct is
where constraints live.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
import yaml
from msgspec import Meta

NonNegative = Annotated[float, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NodeName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=128)]


class ServiceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: ``GEARSHIFT_<ENV_NAME>_<FIELD>``; also the prefix of error messages
    service: ClassVar[str] = ""
    server: str | None = None  # NATS URL(s), comma-separated; default $GEARSHIFT_NATS_URL


_SKIP = {"help", "config"}


class ConfigError(ValueError):
    """A bad config value; the message names the field and its source."""


def env_name(service: str, field: str) -> str:
    return f"GEARSHIFT_{service.upper()}_{field.upper()}"


def _options(ap: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> its first action (whose default the parser uses when flags share a dest)."""
    out: dict[str, argparse.Action] = {}
    for a in ap._actions:
        if a.dest not in _SKIP and a.option_strings:
            out.setdefault(a.dest, a)
    return out


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def _flag_type(action: argparse.Action) -> Any:
    t = bool if _is_switch(action) else action.type if action.type in (int, float) else str
    return t | None if action.default is None else t


def effective_type(ap: argparse.ArgumentParser, base: type[ServiceConfig]) -> type[ServiceConfig]:
    """``base`` plus a plain field for every flag it does not declare."""
    known = set(base.__struct_fields__)
    extra = [(dest, _flag_type(a), a.default) for dest, a in _options(ap).items() if dest not in known]
    if not extra:
        return base
    return msgspec.defstruct(base.__name__, extra, bases=(base,), kw_only=True, forbid_unknown_fields=True)


def _explicit_flags(ap: argparse.ArgumentParser, argv: list[str] | None) -> dict[str, Any]:
    """The options given on the command line (a parse with every default suppressed)."""
    opts = _options(ap)
    actions = [a for a in ap._actions if a.dest in opts]  # two flags may share a dest (--x / --no-x)
    saved = [a.default for a in actions]
    try:
        for a in actions:
            a.default = argparse.SUPPRESS
        ns, _ = ap.parse_known_args(argv)
    finally:
        for a, default in zip(actions, saved):
            a.default = default
    return {k: v for k, v in vars(ns).items() if k in opts}


def _from_text(action: argparse.Action, text: str, field: str, source: str) -> Any:
    """A value written as text (environment, or a string in the file for a typed flag)."""
    if _is_switch(action):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{field}: expected a boolean (true/false), got {text!r} (from {source})")
    conv = action.type or str
    try:
        return conv(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        kind = getattr(conv, "__name__", "value")
        raise ConfigError(f"{field}: invalid {kind} value {text!r} (from {source})") from None


def load_file(path: str | os.PathLike, service: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{service} config {p}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{service} config {p}: not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{service} config {p}: expected a mapping of field: value, got {type(data).__name__}")
    return data


def _file_values(path: str | os.PathLike, service: str, opts: dict[str, argparse.Action]) -> dict[str, Any]:
    """The file's values; a string for a typed flag (``gpu_memory: 40GiB``) goes through the flag's type."""
    out = load_file(path, service)
    for key, value in out.items():
        action = opts.get(key)
        if isinstance(value, str) and action is not None and action.type not in (None, str):
            out[key] = _from_text(action, value, f"{service}.{key}", str(path))
    return out


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def validate(raw: dict[str, Any], cfg_type: type[ServiceConfig], sources: dict[str, str] | None = None,
             service: str | None = None) -> ServiceConfig:
    """``raw`` as ``cfg_type`` or a ConfigError naming ``<service>.<field>``."""
    service = service or cfg_type.service
    sources = sources or {}
    fields = cfg_type.__struct_fields__
    for key in raw:
        if key not in fields:
            src = sources.get(key, "the file")
            raise ConfigError(f"{service}.{key}: unknown field (from {src}); known: {', '.join(sorted(fields))}")
    try:
        return msgspec.convert(raw, cfg_type)
    except msgspec.ValidationError as exc:
        msg, path = _AT.match(str(exc)).groups()  # type: ignore[union-attr]
        path = (path or "").lstrip(".")
        own = re.match(r"^(\w+): (.*)$", msg, re.S)  # a __post_init__ check names its field itself
        if not path and own and own.group(1) in fields:
            path, msg = own.groups()
        top = path.split(".")[0].split("[")[0]
        src = f" (from {sources[top]})" if top in sources else ""
        raise ConfigError(f"{service}.{path or '?'}: {msg}{src}") from None


def resolve(ap: argparse.ArgumentParser, base: type[ServiceConfig], argv: list[str] | None = None,
            environ: dict[str, str] | None = None) -> tuple[argparse.Namespace, ServiceConfig]:
    """Parse ``argv`` with ``ap`` (which must already have ``--config``) and
    merge flag > env > file > default; raises ConfigError."""
    environ = os.environ if environ is None else environ
    service = base.service
    cfg_type = effective_type(ap, base)
    opts = _options(ap)
    args = ap.parse_args(argv)  # bad flags: argparse's own one-line error
    explicit = _explicit_flags(ap, argv)

    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = args.config or environ.get(env_name(service, "config"))
    if path:
        for key, value in _file_values(path, service, opts).items():
            raw[key], sources[key] = value, str(path)
    for dest, action in opts.items():
        name = env_name(service, dest)
        if name in environ:
            raw[dest] = _from_text(action, environ[name], f"{service}.{dest}", name)
            sources[dest] = name
    for dest, value in explicit.items():
        raw[dest], sources[dest] = value, action_flag(opts[dest])
    for dest in opts:
        raw.setdefault(dest, getattr(args, dest))  # the parser's default (older env variables included)
    cfg = validate(raw, cfg_type, sources, service)
    for dest in opts:
        setattr(args, dest, getattr(cfg, dest))
    args.config_object = cfg
    return args, cfg


def action_flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def add_config_flag(ap: argparse.ArgumentParser, service: str) -> None:
    ap.add_argument(
        "--config", metavar="PATH", default=None,
        help=f"YAML config file (default ${env_name(service, 'config')}); flags and "
             f"GEARSHIFT_{service.upper()}_<FIELD> variables override its values",
    )


class _Captured(Exception):
    def __init__(self, ap: argparse.ArgumentParser, base: type[ServiceConfig]):
        self.ap, self.base = ap, base


_capturing = False


def parse_args(ap: argparse.ArgumentParser, base: type[ServiceConfig],
               argv: list[str] | None = None) -> argparse.Namespace:
    """What a service's ``main`` calls instead of ``ap.parse_args``: a bad
    value ends the process with one clear line and exit status 2."""
    add_config_flag(ap, base.service)
    if _capturing:
        raise _Captured(ap, base)
    try:
        args, _ = resolve(ap, base, argv)
    except ConfigError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return args


def parser_of(main: Callable[[list[str]], Any], name: str = "main") -> tuple[argparse.ArgumentParser, type[ServiceConfig]]:
    """The real argument parser of an entry point, built by its own ``main``
    and stopped before it parses or runs anything."""
    global _capturing
    _capturing = True
    try:
        main([])
    except _Captured as got:
        return got.ap, got.base
    finally:
        _capturing = False
    raise RuntimeError(f"{name} does not read its options through gearshift.bus.config.parse_args")
