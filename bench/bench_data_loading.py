"""What reading real data costs a training step: indexed data vs megatron's mock data, same run.

One gloo process trains one model (default ``gpt-125m``) with one ``Trainer``; steps alternate
between two datasets built by ``liveshard.runtime.data.datasets``: the built-in corpus (Python's
reference documentation, byte-level BPE with 4096 ids, through ``GPTDataset`` over the memory-
mapped ``.bin``/``.idx``) and ``MockGPTDataset``. Alternating on the same model in the same
process makes the comparison fair on a noisy machine. Reported: median step seconds of each, the
overhead of real data in percent, and the time ``JobData.batch`` takes to assemble one global
batch (the whole of the data path a step pays). Target: <= 2 %.

    python bench/bench_data_loading.py [--model gpt-125m] [--steps 10] [--global-batch 8] [--seq-length 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

TARGET_PERCENT = 2.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--steps", type=int, default=10, help="steps per dataset (after one warm-up step each)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_loading.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist

    from liveshard.dev.ports import free_port
    from liveshard.runtime.agent.trainer import Trainer, optimizer_options
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.data.corpus import build_corpus, default_corpus_dir
    from liveshard.runtime.data.datasets import MockTokenizer, build_datasets, load_job_tokenizer
    from liveshard.runtime.megatron.build import build_model
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    corpus = build_corpus(os.path.join(default_corpus_dir(), "v4096"), vocab_size=4096)
    spec = load_model(args.model)
    steps = 2 * (args.steps + 1)
    common = {"trainIters": steps, "globalBatch": args.global_batch, "seqLength": args.seq_length,
              "precision": spec.params_dtype, "optimizer": {"lr": 1e-4, "minLr": 1e-5}}
    real_spec = read_training({"data": {"blend": [{"prefix": corpus.data_prefix}], "split": "98,2,0"},
                               "tokenizer": {"path": corpus.tokenizer_dir}, **common})
    mock_spec = read_training({"data": {"mock": True}, **common})
    with tempfile.TemporaryDirectory() as cache:
        real = build_datasets(real_spec, load_job_tokenizer(real_spec, spec.vocab_size, spec.padded_vocab_size),
                              cache)
        mock = build_datasets(mock_spec, MockTokenizer(spec.vocab_size), None)

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        built = build_model(spec, ParallelConfig(), seed=real_spec.seed,
                            optimizer_options=optimizer_options(real_spec), hidden_dropout=0.0,
                            attention_dropout=0.0)
        trainer = Trainer(built, real_spec, real)
        seconds: dict[str, list[float]] = {"indexed": [], "mock": []}
        fetch: dict[str, list[float]] = {"indexed": [], "mock": []}
        for i in range(steps):
            name, data = ("indexed", real) if i % 2 == 0 else ("mock", mock)
            trainer.data = data
            t0 = time.perf_counter()
            data.batch(range(trainer.consumed_samples, trainer.consumed_samples + args.global_batch))
            t1 = time.perf_counter()
            trainer.step()
            if i >= 2:  # one warm-up step of each
                fetch[name].append(t1 - t0)
                seconds[name].append(trainer.last_step_seconds)
        dist.destroy_process_group()

    med = {k: statistics.median(v) for k, v in seconds.items()}
    overhead = 100.0 * (med["indexed"] - med["mock"]) / med["mock"]
    fetch_ms = {k: 1000 * statistics.median(v) for k, v in fetch.items()}
    rows = [(k, med[k], fetch_ms[k]) for k in ("mock", "indexed")]
    print(f"{args.model}, global batch {args.global_batch} x {args.seq_length} tokens, {args.steps} steps each, "
          f"alternating on one model (1 process, CPU)")
    print(f"{'data':<10}{'median step s':>15}{'batch fetch ms':>16}")
    for name, step, ms in rows:
        print(f"{name:<10}{step:>15.3f}{ms:>16.2f}")
    verdict = "meets" if overhead <= TARGET_PERCENT else "misses"
    print(f"indexed data adds {overhead:+.2f} % to the step ({verdict} the <= {TARGET_PERCENT} % target); "
          f"assembling a batch takes {fetch_ms['indexed'] / (1000 * med['indexed']) * 100:.3f} % of a step")
    out = {"model": args.model, "global_batch": args.global_batch, "seq_length": args.seq_length,
           "steps_each": args.steps, "median_step_seconds": med, "batch_fetch_ms": fetch_ms,
           "overhead_percent": overhead, "target_percent": TARGET_PERCENT, "step_seconds": seconds,
           "machine": platform.node(), "load_average": os.getloadavg()[0], "time": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
