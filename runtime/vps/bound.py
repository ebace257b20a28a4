"""How fast a transition can be: the lower bound on the busiest device, and a cluster time model.

Definitions (bytes are over all states of a piece):

* ``must_receive[d]``: bytes device ``d`` needs in the new layout and does not hold in the old
  one (with the chosen rank -> device map). No plan can send ``d`` less.
* ``send_bound_bytes``: pieces whose only surviving holder is ``s`` must all leave ``s``; and a
  set ``S`` of holders must together send everything only ``S`` (or one of its members alone)
  holds, so one of them sends at least that total divided by ``|S|``.
* ``lower_bound_bytes = max(max_d must_receive[d], send_bound_bytes)``.
* ``bottleneck_bytes`` (a plan's figure): the largest of any device's sent or received bytes
  (links are full duplex: each direction is its own budget). ``bottleneck / lower_bound`` is how
  far a plan is from the best possible one for its device map.

Time model: a device has an intra-node link (NVLink, default 450 GB/s per direction) and a
network link (default 50 GB/s per direction), used at once. A round takes the longest of any
device's four (link, direction) byte counts divided by that link's bandwidth, plus a fixed
per-round latency; rounds run one after another. Local copies (same device) are not modelled.
Pure: no torch.
"""

from __future__ import annotations

from collections import defaultdict

INTRA_NODE_GBPS = 450.0
INTER_NODE_GBPS = 50.0
ROUND_LATENCY_S = 50e-6


def lower_bound(demands: list[tuple], num_devices: int) -> dict:
    """Bounds from demands ``(bytes, destination, candidate sources, ...)``."""
    recv = [0] * num_devices
    unique = [0] * num_devices
    shared: dict[tuple[int, ...], int] = defaultdict(int)
    for dm in demands:
        w, d, sources = dm[0], dm[1], dm[2]
        recv[d] += w
        if len(sources) == 1:
            unique[sources[0]] += w
        else:
            shared[sources] += w
    send_bound = max(unique, default=0)
    for sources, w in shared.items():
        total = w + sum(unique[s] for s in sources)
        send_bound = max(send_bound, -(-total // len(sources)))
    receive_bound = max(recv, default=0)
    return {
        "must_receive": recv,
        "receive_bound_bytes": receive_bound,
        "send_bound_bytes": send_bound,
        "lower_bound_bytes": max(receive_bound, send_bound),
    }


def modeled_seconds(plan, schedule, intra_gbps: float = INTRA_NODE_GBPS,
                    inter_gbps: float = INTER_NODE_GBPS, latency_s: float = ROUND_LATENCY_S) -> dict:
    """Modeled transfer time of ``schedule`` on a cluster (see the module docstring)."""
    nodes = plan.devices.nodes
    copies = plan.copies
    # per round: device -> [intra send, intra recv, inter send, inter recv]
    per_round: list[dict[int, list[int]]] = [defaultdict(lambda: [0, 0, 0, 0]) for _ in range(schedule.rounds)]
    for ch in schedule.chunks:
        c = copies[ch.copy]
        rd = per_round[ch.round]
        base = 0 if nodes[c.src] == nodes[c.dst] else 2
        rd[c.src][base] += ch.nbytes
        rd[c.dst][base + 1] += ch.nbytes
    intra, inter = intra_gbps * 1e9, inter_gbps * 1e9
    total = 0.0
    for rd in per_round:
        t = max((_device_seconds(v, intra, inter) for v in rd.values()), default=0.0)
        total += t + latency_s
    # The same bytes without rounds: what the busiest device needs if everything overlapped.
    flat: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for rd in per_round:
        for d, v in rd.items():
            f = flat[d]
            for i in range(4):
                f[i] += v[i]
    unrounded = max((_device_seconds(v, intra, inter) for v in flat.values()), default=0.0)
    return {
        "modeled_seconds": total,
        "modeled_unrounded_seconds": unrounded,
        "intra_node_gbps": intra_gbps,
        "inter_node_gbps": inter_gbps,
        "round_latency_s": latency_s,
    }


def _device_seconds(v: list[int], intra: float, inter: float) -> float:
    """[intra send, intra recv, inter send, inter recv] bytes -> seconds (links run in parallel)."""
    return max(max(v[0], v[1]) / intra, max(v[2], v[3]) / inter)
