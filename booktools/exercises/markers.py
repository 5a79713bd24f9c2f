"""Find the exercise regions marked in a reference source file, and reject malformed ones.

An exercise is a marked region of a module-level function in the reference code:

    def causal_attention(query, key, value):
        \"\"\"The docstring is the learner's spec: shapes, invariants, collectives.\"\"\"
        # BEGIN EXERCISE 0.1: causal self-attention | hint: which scores may the query at ...
        ...the reference body...
        # END EXERCISE

The rules (each broken rule is a `MarkerError` naming file:line):

* `# BEGIN EXERCISE <chapter>.<n>: <title> | hint: <one-line hint>` and `# END EXERCISE`
  (optionally `# END EXERCISE <id>`) are comments on lines of their own.
* The id is `<chapter>.<n>`, two integers; the chapter decides where the stub goes
  (0 -> chapters/00_*/exercises/). Ids are unique across the package.
* The region lies in the body of a module-level function (not a method, not a nested
  function) that has a docstring (the learner's spec), after the docstring, at the indentation of the body, and holds whole statements
  of the body: it may start after some statements and stop before others (the stub keeps
  those), but it never cuts a statement (an `if`, a `for`, ...) in two.
* Regions do not nest, every BEGIN has its END, and a function has at most one exercise.

What a hint says (a convention, not checked here): the idea, never the code. It sits right above
the `raise` where a learner cannot miss it, so it names the quantity, the invariant or the
Megatron-LM function to read, and asks the question that leads there; a fuller hint, still not
the code, can be folded in the chapter's README under "Stuck on exercise N.M?" (see stubs.py).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

# Any comment that looks like a marker, however badly written: it must then parse exactly.
_ANY_MARKER = re.compile(r"#\s*(BEGIN|END)\s+EXERCISE\b", re.IGNORECASE)
_BEGIN = re.compile(r"#\s*BEGIN EXERCISE\s+(?P<id>\d+\.\d+)\s*:\s*(?P<title>[^|]*?)\s*"
                    r"\|\s*hint:\s*(?P<hint>.*?)\s*$")
_END = re.compile(r"#\s*END EXERCISE(?:\s+(?P<id>\d+\.\d+))?\s*$")

BEGIN_FORMAT = "# BEGIN EXERCISE <chapter>.<n>: <title> | hint: <one-line hint>"


class MarkerError(ValueError):
    """A malformed exercise marker. `str()` reads `path:line: what is wrong`."""

    def __init__(self, path: str | Path, line: int, message: str):
        self.path, self.line, self.message = str(path), line, message
        super().__init__(f"{path}:{line}: {message}")


@dataclass(frozen=True)
class Exercise:
    """One exercise region of the reference code.

    Line numbers are 1-based lines of the source file: `first_line` is the function's first
    line (its first decorator, or `def`), `begin_line`/`end_line` the two marker lines, and
    `last_line` the function's last line (the END marker when it comes after the last
    statement).
    """

    id: str
    title: str
    hint: str
    path: Path          # the reference source file
    module: str         # its dotted module name, e.g. "minimegatron.model.attention"
    function: str       # the module-level function that holds the region
    first_line: int
    begin_line: int
    end_line: int
    last_line: int
    indent: str         # the indentation of the function body

    @property
    def chapter(self) -> int:
        """The chapter number: the part of the id before the dot."""
        return int(self.id.split(".")[0])

    @property
    def sort_key(self) -> tuple[int, int]:
        major, minor = self.id.split(".")
        return int(major), int(minor)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.begin_line}"


@dataclass(frozen=True)
class _Marker:
    kind: str            # "BEGIN" or "END"
    line: int
    col: int
    id: str | None
    title: str = ""
    hint: str = ""


def _marker_comments(source: str, path: str | Path) -> list[_Marker]:
    """Every marker comment, in order. Uses the tokenizer, so text inside strings is ignored."""
    markers: list[_Marker] = []
    lines = source.splitlines()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError) as exc:
        line = exc.args[1][0] if len(exc.args) > 1 and isinstance(exc.args[1], tuple) else 1
        raise MarkerError(path, line, f"cannot tokenize the file: {exc.args[0]}") from None
    for tok in tokens:
        if tok.type != tokenize.COMMENT or not _ANY_MARKER.match(tok.string):
            continue
        row, col = tok.start
        if lines[row - 1][:col].strip():
            raise MarkerError(path, row, "an exercise marker must be a comment on a line of its own")
        text = tok.string.rstrip()
        if m := _BEGIN.match(text):
            if not m["title"] or not m["hint"]:
                raise MarkerError(path, row, f"an exercise needs a title and a hint: {BEGIN_FORMAT}")
            markers.append(_Marker("BEGIN", row, col, m["id"], m["title"], m["hint"]))
        elif m := _END.match(text):
            markers.append(_Marker("END", row, col, m["id"]))
        elif re.match(r"#\s*BEGIN", text, re.IGNORECASE):
            raise MarkerError(path, row, f"malformed BEGIN marker {text!r}; expected {BEGIN_FORMAT!r}")
        else:
            raise MarkerError(path, row, f"malformed END marker {text!r}; expected '# END EXERCISE'")
    return markers


def _pair(markers: list[_Marker], path: str | Path) -> list[tuple[_Marker, _Marker]]:
    """Match each BEGIN with its END: no nesting, no stray END, no unclosed BEGIN."""
    pairs, open_ = [], None
    for mk in markers:
        if mk.kind == "BEGIN":
            if open_ is not None:
                raise MarkerError(path, mk.line, f"exercise {mk.id} begins inside exercise {open_.id} "
                                  f"(begun at line {open_.line}): regions cannot nest")
            open_ = mk
        else:
            if open_ is None:
                raise MarkerError(path, mk.line, "END EXERCISE without a BEGIN EXERCISE before it")
            if mk.id is not None and mk.id != open_.id:
                raise MarkerError(path, mk.line, f"END EXERCISE {mk.id} closes exercise {open_.id} "
                                  f"(begun at line {open_.line})")
            pairs.append((open_, mk))
            open_ = None
    if open_ is not None:
        raise MarkerError(path, open_.line, f"exercise {open_.id} is never closed: add '# END EXERCISE'")
    return pairs


def _functions(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[ast.AST]]]:
    """Every function in the tree with its chain of enclosing nodes (outermost first)."""
    found = []

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child, parents))
            visit(child, parents + [child] if isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else parents)

    visit(tree, [])
    return found


def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([d.lineno for d in decorators] + [node.lineno])


def _has_docstring(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = fn.body[0]
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str))


def find_exercises(source: str, path: str | Path, module: str = "") -> list[Exercise]:
    """All exercises marked in `source` (the text of file `path`, module `module`), in order.

    Raises MarkerError (path:line: message) for every rule of this module's docstring that
    the file breaks; the first broken rule is reported.
    """
    path = Path(path)
    markers = _marker_comments(source, path)
    if not markers:
        return []
    pairs = _pair(markers, path)
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise MarkerError(path, exc.lineno or 1, f"syntax error: {exc.msg}") from None
    functions = _functions(tree)
    lines = source.splitlines()

    exercises: list[Exercise] = []
    seen: dict[str, int] = {}
    used_functions: dict[str, str] = {}
    for begin, end in pairs:
        if begin.id in seen:
            raise MarkerError(path, begin.line, f"duplicate exercise id {begin.id} "
                              f"(also at line {seen[begin.id]})")
        seen[begin.id] = begin.line

        # The innermost function whose lines contain the BEGIN marker.
        around = [(fn, parents) for fn, parents in functions
                  if _first_line(fn) < begin.line <= fn.end_lineno]
        if not around:
            raise MarkerError(path, begin.line, f"exercise {begin.id} is outside a function: "
                              "a region must lie in the body of a module-level function")
        fn, parents = max(around, key=lambda item: item[0].lineno)
        if parents:
            outer = ".".join(getattr(p, "name", "?") for p in parents)
            kind = "a method of class" if isinstance(parents[-1], ast.ClassDef) else "nested in"
            raise MarkerError(path, begin.line, f"exercise {begin.id} is in {fn.name!r}, {kind} {outer!r}: "
                              "exercises must be module-level functions. Move the code into a "
                              "module-level function that the method calls, and mark that one")
        if fn.name in used_functions:
            raise MarkerError(path, begin.line, f"function {fn.name!r} already holds exercise "
                              f"{used_functions[fn.name]}: one exercise per function")
        used_functions[fn.name] = begin.id

        if not _has_docstring(fn):
            raise MarkerError(path, fn.lineno, f"function {fn.name!r} holds exercise {begin.id} but has "
                              "no docstring: the docstring is the learner's spec (shapes, invariants)")
        if begin.line <= fn.body[0].end_lineno:
            raise MarkerError(path, begin.line, f"exercise {begin.id} starts before the end of the "
                              f"docstring of {fn.name!r}: the docstring is the spec and stays")
        indent = lines[fn.body[0].lineno - 1][:fn.body[0].col_offset]
        for mk in (begin, end):
            if mk.col != len(indent):
                raise MarkerError(path, mk.line, f"exercise marker is indented {mk.col} columns, the body "
                                  f"of {fn.name!r} {len(indent)}: markers sit at the body's indentation, "
                                  "so that a region is whole statements of the body")

        # The END must belong to the same function: nothing but blank lines and comments may
        # separate it from the function's last statement.
        last_line = max(fn.end_lineno, end.line)
        if end.line > fn.end_lineno:
            between = [n for n in range(fn.end_lineno + 1, end.line)
                       if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")]
            if between:
                raise MarkerError(path, end.line, f"END of exercise {begin.id} is not in function "
                                  f"{fn.name!r} (it ends at line {fn.end_lineno})")

        inside = []
        for stmt in fn.body:
            first, last = _first_line(stmt), stmt.end_lineno
            if begin.line < first and last < end.line:
                inside.append(stmt)
            elif first < begin.line <= last or first <= end.line < last:
                cut = begin if first < begin.line <= last else end
                raise MarkerError(path, cut.line, f"exercise {begin.id}: this marker cuts the statement "
                                  f"at lines {first}-{last} in two; a region holds whole statements")
        if not inside:
            raise MarkerError(path, begin.line, f"exercise {begin.id} holds no code")

        exercises.append(Exercise(id=begin.id, title=begin.title, hint=begin.hint, path=path,
                                  module=module, function=fn.name, first_line=_first_line(fn),
                                  begin_line=begin.line, end_line=end.line, last_line=last_line,
                                  indent=indent))
    return exercises
