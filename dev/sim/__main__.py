"""``python -m liveshard.dev.sim``: exit 0 when every schedule holds, 1 with the first violating
schedule's seed and trace, 2 on bad arguments."""

from __future__ import annotations

import argparse
import json
import sys

from liveshard.dev.sim.run import run_schedules
from liveshard.dev.sim.world import FAULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liveshard.dev.sim", description=__doc__)
    p.add_argument("--schedules", type=int, default=1000, help="how many schedules (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the first schedule's seed (the others follow)")
    p.add_argument("--faults", default="all", help=f"'all' or a comma list of: {', '.join(FAULTS)}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    faults = frozenset(FAULTS) if args.faults == "all" else frozenset(f.strip() for f in args.faults.split(",") if f)
    unknown = sorted(faults - set(FAULTS))
    if unknown or args.schedules < 1:
        print(f"--faults: unknown {', '.join(unknown)}; use 'all' or some of {', '.join(FAULTS)}" if unknown
              else "--schedules: give a positive number", file=sys.stderr)
        return 2
    report = run_schedules(args.schedules, args.seed, faults)
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


if __name__ == "__main__":
    sys.exit(main())
