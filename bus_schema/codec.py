"""One encoder and one typed decoder per message type, built once."""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar

import msgspec

from gearshift.bus_schema import messages as m

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


@cache
def decoder(tp: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(tp)


def decode(data: bytes, tp: type[T]) -> T:
    """Decode and validate; raises msgspec.ValidationError/DecodeError."""
    return decoder(tp).decode(data)


def decode_event(data: bytes) -> m.Event:
    return decoder(m.AnyEvent).decode(data)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def convert(obj: Any, tp: type[T]) -> T:
    """Validate plain Python data (e.g. a parsed YAML file) into ``tp``."""
    return msgspec.convert(obj, tp)


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")


def error_field(exc: Exception) -> str | None:
    """The JSON path a msgspec validation error names, as ``model.params``."""
    match = _PATH_RE.search(str(exc))
    if not match:
        return None
    return match.group(1) or None
