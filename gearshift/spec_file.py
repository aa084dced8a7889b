"""Reading job specs from files or standard input (JSON or YAML); errors name the field."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import JobSpec
from gearshift.bus_schema.validate import SpecError, check_spec


class SpecFileError(ValueError):
    pass


def load_spec(path: str | Path) -> JobSpec:
    """Read a JSON or YAML job spec (``-``: standard input); errors name the field."""
    if str(path) == "-":
        return load_spec_text(sys.stdin.read(), "<stdin>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecFileError(f"{path}: cannot read: {exc.strerror}") from None
    return load_spec_text(text, str(path), "yaml" if p.suffix in (".yaml", ".yml") else "json")


def load_spec_text(text: str, origin: str = "<spec>", fmt: str | None = None) -> JobSpec:
    """A spec from text: JSON, or YAML (``fmt=None``: JSON if it parses, else YAML)."""
    try:
        if fmt == "json" or (fmt is None and text.lstrip().startswith("{")):
            data = msgspec.json.decode(text)
            fmt = "json"
        else:
            import yaml

            data = yaml.safe_load(text)
            fmt = "yaml"
    except Exception as exc:
        raise SpecFileError(f"{origin}: not valid {fmt.upper() if fmt else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecFileError(f"{origin}: a job spec is a mapping (JSON object), got {type(data).__name__}")
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as exc:
        field = codec.error_field(exc)
        raise SpecFileError(f"{origin}: {field or 'spec'}: {exc}") from None
    try:
        check_spec(spec)
    except SpecError as exc:
        raise SpecFileError(f"{origin}: {exc.field}: {exc.message}") from None
    return spec
