"""The Virtual Parameter Space map: for (model spec, parallel config), where every piece lives.

``Layout(spec, cfg)`` answers, for every rank, which boxes of which logical tensors it holds,
for model weights and optimizer state, the way megatron-core's local-spec ``GPTModel`` and its
``DistributedDataParallel`` / ``DistributedOptimizer`` place them:

* keys and stacking follow ``GPTModel.sharded_state_dict()``: per-layer tensors get a leading
  global-layer axis, expert tensors a second (global expert) axis; layer norms use the
  TE-compatible keys (``...linear_qkv.layer_norm_weight``);
* SwiGLU ``linear_fc1`` is two boxes per TP rank (gate rows, up rows), GQA ``linear_qkv`` is
  split by query groups (contiguous rows), tied output weights on the last pipeline stage are a
  replica of ``embedding.word_embeddings.weight``;
* without the distributed optimizer every DP replica holds the optimizer state of its
  parameters; with it, each DP rank holds a contiguous 1/DP slice of every bucket of the
  gradient buffer (params reversed, 64-element aligned starts, buckets padded to lcm(DP, 128)),
  and those flat ranges are decomposed into boxes.

``tests/test_live_layout.py`` checks all of this region by region against live megatron models.
Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from liveshard.runtime.dtypes import itemsize
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.region import (
    EXP_AVG,
    EXP_AVG_SQ,
    MAIN_PARAM,
    PARAM,
    Region,
    Shape,
    flat_range_to_boxes,
    volume,
)

# Alignment rules of megatron-core's _ParamAndGradBuffer with the distributed optimizer.
PARAM_START_ALIGN = 64
BUCKET_ALIGN = 128


@dataclass(frozen=True)
class Piece:
    """One box of a local tensor: rows ``[local_row, local_row + shape[0])`` of the local tensor."""

    global_offset: Shape
    local_row: int


@dataclass(frozen=True)
class LocalParam:
    """A parameter as one rank holds it."""

    name: str  # megatron parameter name on this rank (local layer and expert numbering)
    key: str  # logical tensor (sharded_state_dict key)
    global_shape: Shape
    local_shape: Shape
    pieces: tuple[Piece, ...]
    replicated_in_tp: bool  # same values on every (expert-)TP rank
    expert: bool  # lives in the expert-parallel gradient buffer
    tied_copy: bool = False  # last-stage copy of tied word embeddings
    shared_embedding: bool = False  # megatron puts it in a bucket of its own (dist. optimizer)
    # The global axis split over (expert-)TP, None when every (expert-)TP rank holds the whole
    # tensor. Rank ``i`` of that split holds the pieces of rank 0 moved by ``i`` times a piece's
    # extent along it; ``vps.locate`` finds every holder of a box from this and rank 0's pieces.
    split_axis: int | None = None

    @property
    def numel(self) -> int:
        return volume(self.local_shape)

    @property
    def piece_rows(self) -> int:
        return self.local_shape[0] // len(self.pieces) if self.local_shape else 1


@dataclass(frozen=True)
class BufferParam:
    param: LocalParam
    start: int  # flat index of the parameter in its gradient buffer
    bucket: int


@dataclass(frozen=True)
class GradBuffer:
    """megatron-core's grouping of a rank's parameters into one contiguous gradient buffer."""

    params: tuple[BufferParam, ...]
    buckets: tuple[tuple[int, int], ...]  # (start, end) per bucket, padded
    dp_size: int

    def shard(self, bucket: int, dp_rank: int) -> tuple[int, int]:
        start, end = self.buckets[bucket]
        size = (end - start) // self.dp_size
        return start + dp_rank * size, start + (dp_rank + 1) * size


@dataclass(frozen=True)
class _ParamMaker:
    """Builds one rank's ``LocalParam``s: tensor parallelism of degree ``t``, this rank ``r`` of
    it (an expert's tensors pass the expert-TP degree and rank instead)."""

    spec: ModelSpec
    t: int
    r: int

    @property
    def norm_suffixes(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.spec.normalization == "LayerNorm" else ("weight",)

    def column(self, name: str, key: str, rows: int, cols: int | None, gshape_prefix: Shape = (),
               offset_prefix: Shape = (), *, t: int | None = None, r: int | None = None,
               expert: bool = False) -> LocalParam:
        """Column-parallel tensor (rows split over TP); ``cols=None`` for a bias."""
        t, r = t or self.t, self.r if r is None else r
        local = (rows // t,) if cols is None else (rows // t, cols)
        gshape = (*gshape_prefix, rows) if cols is None else (*gshape_prefix, rows, cols)
        off = (*offset_prefix, r * (rows // t)) + (() if cols is None else (0,))
        return LocalParam(name, key, gshape, local, (Piece(off, 0),), False, expert, split_axis=len(offset_prefix))

    def swiglu(self, name: str, key: str, ffn: int, cols: int | None, gshape_prefix: Shape = (),
               offset_prefix: Shape = (), *, t: int | None = None, r: int | None = None,
               expert: bool = False) -> LocalParam:
        """SwiGLU fc1: the local tensor is [gate rows; up rows], two boxes."""
        t, r = t or self.t, self.r if r is None else r
        part = ffn // t
        rows = 2 * ffn
        local = (2 * part,) if cols is None else (2 * part, cols)
        gshape = (*gshape_prefix, rows) if cols is None else (*gshape_prefix, rows, cols)
        tail = () if cols is None else (0,)
        pieces = (Piece((*offset_prefix, r * part, *tail), 0),
                  Piece((*offset_prefix, ffn + r * part, *tail), part))
        return LocalParam(name, key, gshape, local, pieces, False, expert, split_axis=len(offset_prefix))

    def row(self, name: str, key: str, rows: int, cols: int, gshape_prefix: Shape = (), offset_prefix: Shape = (),
            *, t: int | None = None, r: int | None = None, expert: bool = False) -> LocalParam:
        """Row-parallel weight (columns split over TP)."""
        t, r = t or self.t, self.r if r is None else r
        return LocalParam(name, key, (*gshape_prefix, rows, cols), (rows, cols // t),
                          (Piece((*offset_prefix, 0, r * (cols // t)), 0),), False, expert,
                          split_axis=len(offset_prefix) + 1)

    def replicated(self, name: str, key: str, shape: Shape, gshape_prefix: Shape = (), offset_prefix: Shape = (),
                   *, expert: bool = False) -> LocalParam:
        return LocalParam(name, key, (*gshape_prefix, *shape), shape,
                          (Piece((*offset_prefix,) + (0,) * len(shape), 0),), True, expert)

    def layer_norm(self, name: str, key: str, g: int) -> Iterator[LocalParam]:
        """A layer's norm: parameter ``{name}{weight,bias}``, logical ``decoder.layers.{key}{...}``."""
        for s in self.norm_suffixes:
            yield self.replicated(f"{name}{s}", f"decoder.layers.{key}{s}", (self.spec.hidden_size,),
                                  (self.spec.num_layers,), (g,))

    def mlp(self, prefix: str, key_prefix: str, ffn: int, gp: Shape, op: Shape, *, t: int | None = None,
            r: int | None = None, expert: bool = False) -> Iterator[LocalParam]:
        """An MLP's fc1 (SwiGLU's two boxes, or one column-parallel tensor) and fc2."""
        spec, h = self.spec, self.spec.hidden_size
        fc1 = self.swiglu if spec.gated_linear_unit else self.column
        yield fc1(f"{prefix}.linear_fc1.weight", f"{key_prefix}.linear_fc1.weight", ffn, h, gp, op, t=t, r=r,
                  expert=expert)
        if spec.add_bias_linear:
            yield fc1(f"{prefix}.linear_fc1.bias", f"{key_prefix}.linear_fc1.bias", ffn, None, gp, op, t=t, r=r,
                      expert=expert)
        yield self.row(f"{prefix}.linear_fc2.weight", f"{key_prefix}.linear_fc2.weight", h, ffn, gp, op, t=t, r=r,
                       expert=expert)
        if spec.add_bias_linear:
            yield self.replicated(f"{prefix}.linear_fc2.bias", f"{key_prefix}.linear_fc2.bias", (h,), gp, op,
                                  expert=expert)


class Layout:
    """Where every region of training state lives for one (model, parallel config)."""

    def __init__(self, spec: ModelSpec, cfg: ParallelConfig, *, validate: bool = True) -> None:
        if validate:
            cfg.validate(spec)
        self.spec = spec
        self.cfg = cfg
        self._stage_layers = cfg.stage_layers(spec.num_layers)
        self._stage_offsets = cfg.stage_offsets(spec.num_layers)
        self._params_cache: dict[tuple[int, int, int, int], tuple[LocalParam, ...]] = {}
        self._buffer_cache: dict[tuple, GradBuffer] = {}
        self.locate_index: Any = None  # its ``locate.LayoutIndex``, built on first use (``locate.index_of``)

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @cached_property
    def optimizer_states(self) -> tuple[str, ...]:
        # fp32 models: the optimizer steps the parameters themselves (no main copy).
        if self.spec.params_dtype == "fp32":
            return (EXP_AVG, EXP_AVG_SQ)
        return (MAIN_PARAM, EXP_AVG, EXP_AVG_SQ)

    @property
    def states(self) -> tuple[str, ...]:
        return (PARAM, *self.optimizer_states)

    def dtype(self, state: str) -> str:
        return self.spec.params_dtype if state == PARAM else "fp32"

    def itemsize(self, state: str) -> int:
        return itemsize(self.dtype(state))

    # ---- local parameters ------------------------------------------------------------------
    def local_params(self, rank: int) -> tuple[LocalParam, ...]:
        """The rank's parameters in megatron's registration order (``named_parameters()``)."""
        c = self.cfg.coord(rank)
        key = (c.pp, c.tp, c.ep, c.etp)
        cached = self._params_cache.get(key)
        if cached is None:
            cached = self._params_cache[key] = tuple(self._build_local_params(c.pp, c.tp, c.ep, c.etp))
        return cached

    def _build_local_params(self, pp: int, tp: int, ep: int, etp: int) -> Iterator[LocalParam]:
        cfg = self.cfg
        first, last = pp == 0, pp == cfg.pp - 1
        make = _ParamMaker(self.spec, cfg.tp, tp)
        if first:
            yield from self._embedding_params(make, last)
        for local_i in range(self._stage_layers[pp]):
            yield from self._layer_params(make, self._stage_offsets[pp] + local_i, local_i, ep, etp)
        if last:
            yield from self._output_params(make, first)

    def _embedding_params(self, make: _ParamMaker, last: bool) -> Iterator[LocalParam]:
        """The first stage's word (and learned position) embeddings."""
        spec, h = self.spec, self.spec.hidden_size
        emb = make.column("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
                          spec.padded_vocab_size, h)
        if not last and spec.share_embeddings_and_output_weights:
            emb = replace(emb, shared_embedding=True)
        yield emb
        if spec.position_embedding_type == "learned_absolute":
            yield make.replicated("embedding.position_embeddings.weight", "embedding.position_embeddings.weight",
                                  (spec.max_sequence_length, h))

    def _layer_params(self, make: _ParamMaker, g: int, local_i: int, ep: int, etp: int) -> Iterator[LocalParam]:
        """Global layer ``g`` (the stage's ``local_i``): attention, then a dense or MoE MLP."""
        spec, cfg, h = self.spec, self.cfg, self.spec.hidden_size
        L = spec.num_layers
        fused = spec.fused_layernorms
        p = f"decoder.layers.{local_i}"
        gp, op = (L,), (g,)
        qkv, fc1 = "self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_"

        if not fused:
            yield from make.layer_norm(f"{p}.input_layernorm.", qkv, g)
        yield make.row(f"{p}.self_attention.linear_proj.weight", "decoder.layers.self_attention.linear_proj.weight",
                       h, spec.query_projection_size, gp, op)
        if spec.add_bias_linear:
            yield make.replicated(f"{p}.self_attention.linear_proj.bias",
                                  "decoder.layers.self_attention.linear_proj.bias", (h,), gp, op)
        if fused:  # TransformerEngine's LayerNormLinear registers its norm before its weight
            yield from make.layer_norm(f"{p}.{qkv}", qkv, g)
        yield make.column(f"{p}.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.weight",
                          spec.qkv_rows, h, gp, op)
        if spec.add_bias_linear or spec.add_qkv_bias:
            yield make.column(f"{p}.self_attention.linear_qkv.bias", "decoder.layers.self_attention.linear_qkv.bias",
                              spec.qkv_rows, None, gp, op)
        if spec.qk_layernorm:
            for which in ("q", "k"):
                for s in make.norm_suffixes:
                    yield make.replicated(f"{p}.self_attention.{which}_layernorm.{s}",
                                          f"decoder.layers.self_attention.{which}_layernorm.{s}",
                                          (spec.kv_channels,), gp, op)
        dense = not spec.is_moe_layer(g)
        if fused and dense:
            yield from make.layer_norm(f"{p}.{fc1}", fc1, g)
        else:  # TransformerEngine's MoE layer keeps a separate norm, under its own key
            yield from make.layer_norm(f"{p}.pre_mlp_layernorm.", "pre_mlp_layernorm." if fused else fc1, g)
        if dense:
            yield from make.mlp(f"{p}.mlp", "decoder.layers.mlp", spec.ffn_hidden_size, gp, op)
            return
        n_experts = spec.num_moe_experts or 0
        local_experts = n_experts // cfg.ep if n_experts else 0
        yield make.replicated(f"{p}.mlp.router.weight", "decoder.layers.mlp.router.weight", (n_experts, h), gp, op)
        for e in range(local_experts):
            ge = ep * local_experts + e
            yield from make.mlp(f"{p}.mlp.experts.local_experts.{e}", "decoder.layers.mlp.experts.experts",
                                spec.moe_ffn_hidden_size, (L, n_experts), (g, ge),
                                t=cfg.expert_tp, r=etp, expert=True)
        if spec.moe_shared_expert_intermediate_size:
            yield from make.mlp(f"{p}.mlp.shared_experts", "decoder.layers.mlp.shared_experts",
                                spec.moe_shared_expert_intermediate_size, gp, op)

    def _output_params(self, make: _ParamMaker, first: bool) -> Iterator[LocalParam]:
        """The last stage's final norm and output layer (a tied copy of the word embeddings)."""
        spec, h = self.spec, self.spec.hidden_size
        for s in make.norm_suffixes:
            yield make.replicated(f"decoder.final_layernorm.{s}", f"decoder.final_layernorm.{s}", (h,))
        if not spec.share_embeddings_and_output_weights:
            yield make.column("output_layer.weight", "output_layer.weight", spec.padded_vocab_size, h)
        elif not first:
            base = make.column("output_layer.weight", "embedding.word_embeddings.weight", spec.padded_vocab_size, h)
            yield replace(base, tied_copy=True, shared_embedding=True)

    # ---- regions ----------------------------------------------------------------------------
    def param_primary(self, rank: int, p: LocalParam) -> bool:
        c = self.cfg.coord(rank)
        if p.tied_copy:
            return False
        if p.expert:
            return c.edp == 0 and (not p.replicated_in_tp or c.etp == 0)
        dp_cp = c.cp + self.cfg.cp * c.dp
        return dp_cp == 0 and (not p.replicated_in_tp or c.tp == 0)

    def param_regions(self, rank: int, state: str = PARAM) -> Iterator[Region]:
        """Whole local tensors: model weights, or non-distributed optimizer state."""
        for p in self.local_params(rank):
            primary = self.param_primary(rank, p)
            box = (p.piece_rows, *p.local_shape[1:])
            for piece in p.pieces:
                yield Region(rank, p.key, state, p.global_shape, piece.global_offset, box, primary,
                             p.name, (piece.local_row,) + (0,) * (len(box) - 1))

    def buffers(self, rank: int) -> tuple[GradBuffer, ...]:
        """The rank's gradient buffers: dense first, then expert-parallel (if any)."""
        c = self.cfg.coord(rank)
        out = []
        for expert in (False, True):
            cache_key = (c.pp, c.tp, c.ep, c.etp, expert)
            buf = self._buffer_cache.get(cache_key)
            if buf is None:
                params = [p for p in self.local_params(rank) if p.expert == expert]
                if not params:
                    continue
                dp_size = self.cfg.expert_dp if expert else self.cfg.dp * self.cfg.cp
                bucket_size = self.cfg.bucket_size if c.pp == 0 else None
                buf = self._buffer_cache[cache_key] = build_grad_buffer(
                    params, dp_size, bucket_size, self.cfg.dist_opt)
            out.append(buf)
        return tuple(out)

    def dist_opt_regions(self, rank: int, state: str) -> Iterator[Region]:
        """This DP rank's shard of the distributed optimizer, as boxes."""
        c = self.cfg.coord(rank)
        for buf in self.buffers(rank):
            dp_rank = c.edp if buf.params[0].param.expert else c.cp + self.cfg.cp * c.dp
            shards = [buf.shard(b, dp_rank) for b in range(len(buf.buckets))]
            for bp in buf.params:
                p = bp.param
                lo, hi = shards[bp.bucket]
                start = max(lo, bp.start)
                stop = min(hi, bp.start + p.numel)
                if start >= stop:
                    continue
                primary = not p.tied_copy and (not p.replicated_in_tp or
                                               (c.etp if p.expert else c.tp) == 0)
                yield from flat_regions(rank, state, p, start - bp.start, stop - bp.start, primary)

    def regions(self, rank: int, states: tuple[str, ...] | None = None) -> Iterator[Region]:
        for state in self.states if states is None else states:
            if state == PARAM or not self.cfg.dist_opt:
                yield from self.param_regions(rank, state)
            else:
                yield from self.dist_opt_regions(rank, state)

    def all_regions(self, states: tuple[str, ...] | None = None) -> Iterator[Region]:
        for rank in range(self.world_size):
            yield from self.regions(rank, states)

    # ---- totals -----------------------------------------------------------------------------
    def logical_tensors(self) -> dict[tuple[str, str], Shape]:
        """Every (key, state) with its global shape."""
        shapes: dict[str, Shape] = {}
        for pp in range(self.cfg.pp):
            for p in self.local_params(self.cfg.rank_of(pp=pp)):
                shapes[p.key] = p.global_shape
        return {(k, s): shape for k, shape in shapes.items() for s in self.states}

    def state_bytes(self) -> int:
        """Bytes of all logical training state (each element once)."""
        return sum(volume(shape) * self.itemsize(state)
                   for (_, state), shape in self.logical_tensors().items())

    def rank_bytes(self, rank: int) -> int:
        return sum(r.numel * self.itemsize(r.state) for r in self.regions(rank))


def build_grad_buffer(params: list[LocalParam], dp_size: int, bucket_size: int | None,
                      dist_opt: bool) -> GradBuffer:
    """megatron-core ``_ParamAndGradBuffer`` index arithmetic (params walked in reverse)."""

    def pad_param_start(i: int) -> int:
        return _round_up(i, PARAM_START_ALIGN) if dist_opt else i

    def pad_bucket_end(i: int) -> int:
        return _round_up(i, math.lcm(dp_size, BUCKET_ALIGN)) if dist_opt else i

    out: list[BufferParam] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = 0
    start = 0
    n_in_bucket = 0
    end = 0

    def close_bucket(end_index: int) -> int:
        nonlocal bucket_start, n_in_bucket
        padded = pad_bucket_end(end_index)
        buckets.append((bucket_start, padded))
        bucket_start = padded
        n_in_bucket = 0
        return padded

    for p in reversed(params):
        start = pad_param_start(start)
        own_bucket = p.shared_embedding and dist_opt
        if own_bucket and n_in_bucket:
            start = close_bucket(start)
        end = start + p.numel
        out.append(BufferParam(p, start, len(buckets)))
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close_bucket(end)
        else:
            start = end
    if n_in_bucket:
        close_bucket(end)
    return GradBuffer(tuple(out), tuple(buckets), dp_size)


def flat_regions(rank: int, state: str, p: LocalParam, start: int, stop: int,
                  primary: bool) -> Iterator[Region]:
    """Boxes of the flat range ``[start, stop)`` of a local parameter, split at its pieces."""
    rows = p.piece_rows
    inner = volume(p.local_shape[1:]) if len(p.local_shape) > 1 else 1
    piece_numel = rows * inner
    piece_shape = (rows, *p.local_shape[1:])
    for i, piece in enumerate(p.pieces):
        lo = max(start, i * piece_numel)
        hi = min(stop, (i + 1) * piece_numel)
        if lo >= hi:
            continue
        prepend = piece.global_offset[: len(p.global_shape) - len(p.local_shape)]
        base = piece.global_offset[len(prepend):]
        for off, shape in flat_range_to_boxes(piece_shape, lo - i * piece_numel, hi - i * piece_numel):
            flat_in_param = i * piece_numel + _flat_index(piece_shape, off)
            goff = (*prepend, *(b + o for b, o in zip(base, off)))
            yield Region(rank, p.key, state, p.global_shape, goff, shape, primary, p.name,
                         (flat_in_param - start,))


def _flat_index(shape: Shape, index: Shape) -> int:
    flat = 0
    for s, i in zip(shape, index):
        flat = flat * s + i
    return flat


def _round_up(n: int, d: int) -> int:
    return -(-n // d) * d
