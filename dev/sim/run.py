"""Running schedules: one seed, or many derived from a base seed, with a report."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from liveshard.dev.sim.world import FAULTS, SimResult, Simulation


def run_schedule(seed: int, faults: frozenset[str] = frozenset(FAULTS)) -> SimResult:
    return Simulation(seed, faults).run()


@dataclass
class Report:
    schedules: int = 0
    failed: SimResult | None = None
    seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"schedules": self.schedules, "ok": self.failed is None, "seconds": round(self.seconds, 3),
                "schedules_per_second": round(self.schedules / self.seconds, 1) if self.seconds else None,
                "faults": dict(sorted(self.faults.items())), "outcomes": dict(sorted(self.outcomes.items())),
                "failed": None if self.failed is None else {"seed": self.failed.seed,
                                                            "violations": self.failed.violations,
                                                            "trace": self.failed.trace}}


def run_schedules(count: int, seed: int, faults: frozenset[str] = frozenset(FAULTS)) -> Report:
    """``count`` schedules with seeds ``seed``, ``seed + 1``, ...; stops at the first that fails."""
    logging.getLogger("liveshard").setLevel(logging.CRITICAL)  # the cores log; the trace is ours
    report = Report()
    t0 = time.perf_counter()
    for i in range(count):
        result = run_schedule(seed + i, faults)
        report.schedules += 1
        for k, v in result.faults.items():
            report.faults[k] = report.faults.get(k, 0) + v
        kind = result.outcome.split(" in ")[0]
        report.outcomes[kind] = report.outcomes.get(kind, 0) + 1
        if not result.ok:
            report.failed = result
            break
    report.seconds = time.perf_counter() - t0
    return report
