"""The live side of the Virtual Parameter Space: a rank's regions read from a running model.

Everything here is read from megatron-core's own objects, never re-derived:

* model weights from ``GPTModel.sharded_state_dict()``: key, global shape/offset and local
  shape straight from each ``ShardedTensor`` (``ShardedTensorFactory`` objects such as the
  SwiGLU ``linear_fc1`` are built, giving one box per gate/up slice); the local tensor is found
  by memory address among ``model.named_parameters()``, and the box's start inside it from the
  view's offset;
* optimizer state without the distributed optimizer: the parameters each megatron optimizer
  manages (and their fp32 main copies), one region per weight box and state;
* with the distributed optimizer: the ranges megatron computed for this DP rank
  (``gbuf_ranges[...]["param_map"][param]["param"]``), cross-checked against the grad
  buffer's ``param_index_map`` and the optimizer's shard tensors, decomposed into boxes.

The result has the format of the pure ``Layout(spec, cfg).regions(rank)``;
``tests/test_live_layout.py`` compares the two region by region.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

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


@dataclass(frozen=True)
class ParamBox:
    """One box of a logical tensor held in a local parameter (one ShardedTensor)."""

    name: str  # parameter name in GPTModel.named_parameters()
    param: torch.nn.Parameter
    key: str
    global_shape: Shape
    global_offset: Shape
    local_shape: Shape
    replica_id: tuple[int, ...]
    local_offset: Shape  # start of the box inside the local parameter

    @property
    def primary(self) -> bool:
        """The copy a checkpoint would save: every replica index is 0."""
        return all(r == 0 for r in self.replica_id)

    @property
    def primary_ignoring_dp(self) -> bool:
        """Primary among model-parallel replicas (the last replica axis is data-parallel)."""
        return all(r == 0 for r in self.replica_id[:-1])


def param_boxes(model: torch.nn.Module) -> list[ParamBox]:
    """The boxes of every parameter of a ``GPTModel`` (not its DDP wrapper), in state-dict order."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    locator = _ParamLocator(model)
    out: list[ParamBox] = []
    for item in _leaves(model.sharded_state_dict()):
        if isinstance(item, ShardedTensorFactory):
            tensors = list(_leaves(item.build()))
        elif isinstance(item, ShardedTensor):
            tensors = [item]
        else:  # ShardedObject (extra state), plain values
            continue
        for sh in tensors:
            if not isinstance(sh, ShardedTensor):
                continue
            if sh.flattened_range is not None:
                raise ValueError(f"{sh.key}: flattened ShardedTensors are not expected in a model state dict")
            name, param, local_offset = locator.find(sh.data)
            replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
            out.append(ParamBox(name, param, sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                                tuple(sh.local_shape), tuple(int(r) for r in replica), local_offset))
    covered = Counter()
    for b in out:
        covered[b.name] += volume(b.local_shape)
    for name, p in model.named_parameters():
        if covered[name] != p.numel():
            raise ValueError(f"{name}: the sharded_state_dict covers {covered[name]} of its {p.numel()} elements")
    return out


def param_regions(boxes: Iterable[ParamBox], rank: int, state: str = PARAM) -> list[Region]:
    """Whole-box regions: model weights, or non-distributed optimizer state of the same shape."""
    return [Region(rank, b.key, state, b.global_shape, b.global_offset, b.local_shape, b.primary,
                   b.name, b.local_offset) for b in boxes]


def optimizer_regions(boxes: list[ParamBox], optimizer: Any, rank: int) -> list[Region]:
    """Regions of the optimizer state (fp32 main params, Adam moments) on this rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    by_param: dict[int, list[ParamBox]] = {}
    for b in boxes:
        by_param.setdefault(id(b.param), []).append(b)
    out: list[Region] = []
    for opt in _chained(optimizer):
        if isinstance(opt, DistributedOptimizer):
            out.extend(_dist_opt_regions(opt, by_param, rank))
        else:
            out.extend(_replicated_opt_regions(opt, by_param, rank))
    return out


@dataclass(frozen=True)
class LiveBuffer:
    """One megatron grad buffer (``_ParamAndGradBuffer``) of a rank, by element index."""

    expert: bool  # the expert-parallel buffer (reduced over the expert-data-parallel group)
    dp_size: int
    buckets: tuple[tuple[int, int], ...]  # (start, end) of each bucket, padding included
    params: tuple[tuple[str, int, int], ...]  # (parameter name, start, bucket), in buffer order


def grad_buffers(built: Any) -> list[LiveBuffer]:
    """The rank's DDP grad buffers: dense first, then expert-parallel (as ``Layout.buffers``)."""
    names = {id(p): n for n, p in built.model.named_parameters()}
    out = []
    for expert, buffers in ((False, built.ddp.buffers),
                            (True, getattr(built.ddp, "expert_parallel_buffers", []))):
        for buf in buffers:
            buckets = tuple((b.offset, b.offset + b.grad_data.numel()) for b in buf.buckets)
            params = tuple(sorted(((names[id(p)], start, bucket)
                                   for p, (start, _, bucket) in buf.param_index_map.items()),
                                  key=lambda t: t[1]))
            out.append(LiveBuffer(expert, buf.data_parallel_group.size(), buckets, params))
    return out


def live_regions(built: Any, rank: int | None = None) -> list[Region]:
    """All regions of a ``BuiltModel`` (weights and optimizer state) on this rank."""
    rank = built.rank if rank is None else rank
    boxes = param_boxes(built.model)
    return param_regions(boxes, rank) + optimizer_regions(boxes, built.optimizer, rank)


# ---- optimizer state ---------------------------------------------------------------------------
def _states_for(model_param: torch.Tensor) -> tuple[str, ...]:
    # 16-bit weights get an fp32 main copy in the optimizer; fp32 weights are stepped in place.
    if model_param.dtype in (torch.float16, torch.bfloat16):
        return (MAIN_PARAM, EXP_AVG, EXP_AVG_SQ)
    return (EXP_AVG, EXP_AVG_SQ)


def _replicated_opt_regions(opt: Any, by_param: dict[int, list[ParamBox]], rank: int) -> Iterator[Region]:
    """Float16OptimizerWithFloat16Params / FP32Optimizer: state of whole local parameters."""
    if getattr(opt, "optimizer", None) is None:
        return
    if hasattr(opt, "float16_groups"):
        pairs = [(m, main) for g16, g32 in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                 for m, main in zip(g16, g32)]
        pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
    else:
        pairs = [(p, p) for group in opt.optimizer.param_groups for p in group["params"]]
    for model_param, main in pairs:
        boxes = by_param.get(id(model_param))
        if not boxes:
            raise ValueError(f"optimizer parameter of shape {tuple(model_param.shape)} is not in the "
                             "model's sharded_state_dict")
        if main.shape != model_param.shape:
            raise ValueError(f"{boxes[0].name}: main param {tuple(main.shape)} differs from "
                             f"{tuple(model_param.shape)}")
        for state in _states_for(model_param):
            _check_state_numel(opt.optimizer, main, state, main.numel(), boxes[0].name)
            yield from param_regions(boxes, rank, state)


def _dist_opt_regions(opt: Any, by_param: dict[int, list[ParamBox]], rank: int) -> Iterator[Region]:
    """DistributedOptimizer: this DP rank's flat range of each parameter, as boxes."""
    for gbuf_index, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buffer = opt.buffers[gbuf_index]
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                for model_param, ranges in bucket_map["param_map"].items():
                    boxes = by_param.get(id(model_param))
                    if not boxes:
                        raise ValueError(f"distributed-optimizer parameter of shape "
                                         f"{tuple(model_param.shape)} is not in the model's sharded_state_dict")
                    owned = ranges["param"]
                    world_start, _, _ = buffer.param_index_map[model_param]
                    if ranges["gbuf_world"].start - world_start != owned.start:
                        raise ValueError(f"{boxes[0].name}: buffer range and param range disagree")
                    group_index, group_order = opt.model_param_group_index_map[model_param]
                    shard = opt.optimizer.param_groups[group_index]["params"][group_order]
                    if shard.numel() != owned.size:
                        raise ValueError(f"{boxes[0].name}: optimizer shard has {shard.numel()} elements, "
                                         f"the range {owned.size}")
                    primary = all(b.primary_ignoring_dp for b in boxes)
                    for state in _states_for(model_param):
                        _check_state_numel(opt.optimizer, shard, state, owned.size, boxes[0].name)
                        yield from _flat_range_regions(boxes, rank, state, owned.start, owned.end,
                                                       primary)


def _flat_range_regions(boxes: list[ParamBox], rank: int, state: str, start: int, stop: int,
                        primary: bool) -> Iterator[Region]:
    """The flat range ``[start, stop)`` of a local parameter, cut into boxes per ParamBox."""
    param_shape = tuple(boxes[0].param.shape)
    inner = volume(param_shape[1:]) if len(param_shape) > 1 else 1
    for b in boxes:
        # A box is a block of whole rows of its parameter (TP splits and SwiGLU halves are).
        if b.local_shape[1:] != param_shape[1:] or any(b.local_offset[1:]):
            raise ValueError(f"{b.name}: box {b.local_shape} at {b.local_offset} is not a block of rows")
        span_start = b.local_offset[0] * inner if param_shape else 0
        span_stop = span_start + volume(b.local_shape)
        lo, hi = max(start, span_start), min(stop, span_stop)
        if lo >= hi:
            continue
        prepend = len(b.global_shape) - len(b.local_shape)
        for off, shape in flat_range_to_boxes(b.local_shape, lo - span_start, hi - span_start):
            goff = (*b.global_offset[:prepend],
                    *(g + o for g, o in zip(b.global_offset[prepend:], off)))
            flat_in_param = span_start + _flat_index(b.local_shape, off)
            yield Region(rank, b.key, state, b.global_shape, goff, shape, primary, b.name,
                         (flat_in_param - start,))


def _check_state_numel(inner: Any, main: torch.Tensor, state: str, numel: int, name: str) -> None:
    """Where the Adam state exists already (after a step), it must match the layout."""
    if state == MAIN_PARAM:
        if main.numel() != numel or main.dtype != torch.float32:
            raise ValueError(f"{name}: main param is {main.dtype} x {main.numel()}, expected fp32 x {numel}")
        return
    tensor = inner.state.get(main, {}).get(state)
    if tensor is not None and tensor.numel() != numel:
        raise ValueError(f"{name}: {state} has {tensor.numel()} elements, expected {numel}")


# ---- helpers -----------------------------------------------------------------------------------
def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _flat_index(shape: Shape, index: Shape) -> int:
    flat = 0
    for s, i in zip(shape, index):
        flat = flat * s + i
    return flat


class _ParamLocator:
    """Finds the parameter a tensor views, and where the view starts inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._spans = []
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if not p.is_contiguous():
                raise ValueError(f"{name} is not contiguous")
            start = p.data_ptr()
            self._spans.append((start, start + p.numel() * p.element_size(), name, p))

    def find(self, tensor: torch.Tensor) -> tuple[str, torch.nn.Parameter, Shape]:
        ptr = tensor.data_ptr()
        for start, stop, name, p in self._spans:
            if start <= ptr < stop and tensor.dtype == p.dtype:
                flat, rem = divmod(ptr - start, p.element_size())
                if rem or ptr + tensor.numel() * tensor.element_size() > stop:
                    break
                return name, p, _unravel(flat, tuple(p.shape))
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} is not a view of any model parameter")


def _unravel(flat: int, shape: Shape) -> Shape:
    out = []
    for s in reversed(shape):
        flat, i = divmod(flat, s)
        out.append(i)
    return tuple(reversed(out))


__all__ = ["LiveBuffer", "ParamBox", "grad_buffers", "live_regions", "optimizer_regions", "param_boxes", "param_regions"]
