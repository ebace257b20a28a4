"""``python -m liveshard.dev.sim``: exit 0 when every schedule holds, 1 with the first violating
schedule's seed and trace, 2 on bad arguments, 3 when ``--mutant``'s text is not in its module.

``--mutant NAME`` plants one of ``sim.mutants.MUTANTS`` in the shipped code first (exit 1: the
simulator caught it); a mutant with a scripted scenario of its own runs that first."""

from __future__ import annotations

import argparse
import json
import sys

from liveshard.dev.sim import mutants
from liveshard.dev.sim.kinds import FAULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liveshard.dev.sim", description=__doc__)
    p.add_argument("--schedules", type=int, default=1000, help="how many schedules (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the first schedule's seed (the others follow)")
    p.add_argument("--faults", default="all", help=f"'all' or a comma list of: {', '.join(FAULTS)}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--mutant", choices=sorted(mutants.BY_NAME), help="plant this bug in the shipped code first")
    args = p.parse_args(argv)
    faults = frozenset(FAULTS) if args.faults == "all" else frozenset(f.strip() for f in args.faults.split(",") if f)
    unknown = sorted(faults - set(FAULTS))
    if unknown or args.schedules < 1:
        print(f"--faults: unknown {', '.join(unknown)}; use 'all' or some of {', '.join(FAULTS)}" if unknown
              else "--schedules: give a positive number", file=sys.stderr)
        return 2
    if args.mutant:
        mutants.install(mutants.BY_NAME[args.mutant])
    try:
        from liveshard.dev.sim.run import (
            run_schedules,  # imports the shipped modules: a mutant is planted here
        )

        scenario = mutants.BY_NAME[args.mutant].scenario if args.mutant else None
        if scenario is not None and (caught := _scenario(scenario)):
            print(caught)
            return 1
        report = run_schedules(args.schedules, args.seed, faults)
    except mutants.NotPlanted as e:
        print(e, file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        rate = report.schedules / report.seconds if report.seconds else 0.0
        print(f"{report.schedules} schedules in {report.seconds:.1f} s ({rate:.0f}/s, {rate * 60:.0f}/min); "
              f"faults {dict(sorted(report.faults.items()))}; outcomes {report.outcomes}")
        if report.failed is not None:
            f = report.failed
            print(f"VIOLATION in schedule seed {f.seed}:", *f.violations, sep="\n  ")
            print("trace:", *f.trace[-80:], sep="\n  ")
    return 0 if report.failed is None else 1


def _scenario(name: str) -> str | None:
    """Run a scripted scenario (a mutant's own case); what it found, or None."""
    import logging

    from liveshard.dev.sim.scenarios import SCENARIOS

    logging.getLogger("liveshard").setLevel(logging.CRITICAL)
    result, problems = SCENARIOS[name]()
    if result.ok and not problems:
        return None
    return "\n  ".join([f"VIOLATION in scenario {name}:", *result.violations, *problems, "trace:", *result.trace[-80:]])


if __name__ == "__main__":
    sys.exit(main())
