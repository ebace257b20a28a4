"""A Megatron indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) checked against its ``.bin``
before anything trusts it.

megatron-core reads the index as it is: lengths of 2^30 make it allocate until it dies, a
negative or inflated length makes it train silently on the wrong spans, a pointer past the end
or a wrong dtype fails at the first read, deep in a worker. ``check_indexed`` reads the index
once, with vectorized numpy over a memory map in bounded chunks (a few hundred MB/s of index;
the ``.bin`` is not read but for a sample of its tokens), and refuses a lying one in one line
naming the file and what is wrong:

- the header: magic ``MMIDIDX``, version 1, an integer dtype code;
- the ``.idx``'s length: exactly what its counts make it (34 + 12 per sequence + 8 per
  document index);
- sequence lengths: none negative, none longer than the ``.bin`` holds, their sum × the dtype's
  size exactly the ``.bin``'s length (a truncated ``.bin``, a wrong dtype, another dataset's
  index);
- pointers: ``pointer[0] = 0``, ``pointer[i] = pointer[i-1] + length[i-1] × itemsize`` (so
  non-negative, increasing and every span inside the ``.bin``);
- document indices: start at 0, never decrease, end at the sequence count;
- token ids (sampled: at most ``TOKEN_SAMPLE_BYTES`` spread over the ``.bin``): within the
  tokenizer's vocabulary when it is known.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from liveshard.runtime.errors import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence count (8), document count (8)
# megatron's DType codes; the floating ones hold no token ids
DTYPES: dict[int, Any] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                          7: np.float32, 8: np.uint16}
CHUNK = 1 << 20  # elements per vectorized step: bounded memory whatever the dataset's size
TOKEN_SAMPLE_BYTES = 4 << 20  # of the .bin, in 64 windows, checked against the vocabulary
FIX = "write PREFIX.bin and PREFIX.idx again with liveshard prepare-data (both from the same run)"


class BadIndex(Exception):
    """What is wrong, in words (the caller names the file and the field)."""


def check_indexed(prefix: str, field: str, vocab_size: int | None = None) -> tuple[int, int]:
    """Check ``prefix.idx`` against ``prefix.bin``; (sequences, documents) when they agree,
    ``ConfigError(field, "<file>: <what is wrong>")`` when not."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        return _check(idx, bin_, vocab_size)
    except BadIndex as e:
        raise ConfigError(field, f"{e.args[0]}", FIX) from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {e.filename or prefix}: {e.strerror or e}",
                          "give a readable PREFIX.bin and PREFIX.idx") from None


def _check(idx: str, bin_: str, vocab_size: int | None) -> tuple[int, int]:
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise BadIndex(f"{idx} is truncated: {len(header)} bytes, shorter than the {HEADER_BYTES}-byte header")
    if header[:9] != INDEX_MAGIC:
        raise BadIndex(f"{idx} is not a Megatron indexed dataset index (its first bytes are {header[:9]!r}, "
                       f"not {INDEX_MAGIC!r})")
    version, code, n, d = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise BadIndex(f"{idx} has index version {version}; only version 1 is read")
    dtype = DTYPES.get(code)
    if dtype is None:
        raise BadIndex(f"{idx} has dtype code {code}, which names no dtype (codes: "
                       + ", ".join(f"{k} {np.dtype(v).name}" for k, v in DTYPES.items()) + ")")
    if not np.issubdtype(dtype, np.integer):
        raise BadIndex(f"{idx} has dtype code {code} ({np.dtype(dtype).name}), which holds no token ids")
    itemsize = np.dtype(dtype).itemsize
    want = HEADER_BYTES + 12 * n + 8 * d
    if idx_size != want:
        what = "truncated" if idx_size < want else "longer than its counts say"
        raise BadIndex(f"{idx} is {what}: {idx_size:,} bytes, but its header's {n:,} sequences and {d:,} "
                       f"document indices make it {want:,}")
    if d < 1:
        raise BadIndex(f"{idx} has no document indices (there is always at least the leading 0)")
    tokens = bin_size // itemsize
    if bin_size % itemsize:
        raise BadIndex(f"{bin_} is {bin_size:,} bytes, not a whole number of {np.dtype(dtype).name} tokens "
                       f"({itemsize} bytes each, the index's dtype)")
    if n == 0:
        if bin_size:
            raise BadIndex(f"{idx} lists no sequences, but {bin_} holds {bin_size:,} bytes")
        return 0, d - 1
    # read-only maps, unmapped when the last view goes (on return): nothing is read into memory
    # but one chunk at a time
    mm = np.memmap(idx, dtype=np.uint8, mode="r")
    lengths = np.ndarray((n,), dtype="<i4", buffer=mm, offset=HEADER_BYTES)
    pointers = np.ndarray((n,), dtype="<i8", buffer=mm, offset=HEADER_BYTES + 4 * n)
    documents = np.ndarray((d,), dtype="<i8", buffer=mm, offset=HEADER_BYTES + 12 * n)
    total = _check_lengths(idx, bin_, lengths, tokens)
    if total * itemsize != bin_size:
        raise BadIndex(_size_mismatch(idx, bin_, total, dtype, bin_size))
    _check_pointers(idx, lengths, pointers, itemsize)
    _check_documents(idx, documents, n)
    if vocab_size is not None:
        _check_tokens(bin_, dtype, tokens, vocab_size)
    return n, d - 1


def _check_lengths(idx: str, bin_: str, lengths: np.ndarray, tokens: int) -> int:
    """Every length non-negative and within the .bin; their sum (tokens), stopping as soon as it
    passes the .bin's end."""
    total = 0
    for start in range(0, len(lengths), CHUNK):
        part = lengths[start:start + CHUNK]
        low = int(part.min())
        if low < 0:
            i = start + int(np.argmax(part < 0))
            raise BadIndex(f"{idx}: sequence {i:,} has a negative length ({low:,} tokens)")
        high = int(part.max())
        if high > tokens:
            i = start + int(np.argmax(part > tokens))
            raise BadIndex(f"{idx}: sequence {i:,} has length {int(lengths[i]):,} tokens, more than all of "
                           f"{bin_} holds ({tokens:,})")
        total += int(part.sum(dtype=np.int64))
        if total > tokens:
            end = start + len(part)
            raise BadIndex(f"{idx}: the lengths of sequences 0..{end - 1:,} add up to {total:,} tokens, more "
                           f"than {bin_} holds ({tokens:,}): the .bin is truncated, or the index is not its own")
    return total


def _size_mismatch(idx: str, bin_: str, total: int, dtype: Any, bin_size: int) -> str:
    name, itemsize = np.dtype(dtype).name, np.dtype(dtype).itemsize
    text = (f"{idx}: its lengths add up to {total:,} tokens of {name} ({total * itemsize:,} bytes), but {bin_} "
            f"is {bin_size:,} bytes")
    fits = [np.dtype(t).name for t in DTYPES.values()
            if np.issubdtype(t, np.integer) and t is not dtype and total * np.dtype(t).itemsize == bin_size]
    if fits:
        return text + f": the index's dtype is wrong (the .bin fits {' or '.join(fits)})"
    return text + (": the .bin is truncated" if total * itemsize > bin_size else ": the index is not the .bin's own")


def _check_pointers(idx: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> None:
    """``pointer[i]`` is where sequence ``i`` starts: the bytes of every sequence before it."""
    at = 0  # bytes before this chunk
    for start in range(0, len(lengths), CHUNK):
        part = lengths[start:start + CHUNK].astype(np.int64)
        want = np.empty_like(part)
        want[0] = 0
        np.cumsum(part[:-1] * itemsize, out=want[1:])
        want += at
        got = pointers[start:start + len(part)]
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = start + int(bad[0])
            raise BadIndex(f"{idx}: sequence {i:,} starts at byte {int(pointers[i]):,} of the .bin, but the "
                           f"sequences before it end at byte {int(want[bad[0]]):,}")
        at += int(part.sum()) * itemsize


def _check_documents(idx: str, documents: np.ndarray, n: int) -> None:
    """Document ``k`` is sequences ``documents[k] .. documents[k+1]``: from 0 up to ``n``."""
    if int(documents[0]) != 0:
        raise BadIndex(f"{idx}: the document index starts at {int(documents[0]):,}, not 0")
    if int(documents[-1]) != n:
        raise BadIndex(f"{idx}: the document index ends at {int(documents[-1]):,}, not at the sequence count "
                       f"({n:,})")
    for start in range(0, len(documents) - 1, CHUNK):
        part = documents[start:start + CHUNK + 1]
        down = np.flatnonzero(np.diff(part) < 0)
        if down.size:
            k = start + int(down[0])
            raise BadIndex(f"{idx}: document {k + 1:,} starts at sequence {int(documents[k + 1]):,}, before "
                           f"document {k:,} ({int(documents[k]):,}): the document index must not decrease")


def _check_tokens(bin_: str, dtype: Any, tokens: int, vocab_size: int, windows: int = 64) -> None:
    """A sample of the .bin's tokens (``windows`` spans over the whole file, at most
    ``TOKEN_SAMPLE_BYTES`` in all) within ``0 .. vocab_size - 1``: data tokenized with another
    tokenizer fails here rather than in the embedding, mid-step."""
    if tokens == 0:
        return
    itemsize = np.dtype(dtype).itemsize
    span = max(1, min(tokens, TOKEN_SAMPLE_BYTES // itemsize // windows))
    starts = sorted({int(s) for s in np.linspace(0, tokens - span, num=min(windows, tokens))})
    data = np.memmap(bin_, dtype=dtype, mode="r", shape=(tokens,))
    for s in starts:
        part = data[s:s + span]
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            j = int(np.argmax((part < 0) | (part >= vocab_size)))
            raise BadIndex(f"{bin_}: token {s + j:,} is id {int(part[j]):,}, outside the tokenizer's "
                           f"vocabulary (0..{vocab_size - 1:,}): it was tokenized with another tokenizer, "
                           "or its index's dtype is wrong")


__all__ = ["check_indexed"]
