"""From worker pods to a plan: which GPUs the job has, and the planner's answer in pod terms.

Each worker pod contributes ``gpusPerWorker`` GPUs on its node; they are planned in whole pods
(``Constraints.granularity``), so a plan's rank order maps back to pods: rank ``r`` runs on local
GPU ``r % gpusPerWorker`` of ``members[r // gpusPerWorker]``. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from liveshard.runtime.contract.jobspec import JobSpec
from liveshard.runtime.contract.status import pod_of, worker_ids
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.search import GPU, Constraints, NoFeasiblePlan, ParallelPlan
from liveshard.runtime.planner.world import plan_world

GPU_MEMORY_LABELS = ("nvidia.com/gpu.memory",)  # GPU feature discovery, in MiB


@dataclass(frozen=True)
class Candidate:
    """A running worker pod the next plan may use."""

    pod: str
    node: str
    gpu_memory_bytes: int | None = None  # from the node's labels; None: the job's default
    speed: float = 1.0


@dataclass(frozen=True)
class PodAssignment:
    plan: ParallelPlan
    members: tuple[str, ...]  # pod names in rank order
    standby: tuple[str, ...]  # candidates the plan leaves unused

    @property
    def config(self) -> str:
        return str(self.plan.config)

    @property
    def world_size(self) -> int:
        return len(self.plan.gpus)

    @property
    def standby_reason(self) -> str:
        """Why the plan leaves pods unused, in one line to log ("" when it uses every one)."""
        return self.plan.standby_reason if self.standby else ""


def node_gpu_memory(labels: Mapping[str, str] | None) -> int | None:
    for key in GPU_MEMORY_LABELS:
        value = (labels or {}).get(key)
        if value and str(value).isdigit():
            return int(value) * 2**20
    return None


def constraints_for(spec: JobSpec) -> Constraints:
    p, t = spec.parallelism, spec.training
    return Constraints(tp=p.tp, pp=p.pp, ep=p.ep, global_batch=t.global_batch, micro_batch=t.micro_batch,
                       seq_length=t.seq_length, dist_opt=p.dist_opt,
                       granularity=spec.workers.gpus_per_worker, max_gpus=spec.max_gpus,
                       min_dp=spec.parallelism.min_dp)


def gpus_for(spec: JobSpec, candidates: Sequence[Candidate]) -> list[GPU]:
    gpw = spec.workers.gpus_per_worker
    return [GPU(id=f"{c.pod}/{k}", node=c.node,
                memory_bytes=c.gpu_memory_bytes or spec.workers.gpu_memory_bytes, speed=c.speed)
            for c in candidates for k in range(gpw)]


def plan_for(spec: JobSpec, candidates: Sequence[Candidate], current_config: str = "",
             current_members: Sequence[str] = (), lost: Sequence[str] = ()) -> PodAssignment:
    """The planner's world over these pods (``world.plan_world``); raises ``NoFeasiblePlan``.

    ``current_*``: the running world (its config and member pods in rank order), so survivors
    keep their places where the planner is indifferent; ``lost``: its pods that are gone."""
    if not candidates:
        raise NoFeasiblePlan("no running worker pods to plan on", "gpus")
    current = ParallelConfig.parse(current_config) if current_config else None
    plan = plan_world(spec.model, gpus_for(spec, candidates), constraints_for(spec), current=current,
                      current_members=worker_ids(current_members, spec.workers.gpus_per_worker),
                      lost=worker_ids(lost, spec.workers.gpus_per_worker))
    members = members_in_rank_order(plan, spec.workers.gpus_per_worker)
    used = set(members)
    return PodAssignment(plan, members, tuple(c.pod for c in candidates if c.pod not in used))


def members_in_rank_order(plan: ParallelPlan, gpus_per_worker: int) -> tuple[str, ...]:
    """Pod names in rank order; checks that every pod's GPUs are one whole, consecutive block."""
    members: list[str] = []
    for start in range(0, len(plan.gpus), gpus_per_worker):
        block = plan.gpus[start:start + gpus_per_worker]
        pods = {pod_of(g.id) for g in block}
        if len(block) != gpus_per_worker or len(pods) != 1:
            raise ValueError(f"plan ranks {start}..{start + len(block) - 1} span pods {sorted(pods)}: "
                             "a pod's GPUs must be consecutive ranks")
        members.append(pods.pop())
    if len(set(members)) != len(members):
        raise ValueError("a pod appears twice in the plan's rank order")
    return tuple(members)


def micro_batches(spec: JobSpec, plan: ParallelPlan) -> int:
    """Micro-batches per data-parallel rank per step (the most any rank takes, with an uneven
    ``dp_split``): the global batch stays fixed."""
    cfg = plan.config
    if cfg.dp_split is not None:
        return max(cfg.dp_split)
    return spec.training.global_batch // (cfg.dp * spec.training.micro_batch)


__all__ = ["Candidate", "NoFeasiblePlan", "PodAssignment", "constraints_for", "gpus_for", "members_in_rank_order",
           "micro_batches", "node_gpu_memory", "plan_for"]
