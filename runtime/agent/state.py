"""A rank's training state as named tensors, for the transfer executor.

``state_tensors(built)`` maps ``(state, local_name)`` to the live tensor that holds it in a
megatron model: the parameter itself for ``param``; for optimizer state the full-shape fp32 main
copy / Adam moment, or, with the distributed optimizer, this DP rank's flat shard of them. The
keys are exactly the ``(region.state, region.local_name)`` pairs of the rank's layout, so the
executor can read any region in place, and ``load_state`` copies the tensors a transition
delivered into a freshly built model at commit.

Small state travels as objects: the training progress (step, data cursor, LR schedule) and RNG
states, which follow the model-parallel position (tp, pp) they belong to.
"""

from __future__ import annotations

import contextlib
import random
from collections import defaultdict
from typing import Any

import torch

from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import EXP_AVG, EXP_AVG_SQ, MAIN_PARAM, PARAM

StateKey = tuple[str, str]  # (state, local_name)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def ensure_adam_state(optimizer: Any) -> None:
    """Create Adam's moments for parameters that have not stepped yet (a fresh optimizer)."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def set_adam_step(optimizer: Any, step: int) -> None:
    """Give every parameter its own step counter (Adam's bias correction reads it)."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(step))


def _optimizer_slots(built: Any):
    """(local name, torch optimizer, main param, flat) for every parameter the optimizers step.

    ``flat``: the distributed optimizer's shard of the parameter (1-D), else the whole tensor.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = {id(p): n for n, p in built.model.named_parameters()}
    for opt in _inner_optimizers(built.optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        flat = isinstance(opt, DistributedOptimizer)
        if flat:
            pairs = [(m, inner.param_groups[gi]["params"][go])
                     for m, (gi, go) in opt.model_param_group_index_map.items()]
        elif hasattr(opt, "float16_groups"):
            pairs = [(m, main) for g16, g32 in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                     for m, main in zip(g16, g32)]
            pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
        else:
            pairs = [(p, p) for group in inner.param_groups for p in group["params"]]
        for model_param, main in pairs:
            yield names[id(model_param)], inner, main, flat


def state_tensors(built: Any) -> dict[StateKey, torch.Tensor]:
    """Every ``(state, local_name)`` of a live model, mapped to the tensor that holds it."""
    ensure_adam_state(built.optimizer)
    out: dict[StateKey, torch.Tensor] = {(PARAM, n): p.data for n, p in built.model.named_parameters()}
    sixteen_bit = built.spec.params_dtype != "fp32"
    for name, inner, main, flat in _optimizer_slots(built):
        if sixteen_bit:
            out[MAIN_PARAM, name] = main.data.view(-1) if flat else main.data
        st = inner.state[main]
        for state in (EXP_AVG, EXP_AVG_SQ):
            out[state, name] = st[state].view(-1) if flat else st[state]
    return out


def load_state(built: Any, tensors: dict[StateKey, torch.Tensor], step: int) -> None:
    """Put received tensors into a freshly built model and optimizer.

    Weights and fp32 main weights become the received tensors themselves when the model keeps
    them in storage of their own, and are copied into DDP's buffers when it does not (the
    distributed optimizer); Adam moments are adopted as they are, with no zero-fill and no copy.
    """
    params = dict(built.model.named_parameters())
    slots = list(_optimizer_slots(built))
    sixteen_bit = built.spec.params_dtype != "fp32"
    expected = {(PARAM, n) for n in params}
    for name, _, _, _ in slots:
        expected |= {(EXP_AVG, name), (EXP_AVG_SQ, name)} | ({(MAIN_PARAM, name)} if sixteen_bit else set())
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise RuntimeError(f"received state does not match the built model: missing {missing[:3]}, "
                           f"unexpected {extra[:3]}")

    def check(key: StateKey, src: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        if src.numel() != numel or src.dtype != dtype:
            raise RuntimeError(f"{key}: received {src.dtype} x {src.numel()}, the model holds {dtype} x {numel}")

    with torch.no_grad():
        for name, p in params.items():
            src = tensors[PARAM, name]
            check((PARAM, name), src, p.numel(), p.dtype)
            _adopt_or_copy(p, src)
        for name, inner, main, _ in slots:
            if sixteen_bit:
                src = tensors[MAIN_PARAM, name]
                check((MAIN_PARAM, name), src, main.numel(), main.dtype)
                _adopt_or_copy(main, src)
            st = inner.state[main]
            for state in (EXP_AVG, EXP_AVG_SQ):
                src = tensors[state, name]
                check((state, name), src, main.numel(), torch.float32)
                st[state] = src.view_as(main.data) if src.is_contiguous() else src.reshape(main.shape).clone()
            st["step"] = torch.tensor(float(step))


def _owns_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def _adopt_or_copy(param: torch.Tensor, src: torch.Tensor) -> None:
    """Make ``src`` the parameter's storage when the parameter owns its own (not a view into a
    DDP buffer, as with the distributed optimizer) and ``src`` is a whole tensor of its own (the
    old tensor kept in place, or a fresh one the transfer filled); otherwise copy into it."""
    if _owns_storage(param.data) and _owns_storage(src) and src.device == param.device:
        param.data = src.view_as(param.data)
    else:
        param.data.copy_(src.view_as(param.data))


# ---- small objects -----------------------------------------------------------------------------
def capture_rng() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    with contextlib.suppress(Exception):  # tracker not initialised on this rank
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def region_view(tensors: dict[StateKey, torch.Tensor], region: Any) -> torch.Tensor:
    """The elements of ``region`` inside its local tensor, shaped like ``region.local_shape``."""
    t = tensors[region.state, region.local_name]
    shape = region.local_shape
    if t.dim() == 1 and len(shape) != 1:  # a flat distributed-optimizer shard
        start = region.local_offset[0]
        return t[start: start + _numel(shape)].view(shape)
    index = tuple(slice(o, o + s) for o, s in zip(region.local_offset, shape))
    return t[index]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_MIX_VALUE = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX_INDEX = -4417276706812531889  # 0xC2B2AE3D27D4EB4F as int64


def logical_checksums(layout: Layout, rank: int, tensors: dict[StateKey, torch.Tensor]) -> dict[str, int]:
    """Layout-independent checksums: per ``key/state``, the sum over this rank's primary
    elements of a mix of (global flat index, value bits), modulo 2**64.

    Summing every rank's partial sums gives the same number for the same logical tensor however
    it is sharded, so two runs that end in different layouts can still be compared exactly.
    """
    out: dict[str, int] = defaultdict(int)
    for reg in layout.regions(rank):
        if not reg.primary:
            continue
        # on the host: the indices are built there, and a GPU's copy is one small transfer
        values = region_view(tensors, reg).detach().to("cpu").contiguous()
        bits = values.view(torch.int16 if values.element_size() == 2 else torch.int32).to(torch.int64)
        idx = torch.zeros(reg.box_shape, dtype=torch.int64)
        stride = 1
        for d in range(len(reg.global_shape) - 1, -1, -1):
            ar = torch.arange(reg.global_offset[d], reg.global_offset[d] + reg.box_shape[d], dtype=torch.int64)
            view = [1] * len(reg.global_shape)
            view[d] = -1
            idx = idx + (ar * stride).view(view)
            stride *= reg.global_shape[d]
        mixed = (bits.reshape(-1) * _MIX_VALUE) ^ (idx.reshape(-1) * _MIX_INDEX)
        mixed = mixed ^ (mixed >> 29)
        out[f"{reg.key}/{reg.state}"] = (out[f"{reg.key}/{reg.state}"] + int(mixed.sum())) % 2**64
    return dict(out)
