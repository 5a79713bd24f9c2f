"""The embedded default corpus: the book trains on its own text.

Nothing may be downloaded at run time, and every byte of training data must be text this
repository wrote itself. So the default corpus is the book: every ``*.md`` under ``chapters/``,
the top-level ``README.md`` (both when present: an installed package has neither) and the
package's own ``.py`` files (always present). It is small (tens of thousands of tokens) but
real, mixed prose and code, enough for a tiny GPT's loss to fall visibly in a few hundred
steps.

Each source file is cut into paragraphs at blank lines; each paragraph is one document. Files
are taken in sorted order of their path relative to the repository root, so the corpus, and
every seeded sample drawn from it, is the same on every machine with the same sources.

``build_default_corpus(cache_dir)`` writes, inside ``cache_dir``:

    default.jsonl    the documents, one {"text": ..., "source": relative path} per line
    default.bin/.idx the byte-tokenized indexed dataset, <eod> after every document
    default.sha256   a hash of the sources (names and contents) the pair was built from

and returns the prefix ``cache_dir/default``. When ``default.sha256`` matches the current
sources it returns at once without writing anything; any change to a source (including this
file, which is one of them) triggers a rebuild. The hash is written last, after the pair has
been renamed into place, so an interrupted build is simply redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path

from .preprocess import preprocess_jsonl
from .tokenizer import ByteTokenizer

PACKAGE_DIR = Path(__file__).resolve().parent.parent      # .../minimegatron
REPO_ROOT = PACKAGE_DIR.parent                             # the repository (parent of package)
NAME = "default"


def corpus_sources(root: str | os.PathLike | None = None) -> list[Path]:
    """The source files of the corpus, sorted by their path relative to ``root``.

    root: the repository root (default: the parent of the installed package). The package
    folder is ``root/minimegatron``.
    """
    root = REPO_ROOT if root is None else Path(root)
    files = list((root / "chapters").rglob("*.md")) + list((root / "minimegatron").rglob("*.py"))
    if (root / "README.md").is_file():
        files.append(root / "README.md")
    files = [f for f in files if f.is_file() and "__pycache__" not in f.parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text``: runs of lines separated by blank (whitespace-only) lines.

    Surrounding blank lines are dropped; a paragraph keeps its inner newlines and indentation
    (code stays readable), minus trailing whitespace.
    """
    parts = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
    return [p.strip("\n").rstrip() for p in parts if p.strip()]


def sources_hash(sources: list[tuple[str, bytes]]) -> str:
    """sha256 over every (relative path, contents) pair, in order."""
    h = hashlib.sha256()
    for name, data in sources:
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Write to a unique temporary name, then rename: readers never see half a file."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build_default_corpus(cache_dir: str | os.PathLike = "build/corpus", *,
                         root: str | os.PathLike | None = None) -> str:
    """Build (or reuse) the default corpus; return its prefix ``cache_dir/default``.

    cache_dir: where the files go; a relative path is relative to the current directory.
    root: the repository whose text is the corpus (default: this package's repository).
    """
    root = REPO_ROOT if root is None else Path(root)
    cache_dir = Path(cache_dir)
    prefix = cache_dir / NAME
    hash_file = cache_dir / f"{NAME}.sha256"

    # Read every file once: the hash and the documents then describe the same bytes even if
    # someone edits a source while we build.
    sources = [(f.relative_to(root).as_posix(), f.read_bytes()) for f in corpus_sources(root)]
    digest = sources_hash(sources)
    up_to_date = (hash_file.is_file() and hash_file.read_text().strip() == digest
                  and Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file())
    if up_to_date:
        return str(prefix)

    cache_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, data in sources:
        for paragraph in split_paragraphs(data.decode("utf-8", errors="replace")):
            lines.append(json.dumps({"text": paragraph, "source": name}, ensure_ascii=False))
    jsonl = cache_dir / f"{NAME}.jsonl"
    _write_atomically(jsonl, "\n".join(lines) + "\n")
    preprocess_jsonl(jsonl, prefix, ByteTokenizer(), append_eod=True)
    _write_atomically(hash_file, digest + "\n")
    return str(prefix)


__all__ = ["build_default_corpus", "corpus_sources", "split_paragraphs", "sources_hash",
           "REPO_ROOT", "PACKAGE_DIR"]
