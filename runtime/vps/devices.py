"""Physical devices around a transition: which stay, which leave, which join, and their nodes.

Numbering: old rank ``i`` runs on device ``i``; devices are grouped into nodes of
``gpus_per_node`` (device ``d`` on node ``d // gpus_per_node``); ``joining`` devices are numbered
after the old ones and sit on new nodes. Leaving devices are still alive during the transition
(a spot notice gives a window) and may serve as sources; ``dead`` devices are gone and cannot.
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from liveshard.runtime.errors import ConfigError


def parse_devices(text: str | None, field: str = "devices") -> frozenset[int]:
    """Device ids from ``"1,3,5,7"``, ``"248-255"`` or a mix (``"0,8-15"``)."""
    return frozenset(device_list(text, field, "write ids and ranges, e.g. 1,3,5,7 or 248-255"))


def device_list(text: str | None, field: str, fix: str) -> list[int]:
    """Device ids from ids and ranges, in the order written (ranges ascending, repeats kept);
    ``fix`` is the advice of the error a malformed part raises."""
    out: list[int] = []
    if text is None:
        return out
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ConfigError(field, f"{part!r} is not a device id or range", fix) from None
        if a < 0 or b < a:
            raise ConfigError(field, f"bad range {part!r}", "write ranges low-high with 0 <= low <= high")
        out.extend(range(a, b + 1))
    return out


@dataclass(frozen=True)
class DeviceMap:
    """The devices of a transition. Old devices are ``0..old_world-1``, joiners follow."""

    old_world: int
    gpus_per_node: int = 8
    leaving: frozenset[int] = frozenset()
    joining: int = 0
    dead: frozenset[int] = frozenset()  # lost without notice: hold nothing usable
    # the node of each device (old ones, then joiners) where the job knows it; else devices are
    # grouped ``gpus_per_node`` to a node
    node_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaving", frozenset(self.leaving))
        object.__setattr__(self, "dead", frozenset(self.dead))
        if self.old_world < 1:
            raise ConfigError("old_world", f"old world of {self.old_world} devices", "give a config of >= 1 rank")
        if self.gpus_per_node < 1:
            raise ConfigError("gpus_per_node", f"must be >= 1, got {self.gpus_per_node}")
        if self.joining < 0:
            raise ConfigError("joining", f"must be >= 0, got {self.joining}")
        object.__setattr__(self, "node_ids", tuple(self.node_ids))
        if self.node_ids and len(self.node_ids) != self.old_world + self.joining:
            raise ConfigError("node_ids", f"{len(self.node_ids)} given for {self.old_world + self.joining} devices",
                              "give one node per old and joining device")
        for field, ids in (("leaving", self.leaving), ("dead", self.dead)):
            bad = sorted(d for d in ids if not 0 <= d < self.old_world)
            if bad:
                raise ConfigError(field, f"device {bad[0]} is not an old device (0..{self.old_world - 1})",
                                  "name devices of the old world; joiners cannot leave")

    @property
    def num_devices(self) -> int:
        return self.old_world + self.joining

    @cached_property
    def old_nodes(self) -> int:
        return -(-self.old_world // self.gpus_per_node)

    def node(self, device: int) -> int:
        if self.node_ids:
            return self.node_ids[device]
        if device < self.old_world:
            return device // self.gpus_per_node
        return self.old_nodes + (device - self.old_world) // self.gpus_per_node

    @cached_property
    def nodes(self) -> tuple[int, ...]:
        return tuple(self.node(d) for d in range(self.num_devices))

    @cached_property
    def available(self) -> tuple[int, ...]:
        """Devices that may serve in the new world: surviving old ones, then joiners."""
        gone = self.leaving | self.dead
        return tuple(d for d in range(self.num_devices) if d not in gone)

    def holds_old_state(self, device: int) -> bool:
        """Whether the device's old shards can be read during the transition."""
        return device < self.old_world and device not in self.dead

    def check_fits(self, new_world: int) -> None:
        if new_world > len(self.available):
            raise ConfigError("new config", f"the new config needs {new_world} devices but only "
                                      f"{len(self.available)} are available ({self.old_world} old - "
                                      f"{len(self.leaving | self.dead)} leaving + {self.joining} joining)",
                              "choose a smaller config or add joining devices")

    def describe(self) -> dict:
        return {
            "old_world": self.old_world,
            "gpus_per_node": self.gpus_per_node,
            "leaving": sorted(self.leaving),
            "dead": sorted(self.dead),
            "joining": self.joining,
            **({"node_ids": list(self.node_ids)} if self.node_ids else {}),
        }
