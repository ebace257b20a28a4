"""A deterministic simulator of the control protocol (FoundationDB's way of testing).

It runs the shipped protocol code — the coordinator's loop and core (liveness judge, generation
judgement, adoption), each worker's commit-point driver, and the production ``JobStore`` with its
MACs and tamper accounting in every process — over a simulated transport, clock and set of
processes (``sim.store``, ``sim.world``), injects seeded faults (process kills and restarts, the
coordinator and its store lost, forged, replayed and deleted store values, bumped counters,
stalls, freezes, clock jumps, lost writes, damaged checkpoints) and checks invariants after every
step: safety (atomic commitment's validity and non-triviality, one decision per generation, a
restarted coordinator's resolution agreeing with what survivors acted on, every forged value
counted and none acted on, no live member declared dead, samples once, nothing unverified
restored) and liveness within a bound. A schedule is a seed: the same seed replays the same run.

    python -m liveshard.dev.sim --schedules N --seed S [--faults all|kind,kind] [--json] [--mutant NAME]

``sim.mutants`` plants bugs in the shipped code to show the invariants catch them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_schedule", "run_schedules"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``--mutant`` must plant its bug before any protocol module loads.
    if name in __all__:
        from liveshard.dev.sim import run

        return getattr(run, name)
    raise AttributeError(name)
