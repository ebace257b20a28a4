"""What the coordinator wrote that must stay written: ``KeptKeys``.

A client without the job's secret can delete or overwrite any key of the store, and a reader
that never read a key sees its deletion as absence (``control.store.JobStore``). Two kinds of
keys the coordinator writes must outlive that:

* the pointers that steer the workers (``dead/<id>``, ``plan/current``, ``plan/latest``,
  ``stop``): a process declared dead that never read its ``dead/<id>`` would train on in a world
  the job left. They are read back each tick and written again where gone or not authentic;
* the decisions and outcomes of the last ``KEEP_DECIDED`` generations: write-once keys, which a
  read puts back (``JobStore``), so a process still in its commit window (frozen, slow) finds the
  decision that was made, not room for another;
* the plans of the last ``KEEP_PLANS`` generations (the pending one, the running world's and
  those before it): a plan deleted before its members read it would never be prepared, and its
  generation would abort at the transition timeout; a process reading where it stands
  (``control.left_behind``, ``control.not_this_process``) reads the plans before it.

Bounded work: one read per kept key every ``RESTORE_EVERY`` seconds (the dead, three pointers,
2 x ``KEEP_DECIDED`` decided keys, ``KEEP_PLANS`` plans).
"""

from __future__ import annotations

from collections.abc import Iterable

from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.store import JobStore

KEEP_DECIDED = 8  # generations whose decision and outcome the coordinator keeps in the store
KEEP_PLANS = 4  # generations whose plan the coordinator keeps in the store
RESTORE_EVERY = 0.5  # seconds between two read-backs (the loop ticks up to 50 times a second)


_PLANS = Keys.plan(0).removesuffix("0")


def _decided(key: str) -> bool:
    return key.startswith("gen/")


def _plan(key: str) -> bool:
    """``plan/<generation>`` (not the pointers ``plan/latest``, ``plan/current``)."""
    return key.startswith(_PLANS) and key.removeprefix(_PLANS).isdigit()


class KeptKeys:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._values: dict[str, str] = {}
        self._restored: float | None = None

    def write(self, key: str, value: str) -> None:
        """Write a pointer and keep it written."""
        self.store.set(key, value)
        self._values[key] = value

    def written(self, key: str, value: str | None) -> None:
        """``key`` holds ``value`` (written by another call: ``publish_plan``, ``decide``): keep it."""
        if value is None:
            return
        self._values.pop(key, None)  # (re)inserted last: the pruning below keeps the newest
        self._values[key] = value
        for kind, keep in ((_decided, 2 * KEEP_DECIDED), (_plan, KEEP_PLANS)):
            kept = [k for k in self._values if kind(k)]
            for old in kept[:-keep]:
                del self._values[old]

    def restore(self, dead: Iterable[str], now: float) -> None:
        """Read every kept key back, at most every ``RESTORE_EVERY`` seconds (``now``: the
        coordinator's clock); write again what is gone or not authentic. ``dead``: the members
        the liveness judge counts dead now (another one's ``dead/<id>`` is history: its id came
        back as a new process)."""
        if self._restored is not None and now - self._restored < RESTORE_EVERY:
            return
        self._restored = now
        still_dead = {Keys.dead(m) for m in dead}
        for key, value in list(self._values.items()):
            if key.startswith(Keys.dead("")) and key not in still_dead:
                del self._values[key]
                continue
            r = self.store.read(key)
            if r.tampered or r.value != value:
                self.store.set(key, value)
