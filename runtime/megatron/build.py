"""Build a live megatron-core GPT model, DDP wrapper and optimizer from (ModelSpec, ParallelConfig).

The same processes can tear a model down and build another one under a different parallel
config (``destroy()`` then ``build_model()``): that is how a worker switches parallelism live.
``torch.distributed`` must already be initialised with one rank per ``cfg.world_size``; the
model-parallel groups are made on it with megatron's rank order ``tp-cp-ep-dp-pp``.

On a CPU-only torch (gloo) ``compat.install()`` is applied first; models are then initialised
on the CPU (``use_cpu_initialization``), which also makes the initial weights independent of
the tensor-parallel degree (each rank slices the same full master weight).
"""

from __future__ import annotations

import math
import random
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.megatron import compat
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

# ModelSpec fields that are TransformerConfig fields of the same name.
_TRANSFORMER_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
    "kv_channels", "gated_linear_unit", "normalization", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_router_topk", "layernorm_epsilon", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
)

# Process groups created by the last init_parallel(); destroy() frees them (megatron's own
# destroy_model_parallel() frees only its gloo data-parallel groups).
_groups: list[Any] = []


@dataclass
class BuiltModel:
    """One rank's live model: the GPTModel, its DDP wrapper and the megatron optimizer."""

    spec: ModelSpec
    cfg: ParallelConfig
    config: Any  # megatron TransformerConfig
    model: Any  # GPTModel: sharded_state_dict() and parameter names live here
    ddp: Any  # DistributedDataParallel around model (through Float16Module for 16-bit params)
    optimizer: Any  # megatron ChainedOptimizer (dense, then expert-parallel)
    seed: int
    pre_process: bool
    post_process: bool

    @property
    def chunks(self) -> list[Any]:
        """Model chunks as megatron's schedules and ``finalize_model_grads`` take them."""
        return [self.ddp]

    @property
    def rank(self) -> int:
        return dist.get_rank()


def init_parallel(cfg: ParallelConfig, ahead: Any = None, timeout: float | None = None,
                  members_only: bool = False) -> None:
    """Create megatron's model-parallel groups for ``cfg`` on the initialised default group;
    groups whose communicators were built ahead (``comms.world.WorldAhead``) get those.
    ``timeout``: seconds a collective of every group waits for a peer (the job's collective
    timeout; None: megatron's own default, 30 minutes), as ``group_requests`` must be given too.
    ``members_only`` (without ``ahead``): each group is made by its members only
    (``comms.groups``: one split per kind of group on an eagerly initialised NCCL world, instead
    of one per group on every rank); a shrink asks for it, where the world is eager by need."""
    from megatron.core import parallel_state

    from liveshard.runtime.comms import groups as member_groups
    from liveshard.runtime.comms import world as worlds

    if not dist.is_initialized():
        raise ConfigError("torch.distributed", "is not initialised",
                          "call torch.distributed.init_process_group before building a model")
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise ConfigError("parallel", f"config {cfg} needs {cfg.world_size} ranks, the process group "
                                      f"has {world}", "make tp*pp*cp*dp equal the world size")
    if parallel_state.model_parallel_is_initialized():
        destroy()
    members = None
    if members_only and ahead is None:
        rank = dist.get_rank()
        members = member_groups.MembersOnly(group_requests(cfg, rank, timeout), rank)
    # the groups' connections are the world's: cut off with it when it loses a member
    with worlds.noting_world_connections(), _recording_new_groups(ahead, timeout, members) as created:
        parallel_state.initialize_model_parallel(**_model_parallel_args(cfg, timeout))
    _groups[:] = created


def _model_parallel_args(cfg: ParallelConfig, timeout: float | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"tensor_model_parallel_size": cfg.tp, "pipeline_model_parallel_size": cfg.pp,
                            "context_parallel_size": cfg.cp, "expert_model_parallel_size": cfg.ep,
                            "expert_tensor_parallel_size": cfg.expert_tp, "order": "tp-cp-ep-dp-pp"}
    if timeout is not None:
        # megatron gives every group it makes this timeout (30 minutes unless told): a survivor
        # blocked in a collective with a lost peer would wait that long
        args["distributed_timeout_minutes"] = timeout / 60.0
    return args


def group_requests(cfg: ParallelConfig, rank: int, timeout: float | None = None) -> list[Any]:
    """The process groups megatron's ``initialize_model_parallel`` asks for under ``cfg``, in its
    order (``comms.world.GroupRequest``), as rank ``rank`` sees them: no process group is made and
    no parallel state changes (the previous world may be training meanwhile). ``timeout``: as
    ``init_parallel`` will be given it (each request carries the timeout megatron asks for).

    megatron's own function runs on a private copy of its module, whose ``torch.distributed``
    answers the new world's size and rank and records ``new_group`` calls, so the list is exactly
    what building the world will ask for."""
    import importlib.util

    from megatron.core import parallel_state

    from liveshard.runtime.comms.world import GroupRequest

    requests: list[GroupRequest] = []

    class _Recorder:
        """megatron's view of torch.distributed during the probe: the new world's size and rank,
        recorded group requests, types; anything else (a collective on the live world, from
        this thread) raises."""

        GroupMember = dist.GroupMember
        ProcessGroupNCCL = getattr(dist, "ProcessGroupNCCL", None)

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"megatron's group set-up called torch.distributed.{name}, which the "
                               "group probe does not provide")

        def get_world_size(self, group: Any = None) -> int:
            return cfg.world_size

        def get_rank(self, group: Any = None) -> int:
            return rank

        def is_initialized(self) -> bool:
            return True

        def new_group(self, ranks: Any = None, backend: Any = None, **kwargs: Any) -> Any:
            requests.append(GroupRequest.asked(ranks, backend, kwargs))
            return object() if rank in ranks else dist.GroupMember.NON_GROUP_MEMBER

    class _Torch:
        distributed = _Recorder()

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    spec = importlib.util.spec_from_file_location(f"{parallel_state.__package__}._liveshard_group_probe",
                                                  parallel_state.__file__)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    probe.torch = _Torch()  # type: ignore[attr-defined]
    probe.initialize_model_parallel(**_model_parallel_args(cfg, timeout))
    return requests


def transformer_config(spec: ModelSpec, cfg: ParallelConfig, **overrides: Any) -> Any:
    """The megatron ``TransformerConfig`` for ``spec`` under ``cfg``."""
    spec.require_supported()
    cfg.validate(spec)
    if cfg.cp > 1 and not torch.cuda.is_available():
        raise ConfigError("cp", "context parallelism needs TransformerEngine attention (GPU only)",
                          "use cp=1 on CPU")
    if spec.is_moe and max(cfg.tp, cfg.expert_tp) > 1 and not torch.cuda.is_available():
        raise ConfigError("tp" if cfg.tp > 1 else "etp",
                          "MoE with tensor parallelism needs sequence parallelism, whose norms need "
                          "Apex or TransformerEngine (GPU only)", "use tp=1 and etp=1 for MoE on CPU")
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = {name: getattr(spec, name) for name in _TRANSFORMER_FIELDS}
    dtype = torch_dtype(spec.params_dtype)
    kwargs.update(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
        sequence_parallel=spec.is_moe and cfg.tp > 1,  # megatron requires it for MoE with TP
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.params_dtype == "bf16",
        fp16=spec.params_dtype == "fp16",
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
    )
    if spec.gated_linear_unit:
        kwargs["activation_func"] = torch.nn.functional.silu  # SwiGLU
    if spec.is_moe:
        # "alltoall" needs CUDA streams; "allgather" is the dispatcher that runs everywhere.
        kwargs["moe_token_dispatcher_type"] = ("alltoall" if torch.cuda.is_available()
                                               else "allgather")
    stages = cfg.stage_layers(spec.num_layers)
    if cfg.pp > 1 and len(set(stages)) > 1:
        # An arbitrary per-stage split: embedding on the first stage, loss on the last.
        layout = [["decoder"] * n for n in stages]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        kwargs["pipeline_model_parallel_layout"] = layout
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(spec: ModelSpec, cfg: ParallelConfig, seed: int = 1234, *, lr: float = 1e-3,
                weight_decay: float = 0.0, clip_grad: float = 1.0, grad_reduce_in_fp32: bool = True,
                init_parallel_state: bool = True, spare_buffers: list[torch.Tensor] | None = None,
                optimizer_options: dict[str, Any] | None = None, layer_spec: Any = None,
                group_timeout: float | None = None, **config_overrides: Any) -> BuiltModel:
    """Build this rank's part of ``spec`` under ``cfg``: GPTModel, DDP, Adam optimizer.

    ``config_overrides`` go to ``TransformerConfig`` (e.g. ``hidden_dropout=0.0``);
    ``optimizer_options`` to megatron's ``OptimizerConfig`` (betas, eps, loss scaling; they
    replace ``lr``, ``weight_decay`` and ``clip_grad`` when they name them).
    Deterministic: the same (spec, cfg, seed) gives the same weights on every run.
    ``spare_buffers``: the previous world's gradient buffers (``gradient_buffers``), reused for
    this model's instead of allocating fresh memory (a reconfiguration's commit).
    ``group_timeout``: seconds megatron's groups wait for a peer (``init_parallel``'s ``timeout``).
    """
    compat.install()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config, model, pre_process, post_process = build_gpt_model(
        spec, cfg, seed, init_parallel_state=init_parallel_state, layer_spec=layer_spec,
        group_timeout=group_timeout, **config_overrides)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    module: Any = Float16Module(config, model) if (config.bf16 or config.fp16) else model

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32 and spec.params_dtype != "fp32",
        overlap_grad_reduce=cfg.bucket_size is not None,
        use_distributed_optimizer=cfg.dist_opt,
        bucket_size=cfg.bucket_size,
    )
    with _reusing_zeros(spare_buffers or []):
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)

    options: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "clip_grad": clip_grad,
                               **(optimizer_options or {})}
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=cfg.dist_opt,
            **options,
        ),
        [ddp],
    )

    # What megatron's training loop wires up: grad all-reduce (DP, tied embeddings across the
    # pipeline, num-token scaling) after the last microbatch; no-sync while accumulating.
    config.finalize_model_grads_func = finalize_model_grads
    if config.fp16:
        # fp16: the schedule scales each loss before backward. Through a weak reference: a bound
        # method would tie the config to the optimizer in a cycle that keeps the old world's
        # buffers and communicators alive after a rebuild until the garbage collector runs.
        optimizer_ref = weakref.ref(optimizer)
        config.grad_scale_func = lambda loss: optimizer_ref().scale_loss(loss)
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
    return BuiltModel(spec=spec, cfg=cfg, config=config, model=model, ddp=ddp, optimizer=optimizer,
                      seed=seed, pre_process=pre_process, post_process=post_process)


def transformer_engine_available() -> bool:
    """TransformerEngine's PyTorch modules import and a GPU is there to run them."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # not installed, or built for another CUDA/torch
        return False
    return True


def resolve_transformer_impl(spec: ModelSpec, choice: str | None = None) -> ModelSpec:
    """``spec`` with ``transformer_impl`` decided: ``choice`` (a worker flag) over the spec's own;
    ``auto`` is TransformerEngine where it is available, else megatron's local modules. Every rank
    of a job resolves alike (one image, one GPU type), which the plan checksums confirm."""
    import dataclasses

    impl = choice or spec.transformer_impl
    if impl == "auto":
        impl = "transformer_engine" if transformer_engine_available() else "local"
    elif impl == "transformer_engine" and not transformer_engine_available():
        raise ConfigError("transformer_impl", "transformer_engine needs TransformerEngine and a GPU",
                          "install transformer_engine[pytorch] in the image, or use local")
    return dataclasses.replace(spec, transformer_impl=impl)


def layer_spec_for(spec: ModelSpec) -> Any:
    """megatron's layer spec for ``spec.transformer_impl`` (``auto`` counts as local here)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=spec.num_moe_experts, qk_layernorm=spec.qk_layernorm, normalization=spec.normalization)


def build_gpt_model(spec: ModelSpec, cfg: ParallelConfig, seed: int = 1234, *, init_parallel_state: bool = True,
                    layer_spec: Any = None, group_timeout: float | None = None,
                    **config_overrides: Any) -> tuple[Any, Any, bool, bool]:
    """This rank's bare ``GPTModel`` of ``spec`` under ``cfg`` (no DDP, no optimizer): what a
    weights conversion fills and saves. Returns (config, model, pre_process, post_process).
    ``layer_spec``: a megatron ``ModuleSpec`` to use instead of ``layer_spec_for(spec)``; its
    parameters must be named and ordered as ``spec.transformer_impl`` says (the Layout's)."""
    compat.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, cfg, **config_overrides)
    if init_parallel_state:
        init_parallel(cfg, timeout=group_timeout)

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)

    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if layer_spec is None:
        layer_spec = layer_spec_for(spec)
    with _skipping_tied_embedding_sync(GPTModel, not config.perform_initialization):
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.padded_vocab_size,
            max_sequence_length=spec.max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
            position_embedding_type=spec.position_embedding_type,
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling,
            rope_scaling_factor=spec.rope_scaling_factor,
        )
    return config, model, pre_process, post_process


def gradient_buffers(built: BuiltModel) -> list[torch.Tensor]:
    """The DDP gradient buffers of a model: memory the next world's model can reuse once this one
    is gone (gradients are not training state: nothing is transferred out of them)."""
    out = []
    for buf in (*built.ddp.buffers, *built.ddp.expert_parallel_buffers):
        if getattr(buf, "shared_buffer", None) is None and buf.grad_data is not None:
            out.append(buf.grad_data)
    return out


@contextmanager
def _skipping_tied_embedding_sync(model_cls: type, skip: bool) -> Iterator[None]:
    """With tied embeddings and PP > 1, megatron all-reduces the first stage's embedding into the
    last stage's copy while it builds the model. A model built uninitialised is about to be
    given its whole state (both copies: a reconfiguration's transfer, or a checkpoint), so that
    all-reduce of the full embedding over the embedding group (154 MB in gpt-125m) is skipped."""
    owner = next((c for c in model_cls.__mro__ if "_is_in_embd_group" in c.__dict__), None)
    if not skip or owner is None:  # a megatron-core without the hook keeps its behaviour
        yield
        return
    real = owner.__dict__["_is_in_embd_group"]
    owner._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        owner._is_in_embd_group = real


@contextmanager
def _reusing_zeros(spare: list[torch.Tensor]) -> Iterator[None]:
    """While DDP allocates its buffers, serve ``torch.zeros(n, dtype=...)`` from ``spare``.

    A CPU process returns freed buffers of this size to the OS, so a fresh one pays a page fault
    per 4 KiB on its zero-fill; on a GPU it saves the caching allocator a second copy at peak.
    Reused memory is not zero-filled here: these are gradient buffers, and every step starts with
    ``zero_grad_buffer()`` (megatron's training loop and ``Trainer.step``) before anything reads them.
    """
    if not spare:
        yield
        return
    import importlib

    module = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    real = module.torch
    pool = sorted(spare, key=lambda t: t.numel())

    def zeros(*size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False, **kw: Any) -> Any:
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        numel, dtype_ = math.prod(shape), dtype or torch.get_default_dtype()
        if not requires_grad and not kw:
            for i, t in enumerate(pool):
                if t.dtype == dtype_ and t.numel() >= numel and (device is None or t.device == torch.device(device)):
                    del pool[i]
                    return t.view(-1)[:numel].view(shape)
        return real.zeros(*size, dtype=dtype, device=device, requires_grad=requires_grad, **kw)

    proxy = _TorchWith(real, zeros=zeros)
    module.torch = proxy
    try:
        yield
    finally:
        module.torch = real


class _TorchWith:
    """``torch`` (or the CPU proxy standing in for it) with some attributes replaced."""

    def __init__(self, torch_module: Any, **overrides: Any) -> None:
        self._torch = torch_module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def destroy(defer_free: bool = False) -> None:
    """Tear down megatron's parallel state and free its process groups, so a new config can build.

    Drop every reference to the old ``BuiltModel`` as well: its DDP buffers and optimizer hold
    the groups being freed here. ``defer_free`` (a switch): the groups' objects go to
    ``release.later`` instead of being dropped here, since a gloo communicator's destructor
    closes its connections and joins its threads (milliseconds each, tens of them per world),
    which the pause of a switch need not wait for.
    """
    from megatron.core import parallel_state

    from liveshard.runtime.comms import release

    parallel_state.destroy_model_parallel()
    live = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    for group in _groups:
        if group is not None and group in live:
            dist.destroy_process_group(group)
    if defer_free:
        release.later(list(_groups))
    _groups.clear()


@contextmanager
def _recording_new_groups(ahead: Any = None, timeout: float | None = None,
                          members: Any = None) -> Iterator[list[Any]]:
    """Record the process groups made meanwhile; with ``ahead`` (``comms.world.WorldAhead``),
    hand each group built ahead its communicator instead of connecting a new one; with
    ``members`` (``comms.groups.MembersOnly``), make each group by its members only. A group
    asked for without a timeout gets ``timeout`` (torch's default would be 30 minutes)."""
    from datetime import timedelta

    from liveshard.runtime.comms import world as worlds

    created: list[Any] = []
    real = dist.new_group

    def new_group(ranks: Any = None, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
        request = worlds.GroupRequest.asked(ranks, backend, kwargs)
        if timeout is not None and kwargs.get("timeout") is None:
            kwargs["timeout"] = timedelta(seconds=timeout)
        communicator = ahead.take(request) if ahead is not None and dist.get_rank() in request.ranks else None
        if communicator is None:
            if members is None:
                group = real(ranks, *args, backend=backend, **kwargs)
            else:
                group = members.make(request, lambda: real(ranks, *args, backend=backend, **kwargs), backend, kwargs)
            if not request.ranks or dist.get_rank() in request.ranks:
                worlds.CONNECTED["group"] += 1
                worlds.CREATED["split"] += 1  # made on the running world
        else:
            with worlds.handing_over(communicator):
                group = real(ranks, *args, backend=worlds.ahead_backend(request), **kwargs)
        created.append(group)
        return group

    dist.new_group = new_group  # type: ignore[assignment]
    try:
        yield created
    finally:
        dist.new_group = real  # type: ignore[assignment]


__all__ = ["BuiltModel", "build_gpt_model", "build_model", "destroy", "gradient_buffers", "group_requests", "init_parallel", "layer_spec_for", "resolve_transformer_impl", "transformer_config"]
