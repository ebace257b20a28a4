"""Tokenizers, ``prepare`` (text → Megatron .bin/.idx) and the built-in corpus.

Datasets are read back with megatron-core's own ``IndexedDataset`` and compared with the
tokenizer's ids for the input text; the corpus's tokenizer is checked to drive megatron's
``GPTDataset``.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizerBase

from liveshard.runtime.data import prepare as prepare_module
from liveshard.runtime.data.corpus import build_corpus, corpus_texts, default_corpus_dir
from liveshard.runtime.data.prepare import prepare
from liveshard.runtime.data.tokenizer import check_vocab, default_kind, load_tokenizer
from liveshard.runtime.errors import ConfigError

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: naïve café, 東京, emoji 🙂 and tabs\tand\nnew lines.",
    "def f(x):\n    return x * 2\n",
    "A second paragraph of plain English, long enough to merge a few pairs of bytes.",
]


def _train_hf(directory: Path, special_tokens: list[str], vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts()[:10] + SAMPLE_TEXTS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _train_hf(tmp_path_factory.mktemp("hf"), ["<|endoftext|>"])


@pytest.fixture(scope="module")
def hf(hf_dir):
    return load_tokenizer("huggingface", str(hf_dir))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    import sentencepiece

    root = tmp_path_factory.mktemp("sp")
    text = root / "train.txt"
    text.write_text("\n".join(corpus_texts()[:20]), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(root / "sp"), vocab_size=300,
                                             model_type="bpe", num_threads=1, minloglevel=2)
    return root / "sp.model"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus") / "corpus"), vocab_size=1000)


def _write_jsonl(path: Path, texts: list, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _documents(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    # one sequence per document, in order
    assert list(ds.document_indices) == list(range(len(ds) + 1))
    return [ds[i].tolist() for i in range(len(ds))]


def _leftovers(prefix: Path) -> list[str]:
    if not prefix.parent.exists():
        return []
    return sorted(p.name for p in prefix.parent.iterdir())


# -- tokenizers ---------------------------------------------------------------------------------------


def test_huggingface_tokenizer_from_directory_and_file(hf_dir, hf):
    from_file = load_tokenizer("huggingface", str(hf_dir / "tokenizer.json"))
    assert isinstance(hf, MegatronTokenizerBase)
    assert (hf.kind, hf.path, hf.name) == ("huggingface", str(hf_dir), hf_dir.name)
    assert hf.vocab_size == from_file.vocab_size == 300
    assert hf.eod == hf.vocab["<|endoftext|>"] == 0
    assert hf.pad == -1 and hf.own_pad is None
    for text in SAMPLE_TEXTS:
        ids = hf.tokenize(text)
        assert ids == from_file.tokenize(text)
        assert all(0 <= i < hf.vocab_size for i in ids)
        assert hf.detokenize(ids) == text  # byte-level BPE is lossless
        assert hf.detokenize(np.array(ids, dtype=np.uint16)) == text
    assert hf.encode_batch(SAMPLE_TEXTS) == [hf.tokenize(t) for t in SAMPLE_TEXTS]
    assert hf.detokenize([*hf.tokenize("end"), hf.eod]) == "end<|endoftext|>"


@pytest.mark.parametrize("specials, eod", [
    (["</s>", "<|im_end|>"], "</s>"),
    (["<|im_end|>", "<eos>"], "<eos>"),
    (["[EOS]", "<|end_of_text|>", "<|endoftext|>"], "<|endoftext|>"),
    (["<|im_end|>"], "<|im_end|>"),
])
def test_huggingface_end_of_document_token_in_order_of_preference(tmp_path, specials, eod):
    tok = load_tokenizer("huggingface", str(_train_hf(tmp_path, specials)))
    assert tok.eod == tok.vocab[eod]


def test_huggingface_without_end_of_document_token_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_tokenizer("huggingface", str(_train_hf(tmp_path, ["<unk>"])), field="spec.training.tokenizer")
    assert e.value.field == "spec.training.tokenizer.path"
    assert "<|endoftext|>" in e.value.problem and e.value.fix


def test_huggingface_vocab_size_counts_added_tokens(tmp_path, hf_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    raw.add_special_tokens(["<|pad|>", "<|user|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer("huggingface", str(tmp_path))
    assert tok.vocab_size == 302
    assert tok.own_pad == 300 and tok.pad == -1  # megatron's "no pad": never masks real tokens


def test_sentencepiece_tokenizer(sp_model):
    tok = load_tokenizer("sentencepiece", str(sp_model))
    assert isinstance(tok, MegatronTokenizerBase)
    assert (tok.kind, tok.name, tok.vocab_size) == ("sentencepiece", "sp", 300)
    assert tok.eod == 2 and tok.pad == -1  # SentencePiece's default eos id; no pad piece
    ids = tok.tokenize("Assert statements are a convenient way")
    assert ids and tok.detokenize(ids) == "Assert statements are a convenient way"
    assert tok.encode_batch(["a b", "c"]) == [tok.tokenize("a b"), tok.tokenize("c")]


@pytest.mark.parametrize("kind", ["huggingface", "sentencepiece"])
def test_tokenizer_pickles_as_its_type_and_path(kind, hf_dir, sp_model):
    path = str(hf_dir if kind == "huggingface" else sp_model)
    tok = load_tokenizer(kind, path)
    payload = pickle.dumps(tok)
    assert len(payload) < 1000  # the two strings, not the library object
    again = pickle.loads(payload)
    assert (again.kind, again.path, again.vocab_size, again.eod) == (kind, path, tok.vocab_size, tok.eod)
    assert again.tokenize("hello there") == tok.tokenize("hello there")


def _bad_tokenizer(tmp_path: Path, case: str) -> tuple[str, str]:
    if case == "missing dir":
        return "huggingface", str(tmp_path / "nope")
    if case == "dir without tokenizer.json":
        return "huggingface", str(tmp_path)
    if case == "not JSON":
        (tmp_path / "tokenizer.json").write_text("{ not json")
        return "huggingface", str(tmp_path)
    if case == "JSON but not a tokenizer":
        (tmp_path / "tokenizer.json").write_text('{"model": 3}')
        return "huggingface", str(tmp_path / "tokenizer.json")
    if case == "missing .model":
        return "sentencepiece", str(tmp_path / "x.model")
    if case == "not a .model":
        (tmp_path / "x.model").write_bytes(b"not a sentencepiece model")
        return "sentencepiece", str(tmp_path / "x.model")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing dir", "dir without tokenizer.json", "not JSON", "JSON but not a tokenizer",
                                  "missing .model", "not a .model"])
def test_bad_tokenizer_path_names_the_field(tmp_path, case):
    kind, path = _bad_tokenizer(tmp_path, case)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(kind, path, field="spec.training.tokenizer")
    assert e.value.field == "spec.training.tokenizer.path"
    assert e.value.fix
    assert "\n" not in str(e.value)


def test_unknown_tokenizer_type():
    with pytest.raises(ConfigError) as e:
        load_tokenizer("tiktoken", "/x", field="spec.training.tokenizer")
    assert e.value.field == "spec.training.tokenizer.type"
    assert "huggingface" in e.value.fix


def test_default_kind_follows_the_extension():
    assert default_kind("models/llama/tokenizer.model") == "sentencepiece"
    assert default_kind("models/gpt2") == "huggingface"
    assert default_kind("models/gpt2/tokenizer.json") == "huggingface"


def test_check_vocab(hf):
    check_vocab(hf, 300)
    check_vocab(hf, 512)
    with pytest.raises(ConfigError) as e:
        check_vocab(hf, 256, field="spec.training.tokenizer")
    assert e.value.field == "spec.training.tokenizer"
    assert "at least 300" in e.value.fix


# -- prepare -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("append_eod", [False, True])
def test_round_trip_jsonl_and_text(tmp_path, hf, append_eod):
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    txt = tmp_path / "notes.txt"
    txt.write_text("first paragraph\nstill first\n\n  \n\nsecond paragraph\r\n\nthird\n", encoding="utf-8")
    prefix = tmp_path / "out" / "ds"
    summary = prepare([str(jsonl), str(txt)], hf, str(prefix), append_eod=append_eod, progress=False)

    texts = [*SAMPLE_TEXTS, "first paragraph\nstill first", "second paragraph", "third"]
    expected = [[*ids, hf.eod] if append_eod else ids for ids in hf.encode_batch(texts)]
    assert _documents(str(prefix)) == expected
    assert IndexedDataset(str(prefix)).index.dtype == np.uint16  # vocab 300: megatron's optimal dtype
    assert summary.documents == len(texts) and summary.skipped_empty == 0
    assert summary.tokens == sum(map(len, expected))
    assert summary.bin_path == f"{prefix}.bin" and summary.idx_path == f"{prefix}.idx"
    assert summary.tokens_per_second > 0
    assert f"{summary.documents:,} documents" in summary.describe() and f"{prefix}.idx" in summary.describe()
    assert _leftovers(prefix) == ["ds.bin", "ds.idx"]


def test_workers_keep_input_order_and_bytes(tmp_path, hf, monkeypatch):
    # Small batches: many batches in flight at once across the two worker processes.
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 2000)
    texts = [f"document {i}: " + " ".join(corpus_texts()[i % 79].split()[: 20 + (i * 37) % 400]) for i in range(300)]
    inputs = [str(_write_jsonl(tmp_path / "a.jsonl", texts[:200])), str(_write_jsonl(tmp_path / "b.jsonl", texts[200:]))]
    one = prepare(inputs, hf, str(tmp_path / "one"), append_eod=True, workers=1, progress=False)
    two = prepare(inputs, hf, str(tmp_path / "two"), append_eod=True, workers=2, progress=False)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()
    assert (one.documents, one.tokens) == (two.documents, two.tokens)
    assert _documents(str(tmp_path / "two")) == [[*ids, hf.eod] for ids in hf.encode_batch(texts)]


def test_sentencepiece_workers(tmp_path, sp_model):
    tok = load_tokenizer("sentencepiece", str(sp_model))
    inputs = [str(_write_jsonl(tmp_path / "a.jsonl", SAMPLE_TEXTS * 3))]
    prepare(inputs, tok, str(tmp_path / "one"), workers=1, append_eod=True, progress=False)
    prepare(inputs, tok, str(tmp_path / "two"), workers=2, append_eod=True, progress=False)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert _documents(str(tmp_path / "one")) == [[*ids, tok.eod] for ids in tok.encode_batch(SAMPLE_TEXTS * 3)]


def test_gzip_input_equals_plain(tmp_path, hf):
    plain = _write_jsonl(tmp_path / "d.jsonl", SAMPLE_TEXTS)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    prepare([str(plain)], hf, str(tmp_path / "plain"), progress=False)
    prepare([str(packed)], hf, str(tmp_path / "packed"), progress=False)
    assert (tmp_path / "plain.bin").read_bytes() == (tmp_path / "packed.bin").read_bytes()
    assert (tmp_path / "plain.idx").read_bytes() == (tmp_path / "packed.idx").read_bytes()


def test_empty_documents_are_skipped_and_counted(tmp_path, hf):
    jsonl = _write_jsonl(tmp_path / "d.jsonl", ["", "one", "", "", "two"])
    with open(jsonl, "a") as f:
        f.write("\n   \n")  # blank lines in JSON lines are not documents
    summary = prepare([str(jsonl)], hf, str(tmp_path / "ds"), append_eod=True, progress=False)
    assert (summary.documents, summary.skipped_empty) == (2, 3)
    assert _documents(str(tmp_path / "ds")) == [[*hf.tokenize("one"), hf.eod], [*hf.tokenize("two"), hf.eod]]
    assert "3 empty skipped" in summary.describe()


def test_progress_bar_on_stderr(tmp_path, hf, capsys):
    prepare([str(_write_jsonl(tmp_path / "d.jsonl", SAMPLE_TEXTS))], hf, str(tmp_path / "ds"), progress=True)
    err = capsys.readouterr().err
    assert "prepare-data" in err and "4 docs" in err and "tok/s" in err
    prepare([str(tmp_path / "d.jsonl")], hf, str(tmp_path / "ds2"), progress=False)
    assert capsys.readouterr().err == ""


GOOD = [json.dumps({"text": f"good document number {i}"}) for i in range(50)]

BAD_INPUTS = {
    # name: (file name, content, line named in the error or None, words in the problem)
    "missing key": ("d.jsonl", [*GOOD, '{"content": "x"}'], 51, ['no "text" key', "'content'"]),
    "invalid JSON": ("d.jsonl", [*GOOD, '{"text": "unterminated'], 51, ["not valid JSON"]),
    "non-string text": ("d.jsonl", [*GOOD, '{"text": 42}'], 51, ["number, not a string"]),
    "null text": ("d.jsonl", [*GOOD, '{"text": null}'], 51, ["null, not a string"]),
    "JSON array file": ("d.json", ['[{"text": "a"},', '{"text": "b"}]'], 1, ["looks like one JSON array"]),
    "JSON array line": ("d.json", ['[{"text": "a"}]'], 1, ["a JSON array, not an object"]),
    "empty file": ("d.jsonl", [], None, ["no documents"]),
    "only empty texts": ("d.jsonl", ['{"text": ""}'], None, ["no documents (1 empty texts)"]),
    "NUL bytes": ("d.txt", ["text", "more\x00binary"], 2, ["not UTF-8 text"]),
}


@pytest.mark.parametrize("case, workers", [(c, 1) for c in sorted(BAD_INPUTS)] + [("missing key", 2), ("NUL bytes", 2)])
def test_bad_input_names_file_and_line_and_leaves_nothing(tmp_path, hf, monkeypatch, case, workers):
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 200)  # some batches are written before the error
    name, lines, line, words = BAD_INPUTS[case]
    good = _write_jsonl(tmp_path / "first.jsonl", ["a good first file"] * 30)
    bad = tmp_path / name
    bad.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    prefix = tmp_path / "new" / "dir" / "ds"
    with pytest.raises(ConfigError) as e:
        prepare([str(good), str(bad)], hf, str(prefix), workers=workers, progress=False)
    assert e.value.field == (f"{bad}:{line}" if line else str(bad))
    for w in words:
        assert w in e.value.problem
    assert e.value.fix
    assert not (tmp_path / "new").exists()  # the directories it created are gone too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["first.jsonl", name])


def test_invalid_utf8_names_the_line(tmp_path, hf):
    bad = tmp_path / "d.txt"
    bad.write_bytes(b"fine\n\nalso fine\ncaf\xe9 in latin-1\n")
    with pytest.raises(ConfigError) as e:
        prepare([str(bad)], hf, str(tmp_path / "ds"), progress=False)
    assert e.value.field == f"{bad}:4" and e.value.problem == "not UTF-8 text"
    assert _leftovers(tmp_path / "ds") == ["d.txt"]


def test_missing_input_and_directory_input(tmp_path, hf):
    with pytest.raises(ConfigError) as e:
        prepare([str(tmp_path / "nope.jsonl")], hf, str(tmp_path / "out" / "ds"), progress=False)
    assert e.value.field == str(tmp_path / "nope.jsonl") and "no such file" in e.value.problem
    with pytest.raises(ConfigError) as e:
        prepare([str(tmp_path)], hf, str(tmp_path / "out" / "ds"), progress=False)
    assert "directory" in e.value.problem
    assert not (tmp_path / "out").exists()


def test_failed_run_keeps_the_previous_dataset(tmp_path, hf):
    prefix = tmp_path / "ds"
    prepare([str(_write_jsonl(tmp_path / "old.jsonl", ["old text"]))], hf, str(prefix), progress=False)
    before = (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes())
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["x", 3])
    with pytest.raises(ConfigError):
        prepare([str(bad)], hf, str(prefix), progress=False, overwrite=True)
    assert (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes()) == before
    prepare([str(_write_jsonl(tmp_path / "new.jsonl", ["new", "texts"]))], hf, str(prefix), progress=False,
            overwrite=True)
    assert _documents(str(prefix)) == hf.encode_batch(["new", "texts"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ds.bin", "ds.idx", "new.jsonl", "old.jsonl"]


def test_an_existing_dataset_is_refused_unless_overwrite(tmp_path, hf):
    """As convert refuses a non-empty target: an earlier dataset is replaced only on purpose."""
    prefix = tmp_path / "ds"
    prepare([str(_write_jsonl(tmp_path / "old.jsonl", ["old text"]))], hf, str(prefix), progress=False)
    before = (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes())
    new = _write_jsonl(tmp_path / "new.jsonl", ["new", "texts"])
    with pytest.raises(ConfigError) as e:
        prepare([str(new)], hf, str(prefix), progress=False)
    assert e.value.field == "--output-prefix" and "already exist" in e.value.problem and "--overwrite" in e.value.fix
    assert (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes()) == before
    prefix.with_suffix(".idx").unlink()  # half a dataset is still one to refuse
    with pytest.raises(ConfigError):
        prepare([str(new)], hf, str(prefix), progress=False)
    prepare([str(new)], hf, str(prefix), progress=False, overwrite=True)
    assert _documents(str(prefix)) == hf.encode_batch(["new", "texts"])


def test_output_prefix_must_name_a_file(tmp_path, hf):
    jsonl = _write_jsonl(tmp_path / "d.jsonl", ["x"])
    for prefix in (str(tmp_path) + "/", str(tmp_path)):
        with pytest.raises(ConfigError) as e:
            prepare([str(jsonl)], hf, prefix, progress=False)
        assert e.value.field == "--output-prefix"


# -- corpus --------------------------------------------------------------------------------------------


def test_corpus_builds_a_dataset_megatron_reads(corpus):
    tok = load_tokenizer("huggingface", corpus.tokenizer_dir)
    assert tok.vocab_size == corpus.vocab_size == 1000
    texts = corpus_texts()
    with open(corpus.jsonl, encoding="utf-8") as f:
        assert [json.loads(line)["text"] for line in f] == texts
    docs = _documents(corpus.data_prefix)
    assert docs == [[*ids, tok.eod] for ids in tok.encode_batch(texts)]
    assert tok.detokenize(docs[0][:-1]) == texts[0]
    assert sum(map(len, docs)) > 100_000


def test_corpus_is_idempotent_and_deterministic(corpus, tmp_path):
    files = [corpus.jsonl, os.path.join(corpus.tokenizer_dir, "tokenizer.json"), corpus.data_prefix + ".bin",
             corpus.data_prefix + ".idx", os.path.join(corpus.root, "manifest.json")]
    stamps = [os.stat(f).st_mtime_ns for f in files]
    assert build_corpus(corpus.root, vocab_size=1000) == corpus
    assert [os.stat(f).st_mtime_ns for f in files] == stamps  # complete: nothing rebuilt

    again = build_corpus(str(tmp_path / "again"), vocab_size=1000)
    for f in files:
        assert Path(f).read_bytes() == Path(f.replace(corpus.root, again.root)).read_bytes(), f
    assert sorted(os.listdir(tmp_path)) == ["again"]  # no temporary directory left


def test_corpus_tokenizer_training_does_not_depend_on_threads(tmp_path):
    code = ("import sys; from liveshard.runtime.data.corpus import _train_tokenizer, corpus_texts; "
            "sys.stdout.write(_train_tokenizer(corpus_texts(), 1000).to_str())")
    runs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAYON_NUM_THREADS": n},
                           capture_output=True, text=True, check=True, timeout=60).stdout for n in ("1", "4")]
    assert runs[0] == runs[1] and len(runs[0]) > 10_000


def test_corpus_rebuilds_an_incomplete_or_different_build(corpus, tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "corpus.jsonl").write_text("half-written")
    paths = build_corpus(str(root), vocab_size=1000)
    assert Path(paths.jsonl).read_bytes() == Path(corpus.jsonl).read_bytes()
    bigger = build_corpus(str(root), vocab_size=1200)
    assert load_tokenizer("huggingface", bigger.tokenizer_dir).vocab_size == 1200


@pytest.mark.parametrize("vocab_size, words", [(100, "below 257"), (50_000, "yields only")])
def test_corpus_vocab_out_of_reach(tmp_path, vocab_size, words):
    with pytest.raises(ConfigError) as e:
        build_corpus(str(tmp_path / "c"), vocab_size=vocab_size)
    assert e.value.field == "vocab_size" and words in e.value.problem
    assert os.listdir(tmp_path) == []


def test_default_corpus_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LIVESHARD_CACHE", str(tmp_path))
    assert default_corpus_dir() == str(tmp_path / "corpus")
    monkeypatch.delenv("LIVESHARD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_corpus_dir() == str(tmp_path / "home" / ".cache" / "liveshard" / "corpus")


def test_corpus_tokenizer_drives_megatron_gpt_dataset(corpus, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tok = load_tokenizer("huggingface", corpus.tokenizer_dir)
    config = GPTDatasetConfig(random_seed=1, sequence_length=128, blend=([corpus.data_prefix], None), split="1,0,0",
                              path_to_cache=str(tmp_path / "cache"), tokenizer=tok, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. megatron's warning about a pad id shared with EOD
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, None, None], lambda: True, config).build()
    all_tokens = np.concatenate(_documents(corpus.data_prefix))
    assert len(train) == (len(all_tokens) - 1) // 128
    for i in range(8):
        sample = train[i]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        assert (sample["loss_mask"].numpy() == (tokens != tok.eod)).all()  # only document ends masked
        # every sample is a contiguous window of the dataset's token stream
        starts = np.flatnonzero(all_tokens[:-128] == tokens[0])
        assert any((all_tokens[s:s + 128] == tokens).all() and (all_tokens[s + 1:s + 129] == labels).all()
                   for s in starts)
