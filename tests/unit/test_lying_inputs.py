"""Inputs that lie are refused up front, in one short line naming the file and what is wrong,
within seconds (issue 37, "every input validated before use"):

- a Megatron indexed dataset whose ``.idx`` does not describe its ``.bin`` (lengths of 2^30,
  negative, x4; pointers off; a wrong dtype code; a truncated ``.bin`` or ``.idx``; a document
  index out of order; token ids outside the tokenizer), by ``run-local --check`` (exit 2) and by
  the check a worker runs before it joins (``datasets._check_prefixes``);
- YAML bombs (aliases of aliases, merge keys, self-reference) and job files over 1 MiB, by every
  command that reads a job file; an error message never echoes more than a short clip of a value;
- tokenizer files over 64 MiB.

The corruptions are drawn (which sequence, by how much, how many levels of aliases, ...): the
tests hold for parameters nobody chose in advance.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from liveshard.dev.cli import run_cli
from liveshard.runtime.data.corpus import build_corpus
from liveshard.runtime.data.indexed import HEADER_BYTES, check_indexed
from liveshard.runtime.errors import ConfigError

SECONDS = 10.0  # a refusal comes at once; this leaves room for a loaded CI machine


class Timer:
    """Wall and CPU seconds of a block: the bound is asserted on the CPU time this process
    spent (the work done, whatever else the machine runs) and, loosely, on the wall time."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.monotonic(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.monotonic() - self.wall, time.process_time() - self.cpu

    def within(self, cpu: float) -> None:
        assert self.cpu < cpu and self.wall < max(SECONDS, cpu), (self.cpu, self.wall)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus") / "corpus"), vocab_size=1000)


# ---- a dataset, read and written field by field -------------------------------------------------
class Index:
    """The fields of a ``.idx``, to change and write back."""

    def __init__(self, path: str) -> None:
        raw = Path(path).read_bytes()
        self.magic = raw[:9]
        self.version, self.code, n, d = struct.unpack("<QBQQ", raw[9:HEADER_BYTES])
        self.n, self.d = n, d
        off = HEADER_BYTES
        self.lengths = np.frombuffer(raw, dtype="<i4", count=n, offset=off).astype(np.int64)
        self.pointers = np.frombuffer(raw, dtype="<i8", count=n, offset=off + 4 * n).copy()
        self.documents = np.frombuffer(raw, dtype="<i8", count=d, offset=off + 12 * n).copy()

    def write(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.magic)
            f.write(struct.pack("<QBQQ", self.version, self.code, self.n, self.d))
            f.write(self.lengths.astype("<i4").tobytes())
            f.write(self.pointers.astype("<i8").tobytes())
            f.write(self.documents.astype("<i8").tobytes())


def _copy(corpus, root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    prefix = str(root / "data")
    for ext in (".bin", ".idx"):
        shutil.copyfile(corpus.data_prefix + ext, prefix + ext)
    return prefix


def _job(root: Path, prefix: str, tokenizer_dir: str) -> Path:
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "lying"},
           "spec": {"model": {"preset": "tiny-gpt", "vocabSize": 1024}, "workers": {"max": 2, "gpusPerWorker": 1},
                    "training": {"data": {"blend": [{"prefix": prefix}], "split": "100,0,0"},
                                 "tokenizer": {"type": "huggingface", "path": tokenizer_dir},
                                 "trainIters": 4, "globalBatch": 4, "microBatch": 1, "seqLength": 32,
                                 "precision": "fp32", "eval": {"interval": 0}}}}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _refused(corpus, prefix: str, *words: str) -> str:
    """``run-local --check`` of a job on ``prefix``: exit 2 within seconds, one line naming the
    file and every one of ``words``."""
    job = _job(Path(prefix).parent, prefix, corpus.tokenizer_dir)
    with Timer() as t:
        r = run_cli("run-local", "--job", str(job), "--check")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("liveshard run-local: error: spec.training.data.blend[0].prefix: "), line
    assert prefix in line and len(line) < 600, line
    for w in words:
        assert w in line, (w, line)
    t.within(SECONDS)
    return line


def test_the_real_dataset_passes_and_megatron_reads_every_sequence(corpus):
    n, docs = check_indexed(corpus.data_prefix, "f", vocab_size=corpus.vocab_size)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(corpus.data_prefix, mmap=True)
    assert (n, docs) == (len(ds), len(ds.document_indices) - 1)
    assert sum(len(ds[i]) for i in range(n)) * 2 == os.path.getsize(corpus.data_prefix + ".bin")


def test_run_local_check_passes_the_real_dataset(corpus, tmp_path):
    r = run_cli("run-local", "--job", str(_job(tmp_path, corpus.data_prefix, corpus.tokenizer_dir)), "--check")
    assert r.returncode == 0, r.stderr


# Each corruption: (what it does to the index and .bin, words the refusal must hold). ``rng``
# draws which sequence and by how much.
def _huge_length(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.lengths[rng.randrange(ix.n)] = rng.choice([2**30, 2**31 - 1, rng.randrange(2**20, 2**31)])


def _negative_length(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.lengths[rng.randrange(ix.n)] = -rng.randrange(1, 2**31)


def _scaled_lengths(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.lengths = ix.lengths * rng.choice([2, 3, 4, 8])


def _one_longer(ix: Index, bin_path: str, rng: random.Random) -> None:
    # stays within the .bin, sums to more than it: only the total tells
    ix.lengths[rng.randrange(ix.n)] += rng.randrange(1, 50)


def _swapped_lengths(ix: Index, bin_path: str, rng: random.Random) -> None:
    # the same total, the spans moved: only the pointers tell
    i = rng.randrange(ix.n - 1)
    while ix.lengths[i] == ix.lengths[i + 1]:
        i = rng.randrange(ix.n - 1)
    ix.lengths[i], ix.lengths[i + 1] = ix.lengths[i + 1], ix.lengths[i]


def _bad_pointer(ix: Index, bin_path: str, rng: random.Random) -> None:
    i = rng.randrange(ix.n)
    ix.pointers[i] = rng.choice([-rng.randrange(1, 2**40), ix.pointers[i] + 2 * rng.randrange(1, 1000),
                                 2**62, os.path.getsize(bin_path) + rng.randrange(0, 100)])


def _wrong_dtype(ix: Index, bin_path: str, rng: random.Random) -> None:
    # the corpus is uint16 (8); int16 (3) reads the same bytes alike below id 32,768 (and ids
    # above it as negative, which the token sample refuses): no lie for this vocabulary
    ix.code = rng.choice([1, 2, 4, 5])


def _float_dtype(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.code = rng.choice([6, 7])


def _unknown_dtype(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.code = rng.choice([0, 9, 42, 255])


def _truncated_bin(ix: Index, bin_path: str, rng: random.Random) -> None:
    size = os.path.getsize(bin_path)
    with open(bin_path, "r+b") as f:
        f.truncate(size - 2 * rng.randrange(1, size // 4))


def _odd_bin(ix: Index, bin_path: str, rng: random.Random) -> None:
    with open(bin_path, "ab") as f:
        f.write(b"\x00")


def _decreasing_documents(ix: Index, bin_path: str, rng: random.Random) -> None:
    k = rng.randrange(1, ix.d - 2)
    ix.documents[k] = ix.documents[k + 1] + rng.randrange(1, 5)


def _documents_past_the_end(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.documents[-1] = ix.n + rng.randrange(1, 10**6)


def _documents_not_from_zero(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.documents[0] = rng.choice([1, -1, 2**40])


def _more_sequences_claimed(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.n += rng.randrange(1, 10**9)


def _bad_magic(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.magic = bytes(rng.randrange(256) for _ in range(9))


def _bad_version(ix: Index, bin_path: str, rng: random.Random) -> None:
    ix.version = rng.choice([0, 2, 2**63])


def _token_outside_vocabulary(ix: Index, bin_path: str, rng: random.Random) -> None:
    data = np.fromfile(bin_path, dtype=np.uint16)
    data[rng.randrange(len(data))] = rng.randrange(1000, 65536)  # the tokenizer has 1000 ids
    data[: len(data) // 64] = rng.randrange(1000, 65536)  # the sample sees it, wherever it falls
    data.tofile(bin_path)


CORRUPTIONS = {
    "lengths of 2^30": (_huge_length, ("more than",)),
    "a negative length": (_negative_length, ("negative length",)),
    "lengths x N": (_scaled_lengths, ("more than",)),
    "one length longer": (_one_longer, ("more than",)),
    "two lengths swapped": (_swapped_lengths, ("starts at byte",)),
    "a bad pointer": (_bad_pointer, ("starts at byte",)),
    "a wrong dtype": (_wrong_dtype, ()),
    "a float dtype": (_float_dtype, ("no token ids",)),
    "an unknown dtype code": (_unknown_dtype, ("names no dtype",)),
    "a truncated .bin": (_truncated_bin, ("truncated",)),
    "an odd-sized .bin": (_odd_bin, ("whole number",)),
    "documents out of order": (_decreasing_documents, ("must not decrease",)),
    "documents past the end": (_documents_past_the_end, ("document index ends at",)),
    "documents not from 0": (_documents_not_from_zero, ("starts at",)),
    "more sequences than written": (_more_sequences_claimed, ("truncated",)),
    "no index magic": (_bad_magic, ("not a Megatron indexed dataset",)),
    "another version": (_bad_version, ("version",)),
    "tokens outside the vocabulary": (_token_outside_vocabulary, ("vocabulary",)),
}


def _corrupt(corpus, root: Path, name: str, seed: int) -> str:
    prefix = _copy(corpus, root)
    ix = Index(prefix + ".idx")
    CORRUPTIONS[name][0](ix, prefix + ".bin", random.Random(seed))
    ix.write(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_lying_index_is_refused_by_run_local_check(corpus, tmp_path, name):
    seed = random.SystemRandom().randrange(2**32)  # unseen: a new draw every run (printed on failure)
    prefix = _corrupt(corpus, tmp_path / "ds", name, seed)
    line = _refused(corpus, prefix, *CORRUPTIONS[name][1])
    assert "fix: " in line, (seed, line)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CORRUPTIONS)), seed=st.integers(0, 2**32 - 1))
def test_every_drawn_corruption_is_refused_in_one_line(corpus, tmp_path_factory, name, seed):
    prefix = _corrupt(corpus, tmp_path_factory.mktemp("ds"), name, seed)
    with pytest.raises(ConfigError) as e:
        check_indexed(prefix, "spec.training.data.blend[0].prefix", vocab_size=corpus.vocab_size)
    text = str(e.value)
    assert "\n" not in text and len(text) < 600 and prefix in text, text
    for w in CORRUPTIONS[name][1]:
        assert w in text, (w, text)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_index_is_refused_or_megatron_reads_it_whole(corpus, tmp_path_factory, data):
    """Random bytes of the index overwritten: either refused, or every sequence megatron reads
    lies within the .bin and they cover it exactly (nothing read twice, nothing out of bounds)."""
    prefix = _copy(corpus, tmp_path_factory.mktemp("ds"))
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    Path(prefix + ".idx").write_bytes(bytes(raw))
    try:
        check_indexed(prefix, "f")
    except ConfigError as e:
        assert "\n" not in str(e) and len(str(e)) < 600
        return
    ix = Index(prefix + ".idx")
    size = os.path.getsize(prefix + ".bin")
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}[ix.code]
    ends = ix.pointers + ix.lengths * itemsize
    assert (ix.lengths >= 0).all() and (ix.pointers >= 0).all() and (ends <= size).all()
    assert ix.pointers[0] == 0 and (ix.pointers[1:] == ends[:-1]).all() and ends[-1] == size


def test_a_large_index_is_checked_in_seconds(tmp_path):
    """5 million sequences (a 60 MB index over a sparse 10 GB .bin): well within the budget a
    worker's start can spare."""
    n = 5_000_000
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=n, dtype=np.int64)
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1] * 2, out=pointers[1:])
    documents = np.arange(0, n + 1, 4, dtype=np.int64)
    documents[-1] = n
    prefix = str(tmp_path / "big")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, len(documents)))
        f.write(lengths.astype("<i4").tobytes() + pointers.tobytes() + documents.tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 2)  # sparse: no disk used
    with Timer() as t:
        assert check_indexed(prefix, "f", vocab_size=1000) == (n, len(documents) - 1)
    t.within(5.0)
    # and the same index lying at its very end is found as fast
    lengths[-1] += 1
    with open(prefix + ".idx", "r+b") as f:
        f.seek(HEADER_BYTES + 4 * (n - 1))
        f.write(struct.pack("<i", int(lengths[-1])))
    with Timer() as t, pytest.raises(ConfigError, match="more than"):
        check_indexed(prefix, "f")
    t.within(5.0)


def test_the_worker_checks_the_index_before_megatron_reads_it(corpus, tmp_path):
    """The check ``build_datasets`` (a worker's start) runs: the same refusal, before megatron's
    builder touches the file."""
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.data.datasets import build_datasets, load_job_tokenizer

    prefix = _corrupt(corpus, tmp_path / "ds", "lengths x N", 1)
    training = read_training({"data": {"blend": [{"prefix": prefix}], "split": "100,0,0"},
                              "tokenizer": {"type": "huggingface", "path": corpus.tokenizer_dir},
                              "trainIters": 4, "globalBatch": 4, "seqLength": 32, "eval": {"interval": 0}})
    tokenizer = load_job_tokenizer(training, 1024, 1024)
    with pytest.raises(ConfigError, match=r"^spec.training.data.blend\[0\].prefix: .*data.idx: the lengths"):
        build_datasets(training, tokenizer, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# ---- job files ----------------------------------------------------------------------------------
BASE_JOB = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "bomb"},
            "spec": {"model": {"preset": "tiny-gpt"}, "workers": {"max": 2, "gpusPerWorker": 1},
                     "training": {"data": {"mock": True}, "trainIters": 4, "globalBatch": 4, "microBatch": 1,
                                  "seqLength": 32, "precision": "fp32", "eval": {"interval": 0}}}}


def _bomb(levels: int, fan: int, leaf: str, shape: str) -> str:
    """A job whose spec.training.data.blend holds ``levels`` levels of ``fan`` aliases each."""
    head = yaml.safe_dump({k: v for k, v in BASE_JOB.items() if k != "spec"}, sort_keys=False)
    lines = [head.rstrip(), "spec:", "  model: {preset: tiny-gpt}", "  workers: {max: 2, gpusPerWorker: 1}",
             "  training:", "    trainIters: 4", "    globalBatch: 4", "    data:"]
    if shape == "lists":
        lines.append("      blend:")
        lines.append(f"        - &a0 {leaf}")
        lines += [f"        - &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels + 1)]
        lines.append(f"        - *a{levels}")
    elif shape == "first":  # the largest value first, where validation looks
        lines.append("      defs:")
        lines.append(f"        - &a0 {leaf}")
        lines += [f"        - &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels + 1)]
        lines.append(f"      blend: [*a{levels}]")
    elif shape == "merge":  # merge keys of merge keys
        lines.append("      defs:")
        lines.append("        m0: &m0 {prefix: /x, weight: 1}")
        lines += [f"        m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * fan) + f"], k{i}: 1}}"
                  for i in range(1, levels + 1)]
        lines.append(f"      blend: [*m{levels}]")
    else:  # mappings
        lines.append(f"      d0: &a0 {{x: {leaf}}}")
        lines += [f"      d{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(fan)) + "}"
                  for i in range(1, levels + 1)]
        lines.append(f"      blend: *a{levels}")
    return "\n".join(lines) + "\n"


def _one_short_line(r, command: str, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[:2000])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 600, r.stderr[:2000]
    assert lines[0].startswith(f"liveshard {command}: error: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


COMMANDS = [("run-local", ("--check",)), ("plan", ("--gpus", "4"))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(levels=st.integers(7, 14), fan=st.integers(8, 12), shape=st.sampled_from(["lists", "first", "merge", "maps"]),
       leaf=st.sampled_from(['"lol"', "{prefix: /x}", "[1, 2, 3]", '"' + "x" * 300 + '"']),
       command=st.sampled_from(COMMANDS))
def test_a_yaml_bomb_is_refused_within_a_second(tmp_path_factory, levels, fan, shape, leaf, command):
    path = tmp_path_factory.mktemp("bomb") / "job.yaml"
    path.write_text(_bomb(levels, fan, leaf, shape))
    name, extra = command
    with Timer() as t:
        r = run_cli(name, "--job", str(path), *extra)
    _one_short_line(r, name, str(path), "aliases")
    t.within(1.0)


@pytest.mark.parametrize("levels", [9, 11])
def test_the_reported_bombs_are_refused_within_a_second(tmp_path, levels):
    path = tmp_path / "job.yaml"
    path.write_text(_bomb(levels, 10, '"lol"', "lists"))
    with Timer() as t:
        r = run_cli("run-local", "--job", str(path), "--check")
    _one_short_line(r, "run-local", "aliases", "1,000,000")
    t.within(1.0)


def test_aliases_within_the_bound_are_read_and_echoed_short(tmp_path):
    """Four levels of ten (10^4 values) is no bomb: read, and the error about it quotes at most a
    short clip of the value."""
    path = tmp_path / "job.yaml"
    path.write_text(_bomb(4, 10, '"' + "y" * 5000 + '"', "first"))
    line = _one_short_line(run_cli("run-local", "--job", str(path), "--check"), "run-local",
                           "spec.training.data.blend[0]")
    assert "y" * 201 not in line


def test_a_self_referencing_alias_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE_JOB, sort_keys=False).replace("  training:\n", "  loop: &r [*r, 1]\n  training:\n"))
    _one_short_line(run_cli("run-local", "--job", str(path), "--check"), "run-local", "recursive")


@pytest.mark.parametrize("size", [(1 << 20) + 1, 11 << 20])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_job_file_over_1_mib_is_refused_at_once(tmp_path, size, command):
    text = yaml.safe_dump(BASE_JOB, sort_keys=False)
    path = tmp_path / "job.yaml"
    path.write_text(text + "# " + "p" * (size - len(text)) + "\n")  # a valid manifest, with a long comment
    assert path.stat().st_size > 1 << 20
    name, extra = command
    with Timer() as t:
        r = run_cli(name, "--job", str(path), *extra)
    _one_short_line(r, name, str(path), "1 MiB")
    t.within(1.0)


def test_a_job_file_just_under_1_mib_is_read(tmp_path):
    text = yaml.safe_dump(BASE_JOB, sort_keys=False)
    path = tmp_path / "job.yaml"
    path.write_text(text + "# " + "p" * ((1 << 20) - len(text) - 4) + "\n")
    assert (1 << 20) - 8 < path.stat().st_size <= 1 << 20
    r = run_cli("run-local", "--job", str(path), "--check")
    assert r.returncode == 0, r.stderr


def test_an_endless_job_file_is_refused(tmp_path):
    _one_short_line(run_cli("run-local", "--job", "/dev/zero", "--check"), "run-local", "1 MiB")


def test_the_operator_handed_spec_is_capped():
    from liveshard.runtime.contract.training import TrainingSpec

    with pytest.raises(ConfigError, match="over the 1 MiB"):
        TrainingSpec.from_json('{"data": {"mock": true}, "pad": "' + "p" * (1 << 20) + '"}')


@pytest.mark.parametrize("value", [
    "x" * 10**6, ["a"] * 10**5, {f"k{i}": i for i in range(10**4)}, [[[[[[["deep"]]]]]]], 1e308,
])
def test_spec_errors_quote_a_short_clip_of_the_value(value):
    from liveshard.runtime.contract.training import read_training

    for section in ({"data": {"mock": value}}, {"data": {"mock": True}, "precision": value},
                    {"data": {"blend": [value]}}, {"data": {"mock": True}, "optimizer": {"lr": value}}):
        with pytest.raises(ConfigError) as e:
            read_training(section)
        assert len(str(e.value)) < 600, str(e.value)[:1000]


def test_an_unknown_model_field_with_a_huge_name_is_short(tmp_path):
    from liveshard.runtime.spec import model_fields

    with pytest.raises(ConfigError) as e:
        model_fields({"k" * 10**6: 1})
    assert len(str(e.value)) < 1500


# ---- tokenizer files ----------------------------------------------------------------------------
def test_a_tokenizer_file_over_64_mib_is_refused(corpus, tmp_path):
    from liveshard.runtime.data.tokenizer import load_tokenizer

    big = tmp_path / "tok"
    big.mkdir()
    with open(big / "tokenizer.json", "wb") as f:
        f.write(Path(corpus.tokenizer_dir, "tokenizer.json").read_bytes())
        f.truncate((64 << 20) + 1)  # sparse
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"^t\.path: .*tokenizer.json is 67,108,865 bytes, over the 64 MiB"):
        load_tokenizer("huggingface", str(big), field="t")
    sp = tmp_path / "sp.model"
    with open(sp, "wb") as f:
        f.truncate(100 << 20)
    with pytest.raises(ConfigError, match="over the 64 MiB"):
        load_tokenizer("sentencepiece", str(sp), field="t")
    assert time.monotonic() - start < SECONDS


def test_prepare_data_refuses_a_huge_tokenizer_in_one_line(corpus, tmp_path):
    big = tmp_path / "tok"
    big.mkdir()
    with open(big / "tokenizer.json", "wb") as f:
        f.truncate(400 << 20)
    r = run_cli("prepare-data", "--input", corpus.jsonl, "--tokenizer", str(big),
                "--output-prefix", str(tmp_path / "out" / "x"))
    _one_short_line(r, "prepare-data", "64 MiB")


def test_export_refuses_a_huge_tokenizer_file_before_writing(tmp_path):
    from liveshard.runtime.hf.weights import tokenizer_files

    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    with open(src / "merges.txt", "wb") as f:
        f.truncate(65 << 20)
    with pytest.raises(ConfigError, match=r"merges\.txt is 68,157,440 bytes, over the 64 MiB"):
        tokenizer_files(src)


@pytest.mark.parametrize("what", ["bomb", "oversize"])
def test_a_worker_refuses_a_bad_job_file_before_it_connects(tmp_path, what):
    """``liveshard worker --job``: the same bounded loader, one error line, exit 2 (the
    coordinator address leads nowhere: it is never reached)."""
    import subprocess
    import sys

    path = tmp_path / "job.yaml"
    if what == "bomb":
        path.write_text(_bomb(11, 10, '"lol"', "lists"))
    else:
        text = yaml.safe_dump(BASE_JOB, sort_keys=False)
        path.write_text(text + "# " + "p" * (2 << 20) + "\n")
    r = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "worker", "--job", str(path),
                        "--coordinator", "127.0.0.1:9", "--local-workers", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("liveshard worker: error: --job: ") and len(last) < 600, last
    assert ("aliases" if what == "bomb" else "1 MiB") in last, last


# ---- checkpoints of another precision ---------------------------------------------------------------
def _checkpoint_of(directory: Path, precision: str, contents: str | None = None) -> Path:
    """A torch_dist directory (real DCP metadata) whose liveshard.json says which precision its
    run trained in."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(directory), no_dist=True)
    meta = {"step": 4, "consumed_samples": 16, "config": "tp=1,pp=1,dp=1,ep=1",
            "model": {"name": "tiny-gpt", "params_dtype": precision}}
    if contents:
        meta["contents"] = contents
    (directory / "liveshard.json").write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize("saved,job", [("fp32", "bf16"), ("bf16", "fp32"), ("fp16", "bf16"), ("bf16", "fp16")])
def test_resuming_a_checkpoint_of_another_precision_is_refused_up_front(tmp_path, saved, job):
    ckpt = _checkpoint_of(tmp_path / "ckpt", saved)
    copy_job = {**BASE_JOB, "spec": {**BASE_JOB["spec"], "training": {
        **BASE_JOB["spec"]["training"], "precision": job, "resume": {"path": str(ckpt)}}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(copy_job, sort_keys=False))
    with Timer() as t:
        r = run_cli("run-local", "--job", str(path), "--check")
    line = _one_short_line(r, "run-local", "spec.training.resume", str(ckpt), f"training in {saved}",
                           f"trains in {job}", f"precision: {saved}", "initialWeights")
    assert "KeyError" not in line
    t.within(SECONDS)


def test_a_checkpoint_of_the_same_precision_or_weights_alone_passes(tmp_path):
    from dataclasses import replace

    from liveshard.runtime.agent.checkpoint import check_precision
    from liveshard.runtime.presets import PRESETS

    spec = replace(PRESETS["tiny-gpt"], params_dtype="bf16")
    check_precision(spec, _checkpoint_of(tmp_path / "same", "bf16"), "f")
    check_precision(spec, _checkpoint_of(tmp_path / "weights", "fp32", contents="model"), "f")  # an import
    (tmp_path / "megatron-lm").mkdir()
    check_precision(spec, tmp_path / "megatron-lm", "f")  # no liveshard.json: nothing recorded
    with pytest.raises(ConfigError, match=r"^spec\.training\.precision: .* training in fp32; this job trains in bf16"):
        check_precision(spec, _checkpoint_of(tmp_path / "other", "fp32"), "spec.training.precision")


@pytest.mark.parametrize("workers,append_eod", [(1, True), (2, True), (2, False)])
def test_every_dataset_prepare_data_writes_passes_the_check(corpus, tmp_path, workers, append_eod):
    """No false refusal: what liveshard prepare-data (megatron's writer) writes, with worker
    processes or without, with end-of-document tokens or without, empty documents skipped."""
    import json

    from liveshard.runtime.data.prepare import prepare
    from liveshard.runtime.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("huggingface", corpus.tokenizer_dir)
    lines = Path(corpus.jsonl).read_text().splitlines()
    extra = tmp_path / "extra.jsonl"
    extra.write_text("\n".join([json.dumps({"text": ""}), json.dumps({"text": "x"}), *lines[:5]]) + "\n")
    prefix = str(tmp_path / "ds")
    prepare([corpus.jsonl, str(extra)], tokenizer, prefix, workers=workers, append_eod=append_eod, progress=False)
    n, docs = check_indexed(prefix, "f", vocab_size=tokenizer.vocab_size)
    assert n >= docs > len(lines)


def test_a_blend_of_more_datasets_than_a_job_reads_is_refused_at_once(tmp_path):
    """300,000 aliases of one long path fit in 1 MiB and under the expansion bound: refused by
    the blend's own bound, before any per-dataset work."""
    text = yaml.safe_dump(BASE_JOB, sort_keys=False).replace("    data:\n      mock: true\n", "")
    text = text.replace("  training:\n", "  training:\n    data:\n      defs: [&s \"/tmp/" + "x" * 100_000 + "\"]\n"
                        "      blend: [" + ",".join(["*s"] * 300_000) + "]\n")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert path.stat().st_size <= 1 << 20
    with Timer() as t:
        r = run_cli("run-local", "--job", str(path), "--check")
    _one_short_line(r, "run-local", "spec.training.data.blend", "300,000 datasets", "10,000")
    t.within(2.0)
