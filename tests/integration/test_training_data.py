"""The job's datasets through megatron-core, on a real corpus: blending, splits, the index cache
built once per job (one builder, others wait; nothing half-built is ever trusted)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from liveshard.runtime.contract.training import read_training
from liveshard.runtime.data import datasets
from liveshard.runtime.data.corpus import build_corpus
from liveshard.runtime.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus") / "c"), vocab_size=512)


def _training(corpus, **extra):
    return read_training({"data": {"blend": [{"prefix": corpus.data_prefix, "weight": 2},
                                             {"prefix": corpus.data_prefix, "weight": 1}], "split": "900,90,10"},
                          "tokenizer": {"path": corpus.tokenizer_dir}, "trainIters": 20, "globalBatch": 8,
                          "seqLength": 32, "eval": {"interval": 5, "iters": 2}, **extra})


def _tokenizer(training, padded=512):
    return datasets.load_job_tokenizer(training, padded, padded)


def _build_and_digest(args) -> tuple[str, bytes]:
    root, training_json = args
    from liveshard.runtime.contract.training import TrainingSpec

    t = TrainingSpec.from_json(training_json)
    data = datasets.build_datasets(t, _tokenizer(t), root)
    tokens = data.batch(range(t.train_samples))["tokens"].numpy()
    return data.cache_dir, tokens.tobytes()


@pytest.mark.slow
def test_samples_are_real_text_blended_and_the_same_in_every_process(corpus, tmp_path):
    t = _training(corpus)
    root = str(tmp_path / "cache")
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:  # two workers starting at once: one builds, the other waits for it
        results = pool.map(_build_and_digest, [(root, t.to_json())] * 2)
    assert len({r[0] for r in results}) == 1 and len({r[1] for r in results}) == 1
    entries = sorted(os.listdir(root))
    assert entries == [os.path.basename(results[0][0])]  # no staging directory, no lock left behind
    data = datasets.build_datasets(t, _tokenizer(t), root)  # a joiner: loads the finished cache
    assert len(data.train) >= t.train_samples and len(data.valid) >= t.eval_samples()
    sample = data.train[0]
    assert sample["tokens"].shape == (32,) and bool((sample["labels"][:-1] == sample["tokens"][1:]).all())
    assert float(sample["loss_mask"].sum()) == 32.0
    text = data.tokenizer.detokenize(sample["tokens"].tolist())
    assert sum(c.isalpha() for c in text) > len(text) // 2  # English prose, not noise
    # both datasets of the blend are drawn from, in megatron's proportions
    ids = [int(data.train.dataset_index[i]) for i in range(len(data.train))]
    share = ids.count(0) / len(ids)
    assert 0.6 < share < 0.73
    # the validation split is different text from the train split
    assert not np.array_equal(data.valid[0]["tokens"].numpy(), sample["tokens"].numpy())


def test_a_crash_mid_build_leaves_nothing_that_is_trusted(corpus, tmp_path):
    t = _training(corpus)
    root = tmp_path / "cache"
    root.mkdir()
    key = datasets.cache_key(t, _tokenizer(t))
    half = root / f".staging-{key}-dead"
    half.mkdir()
    (half / "garbage-document_index.npy").write_bytes(b"\x93NUMPY half written")
    lock = root / f"{key}.lock"
    lock.write_text("other-host:123")
    old = time.time() - datasets.LOCK_STALE_SECONDS - 5
    os.utime(lock, (old, old))  # its builder died a while ago
    data = datasets.build_datasets(t, _tokenizer(t), str(root))
    assert data.cache_dir == str(root / key)
    assert not lock.exists()
    reference = datasets.build_datasets(t, _tokenizer(t), str(tmp_path / "fresh"))
    assert np.array_equal(data.batch(range(16))["tokens"].numpy(), reference.batch(range(16))["tokens"].numpy())


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(corpus):
    t = _training(corpus)
    with pytest.raises(ConfigError) as e:
        datasets.load_job_tokenizer(t, 256, 256)
    assert e.value.field.startswith("spec.training.tokenizer") and "vocab" in str(e.value)


def test_a_missing_dataset_names_the_blend_entry(corpus, tmp_path):
    t = read_training({"data": {"blend": [{"prefix": str(tmp_path / "nope")}]},
                       "tokenizer": {"path": corpus.tokenizer_dir}, "trainIters": 2, "globalBatch": 8, "seqLength": 32})
    with pytest.raises(ConfigError) as e:
        datasets.build_datasets(t, _tokenizer(t), str(tmp_path / "cache"))
    assert e.value.field == "spec.training.data.blend[0].prefix" and "prepare-data" in str(e.value)
