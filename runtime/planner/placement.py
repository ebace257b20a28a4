"""Which GPU each rank runs on: the orders the planner tries, and fast questions about them.

Megatron's rank order (tp-cp-ep-dp-pp) makes every parallel group a run of consecutive ranks:
a TP group is ``tp`` of them, a pipeline stage ``tp * dp``. So an order of GPUs fixes every
group, and the planner only needs, per block size, each block's slowest GPU, its smallest
memory and whether it stays inside one node. ``Arrangement`` answers those from per-size caches,
so the planner's candidate loop does no per-GPU work.

Orders are built from whole pods (``granularity`` consecutive input GPUs), grouped by node so
groups stay on NVLink, fastest first, so a prefix of the order is the best set of GPUs to use
and the stragglers end up together (one pipeline stage, which then gets fewer layers). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from liveshard.runtime.planner.search import GPU


class Arrangement:
    """One order of the GPUs; ranks take them from the front."""

    def __init__(self, gpus: Sequence[GPU]) -> None:
        self.gpus = tuple(gpus)
        self.speed = [g.speed for g in self.gpus]
        self.memory = [g.memory_bytes for g in self.gpus]
        nodes: dict[str, int] = {}
        node = [nodes.setdefault(g.node, len(nodes)) for g in self.gpus]
        # changes[i]: node changes between positions up to i (a block is local if none inside)
        self._changes = [0, *accumulate(int(a != b) for a, b in pairwise(node))]
        self._block_speed: dict[int, list[float]] = {}
        self._block_memory: dict[int, list[int]] = {}
        self._block_local: dict[int, list[bool]] = {}
        self._nonlocal_prefix: dict[int, list[int]] = {}
        self.uniform_speed = len(set(self.speed)) <= 1
        self.max_speed = max(self.speed, default=1.0)

    def __len__(self) -> int:
        return len(self.gpus)

    def local(self, start: int, stop: int) -> bool:
        """Positions ``[start, stop)`` all sit on one node."""
        return self._changes[stop - 1] == self._changes[start]

    def block_min_speed(self, size: int) -> list[float]:
        out = self._block_speed.get(size)
        if out is None:
            s = self.speed
            out = self._block_speed[size] = [min(s[i:i + size]) for i in range(0, len(s) - size + 1, size)]
        return out

    def block_min_memory(self, size: int) -> list[int]:
        out = self._block_memory.get(size)
        if out is None:
            m = self.memory
            out = self._block_memory[size] = [min(m[i:i + size]) for i in range(0, len(m) - size + 1, size)]
        return out

    def block_local(self, size: int) -> list[bool]:
        out = self._block_local.get(size)
        if out is None:
            c = self._changes
            out = self._block_local[size] = [c[i + size - 1] == c[i]
                                             for i in range(0, len(self.gpus) - size + 1, size)]
        return out

    def blocks_local(self, size: int, stop: int) -> bool:
        """Every block of ``size`` in the first ``stop`` positions sits on one node."""
        prefix = self._nonlocal_prefix.get(size)
        if prefix is None:
            prefix = self._nonlocal_prefix[size] = [0, *accumulate(not x for x in self.block_local(size))]
        return prefix[stop // size] == 0


def arrangements(gpus: Sequence[GPU], granularity: int) -> list[Arrangement]:
    """The distinct GPU orders worth trying (one when every node looks alike).

    Nodes go fastest first (by their slowest GPU); a second order puts nodes with more GPUs first,
    which keeps TP groups aligned with nodes when some nodes have lost GPUs. Within a node, pods
    go fastest first, and within a pod, GPUs too; ties keep the input order.
    """
    pods = [tuple(gpus[i:i + granularity]) for i in range(0, len(gpus), granularity)]
    by_node: dict[str, list[int]] = {}
    for i, pod in enumerate(pods):
        by_node.setdefault(pod[0].node, []).append(i)
    pod_speed = [min(g.speed for g in pod) for pod in pods]
    facts = []
    for first, members in enumerate(by_node.values()):
        members.sort(key=lambda i: (-pod_speed[i], i))
        size = sum(len(pods[i]) for i in members)
        facts.append((min(pod_speed[i] for i in members), size, first, members))
    keys = (lambda f: (-f[0], -f[1], f[2]), lambda f: (-f[1], -f[0], f[2]))
    out: list[Arrangement] = []
    seen: set[tuple[str, ...]] = set()
    for key in keys:
        order = []
        for *_, members in sorted(facts, key=key):
            for i in members:
                order.extend(sorted(pods[i], key=lambda g: -g.speed))
        ids = tuple(g.id for g in order)
        if ids not in seen:
            seen.add(ids)
            out.append(Arrangement(order))
    return out
