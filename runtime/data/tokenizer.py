"""Tokenizers for training data and for megatron-core's GPT datasets.

``load_tokenizer("huggingface", DIR)`` reads a Hugging Face ``tokenizer.json`` with the
``tokenizers`` library (no ``transformers`` needed); ``load_tokenizer("sentencepiece", FILE)``
reads a SentencePiece ``.model``. Either way the result is a :class:`Tokenizer`, megatron-core's
``MegatronTokenizerBase``, which ``GPTDatasetConfig(tokenizer=...)`` takes as it is.

Importing this module imports megatron-core (and with it torch: several seconds). Code that only
needs raw token ids in a process of its own, such as ``prepare``'s worker processes, loads the
tokenizer library directly and skips this module.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any

from megatron.core.tokenizers import MegatronTokenizerBase

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.inputs import MAX_TOKENIZER_BYTES, check_size

KINDS = ("huggingface", "sentencepiece")

# End-of-document candidates in a tokenizer.json, most specific first: GPT-2/NeoX/Qwen base,
# Llama 1/2 and Mistral, Llama 3, Gemma, BERT-style upper-case, ChatML-only vocabularies.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|im_end|>")

# megatron-core's own "no pad token" value (megatron_dataset._PAD_TOKEN_ID).
NO_PAD = -1


class Tokenizer(MegatronTokenizerBase):
    """A loaded tokenizer, shaped as megatron-core's tokenizer base class.

    What megatron-core's GPT dataset reads: ``vocab_size``, ``eod`` (where documents end),
    ``pad`` and ``unique_identifiers`` (part of the key of its cached sample indices).

    ``pad`` is always -1, megatron's own "no pad token". GPTDataset fills a sample that runs past
    the end of the data with ``pad``, masks the loss wherever a label equals ``pad`` and rewrites
    every ``pad`` in the inputs to id 0. Were it a real token id, every genuine occurrence of that
    token in the text would be masked and rewritten too; -1 never occurs in the data. (Megatron
    itself falls back to -1, with a warning, when a pad id equals the EOS or EOD id.) The
    tokenizer's own pad id, if it has one, is ``own_pad``.
    """

    kind: str
    own_pad: int | None = None

    def __init__(self, path: str, file: str, name: str, field: str) -> None:
        super().__init__(path, {})
        self.path = path  # as given: a directory or a file
        self.file = file  # the file actually read (tokenizer.json or .model)
        self.name = name
        self.field = field
        with open(file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        # Megatron hashes these into the names of its cached dataset indices: keyed on the
        # content, not the path, so pods that mount the same tokenizer elsewhere share the cache.
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, kind=self.kind, sha256=digest)

    # -- megatron-core's interface -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the model's embedding must hold: one past the largest id, added tokens included."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return NO_PAD

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name}: pretraining tokenizers carry no chat template")

    # -- batch encoding ------------------------------------------------------------------------

    @property
    def library(self) -> Any:
        """The underlying library's tokenizer object."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (BOS/EOS templates are left out)."""
        raise NotImplementedError

    def __reduce__(self):
        # Rebuilt from its two strings: library objects are never pickled (spawned DataLoader
        # workers, multiprocessing pools).
        return load_tokenizer, (self.kind, self.path, self.field)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, path={self.path!r}, "
                f"vocab_size={self.vocab_size}, eod={self.eod})")


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: str, field: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            if os.path.isdir(path):
                problem = f"{path} holds no tokenizer.json"
            else:
                problem = f"{path} does not exist"
            raise ConfigError(f"{field}.path", problem,
                              "name a directory holding a Hugging Face tokenizer.json, or the file itself")
        check_size(file, f"{field}.path", what="tokenizer file", limit=MAX_TOKENIZER_BYTES)
        try:
            self._hf = HFTokenizer.from_file(file)
        except Exception as e:  # the Rust side raises plain Exception for parse and schema errors
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            fix = "name a Hugging Face tokenizer.json"
            if file.endswith(".model"):
                fix = "a SentencePiece .model file needs tokenizer type sentencepiece"
            raise ConfigError(f"{field}.path", f"{file} is not a Hugging Face tokenizer ({first})", fix) from None
        name = os.path.basename(os.path.dirname(os.path.abspath(file))) or "tokenizer"
        super().__init__(path, file, name, field)
        vocab = self._hf.get_vocab(with_added_tokens=True)
        # Added tokens may leave gaps: the embedding must reach the largest id, not just count them.
        self._vocab_size = max(self._hf.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        eod = next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise ConfigError(f"{field}.path", f"{file} has none of the end-of-document tokens "
                              f"{', '.join(EOD_CANDIDATES)}",
                              "use a tokenizer with an end-of-text token (add one as a special token)")
        self._eod = eod
        self.own_pad = self._own_pad(vocab)

    def _own_pad(self, vocab: dict[str, int]) -> int | None:
        padding = self._hf.padding
        if padding:
            return int(padding["pad_id"])
        return next((vocab[t] for t in ("<pad>", "[PAD]", "<|pad|>") if t in vocab), None)

    @property
    def vocab(self) -> dict[str, int]:
        return self._hf.get_vocab(with_added_tokens=True)

    @property
    def library(self):
        """The ``tokenizers.Tokenizer`` itself."""
        return self._hf

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Rust encodes the batch on all cores unless TOKENIZERS_PARALLELISM=false; the _fast
        # variant (tokenizers >= 0.20) skips character offsets, nearly twice as fast.
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def detokenize(self, ids: list[int]) -> str:
        return self._hf.decode(_int_list(ids), skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str, field: str) -> None:
        import sentencepiece

        if not os.path.isfile(path):
            problem = f"{path} is a directory" if os.path.isdir(path) else f"{path} does not exist"
            raise ConfigError(f"{field}.path", problem, "name a SentencePiece .model file")
        check_size(path, f"{field}.path", what="tokenizer file", limit=MAX_TOKENIZER_BYTES)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            fix = "name a SentencePiece .model file"
            if path.endswith(".json"):
                fix = "a tokenizer.json needs tokenizer type huggingface"
            raise ConfigError(f"{field}.path", f"{path} is not a SentencePiece model ({first})", fix) from None
        name = os.path.splitext(os.path.basename(path))[0]
        super().__init__(path, path, name, field)
        self._vocab_size = int(self._sp.get_piece_size())
        eod = int(self._sp.eos_id())
        if eod < 0:
            raise ConfigError(f"{field}.path", f"{path} has no end-of-sentence piece (eos_id is -1)",
                              "use a model trained with an eos piece (SentencePiece's default eos_id=2)")
        self._eod = eod
        pad = int(self._sp.pad_id())
        self.own_pad = pad if pad >= 0 else None

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._vocab_size)}

    @property
    def library(self):
        """The ``sentencepiece.SentencePieceProcessor`` itself."""
        return self._sp

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(_int_list(ids))


def _int_list(ids) -> list[int]:
    # numpy arrays (what IndexedDataset returns) convert to Python ints in one call
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


def default_kind(path: str) -> str:
    """The tokenizer type a path implies: SentencePiece for ``.model`` files, else Hugging Face."""
    return "sentencepiece" if path.endswith(".model") else "huggingface"


def load_tokenizer(kind: str, path: str, field: str = "spec.training.tokenizer") -> Tokenizer:
    """Load a tokenizer; every problem is a ``ConfigError`` naming ``{field}.type`` or ``{field}.path``."""
    if kind == "huggingface":
        return HuggingFaceTokenizer(path, field)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path, field)
    raise ConfigError(f"{field}.type", f"unknown tokenizer type {kind!r}", f"use one of {', '.join(KINDS)}")


def check_vocab(tokenizer: Tokenizer, padded_vocab_size: int, field: str = "spec.training.tokenizer") -> None:
    """Refuse a tokenizer whose ids the model's embedding table cannot hold."""
    if tokenizer.vocab_size > padded_vocab_size:
        raise ConfigError(field, f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} token ids but the "
                          f"model's embedding holds {padded_vocab_size}",
                          f"set the model's vocab_size to at least {tokenizer.vocab_size}")
