"""Which surviving device takes which new rank, so that as little data as possible moves.

``overlap(r, d)`` is the bytes new rank ``r`` needs that device ``d`` already holds. We maximise
the total overlap of an injective map ranks -> available devices. Overlaps are accumulated per
pair of *holder classes* (ranks with identical parameter boxes share a class; distributed-
optimizer shards are per rank), so the work grows with the number of distinct boxes, not with
ranks squared. The assignment is greedy on pairs by decreasing overlap: a rank-level pair (one
side holds distributed-optimizer shards) takes one rank, a class-level pair hands out free
members of both classes in rank/device order, which keeps tensor-parallel groups on one node.
Ranks with no overlap anywhere get the remaining devices in order (old devices before joiners).
Pure: no torch.
"""

from __future__ import annotations

from collections import defaultdict

from liveshard.runtime.vps.devices import DeviceMap


def assign_devices(
    new_world: int,
    devices: DeviceMap,
    overlap: dict[tuple[int, int], int],
    new_classes: tuple[list[tuple[int, ...]], list[int]],
    old_classes: tuple[list[tuple[int, ...]], list[int]],
) -> tuple[int, ...]:
    """new rank -> device.

    ``overlap[(new class, old class)]``: bytes in common between boxes held by the two classes
    (every member of both). ``*_classes`` is (members of each parameter class, rank -> its
    parameter class); a class id ``>= len(members)`` is the single rank ``id - len(members)``.
    """
    new_members, new_rank_class = new_classes
    old_members, old_rank_class = old_classes
    num_new_param_classes = len(new_members)
    num_old_param_classes = len(old_members)
    devices.check_fits(new_world)
    avail = devices.available
    usable = set(d for d in avail if d < devices.old_world)

    def members_new(c: int) -> tuple[int, ...]:
        return new_members[c] if c < num_new_param_classes else (c - num_new_param_classes,)

    def members_old(c: int) -> tuple[int, ...]:
        ranks = old_members[c] if c < num_old_param_classes else (c - num_old_param_classes,)
        return tuple(d for d in ranks if d in usable)

    class_pairs: dict[tuple[int, int], int] = {}
    rank_pairs: dict[tuple[int, int], int] = defaultdict(int)
    for (cn, co), w in overlap.items():
        if w <= 0:
            continue
        if cn < num_new_param_classes and co < num_old_param_classes:
            class_pairs[cn, co] = class_pairs.get((cn, co), 0) + w
        else:
            olds = members_old(co)
            if not olds:
                continue
            for r in members_new(cn):
                for d in olds:
                    rank_pairs[r, d] += w
    # a rank pair's total includes the class-level overlap of the two parameter classes
    pc_new, pc_old = new_rank_class, old_rank_class
    entries: list[tuple[int, int, int, int]] = []
    for (r, d), w in rank_pairs.items():
        entries.append((-(w + class_pairs.get((pc_new[r], pc_old[d]), 0)), 0, r, d))
    for (cn, co), w in class_pairs.items():
        entries.append((-w, 1, cn, co))
    entries.sort()

    rank_to_device = [-1] * new_world
    taken: set[int] = set()
    for _, kind, a, b in entries:
        if kind == 0:
            if rank_to_device[a] < 0 and b not in taken:
                rank_to_device[a] = b
                taken.add(b)
            continue
        free_r = [r for r in new_members[a] if rank_to_device[r] < 0]
        if not free_r:
            continue
        free_d = [d for d in members_old(b) if d not in taken]
        for r, d in zip(free_r, free_d):
            rank_to_device[r] = d
            taken.add(d)
    rest = iter(d for d in avail if d not in taken)
    for r in range(new_world):
        if rank_to_device[r] < 0:
            rank_to_device[r] = next(rest)
    return tuple(rank_to_device)
