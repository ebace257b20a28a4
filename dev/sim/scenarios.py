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


def _runs(sim: Simulation, *members: str) -> list[str]:
    """What is wrong, if the job does not end up running exactly ``members`` (in any order)."""
    core = sim.core
    running = core.current.members if core is not None and core.current is not None else None
    return [] if running is not None and set(running) == set(members) else \
        [f"the job runs {running}, not {', '.join(members)}"]


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
    problems += _runs(sim, "w0", "w1")
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


def standby_takes_over_a_lost_member() -> tuple[SimResult, list[str]]:
    """Three workers, of which the planner trains two (dp=2, the minimum the job accepts) and
    keeps the third standing by; a member is lost without notice: the runtime's recovery makes
    the standby a member at once (it is a survivor too), so the job never trains below dp=2
    after the loss, and the standby, which held no state, is given it by the survivor."""
    t_loss = 5.0
    sim = Simulation(9, faults=frozenset(), workers=3, config="dp", most=2, script=((t_loss, "kill:w1"),))
    result = sim.run()
    problems = _aborted(sim)
    first = sim.published.get(min(sim.published)) if sim.published else None
    if first is None or first.standbys != ("w2",):
        problems.append(f"the first world stands by {first.standbys if first else None}, not w2")
    recovery = [p for p in sim.published.values() if "w1" in p.dead]
    if not recovery:
        problems.append("no recovery from w1's loss was planned")
    elif set(recovery[0].members) != {"w0", "w2"}:
        problems.append(f"the recovery trains {recovery[0].members}, not w0 and the standby w2")
    smaller = [p.generation for p in sim.published.values() if p.previous is not None and len(p.members) < 2]
    if smaller:
        problems.append(f"generation(s) {smaller} train below dp=2")
    problems += _runs(sim, "w0", "w2")
    return result, problems


def coordinator_stopped_mid_switch() -> tuple[SimResult, list[str]]:
    """A reshape is prepared by every member; the coordinator's process is stopped (SIGSTOP) just
    before the switch, so each member aborts the generation on its own (its store does not
    answer); when it wakes, the registrations are deleted and the members register again, which
    has them read the plans afresh: none takes up again the generation it prepared before
    (``control.takes_up``), and every process acts on one decision."""
    sim = Simulation(11, faults=frozenset(), workers=3, config="dp",
                     script=((3.45, "request:reshape"), (5.5, "freeze-coordinator:10.7"),
                             (18.0, "delete-registrations")))
    result = sim.run()
    problems = []
    if not any("aborted" in line and "does not answer" in line for line in sim.trace):
        problems.append("no member aborted the generation on its own")
    if not any("registers again" in line for line in sim.trace):
        problems.append("no member registered again")
    return result, problems


def _deaths(sim: Simulation, member: str) -> list[float]:
    return [float(line.split()[0]) for line in sim.trace if f"declared dead: {member} " in line]


def heartbeat_forged_for_three_timeouts() -> tuple[SimResult, list[str]]:
    """An attacker without the secret overwrites a live worker's heartbeat before every read of
    the coordinator for 3.5 heartbeat timeouts: the worker is never declared dead (the
    invariant: nobody dead while heartbeating validly), and the world is not changed."""
    sim = Simulation(3, faults=frozenset(), workers=3, config="dp",
                     script=((4.0, f"forge-hb:w1:{3.5 * HB_TIMEOUT}"),))
    result = sim.run()
    problems = [f"w1 declared dead at {t:.1f} s" for t in _deaths(sim, "w1")] + _aborted(sim)
    return result, problems


def forged_beat_left_on_a_dead_worker() -> tuple[SimResult, list[str]]:
    """A forged heartbeat written once over a worker that is killed right after, and left in its
    key: the tampering ended, so its silence counts again, and it is found dead within two
    heartbeat timeouts of the forgery (not kept alive by a value nobody writes any more)."""
    t_forge = 4.0
    sim = Simulation(4, faults=frozenset(), workers=3, config="dp",
                     script=((t_forge, "forge-hb:w2:once"), (t_forge + 0.05, "kill:w2")))
    result = sim.run()
    deaths = _deaths(sim, "w2")
    problems = [] if deaths and deaths[0] <= t_forge + 2 * HB_TIMEOUT + 0.5 else \
        [f"w2 killed at {t_forge + 0.05:.2f} s was declared dead at {deaths[:1] or 'no time'}"]
    return result, problems


def _rendezvous_overwritten(broken: int) -> tuple[Simulation, list[tuple[int, str]]]:
    sim = Simulation(5, faults=frozenset(), workers=3, config="dp",
                     script=((3.5, f"rendezvous:{broken}"), (4.0, "request:plan:w2 leaves:w0,w1")))
    sim.result = sim.run()  # type: ignore[attr-defined]
    tries = [(g, sorted(sim.ledger.outcomes.get(g, {"none"}))[0]) for g, p in sorted(sim.published.items())
             if p.reason.startswith("w2 leaves")]
    return sim, tries


def rendezvous_overwritten_then_intact() -> tuple[SimResult, list[str]]:
    """The c10d keys of a change's rendezvous are overwritten (they cannot be sealed) for its first
    two tries: each aborts, the old world trains on, and the change is asked again as a new
    generation (a new rendezvous prefix); the third try commits."""
    sim, tries = _rendezvous_overwritten(2)
    problems = [] if [o for _, o in tries] == ["aborted", "aborted", COMMITTED] else [f"tries: {tries}"]
    core = sim.core
    if core is None or core.current is None or core.current.members != ("w0", "w1"):
        problems.append(f"the world that runs is {core.current if core else None}, not w0, w1")
    return sim.result, problems  # type: ignore[attr-defined]


def rendezvous_overwritten_all_along() -> tuple[SimResult, list[str]]:
    """The rendezvous of every try is broken: the change is asked three times in all, then
    dropped, and the job trains on in its old layout (no further generation)."""
    sim, tries = _rendezvous_overwritten(10)
    problems = [] if [o for _, o in tries] == ["aborted"] * 3 else [f"tries: {tries}"]
    core = sim.core
    if core is None or core.current is None or core.current.members != ("w0", "w1", "w2"):
        problems.append(f"the world that runs is {core.current if core else None}, not the old w0, w1, w2")
    return sim.result, problems  # type: ignore[attr-defined]


def forged_list_slots() -> tuple[SimResult, list[str]]:
    """5,000 forged registration slots planted before the workers register, and a worker that
    registers again later (a restarted pod): the writers take planted slots over and every
    reader stops a few slots past the last entry, so no process reads more than a few dozen of
    them (bounded work per tick); the job trains on all three."""
    sim = Simulation(6, faults=frozenset(), workers=3, config="dp",
                     script=((0.0, "plant-slots:5000"), (5.0, "kill:w2"), (6.0, "respawn:w2")))
    result = sim.run()
    problems = [f"{who} read {len(client.forged_read)} planted slots" for who, client, _ in sim.clients
                if len(client.forged_read) > 100]
    core = sim.core
    if core is None or core.current is None or len(core.current.members) != 3:
        problems.append(f"the job runs {core.current.members if core and core.current else None}, not 3 workers")
    return result, problems


def keys_deleted_while_a_change_is_pending() -> tuple[SimResult, list[str]]:
    """A client without the secret deletes every key of each pending generation, its plan and the
    plan pointers before every coordinator tick and worker poll of the generation's first 3 s,
    before its members read them (a join, then a leave): the coordinator writes back what it
    keeps (``coordinator.kept``), the workers what they wrote (``agent.kept_writes``), so each
    change is prepared once the deletions stop and commits without an aborted try. (Deletions
    kept up for the whole change are a stall the docs bound, not a change that can be made.)"""
    sim = Simulation(7, faults=frozenset(), workers=3, config="dp", absent=("w2",),
                     script=((1.0, "delete-pending:3"), (3.0, "respawn:w2"),
                             (14.0, "request:plan:w1 leaves:w0,w2")))
    result = sim.run()
    problems = _aborted(sim)
    problems += _runs(sim, "w0", "w2")
    deleted = sum(" FAULT delete plan/" in line for line in sim.trace)
    if deleted < 2:
        problems.append(f"only {deleted} plan deletions: the attack did not reach the plans")
    return result, problems


def votes_deleted_while_a_change_is_pending() -> tuple[SimResult, list[str]]:
    """The same attack on a generation's own keys only (prepared digests, results, arrivals,
    ready votes, decisions), for the first 4 s of each pending generation: the plans are read at
    once, so the members write while the deletions go on; each member writes its keys again
    (``agent.kept_writes``), and a join and a leave commit without an aborted try."""
    sim = Simulation(7, faults=frozenset(), workers=3, config="dp", absent=("w2",),
                     script=((1.0, "delete-pending-votes:4"), (3.0, "respawn:w2"),
                             (14.0, "request:plan:w1 leaves:w0,w2")))
    result = sim.run()
    problems = _aborted(sim)
    problems += _runs(sim, "w0", "w2")
    if sum(" FAULT delete gen/" in line for line in sim.trace) < 10:
        problems.append("the attack did not reach the generations' keys")
    return result, problems


def checkpoint_pointer_replayed() -> tuple[SimResult, list[str]]:
    """An attacker keeps ``checkpoint/latest``'s bytes while they name an early checkpoint, and
    writes them back into the store of a restarted coordinator, which never read a newer
    pointer; then every worker is lost (no surviving copy): the restore takes the newest
    checkpoint that verifies on the job's volume, not the replayed one (``restore_choice``)."""
    sim = Simulation(4, faults=frozenset(), workers=2, config="dp",
                     script=((6.0, "capture-checkpoint"), (15.0, "coordinator-now"), (19.5, "plant-checkpoint"),
                             (19.6, "kill:w0"), (19.6, "kill:w1"), (21.0, "respawn:w0"), (21.2, "respawn:w1")))
    result = sim.run()
    problems = []
    restores = [p for p in sim.published.values() if p.restore_from is not None]
    if not restores:
        problems.append("no restore was planned")
    if not any("written back (a replay)" in line for line in sim.trace):
        problems.append("the replayed pointer was never planted")
    return result, problems


SCENARIOS: dict[str, Callable[[], tuple[SimResult, list[str]]]] = {
    "checkpoint-pointer-replayed": checkpoint_pointer_replayed,
    "votes-deleted-while-a-change-is-pending": votes_deleted_while_a_change_is_pending,
    "keys-deleted-while-a-change-is-pending": keys_deleted_while_a_change_is_pending,
    "forged-list-slots": forged_list_slots,
    "rendezvous-overwritten-then-intact": rendezvous_overwritten_then_intact,
    "rendezvous-overwritten-all-along": rendezvous_overwritten_all_along,
    "node-deleted-then-operator-plan": node_deleted_then_operator_plan,
    "scale-up-one-to-four": scale_up_one_to_four,
    "standby-takes-over-a-lost-member": standby_takes_over_a_lost_member,
    "coordinator-stopped-mid-switch": coordinator_stopped_mid_switch,
    "heartbeat-forged-for-three-timeouts": heartbeat_forged_for_three_timeouts,
    "forged-beat-left-on-a-dead-worker": forged_beat_left_on_a_dead_worker,
}
