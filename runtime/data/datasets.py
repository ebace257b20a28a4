"""The job's datasets through megatron-core: blending, splits, shuffling and sample indices are megatron's.

``build_datasets`` gives the train and validation datasets of a ``TrainingSpec``:
``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig`` over ``GPTDataset`` (indexed data)
or ``MockGPTDataset`` (``data.mock``). Sample ``i`` of the train dataset is a pure function of
the spec and ``i``, so the sample cursor (``consumed_samples``) is the whole data position: after
any reconfiguration, kill or restore the next step reads samples ``[cursor, cursor + global
batch)``, whatever the layout.

Megatron's index cache (document, sample and shuffle indices) is built once per job on the shared
checkpoint volume: one process builds it while the others wait on a lock file, into a staging
directory that is renamed into place only when complete, so a crash mid-build leaves nothing that
is later trusted, and a joiner loads the finished cache instead of building it. Datasets are built
before a process joins any training world: no collective is involved, whatever the world does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.errors import ConfigError, clip

log = logging.getLogger("liveshard.data")

LOCK_STALE_SECONDS = 60.0  # a builder refreshes its lock every few seconds; older means it died


class MockTokenizer:
    """What megatron's mock dataset needs of a tokenizer when a job has none: its vocabulary
    size and end-of-document id (the model's last token id)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1
        self.unique_identifiers = {"class": "MockTokenizer", "vocab_size": vocab_size}


@dataclass
class JobData:
    """The datasets one process reads: ``train[i]`` and ``valid[i]`` are megatron sample dicts
    (``tokens``, ``labels``, ``loss_mask``, ``position_ids``) of ``seq_length`` tokens."""

    train: Any
    valid: Any | None
    tokenizer: Any
    cache_dir: str | None
    seconds: float  # spent building or loading

    def batch(self, indices: range | list[int], split: str = "train") -> dict[str, Any]:
        """The samples ``indices`` of ``split`` stacked into one batch (torch tensors)."""
        import torch

        dataset = self.train if split == "train" else self.valid
        if dataset is None:
            raise ValueError(f"the job has no {split} split")
        samples = [dataset[i] for i in indices]
        return {key: torch.stack([s[key] for s in samples])
                for key in ("tokens", "labels", "loss_mask", "position_ids")}


def sample_counts(training: TrainingSpec) -> list[int]:
    """Samples megatron must index per split (train, valid, test)."""
    return [training.train_samples, training.eval_samples(), 0]


def load_job_tokenizer(training: TrainingSpec, vocab_size: int, padded_vocab_size: int) -> Any:
    """The job's tokenizer, checked against the model's (padded) vocabulary; with mock data and
    no tokenizer, a stand-in with the model's vocabulary."""
    if training.tokenizer is None:
        return MockTokenizer(vocab_size)
    from liveshard.runtime.data.tokenizer import check_vocab, load_tokenizer

    tokenizer = load_tokenizer(training.tokenizer.type, training.tokenizer.path)
    check_vocab(tokenizer, padded_vocab_size)
    return tokenizer


# Bytes of megatron's indices per sample (``GPTDataset``: a sample index of two int64 offsets
# and a shuffle index entry, with the document index's share; measured well under this).
INDEX_BYTES_PER_SAMPLE = 32


def check_index_memory(training: TrainingSpec, processes: int = 1, memory_bytes: int | None = None) -> None:
    """The sample indices megatron builds in every process for this run's samples fit in this
    machine's memory (``memory_bytes``: its RAM), ``processes`` of them at once: a run that asks
    for more steps than that would be killed while building them, long after it started."""
    if memory_bytes is None:
        import psutil

        memory_bytes = psutil.virtual_memory().total
    samples = sum(sample_counts(training))
    need = samples * INDEX_BYTES_PER_SAMPLE * processes
    if need > memory_bytes:
        raise ConfigError("spec.training.trainIters",
                          f"{training.train_iters:,} steps of globalBatch={training.global_batch} are {samples:,} "
                          f"samples, whose megatron sample index needs ~{need / 2**30:,.1f} GiB in {processes} "
                          f"process(es); this machine has {memory_bytes / 2**30:,.1f} GiB",
                          "train for fewer steps, or run where the index fits")


def check_data(training: TrainingSpec, vocab_size: int, padded_vocab_size: int, processes: int = 1) -> None:
    """What a worker checks before it joins, checked up front (``run-local``, ``processes``
    workers on this machine): the tokenizer loads and fits the model, megatron's sample index fits
    in memory, every dataset exists, its index agrees with its ``.bin`` (``indexed.check_indexed``)
    and every split the job reads holds documents."""
    check_index_memory(training, processes)
    tokenizer = load_job_tokenizer(training, vocab_size, padded_vocab_size)
    if not training.data.mock:
        _check_prefixes(training, _vocab_size(tokenizer))
        _check_splits(training)


def _vocab_size(tokenizer: Any) -> int | None:
    """The ids a tokenizer can produce (its ``vocab_size``), if it says."""
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _check_prefixes(training: TrainingSpec, vocab_size: int | None = None) -> None:
    """Every dataset of the blend exists and its ``.idx`` tells the truth about its ``.bin``
    (header, dtype, lengths, pointers, document indices, the files' lengths; a sample of its
    token ids within ``vocab_size``): refused in one line naming the file before megatron reads it."""
    from liveshard.runtime.data.indexed import check_indexed

    for i, ref in enumerate(training.data.blend):
        field = f"spec.training.data.blend[{i}].prefix"
        for ext in (".bin", ".idx"):
            if not os.path.isfile(ref.prefix + ext):
                raise ConfigError(field,
                                  f"{clip(ref.prefix + ext, 500)} does not exist (or is not readable)",
                                  "run liveshard prepare-data to write PREFIX.bin and PREFIX.idx, on a volume "
                                  "every worker mounts")
        check_indexed(ref.prefix, field, vocab_size)


def _config(training: TrainingSpec, tokenizer: Any, path_to_cache: str | None) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    d = training.data
    blend = None if d.mock else ([r.prefix for r in d.blend], [r.weight for r in d.blend])
    config = GPTDatasetConfig(
        random_seed=training.seed,
        sequence_length=training.seq_length,
        blend=blend,
        split=d.split,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the trainer hands the model one causal mask for every sample
        mmap_bin_files=True,
    )
    # A split the job reads nothing from is not indexed at all (megatron would loop forever
    # looking for its tokens when it holds no document); the others keep their boundaries.
    for i, wanted in enumerate(sample_counts(training)):
        if not wanted:
            config.split_matrix[i] = None
    return config


def _check_splits(training: TrainingSpec) -> None:
    """Every split the job reads from holds documents of every dataset, with megatron's own
    boundaries (``split_matrix``); an empty one is named here, where megatron would hang."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(training.data.split))
    names = ("train", "valid", "test")
    for i, ref in enumerate(training.data.blend):
        docs = len(IndexedDataset(ref.prefix, mmap=True).document_indices) - 1
        for k, wanted in enumerate(sample_counts(training)):
            if not wanted or matrix[k] is None:
                continue
            start, end = (round(x * docs) for x in matrix[k])
            if end <= start:
                raise ConfigError(f"spec.training.data.blend[{i}].prefix",
                                  f"{ref.prefix} has {docs} documents: its {names[k]} part of split "
                                  f"{training.data.split!r} holds none",
                                  "give that part a larger weight, or use a larger corpus"
                                  + (" (or set eval.interval: 0)" if k == 1 else ""))


def _mock_dataset_class(seq_length: int) -> type:
    """megatron's ``MockGPTDataset`` over a corpus sized for a job rather than its fixed 100,000
    documents of up to 4,096 tokens (seconds of indexing per process for a test's few hundred
    samples): 4,096 documents of 1 to ``4 * seq_length`` tokens, epochs repeating as megatron does."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset

    low = type("MockDocuments", (MockGPTLowLevelDataset,), {"size": 4096, "max_sequence_length": 4 * seq_length})
    return type("MockGPTDataset", (MockGPTDataset,), {
        "build_low_level_dataset": staticmethod(lambda path, config: low(config.tokenizer)),
        "numel_low_level_dataset": staticmethod(lambda dataset: len(dataset)),
    })


def _build(training: TrainingSpec, tokenizer: Any, path_to_cache: str | None) -> list[Any]:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    cls = _mock_dataset_class(training.seq_length) if training.data.mock else GPTDataset
    config = _config(training, tokenizer, path_to_cache)
    with _quiet_megatron(), _sole_builder():
        return BlendedMegatronDatasetBuilder(cls, sample_counts(training), lambda: True, config).build()


def cache_key(training: TrainingSpec, tokenizer: Any) -> str:
    """A digest of everything the index cache depends on: one cache directory per distinct job data."""
    d = training.data
    ident = getattr(tokenizer, "unique_identifiers", {"class": type(tokenizer).__name__})
    payload = {"blend": [(r.prefix, r.weight) for r in d.blend], "split": d.split, "seed": training.seed,
               "seq": training.seq_length, "samples": sample_counts(training), "tokenizer": ident}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_datasets(training: TrainingSpec, tokenizer: Any, cache_root: str | None) -> JobData:
    """The job's train and validation datasets, building megatron's index cache once per job.

    ``cache_root``: the shared directory for the cache (``data.cacheDir``, else the checkpoint
    directory's ``data-cache``); None: a per-machine temporary directory. Mock data needs none.
    """
    start = time.perf_counter()
    if training.data.mock:
        train, valid, _ = _build(training, tokenizer, None)
        return JobData(train, valid, tokenizer, None, time.perf_counter() - start)
    _check_prefixes(training, _vocab_size(tokenizer))
    _check_splits(training)
    root = Path(cache_root or os.path.join(tempfile.gettempdir(), "liveshard-data-cache"))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("spec.training.data.cacheDir", f"cannot create {root}: {e.strerror}",
                          "point cacheDir (or spec.checkpoint.path) at a writable shared volume") from None
    final = root / cache_key(training, tokenizer)
    if not final.is_dir():
        with _build_lock(root / f"{final.name}.lock"):
            if not final.is_dir():  # nobody finished it while we waited
                staging = Path(tempfile.mkdtemp(prefix=f".staging-{final.name}-", dir=root))
                try:
                    _build(training, tokenizer, str(staging))
                    os.rename(staging, final)  # atomic: the cache appears complete or not at all
                    log.info("built the dataset index cache in %s (%.1f s)", final, time.perf_counter() - start)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
    train, valid, _ = _build(training, tokenizer, str(final))  # every index file is a cache hit now
    return JobData(train, valid, tokenizer, str(final), time.perf_counter() - start)


@contextlib.contextmanager
def _build_lock(path: Path, poll: float = 0.2) -> Iterator[None]:
    """One builder at a time: an exclusively created lock file, refreshed while held. A lock
    nobody refreshed for ``LOCK_STALE_SECONDS`` belonged to a process that died: it is taken
    over. Works on any shared file system that has atomic exclusive create (NFS v3+ included)."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.write(fd, me.encode())
            os.close(fd)
            break
        except FileExistsError:
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > LOCK_STALE_SECONDS:
                log.warning("taking over the stale dataset cache lock %s (%.0f s old)", path, age)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            time.sleep(poll)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(LOCK_STALE_SECONDS / 6):
            with contextlib.suppress(OSError):
                os.utime(path)

    keeper = threading.Thread(target=refresh, name="data-cache-lock", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _sole_builder() -> Iterator[None]:
    """Datasets are built before the process joins any world, as the only builder (the lock
    sees to that). megatron-core 0.16's ``BlendedDataset`` asks ``torch.distributed.get_rank()``
    on a cache miss without checking that a process group exists (``GPTDataset`` does check):
    outside a world, this process is rank 0 of its own build."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    real = dist.get_rank
    dist.get_rank = lambda group=None: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.get_rank = real  # type: ignore[assignment]


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    """megatron logs every index it builds or loads at INFO: keep the worker's log for training."""
    logger = logging.getLogger("megatron.core.datasets")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "Unable to save ... indexes" for mock data, which has no cache
    try:
        yield
    finally:
        logger.setLevel(level)
