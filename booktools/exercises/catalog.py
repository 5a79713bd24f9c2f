"""The catalog: every exercise of the book, found by scanning the reference package.

Where things are:
  reference code   <package>/**/*.py                 (default package: minimegatron)
  stubs            chapters/NN_<name>/exercises/<module>.py, one file per (chapter, source
                   module), named after the source module: minimegatron/model/rope.py with
                   exercises of chapter 0 -> chapters/00_single_device/exercises/rope.py

The catalog is what every other part asks: the generator (which stubs to write), the adapter
(which function implements exercise 0.1, and where the learner's version lives), the graders'
conftest (which ids exist). Scanning is cheap (only files that mention EXERCISE are parsed)
and cached per process.

Two environment variables point the machinery somewhere else (the tool's own tests use them
on a fixture package): MINIMEGATRON_EXERCISES_PACKAGE (an importable package name) and
MINIMEGATRON_CHAPTERS_DIR (default: the `chapters` folder next to the package).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .markers import Exercise, MarkerError, find_exercises

PACKAGE_ENV = "MINIMEGATRON_EXERCISES_PACKAGE"
CHAPTERS_ENV = "MINIMEGATRON_CHAPTERS_DIR"


class CatalogError(ValueError):
    """The exercises cannot be laid out (unknown id, missing chapter folder, name clash)."""


@dataclass(frozen=True)
class Catalog:
    """The exercises of one reference package and the chapter folders their stubs go to."""

    package: str          # importable name of the reference package
    package_dir: Path     # its folder
    chapters_dir: Path    # the folder that holds chapters/NN_<name>/

    @functools.cached_property
    def exercises(self) -> dict[str, Exercise]:
        """id -> Exercise, sorted by (chapter, number). Raises MarkerError on a bad marker."""
        found: dict[str, Exercise] = {}
        for path in sorted(self.package_dir.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            if "EXERCISE" not in text.upper():
                continue
            for ex in find_exercises(text, self.relative(path), self.module_name(path)):
                if ex.id in found:
                    other = found[ex.id]
                    raise MarkerError(ex.path, ex.begin_line,
                                      f"duplicate exercise id {ex.id} (also at {other.location})")
                found[ex.id] = ex
        return dict(sorted(found.items(), key=lambda item: item[1].sort_key))

    def relative(self, path: Path) -> Path:
        """`path` relative to the folder that holds the package (the repository root)."""
        return path.relative_to(self.package_dir.parent)

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(self.package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([self.package, *parts])

    def get(self, exercise_id: str) -> Exercise:
        """The exercise with this id; CatalogError naming the known ids if there is none."""
        try:
            return self.exercises[exercise_id]
        except KeyError:
            known = ", ".join(self.exercises) or "none"
            raise CatalogError(f"no exercise {exercise_id!r} in package {self.package!r} "
                               f"(known exercises: {known})") from None

    def source_path(self, ex: Exercise) -> Path:
        """The absolute path of the reference file that holds `ex`."""
        return self.package_dir.parent / ex.path

    def chapter_dir(self, chapter: int) -> Path:
        """chapters/NN_<name>/ for chapter number `chapter`; exactly one must exist."""
        matches = sorted(p for p in self.chapters_dir.glob(f"{chapter:02d}_*") if p.is_dir())
        if len(matches) != 1:
            what = "no folder" if not matches else f"{len(matches)} folders ({', '.join(m.name for m in matches)})"
            raise CatalogError(f"chapter {chapter} has {what} matching "
                               f"{self.chapters_dir}/{chapter:02d}_*; exactly one is needed "
                               "to hold its exercises")
        return matches[0]

    def stub_path(self, ex: Exercise) -> Path:
        """Where the learner's stub for `ex` lives."""
        return self.chapter_dir(ex.chapter) / "exercises" / f"{ex.module.rsplit('.', 1)[-1]}.py"

    def stub_files(self) -> dict[Path, list[Exercise]]:
        """Stub path -> the exercises it holds (in source order), for every exercise.

        Raises CatalogError if two source modules of one chapter would share a stub name.
        """
        files: dict[Path, list[Exercise]] = {}
        origin: dict[Path, str] = {}
        for ex in self.exercises.values():
            path = self.stub_path(ex)
            if origin.setdefault(path, ex.module) != ex.module:
                raise CatalogError(f"exercises of chapter {ex.chapter} in {origin[path]} and {ex.module} "
                                   f"would both go to {path}: rename one module, or move one exercise "
                                   "to another chapter")
            files.setdefault(path, []).append(ex)
        for exs in files.values():
            exs.sort(key=lambda e: e.begin_line)
        return files


def default_catalog() -> Catalog:
    """The catalog of the book (or of the package named by MINIMEGATRON_EXERCISES_PACKAGE)."""
    return _catalog(os.environ.get(PACKAGE_ENV, "minimegatron"), os.environ.get(CHAPTERS_ENV, ""))


@functools.lru_cache(maxsize=None)
def _catalog(package: str, chapters_dir: str) -> Catalog:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CatalogError(f"cannot find the package {package!r} (set {PACKAGE_ENV} to an importable package)")
    package_dir = Path(list(spec.submodule_search_locations)[0]).resolve()
    chapters = Path(chapters_dir).resolve() if chapters_dir else package_dir.parent / "chapters"
    if not chapters.is_dir():
        raise CatalogError(f"no chapters folder at {chapters}: the exercises live in a clone of the "
                           f"book's repository (or set {CHAPTERS_ENV})")
    return Catalog(package, package_dir, chapters)
