"""The faults a schedule injects, and the end-of-schedule invariant (every live member trains
again, or the job ended ``Failed`` with a reason). The invariants checked at every step are
where the step happens (``world.Simulation``): one decision per generation, nothing adopted
uncommitted, nobody dead while heartbeating validly, samples once, no unverified restore."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from liveshard.dev.sim.store import ATTACKER, Link, SimClient, full
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import Heartbeat, MemberResult, Registration
from liveshard.runtime.coordinator.requests import PlanRequest

if TYPE_CHECKING:
    from liveshard.dev.sim.world import Simulation, Worker

REQUESTS = ("leave", "reshape")


class Faults:
    """Mixed into ``Simulation``."""

    def _plan_faults(self: Simulation) -> None:
        kinds = sorted(self.faults)
        for _ in range(self.rng.randint(1, 4)):
            if kinds:
                self.at(self.rng.uniform(2.0, self.duration), "fault", self.rng.choice(kinds))
        for _ in range(self.rng.randint(0, 2)):
            self.at(self.rng.uniform(2.0, self.duration), "fault", "request:" + self.rng.choice(REQUESTS))

    def _delete_pending_keys(self: Simulation, gen: int) -> None:
        """Every key of pending generation ``gen``, its plan and the plan pointers, deleted by a client
        without the secret before each coordinator tick and each worker's poll in the
        generation's first seconds (``delete_pending_for``)."""
        since = self.pending_since.setdefault(gen, self.now)
        if self.now - since >= self.delete_pending_for:
            return
        plans = (Keys.plan(gen), Keys.LATEST, Keys.CURRENT) if self.delete_pending_plans else ()
        for key in self.server.keys((f"gen/{gen}/", *plans)):
            if self.server.delete(key):
                self.log(f"FAULT delete {key}")

    def _operator_plan_for_the_loss(self: Simulation, lost: str) -> None:
        """In some schedules (``operator_plans``), the operator's plan for the same loss arrives
        later too (a node deleted: the operator saw it after the runtime did), naming the running
        world's other workers: it may change nothing the runtime already did (one authority)."""
        core = self.core
        if self.operator_plans is None or core is None or core.current is None or lost not in core.current.members:
            return
        others = tuple(m for m in (*core.current.members, *core.current.standbys) if m != lost)
        if others:
            from liveshard.dev.sim.world import HB_TIMEOUT

            delay = self.operator_plans.uniform(0.5, 3 * HB_TIMEOUT)
            self.at(self.now + delay, "fault", f"request:plan:operator: node of {lost} deleted:{','.join(others)}")

    def _alive(self: Simulation) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]

    def _fault(self: Simulation, kind: str) -> None:
        rng, server, core = self.rng, self.server, self.core
        alive = self._alive()
        if kind.startswith("request:"):
            if core is None or core.current is None or not core.current.members:
                return
            cur = core.current
            if kind == "request:leave" and len(cur.members) > 1:
                gone = rng.choice(cur.members)
                self.source.queue.append(PlanRequest(members=tuple(m for m in (*cur.members, *cur.standbys)
                                                                   if m != gone), reason=f"{gone} leaves"))
            elif kind == "request:reshape":
                config = "dp" if cur.config.startswith("tp") else "tp"
                self.source.queue.append(PlanRequest(members=cur.members, config=config, reason="reshape"))
            elif kind.startswith("request:plan:"):  # a scripted plan: request:plan:<reason>:<m,m,...>
                head, members = kind.rsplit(":", 1)  # the reason may hold colons; the members do not
                reason = head.removeprefix("request:plan:")
                self.source.queue.append(PlanRequest(members=tuple(members.split(",")), reason=reason))
            self.log(f"request {kind}")
            return
        self._count(kind)
        if kind.startswith("kill:"):
            w = self.workers[kind.split(":", 1)[1]]
            w.alive = False
            self.log(f"FAULT kill {w.inc} (its node deleted)")
        elif kind in ("kill", "restart") and alive:
            w = rng.choice(alive)
            w.alive = False
            self.log(f"FAULT kill {w.inc}")
            if kind == "restart":
                self.at(self.now + rng.uniform(1.0, 3.0), "fault", f"respawn:{w.id}")
            self._operator_plan_for_the_loss(w.id)
        elif kind.startswith("respawn:"):
            w = self.workers[kind.split(":", 1)[1]]
            w.incarnation += 1
            w.alive, w.phase, w.world, w.state_step, w.target, w.driver = True, "waiting", None, None, None, None
            w.building, w.last_cp, w.preparing, w.known = None, None, None, set()
            w.link, w.frozen_until, w.torn_down, w.broken_at, w.handled = Link(), 0.0, False, None, -1
            w.latest_seen, w.clock_skew = -1, 0.0
            self.log(f"{w.inc} starts (a restarted pod)")
            self.at(self.now + 0.1, "wake", w.id)
        elif kind == "coordinator":
            if core is None:
                return
            if core.pending is None and rng.random() < 0.7 and self.now < self.duration:
                self.at(self.now + 0.3, "fault", kind)  # wait for a generation in flight, most of the time
                self.fault_count[kind] -= 1
                return
            self._kill_coordinator(f"pending {core.pending.plan.generation if core.pending else None}")
        elif kind == "forge":
            self._forge(rng.choice(alive) if alive else self.workers["w0"])
        elif kind.startswith("forge-hb:"):  # scripted: forge-hb:<member>:<seconds, or 'once'>
            _, member, seconds = kind.split(":")
            self._forge_beat(member, None if seconds == "once" else float(seconds))
        elif kind.startswith("plant-slots:"):  # scripted: forged registration slots 0..N-1
            for i in range(int(kind.split(":", 1)[1])):
                server.forge(Keys.member_index(i), f"w{i}")
            self.log(f"FAULT {kind.split(':', 1)[1]} forged registration slots planted")
        elif kind.startswith("rendezvous:"):  # scripted: the next N live transitions' rendezvous broken
            self.rendezvous_broken = int(kind.split(":", 1)[1])
            self.log(f"FAULT the rendezvous keys of the next {self.rendezvous_broken} changes overwritten")
        elif kind == "capture-checkpoint":  # scripted: the attacker keeps checkpoint/latest's bytes as they are
            self.captured_pointer = self.server.data.get(full(Keys.CHECKPOINT))
            self.log(f"FAULT checkpoint/latest captured ({self.captured_pointer is not None})")
        elif kind == "plant-checkpoint":  # scripted: ... and writes them back, into the store of the day
            if self.captured_pointer is not None and server.up:
                server._land(ATTACKER, full(Keys.CHECKPOINT), self.captured_pointer)
                self.log("FAULT the captured checkpoint/latest written back (a replay)")
        elif kind.startswith("freeze-coordinator:") and self.coordinator is not None:  # scripted: for <seconds>
            until = self.now + float(kind.split(":", 1)[1])
            self.coord_frozen_until = self.server.frozen_until = until
            self.coord_frozen_from = self.now
            self.beating_at_freeze = {w.inc for w in alive if self.now - w.last_valid_beat < 1.5
                                      and self.now >= w.frozen_until}
            self.log(f"FAULT freeze the coordinator until {until:.2f}")
        elif kind == "delete-registrations":  # scripted: every registration (members/...) deleted
            for key in server.keys(("members/",)):
                server.delete(key)
                self.log(f"FAULT delete {key}")
        elif kind == "coordinator-now":  # scripted: the coordinator killed at once
            if core is not None:
                self._kill_coordinator("scripted")
        elif kind.startswith("delete-pending"):  # scripted: delete-pending[-votes]:<seconds of each pending generation>
            self.delete_pending_for = float(kind.split(":", 1)[1])
            self.delete_pending_plans = not kind.startswith("delete-pending-votes")
            self.log(f"FAULT the keys of each pending generation deleted for its first {self.delete_pending_for} s")
        elif kind.startswith("unforge:"):
            self.forged_beats.discard(kind.split(":", 1)[1])
            self.solid_forged.discard(kind.split(":", 1)[1])
        elif kind == "replay":
            prefix = rng.choice(("hb/", "hb/", "members/", "gen/", "plan/", "dead/", Keys.CHECKPOINT))
            keys = server.stale_keys((prefix,)) if rng.random() < 0.5 else []
            keys = keys or [k for k in server.keys((prefix,)) if server.history.get(full(k))]
            for key in rng.sample(keys, min(len(keys), rng.choice((1, 1, 2, 5)))):
                if server.replay(key):
                    self.log(f"FAULT replay {key}")
        elif kind == "delete":
            keys = server.keys(("gen/", "hb/", "plan/", "dead/", "members/"))
            for key in rng.sample(keys, min(len(keys), rng.choice((1, 1, 3, 50)))):
                server.delete(key)
                self.log(f"FAULT delete {key}")
        elif kind == "slow" and alive:
            w = rng.choice(alive)
            w.frozen_until = self.now + rng.uniform(0.5, 1.8)  # a stall shorter than half the timeout
            self.log(f"FAULT slow {w.inc} until {w.frozen_until:.2f}")
        elif kind == "freeze" and self.coordinator is not None and rng.random() < 0.25:
            # SIGSTOP of the coordinator's process for longer than the heartbeat timeout: its
            # store answers nobody meanwhile; on waking it must not take that for silence
            until = self.now + rng.uniform(1.5, 3.0) * self.coordinator.heartbeat_timeout
            self.coord_frozen_until = self.server.frozen_until = until
            self.coord_frozen_from = self.now
            self.beating_at_freeze = {w.inc for w in alive if self.now - w.last_valid_beat < 1.5
                                      and self.now >= w.frozen_until}
            self.log(f"FAULT freeze the coordinator until {until:.2f}")
        elif kind == "freeze" and alive:
            w = rng.choice(alive)
            w.frozen_until = self.now + rng.uniform(6.0, 12.0)  # SIGSTOP past the timeout, then SIGCONT
            self.log(f"FAULT freeze {w.inc} until {w.frozen_until:.2f}")
        elif kind == "clock" and alive:
            w = rng.choice(alive)
            w.clock_skew += rng.choice((-1, 1)) * rng.uniform(10.0, 300.0)
            self.log(f"FAULT clock jump on {w.inc}: {w.clock_skew:+.0f} s")
        elif kind == "counter":
            # the store's counters are gone from the protocol; what stands in for them is sealed:
            # a bumped old counter and a forged count-in must change nothing
            if server.up and not server.frozen:
                SimClient(server, ATTACKER).add(Keys.MEMBER_COUNT, 1)
            target = rng.choice(sorted(self.workers))
            key = Keys.arrived(core.next_generation if core else 0, target)
            server.forge(key, "1")
            self.log(f"FAULT counter {key}")
        elif kind == "damage" and self.checkpoints and not self.checkpoints[-1].get("final"):
            self.checkpoints[-1]["verified"] = False
            self.log(f"FAULT damage {self.checkpoints[-1]['path']}")

    def _forge(self: Simulation, target: Worker) -> None:
        """Values an attacker without the secret writes: well-formed, and harmful if taken as valid."""
        rng, server, core = self.rng, self.server, self.core
        if rng.random() < 0.35:
            # overwritten before every read of the coordinator, for longer than three heartbeat
            # timeouts: the key shows the coordinator nothing valid all along
            from liveshard.dev.sim.world import HB_TIMEOUT

            self._forge_beat(target.id, rng.uniform(3.2, 4.0) * HB_TIMEOUT)
            return
        what = rng.choice(("hb", "decision", "latest", "result", "dead", "member", "index", "garbage"))
        if what == "hb":
            self.forged_beats.add(target.id)
            self.at(self.now + rng.uniform(2.0, 8.0), "fault", f"unforge:{target.id}")
        elif core is not None:
            gen = core.pending.plan.generation if core.pending is not None and rng.random() < 0.7 \
                else core.next_generation
            info = Registration(node=target.id, incarnation=f"{target.id}.forged", latest_seen=10**6)
            value = {"decision": (Keys.decision(gen), COMMITTED),
                     "latest": (Keys.LATEST, str(gen + 5)),
                     "result": (Keys.result(gen, target.id), MemberResult(ok=True).to_json()),
                     "dead": (Keys.dead(target.id), target.inc),
                     "member": (Keys.member(target.id), json.dumps(info.to_dict())),
                     "index": (Keys.member_index(len(server.keys(("members/index",))) + rng.randint(0, 1)),
                               target.id),
                     "garbage": (Keys.decision(gen), "")}[what]
            if what == "garbage":
                server.garbage(value[0])
            else:
                server.forge(*value)
        self.log(f"FAULT forge {what} {target.id}")

    def _forge_beat(self: Simulation, member: str, seconds: float | None) -> None:
        """An attacker overwrites ``member``'s heartbeat before every read of the coordinator for
        ``seconds`` (None: once, and the forged value is left in the key)."""
        if seconds is None:
            w = self.workers[member]
            self.server.forge(Keys.heartbeat(member), Heartbeat(time=self.now, state="training",
                                                                incarnation=w.inc).to_json())
            self.log(f"FAULT forge hb {member} once")
            return
        self.forged_beats.add(member)
        self.solid_forged.add(member)
        self.at(self.now + seconds, "fault", f"unforge:{member}")
        self.log(f"FAULT forge hb {member} before every read for {seconds:.1f} s")

    def _kill_coordinator(self: Simulation, when: str) -> None:
        """The coordinator's process dies, and the store it serves with it; Kubernetes restarts
        its pod a little later (a new, empty store)."""
        self.server.up = False
        self.coordinator = None
        self.log(f"FAULT coordinator killed ({when})")
        self.at(self.now + self.rng.uniform(0.5, 4.0), "coord-up", "")

    # ---- the end --------------------------------------------------------------------------------
    def _settled(self: Simulation) -> str | None:
        """None when the job is settled: it ended ``Failed``, or every live member trains in
        the current world, which counts no dead member and stepped since the last fault; else
        what is not."""
        core = self.core
        if self.failure is not None:
            return None
        if core is None:
            return "the coordinator is not back"
        if core.finished is not None:
            return None  # trainIters reached and the final checkpoint saved: done
        gave_up = [w.inc for w in self.workers.values() if w.phase == "failed"]
        if gave_up:
            return f"the final save gave up ({gave_up}) and the job has not ended Failed"
        cur = core.current
        if not self._alive() and core.pending is None:
            return None  # no process left to train: the job waits for capacity (the operator's part)
        if cur is None or core.pending is not None:
            return (f"current {cur.generation if cur else None}, "
                    f"pending {core.pending.plan.generation if core.pending else None}")
        for w in self._alive():
            if w.id in cur.members and (w.phase != "training" or w.world is None
                                        or w.world.generation != cur.generation):
                return f"{w.inc} is {w.phase} in {w.world.generation if w.world else None}, not in {cur.generation}"
            if w.id not in cur.members and w.id not in cur.standbys and w.phase != "waiting":
                return f"{w.inc} is {w.phase} outside generation {cur.generation}"
        dead_members = [m for m in cur.members if not self.workers[m].alive]
        if dead_members:
            return f"generation {cur.generation} still counts dead {dead_members}"
        track = self.tracks.get(cur.generation)
        if track is None or (track.step <= self.step_at_last_fault and track.start is not None \
                and track.start <= self.step_at_last_fault):
            return f"generation {cur.generation} has not stepped since the last fault"
        return None

    def _check_settled(self: Simulation) -> None:
        """After the faults and a bound: every live member trains again, or the job failed."""
        problem = self._settled()
        if problem is not None:
            self.violate(f"not settled {self.settle:.0f} s after the last fault: {problem}")

    def _outcome(self: Simulation) -> str:
        core = self.core
        if self.failure is not None:
            return f"failed: {self.failure['reason']}"
        if core is not None and core.finished is not None:
            return f"finished in step {core.finished.get('step')}"
        if core is not None and core.current is not None:
            return f"training in generation {core.current.generation}"
        return "nothing"
