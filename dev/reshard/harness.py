"""One process's part of a local reshard: plan, fill from the reference, transfer, check.

``run_rank(rank, world, job)`` is what every process of ``liveshard reshard-local`` (and the
tests' process pool) runs inside an initialised process group: it computes the plan itself,
confirms that every process computed the same plan (checksums gathered), fills its old shards
and small objects from the deterministic reference, runs the executor, and checks every new
shard bit for bit against the reference (and the old shards untouched).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from liveshard.dev.reshard.reference import check_reference, fill_reference
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec, load_model
from liveshard.runtime.transfer.executor import TransferError, allocate_destinations, execute
from liveshard.runtime.transfer.storage import LocalShards
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.schedule import DEFAULT_BUDGET, schedule
from liveshard.runtime.vps.transition import GLOBAL_OBJECTS, PER_RANK_OBJECTS, TransitionPlan, plan_transition


@dataclass(frozen=True)
class LocalJob:
    model: str | ModelSpec
    old: str
    new: str
    leave: str = ""
    join: int = 0
    gpus_per_node: int = 8
    budget: int = DEFAULT_BUDGET
    mode: str = "p2p"
    verify: bool = True  # executor checksums
    check: bool = True  # compare new (and old) shards with the reference afterwards
    release_old: bool = False
    repeat: int = 1  # timed executions (the first one is reported as cold)
    direct_min_bytes: int | None = None  # executor default unless set
    # who allocates and touches its new tensors before each timed transfer, as the worker's
    # --preallocate: None/False nobody, "all" (or True, or "auto": gloo runs on the CPU) every
    # member, "joiners" only the devices joining
    preallocate: bool | str | None = None

    def spec(self) -> ModelSpec:
        return self.model if isinstance(self.model, ModelSpec) else load_model(self.model)

    def devices(self) -> DeviceMap:
        old = ParallelConfig.parse(self.old)
        return DeviceMap(old.world_size, self.gpus_per_node, parse_devices(self.leave), self.join)

    def plan(self):
        return plan_transition(self.spec(), ParallelConfig.parse(self.old), ParallelConfig.parse(self.new),
                               self.devices())


def reference_objects(rank: int) -> dict:
    """The small objects old rank ``rank`` carries, in a form that shows where they came from."""
    objs: dict = {"step": 1000, "scheduler": {"lr": 3e-4, "last_epoch": 1000},
                  "data_cursor": {"consumed_samples": 512000},
                  "loss_scaler": {"skipped_steps": 3, "grad_scalers": [{"scale": 65536.0, "growth_tracker": 7}]}}
    gen = torch.Generator().manual_seed(10_000 + rank)
    objs["rng"] = {"owner": rank, "state": gen.get_state()}
    return objs


def run_rank(rank: int, world: int, job: LocalJob) -> dict:
    plan = job.plan()
    sched = schedule(plan, job.budget)
    sums: list = [None] * world
    # a whole plan's checksum hashes every copy; a device's own plan has its inputs digest
    agreed = plan.checksum if isinstance(plan, TransitionPlan) else plan.digest
    dist.all_gather_object(sums, agreed)
    if len(set(sums)) != 1:
        raise RuntimeError(f"ranks computed different plans: {sorted(set(sums))}")
    old_layout, new_layout = plan.old_layout, plan.new_layout
    member = rank < plan.devices.num_devices
    is_old = member and rank < plan.devices.old_world
    old = fill_reference(old_layout, rank) if is_old else LocalShards()
    objects = reference_objects(rank) if is_old else {}
    result = None
    times: list[float] = []
    prepare_times: list[float] = []
    error = None
    dest_bytes = 0
    dest_used = True
    for _ in range(max(1, job.repeat)):
        destinations = None
        if _preallocates(job.preallocate, member, is_old):  # what a live job does while it trains; timed apart
            result = None  # the previous repeat's tensors go first, as they would in a job
            t0 = time.perf_counter()
            destinations = allocate_destinations(plan, rank) if member else LocalShards()
            prepare_times.append(time.perf_counter() - t0)
            dest_bytes = destinations.nbytes()
        dist.barrier()
        t0 = time.perf_counter()
        try:
            extra = {} if job.direct_min_bytes is None else {"direct_min_bytes": job.direct_min_bytes}
            result = execute(plan, sched, rank, old, objects, mode=job.mode, verify=job.verify,
                             release_old=job.release_old, destinations=destinations, **extra)
        except TransferError as e:  # every rank sees the verdict; the old state must be intact
            error = str(e)
            break
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if destinations is not None:  # written in place, not replaced
            dest_used = dest_used and all(result.shards.get(s, n) is t for s, n, t in destinations.items())
    out = {"rank": rank, "seconds": times, "prepare_seconds": prepare_times,
           "stats": asdict(result.stats) if result else None,
           "checksum": agreed, "new_rank": plan.device_to_rank.get(rank), "error": error,
           "destination_bytes": dest_bytes, "destinations_used": dest_used,
           "new_bytes": result.shards.nbytes() if result else 0,
           "mismatches": [], "old_mismatches": [], "object_errors": []}
    if job.check and member:
        new_rank = plan.device_to_rank.get(rank)
        if new_rank is not None and result is not None:
            out["mismatches"] = check_reference(new_layout, new_rank, result.shards)
            out["object_errors"] = _check_objects(plan, new_rank, result.objects)
        if is_old and not job.release_old:
            out["old_mismatches"] = check_reference(old_layout, rank, old)
    return out


def _check_objects(plan, new_rank: int, objects: dict) -> list[str]:
    errors = []
    expect_src = {m.name: m.src_rank for m in plan.objects if m.dst_rank == new_rank}
    for name in GLOBAL_OBJECTS:
        if objects.get(name) != reference_objects(expect_src[name])[name]:
            errors.append(f"{name}: got {objects.get(name)!r}")
    for name in PER_RANK_OBJECTS:
        got = objects.get(name)
        want = reference_objects(expect_src[name])[name]
        if not isinstance(got, dict) or got["owner"] != want["owner"] or not torch.equal(got["state"], want["state"]):
            errors.append(f"{name}: not the state of old rank {expect_src[name]}")
    return errors


def _preallocates(mode: bool | str | None, member: bool, is_old: bool) -> bool:
    """Whether this process allocates its new tensors ahead (``LocalJob.preallocate``)."""
    if mode in (None, False):
        return False
    if mode == "joiners":
        return member and not is_old
    return member  # True, "all", "auto"
