"""Real transfers on per-device plans: every gloo process plans only its own part
(``vps.device_plan``), the processes compare inputs digests, and the executor runs each process's
own plan and rounds; every new shard must equal the reference bit for bit, the old shards stay
untouched, every device receives exactly what the whole plan sends it, and staging stays within
the budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from liveshard.dev.procpool import GlooPool
from liveshard.dev.reshard.cases import CASES
from liveshard.dev.reshard.harness import LocalJob, run_rank
from liveshard.runtime.parallel import ParallelConfig

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class DeviceJob(LocalJob):
    """A local reshard in which each process plans only its own device."""

    def plan(self):
        import torch.distributed as dist

        from liveshard.runtime.vps.device_plan import plan_device
        from liveshard.runtime.vps.transition import rank_order

        spec, old, new, devices = self.spec(), ParallelConfig.parse(self.old), ParallelConfig.parse(self.new), self.devices()
        return plan_device(spec, old, new, devices, rank_order(spec, old, new, devices), dist.get_rank())


def run_device_rank(rank: int, world: int, job: DeviceJob) -> dict:
    return run_rank(rank, world, job)


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(8, preload=("liveshard.dev.reshard.harness",), timeout_s=120)
    yield p
    p.close()


_RUNS = [(c, "p2p", False) for c in CASES if c.name in ("dp-shrink-dist-opt", "ep-change", "etp-and-tp",
                                                          "everything-moves")]
# all-to-all rounds from per-device plans: these devices have different numbers of rounds (a
# device's own plan knows its own); pre-allocated destinations come from the device plan too
_RUNS += [(c, "a2a", c.name == "everything-moves") for c in CASES
          if c.name in ("dp-shrink-dist-opt", "everything-moves")]


@pytest.mark.parametrize(("case", "mode", "preallocate"), _RUNS,
                         ids=[f"{c.name}-{m}{'-prealloc' if p else ''}" for c, m, p in _RUNS])
def test_per_device_plans_move_state_bit_exactly(pool, case, mode, preallocate):
    whole = case.plan()
    must = whole.lower_bound["must_receive"]
    job = DeviceJob(case.spec, case.old, case.new, case.leave, case.join, case.gpus_per_node, case.budget, mode,
                    direct_min_bytes=256, preallocate=preallocate)
    results = pool.run(run_device_rank, job, world=case.procs, timeout_s=120)
    digests = {r["checksum"] for r in results}
    assert len(digests) == 1 and whole.checksum not in digests  # the inputs digest, not the whole plan's checksum
    for r in results:
        where = f"{case.name} rank {r['rank']}"
        assert r["error"] is None, where
        assert r["mismatches"] == [] and r["old_mismatches"] == [] and r["object_errors"] == [], where
        s = r["stats"]
        assert s["verified"], where
        assert s["peak_staging_bytes"] <= case.budget, where
        assert s["bytes_received"] == must[r["rank"]], where
        if preallocate:  # the transfer filled the tensors allocated ahead (no fresh memory in the pause)
            assert r["destinations_used"], where
