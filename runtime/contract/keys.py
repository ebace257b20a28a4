"""Every key of a job's c10d store, in one namespace.

The coordinator serves the store; workers, the coordinator's plan sources and the local tools
read and write it. All values are JSON or plain text (never pickled). Keys live under the job's
prefix (``liveshard/<job>/``, see ``control.store.JobStore``). Every value is sealed with the job's
secret, incarnation and a per-key sequence; a reader that finds a value forged, replayed or deleted
keeps the last valid one (the rules: ``control.store``). Keys marked *write-once* keep the first
value a reader accepted; ``counter`` keys (``store.add``) cannot be sealed.

    members/<id>                 a worker announces itself (host, pid, node, time; after a
                                 coordinator restart also its plan and newest checkpoint)
    members/index/<i>            the registration order: worker ids, each slot claimed by a
                                 compare-and-set (``JobStore.append``; a forged slot is taken
                                 over); read up to a few slots in a row without a valid entry
    members/count                no longer written (the slots above need no counter)
    dead/<id>                    the coordinator declared this incarnation of <id> dead (it
                                 rejoins as a new one if it is still alive)
    hb/<id>                      heartbeat: time, state, generation, rank, step, step time, loss
    plan/latest                  generation number of the newest world plan (a lower one than a
                                 reader accepted is a replay)
    plan/current                 the newest committed generation (the coordinator): a process
                                 whose world is older and that is not in this one holds stale
                                 state and comes back as a new process
    plan/<N>                     WorldPlan N (config, members in rank order, reason, ...); write-once
    gen/<N>/prepared/<id>        the member's transition-plan checksum (it has prepared N)
    gen/<N>/switch               the step boundary at which the old world switched to N
    gen/<N>/result/<id>          the member's outcome and phase timings (MemberResult); write-once
    gen/<N>/arrived/<id>         the new member is about to build the new world (its sources have
                                 delivered); sealed: what the coordinator counts
    gen/<N>/arrivals             counter of the same, for members waiting for each other; not
                                 sealed: a bump only ends a wait early, into the rendezvous
    gen/<N>/ready/<id>           the new member's world is built and loaded
    gen/<N>/decision             the commit point of a live transition: "committed" (written
                                 by the last ready member) or "aborted: <why>" (a failed
                                 member, a waiter out of time, or the coordinator on a death);
                                 the first valid writer wins (``JobStore.decide``: compare-and-set,
                                 planted values replaced); write-once
    gen/<N>/outcome              "committed" or "aborted: <why>" (written by the coordinator); write-once
    world/<N>/<t>/...            c10d keys of the training world of generation N; not sealed (c10d
                                 writes them), so under a token <t> derived from the job's secret
                                 (``rendezvous_token``): no one without it can plant them before
    xfer/<N>/<t>/...             c10d keys of the transition group (old members + new members), the same
    request/<k>                  plan requests posted by a local driver (StorePlanSource), a list
                                 without a counter (``JobStore.append``/``entries``)
    coordinator/status           the coordinator's last status report (JSON)
    control/stop                 ask every worker to finish (local driver)
    checkpoint/latest            the newest complete checkpoint: path, step, config (rank 0); a
                                 lower step than a reader accepted is a replay unless written
                                 with ``JobStore.rewind`` (after a restore from an older one)
    checkpoint/failed            the last failed save: step, error, time, count (rank 0)
    checkpoint/unavailable       why a worker cannot use the checkpoint directory (path, error)
    dev/release/<step>           dev tooling: a held worker may pass step <step>
    dev/held/<step>/<id>         dev tooling: worker <id> is held at step <step>
    dev/phase/<id>               dev tooling: the reconfiguration phase to hold worker <id> at
    dev/at-phase/<id>            dev tooling: worker <id> is held at that phase
"""

from __future__ import annotations

import hashlib
import hmac
import os

from liveshard.runtime.contract.env import Env

# The environment variable that carries the job's store secret: every value above is written
# with an HMAC made with it (control.store.JobStore); the operator keeps it in a per-job Secret.
SECRET_ENV = Env.JOB_SECRET
# The job's incarnation (the job object's uid), bound into every MAC, so values of an earlier job
# of the same name do not verify in this one; empty where nothing sets it (local runs).
INCARNATION_ENV = Env.JOB_INCARNATION


class Keys:
    LATEST = "plan/latest"
    CURRENT = "plan/current"  # the newest committed generation (the coordinator, at each commit)
    STOP = "control/stop"
    CHECKPOINT = "checkpoint/latest"
    CHECKPOINT_FAILED = "checkpoint/failed"
    CHECKPOINT_UNAVAILABLE = "checkpoint/unavailable"
    FINISHED = "control/finished"  # rank 0 at trainIters: step, final checkpoint, or why none (JSON)
    MEMBER_COUNT = "members/count"
    COORDINATOR_STATUS = "coordinator/status"

    @staticmethod
    def member(worker: str) -> str:
        return f"members/{worker}"

    @staticmethod
    def member_index(index: int) -> str:
        return f"members/index/{index}"

    @staticmethod
    def dead(worker: str) -> str:
        return f"dead/{worker}"

    @staticmethod
    def heartbeat(worker: str) -> str:
        return f"hb/{worker}"

    @staticmethod
    def plan(gen: int) -> str:
        return f"plan/{gen}"

    @staticmethod
    def prepared(gen: int, worker: str) -> str:
        return f"gen/{gen}/prepared/{worker}"

    @staticmethod
    def connecting(gen: int, worker: str) -> str:
        """A new member is about to connect the new world's communicators (comms.world)."""
        return f"gen/{gen}/connecting/{worker}"

    @staticmethod
    def switch(gen: int) -> str:
        return f"gen/{gen}/switch"

    @staticmethod
    def result(gen: int, worker: str) -> str:
        return f"gen/{gen}/result/{worker}"

    @staticmethod
    def arrived(gen: int, worker: str) -> str:
        """A new member counted itself in to build the new world (its sources have delivered):
        sealed, what the coordinator counts."""
        return f"gen/{gen}/arrived/{worker}"

    @staticmethod
    def arrivals(gen: int) -> str:
        """Counter of the same, for members waiting for each other (one read per poll at any
        scale). Not sealed: a bump only ends a wait early, into the rendezvous, which waits for
        everyone itself."""
        return f"gen/{gen}/arrivals"

    @staticmethod
    def ready(gen: int, worker: str) -> str:
        return f"gen/{gen}/ready/{worker}"

    @staticmethod
    def decision(gen: int) -> str:
        return f"gen/{gen}/decision"

    @staticmethod
    def outcome(gen: int) -> str:
        return f"gen/{gen}/outcome"

    @staticmethod
    def world_prefix(gen: int) -> str:
        return f"world/{gen}/{rendezvous_token(f'world/{gen}')}"

    @staticmethod
    def transfer_prefix(gen: int) -> str:
        return f"xfer/{gen}/{rendezvous_token(f'xfer/{gen}')}"

    @staticmethod
    def request(index: int) -> str:
        return f"request/{index}"

    @staticmethod
    def release(step: int) -> str:
        return f"dev/release/{step}"

    @staticmethod
    def held(step: int, worker: str) -> str:
        return f"dev/held/{step}/{worker}"

    @staticmethod
    def hold_phase(worker: str) -> str:
        return f"dev/phase/{worker}"

    @staticmethod
    def at_phase(worker: str) -> str:
        return f"dev/at-phase/{worker}"

    @staticmethod
    def slowdown(worker: str) -> str:
        return f"dev/slowdown/{worker}"


COMMITTED = "committed"  # the value of Keys.decision / Keys.outcome for a generation that took effect


def rendezvous_token(name: str) -> str:
    """A path segment for the c10d keys of rendezvous ``name`` (``world/<N>``, ``xfer/<N>``) that
    only the job's processes can compute: an HMAC of the name under the job's secret and
    incarnation (``""`` without a secret: in-process tests). c10d's own keys cannot be sealed; a
    client without the secret cannot know them before the rendezvous writes them (it can still
    see them once written: docs/architecture.md, threat model)."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        return ""
    message = f"liveshard-rendezvous:{os.environ.get(INCARNATION_ENV, '')}:{name}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()[:16] + "/"
