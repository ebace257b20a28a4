"""The job's coordinator: turns plan requests into world plans, judges liveness, ends generations.

The decisions are a pure state machine (``core.CoordinatorCore``: observations in, actions out,
time injected) whose phase is derived in one place (``phases``: the phase, what the loop reads,
the reason it waits), built from ``membership`` (the one liveness judge), ``generations`` (how a
generation ends, and how an open one is resolved after a restart), ``planning``, ``adoption`` and
``switching`` (what each phase does), ``world_choice`` (the planner's world and the no-live-copy
check) and ``requests`` (where wishes come from). ``loop.Coordinator``
is the process: it reads the store, steps the core and carries out its actions. The protocol is
told once in docs/architecture.md.
"""

from liveshard.runtime.coordinator.core import MAX_BROKEN_RECOVERIES, CoordinatorCore
from liveshard.runtime.coordinator.events import Observation, Registration
from liveshard.runtime.coordinator.generations import Generation
from liveshard.runtime.coordinator.loop import Coordinator
from liveshard.runtime.coordinator.phases import Phase
from liveshard.runtime.coordinator.requests import (
    BackgroundSource,
    PlanningInputs,
    PlanRequest,
    PlanSource,
    StorePlanSource,
    whole_pods,
)
from liveshard.runtime.coordinator.status import CoordinatorStatus

__all__ = [
    "MAX_BROKEN_RECOVERIES",
    "BackgroundSource",
    "Coordinator",
    "CoordinatorCore",
    "CoordinatorStatus",
    "Generation",
    "Observation",
    "Phase",
    "PlanRequest",
    "PlanSource",
    "PlanningInputs",
    "Registration",
    "StorePlanSource",
    "whole_pods",
]
