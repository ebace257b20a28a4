"""Point-to-point and collective calls on either kind of process group.

A transition group spans old and new members; joiners are not in the current default group, so
the runtime builds it as a standalone ``ProcessGroup`` object that torch.distributed's module
functions do not know (they look groups up in their registry). Registered groups (tests,
``reshard-local``) go through the module functions; standalone ones through the group's own
methods. Both give one batched exchange per round, so no ordering can deadlock: on NCCL the
sends and receives are issued inside one coalesced group (ncclGroupStart/End); gloo's
send/recv are asynchronous pairs matched by tag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def is_registered(group: Any) -> bool:
    if group is None:
        return True
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_group_ranks


def exchange(send_bufs: dict[int, torch.Tensor], recv_bufs: dict[int, torch.Tensor],
             rank_of: Callable[[int], int], group: Any) -> None:
    """Send ``send_bufs[peer]`` to and receive ``recv_bufs[peer]`` from each peer, all at once."""
    wait(post(sorted(send_bufs.items()), sorted(recv_bufs.items()), rank_of, group))


def post(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
         rank_of: Callable[[int], int], group: Any) -> list[Any]:
    """Start one batch of sends and receives (several per peer allowed: they pair up in list
    order on both sides); ``wait`` on the returned works before touching the buffers."""
    if not sends and not recvs:
        return []
    if is_registered(group):
        ops = [dist.P2POp(dist.isend, buf, rank_of(p), group) for p, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, rank_of(p), group) for p, buf in recvs]
        return list(dist.batch_isend_irecv(ops))
    coalesce = _is_nccl(group)
    dev = (sends or recvs)[0][1].device
    if coalesce:
        group._start_coalescing(dev)
    works = [group.send([buf], rank_of(p), 0) for p, buf in sends]
    works += [group.recv([buf], rank_of(p), 0) for p, buf in recvs]
    if coalesce:
        works = [group._end_coalescing(dev)]
    return works


def wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def all_to_all(recv: torch.Tensor, send: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Any) -> None:
    if is_registered(group):
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
        return
    group.alltoall_base(recv, send, out_splits, in_splits, dist.AllToAllOptions()).wait()


def all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if is_registered(group):
        dist.all_reduce(tensor, op=op, group=group)
        return
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([tensor], opts).wait()


def group_size(group: Any) -> int:
    if is_registered(group):
        return dist.get_world_size(group)
    return group.size()


def _is_nccl(group: Any) -> bool:
    try:
        return group.name() == "nccl" or "nccl" in str(group._get_backend_name()).lower()
    except Exception:
        return False
