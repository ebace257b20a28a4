"""Process groups of a worker: the training world of a generation, and transition groups.

The training world is torch.distributed's default group (megatron's parallel groups are made on
it). A transition group spans the old and the new members, joiners included, who are not in the
current default group; it is therefore a standalone ``ProcessGroup`` object built from the
job's store under a per-generation prefix, in a background thread while training goes on, and
used through its own methods (``send``/``recv``/``alltoall_base``/``allreduce``). Every group has
its own store prefix, so no world ever reads a previous world's addresses.

Backend-specific lines are here and only here: gloo on CPU, NCCL when CUDA is present.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_training_world(store: dist.Store, prefix: str, rank: int, size: int, timeout: float) -> None:
    """Make the default process group for one generation's training world."""
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        kwargs["device_id"] = device()  # eager NCCL init: pay it here, not in the first step
    dist.init_process_group(backend(), store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout), **kwargs)


def destroy_training_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def build_transition_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A standalone group over old and new members (blocks until all of them have joined)."""
    prefixed = dist.PrefixStore(prefix, store)
    td = timedelta(seconds=timeout)
    if torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        flag = torch.ones(1, device=device())
        pg.allreduce([flag]).wait()  # NCCL creates its communicator lazily: force it now
        return pg
    pg = dist.ProcessGroupGloo(prefixed, rank, size, td)
    flag = torch.ones(1)
    pg.allreduce([flag]).wait()
    return pg


def group_all_ok(pg: Any, ok: bool) -> bool:
    """True only if every member of ``pg`` says ok (a MIN all-reduce of one flag)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device())
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([flag], opts).wait()
    return bool(flag.item())


