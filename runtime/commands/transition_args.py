"""Arguments shared by ``plan-transition`` and ``reshard-local``: model, configs, devices, budget."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec, load_model
from liveshard.runtime.units import parse_bytes
from liveshard.runtime.vps.devices import DeviceMap, device_list, parse_devices
from liveshard.runtime.vps.transition import InvalidDeviceOrder, NoSurvivingCopy


def add_transition_args(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import alias, byte_size

    p.add_argument("--model", required=True, help="preset name or YAML file of ModelSpec fields")
    p.add_argument("--from-parallel", dest="old", required=True, metavar="CFG",
                   help="old parallel config, e.g. tp=8,pp=4,dp=8,dist_opt")
    p.add_argument("--to-parallel", dest="new", required=True, metavar="CFG", help="new parallel config")
    alias(p, "--from-parallel", "--from")  # --from/--to: convert's source and target
    alias(p, "--to-parallel", "--to")
    p.add_argument("--leave", default="", help="old devices leaving (still readable), e.g. 1,3,5,7 or 248-255")
    p.add_argument("--dead", default="", help="old devices lost without notice (cannot serve as sources)")
    p.add_argument("--join", type=int, default=0, help="devices joining, numbered after the old ones, on new nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    # read as the worker's --budget, with its default: the plan is the one a worker would carry out
    p.add_argument("--budget", type=byte_size("--budget"), default=Defaults.STAGING_BUDGET, metavar="SIZE",
                   help="staging bytes per device per round: bytes or a size, e.g. 64MiB, 1GiB "
                        f"(default {Defaults.STAGING_BUDGET >> 20}MiB, the worker's --budget)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def resolve(args: argparse.Namespace) -> tuple[ModelSpec, ParallelConfig, ParallelConfig, DeviceMap, int]:
    spec = load_model(args.model)
    old = _parse_cfg(args.old, "--from-parallel")
    new = _parse_cfg(args.new, "--to-parallel")
    old.validate(spec)
    new.validate(spec)
    if old.world_size < 1:
        raise ConfigError("--from-parallel", "empty world")
    with as_flags():
        devices = DeviceMap(old.world_size, args.gpus_per_node, parse_devices(args.leave, "--leave"), args.join,
                            parse_devices(args.dead, "--dead"))
        devices.check_fits(new.world_size)
    budget = parse_bytes(args.budget, "--budget")
    return spec, old, new, devices, budget


# What the pure planner calls a field, as these commands' flags.
_FLAGS = {"old_world": "--from-parallel", "old config": "--from-parallel", "new config": "--to-parallel",
          "leaving": "--leave",
          "dead": "--dead", "joining": "--join", "gpus_per_node": "--gpus-per-node", "budget": "--budget",
          "device": "--device"}


@contextlib.contextmanager
def as_flags() -> Iterator[None]:
    """Errors of the planner named after the flag that set the value; a transition whose
    state has no surviving copy is an error of ``--dead``."""
    try:
        yield
    except ConfigError as e:
        fix = e.fix.replace("add joining devices", "add devices with --join")
        raise ConfigError(_FLAGS.get(e.field, e.field), e.problem, fix) from None
    except NoSurvivingCopy as e:
        raise ConfigError("--dead", str(e), "restore from the last checkpoint, or lose fewer devices") from None
    except InvalidDeviceOrder as e:
        raise ConfigError("--rank-to-device", str(e), "name each available device at most once, one per new rank") from None


def parse_order(text: str, field: str = "--rank-to-device") -> tuple[int, ...]:
    """Devices in rank order from ``"3,7,11"``, ``"8-15,0-7"`` or a mix (ranges kept in order)."""
    return tuple(device_list(text, field, "list the device of each new rank in rank order, e.g. 8-15,0-7"))


def _parse_cfg(text: str, field: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except ConfigError as e:
        raise ConfigError(f"{field} {e.field}", e.problem, e.fix) from None
