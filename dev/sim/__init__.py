"""A deterministic simulator of the control protocol (FoundationDB's way of testing).

It runs the real protocol cores — ``coordinator.core.CoordinatorCore`` and each worker's
``agent.commit_point.CommitPoint`` — with modelled workers, store and planner on a simulated
clock, injects seeded faults (process kills and restarts, the coordinator and its store lost,
forged, replayed and deleted store values, bumped counters, stalls, freezes, clock jumps, lost
writes, damaged checkpoints) and checks the protocol's invariants after every step. A schedule is
a seed: the same seed replays the same run, trace included.

    python -m liveshard.dev.sim --schedules N --seed S [--faults all|kind,kind] [--json]
"""

from liveshard.dev.sim.run import run_schedule, run_schedules

__all__ = ["run_schedule", "run_schedules"]
