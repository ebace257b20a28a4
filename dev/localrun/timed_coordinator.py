"""``liveshard coordinator`` with another transition timeout: the local driver's, for tests.

    python -m liveshard.dev.localrun.timed_coordinator --transition-timeout S COORDINATOR-ARGS

Takes exactly the arguments of ``liveshard coordinator`` plus ``--transition-timeout`` and runs
the same command (``liveshard.runtime.commands.coordinator.run``) with the coordinator's
``transition_timeout`` set to ``S`` seconds. The production command has no such flag (a job's
generations get ``Defaults.TRANSITION_TIMEOUT``, minutes): a local test of what that timeout
bounds (a join waiting for a worker that never registers) would wait that long.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from liveshard.runtime.commands import coordinator as coordinator_command

MODULE = "liveshard.dev.localrun.timed_coordinator"


def build_parser() -> argparse.ArgumentParser:
    # resolve: should the command get a flag of that name, this one stands (with the same meaning)
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", conflict_handler="resolve",
                                description="liveshard coordinator with another transition timeout")
    coordinator_command.configure(p)
    p.add_argument("--transition-timeout", type=float, required=True,
                   help="seconds a generation may take (and a request may wait for its workers to register)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from liveshard.runtime.coordinator import loop

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    init = loop.Coordinator.__init__

    def with_timeout(self, *a, **kw) -> None:
        init(self, *a, **{**kw, "transition_timeout": args.transition_timeout})

    loop.Coordinator.__init__ = with_timeout  # the command builds its Coordinator with the default
    return int(coordinator_command.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
