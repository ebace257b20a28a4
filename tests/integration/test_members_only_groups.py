"""After a shrink, megatron's groups are made by their members only (``comms.groups``): real gloo
processes, real ``initialize_model_parallel``. A world of 4 trains, rank 3 leaves, the 3 survivors
shrink it away (``World.shrink``) and make the groups of a 3-stage pipeline on the shrunk world
(``init_parallel(..., members_only=True)``). Every group creation torch performs is recorded
(``_new_process_group_helper``, which connects a group, or returns at once for a non-member): a
survivor creates exactly the groups it is a member of and nothing for the others, where megatron's
own path calls it for every group on every rank. The groups work (each all-reduce spans exactly
its members) and a model built on them trains bit-exactly as on a world of 3 made from scratch with
megatron's own group calls.

The 3-stage pipeline leaves rank 1 out of the embedding groups and ranks 1, 2 out of the
position-embedding group: members of a later group then hold different numbers of groups, which
torch's ``use_local_synchronization`` names would disagree on (they would never meet).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)
from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

WORLD = 4
LEAVER = 3
OLD_CFG = "tp=2,pp=1,dp=2"
NEW_CFG = "tp=1,pp=3,dp=1,layers=2+1+1"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(WORLD, preload=("liveshard.runtime.megatron.build", __name__), timeout_s=240)
    yield p
    p.close()


def members_only_job(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from liveshard.runtime.comms import world as worlds
    from liveshard.runtime.megatron import build

    build.compat.install()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()  # the pool's own group
    old = worlds.World.scratch(store, "job/world/0/", rank, world, TIMEOUT)
    build.init_parallel(_cfg(OLD_CFG), timeout=TIMEOUT)  # the old world, megatron's own path
    _all_reduce_every_group(rank)
    if rank == LEAVER:
        old.shutdown()
        return {"left": True}
    old.shutdown(groups_only=True)  # a survivor keeps the default group, to shrink it
    new = old.shrink([LEAVER], "job/world/1/", 30.0)
    shrunk = _build_and_train(members_only=True)
    new.shutdown()
    # the reference: a world of 3 made from scratch, megatron's groups made its own way
    worlds.World.scratch(dist.PrefixStore("ref/", store), "job/ref/", rank, world - 1, TIMEOUT)
    reference = _build_and_train(members_only=False)
    worlds.shutdown_current()
    return {"left": False, "shrunk": shrunk, "reference": reference}


def _cfg(text: str) -> Any:
    from liveshard.runtime.parallel import ParallelConfig

    return ParallelConfig.parse(text)


def _build_and_train(members_only: bool) -> dict[str, Any]:
    """megatron's groups for NEW_CFG (every group torch creates recorded), their all-reduces and
    two training steps of a model built on them."""
    import torch.distributed as dist

    from liveshard.runtime.comms import groups
    from liveshard.runtime.megatron import build
    from liveshard.runtime.presets import PRESETS

    c10d = dist.distributed_c10d
    real, created = c10d._new_process_group_helper, []

    def recording(size: int, group_rank: Any, ranks: list[int], *args: Any, **kwargs: Any) -> Any:
        created.append(tuple(ranks))
        return real(size, group_rank, ranks, *args, **kwargs)

    made_before = dict(groups.MADE)
    c10d._new_process_group_helper = recording
    try:
        build.init_parallel(_cfg(NEW_CFG), timeout=TIMEOUT, members_only=members_only)
    finally:
        c10d._new_process_group_helper = real
    rank = dist.get_rank()
    requests = build.group_requests(_cfg(NEW_CFG), rank, TIMEOUT)
    sums = _all_reduce_every_group(rank)
    built = build.build_model(PRESETS["tiny-llama"], _cfg(NEW_CFG), seed=5, lr=3e-3, init_parallel_state=False,
                              hidden_dropout=0.0, attention_dropout=0.0)
    losses = _train(built, steps=2)
    del built
    build.destroy()
    return {"created": created, "mine": [r.ranks for r in requests if rank in r.ranks],
            "asked": len(requests), "sums": sums, "losses": losses,
            "made": {k: groups.MADE[k] - made_before.get(k, 0) for k in groups.MADE if groups.MADE[k] - made_before.get(k, 0)}}


def _all_reduce_every_group(rank: int) -> dict[str, tuple[float, float]]:
    """Each of megatron's groups all-reduces its members' rank + 1: (got, the sum over its ranks)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "dp_gloo": ps.get_data_parallel_group_gloo(),
              "mp": ps.get_model_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
              # a rank outside them has none (megatron keeps its groups' only)
              "embedding": ps.get_embedding_group(check_initialized=False),
              "position_embedding": ps.get_position_embedding_group(check_initialized=False)}
    for name, group in groups.items():
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        out[name] = (t.item(), float(sum(r + 1 for r in dist.get_process_group_ranks(group))))
    return out


def _train(built: Any, steps: int, seq: int = 16, micro: int = 2, microbatches: int = 3) -> list[float]:
    """``steps`` optimizer steps on one fixed batch (every rank the same data: dp=1); the loss."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = torch.randint(0, built.spec.vocab_size, (micro * microbatches, seq + 1),
                         generator=torch.Generator().manual_seed(17))
    position_ids = torch.arange(seq).unsqueeze(0).expand(micro, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)

    def batches():
        for i in range(microbatches):
            chunk = data[i * micro:(i + 1) * micro]
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, causal, labels=labels)
        return output, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach()})

    losses = []
    for _ in range(steps):
        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches(),
                                          model=built.chunks, num_microbatches=microbatches, seq_length=seq,
                                          micro_batch_size=micro, forward_only=False)
        ok, _, _ = built.optimizer.step()
        assert ok
        loss = torch.zeros(1, dtype=torch.float64)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss += torch.stack([o["loss"] for o in out]).double().mean()
        dist.all_reduce(loss)
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(members_only_job, world=WORLD)


def test_a_survivor_creates_only_the_groups_it_is_a_member_of(results):
    assert results[LEAVER] == {"left": True}
    for rank in range(WORLD - 1):
        shrunk, reference = results[rank]["shrunk"], results[rank]["reference"]
        # members only: torch created this rank's groups, in megatron's order, and nothing else
        assert shrunk["created"] == shrunk["mine"], (rank, shrunk)
        assert len(shrunk["mine"]) < shrunk["asked"]
        assert shrunk["made"] == {"connect": len(shrunk["mine"]), "skip": shrunk["asked"] - len(shrunk["mine"])}
        # megatron's own path: a creation for every group on every rank (the non-members' return at once)
        assert len(reference["created"]) == reference["asked"] and reference["made"] == {}
        assert reference["mine"] == shrunk["mine"]


def test_the_groups_made_by_their_members_work_and_train_bit_exactly(results):
    survivors = [results[r] for r in range(WORLD - 1)]
    for rank, s in enumerate(survivors):
        sums = s["shrunk"]["sums"]
        assert {"tp", "pp", "dp", "dp_gloo", "mp", "ep"} <= set(sums), sums
        for name, (got, want) in sums.items():
            assert got == want, f"rank {rank}: the {name} group spans other ranks"
        assert sums == s["reference"]["sums"]
    losses = [s["shrunk"]["losses"] for s in survivors]
    assert losses[0] == survivors[0]["reference"]["losses"], "training on the shrunk world's groups differs"
    assert all(lo == losses[0] for lo in losses) and losses[0][1] < losses[0][0]
