"""Which old holder sends each piece: a rule that needs only the holders' own boxes.

Terms. A *piece* is the common box of one new box and one old box (one state group). The old
box's *holders* ``H`` (the old ranks holding it, dead ones included) name its *pool*: the
surviving holders that stay, or, when every surviving holder is leaving, those
(``pool_of``). A *demand* is a piece wanted by a device that runs a new holder of the new box
and does not hold the old box itself (it copies the piece locally).

* A demand whose pool has one member comes from it. The sum of those demands on a device is its
  *forced* load ``F``.
* The demands on the boxes of one holder set ``H`` with a larger pool (``W_H`` bytes in all)
  are shared out by water-filling on the members' forced loads: member ``s`` gets
  ``x_s = max(0, L - F_s)`` bytes, with the level ``L`` such that the ``x_s`` add up to
  ``W_H`` (``targets``; integers, exact arithmetic). ``split`` then cuts the demands, element
  by element, into those shares: first on each node among that node's members (destinations
  there take the piece over the node's fast links), then what is left among all members. A
  member serves at most ``x_s + 2 * E`` bytes (``E``: the largest element of the pool's state
  groups), which bounds what a device sends without planning its peers (``schedule``).

Everything the rule reads about a pool (its boxes and their new holders, its members' forced
loads) follows from the members' own boxes, so one device's sends and receives can be planned
from the boxes around it (``vps.device_plan``) and equal its part of the global plan
(``vps.transition``). Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate
from typing import NamedTuple

from liveshard.runtime.vps.devices import DeviceMap


def pool_of(holders, devices: DeviceMap) -> tuple[int, ...]:
    """The devices that may serve a box held by ``holders`` (old devices), ascending."""
    alive = sorted(d for d in holders if devices.holds_old_state(d))
    staying = [d for d in alive if d not in devices.leaving]
    return tuple(staying or alive)


def targets(pool: tuple[int, ...], forced: Sequence[int] | dict, total: int) -> list[int]:
    """Bytes each member of ``pool`` (ascending) serves of a holder set's ``total`` demand:
    water-filled on the members' forced loads, then rounded so that they add up to ``total``
    (cumulative floors in pool order)."""
    base = sorted((forced[s], s) for s in pool)
    acc = 0
    level = Fraction(0)
    for m in range(1, len(base) + 1):
        acc += base[m - 1][0]
        level = Fraction(total + acc, m)
        if m == len(base) or level <= base[m][0]:
            break
    out = []
    cum = Fraction(0)
    prev = 0
    for s in pool:
        f = forced[s]
        if level > f:
            cum += level - f
        x = cum.numerator // cum.denominator
        out.append(x - prev)
        prev = x
    out[-1] += total - prev  # the floors of an exact sum end on ``total``; kept exact regardless
    return out


class Demand(NamedTuple):
    """One piece wanted by ``dest``: ``order`` sorts it among the pool's demands (the same
    everywhere), ``nbytes`` = elements * ``elem`` (bytes of one element, all states)."""

    dest: int
    order: tuple
    nbytes: int
    elem: int


# A part of a demand served by one member: (member, first element, element count).
Part = tuple[int, int, int]


def split(pool: tuple[int, ...], shares: list[int], demands: list[Demand], nodes,
          only: int | None = None) -> dict[int, list[Part]]:
    """The parts of each demand (by index in ``demands``, which must come in ascending
    ``order``), see the module doc. With ``only``, just the parts that device serves or receives.

    Phase 1, per node in ascending order: that node's demands (by destination, then ``order``)
    laid end to end against that node's members' shares (ascending); an element goes to the
    member whose share covers its first byte, elements past the node's shares wait. Phase 2:
    the waiting elements, in phase-1 order, against what each member has left."""
    parts: dict[int, list[Part]] = {}
    served = [0] * len(pool)
    by_node: dict[int, list[int]] = {}
    for k, s in enumerate(pool):
        by_node.setdefault(nodes[s], []).append(k)
    # (node, destination, order): a stable sort on (node, destination) of demands in order
    span = len(nodes)
    keys = [nodes[dm[0]] * span + dm[0] for dm in demands]
    index = sorted(range(len(demands)), key=keys.__getitem__)
    waiting: list[tuple[int, int]] = []  # (demand index, first element not yet served)
    i, n = 0, len(index)
    while i < n:
        node = keys[index[i]] // span
        members = by_node.get(node, [])
        ends = list(accumulate(shares[k] for k in members))
        nm = len(members)
        pos = 0
        k = 0
        while i < n and keys[index[i]] // span == node:
            q = index[i]
            i += 1
            dest, _, nbytes, elem = demands[q]
            while k < nm and ends[k] <= pos:
                k += 1
            if k < nm and pos + nbytes <= ends[k]:  # all in one share (the usual case)
                m = members[k]
                if only is None or only == pool[m] or only == dest:
                    parts[q] = [(pool[m], 0, nbytes // elem)]
                served[m] += nbytes
            else:
                first = _lay(demands[q], q, 0, pos, members, ends, pool, parts, served, only)
                if first < nbytes // elem:
                    waiting.append((q, first))
            pos += nbytes
    if waiting:
        members = [k for k in range(len(pool)) if shares[k] > served[k]]
        ends = list(accumulate(shares[k] - served[k] for k in members))
        pos = 0
        for q, first in waiting:
            dm = demands[q]
            _lay(dm, q, first, pos, members, ends, pool, parts, served, only)
            pos += dm.nbytes - first * dm.elem
    return parts


def _lay(dm: Demand, q: int, first: int, pos: int, members: list[int], ends: list[int], pool,
         parts: dict[int, list[Part]], served: list[int], only: int | None) -> int:
    """Hand the elements ``first..`` of demand ``q`` (its element ``first`` starts at stream
    byte ``pos``) to the members whose shares (ending at ``ends``) cover their first byte;
    returns the first element past the last share."""
    e = dm.elem
    n = dm.nbytes // e
    k = bisect_right(ends, pos)
    if k < len(members) and pos + (n - first) * e <= ends[k]:  # all in one share (the usual case)
        m = members[k]
        if only is None or only == pool[m] or only == dm.dest:
            parts.setdefault(q, []).append((pool[m], first, n - first))
        served[m] += (n - first) * e
        return n
    i = first
    while i < n and k < len(members):
        # elements i.. whose first byte is before ends[k]
        stop = min(n, first + -(-(ends[k] - pos) // e))
        if stop > i:
            m = members[k]
            if only is None or only == pool[m] or only == dm.dest:
                parts.setdefault(q, []).append((pool[m], i, stop - i))
            served[m] += (stop - i) * e
            i = stop
        k += 1
    return i
