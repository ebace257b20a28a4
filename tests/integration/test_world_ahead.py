"""The next training world's communicators, connected while the previous world still trains
(``comms.world.build_world_ahead``), are exactly the groups megatron-core then asks for, and each
is handed to the right group: real gloo processes, real ``initialize_model_parallel``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)
from liveshard.dev.ports import free_port
from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

WORLD = 4
TIMEOUT = 45.0  # the job's collective timeout: megatron's groups ask for it, probed and made alike


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(WORLD, preload=("liveshard.runtime.megatron.build", __name__), timeout_s=120)
    yield p
    p.close()


def world_ahead_job(rank: int, world: int, cfg_text: str, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from liveshard.runtime.comms import world as worlds
    from liveshard.runtime.megatron import build
    from liveshard.runtime.parallel import ParallelConfig

    build.compat.install()
    build.init_parallel(ParallelConfig.parse(f"tp=1,pp=1,dp={world}"), timeout=TIMEOUT)  # trains meanwhile
    made_at_once = _timeouts(build._groups)  # groups connected by init_parallel itself
    old_dp = ps.get_data_parallel_group()
    cfg = ParallelConfig.parse(cfg_text)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)

    requests = build.group_requests(cfg, rank, TIMEOUT)
    probe_left_state = ps.get_data_parallel_group() is old_dp and ps.get_tensor_model_parallel_world_size() == 1
    ahead = worlds.build_world_ahead(store, "gen/ahead/", rank, world, requests, TIMEOUT)
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the old world still works beside the new communicators
    old_world_works = flag.item() == world

    build.destroy()
    worlds.destroy_training_world()
    asked: list[Any] = []
    real = ps.create_group  # what megatron's initialize_model_parallel calls for every group

    def recording(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  use_local_synchronization: bool = False, group_desc: Any = None) -> Any:
        asked.append(worlds.GroupRequest.asked(ranks, backend, {"timeout": timeout, "group_desc": group_desc}))
        return real(ranks, timeout, backend, pg_options, use_local_synchronization, group_desc)

    ps.create_group = recording
    try:
        worlds.init_training_world(store, "gen/world/", rank, world, 60.0, ahead=ahead)
        build.init_parallel(cfg, ahead, timeout=TIMEOUT)
    finally:
        ps.create_group = real

    # the timeout each group made waits for a lost peer (megatron leaves some groups without one)
    made_timeouts = _timeouts(build._groups)
    sums = {}
    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "dp_gloo": ps.get_data_parallel_group_gloo(),
              "mp": ps.get_model_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
              "world": None}
    for name, group in groups.items():
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        sums[name] = (t.item(), float(sum(r + 1 for r in ranks)))
    # a group asked for later (a library's own new_group on this world) is connected then
    later = dist.new_group(list(range(world)))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=later)
    sums["later"] = (t.item(), float(sum(r + 1 for r in range(world))))
    return {"probe_left_state": probe_left_state, "old_world_works": old_world_works,
            "asked_is_probed": asked == requests, "asked": len(asked), "handed": ahead.handed,
            "made_timeouts": made_timeouts, "made_at_once": made_at_once,
            "missed": [r.desc for r in ahead.missed], "unused": len(ahead.groups), "sums": sums,
            "backend": dist.get_backend()}


def _timeouts(groups: list[Any]) -> list[float]:
    """The timeouts (seconds) the gloo communicators of ``groups`` wait for a peer."""
    import torch
    import torch.distributed as dist

    return sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                   for g in groups if isinstance(g, dist.ProcessGroup)})


@pytest.mark.parametrize("cfg", ["tp=2,pp=1,dp=2", "tp=1,pp=2,dp=2", "tp=1,pp=4,dp=1", "tp=4,pp=1,dp=1",
                                 "tp=1,pp=1,dp=4,ep=2"])
def test_the_world_built_ahead_is_the_one_megatron_asks_for(pool, cfg):
    for rank, out in enumerate(pool.run(world_ahead_job, cfg, free_port(), world=WORLD)):
        assert out["probe_left_state"], "probing megatron's groups changed the parallel state in use"
        assert out["old_world_works"]
        assert out["asked_is_probed"], f"rank {rank}: megatron asked for other groups than were probed"
        # not megatron's (or torch's) 30 minutes, whether connected ahead or at once
        assert out["made_timeouts"] == out["made_at_once"] == [TIMEOUT], out
        # every group this rank is in was connected ahead and handed over; none made at the commit
        assert out["missed"] == [] and out["unused"] == 0 and out["handed"] > 0, out
        assert out["backend"] == "liveshard_ahead"
        for name, (got, want) in out["sums"].items():
            assert got == want, f"rank {rank} {cfg}: the {name} group's communicator spans other ranks"
