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
    QUEUE_EVICTION = "queue-eviction"  # Kueue evicted the job's Workload (or spec.suspend): stop
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

# Causes after which the leaving members may already be dead: a plan that names them gets no
# copy of their state from them (the planner's ``lost``).
LOSSES: frozenset[Cause] = frozenset({
    Cause.NODE_GONE, Cause.UNREACHABLE, Cause.NOT_READY, Cause.POD_FAILED, Cause.MEMBER_LOST,
    Cause.POD_DELETION, Cause.POD_DISRUPTION, Cause.OUT_OF_SERVICE})


# One authority per event: losses *without notice* are the runtime's alone. The worker process
# is gone (a pod failed, deleted or evicted: the kubelet's SIGTERM ends it at once; its node
# deleted or out of service) and the coordinator sees it first (missing heartbeats, a failed
# collective), recovers on its own and reports the world it committed (``status.world``); the
# operator plans no departure for them and records that world as observed. The operator plans
# the announced departures (spot notices, maintenance, scale-in, Karpenter's disruption, cordon:
# the node's taint or condition comes while the workers still run), scaling and spec changes.
WITHOUT_NOTICE: frozenset[Cause] = frozenset({
    Cause.NODE_GONE, Cause.POD_FAILED, Cause.MEMBER_LOST, Cause.POD_DELETION, Cause.POD_DISRUPTION,
    Cause.OUT_OF_SERVICE, Cause.NOT_READY, Cause.UNREACHABLE})

# A node that stopped answering the API server says nothing certain about its workers: they may
# train on. Whether a member there is alive is the runtime's liveness judge's call alone (its
# heartbeats); the operator keeps such a member in its plans and adds no new pod from there.
RUNTIME_JUDGED: frozenset[Cause] = frozenset({Cause.NOT_READY, Cause.UNREACHABLE})


def cause_of(value: object) -> Cause | None:
    """The cause a status field names, or None when it is absent or unknown (an older writer)."""
    try:
        return Cause(str(value)) if value else None
    except ValueError:
        return None
