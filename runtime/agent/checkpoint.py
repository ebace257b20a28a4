"""Checkpoints with megatron-core ``dist_checkpointing``: the restart path and the safety net.

A checkpoint holds the model's and the optimizer's sharded state dicts (the optimizer in
megatron's ``fully_reshardable`` format, so it loads at any TP/PP/DP), the training progress
(step, data cursor, LR schedule) as common state, and every rank's RNG states as a
``ShardedObject``. ``load`` works under any config: new rank r takes the RNG states of the old
rank the transition planner would have given it (``vps.transition.object_moves``), so a restart
through a checkpoint and a live switch leave exactly the same state.

Safety checkpoints are written asynchronously (megatron's async ``torch_dist`` strategy: a
background process writes while training goes on); a kill with no surviving copy of some state
falls back to the newest complete one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from liveshard.runtime.agent.state import capture_rng, restore_rng, set_adam_step
from liveshard.runtime.contract.checkpoint import IDENTITY_KEY, MARKER, JobIdentity, file_manifest, sha256_of
from liveshard.runtime.parallel import ParallelConfig

_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointCorrupt(RuntimeError):
    """A checkpoint's files are not those its save recorded: nothing of it is read."""


def _sharded_state_dict(built: Any, is_loading: bool = False) -> dict:
    model_sd = built.model.sharded_state_dict()
    opt_sd = built.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)
    return {"model": model_sd, "optimizer": opt_sd}


def save(built: Any, trainer: Any, directory: str | os.PathLike, queue: Any = None,
         on_complete: Callable[[], None] | None = None, min_free: int = 0,
         verify_later: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Save every rank's state to ``directory`` (collective over the training world).

    With ``queue`` (megatron's ``AsyncCallsQueue``) the shards are written by a background
    process while training goes on; the checkpoint is complete (``liveshard.json`` written,
    ``on_complete`` called) when the queue finalizes it, which every rank must ask for at the
    same step (``queue.maybe_finalize_async_calls``). Without it, it is complete on return.

    Rank 0 first makes the directory and checks that its volume has ``min_free`` bytes free
    (``MIN_FREE`` at least): megatron's first file (``common.pt``) is written by rank 0 alone,
    so a full disk found there would fail rank 0 while the others wait in the next collective.
    Either failure is raised on every rank, before anything is written.

    The marker lists every file with its size and sha256: the checkpoint is complete once that
    is written. ``verify_later`` (with ``queue``): rank 0 hands it the hashing and the marker's
    writing (a full read of its files) to run off the training thread, and the completion to
    call after; other ranks complete at finalize. Without it rank 0 hashes at finalize.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    path = Path(directory)
    problem: OSError | None = None
    if dist.get_rank() == 0:
        try:
            if path.exists():  # what an interrupted save left behind: never mixed with this one
                shutil.rmtree(path)
            path.mkdir(parents=True)
            free = shutil.disk_usage(path).free
            if free < max(min_free, MIN_FREE):
                raise OSError(errno.ENOSPC, f"{free} bytes free, the checkpoint needs about "
                                            f"{max(min_free, MIN_FREE)}", str(path.parent))
        except OSError as e:
            problem = e
    _raise_everywhere(problem, f"preparing {path}")
    sd = _sharded_state_dict(built)
    world = dist.get_world_size()
    sd["rng"] = ShardedObject("rng", capture_rng(), (world,), (dist.get_rank(),), replica_id=0)
    sd["progress"] = trainer.progress()
    # The tensor layout the shards are in: a DP split is how this run shared its batches, not
    # part of the state (whoever loads it chooses its own).
    layout = str(built.cfg.with_even_dp())
    sd["config"] = layout
    identity = JobIdentity.from_env()  # whose run this is: only this job continues it
    meta = json.dumps({"config": layout, "model": built.spec.to_dict(), **_plain(trainer.progress()),
                       **({IDENTITY_KEY: identity.to_dict()} if identity is not None else {})})

    def mark() -> None:  # every file hashed, then the marker: the checkpoint is complete
        tmp = path / ".liveshard.json.partial"
        tmp.write_text(json.dumps({**json.loads(meta), "files": file_manifest(path)}))
        os.replace(tmp, path / MARKER)

    def finish() -> None:  # after every rank's shards and the global metadata are written
        if dist.get_rank() == 0:
            if verify_later is not None and queue is not None:
                verify_later(mark)  # completes (on_complete) once the marker is written
                return
            mark()
        if on_complete is not None:
            on_complete()

    if queue is None:
        dist_checkpointing.save(sd, str(path))
        dist.barrier()
        finish()
        return
    request = dist_checkpointing.save(sd, str(path), async_sharded_save=True)
    request.add_finalize_fn(finish)
    queue.schedule_async_request(request)


def _raise_everywhere(error: OSError | None, what: str) -> None:
    """Raise on every rank when a step some ranks did alone failed on one (one MIN all-reduce;
    it replaces the barrier after that step)."""
    import torch

    from liveshard.runtime.comms.world import device

    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not int(flag):
        raise OSError(f"{what} failed on rank 0")


# Bytes a volume must have free before a save starts, whatever the checkpoint's size (its
# metadata files, written by rank 0 alone).
MIN_FREE = 1 << 20


def manifest_bytes(directory: str | os.PathLike) -> int:
    """The bytes of a complete checkpoint's files, from its manifest (0 where it has none)."""
    try:
        files = read_meta(directory).get("files") or {}
        return sum(int(item.get("size") or 0) for item in files.values())
    except (OSError, ValueError, AttributeError, TypeError):
        return 0
def verify(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is not a complete, intact checkpoint, or None when it is: the marker is
    there and every file of its manifest has the size and sha256 the save recorded (a manifest
    written before every file was hashed checks the hashes it has). A checkpoint written before
    manifests existed passes on its marker alone."""
    root = Path(directory)
    try:
        meta = read_meta(root)
    except (OSError, ValueError):
        return "incomplete (no liveshard.json)"
    files = meta.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        return "liveshard.json: files is not a mapping"
    for name, item in files.items():
        f = root / name
        if ".." in Path(name).parts or not f.is_file():
            return f"{name}: missing"
        if f.stat().st_size != item.get("size"):
            return f"{name}: {f.stat().st_size} bytes, the save wrote {item.get('size')}"
        digest = item.get("sha256")
        if digest is not None and sha256_of(f) != digest:
            return f"{name}: content differs from what the save wrote (sha256)"
    return None


def is_complete(directory: str | os.PathLike, step: int | None = None) -> bool:
    """Whether ``directory`` holds a finished checkpoint (of ``step``, if given): rank 0 writes
    ``liveshard.json`` after every rank's shards are written."""
    try:
        meta = read_meta(directory)
    except (OSError, ValueError):
        return False
    return step is None or int(meta.get("step", -1)) == step


def newest_complete(root: str | os.PathLike | None, identity: JobIdentity | None = None) -> dict | None:
    """The newest verified checkpoint directly under ``root`` (``{path, step, config}``), or
    None: what a job whose every process was replaced continues from. A newer one that fails
    verification (a torn write, a corrupted file) is skipped with a warning. With ``identity``
    only that job's own checkpoints count (another job's run is never continued by accident)."""
    import logging

    if not root or not os.path.isdir(root):
        return None
    found: list[dict] = []
    for entry in sorted(Path(root).iterdir()):
        if not entry.is_dir() or not is_complete(entry):
            continue
        meta = read_meta(entry)
        if identity is not None and not identity.owns(meta):
            continue
        found.append({"path": str(entry), "step": int(meta.get("step", -1)), "config": meta.get("config")})
    from liveshard.runtime.notice import notice

    damaged: list[tuple[dict, str]] = []
    chosen = None
    for candidate in sorted(found, key=lambda c: c["step"], reverse=True):
        problem = verify(candidate["path"])
        if problem is None:
            chosen = candidate
            break
        damaged.append((candidate, problem))
        logging.getLogger("liveshard.checkpoint").warning(
            "checkpoint %s (step %d) skipped: %s", candidate["path"], candidate["step"], problem)
    for candidate, problem in damaged:  # one console line each (run-local's, a pod's log)
        instead = f"resuming from {Path(chosen['path']).name}" if chosen else "no intact checkpoint is left"
        notice(f"checkpoint {Path(candidate['path']).name} is damaged ({problem}); {instead}")
    return chosen


def read_meta(directory: str | os.PathLike) -> dict:
    return json.loads((Path(directory) / "liveshard.json").read_text())


def load(built: Any, trainer: Any, directory: str | os.PathLike) -> None:
    """Load ``directory`` into a freshly built model under its (possibly different) config.

    A liveshard checkpoint restores everything (weights, optimizer, progress, RNG); one marked
    ``contents: model`` (``liveshard convert``'s import) or a Megatron-LM save restores what it
    has: weights, the optimizer state when it loads, and the step of its iteration directory.
    """
    from liveshard.runtime.hf.weights import megatron_checkpoint_dir
    from liveshard.runtime.megatron import safe_load

    safe_load.install()  # every file below is read without running any of its code
    directory = megatron_checkpoint_dir(directory, check=False)
    meta = read_meta(directory) if (directory / MARKER).exists() else None
    if meta is not None:
        problem = verify(directory)
        if problem is not None:  # before any of it is read: a torn save is not a foreign file
            raise CheckpointCorrupt(f"{directory}: {problem}")
        check_precision(built.spec, directory, "spec.training.precision")  # not a KeyError mid-load
    megatron_checkpoint_dir(directory)  # its .metadata, through the allow-list: one line if refused
    with safe_load.refusals():
        if meta is None or meta.get("contents") == "model":
            _load_foreign(built, trainer, directory, with_optimizer=meta is None)
        else:
            _load_complete(built, trainer, directory, meta)


def load_weights(built: Any, directory: str | os.PathLike) -> None:
    """Only the model weights of a megatron checkpoint (any layout); the optimizer's fp32 main
    parameters are refreshed from them (its moments stay fresh)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from liveshard.runtime.hf.weights import megatron_checkpoint_dir
    from liveshard.runtime.megatron import safe_load

    safe_load.install()
    directory = megatron_checkpoint_dir(directory)
    model_sd = built.model.sharded_state_dict()
    # the sharded strategy alone: a Megatron-LM common.pt (pickled arguments) is never opened
    with safe_load.refusals():
        loaded = dist_checkpointing.load(model_sd, str(directory), sharded_strategy=TorchDistLoadShardedStrategy(),
                                         common_strategy=_NoCommonState())
    built.model.load_state_dict(loaded, strict=False)
    built.optimizer.reload_model_params()


def check_start_weights(spec: Any, training: Any) -> None:
    """``spec.training.initialWeights`` / ``resume`` are there and fit the model (headers and
    metadata only), so a bad path is one line before any process joins the job, not a crash
    inside the first world's build."""
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.hf.weights import megatron_checkpoint_dir

    ref, field = training.initial_weights, "spec.training.initialWeights"
    try:
        if ref is not None and ref.format == "huggingface":
            from liveshard.runtime.hf.checkpoint import HFCheckpoint
            from liveshard.runtime.hf.names import hf_tensors
            from liveshard.runtime.hf.weights import check_matches

            ckpt = HFCheckpoint(ref.path)
            check_matches(spec, ckpt.config, f"{ref.path}/config.json")
            ckpt.check(hf_tensors(spec))
            ckpt.close()
        elif ref is not None:
            megatron_checkpoint_dir(ref.path)
        if training.resume:
            field = "spec.training.resume"
            check_precision(spec, megatron_checkpoint_dir(training.resume), "spec.training.resume")
    except ConfigError as e:
        if e.field.startswith(field):
            raise
        raise ConfigError(f"{field}: {e.field}", e.problem, e.fix) from None


def check_precision(spec: Any, directory: str | os.PathLike, field: str) -> None:
    """A liveshard checkpoint whose run trained in another precision is refused in one line
    (``field``): its optimizer state has another shape (a bf16/fp16 run keeps fp32 main
    parameters that an fp32 run has not), and megatron's load would fail deep in the first
    world's build with a ``KeyError``. A weights-only checkpoint (``liveshard convert``'s
    import, a Megatron-LM save) is cast on load and passes."""
    from liveshard.runtime.errors import ConfigError, clip

    root = Path(directory)
    try:
        meta = read_meta(root) if (root / MARKER).is_file() else None
    except (OSError, ValueError):
        return  # an unreadable marker: verify() names it when the checkpoint is loaded
    if not isinstance(meta, dict) or meta.get("contents") == "model":
        return
    model = meta.get("model")
    recorded = model.get("params_dtype") if isinstance(model, dict) else None
    if recorded is None or recorded == spec.params_dtype:
        return
    recorded = clip(str(recorded), 20)  # as the file says it: bounded
    raise ConfigError(field, f"{root} was saved by a run training in {recorded}; this job trains "
                      f"in {spec.params_dtype}, and the optimizer state of one precision does not load "
                      "into the other",
                      f"resume it with spec.training.precision: {recorded}, or start a "
                      f"{spec.params_dtype} run from its weights alone (spec.training.initialWeights: "
                      f"{{format: megatron, path: {root}}})")


def load_initial_weights(built: Any, ref: Any) -> None:
    """``spec.training.initialWeights``: Hugging Face or megatron weights into this world's layout."""
    if ref.format == "huggingface":
        from liveshard.runtime.hf.weights import load_hf

        load_hf(built.model, built.spec, ref.path)
        built.optimizer.reload_model_params()
    else:
        load_weights(built, ref.path)


def _load_foreign(built: Any, trainer: Any, directory: Path, with_optimizer: bool) -> None:
    import logging

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    from liveshard.runtime.agent.state import ensure_adam_state
    from liveshard.runtime.megatron import safe_load

    log = logging.getLogger("liveshard.checkpoint")
    step = _iteration(directory)
    if with_optimizer:
        ensure_adam_state(built.optimizer)
        sd = _sharded_state_dict(built, is_loading=True)
        # What the common state would have held (the optimizer's param_groups: hyperparameters
        # and parameter indices) is this optimizer's own: the LR scheduler sets the values.
        _, own_common = extract_sharded_base(sd)
        try:
            loaded = dist_checkpointing.load(sd, str(directory), sharded_strategy=TorchDistLoadShardedStrategy(),
                                             common_strategy=_NoCommonState())
            _fill_missing(loaded, own_common)
            _set_missing_adam_steps(loaded["optimizer"], step)
        except Exception as e:  # no optimizer state, or not in a reshardable format
            refused = safe_load.refusal(e)
            if refused is not None:  # a crafted file is not a missing optimizer state
                raise safe_load.UnsafeCheckpoint(refused.field, refused.problem, refused.fix) from None
            log.warning("%s: optimizer state not loaded (%s); continuing with fresh optimizer state",
                        directory, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        else:
            built.model.load_state_dict(loaded["model"])
            built.optimizer.load_state_dict(loaded["optimizer"])
            set_adam_step(built.optimizer, step)
            trainer.fast_forward(step)
            return
    load_weights(built, directory)
    trainer.fast_forward(step if with_optimizer else 0)


def _fill_missing(loaded: Any, own: Any) -> None:
    """Put into ``loaded`` what only ``own`` has (nested dicts and lists walked in step)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    if isinstance(loaded, dict) and isinstance(own, dict):
        for key, value in own.items():
            if isinstance(value, LocalNonpersistentObject):
                value = value.unwrap()
            if key not in loaded:
                loaded[key] = value
            else:
                _fill_missing(loaded[key], value)
    elif isinstance(loaded, list) and isinstance(own, list) and len(loaded) == len(own):
        for a, b in zip(loaded, own):
            _fill_missing(a, b)


def _set_missing_adam_steps(tree: Any, step: int) -> None:
    """Adam's per-parameter step counter is common state in megatron's format: set it where the
    moments were read without it."""
    import torch

    if isinstance(tree, dict):
        if "exp_avg" in tree and "step" not in tree:
            tree["step"] = torch.tensor(float(step))
        for value in tree.values():
            _set_missing_adam_steps(value, step)
    elif isinstance(tree, list):
        for value in tree:
            _set_missing_adam_steps(value, step)


def _iteration(directory: Path) -> int:
    """The step of a Megatron-LM iteration directory (``iter_0000100``); 0 otherwise."""
    name = directory.name
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else 0


class _NoCommonState:
    """A common-state strategy that reads nothing: foreign checkpoints' common state is a pickle."""

    def load_common(self, checkpoint_dir: Any) -> dict:
        return {}

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
        raise ValueError("sharded objects are not read from foreign checkpoints")

    def load_sharded_metadata(self, checkpoint_dir: Any) -> dict:
        return {}

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        pass

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False


def _load_complete(built: Any, trainer: Any, directory: Path, meta: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from liveshard.runtime.agent.state import ensure_adam_state
    from liveshard.runtime.megatron import safe_load
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.transition import object_moves

    old_cfg = ParallelConfig.parse(meta["config"])
    new_cfg = built.cfg
    rank = dist.get_rank()
    # The live path's rule for per-rank objects; no device persists across a restart.
    devices = DeviceMap(old_cfg.world_size, joining=max(0, new_cfg.world_size - old_cfg.world_size))
    moves = object_moves(old_cfg, new_cfg, tuple(range(new_cfg.world_size)), devices)
    rng_src = next(m.src_rank for m in moves if m.name == "rng" and m.dst_rank == rank)
    ensure_adam_state(built.optimizer)
    sd = _sharded_state_dict(built, is_loading=True)
    # torch_dist named here, not taken from the checkpoint's metadata.json; common.pt is read
    # with weights_only (safe_load)
    with safe_load.refusals():
        loaded = dist_checkpointing.load(sd, str(directory), sharded_strategy=TorchDistLoadShardedStrategy())
    built.model.load_state_dict(loaded["model"])
    built.optimizer.load_state_dict(loaded["optimizer"])
    progress = loaded["progress"]
    trainer.restore_progress(progress)
    set_adam_step(built.optimizer, int(progress["step"]))
    # Each new rank reads one old rank's RNG states: some old shards are read twice, some not
    # at all, which megatron's access check (one reader per shard) would reject.
    rng = ShardedObject("rng", None, (old_cfg.world_size,), (rng_src,), replica_id=0)
    with safe_load.refusals():
        states = dist_checkpointing.load({"rng": rng}, str(directory), sharded_strategy=TorchDistLoadShardedStrategy(),
                                         validate_access_integrity=False)
    restore_rng(states["rng"])


def _plain(progress: dict) -> dict:
    return {"step": progress["step"], "consumed_samples": progress["consumed_samples"]}

