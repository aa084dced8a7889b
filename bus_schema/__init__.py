"""The bus: every message type, subject builder and codec (pure, no NATS)."""

from gearshift.bus_schema import codec, subjects
from gearshift.bus_schema.messages import *  # noqa: F401,F403
from gearshift.bus_schema.perfmodel import *  # noqa: F401,F403
