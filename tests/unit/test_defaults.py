"""Each default lives once (``contract.env.Defaults``, ``contract.jobspec.AdaptivePolicy``): the
command lines, the worker's options, the coordinator and the CRD say the same."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import yaml

from liveshard.runtime.agent.worker import WorkerOptions
from liveshard.runtime.commands import coordinator as coordinator_cmd
from liveshard.runtime.commands import worker as worker_cmd
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.jobspec import AdaptivePolicy
from liveshard.runtime.coordinator import Coordinator, CoordinatorCore, PlanningInputs

CRD = Path(__file__).resolve().parents[2] / "crds" / "elastictrainingjob.yaml"


def _defaults(configure) -> dict:
    p = argparse.ArgumentParser()
    configure(p)
    return {a.dest: a.default for a in p._actions}


def test_timeouts_and_budgets_are_one_value_everywhere():
    worker, coordinator, options = _defaults(worker_cmd.configure), _defaults(coordinator_cmd.configure), WorkerOptions()
    assert worker["collective_timeout"] == options.collective_timeout == Defaults.COLLECTIVE_TIMEOUT
    assert worker["budget"] == options.transfer_budget == Defaults.STAGING_BUDGET
    assert coordinator["heartbeat_timeout"] == Defaults.HEARTBEAT_TIMEOUT
    for cls in (Coordinator, CoordinatorCore):
        params = inspect.signature(cls.__init__).parameters
        assert params["heartbeat_timeout"].default == Defaults.HEARTBEAT_TIMEOUT
        assert params["transition_timeout"].default == Defaults.TRANSITION_TIMEOUT
    assert PlanningInputs(constraints=None).gpu_memory_bytes == Defaults.GPU_MEMORY  # type: ignore[arg-type]


def test_the_adaptive_policy_defaults_are_the_crds_and_the_command_lines():
    policy, cli = AdaptivePolicy(), _defaults(coordinator_cmd.configure)
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = schema["properties"]["spec"]["properties"]["elasticity"]["properties"]["adaptive"]["properties"]
    pairs = {"threshold": "threshold", "window": "window", "horizon": "horizonSteps", "min_gain": "minGain",
             "probation": "probationSteps"}
    for field, crd_name in pairs.items():
        assert cli[f"adaptive_{field}"] == getattr(policy, field) == props[crd_name]["default"], field
    assert props["enabled"]["default"] is policy.enabled is cli["adaptive"] is False


def test_the_planning_tools_plan_with_the_workers_staging_budget():
    from liveshard.runtime.commands.transition_args import add_transition_args
    from liveshard.runtime.units import parse_bytes

    tool, worker = _defaults(add_transition_args), _defaults(worker_cmd.configure)
    assert parse_bytes(tool["budget"], "--budget") == worker["budget"] == Defaults.STAGING_BUDGET
