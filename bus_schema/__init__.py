"""The bus: every message type, subject builder and codec (pure, no NATS)."""

from . import codec, subjects
from .messages import *  # noqa: F401,F403
from .perfmodel import *  # noqa: F401,F403
