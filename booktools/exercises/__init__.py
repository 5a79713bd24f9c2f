"""The book's exercises: stubs generated from marked regions of the reference code, and the
adapter through which the same grader grades the reference or the learner's code.

  markers.py   the marker format and its rules: which regions are exercises
  catalog.py   every exercise of the package, and where its stub lives
  stubs.py     write the stub files; check that the committed ones did not drift
  adapter.py   implementation(id), plug(...), plugged(...): what a grader calls
  grading.py   what a grader's outcome means (pass / todo / fail), the inverted proof, and
               the one line a failing exercise gets in the summary
  world.py     several exercises graded in one spawned world, each failure charged to its own
  __main__.py  the command line: python -m booktools.exercises {list,generate,check}

A learner never imports this package: they edit chapters/NN_*/exercises/*.py and run
`make grade CH=NN`. A chapter author marks a region (see markers.py), runs `make exercises`
and writes a grader in tests/graders/.
"""

from .adapter import IMPL_ENV, IMPLEMENTATIONS, current_impl, implementation, plug, plugged
from .catalog import Catalog, CatalogError, default_catalog
from .markers import Exercise, MarkerError, find_exercises

__all__ = ["implementation", "plug", "plugged", "current_impl", "IMPL_ENV", "IMPLEMENTATIONS",
           "Catalog", "CatalogError", "default_catalog", "Exercise", "MarkerError", "find_exercises"]
