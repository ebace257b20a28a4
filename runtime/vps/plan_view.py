"""What the runtime reads off a transition plan: one interface, two implementations.

``TransitionPlanView`` is what the executor (``transfer.executor``, ``transfer.rounds``), the
rounds (``vps.schedule``) and the workers (``agent``) use. Two plans implement it:

* ``vps.device_plan.DevicePlan``: one device's part, planned from the boxes around it alone:
  the only plan a running job builds;
* ``vps.transition.TransitionPlan``: the whole plan, every device's copies: the oracle of the
  tests and of ``liveshard plan-transition`` (and the source of the greedy rounds under a budget
  too small for pairwise ones).

Every member means the same on both: ``copies`` are the copies this plan holds (all of them, or
the ones ``device`` sends, receives or runs locally); ``device`` is the device whose part the plan
is (None: the whole plan); ``device_bound(d)`` is device ``d``'s load bound, the same figure on
both; ``digest`` is sha256 over the plan's inputs and the planner's version (equal on two plans
exactly when they are parts of one plan: what members compare before data moves). The whole
plan's ``checksum`` (sha256 over every copy) is the whole plan's own and not part of this view.
Pure: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import ModelSpec
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.layout import Layout
    from liveshard.runtime.vps.schedule import Schedule
    from liveshard.runtime.vps.transition import Copy, ObjectMove, StateGroup


@runtime_checkable
class TransitionPlanView(Protocol):
    """A transition plan as the runtime reads it (see the module doc)."""

    spec: ModelSpec
    old_cfg: ParallelConfig
    new_cfg: ParallelConfig
    devices: DeviceMap
    groups: tuple[StateGroup, ...]
    rank_to_device: tuple[int, ...]
    copies: list[Copy]
    objects: list[ObjectMove]
    plan_seconds: float

    @property
    def device(self) -> int | None:
        """The device whose part this plan is; None for the whole plan."""
        ...

    @property
    def device_to_rank(self) -> dict[int, int]: ...

    @property
    def old_layout(self) -> Layout: ...

    @property
    def new_layout(self) -> Layout: ...

    @property
    def standbys(self) -> tuple[int, ...]: ...

    @property
    def digest(self) -> str:
        """sha256 over the plan's inputs and the planner's version."""
        ...

    def device_bound(self, device: int) -> int:
        """Device ``device``'s load bound: bytes it receives plus the most it can send."""
        ...

    def greedy_schedule(self, budget: int) -> Schedule:
        """The greedy rounds (budgets too small for pairwise ones), restricted to this plan's copies."""
        ...
