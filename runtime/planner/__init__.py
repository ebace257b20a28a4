"""The parallelism planner: the one owner of a world's parallel config and rank order.

``plan_world`` (``world``) is the entry every caller uses; ``search`` prices configs with the
cost model (``cost_model``, ``layer_split``, ``placement``); ``pods`` maps a job's worker pods
to GPUs and the answer back to pods. Pure: no torch, no kopf, no kubernetes.
"""

from liveshard.runtime.planner.search import GPU, Constraints, NoFeasiblePlan, ParallelPlan, plan_parallelism
from liveshard.runtime.planner.world import (
           FEWEST_CHANGES,
           OBJECTIVES,
           THROUGHPUT,
           continuity_order,
           plan_world,
)

__all__ = ["FEWEST_CHANGES", "GPU", "OBJECTIVES", "THROUGHPUT", "Constraints", "NoFeasiblePlan", "ParallelPlan",
           "continuity_order", "plan_parallelism", "plan_world"]
