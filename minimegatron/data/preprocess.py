"""Turn a JSONL corpus into an indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

One JSON object per line with a string "text" (other fields ignored, blank lines skipped) ->
one document each, ``<eod>`` appended with ``--append-eod``; uint16 tokens below 65500 ids,
else int32. ``preprocess_jsonl(input, output_prefix, tokenizer, append_eod=True)``, or
``python tools/preprocess_data.py --help``. A line that is not a JSON object with a string
"text" raises ``DataError`` naming the file and 1-based line; nothing is written then."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from .errors import DataError
from .indexed_dataset import IndexedDatasetBuilder, best_dtype
from .tokenizer import build_tokenizer


def iter_jsonl_texts(path: str | os.PathLike, progress: bool = False) -> Iterator[str]:
    """Yield the "text" of every non-blank line of a JSONL file, validating; progress: a tqdm bar in bytes."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found")
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"tokenizing {path.name}", disable=not progress) as bar:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object with a \"text\" "
                                f"field, got {type(record).__name__}")
            if "text" not in record:
                raise DataError(f"{path}:{lineno}: missing \"text\" key (keys: {', '.join(sorted(record)) or 'none'})")
            if not isinstance(record["text"], str):
                raise DataError(f"{path}:{lineno}: \"text\" must be a string, got {type(record['text']).__name__}")
            yield record["text"]


def preprocess_jsonl(input: str | os.PathLike, output_prefix: str | os.PathLike,
                     tokenizer, append_eod: bool = True, progress: bool = False) -> str:
    """Tokenize every document of ``input`` into ``output_prefix``.{bin,idx}; return the prefix.
    tokenizer: an object (``encode``, ``eod``, ``vocab_size``) or a ``build_tokenizer`` spec.
    Document i is the i-th non-blank line (+ ``<eod>`` with append_eod)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = build_tokenizer(tokenizer)
    # The builder finalizes only if the whole file was read: a bad line aborts it, so no
    # half-made dataset is left under the output name.
    with IndexedDatasetBuilder(output_prefix, best_dtype(tokenizer.vocab_size)) as builder:
        for text in iter_jsonl_texts(input, progress=progress):
            ids = tokenizer.encode(text)
            if append_eod:
                ids.append(tokenizer.eod)
            builder.add_document(ids)
    return os.fspath(output_prefix)
