"""How big the package is, as a reader meets it: code lines and docstring lines per file.

    python -m booktools.size [minimegatron] [--top 15]

A code line holds a token outside a docstring (not a comment, not blank); a docstring line is a
line of a module's, class's or function's docstring. Issue 33 set the bounds docs/ARCHITECTURE.md
reports against: code <= 9,000 and docstrings <= 4,500 lines.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER}


def docstring_lines(source: str) -> set[int]:
    """The line numbers (1-based) of every docstring in `source`."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def count(source: str) -> tuple[int, int]:
    """(code lines, docstring lines) of one file's source."""
    docs = docstring_lines(source)
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            code.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docs)
    return len(code), len(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m booktools.size", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default="minimegatron", help="the package folder (default: minimegatron)")
    parser.add_argument("--top", type=int, default=15, help="files to list, largest code first (default: 15)")
    args = parser.parse_args(argv)
    files = sorted(Path(args.folder).rglob("*.py"))
    if not files:
        parser.error(f"no .py files under {args.folder!r}")
    rows = sorted(((*count(p.read_text()), str(p)) for p in files), reverse=True)
    print(f"{'code':>6} {'doc':>6}  file")
    for code, doc, name in rows[:args.top]:
        print(f"{code:>6,} {doc:>6,}  {name}")
    print(f"{sum(r[0] for r in rows):>6,} {sum(r[1] for r in rows):>6,}  all {len(rows)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
