"""The textbook's machinery, kept out of the book's code (`minimegatron/`), like slides/build.py:

  booktools.exercises   exercise stubs generated from marked regions of minimegatron/, the drift
                        check, and the grading adapter the graders in tests/graders/ use
                        (`python -m booktools.exercises --help`, `make exercises`, `make grade`)
  booktools.demo        what every chapter demo shares: import_chapter (notebooks, graders and
                        figures reach a chapter's experiments), the torchrun-or-spawn entry
                        run_demo, the verdict line
"""
