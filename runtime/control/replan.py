"""Choosing a config for the workers at hand when nobody else does (local runs, lost ranks).

The operator's planner decides on a cluster; the coordinator uses this small rule when it must
react alone (a rank died without notice) or when the local driver asks for "whatever fits":
keep the current TP and PP degrees and change only DP if the global batch allows it, otherwise
the valid config closest to the current one that uses the most workers. Pure.
"""

from __future__ import annotations

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_config(spec: ModelSpec, current: ParallelConfig, workers: int, global_batch: int,
               micro_batch: int = 1) -> ParallelConfig:
    """The best config for ``workers`` ranks (some may stay idle as standbys)."""
    candidates: list[tuple[tuple, ParallelConfig]] = []
    for world in range(workers, 0, -1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                if global_batch % (dp * micro_batch):
                    continue
                ep = current.ep if current.ep <= dp * tp and (dp * tp) % current.ep == 0 else 1
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep,
                                     etp=current.etp if current.etp is not None else None,
                                     dist_opt=current.dist_opt, bucket_size=current.bucket_size)
                try:
                    cfg.validate(spec)
                except ConfigError:
                    continue
                # most workers, then fewest changed degrees, then smallest TP*PP
                changes = (tp != current.tp) + (pp != current.pp) + (ep != current.ep)
                candidates.append(((-world, changes, tp * pp, tp), cfg))
        if candidates:
            break
    if not candidates:
        raise ConfigError("workers", f"no valid parallel config for {spec.name} fits {workers} worker(s) "
                                     f"with global batch {global_batch}",
                          "add workers or change the global batch")
    candidates.sort(key=lambda c: c[0])
    return candidates[0][1]
