"""python -m booktools.exercises {list,generate,check}

  list                    the exercises found in the reference code
  generate [--chapter N] [--force] [--dry-run]
                          write chapters/NN_*/exercises/ from the reference code; a stub
                          that holds your work is left alone unless --force
  check                   exit 1 if a committed stub differs from what generate would write
                          (CI's drift check)
"""

from __future__ import annotations

import argparse
import sys

from .catalog import Catalog, CatalogError, default_catalog
from .markers import MarkerError
from .stubs import check, generate


def _chapter(text: str) -> int:
    """"00", "0" or "00_single_device" -> 0."""
    head = text.split("_", 1)[0]
    if not head.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a chapter number (e.g. 00)")
    return int(head)


def main(argv: list[str] | None = None, catalog: Catalog | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m booktools.exercises",
                                     description="Generate and check the exercise stubs.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the exercises")
    gen = sub.add_parser("generate", help="write the stubs into chapters/NN_*/exercises/")
    gen.add_argument("--chapter", type=_chapter, help="only this chapter (e.g. 00)")
    gen.add_argument("--force", action="store_true", help="overwrite stubs that hold your work")
    gen.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    sub.add_parser("check", help="fail if the committed stubs differ from the generated ones")
    args = parser.parse_args(argv)

    try:
        catalog = catalog or default_catalog()
        root = catalog.chapters_dir.parent

        def show(path):
            try:
                return path.relative_to(root)
            except ValueError:
                return path

        if args.command == "list":
            for ex in catalog.exercises.values():
                print(f"{ex.id:6} {ex.title:45} {ex.function}()  {ex.path}:{ex.begin_line}")
            return 0

        if args.command == "generate":
            changes = generate(catalog, force=args.force, chapter=args.chapter, dry_run=args.dry_run)
            for c in changes:
                if c.action != "unchanged":
                    print(f"{c.action:9} {show(c.path)}" + (f"  ({c.detail})" if c.detail else ""))
            kept = [c for c in changes if c.action == "kept"]
            written = sum(c.action in ("write", "remove") for c in changes)
            print(f"{written} file(s) {'would change' if args.dry_run else 'changed'}, "
                  f"{sum(c.action == 'unchanged' for c in changes)} unchanged"
                  + (f", {len(kept)} kept because they hold your work (use --force to overwrite)"
                     if kept else ""))
            return 0

        problems = check(catalog)
        if not problems:
            print(f"exercise stubs are up to date ({len(catalog.exercises)} exercises)")
            return 0
        print("exercise stubs differ from the reference code:", file=sys.stderr)
        for p in problems:
            print(f"  {p.action:8} {show(p.path)}: {p.detail}", file=sys.stderr)
        return 1
    except (MarkerError, CatalogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
