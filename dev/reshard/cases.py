"""Transition cases for the planner and executor tests: named ones and random valid ones."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.transition import plan_transition

# bf16 weights bring the fp32 main-weight state: mixed dtypes in one transfer
TINY_LLAMA_BF16 = ModelSpec(**{**PRESETS["tiny-llama"].to_dict(), "params_dtype": "bf16", "name": "tiny-llama-bf16"})
# TransformerEngine's parameter names and order (norms fused into the next linear layer)
TINY_LLAMA_TE = ModelSpec(**{**TINY_LLAMA_BF16.to_dict(), "transformer_impl": "transformer_engine",
                             "name": "tiny-llama-te"})
SPECS = {"tiny-llama": PRESETS["tiny-llama"], "tiny-gpt": PRESETS["tiny-gpt"], "tiny-moe": PRESETS["tiny-moe"],
         "tiny-llama-bf16": TINY_LLAMA_BF16, "tiny-llama-te": TINY_LLAMA_TE}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    old: str
    new: str
    leave: str = ""
    join: int = 0
    gpus_per_node: int = 4
    budget: int = 1 << 16

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]

    @property
    def procs(self) -> int:
        return ParallelConfig.parse(self.old).world_size + self.join

    def devices(self) -> DeviceMap:
        return DeviceMap(ParallelConfig.parse(self.old).world_size, self.gpus_per_node,
                         parse_devices(self.leave), self.join)

    def plan(self):
        return plan_transition(self.spec, ParallelConfig.parse(self.old), ParallelConfig.parse(self.new),
                               self.devices())

    def job(self, mode: str = "p2p", **kw):
        from liveshard.dev.reshard.harness import LocalJob

        return LocalJob(self.spec, self.old, self.new, self.leave, self.join, self.gpus_per_node, self.budget,
                        mode, **kw)


CASES = [
    Case("dp-shrink-leave-node", "tiny-gpt", "tp=2,pp=1,dp=4", "tp=2,pp=1,dp=3", leave="4,5", gpus_per_node=2),
    Case("dp-shrink-dist-opt", "tiny-llama", "tp=1,pp=2,dp=3,dist_opt", "tp=1,pp=2,dp=2,dist_opt", leave="5",
         gpus_per_node=2, budget=4096),
    Case("join-dp-grow", "tiny-llama-bf16", "tp=2,pp=1,dp=2,dist_opt", "tp=2,pp=1,dp=4,dist_opt", join=4),
    Case("tp-change", "tiny-llama", "tp=2,pp=2,dp=1", "tp=1,pp=2,dp=2", budget=3000),
    Case("pp-nonuniform", "tiny-gpt", "tp=1,pp=2,dp=2,layers=1+3", "tp=1,pp=3,dp=2,layers=2+1+1,dist_opt",
         join=2),
    Case("ep-change", "tiny-moe", "tp=1,pp=1,dp=4,ep=2,dist_opt", "tp=1,pp=1,dp=4,ep=4", budget=8192),
    Case("etp-and-tp", "tiny-moe", "tp=2,pp=1,dp=2,ep=2,etp=1", "tp=1,pp=2,dp=3,ep=1,dist_opt", leave="0",
         join=3),
    Case("dist-opt-buckets", "tiny-gpt", "tp=1,pp=1,dp=4,dist_opt,bucket=3000", "tp=2,pp=1,dp=3,dist_opt",
         join=2, budget=6000),
    Case("transformer-engine-layout", "tiny-llama-te", "tp=2,pp=1,dp=2,dist_opt", "tp=1,pp=2,dp=2,dist_opt",
         leave="1", join=1, budget=4096),
    Case("everything-moves", "tiny-llama-bf16", "tp=2,pp=2,dp=2,dist_opt", "tp=1,pp=4,dp=1,layers=1+1+1+1",
         leave="0-3", budget=5000),
]


@cache
def candidate_configs(model: str, max_world: int) -> tuple[str, ...]:
    spec = SPECS[model]
    splits = {1: [None], 2: [None, (1, 3), (3, 1)], 3: [(1, 1, 2), (2, 1, 1)], 4: [None]}
    out = []
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2, 3, 4), range(1, max_world + 1)):
        if tp * pp * dp > max_world:
            continue
        for layers, ep, etp, dist_opt, bucket in itertools.product(
                splits[pp], (1, 2, 4) if spec.is_moe else (1,), (None, 1) if spec.is_moe else (None,),
                (False, True), (None, 2000)):
            if bucket and not dist_opt:
                continue
            try:
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, layers=layers, dist_opt=dist_opt,
                                     bucket_size=bucket)
                cfg.validate(spec)
            except ConfigError:
                continue
            out.append(str(cfg))
    return tuple(out)


def transition_case(draw, max_procs: int = 8) -> Case:
    """A random valid transition (``draw`` is hypothesis' ``data.draw``)."""
    from hypothesis import strategies as st

    model = draw(st.sampled_from(sorted(SPECS)))
    old = draw(st.sampled_from(candidate_configs(model, max_procs)))
    world = ParallelConfig.parse(old).world_size
    k = draw(st.integers(0, min(world - 1, 3)))
    leaving = draw(st.lists(st.integers(0, world - 1), min_size=k, max_size=k, unique=True))
    join = draw(st.integers(0, max_procs - world))
    avail = world - len(leaving) + join
    new = draw(st.sampled_from([c for c in candidate_configs(model, max_procs)
                                if ParallelConfig.parse(c).world_size <= avail]))
    gpn = draw(st.sampled_from((1, 2, 4, 8)))
    # tight: a tiny model's rank holds 0.2-2 MB, so a few KiB means hundreds of rounds
    budget = draw(st.sampled_from((2048, 8192, 65536, 1 << 20)))
    return Case("random", model, old, new, ",".join(map(str, sorted(leaving))), join, gpn, budget)


def run_rank_with_corruption(rank: int, world: int, job) -> dict:
    """``run_rank`` with one byte flipped in the first buffer device 0 receives: verification
    must fail on every rank, and every old shard must still match the reference."""
    from liveshard.dev.reshard.harness import run_rank
    from liveshard.runtime.transfer import packing

    real_unpack = packing.unpack
    flipped = []

    def corrupting_unpack(buf, chunks, plan, store):
        if rank == 0 and not flipped and buf.numel():
            buf[0] ^= 0xFF
            flipped.append(True)
        real_unpack(buf, chunks, plan, store)

    packing.unpack = corrupting_unpack
    try:
        return {**run_rank(rank, world, job), "flipped": bool(flipped)}
    finally:
        packing.unpack = real_unpack
