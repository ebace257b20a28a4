"""megatron's groups made on a running world by their members only (``MembersOnly``).

megatron-core's ``initialize_model_parallel`` calls ``torch.distributed.new_group`` on every rank
for every group, members or not. On an eagerly initialised NCCL world (a world a shrink made, or
one made from scratch with a bound device) torch turns each call into an ``ncclCommSplit`` on every
rank, a non-member's with no colour: thousands of collectives over the whole world at 1024+ GPUs.
Here each group is made where its members are only:

* NCCL on a bound world: megatron's groups of one description are disjoint (a partition of the
  ranks, or of some of them), so each such kind is one ``torch.distributed.split_group`` of the
  world at the kind's first call, every rank in it once; its later calls take this rank's group
  from that split (``steps`` maps each call to what it gets). A kind whose groups overlap would
  not split in one call: its calls go to torch's own ``new_group`` on every rank, as before.
* gloo, and any group of a world that is not bound to a device (no split there): its members
  connect it alone and the others return at once, without touching the store. torch's own
  ``use_local_synchronization=True`` is not used: it names the group from its ranks and the
  number of groups this process holds, which differs between the members of a group as soon as
  one kind leaves some ranks out (the position-embedding group: first pipeline stage only), and
  members under different names never meet. The name here is the call's index in megatron's
  order (the same on every rank) under a per-build prefix.

Non-members get ``GroupMember.NON_GROUP_MEMBER``, as from torch's ``new_group``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from liveshard.runtime.comms.world import GroupRequest, device

# What ``MembersOnly`` did for megatron's calls, by step kind (see ``Step``); a test reads it.
MADE: Counter[str] = Counter()

SKIP = "skip"  # not a member: nothing made, no store touched
CONNECT = "connect"  # a member: the group's members connect it alone
SPLIT = "split"  # a kind's first call: every rank splits the world once for the whole kind
TAKE = "take"  # a later call of a split kind, this rank a member: the group its kind's split gave
STOCK = "stock"  # torch's new_group on every rank (a kind that cannot be split in one call)


@dataclass(frozen=True)
class Step:
    """What one of megatron's ``new_group`` calls does on one rank."""

    how: str
    member: bool  # the rank is in this call's group
    # SPLIT: every group of the call's kind, in megatron's order (``split_group``'s split_ranks)
    split: tuple[tuple[int, ...], ...] = ()


def _disjoint(groups: Sequence[tuple[int, ...]]) -> bool:
    ranks = [r for g in groups for r in g]
    return len(ranks) == len(set(ranks)) and all(groups)


def steps(requests: Sequence[GroupRequest], rank: int, splittable: bool) -> list[Step]:
    """For each request (megatron's calls, in order, as ``megatron.build.group_requests`` lists
    them) what rank ``rank`` does. ``splittable``: the world is an eagerly initialised NCCL world,
    whose groups are split from it (gloo requests are connected by their members either way).
    Every rank gets the same sequence of SPLIT and STOCK steps: those are collectives."""
    kinds: dict[tuple[str, bool], list[tuple[int, ...]]] = {}
    for r in requests:
        kinds.setdefault((r.desc, r.gloo), []).append(r.ranks)
    disjoint = {kind: _disjoint(groups) for kind, groups in kinds.items()}
    out: list[Step] = []
    split_done: set[tuple[str, bool]] = set()
    for r in requests:
        kind, member = (r.desc, r.gloo), rank in r.ranks
        if not r.ranks:  # the whole world: not a subgroup
            out.append(Step(STOCK, True))
        elif r.gloo or not splittable:
            out.append(Step(CONNECT if member else SKIP, member))
        elif not r.desc or not disjoint[kind]:
            out.append(Step(STOCK, member))
        elif kind not in split_done:
            split_done.add(kind)
            out.append(Step(SPLIT, member, tuple(kinds[kind])))
        else:
            out.append(Step(TAKE if member else SKIP, member))
    return out


def splittable() -> bool:
    """Whether the default group is an eagerly initialised world that ``split_group`` splits
    (NCCL bound to a device); gloo is not."""
    if not dist.is_initialized() or not hasattr(dist, "split_group"):
        return False
    pg = dist.distributed_c10d._get_default_group()
    if pg.bound_device_id is None:
        return False
    try:
        return bool(pg._get_backend(device()).supports_splitting)
    except Exception:  # no backend for the device
        return False


class MembersOnly:
    """Makes megatron's groups of one ``initialize_model_parallel`` members only: ``make`` stands
    in for ``torch.distributed.new_group``, call by call, for the requests listed beforehand."""

    def __init__(self, requests: Sequence[GroupRequest], rank: int, split: bool | None = None) -> None:
        self.requests = list(requests)
        self.steps = steps(self.requests, rank, splittable() if split is None else split)
        c10d = dist.distributed_c10d
        # group names must be unique in this process and under the world's store: every rank of
        # the world makes every build, so torch's count of the world's groups is the same on all
        self.prefix = f"liveshard-{c10d._world.group_count}-"
        c10d._world.group_count += 1
        self.calls = 0
        self.split: dict[tuple[str, bool], Any] = {}  # kind -> this rank's group of its split

    def make(self, request: GroupRequest, stock: Callable[[], Any], backend: Any, kwargs: dict[str, Any]) -> Any:
        """The group for megatron's next call, ``new_group(..., backend=backend, **kwargs)``
        (``stock``: that call to torch's own ``new_group``)."""
        i = self.calls
        self.calls += 1
        if i >= len(self.requests) or self.requests[i] != request:
            raise RuntimeError(f"megatron's group call {i} ({request.desc} {request.ranks}) is not the one "
                               "listed beforehand: the groups cannot be made by their members only")
        step = self.steps[i]
        MADE[step.how] += 1
        kind = (request.desc, request.gloo)
        if step.how == STOCK:
            return stock()
        if step.how == SPLIT:
            self.split[kind] = dist.split_group(None, [list(g) for g in step.split], timeout=kwargs.get("timeout"),
                                                pg_options=kwargs.get("pg_options"), group_desc=request.desc)
        if step.how == CONNECT:
            return _connect(list(request.ranks), f"{self.prefix}{i}", backend, kwargs)
        if step.member:  # SPLIT or TAKE
            group = self.split.get(kind)
            if group is None:
                raise RuntimeError(f"the split of {request.desc} gave rank {dist.get_rank()} no group")
            return group
        return dist.GroupMember.NON_GROUP_MEMBER


def _connect(ranks: list[int], name: str, backend: Any, kwargs: dict[str, Any]) -> Any:
    """The group of ``ranks`` (this rank among them), connected by its members alone under
    ``name``: what torch's ``new_group`` does for a member, with a name of ours."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    default_backend, default_store = c10d._world.pg_map[default]
    backend = dist.Backend(backend or default_backend)
    timeout = kwargs.get("timeout")
    if timeout is None:
        timeout = c10d._get_default_timeout(backend)
    assert isinstance(timeout, timedelta)
    ranks = sorted(ranks)
    pg, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(default.rank()), ranks, backend, default_store, c10d.GroupName(name),
        backend_options=kwargs.get("pg_options"), timeout=timeout, device_id=default.bound_device_id,
        group_desc=kwargs.get("group_desc"))
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


__all__ = ["MADE", "MembersOnly", "Step", "splittable", "steps"]
