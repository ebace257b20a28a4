"""The one liveness judge of a job: which members are alive, which are dead, who may come back.

Pure: the coordinator's loop reads the heartbeats and registrations and passes them in with the
time (its own monotonic clock); the verdicts come back. Everyone else (the operator, the
workers, the status) reads this judge's verdict (``Keys.dead``, ``status.dead``) and never judges
again.

The rules:

* **Alive** is a *new* valid heartbeat seen within ``timeout`` on the reader's clock. A beat is new
  when its sender's (incarnation, seq or time) moved forward; the sender's clock is never
  compared with the reader's, so clock skew and clock jumps on either side cannot kill anyone.
* **Silent** past ``timeout`` is dead; past half of it when a peer of the same world reports that
  world broken (a failed collective is the first sign of a loss without notice).
* **Contested is not silent.** When the member's heartbeat key held a forged, replayed or deleted
  value within the last ``timeout`` (someone without the job's secret writes the store), the
  missing beats may be tampering, not silence, and a client without the secret must not be able
  to decide a death: silence alone never kills a contested member. It is dead only with
  authenticated evidence besides: its peers of the same world report that world broken (their
  beats are sealed; a forger cannot write them) and no new valid beat of its own came for
  ``contest_limit``. A contested member with no peer to report (a world of one, a joiner) is
  kept while the tampering goes on: an attack can delay the finding of a death by its own
  length plus ``timeout``, never cause one (a pending generation that waits on it still ends
  by its own timeout).
* **Unresponsive**: the coordinator may declare a member dead that answers no transition
  (``declare``), with its reason; the verdict is this judge's like any other.
* **Exited**: a member whose last heartbeat says its process is ending is dead for the world
  it was in (it takes no part in a transition); one that left by plan, or finished, is not judged.
* **Another process under the same id** (an incarnation change) is a death: the state the old
  process held is gone with it.
* **Never seen**: a watched member with neither a registration nor a beat is dead after
  ``never_seen_grace``; a registered one that never beats, after ``timeout`` from when its
  registration was first seen.
* **Readmission**: a dead id heartbeating again as a new incarnation is a new process and may
  join again (never while a plan about the world it died in still counts it); the same
  incarnation heartbeating again is the old process holding stale state: it stays out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from liveshard.runtime.control.protocol import Heartbeat, WorkerPhase

LOST_PROCESS = "<lost>"  # a holder not seen since a coordinator restart: any process seen is another


@dataclass(frozen=True)
class BeatRead:
    """What the loop read of one member this tick."""

    beat: Heartbeat | None = None  # the last valid heartbeat (None: never a valid one)
    tampered: bool = False  # the key held a forged, replayed or deleted value this tick
    registered: bool = False  # a valid registration (``members/<id>``) is in the store
    registered_incarnation: str | None = None


@dataclass
class _Watch:
    since: float  # when this judge started watching the member (its grace starts here)
    incarnation: str | None = None
    last: tuple[int, float] | None = None  # the order key of the newest beat accepted
    fresh_at: float | None = None  # the reader's time of the newest beat accepted
    registered_at: float | None = None
    contested_at: float | None = None  # the reader's time tampering was last seen on its key
    beat: Heartbeat | None = None
    grace: float | None = None  # how long it may stay unseen (None: ``never_seen_grace``)
    world: int | None = None  # the generation its holder trains in (``expect``)


@dataclass(frozen=True)
class Death:
    member: str
    incarnation: str | None
    why: str
    # its key was contested: only the peers' report that its world broke made its silence count
    on_report: bool = False


@dataclass(frozen=True)
class Verdict:
    dead: tuple[Death, ...] = ()
    readmitted: tuple[str, ...] = ()


def _order(beat: Heartbeat) -> tuple[int, float]:
    return (beat.seq if beat.seq is not None else -1, beat.time)


@dataclass
class Liveness:
    timeout: float
    never_seen_grace: float = 30.0
    contest_limit: float | None = None  # default: 3 timeouts
    dead: set[str] = field(default_factory=set)
    dead_incarnation: dict[str, str | None] = field(default_factory=dict)
    _watch: dict[str, _Watch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.never_seen_grace = max(self.never_seen_grace, 10 * self.timeout)
        if self.contest_limit is None:
            self.contest_limit = 3 * self.timeout

    def latest(self, member: str) -> Heartbeat | None:
        w = self._watch.get(member)
        return w.beat if w else None

    def beat_since(self, member: str, t: float) -> bool:
        """Whether a new beat of ``member`` was seen after the reader's time ``t``."""
        w = self._watch.get(member)
        return w is not None and w.fresh_at is not None and w.fresh_at > t

    def contested(self) -> tuple[str, ...]:
        """Members whose heartbeat key was tampered with (for the status)."""
        return tuple(sorted(m for m, w in self._watch.items() if w.contested_at is not None))

    def judge(self, now: float, watched: Iterable[str], reads: Mapping[str, BeatRead],
              corroborated: frozenset[str] = frozenset(), busy: frozenset[str] = frozenset(),
              paused: float = 0.0) -> Verdict:
        """One look: ``watched`` are the members whose death matters now (of the running world
        and of a pending transition), ``reads`` what the store holds for every member read,
        ``corroborated`` the members whose peers report their world broken, ``busy`` the dead
        ids still counted by a plan (not readmitted yet), ``paused`` how long the looking
        process was stopped before this look (``pause``)."""
        if paused > 0:
            self.pause(paused)
        deaths: list[Death] = []
        watched = set(watched)
        for m in [m for m in self._watch if m not in watched and m not in self.dead]:
            del self._watch[m]  # no longer in any world or transition: a later look starts afresh
        for m in sorted(watched - self.dead):
            read = reads.get(m, BeatRead())
            w = self._watch.get(m)
            if w is None:
                w = self._watch[m] = _Watch(since=now)
            death = self._observe(m, w, read, now, corroborated)
            if death is not None:
                deaths.append(death)
        if any(d.on_report for d in deaths):
            # The peers' report says that someone of their world is gone, not who. It decides
            # against a member whose key is contested (its silence may be the forgery's) only
            # when that member is the one suspect: not once a silence that needs no report
            # explains the break, nor while two or more contested members share the suspicion.
            # A contested member that is dead after all gives no result in the recovery's
            # generation and is found dead there (``switching``: silent in two aborted ones).
            suspects = [m for m in corroborated if (w := self._watch.get(m)) is not None
                        and w.contested_at is not None and now - w.contested_at <= self.timeout]
            if len(suspects) > 1 or any(d.member in corroborated and not d.on_report for d in deaths):
                deaths = [d for d in deaths if not d.on_report]
        for d in deaths:
            self.dead.add(d.member)
            self.dead_incarnation[d.member] = d.incarnation
            self._watch.pop(d.member, None)
        readmitted = []
        for m in sorted(self.dead - set(busy)):
            seen = reads.get(m)
            beat = seen.beat if seen else None
            if beat is None or not beat.incarnation or beat.incarnation == self.dead_incarnation.get(m):
                continue
            # a new process: watched afresh (if it is gone too, its silence tells)
            self.dead.discard(m)
            self.dead_incarnation.pop(m, None)
            self._watch[m] = _Watch(since=now, incarnation=beat.incarnation, last=_order(beat), fresh_at=now,
                                    beat=beat)
            readmitted.append(m)
        return Verdict(tuple(deaths), tuple(readmitted))

    def pause(self, gap: float) -> None:
        """Time this judge did not look does not count against anyone. The store is served by
        the coordinator's process: while that process is stopped (SIGSTOP, a VM pause, a long GC,
        a throttled container) no beat can land, and on waking its first look would find every
        member silent for the whole pause. So every member's last sign of life moves forward by
        ``gap``: silence counts only while the judge was there to hear it."""
        for w in self._watch.values():
            w.since += gap
            if w.fresh_at is not None:
                w.fresh_at += gap
            if w.registered_at is not None:
                w.registered_at += gap
            if w.contested_at is not None:
                w.contested_at += gap

    def _observe(self, m: str, w: _Watch, read: BeatRead, now: float, corroborated: frozenset[str]) -> Death | None:
        if read.tampered:
            w.contested_at = now
        if read.registered and w.registered_at is None:
            w.registered_at = now
            if read.registered_incarnation and w.incarnation is None:
                w.incarnation = read.registered_incarnation
        beat = read.beat
        if beat is not None:
            if w.incarnation == LOST_PROCESS and w.world is not None and beat.generation == w.world:
                w.incarnation = beat.incarnation  # it trains in the world: the holder
            if beat.incarnation and w.incarnation and beat.incarnation != w.incarnation:
                if w.fresh_at is not None or w.incarnation == LOST_PROCESS \
                        or w.incarnation != read.registered_incarnation:
                    return Death(m, w.incarnation, f"another process ({beat.incarnation}) runs under its id")
                w.incarnation = beat.incarnation  # registered, then beat as registered again: the same
            if w.incarnation is None:
                w.incarnation = beat.incarnation
            if w.last is None or _order(beat) > w.last:
                w.last, w.fresh_at, w.beat = _order(beat), now, beat
                if not read.tampered:
                    w.contested_at = None  # a valid new beat: the key is its own again
            if beat.state == WorkerPhase.EXITED:
                return Death(m, w.incarnation, "its process exited")
            if beat.ended:
                return None  # left by plan, or the job finished
        # Contested (tampering seen on its key within the timeout): the missing beats may be
        # tampering, which must not decide a death; only the peers' sealed report that its
        # world broke does, after ``contest_limit``. Otherwise half the timeout once a peer
        # reports the world broken, else the timeout.
        if w.contested_at is not None and now - w.contested_at <= self.timeout:
            if m not in corroborated:
                return None
            limit = self.contest_limit if self.contest_limit is not None else 3 * self.timeout
        else:
            limit = self.timeout / 2 if m in corroborated else self.timeout
        on_report = w.contested_at is not None and now - w.contested_at <= self.timeout
        if w.fresh_at is not None:
            if now - w.fresh_at > limit:
                return Death(m, w.incarnation, f"no heartbeat for {now - w.fresh_at:.1f} s", on_report)
            return None
        if w.registered_at is not None:
            if now - w.registered_at > limit:
                return Death(m, w.incarnation, "registered, then silent", on_report)
            return None
        grace = self.never_seen_grace if w.grace is None else w.grace
        if now - w.since > max(grace, limit):
            return Death(m, w.incarnation, f"never seen in {grace:.0f} s", on_report)
        return None

    def expect(self, holders: Mapping[str, str | None], now: float, grace: float, world: int | None = None) -> None:
        """Members known to have been running (a world adopted after a coordinator restart), by
        the process that holds their part (``None``: not re-registered yet). Every live one
        reconnects within seconds, so one unseen for ``grace`` is dead; and a process under the
        id that is not the holder (a replacement that never held the world) is another process;
        one whose (authenticated) beats say it trains in ``world`` is the holder."""
        for m, incarnation in holders.items():
            if m not in self.dead:
                self._watch[m] = _Watch(since=now, grace=grace, incarnation=incarnation or LOST_PROCESS, world=world)

    def awaiting_holders(self) -> bool:
        """Whether some member's holding process is not known yet (``expect`` without one)."""
        return any(w.incarnation == LOST_PROCESS for w in self._watch.values())

    def sign_of_life(self, member: str, now: float) -> None:
        """``member`` wrote a sealed value read now for the first time (its result for the
        pending generation): it was alive a moment ago, as a new beat would say, whatever its
        heartbeat key holds (an attacker may be overwriting it)."""
        w = self._watch.get(member)
        if w is not None and member not in self.dead:
            w.fresh_at = now if w.fresh_at is None else max(w.fresh_at, now)

    def hold(self, member: str, incarnation: str | None) -> None:
        """``incarnation`` registered holding the member's part: it is the process to watch."""
        w = self._watch.get(member)
        if w is not None and w.incarnation == LOST_PROCESS and incarnation:
            w.incarnation = incarnation

    def declare(self, member: str, why: str, incarnation: str | None = None) -> Death | None:
        """A verdict from outside the heartbeats (a member that answers no transition; with
        ``incarnation``, a process that is not the one watched, e.g. one lost with a restarted
        coordinator's store, whose id now runs a new process)."""
        if member in self.dead:
            return None
        w = self._watch.pop(member, None)
        death = Death(member, incarnation or (w.incarnation if w else None), why)
        self.dead.add(member)
        self.dead_incarnation[member] = death.incarnation
        return death
