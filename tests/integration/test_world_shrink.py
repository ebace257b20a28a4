"""The world object's lifecycle on real gloo processes (``comms.world.World``): a world of 3 made
from scratch, a leaver shutting its own side down, the survivors shrinking it away (on gloo: a
survivors-only communicator, finalised by torch's own shrink code into the default group), the
groups made on the shrunk world afterwards; a shrink that passes its bound fails as
``ShrinkFailed`` and the world is made again (``World.recreate``). Every creation is counted by
kind.
"""

from __future__ import annotations

from typing import Any

import pytest

from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

WORLD = 3
LEAVER = 1
BOUND = 2.0  # seconds a shrink may take here
FAULTS = ("", "hang")  # none; a survivor that never comes (the others wait out the bound)


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(WORLD, preload=("liveshard.runtime.comms.world", __name__), timeout_s=240)
    yield p
    p.close()


def shrink_job(rank: int, world: int) -> dict[str, Any]:
    """Each case on a world of its own, made from scratch on the pool's store."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()  # no second port to race for
    dist.destroy_process_group()  # the pool's own group
    return {fault: _shrink_case(rank, world, dist.PrefixStore(f"case-{fault}/", store), fault)
            for fault in FAULTS}


def _shrink_case(rank: int, world: int, store: Any, fault: str) -> dict[str, Any]:
    import os
    import time
    from collections import Counter

    import torch
    import torch.distributed as dist

    from liveshard.runtime.comms import world as worlds

    old = worlds.World.scratch(store, "job/world/0/", rank, world, 30.0)
    dist.new_group(list(range(world)))  # one of megatron's groups of the old world
    t = torch.ones(1)
    dist.all_reduce(t)  # the old world works, the leaver still in it
    before = Counter(worlds.CREATED)
    if rank == LEAVER:
        old.shutdown()  # its own side only: no collective
        return {"left": not dist.is_initialized(), "errored": old.errored()}
    os.environ[worlds.SHRINK_FAULT_ENV] = fault
    t0 = time.perf_counter()
    try:
        new = old.shrink([LEAVER], "job/world/1/", BOUND)
        failed = None
    except worlds.ShrinkFailed as e:
        failed = str(e)
        worlds.shutdown_current()
        new = worlds.World.recreate(store, "job/world/1/rebuild/", [0, 2].index(rank), world - 1, 30.0,
                                    name="job/world/1/")
    seconds = time.perf_counter() - t0
    os.environ.pop(worlds.SHRINK_FAULT_ENV)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the survivors' world: old ranks 0 and 2
    sub = dist.new_group([0, 1])  # a group made on it (megatron's are made so)
    u = torch.ones(1)
    dist.all_reduce(u, group=sub)
    out = {"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": t.item(), "sub": u.item(),
           "failed": failed, "seconds": seconds, "current": worlds.World.current() is new,
           "old_errored": old.errored(), "new_errored": new.errored(), "how": new.how,
           "created": worlds.created_since(before)}
    new.shutdown()
    return out


@pytest.fixture(scope="module")
def cases(pool):
    results = pool.run(shrink_job, world=WORLD)
    return {fault: [results[r][fault] for r in range(WORLD)] for fault in FAULTS}


@pytest.mark.parametrize("fault", FAULTS)
def test_survivors_shrink_the_leaver_away_or_fall_back_within_the_bound(cases, fault):
    results = cases[fault]
    assert results[LEAVER] == {"left": True, "errored": True}
    survivors = [results[r] for r in range(WORLD) if r != LEAVER]
    assert [s["rank"] for s in survivors] == [0, 1] and all(s["size"] == WORLD - 1 for s in survivors)
    assert all(s["sum"] == 0 + 2 and s["sub"] == 2 for s in survivors), survivors
    assert all(s["current"] and s["old_errored"] and not s["new_errored"] for s in survivors), survivors
    for s in survivors:
        if fault:
            assert s["failed"] and s["how"] == "recreate" and s["created"] == {"recreate": 1}, s
            assert BOUND <= s["seconds"] < BOUND + 10, s  # waited out the bound, not the 30 s timeout
        else:
            assert s["failed"] is None and s["how"] == "shrink" and s["created"] == {"shrink": 1}, s
