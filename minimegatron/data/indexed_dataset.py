"""The indexed dataset: token ids on disk as a ``.bin``/``.idx`` pair, memory-mapped for reading.

``PREFIX.bin``: every document's token ids back to back, one numpy dtype (``best_dtype``).
``PREFIX.idx``, little-endian, byte-compatible with Megatron-LM's _IndexWriter
(megatron/core/datasets/indexed_dataset.py):

    offset  size     field
    0       9        magic b"MMIDIDX\\x00\\x00"
    9       8        version, uint64, always 1
    17      1        dtype code, uint8 (DTYPE_CODES below; uint16 is 8, int32 is 4)
    18      8        S = sequence count, uint64
    26      8        D = document count, uint64 (number of entries in document_indices)
    34      4*S      sequence_lengths, int32: tokens in sequence i
    34+4S   8*S      sequence_pointers, int64: byte offset of sequence i in .bin
    34+12S  8*D      document_indices, int64: document j = sequences [di[j], di[j+1])

Invariant: one sequence per document, ``document_indices == [0, 1, ..., S]``, D == S + 1; a
file breaking any invariant raises ``DataError`` naming it. ``IndexedDataset(...)[i]`` reads
only document i's pages (np.memmap). ``IndexedDatasetBuilder.finalize()`` renames the
temporaries into place, .bin first: a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path
from typing import Iterable

import numpy as np

from .errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")        # magic, version, dtype code, S, D: 34 bytes
assert HEADER.size == 34

# Megatron-LM's DType enum: code <-> numpy dtype. Only integer dtypes can hold token ids, but
# the reader accepts the whole table so that it can open (and reject clearly) any Megatron file.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def _pointers(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """int64 [S]: sequence i's byte offset in .bin, itemsize x (the sum of the lengths before it)."""
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    return pointers * itemsize


class IndexedDatasetBuilder:
    """Write documents of token ids to ``PREFIX.bin`` / ``PREFIX.idx``::

        with IndexedDatasetBuilder("out/corpus", best_dtype(tok.vocab_size)) as builder:
            for text in texts:
                builder.add_document(tok.encode(text) + [tok.eod])
        # leaving the block finalizes; an exception inside it removes the temporaries instead

    dtype: an integer numpy dtype from DTYPE_CODES."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE or self.dtype.kind not in "ui":
            raise ValueError(f"dtype {self.dtype} cannot store token ids; use one of "
                             "uint8, int8, int16, int32, int64, uint16")
        bin_path(prefix).parent.mkdir(parents=True, exist_ok=True)
        # Unique temporary names: several processes (e.g. torchrun ranks) may build the same
        # prefix at once without writing into each other's files.
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp_bin = Path(f"{bin_path(prefix)}{tag}")
        self._tmp_idx = Path(f"{idx_path(prefix)}{tag}")
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._done = False

    def add_document(self, token_ids: Iterable[int] | np.ndarray) -> None:
        """Append one document (a 1-D sequence of ids, possibly empty) as one sequence."""
        if self._done:
            raise RuntimeError(f"builder for {self.prefix} is already finalized")
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {ids.shape}")
        if ids.size:
            # Refuse ids the dtype cannot hold: casting 70000 to uint16 would silently wrap.
            info = np.iinfo(self.dtype)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < max(info.min, 0) or hi > info.max:
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit {self.dtype} "
                                 f"(range [0, {info.max}]) in document {len(self._lengths)}")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(ids.size))

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._done:
            return
        self._bin.close()
        lengths = np.array(self._lengths, dtype=np.int32)
        pointers = _pointers(lengths, self.dtype.itemsize)
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)   # one sequence per document
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(doc_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_indices.tobytes(order="C"))
        os.replace(self._tmp_bin, bin_path(self.prefix))   # atomic on POSIX
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Forget everything written so far: close and delete the temporary files."""
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    len(ds) documents; ds[i] np.ndarray[len_i] of ds.dtype (a read-only view); ds.get(i, offset, n);
    ds.sequence_lengths (int32); ds.dtype; ds.num_tokens.
    DataError (naming the file) for a missing file, wrong magic or version, unknown dtype code, or
    sizes that disagree with the index; with vocab_size, for a token id outside [0, vocab_size)
    (naming the id, its document and the vocabulary; one pass over the tokens)."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int | None = None):
        self.prefix = os.fspath(prefix)
        bpath, ipath = bin_path(prefix), idx_path(prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise DataError(f"{p}: file not found (an indexed dataset needs both "
                                f"{bpath.name} and {ipath.name}; make them with python tools/preprocess_data.py)")

        idx_size = ipath.stat().st_size
        if idx_size < HEADER.size:
            raise DataError(f"{ipath}: truncated index ({idx_size} bytes, the header alone is {HEADER.size})")
        with open(ipath, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{ipath}: bad magic {magic!r}, expected {MAGIC!r} (not a Megatron indexed dataset index)")
        if version != VERSION:
            raise DataError(f"{ipath}: unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise DataError(f"{ipath}: unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]

        expected = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size != expected:
            raise DataError(f"{ipath}: size {idx_size} bytes does not match its header "
                            f"({n_seq} sequences, {n_doc} document indices -> {expected} "
                            "bytes); the file is truncated or corrupt")

        # Three arrays laid end to end after the header, read as views of one mapping.
        index = np.memmap(ipath, dtype=np.uint8, mode="r").view(np.ndarray)
        off = HEADER.size
        self.sequence_lengths = index[off:off + 4 * n_seq].view(np.int32)
        off += 4 * n_seq
        self.sequence_pointers = index[off:off + 8 * n_seq].view(np.int64)
        off += 8 * n_seq
        self.document_indices = index[off:off + 8 * n_doc].view(np.int64)
        self._check_index(ipath, n_seq, n_doc)

        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = bpath.stat().st_size
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise DataError(f"{bpath}: size {bin_size} bytes, but its index {ipath.name} "
                            f"describes {self.num_tokens} tokens of {self.dtype} = "
                            f"{self.num_tokens * self.dtype.itemsize} bytes; the pair is "
                            "truncated or does not belong together")
        # numpy cannot map an empty file; an empty dataset gets an empty array instead.
        self._tokens = (np.memmap(bpath, dtype=self.dtype, mode="r").view(np.ndarray) if self.num_tokens
                        else np.zeros(0, self.dtype))
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """DataError unless every token id is in [0, vocab_size), naming the first bad id."""
        if not self.num_tokens:
            return
        lo, hi = int(self._tokens.min()), int(self._tokens.max())
        if 0 <= lo and hi < vocab_size:
            return
        bad = hi if hi >= vocab_size else lo
        position = int(np.argmax(self._tokens == bad))
        doc = int(np.searchsorted(self.sequence_pointers // self.dtype.itemsize, position, side="right")) - 1
        raise DataError(f"{bin_path(self.prefix)}: token id {bad} (document {doc}) is outside the model's "
                        f"vocabulary [0, {vocab_size}); the ids span [{lo}, {hi}], so the data was tokenized "
                        f"with another tokenizer: give vocab_size >= {hi + 1} or re-tokenize it")

    def _check_index(self, ipath: Path, n_seq: int, n_doc: int) -> None:
        """The invariants of a one-sequence-per-document index (see the module docstring)."""
        if n_doc != n_seq + 1 or not np.array_equal(self.document_indices, np.arange(n_seq + 1)):
            raise DataError(f"{ipath}: {n_seq} sequences grouped into {max(n_doc - 1, 0)} "
                            "documents; minimegatron reads one sequence per document (data "
                            "preprocessed without sentence splitting)")
        if n_seq and self.sequence_lengths.min() < 0:
            raise DataError(f"{ipath}: negative sequence length; the index is corrupt")
        if not np.array_equal(self.sequence_pointers, _pointers(self.sequence_lengths, self.dtype.itemsize)):
            raise DataError(f"{ipath}: sequence pointers do not match the sequence lengths; the index is corrupt")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i (to its end when length is None)."""
        i, n = int(i), len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {self.prefix} ({n} documents)")
        i %= n
        doc_len = int(self.sequence_lengths[i])
        if length is None:
            length = doc_len - offset
        if offset < 0 or length < 0 or offset + length > doc_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for "
                             f"document {i} of {self.prefix} (length {doc_len})")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    # Pickling (e.g. for DataLoader worker processes) sends the prefix, not the mapped
    # tokens: the receiver maps the files itself.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {len(self)} documents, {self.num_tokens} tokens, {self.dtype})")


__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "best_dtype", "DataError"]
