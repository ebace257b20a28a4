"""``liveshard layout``: every rank's regions of every logical tensor, for a model and a config."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import load_model
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import OPTIMIZER_STATES, PARAM

STATE_CHOICES = ("params", "optimizer", "all")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or YAML file of ModelSpec fields")
    p.add_argument("--parallel", required=True, help="e.g. tp=8,pp=4,dp=8,ep=1,layers=20+20+21+19,dist_opt")
    p.add_argument("--state", choices=STATE_CHOICES, default="params",
                   help="model weights, optimizer state (fp32 main weights and Adam moments), or both")
    p.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per (rank, region)")


def run(args: argparse.Namespace) -> int:
    spec = load_model(args.model)
    cfg = ParallelConfig.parse(args.parallel)
    layout = Layout(spec, cfg)
    if args.state == "params":
        states: tuple[str, ...] = (PARAM,)
    elif args.state == "optimizer":
        states = tuple(s for s in OPTIMIZER_STATES if s in layout.states)
    else:
        states = layout.states
    ranks = args.rank if args.rank else range(layout.world_size)
    for r in ranks:
        if not 0 <= r < layout.world_size:
            from liveshard.runtime.errors import ConfigError

            raise ConfigError("--rank", f"{r} is outside the world of {layout.world_size} ranks")
    if args.json:
        _write_json(layout, ranks, states)
    else:
        _write_summary(layout, ranks, states)
    return 0


def _write_json(layout: Layout, ranks, states) -> None:
    # Hand-assembled JSON: at 1024 ranks the list has ~10^5 rows and json.dumps per row dominates.
    out = sys.stdout
    out.write("[")
    first = True
    dumps = json.dumps
    for r in ranks:
        for reg in layout.regions(r, states):
            out.write(("\n" if first else ",\n")
                      + f'{{"rank": {reg.rank}, "key": {dumps(reg.key)}, "state": "{reg.state}", '
                      f'"global_shape": {list(reg.global_shape)}, "global_offset": {list(reg.global_offset)}, '
                      f'"local_shape": {list(reg.local_shape)}, "primary": {"true" if reg.primary else "false"}}}')
            first = False
    out.write("\n]\n")


def _write_summary(layout: Layout, ranks, states) -> None:
    spec, cfg = layout.spec, layout.cfg
    print(f"model {spec.name}: {spec.num_parameters() / 1e9:.3f}B parameters, "
          f"{layout.state_bytes() / 2**30:.2f} GiB of state ({', '.join(layout.states)})")
    print(f"parallel {cfg}: {cfg.world_size} ranks")
    per_rank: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    regions: dict[int, int] = defaultdict(int)
    for r in ranks:
        for reg in layout.regions(r, states):
            per_rank[r][reg.state] += reg.numel * layout.itemsize(reg.state)
            regions[r] += 1
    header = f"{'rank':>6} {'tp':>3} {'pp':>3} {'dp':>4} {'ep':>3} {'regions':>8} " + " ".join(
        f"{s + ' MiB':>14}" for s in states)
    print(header)
    for r in ranks:
        c = cfg.coord(r)
        print(f"{r:>6} {c.tp:>3} {c.pp:>3} {c.dp:>4} {c.ep:>3} {regions[r]:>8} " + " ".join(
            f"{per_rank[r][s] / 2**20:>14.2f}" for s in states))
