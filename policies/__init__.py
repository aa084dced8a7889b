"""Blox-style scheduling parts and named policies (pure, no NATS)."""

from .api import (  # noqa: F401
    AllocationError, Decision, JobDecision, JobView, NodeState, Placement, SchedOptions, check_decision, default_plan,
)
from .registry import make_policy, policy_names, register  # noqa: F401
