"""How the model is split: tensor, pipeline, data, expert and context parallel degrees.

``ParallelConfig`` is one small frozen dataclass with a compact string form
(``tp=8,pp=4,dp=8,ep=1,layers=20+20+21+19,dist_opt``) and megatron-core's rank order
(``tp-cp-ep-dp-pp``: TP varies fastest). ``validate(spec)`` checks it against a model and names
the broken rule and its fix. ``dp_split=3+1`` (micro-batches per DP replica) is the one setting
that changes no tensor layout: only how the global batch is shared. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from liveshard.runtime.errors import ConfigError, short
from liveshard.runtime.spec import ModelSpec

SUPPORTED_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class RankCoord:
    """Where a rank sits in both of megatron's grids (dense and expert)."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None means "same as tp" (megatron's default)
    layers: tuple[int, ...] | None = None  # layers per pipeline stage; None: even split
    dist_opt: bool = False
    # Gradient-buffer bucket size in elements (megatron DDP with overlap_grad_reduce); None means
    # one bucket per buffer. It decides the distributed optimizer's shard boundaries.
    bucket_size: int | None = None
    # Micro-batches per data-parallel replica (index: the DP rank) out of the same global batch;
    # None: an even split. A training-time choice that moves no tensor: a slower replica takes
    # fewer samples and the gradient average weights each replica by the samples it processed.
    # An all-equal split is the even one and normalises to None (one config, one string).
    dp_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {short(value)}")
        for name in ("etp", "bucket_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a positive integer, got {short(value)}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
            if len(self.layers) != self.pp:
                raise ConfigError("layers", f"{len(self.layers)} stage sizes given for pp={self.pp}",
                                  "give one layer count per pipeline stage, joined with '+'")
            if any(n < 1 for n in self.layers):
                raise ConfigError("layers", "every pipeline stage needs at least one layer")
        if self.dp_split is not None:
            split = tuple(self.dp_split)
            if len(split) != self.dp:
                raise ConfigError("dp_split", f"{len(split)} micro-batch counts given for dp={self.dp}",
                                  "give one micro-batch count per data-parallel replica, joined with '+'")
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split):
                raise ConfigError("dp_split", f"{'+'.join(map(str, split))}: every data-parallel replica "
                                              "needs at least one micro-batch",
                                  "give each replica a count >= 1, or use fewer replicas")
            object.__setattr__(self, "dp_split", None if len(set(split)) == 1 else split)
        if self.world_size % (self.expert_tp * self.ep * self.pp):
            raise ConfigError("ep", f"tp*cp*dp={self.tp * self.cp * self.dp} ranks per stage do not "
                                    f"split into etp*ep={self.expert_tp * self.ep} expert shards",
                              "choose ep and etp so that etp*ep divides tp*cp*dp")

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def with_even_dp(self) -> ParallelConfig:
        """This config without its DP split: the tensor layout alone (what a checkpoint records)."""
        return self if self.dp_split is None else replace(self, dp_split=None)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layers is not None:
            return self.layers
        if num_layers % self.pp:
            raise ConfigError("pp", f"{num_layers} layers do not split evenly into pp={self.pp} stages",
                              "give a per-stage split, e.g. layers=" + _even_split_hint(num_layers, self.pp))
        return (num_layers // self.pp,) * self.pp

    def stage_offsets(self, num_layers: int) -> tuple[int, ...]:
        """Global index of each stage's first layer."""
        out, acc = [], 0
        for n in self.stage_layers(num_layers):
            out.append(acc)
            acc += n
        return tuple(out)

    # ---- rank order (megatron-core's RankGenerator with order tp-cp-ep-dp-pp) ---------------
    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return self._coords[rank]

    @cached_property
    def _coords(self) -> tuple[RankCoord, ...]:
        out = []
        tp, cp, dp, etp, ep = self.tp, self.cp, self.dp, self.expert_tp, self.ep
        per_stage = tp * cp * dp
        for rank in range(self.world_size):
            pp_i, r = divmod(rank, per_stage)
            dp_i, r = divmod(r, tp * cp)
            cp_i, tp_i = divmod(r, tp)
            edp_i, r = divmod(rank % per_stage, etp * ep)
            ep_i, etp_i = divmod(r, etp)
            out.append(RankCoord(tp_i, cp_i, dp_i, pp_i, etp_i, ep_i, edp_i))
        return tuple(out)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    # ---- validation against a model ---------------------------------------------------------
    def validate(self, spec: ModelSpec) -> None:
        """Raise ConfigError naming the first rule this config breaks for ``spec``."""
        spec.require_supported()
        if spec.num_attention_heads % self.tp:
            raise ConfigError("tp", f"{spec.num_attention_heads} attention heads do not split over "
                                    f"tp={self.tp}", f"use a tp that divides {spec.num_attention_heads}")
        if spec.num_query_groups % self.tp:
            raise ConfigError("tp", f"{spec.num_query_groups} query groups (GQA) do not split over "
                                    f"tp={self.tp}", f"use a tp that divides {spec.num_query_groups}")
        if spec.ffn_hidden_size % self.tp:
            raise ConfigError("tp", f"ffn_hidden_size={spec.ffn_hidden_size} does not split over "
                                    f"tp={self.tp}", "use a tp that divides ffn_hidden_size")
        if spec.padded_vocab_size % self.tp:
            raise ConfigError("tp", f"padded vocabulary {spec.padded_vocab_size} does not split over "
                                    f"tp={self.tp} (vocab padding rule: vocab_size rounded up to a "
                                    f"multiple of make_vocab_size_divisible_by="
                                    f"{spec.make_vocab_size_divisible_by})",
                              "use a tp that divides it, or set make_vocab_size_divisible_by to a "
                              f"multiple of {self.tp}")
        if self.layers is not None and sum(self.layers) != spec.num_layers:
            raise ConfigError("layers", f"stage sizes {'+'.join(map(str, self.layers))} add up to "
                                        f"{sum(self.layers)}, the model has {spec.num_layers} layers",
                              "make the per-stage layer counts add up to num_layers")
        self.stage_layers(spec.num_layers)
        if self.cp > 1 and spec.max_sequence_length % (2 * self.cp):
            raise ConfigError("cp", f"max_sequence_length={spec.max_sequence_length} does not split into "
                                    f"2*cp={2 * self.cp} chunks", "use a cp with 2*cp dividing the sequence")
        if spec.is_moe:
            if spec.num_moe_experts % self.ep:
                raise ConfigError("ep", f"{spec.num_moe_experts} experts do not split over ep={self.ep}",
                                  f"use an ep that divides {spec.num_moe_experts}")
            if spec.moe_ffn_hidden_size % self.expert_tp:
                raise ConfigError("etp", f"moe_ffn_hidden_size={spec.moe_ffn_hidden_size} does not split "
                                         f"over etp={self.expert_tp}", "use an etp that divides it")
            if (spec.moe_shared_expert_intermediate_size
                    and spec.moe_shared_expert_intermediate_size % self.tp):
                raise ConfigError("tp", "moe_shared_expert_intermediate_size="
                                        f"{spec.moe_shared_expert_intermediate_size} does not split over "
                                        f"tp={self.tp}", "use a tp that divides it")
        elif self.ep > 1:
            raise ConfigError("ep", f"ep={self.ep} on a dense model", "use ep=1 (the model has no experts)")
        if self.dp_split is not None:
            self._validate_dp_split(spec)

    def _validate_dp_split(self, spec: ModelSpec) -> None:
        """Ranks that meet in a collective every micro-batch must run the same number of them."""
        split = "+".join(map(str, self.dp_split or ()))
        if self.cp > 1:
            # The trainer gives each of the dp*cp ranks its own share of samples; an uneven split
            # is defined per replica of dp, which that data path does not have.
            raise ConfigError("dp_split", f"dp_split={split} with cp={self.cp}", "use an even split with cp > 1")
        if spec.is_moe:
            # An expert-model-parallel group (the etp*ep ranks of a stage with one expert-DP
            # index) exchanges tokens every micro-batch; its ranks can sit in different replicas.
            counts: dict[int, set[int]] = {}
            for c in self._coords[:self.tp * self.cp * self.dp]:
                counts.setdefault(c.edp, set()).add(self.dp_split[c.dp])  # type: ignore[index]
            if any(len(v) > 1 for v in counts.values()):
                raise ConfigError("dp_split", f"dp_split={split} gives the ranks of one expert-parallel group "
                                              f"(etp*ep={self.expert_tp * self.ep}) different micro-batch counts",
                                  "give the replicas that share an expert-parallel group equal counts, or use ep=1")

    # ---- string form ------------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        parts.append(f"ep={self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp={self.etp}")
        if self.layers is not None:
            parts.append("layers=" + "+".join(map(str, self.layers)))
        if self.dp_split is not None:
            parts.append("dp_split=" + "+".join(map(str, self.dp_split)))
        if self.dist_opt:
            parts.append("dist_opt")
        if self.bucket_size is not None:
            parts.append(f"bucket={self.bucket_size}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> ParallelConfig:
        """Parse ``tp=8,pp=4,dp=8,ep=1,layers=20+20+21+19,dp_split=3+1+...,dist_opt``.

        ``dp`` may be left out when ``world_size`` is given; it is then derived.
        """
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("parallel", "empty parallel config", "write e.g. tp=2,pp=2,dp=2")
        ints = {"tp", "pp", "dp", "cp", "ep", "etp", "bucket_size"}
        values: dict[str, object] = {}
        for raw in text.replace(" ", "").split(","):
            if not raw:
                continue
            key, sep, val = raw.partition("=")
            key = {"expert_tp": "etp", "distributed_optimizer": "dist_opt", "bucket": "bucket_size"}.get(key, key)
            if key == "dist_opt" and (not sep or val.lower() in ("1", "true", "yes", "on")):
                values["dist_opt"] = True
            elif key == "dist_opt" and val.lower() in ("0", "false", "no", "off"):
                values["dist_opt"] = False
            elif key in ints and sep:
                try:
                    values[key] = int(val)
                except ValueError:
                    raise ConfigError(f"parallel.{key}", f"{short(val)} is not an integer") from None
            elif key in ("layers", "dp_split") and sep:
                try:
                    values[key] = tuple(int(x) for x in val.split("+"))
                except ValueError:
                    example = "layers=20+20+21+19" if key == "layers" else "dp_split=3+1"
                    raise ConfigError(f"parallel.{key}", f"{short(val)} is not a '+'-joined list of integers",
                                      f"write e.g. {example}") from None
            elif key == "order":
                if val != SUPPORTED_ORDER:
                    raise ConfigError("parallel.order", f"rank order {short(val)} is not supported",
                                      f"use {SUPPORTED_ORDER} (megatron-core's default)")
            else:
                raise ConfigError(f"parallel.{key}", f"unknown setting {short(raw)}",
                                  "use tp=, pp=, dp=, cp=, ep=, etp=, layers=A+B+..., dp_split=A+B+..., dist_opt, "
                                  "bucket=N")
        if "dp" not in values and world_size is not None:
            per_dp = int(values.get("tp", 1)) * int(values.get("pp", 1)) * int(values.get("cp", 1))
            if world_size % per_dp:
                raise ConfigError("parallel", f"world size {world_size} is not a multiple of tp*pp*cp={per_dp}")
            values["dp"] = world_size // per_dp
        cfg = cls(**values)  # type: ignore[arg-type]
        if world_size is not None and cfg.world_size != world_size:
            raise ConfigError("parallel", f"tp*pp*cp*dp={cfg.world_size} but the world has {world_size} ranks",
                              "make the product of the degrees equal the number of GPUs")
        return cfg


def _even_split_hint(num_layers: int, pp: int) -> str:
    base, extra = divmod(num_layers, pp)
    return "+".join(str(base + (1 if i >= pp - extra else 0)) for i in range(pp))
