"""Named scenarios on the shipped code: the cases a new user met first, scripted instead of
drawn at random, each with what it must show besides the invariants (which hold as always).

    from liveshard.dev.sim.scenarios import SCENARIOS
    result, problems = SCENARIOS["node-deleted-then-operator-plan"]()
"""

from __future__ import annotations

from collections.abc import Callable

from liveshard.dev.sim.world import HB_TIMEOUT, SimResult, Simulation
from liveshard.runtime.contract.keys import COMMITTED


def _aborted(sim: Simulation) -> list[str]:
    return [f"generation {g}: {sorted(kinds)}" for g, kinds in sorted(sim.ledger.outcomes.items()) if "aborted" in kinds]


def node_deleted_then_operator_plan() -> tuple[SimResult, list[str]]:
    """A worker's node is deleted (no notice): the runtime, which sees the heartbeats stop,
    recovers alone; the operator's plan for the same loss arrives afterwards and must change
    nothing: no aborted generation, and the world that runs is the one the runtime committed."""
    t_loss = 5.0
    sim = Simulation(1, faults=frozenset(), workers=3, config="dp",
                     script=((t_loss, "kill:w2"),
                             (t_loss + 2 * HB_TIMEOUT + 3.0, "request:plan:operator: node of w2 deleted:w0,w1")))
    result = sim.run()
    problems = _aborted(sim)
    core = sim.core
    if core is None or core.current is None or set(core.current.members) != {"w0", "w1"}:
        problems.append(f"the world that runs is {core.current if core else None}, not w0, w1")
    recovery = [g for g, p in sim.published.items() if p.previous is not None and "w2" in p.dead]
    operator = [g for g, p in sim.published.items() if p.reason.startswith("operator")]
    if not recovery or (operator and min(operator) < min(recovery)):
        problems.append(f"the runtime's recovery {recovery} did not come first (operator's plans: {operator})")
    return result, problems


def scale_up_one_to_four() -> tuple[SimResult, list[str]]:
    """A job on one worker; three more start (``kubectl scale`` 1 -> 4): every generation after
    the first commits, and the job trains on all four."""
    sim = Simulation(2, faults=frozenset(), workers=4, config="dp", absent=("w1", "w2", "w3"),
                     script=tuple((3.0 + 0.4 * i, f"respawn:w{i}") for i in (1, 2, 3)))
    result = sim.run()
    problems = _aborted(sim)
    core = sim.core
    if core is None or core.current is None or len(core.current.members) != 4:
        problems.append(f"the job runs {core.current.members if core and core.current else None}, not 4 workers")
    if not any(kinds == {COMMITTED} for kinds in sim.ledger.outcomes.values()):
        problems.append("no generation committed")
    return result, problems


SCENARIOS: dict[str, Callable[[], tuple[SimResult, list[str]]]] = {
    "node-deleted-then-operator-plan": node_deleted_then_operator_plan,
    "scale-up-one-to-four": scale_up_one_to_four,
}
