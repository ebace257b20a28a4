"""prepare-data throughput: tokens/s per core with the corpus tokenizer, 1 and 2 workers.

The built-in corpus (``runtime/data/corpus.py``: Python's reference documentation, byte-level BPE
with 4096 ids) is repeated into one JSON-lines file of at least ``--tokens`` tokens; each run
tokenizes it with ``prepare`` into a fresh prefix, EOD appended. Per worker count: best and
median wall time of ``--repeat`` runs, tokens/s, tokens/s per worker, and CPU seconds of this
process and its worker processes together (so tokens per CPU-second charges the reading, JSON
parsing and writing too). As the peer in the same run: the tokenizer alone, the same texts
encoded in memory on one thread (``encode_batch_fast``), the ceiling for one worker. The load
average is recorded: on a shared machine, compare rows of one run.

    python bench/bench_prepare_data.py [--tokens 5000000] [--repeat 3] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from liveshard.runtime.data.corpus import build_corpus, corpus_texts, default_corpus_dir
from liveshard.runtime.data.prepare import prepare

TARGET_PER_CORE = 1_000_000


def cpu_seconds() -> float:
    """User + system time of this process and of its reaped children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def tokenizer_alone(tokenizer, texts: list[str], repeat: int) -> dict:
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        seconds = []
        for _ in range(repeat):
            start = time.perf_counter()
            tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
            seconds.append(time.perf_counter() - start)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    best = min(seconds)
    return {"what": "tokenizer alone (1 thread, in memory)", "workers": 1, "tokens": tokens,
            "seconds_best": best, "seconds_median": statistics.median(seconds), "seconds_all": seconds,
            "tokens_per_second": tokens / best, "tokens_per_second_per_worker": tokens / best,
            "tokens_per_cpu_second": None, "load_average": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=5_000_000, help="at least this many tokens per run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--corpus-dir", default=default_corpus_dir())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "prepare_data.json"))
    args = parser.parse_args()
    # Imported here, not at the top: prepare's spawned workers re-import this script, and should
    # not pay for megatron-core and torch (seconds each).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from liveshard.runtime.data.tokenizer import load_tokenizer

    corpus = build_corpus(args.corpus_dir)
    tokenizer = load_tokenizer("huggingface", corpus.tokenizer_dir)
    texts = corpus_texts()
    per_copy = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    copies = -(-args.tokens // per_copy)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        source = os.path.join(tmp, "corpus.jsonl")
        with open(source, "w", encoding="utf-8") as f:
            lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
            for _ in range(copies):
                f.write(lines)
        size = os.path.getsize(source)
        print(f"input: {copies} copies of the corpus, {len(texts) * copies:,} documents, {size / 2**20:.1f} MiB; "
              f"tokenizer {corpus.vocab_size} ids; {os.cpu_count()} CPUs\n")
        header = (f"{'what':<36} {'workers':>7} {'tokens':>10} {'best s':>7} {'median s':>8} {'tokens/s':>10} "
                  f"{'per worker':>10} {'tok/CPU-s':>10} {'load':>5}")
        print(header)
        print("-" * len(header))

        alone = tokenizer_alone(tokenizer, texts * copies, args.repeat)
        rows.append(alone)
        print(f"{alone['what']:<36} {1:>7} {alone['tokens']:>10,} {alone['seconds_best']:>7.2f} "
              f"{alone['seconds_median']:>8.2f} {alone['tokens_per_second']:>10,.0f} "
              f"{alone['tokens_per_second']:>10,.0f} {'':>10} {alone['load_average']:>5.1f}")

        for workers in args.workers:
            seconds, cpus, summary = [], [], None
            for i in range(args.repeat):
                start_cpu = cpu_seconds()
                summary = prepare([source], tokenizer, os.path.join(tmp, f"out-{workers}-{i}", "ds"),
                                  workers=workers, append_eod=True, progress=False)
                cpus.append(cpu_seconds() - start_cpu)
                seconds.append(summary.seconds)
            best = min(seconds)
            row = {"what": "prepare (read, tokenize, write)", "workers": workers, "tokens": summary.tokens,
                   "documents": summary.documents, "input_bytes": size, "seconds_best": best,
                   "seconds_median": statistics.median(seconds), "seconds_all": seconds, "cpu_seconds_all": cpus,
                   "tokens_per_second": summary.tokens / best,
                   "tokens_per_second_per_worker": summary.tokens / best / workers,
                   "tokens_per_cpu_second": summary.tokens / min(cpus), "load_average": os.getloadavg()[0]}
            rows.append(row)
            print(f"{row['what']:<36} {workers:>7} {row['tokens']:>10,} {best:>7.2f} {row['seconds_median']:>8.2f} "
                  f"{row['tokens_per_second']:>10,.0f} {row['tokens_per_second_per_worker']:>10,.0f} "
                  f"{row['tokens_per_cpu_second']:>10,.0f} {row['load_average']:>5.1f}")

    best_per_worker = max(r["tokens_per_second_per_worker"] for r in rows if r["what"].startswith("prepare"))
    print(f"\nbest prepare throughput per worker: {best_per_worker:,.0f} tokens/s "
          f"(target {TARGET_PER_CORE:,} per core)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "prepare_data", "target_tokens_per_second_per_core": TARGET_PER_CORE,
        "best_tokens_per_second_per_worker": best_per_worker,
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "source": "pydoc_data.topics"},
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
        "copies": copies, "repeat": args.repeat, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
