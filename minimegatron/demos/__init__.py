"""The runnable pieces of each chapter, shared by its notebook and its demo.

One module per chapter (``ch00.py``, ``ch01.py``, ...). What lives here is what a chapter
*shows* rather than what the library *is*: the experiments the notebook runs and the demo
prints (an equivalence check, a memory report, a worker for ``launch.spawn``). Two readers
need them, so they are written once, here:

  - ``notebooks/NN_*.ipynb`` imports them (a function typed into a notebook cannot be sent to
    the ranks that ``minimegatron.launch.spawn`` starts: those processes import it by name);
  - ``chapters/NN_*/demo.py`` imports them and prints the verdict.

The library code they use (``minimegatron.model``, ``.train``, ``.testing``, ``.analysis``)
stays the single source of truth; nothing here re-implements it, except where a chapter
writes a step out on purpose, and then the docstring says so.
"""
