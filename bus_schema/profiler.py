"""Messages of the profiler service (``gs.profiler.{profile,status}``)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from gearshift.bus_schema import subjects as _subj
from gearshift.bus_schema.messages import ModelSpec, Plan, PlanSupport, ProfileResult
from gearshift.bus_schema.perfmodel import FitReply, ProfileSample

PROFILER_PROFILE = f"{_subj.PROFILER}.profile"
PROFILER_STATUS = f"{_subj.PROFILER}.status"
DEFAULT_PROFILE_STEPS = 10


class ProfileRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Profile a model now: run a few plans for a few steps each and fit."""

    model: ModelSpec
    global_batch: Annotated[int, Meta(ge=1, le=1 << 24)]
    command: list[str] | None = None
    env: dict[str, str] | None = None
    step_time: float | None = None  # emulated worker: seconds per step on one GPU
    plans: list[Plan] | None = None  # default: the profiler's own choice (<= 7)
    max_dp: Annotated[int, Meta(ge=1, le=64)] | None = None  # default: the largest node's GPUs
    steps: Annotated[int, Meta(ge=1, le=1000)] = DEFAULT_PROFILE_STEPS
    fit: bool = True
    # runs per plan, round-robin over the plans; the fastest counts (other load only ever adds time)
    repeats: Annotated[int, Meta(ge=1, le=5)] = 1
    # the job's declaration (JobSpec.plan_support): only plans its script runs are profiled
    plan_support: PlanSupport | None = None


class ProfileReply(Struct, kw_only=True, frozen=True):
    model_key: str
    samples: list[ProfileSample]
    results: list[ProfileResult]
    fit: FitReply | None = None
    wall_s: float = 0.0


class ProfilerStatus(Struct, kw_only=True, frozen=True):
    busy: str | None = None  # model key being profiled
    done: list[str] = []
    failed: dict[str, str] = {}


PROFILER_TYPES = [ProfileRequest, ProfileReply, ProfilerStatus]
