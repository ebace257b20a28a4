"""Run megatron-core on a CPU-only torch (gloo): contained patches for its CUDA assumptions.

megatron-core targets GPUs and hard-codes CUDA in a few places that the CPU path of a
liveshard worker (local demo cluster, CI) goes through. ``install()`` patches exactly those
places, and only when ``torch.cuda.is_available()`` is False; on a GPU machine it does nothing.
No installed file is edited; every patch is applied at runtime, once (``install()`` is
idempotent), and each one says below why it is needed.

Three kinds of patch:

* ``torch.cuda`` stand-ins (``current_device``, ``synchronize``, ``current_stream``,
  ``default_stream``): without CUDA these functions only raise, so giving them CPU meanings can
  break no working code. Scratch buffers megatron allocates on "the current device" land on CPU.
* a module-local ``torch`` for the megatron modules that write ``device="cuda"`` literals
  (schedules, optimizers, grad clipping, utils, grad buffers) or use the CUDA RNG
  (``tensor_parallel.random``): inside those modules only, "cuda" means "cpu".
* wrappers around megatron methods: the optimizers' ``Tensor.type()`` string checks
  (``'torch.cuda.FloatTensor'``), the ``.cuda()`` in the tied-embedding setup, the distributed
  optimizer's NCCL-only gather, and three bugs of megatron's plain ``torch.optim.Adam`` path
  (no Apex/TransformerEngine) that break distributed-optimizer checkpoint loading; plus the MoE
  router's reference to ``te_general_gemm``, a name that exists only with TransformerEngine.

The Adam checkpoint bugs and the MoE name are not CPU issues (a GPU install without
Apex/TransformerEngine has them too), but they are patched only here, with the rest.

Written against megatron-core 0.16.1; each patch checks that its target exists, so a newer
megatron-core that moved or fixed something loses only that patch (``applied()`` lists them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
_installed = False
_applied: list[str] = []


@contextlib.contextmanager
def eager_fusions() -> Iterator[None]:
    """Import megatron-core inside this on a CPU-only torch: its fused elementwise kernels
    (``megatron.core.jit.jit_fuser``, ``torch.compile`` since torch 2.2) are decorated at import,
    which imports torch's dynamo and inductor compilers (about 1.5 s of CPU per process, every
    worker and every test process) for kernels a CPU run never compiles (megatron enables them
    with ``bias_activation_fusion`` and friends, off here). While megatron-core is first imported,
    ``torch.compile`` returns the function itself: ``jit_fuser`` keeps that, and the fusions run
    eagerly. Nothing changes where CUDA is present, or once megatron-core is imported."""
    import sys

    import torch

    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        yield
        return
    real = torch.compile

    def uncompiled(model: Any = None, **kwargs: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = uncompiled  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real


def install() -> bool:
    """Apply the CPU patches if CUDA is absent. Returns whether they are active. Idempotent."""
    global _installed
    import torch

    if torch.cuda.is_available():
        return False
    with _lock:
        if _installed:
            return True
        _patch_torch_cuda(torch)
        _patch_device_literals(torch)
        _patch_rng(torch)
        _patch_type_checks()
        _patch_tied_embedding_setup()
        _patch_moe_without_te()
        _patch_dp_zero_gather()
        _patch_adam_checkpoint_load(torch)
        _patch_grad_scaler_load(torch)
        _installed = True
    return True


def is_installed() -> bool:
    return _installed


def applied() -> tuple[str, ...]:
    """Names of the patches in effect (a patch whose target is missing is left out)."""
    return tuple(_applied)


# ---- torch.cuda stand-ins ----------------------------------------------------------------------
class _NullStream:
    """A CUDA stream on CPU: work is already ordered, so every wait or record is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_NULL_STREAM = _NullStream()


def _patch_torch_cuda(torch: Any) -> None:
    cuda = torch.cuda
    # megatron allocates scratch buffers (GlobalMemoryBuffer, TP all-gathers, P2P shape
    # exchange, grad buffers) with device=torch.cuda.current_device().
    cuda.current_device = lambda: "cpu"
    # P2P communication and buffer (de)allocation call synchronize(); CPU ops are synchronous.
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NULL_STREAM
    cuda.default_stream = lambda device=None: _NULL_STREAM
    _applied.append("torch.cuda.current_device/synchronize/current_stream/default_stream")


# ---- device="cuda" literals, module by module --------------------------------------------------
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
              "empty_like", "full_like", "as_tensor")


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if getattr(device, "type", None) == "cuda":
        return "cpu"
    return device


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside one megatron module: tensor factories map "cuda" to CPU.

    Every other attribute is the real ``torch``'s, so ``torch.Tensor``, ``torch.distributed``
    and the rest behave as before.
    """

    def __init__(self, torch: Any, cuda: Any = None) -> None:
        super().__init__("torch")
        self._torch = torch
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))
        if cuda is not None:
            self.cuda = cuda

    @staticmethod
    def _factory(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            # CPU tensors cannot be pinned without an accelerator.
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


# Modules that create tensors with device="cuda" (0.16.1): the three forward_backward_* schedules
# (a token counter, even with PP=1), the optimizers' found-inf / loss-scale scalars, grad-norm
# clipping, utils.local_multi_tensor_l2_norm, and the grad buffers' NCCL warm-up tensor.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",  # fp16 loss scaling: its scale lives on "cuda"
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
)


def _replace_module_torch(module_name: str, proxy: _CpuTorch) -> bool:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    if getattr(module, "torch", None) is None:
        return False
    module.torch = proxy  # type: ignore[attr-defined]
    return True


def _patch_device_literals(torch: Any) -> None:
    proxy = _CpuTorch(torch)
    for name in _CUDA_LITERAL_MODULES:
        if _replace_module_torch(name, proxy):
            _applied.append(f"device literals: {name}")


# ---- RNG: megatron's "CUDA RNG tracker" on the CPU generator -----------------------------------
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class _DropCpuRngWarning(logging.Filter):
    # On CPU the tracked states *are* the CPU generator's, so this warning fires on every fork
    # that draws random numbers (dropout) and means nothing.
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_WARNING


def _patch_rng(torch: Any) -> None:
    """``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` on CPU.

    megatron keeps named CUDA RNG states (data-parallel, tensor-parallel, expert-parallel) and
    forks between them so dropout differs across TP ranks. CPU ops draw from the CPU default
    generator, so that is the generator the tracker must save, seed and restore.
    """
    try:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:
        return
    cuda = types.SimpleNamespace(
        **{k: getattr(torch.cuda, k) for k in dir(torch.cuda) if not k.startswith("__")})
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: torch.manual_seed(seed)
    if not _replace_module_torch(random.__name__, _CpuTorch(torch, cuda=cuda)):
        return
    if hasattr(random, "_get_cuda_rng_state"):
        random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
            torch.get_rng_state())
    if hasattr(random, "_set_cuda_rng_state"):
        random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
            torch.set_rng_state(new_state))
    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())
    _applied.append("rng tracker on the CPU generator")


# ---- Tensor methods, patched only while a named megatron function runs ------------------------
_real_methods: dict[str, Any] = {}
_method_depth: dict[str, int] = {}
_lock_methods = threading.RLock()


def _cuda_type_name(self: Any, *args: Any, **kwargs: Any) -> Any:
    name = _real_methods["type"](self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or self.is_cuda:
        return name
    # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor'
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


def _stay_on_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


@contextlib.contextmanager
def _tensor_method(name: str, replacement: Callable) -> Iterator[None]:
    """While active, ``torch.Tensor.<name>`` is ``replacement`` (re-entrant, restored exactly)."""
    import torch

    with _lock_methods:
        depth = _method_depth.get(name, 0)
        if depth == 0:
            _real_methods[name] = getattr(torch.Tensor, name)
            _real_methods[name + ".own"] = name in torch.Tensor.__dict__
            setattr(torch.Tensor, name, replacement)
        _method_depth[name] = depth + 1
    try:
        yield
    finally:
        with _lock_methods:
            _method_depth[name] -= 1
            if _method_depth[name] == 0:
                if _real_methods.pop(name + ".own"):
                    setattr(torch.Tensor, name, _real_methods[name])
                else:  # inherited from the C base class: just remove the shadow
                    delattr(torch.Tensor, name)



def _with_tensor_method(name: str, replacement: Callable) -> Callable[[Callable], Callable]:
    def make(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _tensor_method(name, replacement):
                return fn(*args, **kwargs)

        wrapper.__liveshard_compat__ = True  # type: ignore[attr-defined]
        return wrapper

    return make


# The optimizers test ``param.type() == 'torch.cuda.FloatTensor'`` (and Half/BFloat16).
_reporting_cuda = _with_tensor_method("type", _cuda_type_name)


def _wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Wrap ``cls.name`` (plain function or classmethod) once."""
    raw = cls.__dict__.get(name)
    if raw is None:
        return False
    if isinstance(raw, classmethod):
        if getattr(raw.__func__, "__liveshard_compat__", False):
            return True
        setattr(cls, name, classmethod(make(raw.__func__)))
    else:
        if getattr(raw, "__liveshard_compat__", False):
            return True
        setattr(cls, name, make(raw))
    return True


def _patch_type_checks() -> None:
    """The optimizers accept only params whose ``type()`` is a ``torch.cuda.*Tensor`` string."""
    try:
        opt = importlib.import_module("megatron.core.optimizer.optimizer")
        dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    except ImportError:
        return
    targets = [
        (getattr(dopt, "DistributedOptimizer", None), "__init__"),
        (getattr(dopt, "DistributedOptimizer", None), "_build_model_and_main_param_groups"),
        (getattr(opt, "Float16OptimizerWithFloat16Params", None), "__init__"),
    ]
    for cls, name in targets:
        if cls is not None and _wrap_method(cls, name, _reporting_cuda):
            _applied.append(f"type checks: {cls.__name__}.{name}")
    # Grad clipping asserts grad.type() == 'torch.cuda.FloatTensor'; optimizer.py imports the
    # function by name, so both module attributes are replaced.
    fn = getattr(clip, "clip_grad_by_total_norm_fp32", None)
    if fn is not None and not getattr(fn, "__liveshard_compat__", False):
        wrapped = _reporting_cuda(fn)
        clip.clip_grad_by_total_norm_fp32 = wrapped
        if getattr(opt, "clip_grad_by_total_norm_fp32", None) is fn:
            opt.clip_grad_by_total_norm_fp32 = wrapped
        _applied.append("type checks: clip_grad_by_total_norm_fp32")


def _patch_tied_embedding_setup() -> None:
    """With tied embeddings and PP > 1, the last stage's output weight is synchronised with the
    first stage's embedding by an all-reduce after ``weight.data = weight.data.cuda()``."""
    try:
        lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    except ImportError:
        return
    cls = getattr(lm, "LanguageModule", None)
    if cls is not None and _wrap_method(cls, "setup_embeddings_and_output_layer",
                                        _with_tensor_method("cuda", _stay_on_cpu)):
        _applied.append("tied embeddings: LanguageModule.setup_embeddings_and_output_layer")


def _patch_moe_without_te() -> None:
    """``moe_utils`` imports ``te_general_gemm`` only when TransformerEngine is installed but the
    router's gating function tests ``te_general_gemm is not None`` either way (NameError)."""
    try:
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _applied.append("moe router without TransformerEngine: moe_utils.te_general_gemm = None")


# ---- distributed optimizer -------------------------------------------------------------------
def _patch_dp_zero_gather() -> None:
    """``get_parameter_state_dp_zero(use_gloo_comm=False)`` moves shards to CUDA for NCCL.

    The ``fully_reshardable`` checkpoint format calls it that way; on CPU the gloo
    data-parallel group does the same gather.
    """
    try:
        dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    except ImportError:
        return
    cls = getattr(dopt, "DistributedOptimizer", None)

    def make(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def get_parameter_state_dp_zero(self: Any, use_gloo_comm: bool = True, *args: Any,
                                        **kwargs: Any) -> Any:
            return fn(self, True, *args, **kwargs)

        get_parameter_state_dp_zero.__liveshard_compat__ = True  # type: ignore[attr-defined]
        return get_parameter_state_dp_zero

    if cls is not None and _wrap_method(cls, "get_parameter_state_dp_zero", make):
        _applied.append("DistributedOptimizer.get_parameter_state_dp_zero over gloo")


def _patch_adam_checkpoint_load(torch: Any) -> None:
    """Three bugs of the distributed optimizer with plain ``torch.optim.Adam`` (no Apex/TE).

    They are not CPU issues (a GPU worker without Apex/TE has them too) and only bite when a
    checkpoint is loaded into the distributed optimizer:

    1. ``sharded_state_dict(is_loading=True)`` on a fresh optimizer calls ``state_dict()``,
       which asserts that every param state has one ``step``: there are none yet. Initialise
       the states first (megatron's own ``_init_optimizer_states_with_dummy_values``).
    2. ``_set_main_param_and_optimizer_states`` copies into the fp32 main params (leaves that
       require grad) outside ``no_grad``, and copies ``step``, which the source does not have.
    3. ``load_state_dict`` gives every param state the same ``step`` tensor; torch's Adam
       increments it in place once per param, so after a resume the bias correction runs ahead.
    """
    try:
        dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    except ImportError:
        return
    cls = getattr(dopt, "DistributedOptimizer", None)
    if cls is None or getattr(dopt, "HAVE_APEX_OR_TE", False):
        return

    def make_sharded_state_dict(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
            is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
            if (is_loading and getattr(self, "optimizer", None) is not None
                    and len(self.optimizer.state) == 0
                    and hasattr(self, "_init_optimizer_states_with_dummy_values")):
                self._init_optimizer_states_with_dummy_values()
            return fn(self, *args, **kwargs)

        sharded_state_dict.__liveshard_compat__ = True  # type: ignore[attr-defined]
        return sharded_state_dict

    def make_set_states(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> None:
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return fn(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **self.optimizer.state[main_param]}
            with torch.no_grad():
                for key, value in dst.items():
                    if key != "step" and key in tensors:
                        value.copy_(tensors[key])
            return None

        _set_main_param_and_optimizer_states.__liveshard_compat__ = True  # type: ignore[attr-defined]
        return _set_main_param_and_optimizer_states

    def make_load_state_dict(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def load_state_dict(self: Any, state_dict: Any) -> Any:
            out = fn(self, state_dict)
            inner = getattr(self, "optimizer", None)
            if inner is not None:
                for state in inner.state.values():
                    step = state.get("step")
                    if isinstance(step, torch.Tensor):
                        state["step"] = step.detach().clone()
            return out

        load_state_dict.__liveshard_compat__ = True  # type: ignore[attr-defined]
        return load_state_dict

    for name, make in (("sharded_state_dict", make_sharded_state_dict),
                       ("_set_main_param_and_optimizer_states", make_set_states),
                       ("load_state_dict", make_load_state_dict)):
        if _wrap_method(cls, name, make):
            _applied.append(f"adam checkpoint load: DistributedOptimizer.{name}")


__all__ = ["applied", "install", "is_installed"]


# ---- fp16 loss scaling: the scale restored on CPU ------------------------------------------
def _patch_grad_scaler_load(torch: Any) -> None:
    """``DynamicGradScaler.load_state_dict`` moves the restored scale with ``.cuda()`` (an
    optimizer or checkpoint load of an fp16 run): on CPU it stays on the CPU."""
    try:
        grad_scaler = importlib.import_module("megatron.core.optimizer.grad_scaler")
    except ImportError:
        return
    cls = getattr(grad_scaler, "DynamicGradScaler", None)
    if cls is None or not hasattr(cls, "load_state_dict"):
        return

    def load_state_dict(self: Any, state_dict: dict) -> None:
        scale = state_dict["scale"]
        self._scale = (scale if torch.is_tensor(scale) else torch.tensor([float(scale)])).float().cpu()
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    cls.load_state_dict = load_state_dict
    _applied.append("grad scaler load on CPU")
