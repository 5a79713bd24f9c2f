"""How a grader reaches the code it grades: the reference, the learner's, or the bare stub.

    from booktools.exercises import implementation, plug, plugged

    causal_attention = implementation("0.1")      # the function to grade
    with plug("0.1"):                              # the whole reference model, with the
        loss = model(tokens, labels=labels)        # graded function inside it
    spawn(plugged(worker, "0.1"), 2)               # the same in every spawned rank

Which implementation: the environment variable MINIMEGATRON_IMPL (spawned ranks inherit it):

  reference  (default) the book's code in minimegatron/;
  learner    the learner's stub files, chapters/NN_*/exercises/<module>.py, as edited;
  stub       the unfilled stubs, generated in memory from the reference: the inverted
             grading of CI, which must see every grader fail with "exercise <id>".

`plug` swaps the function wherever the package holds it: every module of the package whose
namespace binds the reference function object (its own module, and copies made by
`from .attention import causal_attention`) gets the chosen implementation until the block
ends. The reference code calls the function through such a module-level name, so the model
runs the learner's code; bindings elsewhere (a class attribute, a dict of functions, a
closure) are not swapped. A spawned rank is a fresh process: give `spawn` the worker wrapped
with `plugged(worker, ids...)` and the rank plugs the same exercises before it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import linecache
import os
import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .catalog import Catalog, default_catalog
from .markers import Exercise
from .stubs import render_stub_module

IMPL_ENV = "MINIMEGATRON_IMPL"
IMPLEMENTATIONS = ("reference", "learner", "stub")

_modules: dict[tuple[str, str], tuple[bytes, types.ModuleType]] = {}


def current_impl() -> str:
    """The implementation named by MINIMEGATRON_IMPL (default "reference")."""
    impl = os.environ.get(IMPL_ENV, "reference") or "reference"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return impl


def _module_name(impl: str, catalog: Catalog, ex: Exercise) -> str:
    stub = catalog.stub_path(ex)
    return f"_minimegatron_{impl}.{stub.parent.parent.name[:2]}.{stub.stem}".replace("-", "_")


def _load_learner(catalog: Catalog, ex: Exercise) -> types.ModuleType:
    path = catalog.stub_path(ex)
    if not path.exists():
        raise FileNotFoundError(f"exercise {ex.id}: your file {path} does not exist; "
                                "`make exercises` writes the stubs")
    name = _module_name("learner", catalog, ex)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # as an import would (dataclasses, pickling look it up)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        raise ImportError(f"exercise {ex.id}: importing your file {path} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return module


def _load_stub(catalog: Catalog, ex: Exercise) -> types.ModuleType:
    exercises = catalog.stub_files()[catalog.stub_path(ex)]
    text = render_stub_module(catalog, exercises)
    name = _module_name("stub", catalog, ex)
    # A pseudo file name, with the text registered for tracebacks: the file on disk may hold a
    # learner's work and must not be shown in place of the generated stub.
    filename = f"<generated stub {catalog.stub_path(ex).relative_to(catalog.chapters_dir.parent)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(text, filename, "exec"), module.__dict__)
    return module


def implementation(exercise_id: str, impl: str | None = None) -> Callable[..., Any]:
    """The function that implements exercise `exercise_id` in `impl` (default: MINIMEGATRON_IMPL).

    reference: the function in the book's package; learner: the same-named function in the
    learner's stub file; stub: the unfilled stub, generated from the reference in memory.
    Raises a clear error if the id is unknown or the learner's file cannot be imported.
    """
    catalog = default_catalog()
    ex = catalog.get(exercise_id)
    impl = impl or current_impl()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "reference":
        module = importlib.import_module(ex.module)
    else:
        # Loaded once per process, and again if the learner's file changed since.
        path = catalog.stub_path(ex)
        version = path.read_bytes() if impl == "learner" and path.exists() else b""
        key = (impl, str(path))
        if key not in _modules or _modules[key][0] != version:
            _modules[key] = (version, (_load_learner if impl == "learner" else _load_stub)(catalog, ex))
        module = _modules[key][1]
    fn = getattr(module, ex.function, None)
    if not callable(fn):
        raise AttributeError(f"exercise {ex.id}: {impl} module {module.__name__} has no function "
                             f"{ex.function!r} (the graders call it by that name; keep the signature)")
    return fn


def _package_modules(package: str) -> list[types.ModuleType]:
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == package or name.startswith(package + "."))]


def _rebind(package: str, old: Any, new: Any) -> list[tuple[types.ModuleType, str]]:
    """Point every module-level name of the package that holds `old` at `new`."""
    changed = []
    for module in _package_modules(package):
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                changed.append((module, attr))
    return changed


@contextmanager
def plug(*exercise_ids: str, impl: str | None = None) -> Iterator[None]:
    """Inside the block, the reference package calls `implementation(id, impl)` for each id.

    With impl "reference" (the default when MINIMEGATRON_IMPL is unset) this changes nothing,
    so a grader written with `plug` runs the same way on the book's code and on the learner's.
    """
    catalog = default_catalog()
    swaps = []
    for eid in exercise_ids:
        reference = implementation(eid, "reference")
        chosen = implementation(eid, impl)
        if chosen is not reference:
            swaps.append((reference, chosen))
    try:
        for reference, chosen in swaps:
            if not _rebind(catalog.package, reference, chosen):
                raise RuntimeError(f"plug: no module of {catalog.package} holds {reference.__qualname__}; "
                                   "is its module imported?")
        yield
    finally:
        # Also catches copies made while plugged (a module imported inside the block).
        for reference, chosen in reversed(swaps):
            _rebind(catalog.package, chosen, reference)


class plugged:
    """`fn` wrapped so that it runs inside `plug(*exercise_ids)`; picklable for `spawn`.

        spawn(plugged(worker, "0.1"), world_size, ...)

    `fn` must itself be importable by name (a top-level function of a module). The rank picks
    the implementation from MINIMEGATRON_IMPL, which it inherits from the parent.
    """

    def __init__(self, fn: Callable[..., Any], *exercise_ids: str):
        self.fn = fn
        self.exercise_ids = exercise_ids
        self.__qualname__ = f"plugged({getattr(fn, '__qualname__', fn)})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with plug(*self.exercise_ids):
            return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"plugged({self.fn!r}, {', '.join(map(repr, self.exercise_ids))})"
