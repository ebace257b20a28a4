"""``liveshard prepare-data`` as a person runs it: a process, its exit status, stdout and stderr.

Both runs start at once: each process spends most of its time importing megatron-core and torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest


def _tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["some text to learn a few merges from, " * 20, "and another line"], trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "liveshard.runtime.cli", "prepare-data", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tok = _tokenizer(root / "tok")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"body": t}) + "\n" for t in ["first document", "", "second document"]))
    notes = root / "notes.txt"
    notes.write_text("a paragraph\nof two lines\n\nanother paragraph\n")
    good = _start("--input", str(docs), str(notes), "--tokenizer", str(tok), "--json-key", "body",
                  "--output-prefix", str(root / "out" / "ds"), "--append-eod", "--jobs", "2", "--no-progress")
    bad = _start("--input", str(docs), "--tokenizer", str(tok), "--output-prefix", str(root / "bad" / "ds"),
                 "--no-progress")
    # This process's own import of megatron-core (to read the dataset back) overlaps the runs.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    results = {}
    for name, proc in (("good", good), ("bad", bad)):
        out, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, out, err)
    return root, tok, docs, results


def test_prepare_data_writes_a_readable_dataset(runs):
    root, tok_dir, _, results = runs
    code, out, err = results["good"]
    assert code == 0, err
    assert "Tokenized 4 documents" in out and "(1 empty skipped)" in out and f"{root / 'out' / 'ds'}.idx" in out
    assert "Traceback" not in err and "Warning" not in err

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from liveshard.runtime.data.tokenizer import load_tokenizer

    tok = load_tokenizer("huggingface", str(tok_dir))
    ds = IndexedDataset(str(root / "out" / "ds"))
    texts = ["first document", "second document", "a paragraph\nof two lines", "another paragraph"]
    assert [ds[i].tolist() for i in range(len(ds))] == [[*ids, tok.eod] for ids in tok.encode_batch(texts)]


def test_missing_json_key_is_one_line_exit_2(runs):
    root, _, docs, results = runs
    code, out, err = results["bad"]
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f'liveshard prepare-data: error: {docs}:1: no "text" key')
    assert "--json-key" in lines[0]
    assert not (root / "bad").exists()
