"""prepare-data throughput: tokens/s per core with the corpus tokenizer, 1 and 2 workers.

The built-in corpus (``runtime/data/corpus.py``: Python's reference documentation, byte-level BPE
with 4096 ids) is repeated into one JSON-lines file of at least ``--tokens`` tokens; each run
tokenizes it with ``prepare`` into a fresh prefix, EOD appended. Per worker count: best and
median wall time of ``--repeat`` runs, tokens/s, tokens/s per worker, and CPU seconds of this
process and its worker processes together (so tokens per CPU-second charges the reading, JSON
parsing and writing too). As the peer in the same run: the tokenizer alone, the same texts
encoded in memory in the same batches on one thread (the ceiling for one worker) and on the
tokenizer's own Rust thread pool over every core (the alternative to worker processes). Rounds
interleave the configurations; on a shared machine, compare rows of one run.

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
from liveshard.runtime.data.prepare import BATCH_CHARS, prepare

TARGET_PER_CORE = 1_000_000


def cpu_seconds() -> float:
    """User + system time of this process and of its reaped children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def tokenizer_alone(tokenizer, texts: list[str], threads: bool = False) -> tuple[int, float]:
    """Tokens and seconds to encode ``texts`` in memory, in prepare's batch sizes: on this thread,
    or with ``threads`` on the tokenizer's own Rust thread pool (every core)."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    try:
        batches, batch, chars = [], [], 0
        for text in texts:
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                batches.append(batch)
                batch, chars = [], 0
        batches.append(batch)
        start = time.perf_counter()
        tokens = sum(len(ids) for b in batches for ids in tokenizer.encode_batch(b))
        return tokens, time.perf_counter() - start
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


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
        header = (f"{'what':<42} {'workers':>7} {'tokens':>10} {'best s':>7} {'median s':>8} {'tokens/s':>10} "
                  f"{'per worker':>10} {'tok/CPU-s':>10}")

        # Rounds interleave the configurations, so that a busy spell on a shared machine slows
        # one sample of each rather than every sample of one.
        samples: dict[str, list[tuple[float, float, object]]] = {}
        for i in range(args.repeat):
            for key, threads in (("alone", False), ("threads", True)):
                start_cpu = cpu_seconds()
                tokens, seconds = tokenizer_alone(tokenizer, texts * copies, threads=threads)
                samples.setdefault(key, []).append((seconds, cpu_seconds() - start_cpu, tokens))
            for workers in args.workers:
                start_cpu = cpu_seconds()
                summary = prepare([source], tokenizer, os.path.join(tmp, f"out-{workers}-{i}", "ds"),
                                  workers=workers, append_eod=True, progress=False)
                samples.setdefault(str(workers), []).append((summary.seconds, cpu_seconds() - start_cpu, summary))
            print(f"round {i + 1}/{args.repeat} done (load average {os.getloadavg()[0]:.1f})")
        print()
        print(header)
        print("-" * len(header))
        for key, runs in samples.items():
            seconds = [s for s, _, _ in runs]
            cpus = [c for _, c, _ in runs]
            best = min(seconds)
            if key == "alone":
                what, workers, tokens, extra = "tokenizer alone (1 thread, in memory)", 1, runs[0][2], {}
            elif key == "threads":
                what, workers, tokens = "tokenizer alone (Rust threads, in memory)", os.cpu_count() or 1, runs[0][2]
                extra = {}
            else:
                summary = runs[0][2]
                what, workers, tokens = "prepare (read, tokenize, write)", int(key), summary.tokens
                extra = {"documents": summary.documents, "input_bytes": size}
            row = {"what": what, "workers": workers, "tokens": tokens, **extra, "seconds_best": best,
                   "seconds_median": statistics.median(seconds), "seconds_all": seconds, "cpu_seconds_all": cpus,
                   "tokens_per_second": tokens / best, "tokens_per_second_per_worker": tokens / best / workers,
                   "tokens_per_cpu_second": tokens / min(cpus)}
            rows.append(row)
            print(f"{what:<42} {workers:>7} {tokens:>10,} {best:>7.2f} {row['seconds_median']:>8.2f} "
                  f"{row['tokens_per_second']:>10,.0f} {row['tokens_per_second_per_worker']:>10,.0f} "
                  f"{row['tokens_per_cpu_second']:>10,.0f}")

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
