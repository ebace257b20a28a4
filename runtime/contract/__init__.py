"""The operator ↔ runtime contract: the one place both sides take their shared names from.

``crd``: the resource and its labels; ``jobspec``: the job's spec, read and validated;
``status``: what the operator and the coordinator write to the job's status; ``causes``: why a
plan was made; ``keys``: every key of a job's store; ``times``: the API's timestamps.
"""

from liveshard.runtime.contract.causes import (
    ALWAYS_ACT,
    LOSSES,
    NODE_KINDS,
    RUNTIME_JUDGED,
    WITHOUT_NOTICE,
    Cause,
    cause_of,
)
from liveshard.runtime.contract.crd import GROUP, KIND, PLURAL, VERSION
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import (
    AdaptiveReport,
    CommittedWorld,
    InvalidStatus,
    PlanAbort,
    PlanAck,
    StatusPlan,
    Straggler,
    Telemetry,
    answer_due,
    members_due,
    pod_of,
    worker_ids,
)
from liveshard.runtime.contract.times import iso, parse_time

__all__ = [
    "ALWAYS_ACT",
    "GROUP",
    "KIND",
    "LOSSES",
    "NODE_KINDS",
    "PLURAL",
    "RUNTIME_JUDGED",
    "VERSION",
    "WITHOUT_NOTICE",
    "AdaptiveReport",
    "Cause",
    "CommittedWorld",
    "InvalidStatus",
    "Keys",
    "PlanAbort",
    "PlanAck",
    "StatusPlan",
    "Straggler",
    "Telemetry",
    "answer_due",
    "cause_of",
    "iso",
    "members_due",
    "parse_time",
    "pod_of",
    "worker_ids",
]
