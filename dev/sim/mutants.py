"""Bugs planted in the shipped protocol code, to show the simulator catches them.

Each ``Mutant`` names a shipped module and one edit of its source (a rule weakened the way a
careless change would weaken it). ``install(mutant)`` makes the next import of that module load
the edited source instead (an import hook: nothing on disk changes), so it must run in a fresh
process before anything imports the module: ``python -m liveshard.dev.sim --mutant NAME`` does
that, and exits 1 when the simulator finds a violation (the mutant is caught), 0 when every
schedule held (it survived). ``tests/unit/test_sim_mutants.py`` runs every mutant on a fixed
budget in CI.

An edit whose ``old`` text is no longer in the module is an error (exit 3), never a silent
pass: the mutants move with the code they plant bugs in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str  # the shipped module, as imported
    old: str  # the text replaced (exactly once)
    new: str
    why: str  # what the planted bug breaks
    scenario: str | None = None  # a scripted case (``sim.scenarios``) run before the random schedules


R = "liveshard.runtime."

MUTANTS: tuple[Mutant, ...] = (
    Mutant("mac-accepted", R + "control.store",
           "        if not hmac.compare_digest(mac.encode(), self._mac(key, seq, flag, value).encode()):\n"
           "            return None\n",
           "",
           "JobStore takes a value whose MAC does not verify for valid: forgeries steer the job"),
    Mutant("worker-commits-on-one-vote", R + "agent.commit_driver",
           "if self.cp.ready and store.store.check(keys) and all(store.get(k) == \"1\" for k in keys):",
           "if self.cp.ready:",
           "a new member writes the commit after its own ready vote, before the others voted"),
    Mutant("judge-commits-on-one-vote", R + "coordinator.generations",
           "if plan.members and all(m in ready for m in plan.members):",
           "if plan.members and any(m in ready for m in plan.members):",
           "the coordinator writes the commit once one member's ready vote is in"),
    Mutant("resolution-always-commits", R + "coordinator.generations",
           "    if any(True for _ in adopted):\n        return COMMITTED\n",
           "    return COMMITTED\n",
           "a restarted coordinator resolves every open generation as committed"),
    Mutant("resolution-without-every-member", R + "coordinator.generations",
           "    if plan.members and all(m in mine and m not in dead for m in plan.members):",
           "    if plan.members and any(m in mine and m not in dead for m in plan.members):",
           "a restarted coordinator commits an open generation one member reported, without the others"),
    Mutant("dead-kept-alive", R + "coordinator.membership",
           "            if now - w.fresh_at > limit:",
           "            if now - w.fresh_at > 1e9:",
           "the liveness judge never declares a silent member dead"),
    Mutant("sender-clock", R + "coordinator.membership",
           "            if now - w.fresh_at > limit:",
           "            if now - (w.beat.time if w.beat is not None else w.fresh_at) > limit:",
           "a heartbeat's age is judged against the sender's clock, not the reader's"),
    Mutant("contested-silence-kills", R + "coordinator.membership",
           "            if m not in corroborated:\n                return None\n",
           "",
           "a member whose heartbeat key an attacker overwrites all along is judged by its silence: "
           "a client without the secret decides its death", scenario="heartbeat-forged-for-three-timeouts"),
    Mutant("forged-beat-left-in-place", R + "control.store",
           "                elif _HEARTBEAT.fullmatch(key):\n                    repair = self._clear(key, raw, accepted)\n",
           "",
           "a forged heartbeat left behind once keeps its member contested for ever: a dead member is found "
           "dead late, or never", scenario="forged-beat-left-on-a-dead-worker"),
    Mutant("failed-change-never-asked-again", R + "coordinator.switching",
           "    core.change(reissue=(*core.state.reissue, request))\n",
           "",
           "a change whose rendezvous was disturbed is dropped at once: one overwrite of c10d's keys "
           "stops every reconfiguration", scenario="rendezvous-overwritten-then-intact"),
    Mutant("failed-change-retried-for-ever", R + "coordinator.switching",
           "    if tries >= RETRIES:\n",
           "    if False:\n",
           "a change that keeps failing is asked again without bound", scenario="rendezvous-overwritten-all-along"),
    Mutant("list-walks-planted-slots", R + "control.store",
           "            missing = missing + 1 if read.value is None else 0\n",
           "            missing = missing + 1 if read.seen is Seen.ABSENT else 0\n",
           "a list reader walks every planted slot: work per tick grows with what an attacker plants",
           scenario="forged-list-slots"),
    Mutant("tampering-uncounted", R + "control.store",
           "            self.tampering[seen] += 1\n",
           "",
           "JobStore ignores tampering silently (it is neither counted nor exported)"),
    Mutant("final-save-verdict-ignores-a-rank", R + "agent.final_save",
           "    if not failed:\n        return None\n",
           "    if len(failed) < len(errors):\n        return None\n",
           "the final save counts as saved when some rank wrote its part, not every rank"),
    Mutant("final-save-failure-finishes", R + "coordinator.core",
           "if isinstance(obs.finished, dict) and obs.finished.get(\"error\") and self.finished is None:",
           "if False:",
           "the coordinator takes a final save that gave up for a finished job"),
    Mutant("frozen-coordinator-judges-its-own-pause", R + "coordinator.loop",
           "        return gap if gap > self.heartbeat_timeout / 2 else 0.0\n",
           "        return 0.0\n",
           "a coordinator woken from a stop takes the time it did not run for its members' silence"),
    Mutant("final-save-without-its-fallback", R + "agent.final_save",
           "roots = [r for r in dict.fromkeys((primary, fallback)) if r]",
           "roots = [primary] if primary else []",
           "the final save never tries the fallback directory: a job with room there fails"),
    Mutant("plan-not-kept", R + "coordinator.loop",
           "                self.kept.written(Keys.plan(a.plan.generation), a.plan.to_json())\n",
           "",
           "a plan deleted before its members read it is never written back: the change aborts at the "
           "transition timeout", scenario="keys-deleted-while-a-change-is-pending"),
    Mutant("worker-writes-not-kept", R + "agent.kept_writes",
           "        if now - self._checked < KEPT_CHECK:\n",
           "        if True:\n",
           "a member's result, digest, arrival or ready vote deleted before it was read is never written "
           "again: the change aborts at the timeout", scenario="votes-deleted-while-a-change-is-pending"),
    Mutant("replayed-checkpoint-pointer-trusted", R + "coordinator.events",
           "    if newest is not None and (not pointer or int(newest[\"step\"]) > int(pointer.get(\"step\", -1))):\n",
           "    if newest is not None and not pointer:\n",
           "a validly sealed checkpoint/latest replayed to a restarted coordinator rolls a restore back to the "
           "older checkpoint it names", scenario="checkpoint-pointer-replayed"),
    Mutant("standbys-left-out-of-a-recovery", R + "coordinator.planning",
           "    survivors = tuple(m for m in (*core.current.members, *core.current.standbys) if m not in core.dead)\n",
           "    survivors = tuple(m for m in core.current.members if m not in core.dead)\n",
           "a recovery from a loss plans over the members alone: a standby never takes the lost member's "
           "place, and the job trains below the parallelism it needs", scenario="standby-takes-over-a-lost-member"),
    Mutant("generation-prepared-twice", R + "agent.control",
           "    if known or plan.generation <= current or decided or worker_id in plan.dead or replacement():\n",
           "    if plan.generation <= current or decided or worker_id in plan.dead or replacement():\n",
           "a worker takes up again a generation it prepared (and saw aborted) before: members switch to "
           "a generation the coordinator decided against", scenario="coordinator-stopped-mid-switch"),
    Mutant("lost-world-fails-despite-a-checkpoint", R + "coordinator.planning",
           "    checkpoint = core.checkpoints.latest() or core.adopted_checkpoint\n    if checkpoint is None:\n",
           "    checkpoint = core.checkpoints.latest() or core.adopted_checkpoint\n    if True:\n",
           "a world whose state has no surviving copy fails the job even with a verified checkpoint"),
)

BY_NAME = {m.name: m for m in MUTANTS}


class _Loader(importlib.abc.Loader):
    def __init__(self, mutant: Mutant, origin: str) -> None:
        self.mutant, self.origin = mutant, origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        with open(self.origin, encoding="utf-8") as f:
            source = f.read()
        if source.count(self.mutant.old) != 1:
            raise NotPlanted(f"mutant {self.mutant.name}: its text is not in {self.origin} exactly once")
        code = compile(source.replace(self.mutant.old, self.mutant.new), self.origin, "exec")
        exec(code, module.__dict__)


class NotPlanted(Exception):
    """The mutant's text is not in the module (the code moved on): update the mutant."""


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != self.mutant.module:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.origin:
                return importlib.util.spec_from_loader(name, _Loader(self.mutant, spec.origin), origin=spec.origin)
        return None


def install(mutant: Mutant) -> None:
    """Plant ``mutant``: the next import of its module loads the edited source."""
    if mutant.module in sys.modules:
        raise RuntimeError(f"{mutant.module} is imported already: plant {mutant.name} in a fresh process")
    sys.meta_path.insert(0, _Finder(mutant))
