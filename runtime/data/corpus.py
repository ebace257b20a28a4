"""A small real corpus and BPE tokenizer, built from text that ships with Python: no download.

The text is the English prose of Python's reference documentation, ``pydoc_data.topics.topics``
(the pages ``help("if")`` shows; 79 topics, ~465 KB in Python 3.11). ``build_corpus`` writes::

    OUT/corpus.jsonl                          one {"text": ...} per topic, topics sorted by name
    OUT/tokenizer/tokenizer.json              byte-level BPE trained on it (Hugging Face tokenizers)
    OUT/data/corpus_text_document.{bin,idx}   the corpus tokenized, each topic ending with <|endoftext|>
    OUT/manifest.json                         what was built, from which text; written last

in about a second. The text differs between Python versions, and so does the corpus; the
manifest records the text's hash so that a corpus built by another Python is rebuilt.

Training is deterministic: the same text and vocabulary size give the same ``tokenizer.json``,
byte for byte, with one thread or several (the BPE trainer breaks ties between equally frequent
pairs by the pair itself; tests build twice and compare).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import ConfigError

EOD = "<|endoftext|>"
# 256 byte symbols plus <|endoftext|>: the smallest byte-level vocabulary.
MIN_VOCAB = 257
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class CorpusPaths:
    root: str
    jsonl: str
    tokenizer_dir: str
    data_prefix: str  # Megatron's data path: PREFIX.bin + PREFIX.idx
    vocab_size: int

    @classmethod
    def at(cls, root: str, vocab_size: int) -> CorpusPaths:
        return cls(root=root, jsonl=os.path.join(root, "corpus.jsonl"),
                   tokenizer_dir=os.path.join(root, "tokenizer"),
                   data_prefix=os.path.join(root, "data", "corpus_text_document"), vocab_size=vocab_size)


def default_corpus_dir() -> str:
    """``$LIVESHARD_CACHE/corpus``, else ``~/.cache/liveshard/corpus``."""
    cache = os.environ.get(Env.CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "liveshard")
    return os.path.join(cache, "corpus")


# How a job names the built-in corpus portably: ``builtin:corpus/tokenizer`` and
# ``builtin:corpus/data/corpus_text_document`` are its tokenizer and dataset wherever it lives
# (the image's prebuilt copy, else the cache, where it is built on first use in about a second).
BUILTIN_SCHEME = "builtin:"
BUILTIN_CORPUS = "corpus"
BUILTIN_VOCAB = 1024  # the examples' models have this vocabulary


def builtin_corpus_dir() -> str:
    """``$LIVESHARD_CORPUS`` (the image sets it to its prebuilt copy), else
    ``default_corpus_dir()/v1024``."""
    return os.environ.get(Env.CORPUS) or os.path.join(default_corpus_dir(), f"v{BUILTIN_VOCAB}")


def resolve_builtin(path: str, field: str) -> str:
    """``path`` itself, or for ``builtin:corpus[/REST]`` the built-in corpus's directory (built
    now when absent) joined with REST."""
    if not path.startswith(BUILTIN_SCHEME):
        return path
    name, _, rest = path[len(BUILTIN_SCHEME):].partition("/")
    if name != BUILTIN_CORPUS:
        raise ConfigError(field, f"unknown built-in {name!r} in {path!r}",
                          f"use {BUILTIN_SCHEME}{BUILTIN_CORPUS}/tokenizer or "
                          f"{BUILTIN_SCHEME}{BUILTIN_CORPUS}/data/corpus_text_document")
    root = builtin_corpus_dir()
    try:
        built = build_corpus(root, vocab_size=BUILTIN_VOCAB)
    except OSError as e:
        raise ConfigError(field, f"the built-in corpus could not be built in {root}: {e.strerror or e}",
                          f"set {Env.CORPUS} or {Env.CACHE} to a writable directory") from None
    return os.path.join(built.root, rest) if rest else built.root


def with_builtin_paths(training: Any, path: str = "spec.training") -> Any:
    """``training`` (a ``TrainingSpec``) with its ``builtin:`` dataset prefixes and tokenizer path
    resolved (``resolve_builtin``); the same object when it names none."""
    from dataclasses import replace

    data, tokenizer = training.data, training.tokenizer
    blend = tuple(replace(ref, prefix=resolve_builtin(ref.prefix, f"{path}.data.blend[{i}].prefix"))
                  for i, ref in enumerate(data.blend))
    if tokenizer is not None and tokenizer.path.startswith(BUILTIN_SCHEME):
        tokenizer = replace(tokenizer, path=resolve_builtin(tokenizer.path, f"{path}.tokenizer.path"))
    if blend == data.blend and tokenizer is training.tokenizer:
        return training
    return replace(training, data=replace(data, blend=blend), tokenizer=tokenizer)


def corpus_texts() -> list[str]:
    """The documents: one per help topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def build_corpus(out_dir: str, vocab_size: int = 4096) -> CorpusPaths:
    """Build the corpus, tokenizer and dataset in ``out_dir``; a complete, matching build is kept.

    The build happens in a temporary directory beside ``out_dir`` and is renamed into place, so
    ``out_dir`` is either absent, a complete older build, or complete; never half-written.
    Concurrent builders are safe: the first rename wins and the others use its result.
    """
    if vocab_size < MIN_VOCAB:
        raise ConfigError("vocab_size", f"{vocab_size} is below {MIN_VOCAB}, the 256 bytes plus {EOD}",
                          f"use at least {MIN_VOCAB}")
    out_dir = os.path.abspath(out_dir)
    texts = corpus_texts()
    wanted = _manifest(texts, vocab_size)
    paths = CorpusPaths.at(out_dir, vocab_size)
    if _is_complete(out_dir, wanted):
        return paths

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    os.chmod(work, 0o755)  # mkdtemp's 0700 would carry over to out_dir
    try:
        _build(work, texts, vocab_size, wanted)
        _install(work, out_dir, wanted)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already once installed
    return paths


def _manifest(texts: list[str], vocab_size: int) -> dict:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return {"version": MANIFEST_VERSION, "source": "pydoc_data.topics", "source_sha256": digest.hexdigest(),
            "documents": len(texts), "vocab_size": vocab_size}


def _read_manifest(root: str) -> dict | None:
    try:
        with open(os.path.join(root, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete(root: str, wanted: dict) -> bool:
    found = _read_manifest(root)
    if found is None or any(found.get(k) != v for k, v in wanted.items()):
        return False
    paths = CorpusPaths.at(root, wanted["vocab_size"])
    files = (paths.jsonl, os.path.join(paths.tokenizer_dir, "tokenizer.json"),
             paths.data_prefix + ".bin", paths.data_prefix + ".idx")
    return all(os.path.isfile(f) for f in files)


def _build(work: str, texts: list[str], vocab_size: int, manifest: dict) -> None:
    from liveshard.runtime.data.prepare import prepare
    from liveshard.runtime.data.tokenizer import load_tokenizer

    paths = CorpusPaths.at(work, vocab_size)
    with open(paths.jsonl, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    os.makedirs(paths.tokenizer_dir)
    trained = _train_tokenizer(texts, vocab_size)
    if trained.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ConfigError("vocab_size", f"the corpus yields only {trained.get_vocab_size(with_added_tokens=True)} "
                          f"tokens, fewer than the {vocab_size} asked", "ask for fewer tokens")
    trained.save(os.path.join(paths.tokenizer_dir, "tokenizer.json"))
    tokenizer = load_tokenizer("huggingface", paths.tokenizer_dir, field="corpus tokenizer")
    summary = prepare([paths.jsonl], tokenizer, paths.data_prefix, append_eod=True, progress=False)
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump({**manifest, "tokens": summary.tokens}, f, indent=1)


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def _install(work: str, out_dir: str, wanted: dict) -> None:
    """Rename the finished build to ``out_dir``, replacing an incomplete or outdated one."""
    old = None
    if os.path.exists(out_dir):
        if _is_complete(out_dir, wanted):  # a concurrent builder finished first
            return
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "corpus"))
    try:
        os.rename(work, out_dir)
    except OSError:
        # Another builder renamed its build in between; keep theirs if it is complete.
        if not _is_complete(out_dir, wanted):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
