"""What one device does in each step of a transition, as plain data (the executor's pure half).

From a plan, its schedule and a device id: the new tensors the device ends up with and which of
them are old tensors kept in place, the local copies it runs, what it sends and receives in each
round and how those chunks go on the wire (P2P message layout), which old tensors it may free
after which round, and which P2P rounds are on the wire at once (``PostingWindow``). The
executor (``executor.py``) turns these into tensor copies and torch.distributed calls; the
functions here touch no tensor and no process group, so they can be checked in one process.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

from liveshard.runtime.transfer.packing import buffer_size, split_direct
from liveshard.runtime.vps.plan_view import TransitionPlanView
from liveshard.runtime.vps.region import Shape, volume
from liveshard.runtime.vps.schedule import Chunk, Schedule
from liveshard.runtime.vps.shards import local_tensor_shapes
from liveshard.runtime.vps.transition import Copy

P2P = "p2p"  # a round is one batch of point-to-point messages; rounds are posted ahead
A2A = "a2a"  # a round is one all_to_all_single

ByPeer = dict[int, list[Chunk]]  # peer device -> chunks, in schedule order
Round = tuple[ByPeer, ByPeer]  # (sends, receives)
Kept = dict[tuple[str, str], str]  # (state, new name) -> old name of an old tensor kept in place


class NewTensor(NamedTuple):
    state: str
    name: str
    shape: Shape
    dtype: str  # the layout's dtype name


class Packed(NamedTuple):
    """A message of several small chunks packed into one staging buffer."""

    peer: int
    chunks: list[Chunk]
    staging: int  # the buffer's bytes


class Direct(NamedTuple):
    """A message of one state of one large chunk, straight from/into the state tensor's view."""

    peer: int
    chunk: Chunk
    state: str
    view: tuple  # the copy's source view (sends) or destination view (receives)
    rel: Shape


Message = Packed | Direct


def own_part(plan: TransitionPlanView) -> bool:
    """Whether ``plan`` is one device's part of a transition (``vps.device_plan.DevicePlan``):
    its copies and rounds are that device's only."""
    return plan.device is not None


def new_rank_of(plan: TransitionPlanView, device_id: int) -> int | None:
    """The new rank device ``device_id`` runs, or None (leaving, standby, not in the transition)."""
    if device_id >= plan.devices.num_devices:
        return None
    return plan.device_to_rank.get(device_id)


def new_tensors(plan: TransitionPlanView, new_rank: int) -> list[NewTensor]:
    """Every local tensor new rank ``new_rank`` holds, in layout order."""
    return [NewTensor(state, name, tuple(shape), plan.new_layout.dtype(state))
            for state, per in local_tensor_shapes(plan.new_layout, new_rank).items()
            for name, shape in per.items()]


def kept_in_place(plan: TransitionPlanView, device_id: int, new_rank: int) -> Kept:
    """New tensors that are an old tensor of the same device kept whole and in place (every
    state of the group): no copy, no allocation. From the layouts' shapes only."""
    if device_id >= plan.devices.old_world:
        return {}
    incoming: dict[tuple[int, str], list[Copy]] = {}
    for c in plan.copies:
        if c.dst == device_id:
            incoming.setdefault((c.group, c.dst_view[0]), []).append(c)
    new_shapes = local_tensor_shapes(plan.new_layout, new_rank)
    old_shapes = local_tensor_shapes(plan.old_layout, device_id)  # old rank i is device i
    out: Kept = {}
    for (gi, name), cs in incoming.items():
        src_name = cs[0].src_view[0]
        if not all(c.src == device_id and c.src_view == c.dst_view and c.src_rel == c.dst_rel
                   and c.src_view[0] == src_name for c in cs):
            continue
        states = plan.groups[gi].states
        covered = sum(volume(c.shape) for c in cs)
        if all(tuple(old_shapes.get(state, {}).get(src_name, ())) == tuple(new_shapes[state][name])
               and covered == volume(new_shapes[state][name]) for state in states):
            for state in states:
                out[state, name] = src_name
    return out


def local_copies(plan: TransitionPlanView, device_id: int, kept: Kept) -> list[int]:
    """Indices of the copies device ``device_id`` runs locally (source and destination itself),
    in plan order, leaving out those into a tensor kept in place (they are already there)."""
    kept_names = {name for (_, name) in kept}
    out = []
    for ci, c in enumerate(plan.copies):
        if c.src != device_id or c.dst != device_id:
            continue
        name = c.dst_view[0]
        if name in kept_names and all((s, name) in kept for s in plan.groups[c.group].states):
            continue
        out.append(ci)
    return out


def whole_copy(plan: TransitionPlanView, ci: int) -> Chunk:
    """Copy ``ci`` as one chunk (how a local copy is cut: not at all)."""
    c = plan.copies[ci]
    return Chunk(ci, (0,) * len(c.shape), c.shape, c.nbytes, 0, -1)


def local_copies_overlap_rounds(mode: str, rounds: int) -> bool:
    """Whether the local copies run while the first P2P rounds are on the wire (after posting
    them, before the first completes; only a device of the new world has any), else before
    every round."""
    return mode == P2P and rounds > 0


def device_rounds(plan: TransitionPlanView, sched: Schedule, device_id: int) -> list[Round]:
    """Per round: (chunks device ``device_id`` sends, by peer; chunks it receives, by peer).
    A process beyond the plan's devices takes part in every round with nothing to move."""
    if device_id < plan.devices.num_devices:
        return sched.for_device(device_id, plan.copies)
    return [({}, {})] * sched.rounds


def piece_refs(plan: TransitionPlanView, ch: Chunk, src_side: bool) -> list[tuple[str, tuple, Shape]]:
    """(state, view, rel) of each state's piece of chunk ``ch``, at its source or destination."""
    c = plan.copies[ch.copy]
    view, rel = (c.src_view, c.src_rel) if src_side else (c.dst_view, c.dst_rel)
    return [(state, view, rel) for state in plan.groups[c.group].states]


def message_layout(plan: TransitionPlanView, by_peer: ByPeer, direct_min_bytes: int,
                   src_side: bool) -> list[Message]:
    """The P2P messages of one side of a round, in posting order: peers in ascending order; per
    peer one packed buffer of the small chunks, then one message per (large chunk, state).
    Depends on the schedule only, so sender and receiver list a pair's messages alike."""
    out: list[Message] = []
    for p, chs in sorted(by_peer.items()):
        packed, direct = split_direct(chs, direct_min_bytes)
        if packed:
            out.append(Packed(p, packed, buffer_size(packed)))
        for ch in direct:
            out.extend(Direct(p, ch, state, view, rel) for state, view, rel in piece_refs(plan, ch, src_side))
    return out


def round_bytes(by_peer: ByPeer) -> int:
    """Data bytes of one side of a round."""
    return sum(ch.nbytes for chs in by_peer.values() for ch in chs)


def received_by_peer(per_round: list[Round]) -> ByPeer:
    """Every chunk a device receives, by source, in round then schedule order."""
    received: ByPeer = {}
    for _, recvs in per_round:
        for p, chs in recvs.items():
            received.setdefault(p, []).extend(chs)
    return received


def release_schedule(plan: TransitionPlanView, sched: Schedule, device_id: int,
                     kept: Kept) -> dict[int, list[tuple[str, str]]]:
    """Round -> the old tensors (state, name) device ``device_id`` last reads in it (-1: the local
    copies). Lists every state of the group; the executor frees those its old shards hold. An
    old tensor whose name is kept in place is never listed, for any state (the test is on the
    local name alone)."""
    kept_names = set(kept.values())
    out: dict[int, list[tuple[str, str]]] = {}
    for (d, gi, name), last in sched.last_read.items():
        if d != device_id or name in kept_names:
            continue
        out.setdefault(last, []).extend((state, name) for state in plan.groups[gi].states)
    return out


class PostingWindow:
    """The P2P rounds on the wire, oldest first, with the staging each allocated.

    Round ``r`` is always posted before it completes; with ``ahead``, later rounds are posted
    too, in order, while the staging of every round on the wire fits ``budget`` together. Pure
    bookkeeping: the executor prepares and posts the rounds and hands them in as items."""

    def __init__(self, rounds: int, budget: int, ahead: bool) -> None:
        self.rounds = rounds
        self.budget = budget
        self.ahead = ahead
        self.in_flight: deque[tuple[Any, int]] = deque()
        self.live = 0  # staging bytes of the rounds on the wire
        self.peak_live = 0
        self.max_in_flight = 0

    def next_to_post(self, r: int) -> int | None:
        """The round to post next while round ``r`` is due (rounds before it are complete), or
        None when there is none."""
        nxt = r + len(self.in_flight)
        if nxt >= self.rounds or (nxt > r and not self.ahead):
            return None
        return nxt

    def fits(self, r: int, nxt: int, staging: int) -> bool:
        """Whether round ``nxt`` may go on the wire now (the due round always may)."""
        return nxt == r or self.live + staging <= self.budget

    def posted(self, item: Any, staging: int) -> None:
        self.in_flight.append((item, staging))
        self.live += staging
        self.peak_live = max(self.peak_live, self.live)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def complete_oldest(self) -> Any:
        item, staging = self.in_flight.popleft()
        self.live -= staging
        return item
