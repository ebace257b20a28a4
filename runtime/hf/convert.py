"""``liveshard convert``'s two directions, each run by a set of local processes.

* import (Hugging Face -> megatron): ``world`` gloo processes build the model in the target
  layout (uninitialised: every element is about to be read), each fills its own parameters from
  the safetensors (reading only its boxes) and megatron's ``dist_checkpointing.save`` writes a
  ``torch_dist`` checkpoint. Rank 0 then writes ``liveshard.json`` (the layout, the ModelSpec,
  ``contents: model``), which marks the checkpoint complete.
* export (megatron -> Hugging Face): independent processes (no process group), each writing
  every ``procs``-th safetensors file (``hf.weights.export_hf``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from liveshard.runtime.errors import ConfigError, RunFailed
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

MODEL_ONLY = "model"  # liveshard.json "contents" of a checkpoint without optimizer state


@dataclass(frozen=True)
class ImportResult:
    rank: int
    bytes_read: int
    local_bytes: int  # bytes of this rank's model parameters
    load_seconds: float
    save_seconds: float
    peak_rss: int  # the process's peak resident memory (with the safetensors' mapped file pages)
    base_anon: int  # anonymous (non-file) resident memory before the model was built
    load_anon: int  # the same after reading the weights into it


def check_output_dir(path: str | os.PathLike) -> Path:
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--to", f"{out} exists and is not empty", "choose a new directory")
    return out


def import_rank(rank: int, world: int, port: int, spec_dict: dict, parallel: str, source: str, out: str,
                show_progress: bool) -> ImportResult:
    """One process of an import (spawned by ``run_import``)."""
    import resource

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(minutes=10))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=30))
    try:
        from megatron.core import dist_checkpointing

        from liveshard.runtime.hf.weights import load_hf
        from liveshard.runtime.megatron.build import build_gpt_model, destroy

        spec = ModelSpec.from_dict(spec_dict)
        cfg = ParallelConfig.parse(parallel)
        base = _anon()
        _, model, _, _ = build_gpt_model(spec, cfg, perform_initialization=False)
        bar = _progress(f"rank {rank}: reading", show_progress and rank == 0)
        t0 = time.perf_counter()
        nbytes = load_hf(model, spec, source, progress=bar)
        load_s = time.perf_counter() - t0
        load_anon = _anon()
        dist.barrier()
        t1 = time.perf_counter()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, out)
        dist.barrier()
        save_s = time.perf_counter() - t1
        if rank == 0:
            from liveshard.runtime.contract.checkpoint import MARKER, file_manifest

            meta = {"config": str(cfg), "model": spec.to_dict(), "step": 0, "consumed_samples": 0,
                    "contents": MODEL_ONLY, "source": f"hf:{source}", "files": file_manifest(out)}
            (Path(out) / MARKER).write_text(json.dumps(meta, indent=1))
        local = sum(p.numel() * p.element_size() for p in model.parameters())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        del model
        destroy()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return ImportResult(rank, nbytes, local, load_s, save_s, peak, base, load_anon)
    finally:
        dist.destroy_process_group()


def _entry(rank: int, fn_args: tuple, results: Any) -> None:
    results.put((rank, import_rank(rank, *fn_args)))


def run_import(spec: ModelSpec, parallel: ParallelConfig, source: str, out: str, *,
               show_progress: bool = True) -> list[ImportResult]:
    """Import the Hugging Face checkpoint ``source`` into ``out`` under ``parallel`` (one local
    process per rank). Raises ConfigError before starting processes for what can be checked here."""
    import torch.multiprocessing as mp

    from liveshard.runtime.hf.checkpoint import HFCheckpoint
    from liveshard.runtime.hf.names import hf_tensors
    from liveshard.runtime.hf.weights import check_matches

    parallel = parallel.with_even_dp()  # a DP split is a training-time choice: no tensor depends on it
    parallel.validate(spec)
    ckpt = HFCheckpoint(source)  # config, index and every tensor's shape, before any process starts
    check_matches(spec, ckpt.config, f"{source}/config.json")
    ckpt.check(hf_tensors(spec))
    ckpt.close()
    check_output_dir(out)
    Path(out).mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    args = (parallel.world_size, port, spec.to_dict(), str(parallel), source, out, show_progress)
    procs = [ctx.Process(target=_entry, args=(r, args, results)) for r in range(parallel.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RunFailed(f"import processes {failed} failed (exit codes "
                           f"{[procs[r].exitcode for r in failed]}); {out} is incomplete (no liveshard.json)")
    out_list = [results.get() for _ in procs]
    return [r for _, r in sorted(out_list, key=lambda x: x[0])]


def _export_entry(proc: int, procs: int, checkpoint: str, spec_dict: dict, out: str, dtype: str | None,
                  max_shard_bytes: int, tokenizer: str | None) -> None:
    from liveshard.runtime.hf.weights import export_hf

    export_hf(checkpoint, ModelSpec.from_dict(spec_dict), out, dtype=dtype, max_shard_bytes=max_shard_bytes,
              tokenizer=tokenizer, procs=procs, proc=proc,
              progress=_progress("writing", proc == 0 and sys.stderr.isatty()))


def run_export(checkpoint: str, spec: ModelSpec, out: str, *, procs: int = 1, dtype: str | None = None,
               max_shard_bytes: int | None = None, tokenizer: str | None = None) -> None:
    from liveshard.runtime.hf.config import hf_config_from_spec
    from liveshard.runtime.hf.weights import (
        DEFAULT_SHARD_BYTES,
        export_hf,
        megatron_checkpoint_dir,
        tokenizer_files,
    )

    hf_config_from_spec(spec)  # refuse what has no Hugging Face equivalent before reading anything
    megatron_checkpoint_dir(checkpoint)
    check_output_dir(out)
    if tokenizer:
        tokenizer_files(tokenizer)
    size = max_shard_bytes or DEFAULT_SHARD_BYTES
    if procs <= 1:
        export_hf(checkpoint, spec, out, dtype=dtype, max_shard_bytes=size, tokenizer=tokenizer,
                  progress=_progress("writing", sys.stderr.isatty()))
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_export_entry, args=(i, procs, checkpoint, spec.to_dict(), out, dtype, size, tokenizer))
          for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    if any(p.exitcode != 0 for p in ps):
        raise RunFailed(f"export processes failed (exit codes {[p.exitcode for p in ps]}); {out} is incomplete")


def checkpoint_model(directory: str | os.PathLike) -> ModelSpec | None:
    """The ModelSpec a liveshard checkpoint recorded in its ``liveshard.json`` (None without one)."""
    path = Path(directory) / "liveshard.json"
    if not path.exists():
        return None
    from liveshard.runtime.inputs import load_json

    meta = load_json(path, str(path), what="liveshard.json")
    model = meta.get("model") if isinstance(meta, dict) else None
    return ModelSpec.from_dict(model, source=f"{path}: model") if isinstance(model, dict) else None


def _progress(label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=label, unit="tensor", file=sys.stderr, leave=False)
        bar["bar"].n = done
        bar["bar"].refresh()
        if done >= total:
            bar["bar"].close()

    return update


def _anon() -> int:
    """Resident anonymous memory (``RssAnon``): the process's own, without mapped file pages."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["MODEL_ONLY", "ImportResult", "checkpoint_model", "run_export", "run_import"]
