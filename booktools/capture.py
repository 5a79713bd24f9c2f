"""Run a recorded command's `main(argv)` and keep the dataclass it returns, beside its printout.

    python -m booktools.capture chapters/02_tp/demo.py --tp 2          # as `python chapters/02_tp/demo.py --tp 2`
    python -m booktools.capture -m minimegatron.plan --model ...        # as `python -m minimegatron.plan ...`
    torchrun ... -m booktools.capture chapters/02_tp/demo.py --tp 2 --dp 2

Every command a chapter records (its RUNS: demos, make_figures.py, benchmarks, the planner)
ends in a `main(argv)` that prints what it found and returns a dataclass of the same values,
with an `exit_code` field (the script's `__main__` block exits with it). This wrapper imports
the script (a chapter's file under its importable name, chapters.NN_x.demo, so spawned ranks
can import it again), calls its main with the rest of the command line, and, when
$BOOK_RESULTS names a file, writes `dataclasses.asdict(result)` there as JSON (rank 0 alone
under torchrun; a torchrun entry, which may leave by os._exit, calls `keep(result)` first). The printout is the script's own, line for line. booktools/measured.py
records both; a chapter's measure() reads numbers from the values, and quotes the printout.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

RESULTS = "BOOK_RESULTS"          # the environment variable naming the JSON file to write


def load_main(target: str, as_module: bool):
    """The `main` of a script path or a module name, imported as the command would run it."""
    if as_module:
        name = target if target.endswith("__main__") or not _is_package(target) else target + ".__main__"
        return importlib.import_module(name).main
    path = Path(target).resolve()
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(path.parent))                      # what `python path` puts first
    if path.parent.parent == root / "chapters":               # chapters/NN_x/file.py: its importable name
        from booktools.demo import import_chapter
        return import_chapter(path.parent.name.split("_")[0], path.stem).main
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.main


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def write_results(result, path: str) -> None:
    """asdict(result) as JSON at `path` (written to a temporary name, then renamed)."""
    if not dataclasses.is_dataclass(result):
        raise TypeError(f"main() returned {type(result).__name__}, not a dataclass of its results")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(result), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def keep(result) -> None:
    """Write `result` where $BOOK_RESULTS says, on rank 0 (RANK unset or 0): for an entry that
    may leave by os._exit (launch.finish_torchrun, when gloo threads outlive the job) and so
    calls this before leaving. Nothing when the variable is unset."""
    if os.environ.get(RESULTS) and os.environ.get("RANK", "0") == "0":
        write_results(result, os.environ[RESULTS])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m booktools.capture [-m module | script.py] [args ...]", file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    result = load_main(target, as_module)(args)
    if result is None or isinstance(result, int):             # a main that returns only its status
        return result or 0
    keep(result)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
