"""The event list of a local run: ``"STEP:leave=R,R STEP:join=K STEP:kill=R STEP:parallel=CFG"``.

``STEP`` is the optimizer step after which the change happens. ``leave`` and ``kill`` name ranks
of the world current at that step; ``join`` adds ``K`` new workers; ``parallel`` switches to a
config on the same workers; ``coordinator=restart`` kills the coordinator and starts a new one
(training must not notice, and later changes must still work); ``stop=resume`` stops the job
(the world saves a checkpoint, every worker waits) and resumes it at once on the same workers
from that checkpoint, the way a job that fell below its minimum comes back. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig

KINDS = ("leave", "join", "kill", "parallel", "coordinator", "stop")


@dataclass(frozen=True)
class Event:
    step: int
    kind: str
    ranks: tuple[int, ...] = ()  # leave, kill
    count: int = 0  # join
    config: str | None = None  # parallel; for "coordinator" and "stop" the action ("restart", "resume")

    def __str__(self) -> str:
        arg = {"leave": ",".join(map(str, self.ranks)), "kill": ",".join(map(str, self.ranks)),
               "join": str(self.count), "parallel": self.config, "coordinator": self.config,
               "stop": self.config}[self.kind]
        return f"{self.step}:{self.kind}={arg}"


def parse_events(text: str | None) -> list[Event]:
    if not text or not text.strip():
        return []
    out: list[Event] = []
    for item in text.split():
        step_s, sep, rest = item.partition(":")
        kind, eq, arg = rest.partition("=")
        if not sep or not eq:
            raise ConfigError("--events", f"{item!r} is not STEP:KIND=ARG",
                              "write e.g. 10:leave=3 20:join=1 30:kill=2 40:parallel=tp=2,pp=1,dp=2")
        try:
            step = int(step_s)
        except ValueError:
            raise ConfigError("--events", f"{step_s!r} in {item!r} is not a step number") from None
        if kind not in KINDS:
            raise ConfigError("--events", f"unknown event kind {kind!r} in {item!r}", f"use one of {', '.join(KINDS)}")
        if kind in ("leave", "kill"):
            try:
                ranks = tuple(sorted({int(r) for r in arg.split(",")}))
            except ValueError:
                raise ConfigError("--events", f"{arg!r} in {item!r} is not a list of ranks") from None
            out.append(Event(step, kind, ranks=ranks))
        elif kind == "join":
            if not arg.isdigit() or int(arg) < 1:
                raise ConfigError("--events", f"join needs a positive count, got {arg!r}")
            out.append(Event(step, kind, count=int(arg)))
        elif kind in ("coordinator", "stop"):
            action = {"coordinator": "restart", "stop": "resume"}[kind]
            if arg != action:
                raise ConfigError("--events", f"{kind} events take {action!r}, got {arg!r}", f"write {step_s}:{kind}={action}")
            out.append(Event(step, kind, config=arg))
        else:
            ParallelConfig.parse(arg)  # fail early with the config's own message
            out.append(Event(step, kind, config=arg))
    steps = [e.step for e in out]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        raise ConfigError("--events", "steps must be strictly increasing", "one event per step, in order")
    if any(s < 1 for s in steps):
        raise ConfigError("--events", "event steps start at 1 (after the first optimizer step)")
    return out
