"""One config Struct per process: its flags, environment and YAML file.

Each entry point (a service, the agent) owns its config ``Struct``, and the
Struct is the only place an option is declared: its name, type, constraints,
documentation and default. ``build_parser`` makes the command line from it
(one ``--field-name`` per field) and ``load`` fills every field from, in order
of precedence:

1. the flag on the command line;
2. the environment: ``GEARSHIFT_<SERVICE>_<FIELD>`` (``GEARSHIFT_OPTIMIZER_INTERVAL=2``);
3. the file (``--config`` or ``GEARSHIFT_<SERVICE>_CONFIG``): a YAML mapping of
   field names (the flags' names with ``_``: ``node_timeout: 10``);
4. an older variable the field names with ``option(env=...)``, kept for the
   scripts and tools that set it: ``GEARSHIFT_NATS_URL`` (every ``server``),
   ``GEARSHIFT_POLICY``, ``GEARSHIFT_POLICY_OPTIONS``,
   ``GEARSHIFT_WAIT_FOR_MODELS`` (optimizer), ``GEARSHIFT_MAX_JOBS_PER_TENANT``
   (admission); an empty one counts as unset;
5. the Struct's default.

A field is documented by ``option(help, ...)`` in its ``Annotated`` type
(``msgspec.Meta(description=...)``, so the JSON Schema carries it too)::

    interval: Annotated[Positive, option("seconds between timer rounds")] = 5.0

gives ``--interval INTERVAL  seconds between timer rounds (default: 5.0)``;
the flag's type comes from the annotation (``int``, ``float``, ``str``, or
``option(parse=...)`` for text like ``80GiB``), ``X | None`` is optional, and a
``bool`` becomes a pair ``--x`` / ``--no-x`` (``option(negative=...)`` renames
the second). The parser itself holds no defaults (every flag's is
``argparse.SUPPRESS``), so the flags the command line gave are exactly the
parsed ones, and a default is written once, in the Struct.

The merged values are validated by the Struct: an error names the field and
where the bad value came from
(``optimizer.interval: Expected `float` > 0.0 (from GEARSHIFT_OPTIMIZER_INTERVAL)``)
and the process exits 2 with that one line, before it connects anywhere.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
import msgspec.inspect as mi
import yaml
from msgspec import Meta


def option(help: str, *, env: str | None = None, parse: Callable[[str], Any] | None = None,
           show: Callable[[Any], str] | None = None, metavar: str | None = None,
           negative: str | None = None, negative_help: str | None = None) -> Meta:
    """A config field's documentation and the look of its flag, for its ``Annotated`` type.

    ``env``: an older variable honoured below the file; ``parse``: text -> value
    (flag, environment, a string in the file); ``show``: the default as ``--help``
    writes it; ``negative`` / ``negative_help``: a bool's second flag (``--no-<name>``)."""
    extra = {"env": env, "parse": parse, "show": show, "metavar": metavar,
             "negative": negative, "negative_help": negative_help}
    return Meta(description=help, extra={k: v for k, v in extra.items() if v is not None} or None)


NonNegative = Annotated[float, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NodeName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=128)]


class ServiceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options every entry point has; a subclass's docstring is its ``--help`` description."""

    #: ``GEARSHIFT_<SERVICE>_<FIELD>``, the prefix of error messages, and the program ``gearshift-<service>``
    service: ClassVar[str] = ""
    server: Annotated[str | None, option(
        "NATS URL(s), comma-separated (default: $GEARSHIFT_NATS_URL, else the local server)",
        env="GEARSHIFT_NATS_URL")] = None


C = TypeVar("C", bound=ServiceConfig)


class ConfigError(ValueError):
    """A bad config value; the message names the field and its source."""


def env_name(service: str, field: str) -> str:
    return f"GEARSHIFT_{service.upper()}_{field.upper()}"


_KINDS: dict[type, type] = {mi.BoolType: bool, mi.IntType: int, mi.FloatType: float, mi.StrType: str}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Option:
    """One field of a config Struct, as a flag."""

    name: str
    kind: type  # bool, int, float or str (the X of ``X | None``)
    default: Any
    help: str
    extra: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def negative(self) -> str:
        return self.extra.get("negative") or "--no-" + self.name.replace("_", "-")

    @property
    def env(self) -> str | None:
        return self.extra.get("env")

    @property
    def parse(self) -> Callable[[str], Any]:
        return self.extra.get("parse") or self.kind

    @property
    def converts_text(self) -> bool:
        """A string for it (in the file) is text to parse, not the value."""
        return self.kind in (int, float) or "parse" in self.extra

    def help_text(self) -> str:
        """The help, with the default (and the older variable) unless it says its default itself."""
        text, d = self.help, self.default
        if "show" in self.extra:
            shown = self.extra["show"](d)
        elif d is None or isinstance(d, bool):
            shown = {None: None, False: "off", True: "on"}[d]
        else:
            shown = str(d)
        if self.env:
            shown = f"${self.env}" + (f", else {shown}" if shown else "")
        if shown and "(default" not in text:
            text += f" (default: {shown})"
        return text.replace("%", "%%")

    def from_text(self, text: str, service: str, source: str) -> Any:
        """A value written as text (the environment, or a string in the file)."""
        field = f"{service}.{self.name}"
        if self.kind is bool:
            low = text.strip().lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise ConfigError(f"{field}: expected a boolean (true/false), got {text!r} (from {source})")
        try:
            return self.parse(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(self.parse, "__name__", "value").lstrip("_")
            raise ConfigError(f"{field}: invalid {kind} value {text!r} (from {source})") from None


def _option(cls: type, field: mi.Field) -> Option:
    t, doc, extra = field.type, "", {}
    while True:  # Annotated metadata and ``| None`` around the flag's type
        if isinstance(t, mi.Metadata):
            doc = doc or (t.extra_json_schema or {}).get("description", "")
            extra = {**(t.extra or {}), **extra}
            t = t.type
        elif isinstance(t, mi.UnionType) and any(isinstance(u, mi.NoneType) for u in t.types):
            rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
            if len(rest) != 1:
                break
            t = rest[0]
        else:
            break
    kind = _KINDS.get(type(t))
    if kind is None:
        raise TypeError(f"{cls.__name__}.{field.name}: a flag is a bool, int, float or str (or one | None), not {t}")
    if not doc:
        raise TypeError(f"{cls.__name__}.{field.name}: no help; declare it Annotated[..., option('...')]")
    if field.required or field.default_factory is not msgspec.NODEFAULT:
        raise TypeError(f"{cls.__name__}.{field.name}: a config field needs a plain default")
    return Option(field.name, kind, field.default, doc, extra)


@functools.cache
def options(cfg_type: type[ServiceConfig]) -> tuple[Option, ...]:
    """The fields of ``cfg_type`` as flags, in declaration order (the base's ``server`` after a subclass's own)."""
    info = mi.type_info(cfg_type)
    assert isinstance(info, mi.StructType)
    return tuple(_option(cfg_type, f) for f in info.fields)


def _description(cfg_type: type) -> str | None:
    doc = cfg_type.__dict__.get("__doc__")
    return doc.strip().split("\n\n")[0].replace("\n", " ") if doc else None


def build_parser(cfg_type: type[ServiceConfig], prog: str | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``cfg_type``: ``--config`` and one flag per field (a
    pair for a bool), typed and documented from the Struct, holding no defaults."""
    service = cfg_type.service
    ap = argparse.ArgumentParser(
        prog=prog or f"gearshift-{service}", description=description or _description(cfg_type),
        argument_default=argparse.SUPPRESS,
        epilog=f"Every option can also be set as {env_name(service, '<FIELD>')} (e.g. "
               f"{env_name(service, options(cfg_type)[0].name)}) or as <field>: value in the --config "
               "file; a flag wins over the environment, the environment over the file.")
    ap.add_argument(
        "--config", metavar="PATH", default=None,
        help=f"YAML config file (default ${env_name(service, 'config')})",
    )
    for o in options(cfg_type):
        if o.kind is bool:
            ap.add_argument(o.flag, dest=o.name, action="store_const", const=True, help=o.help_text())
            ap.add_argument(o.negative, dest=o.name, action="store_const", const=False,
                            help=(o.extra.get("negative_help") or f"the opposite of {o.flag}").replace("%", "%%"))
        else:
            ap.add_argument(o.flag, dest=o.name, type=o.parse, metavar=o.extra.get("metavar"), help=o.help_text())
    return ap


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


def file_values(path: str | os.PathLike, cfg_type: type[ServiceConfig]) -> dict[str, Any]:
    """The file's values; a string for a typed field (``gpu_memory: 40GiB``) is parsed as its flag would be."""
    service = cfg_type.service
    out = load_file(path, service)
    by_name = {o.name: o for o in options(cfg_type)}
    for key, value in out.items():
        o = by_name.get(key)
        if isinstance(value, str) and o is not None and o.converts_text:
            out[key] = o.from_text(value, service, str(path))
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


def resolve(ap: argparse.ArgumentParser, cfg_type: type[ServiceConfig], argv: list[str] | None = None,
            environ: Mapping[str, str] | None = None) -> tuple[argparse.Namespace, ServiceConfig]:
    """Parse ``argv`` with ``ap`` (``build_parser(cfg_type)``) and merge flag >
    env > file > older variable > default; raises ConfigError. Returns the
    values as a namespace (``config`` included) and as the Struct."""
    environ = os.environ if environ is None else environ
    service = cfg_type.service
    given = vars(ap.parse_args(argv))  # bad flags: argparse's own one-line error; only the given ones are set
    opts = options(cfg_type)

    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in opts:
        if o.env and environ.get(o.env):
            raw[o.name], sources[o.name] = o.from_text(environ[o.env], service, o.env), o.env
    path = given.get("config") or environ.get(env_name(service, "config"))
    if path:
        for key, value in file_values(path, cfg_type).items():
            raw[key], sources[key] = value, str(path)
    for o in opts:
        name = env_name(service, o.name)
        if name in environ:
            raw[o.name], sources[o.name] = o.from_text(environ[name], service, name), name
    for o in opts:
        if o.name in given:
            raw[o.name], sources[o.name] = given[o.name], o.flag
    cfg = validate(raw, cfg_type, sources, service)
    return argparse.Namespace(config=path or None, **msgspec.structs.asdict(cfg)), cfg


class _Captured(Exception):
    def __init__(self, ap: argparse.ArgumentParser, cfg_type: type[ServiceConfig]):
        self.ap, self.cfg_type = ap, cfg_type


_capturing = False


def load(cfg_type: type[C], argv: list[str] | None = None) -> C:
    """What an entry point's ``main`` calls: its options as ``cfg_type``, from
    ``argv`` (default ``sys.argv[1:]``), the environment and the file. A bad
    value ends the process with one clear line and exit status 2."""
    ap = build_parser(cfg_type)
    if _capturing:
        raise _Captured(ap, cfg_type)
    try:
        _, cfg = resolve(ap, cfg_type, argv)
    except ConfigError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return cfg  # type: ignore[return-value]


def parser_of(main: Callable[[list[str]], Any], name: str = "main") -> tuple[argparse.ArgumentParser, type[ServiceConfig]]:
    """The real argument parser of an entry point, built by its own ``main``
    and stopped before it parses or runs anything."""
    global _capturing
    _capturing = True
    try:
        main([])
    except _Captured as got:
        return got.ap, got.cfg_type
    finally:
        _capturing = False
    raise RuntimeError(f"{name} does not read its options through gearshift.bus.config.load")


def defaults(cfg_type: type[ServiceConfig]) -> Any:
    """The Struct's field defaults as attributes (``defaults(OptimizerConfig).interval``),
    without validating anything: what a class that the entry point builds uses for
    its own keyword defaults, so that each default is written once, in the Struct."""
    info = mi.type_info(cfg_type)
    return types.SimpleNamespace(**{f.name: f.default for f in info.fields if f.default is not msgspec.NODEFAULT})
