"""Real nodes reach the transition: the plans carry where every worker registered from, and the
device map groups devices by those nodes instead of assuming eight GPUs to a node."""

from __future__ import annotations

from liveshard.runtime.agent.transition import device_map, transition_inputs
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.transition import plan_transition

NODES = (("a0", "node-a"), ("a1", "node-a"), ("b0", "node-b"), ("b1", "node-b"), ("c0", "node-c"))


def _plans() -> tuple[WorldPlan, WorldPlan]:
    old = WorldPlan(generation=1, config="tp=2,pp=1,dp=2", members=("a0", "a1", "b0", "b1"), nodes=NODES[:4])
    new = WorldPlan(generation=2, config="tp=2,pp=1,dp=2", members=("a0", "a1", "c0", "b1"), previous=1,
                    nodes=(NODES[0], NODES[1], NODES[4], NODES[3]))
    return old, new


def test_a_plan_carries_its_workers_nodes_through_json():
    old, _ = _plans()
    again = WorldPlan.from_json(old.to_json())
    assert again == old and again.node_of("b1") == "node-b" and again.node_of("zz") is None


def test_the_device_map_groups_devices_by_the_nodes_the_workers_registered_from():
    old, new = _plans()
    _, _, devices, _ = transition_inputs(old, new)
    # a0 a1 | b0 b1 | c0 (joins): three nodes of two, two and one device, not one node of eight
    assert devices.nodes == (0, 0, 1, 1, 2) and devices.leaving == frozenset({2})
    assert DeviceMap(4, joining=1).nodes == (0, 0, 0, 0, 1)  # what was assumed before
    # a worker with no node known: the grouping falls back to gpus_per_node
    assert device_map(old, new.members, (), 2, {"a0": "node-a"}).nodes == (0, 0, 1, 1, 2)


def test_real_nodes_change_which_copies_cross_the_network():
    """With eight GPUs to a node assumed, the four old devices look like one node; by the real
    nodes some copies cross between nodes, and the plan (whose checksum every member compares)
    follows the real placement."""
    old, new = _plans()
    spec = PRESETS["tiny-llama"]
    by_nodes = plan_transition(spec, *transition_inputs(old, new), cached=False)
    assumed = plan_transition(spec, *transition_inputs(WorldPlan(**{**old.__dict__, "nodes": ()}),
                                                       WorldPlan(**{**new.__dict__, "nodes": ()})), cached=False)
    # with the 8-per-node assumption every copy is local to "node 0"; with real nodes some cross
    assert all(assumed.devices.node(c.src) == assumed.devices.node(c.dst) for c in assumed.network_copies
               if c.dst < 4)
    crossing = [c for c in by_nodes.network_copies if by_nodes.devices.node(c.src) != by_nodes.devices.node(c.dst)]
    assert crossing and by_nodes.checksum != assumed.checksum
