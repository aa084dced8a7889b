"""Blox-style scheduling parts and named policies (pure, no NATS)."""

from gearshift.policies.api import (
    AllocationError,
    Decision,
    JobDecision,
    JobView,
    NodeState,
    Placement,
    SchedOptions,
    default_plan,
)
from gearshift.policies.decision import Diff, check_decision, diff  # noqa: F401
from gearshift.policies.registry import make_policy, policy_names, register  # noqa: F401
