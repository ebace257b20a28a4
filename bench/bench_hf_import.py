"""Hugging Face import: bytes read per rank, read speed against the disk's, memory per rank.

A Llama-style model of ``--params`` (default ~125M: hidden 768, 12 layers, GQA 12/4, SwiGLU 2048,
32,000-id vocabulary, untied; random weights from ``transformers``, bf16 safetensors) is
imported by ``liveshard convert``'s import (``liveshard.runtime.hf.convert.run_import``) into a
4-process layout (``--parallel``, default tp=2,pp=2). Per rank: bytes read from the safetensors
(only the slices of the rank's boxes), its local model state, the time to read and place them,
the anonymous memory (``RssAnon``: its own, not the safetensors' mapped file pages, which are
page cache) it added from before building the model to after reading the weights into it. The peer in the same
run is the disk itself: the safetensors file read sequentially (16 MiB reads), with the page
cache for it dropped before each measurement (``posix_fadvise(DONTNEED)``), as it is before the
import.

    python bench/bench_hf_import.py [--parallel tp=2,pp=2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential_read(path: Path) -> float:
    """Bytes per second of one cold sequential read of ``path``."""
    drop_cache(path)
    size = path.stat().st_size
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return size / (time.perf_counter() - start)


def build(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out / "hf")
    return out / "hf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", default="tp=2,pp=2")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_import.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from liveshard.runtime.hf.checkpoint import config_dtype, read_config
    from liveshard.runtime.hf.config import spec_from_hf_config
    from liveshard.runtime.hf.convert import run_import
    from liveshard.runtime.parallel import ParallelConfig

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        src = build(Path(tmp))
        files = sorted(src.glob("*.safetensors"))
        config = read_config(src)
        spec = spec_from_hf_config(config, params_dtype=config_dtype(config))
        parallel = ParallelConfig.parse(args.parallel)
        rounds = []
        for i in range(args.repeat):
            disk = min(sequential_read(f) for f in files)
            for f in files:
                drop_cache(f)
            results = run_import(spec, parallel, str(src), str(Path(tmp) / f"out{i}"), show_progress=False)
            read = sum(r.bytes_read for r in results)
            seconds = max(r.load_seconds for r in results)
            rounds.append({"disk_bytes_per_s": disk, "import_bytes_per_s": read / seconds, "ranks": [
                {"rank": r.rank, "bytes_read": r.bytes_read, "local_state": r.local_bytes,
                 "load_seconds": r.load_seconds, "save_seconds": r.save_seconds,
                 "anon_memory_above_start": r.load_anon - r.base_anon, "peak_rss": r.peak_rss}
                for r in results]})
        best = max(rounds, key=lambda r: r["import_bytes_per_s"] / r["disk_bytes_per_s"])
        file_bytes = sum(f.stat().st_size for f in files)
    print(f"{spec.name}: {spec.num_parameters() / 1e6:.1f}M parameters, {file_bytes / 2**20:.0f} MiB of safetensors, "
          f"layout {parallel}")
    print(f"{'rank':>4} {'read MiB':>9} {'local MiB':>9} {'read s':>7} {'own memory added MiB':>20}")
    for r in best["ranks"]:
        print(f"{r['rank']:>4} {r['bytes_read'] / 2**20:>9.1f} {r['local_state'] / 2**20:>9.1f} "
              f"{r['load_seconds']:>7.2f} {r['anon_memory_above_start'] / 2**20:>20.1f}")
    total_read = sum(r["bytes_read"] for r in best["ranks"])
    total_local = sum(r["local_state"] for r in best["ranks"])
    ratio = best["import_bytes_per_s"] / best["disk_bytes_per_s"]
    print(f"read {total_read / 2**20:.1f} MiB for {total_local / 2**20:.1f} MiB of local state "
          f"({'within' if total_read <= total_local else 'OVER'} the target); import reads at "
          f"{best['import_bytes_per_s'] / 2**20:.0f} MiB/s, the disk sequentially at "
          f"{best['disk_bytes_per_s'] / 2**20:.0f} MiB/s: {ratio:.0%} (target >= 50%)")
    Path(args.out).write_text(json.dumps({"model": spec.to_dict(), "parallel": str(parallel), "file_bytes": file_bytes,
                                          "rounds": rounds, "machine": platform.platform(),
                                          "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
