"""The event list of a local run: ``"STEP:leave=R,R STEP:join=K STEP:kill=R STEP:parallel=CFG"``.

``STEP`` is the optimizer step after which the change happens. ``leave`` and ``kill`` name ranks
of the world current at that step; ``join`` adds ``K`` new workers; ``parallel`` switches to a
config on the same workers; ``coordinator=restart`` kills the coordinator and starts a new one
(training must not notice, and later changes must still work); ``stop=resume`` stops the job
(the world saves a checkpoint, every worker waits) and resumes it at once on the same workers
from that checkpoint, the way a job that fell below its minimum comes back.

``kill=R@PHASE`` kills during a reconfiguration instead of at a step: at ``STEP`` the victims
are armed, and the next event's reconfiguration (a leave, join or parallel event, which must
follow) kills each when it reaches ``PHASE`` (``prepare``, ``connect``, ``transfer``, ``commit``,
``built``, ``commit-window``, ``committed``: ``protocol.PHASES``). ``R`` is a rank of the current
world, or ``+K`` for the K-th worker the next join adds.

``kill=coordinator@PHASE`` kills the coordinator instead, once every process of the next
reconfiguration that passes ``PHASE`` is held there (``commit-window``: the new members' ready
votes are cast and no decision is read), and starts a new one on the same address, as Kubernetes
restarts its pod. The change must still happen: committed, or aborted and re-issued by the new
coordinator.

``sigstop=R`` freezes ranks (SIGSTOP) at the step: to the job they are lost without notice.
``sigcont=all`` lets every frozen worker go on (SIGCONT): it finds the job went on without it,
drops its stale state and comes back as a new member, which the driver then admits as a join.
``restart=all`` kills the coordinator and every worker at once and starts new ones on the same
checkpoint directory: the job continues from its newest complete checkpoint.

``slow=R@F`` makes device R (the worker that was rank R of the first world) run at F times its
speed from that step on (``F`` in (0, 1]: after each forward or backward the worker sleeps
``(1/F - 1)`` times what it computed, so the CPU stays free for the others); ``slow=R@1``
restores it. A device keeps its slowness wherever a reconfiguration moves it (another rank,
standby), so R names a device, not a rank. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from liveshard.runtime.control.protocol import PHASES
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig

KINDS = ("leave", "join", "kill", "parallel", "coordinator", "stop", "sigstop", "sigcont", "restart", "slow")
PLAN_KINDS = ("leave", "join", "parallel", "stop", "sigstop", "sigcont", "kill")  # events that change the world


@dataclass(frozen=True)
class Event:
    step: int
    kind: str
    ranks: tuple[int, ...] = ()  # leave, kill
    count: int = 0  # join
    config: str | None = None  # parallel; for "coordinator" and "stop" the action ("restart", "resume")
    phase: str | None = None  # kill: during this phase of the next reconfiguration
    factor: float = 1.0  # slow: the device's speed from this step on
    joiners: tuple[int, ...] = ()  # kill: the next join's K-th workers (1-based)
    coordinator: bool = False  # kill: the coordinator, not workers

    @property
    def victims(self) -> str:
        if self.coordinator:
            return "coordinator"
        return ",".join([*map(str, self.ranks), *(f"+{k}" for k in self.joiners)])

    def __str__(self) -> str:
        kill = self.victims + (f"@{self.phase}" if self.phase else "")
        arg = {"leave": ",".join(map(str, self.ranks)), "kill": kill, "sigstop": ",".join(map(str, self.ranks)),
               "sigcont": "all", "restart": "all", "slow": f"{','.join(map(str, self.ranks))}@{self.factor:g}",
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
        if kind == "kill":
            out.append(_kill(step, arg, item))
        elif kind == "slow":
            out.append(_slow(step, arg, item))
        elif kind in ("sigcont", "restart"):
            if arg != "all":
                raise ConfigError("--events", f"{kind} events take 'all', got {arg!r}", f"write {step_s}:{kind}=all")
            out.append(Event(step, kind))
        elif kind in ("leave", "sigstop"):
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
    for i, ev in enumerate(out):
        if ev.kind != "kill" or ev.phase is None:
            continue
        following = out[i + 1] if i + 1 < len(out) else None
        if following is None or following.kind not in ("leave", "join", "parallel"):
            raise ConfigError("--events", f"{ev} needs a reconfiguration to kill in",
                              f"follow it with a leave, join or parallel event, e.g. {ev.step + 1}:join=1")
        if ev.joiners and (following.kind != "join" or max(ev.joiners) > following.count):
            raise ConfigError("--events", f"{ev} names joiners the next event does not add",
                              f"follow it with {ev.step + 1}:join={max(ev.joiners)}")
    return out


def _kill(step: int, arg: str, item: str) -> Event:
    """``kill=R,R`` (at the step), ``kill=R,+K@PHASE`` (during the next reconfiguration) or
    ``kill=coordinator@PHASE``."""
    who, at, phase = arg.partition("@")
    if at and phase not in PHASES:
        raise ConfigError("--events", f"unknown phase {phase!r} in {item!r}", f"use one of {', '.join(PHASES)}")
    if who == "coordinator":
        if not at:
            raise ConfigError("--events", f"{item!r} kills the coordinator at no phase",
                              f"write {step}:kill=coordinator@commit-window, or {step}:coordinator=restart at a step")
        return Event(step, "kill", phase=phase, coordinator=True)
    ranks, joiners = set(), set()
    try:
        for token in who.split(","):
            (joiners if token.startswith("+") else ranks).add(int(token))
    except ValueError:
        raise ConfigError("--events", f"{who!r} in {item!r} is not a list of ranks",
                          "ranks of the current world, or +K for the next join's K-th worker") from None
    if joiners and not at:
        raise ConfigError("--events", f"{item!r} kills a joiner outside a reconfiguration", f"write {item}@commit")
    if any(k < 1 for k in joiners) or any(r < 0 for r in ranks):
        raise ConfigError("--events", f"{who!r} in {item!r}: ranks start at 0, joiners at +1")
    return Event(step, "kill", ranks=tuple(sorted(ranks)), phase=phase or None, joiners=tuple(sorted(joiners)))


def _slow(step: int, arg: str, item: str) -> Event:
    """``slow=R,R@F``: those ranks' devices at F times their speed (0 < F <= 1)."""
    who, at, factor = arg.partition("@")
    try:
        ranks = tuple(sorted({int(r) for r in who.split(",")}))
        value = float(factor)
    except ValueError:
        raise ConfigError("--events", f"{arg!r} in {item!r} is not RANKS@FACTOR",
                          "write e.g. 5:slow=1@0.5 (rank 1 at half speed) and 20:slow=1@1 (back to full)") from None
    if not at or not 0.0 < value <= 1.0 or any(r < 0 for r in ranks):
        raise ConfigError("--events", f"{item!r}: a slowdown is RANKS@FACTOR with 0 < FACTOR <= 1",
                          "write e.g. 5:slow=1@0.5")
    return Event(step, "slow", ranks=ranks, factor=value)
