"""Split a model's layers over pipeline stages so the slowest stage is as fast as it can be.

Stage i with n layers takes ``slope[i] * n + intercept[i]`` (slower GPUs: a larger slope; the
first and last stages: a larger intercept for the embedding and output layer) and holds at most
``cap[i]`` layers (its memory). Minimising the largest stage time over whole layer counts is
Malleus' non-uniform layer assignment; since every stage time grows with n, adding layers one at
a time to the stage that stays fastest is optimal. Pure.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def balance_layers(num_layers: int, slope: Sequence[float], intercept: Sequence[float],
                   cap: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Layers per stage minimising ``max(slope[i] * n[i] + intercept[i])``, 1 <= n[i] <= cap[i].

    Returns None when the caps leave no room (fewer than one layer a stage, or too few in all).
    Ties go to the lower stage index, so the result is deterministic.
    """
    stages = len(slope)
    caps = [num_layers] * stages if cap is None else [min(c, num_layers) for c in cap]
    if stages == 0 or stages > num_layers or min(caps) < 1 or sum(caps) < num_layers:
        return None
    if stages == 1:
        return (num_layers,)
    # Start below the optimum (the continuous solution, rounded down), then place the rest
    # greedily: the greedy never passes the optimal makespan from a start below it.
    inv = [1.0 / a for a in slope]
    target = (num_layers + sum(b * w for b, w in zip(intercept, inv))) / sum(inv)
    n = [min(c, max(1, math.floor((target - b) * w))) for b, w, c in zip(intercept, inv, caps)]
    if sum(n) > num_layers:
        n = [1] * stages
    heap = [(slope[i] * (n[i] + 1) + intercept[i], i) for i in range(stages) if n[i] < caps[i]]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(n)):
        _, i = heapq.heappop(heap)
        n[i] += 1
        if n[i] < caps[i]:
            heapq.heappush(heap, (slope[i] * (n[i] + 1) + intercept[i], i))
    return tuple(n)
