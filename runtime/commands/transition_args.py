"""Arguments shared by ``plan-transition`` and ``reshard-local``: model, configs, devices, budget."""

from __future__ import annotations

import argparse
import re

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec, load_model
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.schedule import DEFAULT_BUDGET

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, field: str = "--budget") -> int:
    """``1073741824``, ``1GiB``, ``512MiB``, ``1.5GB``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(field, f"{text!r} is not a byte count", "write e.g. 1073741824, 1GiB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_transition_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or YAML file of ModelSpec fields")
    p.add_argument("--from", dest="old", required=True, help="old parallel config, e.g. tp=8,pp=4,dp=8,dist_opt")
    p.add_argument("--to", dest="new", required=True, help="new parallel config")
    p.add_argument("--leave", default="", help="old devices leaving (still readable), e.g. 1,3,5,7 or 248-255")
    p.add_argument("--dead", default="", help="old devices lost without notice (cannot serve as sources)")
    p.add_argument("--join", type=int, default=0, help="devices joining, numbered after the old ones, on new nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--budget", default=str(DEFAULT_BUDGET),
                   help="staging bytes per device per round, e.g. 1GiB (default 1 GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def resolve(args: argparse.Namespace) -> tuple[ModelSpec, ParallelConfig, ParallelConfig, DeviceMap, int]:
    spec = load_model(args.model)
    old = _parse_cfg(args.old, "--from")
    new = _parse_cfg(args.new, "--to")
    old.validate(spec)
    new.validate(spec)
    if old.world_size < 1:
        raise ConfigError("--from", "empty world")
    devices = DeviceMap(old.world_size, args.gpus_per_node, parse_devices(args.leave, "--leave"), args.join,
                        parse_devices(args.dead, "--dead"))
    devices.check_fits(new.world_size)
    budget = parse_bytes(args.budget)
    return spec, old, new, devices, budget


def _parse_cfg(text: str, field: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except ConfigError as e:
        raise ConfigError(f"{field} {e.field}", e.problem, e.fix) from None
