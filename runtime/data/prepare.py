"""Text → Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``): ``liveshard prepare-data``.

Inputs, by extension (a trailing ``.gz`` means gzip-compressed):

- ``.jsonl``, ``.ndjson``, ``.json``: JSON lines, one object per line with the document's text
  under ``json_key``; blank lines are ignored. (A ``.json`` file holding one JSON array is not
  JSON lines and is refused at its first line.)
- anything else: UTF-8 plain text, one document per paragraph; paragraphs are separated by one
  or more blank (whitespace-only) lines and keep their inner line breaks.

Every document becomes one sequence and one document of the dataset, in input order (whatever
the number of workers), optionally followed by the tokenizer's end-of-document id. Documents
that tokenize to nothing (empty strings) are skipped and counted. Token ids are stored as
megatron's ``DType.optimal_dtype`` for the vocabulary (uint16 below 65,500 ids, else int32),
written with megatron-core's ``IndexedDatasetBuilder``.

Nothing partial is left behind: the files are written as ``PREFIX.bin.tmp-PID`` and
``PREFIX.idx.tmp-PID`` next to their final names and renamed into place (the index last) only
once every input was read; on any error the temporaries are removed.

Workers: with ``workers > 1``, batches of documents are tokenized in a pool of spawned processes
that each load the tokenizer from its type and file (library objects never cross processes) and
run it on one thread; this process reads, parses and writes meanwhile. With ``workers == 1`` the
tokenizer runs here, also on one thread. The workers import this module, numpy and the tokenizer
library, not megatron-core or torch, and start in a fraction of a second; but like every spawned
process they also re-import the calling program's main module, so a script that calls
``prepare(workers=N)`` keeps its heavy imports inside ``if __name__ == "__main__":`` (the
``liveshard`` command's own main module is light).
"""

from __future__ import annotations

import collections
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import numpy as np

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.inputs import json_problem

if TYPE_CHECKING:
    from liveshard.runtime.data.tokenizer import Tokenizer

JSON_LINES = (".jsonl", ".ndjson", ".json")
# Text per tokenization batch: ~60k tokens, a tenth of a second of one core; small enough that a
# few files keep every worker busy and the progress bar moves, large enough that the per-batch
# cost (pickling, a task round trip) stays under 1%.
BATCH_CHARS = 256 * 1024
BATCH_DOCS = 4096


@dataclass(frozen=True)
class PrepareSummary:
    documents: int
    skipped_empty: int
    tokens: int
    seconds: float
    bin_path: str
    idx_path: str
    files: int = 1
    input_bytes: int = 0
    dtype: str = "uint16"
    workers: int = 1
    append_eod: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """One paragraph for a person: what was read, what was written, how fast."""
        eod = ", each ending with the end-of-document id" if self.append_eod else ""
        return (f"Tokenized {self.documents:,} documents{eod} ({self.skipped_empty:,} empty skipped) from "
                f"{self.files} file{'s' if self.files != 1 else ''} ({_size(self.input_bytes)}) into "
                f"{self.tokens:,} tokens in {self.seconds:.2f} s ({self.tokens_per_second:,.0f} tokens/s, "
                f"{self.workers} worker{'s' if self.workers != 1 else ''}); wrote {self.bin_path} and "
                f"{self.idx_path} ({self.dtype} ids).")


def prepare(inputs: list[str], tokenizer: Tokenizer, output_prefix: str, json_key: str = "text",
            workers: int = 1, append_eod: bool = False, progress: bool = True,
            overwrite: bool = False) -> PrepareSummary:
    """Tokenize ``inputs`` into ``output_prefix.bin`` / ``.idx``; bad input is a ``ConfigError``,
    and so is a dataset already there unless ``overwrite``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    start = time.perf_counter()
    _check_arguments(inputs, output_prefix, json_key, workers)
    existing = [p for p in (output_prefix + ".bin", output_prefix + ".idx") if os.path.exists(p)]
    if existing and not overwrite:
        raise ConfigError("--output-prefix", f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}",
                          "give --overwrite to replace the dataset, or another --output-prefix")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod if append_eod else None
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    tmp = f".tmp-{os.getpid()}"
    bin_tmp, idx_tmp = bin_path + tmp, idx_path + tmp
    reader = _Reader(inputs, json_key)
    created = _make_parent(output_prefix)
    bar = _progress_bar(reader.total_bytes, progress)
    builder = None
    documents = tokens = 0
    try:
        builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        with _encoder(tokenizer, workers, eod, dtype) as encode:
            for flat, lengths in encode(reader.batches()):
                offset = 0
                for n in lengths.tolist():
                    builder.add_document(flat[offset:offset + n], [n])
                    offset += n
                documents += len(lengths)
                tokens += offset
                bar.update(reader.bytes_read - bar.n)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"{documents:,} docs, {tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)
        builder.finalize(idx_tmp)
        # Two files cannot be replaced at once. With the old index gone first, a reader sees the
        # old pair, or a .bin without its .idx (not a dataset), or the new pair; never a mix.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    except BaseException:
        if builder is not None and not builder.data_file.closed:
            builder.data_file.close()
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        _remove_empty_dirs(created)
        raise
    finally:
        bar.close()
    return PrepareSummary(documents=documents, skipped_empty=reader.empty + (reader.documents - documents),
                          tokens=tokens, seconds=time.perf_counter() - start, bin_path=bin_path,
                          idx_path=idx_path, files=len(inputs), input_bytes=reader.total_bytes,
                          dtype=np.dtype(dtype).name, workers=workers, append_eod=append_eod)


def _check_arguments(inputs: list[str], output_prefix: str, json_key: str, workers: int) -> None:
    if not inputs:
        raise ConfigError("--input", "no input files", "name one or more .jsonl or text files")
    for path in inputs:
        if os.path.isdir(path):
            raise ConfigError(path, "is a directory", "name the files in it, e.g. DIR/*.jsonl")
        if not os.path.isfile(path):
            raise ConfigError(path, "no such file", "check the --input paths")
    if not output_prefix or output_prefix.endswith(("/", os.sep)) or os.path.isdir(output_prefix):
        raise ConfigError("--output-prefix", f"{output_prefix!r} names a directory, not a file prefix",
                          "add a file name, e.g. data/corpus_text_document")
    if not json_key:
        raise ConfigError("--json-key", "is empty", "name the key that holds each document's text")
    if workers < 1:
        raise ConfigError("--workers", f"{workers} is not a positive number", "use 1 or more")


def _make_parent(output_prefix: str) -> str | None:
    """Create the output directory; return the topmost directory created (None if all existed)."""
    parent = os.path.dirname(os.path.abspath(output_prefix))
    topmost = None
    probe = parent
    while not os.path.exists(probe):
        topmost = probe
        probe = os.path.dirname(probe)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError("--output-prefix", f"cannot create {parent} ({e.strerror})",
                          "choose a writable location") from None
    if not os.access(parent, os.W_OK):
        raise ConfigError("--output-prefix", f"{parent} is not writable", "choose a writable location")
    return topmost


def _remove_empty_dirs(topmost: str | None) -> None:
    """Undo ``_make_parent`` after a failure, keeping anything someone else put there meanwhile."""
    if topmost is None:
        return
    for dirpath, _, _ in sorted(os.walk(topmost), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            return


# -- reading ---------------------------------------------------------------------------------------


@dataclass
class _Reader:
    """Documents of every input in order, batched; counts what it skipped and how far it read."""

    inputs: list[str]
    json_key: str
    documents: int = 0  # non-empty texts handed out
    empty: int = 0  # empty texts skipped
    total_bytes: int = 0
    _done_bytes: int = 0  # size of the files read completely
    _raw: IO[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.total_bytes = sum(os.path.getsize(p) for p in self.inputs)

    @property
    def bytes_read(self) -> int:
        # On-disk bytes (compressed for .gz), so that the ETA is against the file sizes.
        return self._done_bytes + (self._raw.tell() if self._raw is not None and not self._raw.closed else 0)

    def batches(self) -> Iterator[list[str]]:
        batch: list[str] = []
        chars = 0
        for text in self._texts():
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch

    def _texts(self) -> Iterator[str]:
        for path in self.inputs:
            before = self.documents
            empty_before = self.empty
            with open(path, "rb") as raw:
                self._raw = raw
                stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
                lines = _lines(stream, path)
                docs = _json_documents(lines, path, self.json_key) if _is_json_lines(path) else _paragraphs(lines)
                for text in docs:
                    if text:
                        self.documents += 1
                        yield text
                    else:
                        self.empty += 1
                self._raw = None
            self._done_bytes += os.path.getsize(path)
            if self.documents == before:
                empties = self.empty - empty_before
                detail = f" ({empties} empty texts)" if empties else ""
                raise ConfigError(path, f"no documents{detail}", "remove the file from --input or fill it")


def _is_json_lines(path: str) -> bool:
    base = path[:-3] if path.endswith(".gz") else path
    return base.lower().endswith(JSON_LINES)


def _lines(stream: IO[bytes], path: str) -> Iterator[tuple[int, str]]:
    """(line number, decoded line) pairs; NUL bytes or invalid UTF-8 name the line."""
    lineno = 0
    try:
        for lineno, raw in enumerate(stream, 1):
            if b"\x00" in raw:
                raise _not_text(path, lineno)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _not_text(path, lineno) from None
            if lineno == 1 and line.startswith("\ufeff"):  # byte-order mark some editors write
                line = line[1:]
            yield lineno, line
    except (EOFError, OSError, zlib.error) as e:  # truncated or corrupt .gz (BadGzipFile is an OSError)
        raise ConfigError(f"{path}:{lineno + 1}", f"unreadable ({e})",
                          "check the file; a .gz input must be a complete gzip file") from None


def _not_text(path: str, lineno: int) -> ConfigError:
    return ConfigError(f"{path}:{lineno}", "not UTF-8 text",
                       "convert the file to UTF-8 text or remove it from --input")


def _json_documents(lines: Iterator[tuple[int, str]], path: str, key: str) -> Iterator[str]:
    loads = json.loads
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({json_problem(e, line=False)})"
            if lineno == 1 and line.lstrip().startswith("["):
                problem += "; the file looks like one JSON array"
            raise ConfigError(f"{path}:{lineno}", problem, _ONE_OBJECT_PER_LINE) from None
        except RecursionError:
            raise ConfigError(f"{path}:{lineno}", "JSON nested too deeply to be a document",
                              _ONE_OBJECT_PER_LINE) from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise ConfigError(f"{path}:{lineno}", f"not valid JSON ({str(e).splitlines()[0][:120]})",
                              _ONE_OBJECT_PER_LINE) from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{lineno}", f"a JSON {_json_type(obj)}, not an object", _ONE_OBJECT_PER_LINE)
        try:
            value = obj[key]
        except KeyError:
            keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
            raise ConfigError(f"{path}:{lineno}", f'no "{key}" key (keys: {keys})',
                              "name the key that holds the text with --json-key") from None
        if not isinstance(value, str):
            raise ConfigError(f"{path}:{lineno}", f'"{key}" is a JSON {_json_type(value)}, not a string',
                              "store each document's text as a string")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate escape such as "\ud800": no text
                raise ConfigError(f"{path}:{lineno}", f'"{key}" holds an unpaired surrogate '
                                  f"(\\u{ord(value[e.start]):04x}) at character {e.start}",
                                  "escape only whole characters (surrogate pairs) in the JSON") from None
        yield value


_ONE_OBJECT_PER_LINE = "write one JSON object per line (JSON lines; for a JSON array: jq -c '.[]' FILE)"


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _paragraphs(lines: Iterator[tuple[int, str]]) -> Iterator[str]:
    paragraph: list[str] = []
    for _, line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\r\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _progress_bar(total_bytes: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes or None, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare-data",
                file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


# -- tokenizing --------------------------------------------------------------------------------------


def _pack(ids: list[list[int]], eod: int | None, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A batch's token ids as one flat array plus per-document lengths; documents with no tokens dropped."""
    kept = [x for x in ids if x]
    if eod is not None:
        for x in kept:
            x.append(eod)
    lengths = np.fromiter((len(x) for x in kept), np.int64, len(kept))
    flat = np.fromiter(itertools.chain.from_iterable(kept), dtype, int(lengths.sum()))
    return flat, lengths


class _encoder:
    """``with _encoder(...) as encode``: ``encode(batches)`` yields packed batches in input order."""

    def __init__(self, tokenizer: Tokenizer, workers: int, eod: int | None, dtype) -> None:
        self.tokenizer, self.workers, self.eod, self.dtype = tokenizer, workers, eod, dtype
        self.pool = None
        self._saved_env: str | None = None

    def __enter__(self):
        if self.workers == 1:
            # One thread here: Hugging Face tokenizers would otherwise spread each batch over every
            # core. The Rust side reads the variable at each call, so setting it for the duration
            # suffices.
            self._saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            return self._serial
        ctx = multiprocessing.get_context("spawn")
        self.pool = ctx.Pool(self.workers, initializer=_worker_init,
                             initargs=(self.tokenizer.kind, self.tokenizer.file))
        return self._parallel

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            if exc[0] is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()
        elif self._saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._saved_env

    def _serial(self, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        encode = _single_thread_encoder(self.tokenizer.kind, self.tokenizer.library)
        for texts in batches:
            yield _pack(encode(texts), self.eod, self.dtype)

    def _parallel(self, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # apply_async with a bounded queue, not imap: imap's feeder thread would read the whole
        # input ahead into memory. Two batches in flight per worker keep each one busy.
        pending: collections.deque = collections.deque()
        dtype_name = np.dtype(self.dtype).name
        for texts in batches:
            pending.append(self.pool.apply_async(_worker_encode, (texts, self.eod, dtype_name)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _single_thread_encoder(kind: str, library) -> Callable[[list[str]], list[list[int]]]:
    """Token ids of a batch on this thread (Hugging Face also needs TOKENIZERS_PARALLELISM=false).

    The same call as ``Tokenizer.encode_batch``, which worker processes cannot use: importing
    ``tokenizer.py`` imports megatron-core and torch, seconds per process.
    """
    if kind == "huggingface":
        encode = getattr(library, "encode_batch_fast", library.encode_batch)

        def encode_hf(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in encode(texts, add_special_tokens=False)]

        return encode_hf

    def encode_sp(texts: list[str]) -> list[list[int]]:
        return library.encode(texts, num_threads=1)

    return encode_sp


# -- worker processes (spawned: they import this module, numpy and the tokenizer library only) --------

_WORKER_ENCODE: Callable[[list[str]], list[list[int]]] | None = None


def _worker_init(kind: str, file: str) -> None:
    global _WORKER_ENCODE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    if kind == "huggingface":
        from tokenizers import Tokenizer as HFTokenizer

        library = HFTokenizer.from_file(file)
    else:
        import sentencepiece

        library = sentencepiece.SentencePieceProcessor(model_file=file)
    _WORKER_ENCODE = _single_thread_encoder(kind, library)


def _worker_encode(texts: list[str], eod: int | None, dtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_ENCODE is not None, "worker used before _worker_init"
    return _pack(_WORKER_ENCODE(texts), eod, np.dtype(dtype_name))
