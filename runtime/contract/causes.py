"""Why a plan was made: the kinds of node and pod signals, and the operator's own reasons.

A ``Cause`` is carried as a field (``status.plan.cause``, ``Signal.kind``), never parsed out of
the human-readable ``reason``. The string values are also what ``spec.elasticity.actOn`` lists
and what the operator's metrics use as labels.
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    # node signals (a job may choose which to act on: spec.elasticity.actOn)
    SPOT_INTERRUPTION = "spot-interruption"
    REBALANCE_RECOMMENDATION = "rebalance-recommendation"
    SCHEDULED_MAINTENANCE = "scheduled-maintenance"
    SCALE_IN = "scale-in"
    DISRUPTION = "disruption"
    CORDON = "cordon"
    NOT_READY = "not-ready"
    UNREACHABLE = "unreachable"
    OUT_OF_SERVICE = "out-of-service"
    # always acted on: the pod is gone or going whatever the policy says
    NODE_GONE = "node-gone"
    POD_DISRUPTION = "pod-disruption"
    POD_DELETION = "pod-deletion"
    POD_FAILED = "pod-failed"
    # the operator's own reasons to plan
    INITIAL = "initial"
    RESUME = "resume"
    MEMBER_LOST = "member-lost"
    SCALE_UP = "scale-up"
    SCALE_DOWN = "scale-down"
    SPEC_CHANGED = "spec-changed"
    RETRY = "retry"
    # the runtime's own: a member lost without notice, seen by the coordinator first
    LOST_WITHOUT_NOTICE = "lost-without-notice"
    # the runtime's straggler policy: a slow device, planned around (spec.elasticity.adaptive)
    STRAGGLER = "straggler"


NODE_KINDS: tuple[Cause, ...] = (
    Cause.SPOT_INTERRUPTION, Cause.REBALANCE_RECOMMENDATION, Cause.SCHEDULED_MAINTENANCE, Cause.SCALE_IN,
    Cause.DISRUPTION, Cause.CORDON, Cause.NOT_READY, Cause.UNREACHABLE, Cause.OUT_OF_SERVICE)
ALWAYS_ACT: tuple[Cause, ...] = (Cause.NODE_GONE, Cause.POD_DISRUPTION, Cause.POD_DELETION, Cause.POD_FAILED)

# Node signals that are often withdrawn within seconds (a taint blip, a flapping Ready
# condition, a rebalance hint): acted on only once they have held for the job's debounce time.
# Hard deadlines (spot-interruption, Karpenter's disruption) act at once.
WITHDRAWABLE: frozenset[Cause] = frozenset({
    Cause.REBALANCE_RECOMMENDATION, Cause.CORDON, Cause.NOT_READY, Cause.UNREACHABLE, Cause.SCALE_IN})

# Causes after which the leaving members may already be dead: the coordinator's heartbeat
# watch may see the loss first, and a plan for it waits a moment for that recovery.
LOSSES: frozenset[Cause] = frozenset({
    Cause.NODE_GONE, Cause.UNREACHABLE, Cause.NOT_READY, Cause.POD_FAILED, Cause.MEMBER_LOST,
    Cause.POD_DELETION, Cause.POD_DISRUPTION, Cause.OUT_OF_SERVICE})


def cause_of(value: object) -> Cause | None:
    """The cause a status field names, or None when it is absent or unknown (an older writer)."""
    try:
        return Cause(str(value)) if value else None
    except ValueError:
        return None
