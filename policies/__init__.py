"""Blox-style scheduling parts and named policies (pure, no NATS)."""

from .api import Decision, JobDecision, JobView, NodeState, Placement, check_decision, default_plan  # noqa: F401
from .registry import make_policy, policy_names, register  # noqa: F401
