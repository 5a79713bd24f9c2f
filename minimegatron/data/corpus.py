"""The embedded default corpus: the book trains on its own text, frozen.

The default corpus is every ``*.md`` under ``chapters/``, the top-level ``README.md`` and the
package's ``.py`` files as frozen in ``book_corpus.jsonl.gz`` (``freeze_corpus()``): frozen,
because the book quotes losses measured on it. Each file (sorted by relative path) is cut into
paragraphs at blank lines, one document each.

``build_default_corpus(cache_dir)`` writes ``default.jsonl`` ({"text", "source"} per line),
``default.bin/.idx`` (byte-tokenized, <eod> after each document) and, last, ``default.sha256``
of the snapshot; it returns ``cache_dir/default`` at once when that hash matches."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import uuid
from pathlib import Path

from .preprocess import preprocess_jsonl
from .tokenizer import ByteTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]           # the repository (parent of minimegatron/)
NAME = "default"
FROZEN = Path(__file__).resolve().parent / "book_corpus.jsonl.gz"


def corpus_sources(root: str | os.PathLike | None = None) -> list[Path]:
    """The corpus's source files under ``root`` (default: the package's parent), sorted by relative path."""
    root = REPO_ROOT if root is None else Path(root)
    files = list((root / "chapters").rglob("*.md")) + list((root / "minimegatron").rglob("*.py"))
    if (root / "README.md").is_file():
        files.append(root / "README.md")
    files = [f for f in files if f.is_file() and "__pycache__" not in f.parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text`` (runs of lines between blank lines), inner newlines and indentation
    kept, trailing whitespace removed."""
    parts = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
    return [p.strip("\n").rstrip() for p in parts if p.strip()]


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a unique temporary name, then rename: readers never see half a file."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def corpus_documents(root: str | os.PathLike | None = None) -> list[dict]:
    """The live sources of ``root`` cut into documents: [{"text": paragraph, "source": path}]."""
    root = REPO_ROOT if root is None else Path(root)
    return [{"text": paragraph, "source": f.relative_to(root).as_posix()} for f in corpus_sources(root)
            for paragraph in split_paragraphs(f.read_bytes().decode("utf-8", errors="replace"))]


def freeze_corpus(root: str | os.PathLike | None = None, path: str | os.PathLike = FROZEN) -> Path:
    """Take a new snapshot of the book's text (``python -m minimegatron.data.corpus``):
    ``root``'s sources as gzipped JSON lines at ``path``. Every recorded loss moves with it."""
    lines = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in corpus_documents(root))
    path = Path(path)
    _write_atomically(path, gzip.compress(lines.encode("utf-8"), compresslevel=9, mtime=0))
    return path


def build_default_corpus(cache_dir: str | os.PathLike = "build/corpus", *, frozen: str | os.PathLike = FROZEN) -> str:
    """Build (or reuse) the default corpus from `frozen` (default the book's snapshot) in
    `cache_dir` (relative to the current directory); returns ``cache_dir/default``."""
    cache_dir = Path(cache_dir)
    prefix = cache_dir / NAME
    hash_file = cache_dir / f"{NAME}.sha256"
    snapshot = Path(frozen).read_bytes()
    digest = hashlib.sha256(Path(frozen).name.encode() + b"\0" + snapshot + b"\0").hexdigest()
    up_to_date = (hash_file.is_file() and hash_file.read_text().strip() == digest
                  and Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file())
    if up_to_date:
        return str(prefix)

    cache_dir.mkdir(parents=True, exist_ok=True)
    jsonl = cache_dir / f"{NAME}.jsonl"
    _write_atomically(jsonl, gzip.decompress(snapshot))
    preprocess_jsonl(jsonl, prefix, ByteTokenizer(), append_eod=True)
    _write_atomically(hash_file, f"{digest}\n".encode())
    return str(prefix)


__all__ = ["build_default_corpus", "freeze_corpus", "corpus_documents", "corpus_sources", "FROZEN"]


if __name__ == "__main__":
    print(f"wrote {freeze_corpus()}: {len(corpus_documents())} documents; now run `make numbers`")
