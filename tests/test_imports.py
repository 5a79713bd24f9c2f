"""The package's shape, read from its source (no module is imported): imports go one way.

docs/ARCHITECTURE.md, section 1: config, comm, parallel_state, launch, data, checkpoint ->
placement -> model -> optim -> dp -> tp -> pp -> cp -> moe -> analysis -> parallelize -> train;
an earlier layer never imports a later one, and nothing in the library imports the training
loop. The figures come just before the loop (it draws its loss curve); the harness comes last. Every `import x` and `from x import y` counts, including the
ones inside functions (a lazy import is still a dependency: it only moves the failure to run
time).

Also: ONE model class (the parallelisms transform it, they do not subclass or rewrite it),
and no test-only code inside the package (spawn targets live in tests/workers/, chapter
experiments in chapters/NN_x/demo.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "minimegatron"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Layers, earliest first. A module may import modules of its own layer or of an earlier one;
# within a layer, imports must not form a cycle. A new top-level module or package must be
# placed here (the test fails until it is). Later chapters' folders (sp/cp, moe, fp8,
# kernels) go between pp and analysis, in chapter order.
LAYERS: list[list[str]] = [
    ["config", "comm", "parallel_state", "watchdog", "launch", "data", "checkpoint",    # foundation
     "triton_mode", "lifeline"],
    ["placement"],                  # where each parameter lives: the one record (read by everything after)
    ["model"],
    ["optim", "grad_scaler"],       # the optimizer; fp16's loss scaler (chapter 06)
    ["dp"],
    ["tp"],
    ["pp"],
    ["cp"],                         # chapter 04 (sequence parallelism lives in tp, as in Megatron)
    ["moe"],                        # chapter 05
    ["fp8"],                        # chapter 06 (bf16 / fp16 live in optim, grad_scaler and dp)
    ["kernels"],                    # chapter 07: Triton programs
    ["recompute"],                  # chapter 07
    # formulas (parameters, FLOPs, memory): may check a layout with the chapters' own rules
    # (tp.check_tensor_parallel_config); never the model builder or the training loop
    ["analysis"],
    ["parallelize"],
    ["viz"],                                        # every figure (the loop draws its loss curve)
    ["arguments"],                                  # the loop's command line
    ["dist_checkpoint"],                            # chapter 08's checkpoints that reshard (the loop saves them)
    ["plan", "convert"],                            # chapter 08's planner and Hugging Face conversion; nothing imports them
    ["profiling", "nonfinite", "resume", "train"],  # --profile; inf/nan stops; checkpoints saved, resumed; the loop
    ["generate"],                                   # chapter 08's decoding (loads a checkpoint with the loop's layout)
    ["testing"],                                    # the harness (it runs train_step)
    ["run_report"],                                 # make demo's entry: the loop, its report and its check
]
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
ROOT_MODULE = PACKAGE                               # minimegatron/__init__.py: may import anything


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The layer table's unit of a module: minimegatron.dp.zero -> "dp"; the package root -> itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_MODULE


def imported_modules(module: str, path: Path, modules: dict[str, Path],
                     missing: list[tuple[str, int]] | None = None) -> list[tuple[str, int]]:
    """(module of the package it imports, line) for every import statement in the file,
    at any depth (functions, methods, if blocks, try blocks). `from p import name` imports
    the submodule p.name when there is one, else p itself. Imports of modules of the package
    that do not exist are appended to `missing` as (name, line)."""
    is_package = path.name == "__init__.py"
    here = module if is_package else module.rpartition(".")[0]     # the package relative imports start from
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                       for alias in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):                        # `from p import a, b`: p once
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue                                              # not ours
            if missing is not None and target not in modules:
                missing.append((target, node.lineno))                 # e.g. a module renamed since
            while target not in modules and "." in target:            # import a.b.c.name -> a.b.c
                target = target.rpartition(".")[0]
            if target != module:
                found.append((target, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: first line}} over the whole package."""
    modules = package_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in imported_modules(module, path, modules):
            edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, set[str]] | dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component that has one."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(v):                                   # Tarjan's algorithm, recursive (small graphs)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(cycle_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def cycle_through(graph, component: set[str]) -> list[str]:
    """A path start -> ... -> start inside one strongly connected component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:                                   # breadth-first, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return [start]


def _edge(src: str, dst: str, graph) -> str:
    return f"{src} -> {dst}  (line {graph[src][dst]} of {src})"


def test_every_top_level_module_is_placed_in_a_layer():
    units = {unit_of(m) for m in package_modules()} - {ROOT_MODULE}
    unplaced = sorted(units - set(LAYER_OF))
    print("not in LAYERS:", unplaced)
    assert not unplaced, f"top-level modules or packages of {PACKAGE} not placed in LAYERS: {unplaced}"


def test_every_import_of_the_package_names_an_existing_module():
    """A lazy import of a module that was renamed fails only when its function runs: find it here."""
    modules = package_modules()
    bad = []
    for module, path in modules.items():
        missing: list[tuple[str, int]] = []
        imported_modules(module, path, modules, missing)
        bad += [f"{module} (line {line}) imports {target}, which does not exist" for target, line in missing]
    print("\n".join(bad))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules():
    graph = import_graph()
    cycles = find_cycles(graph)
    for cycle in cycles:
        print("cycle: " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            print("    " + _edge(a, b, graph))
    assert not cycles, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_layer_units():
    """Between units (config, comm, dp, ...): e.g. comm -> parallel_state -> comm is a cycle
    even when no single file imports its own importer."""
    graph = import_graph()
    units: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for src, targets in graph.items():
        for dst in targets:
            a, b = unit_of(src), unit_of(dst)
            if a != b and ROOT_MODULE not in (a, b):
                units.setdefault(a, set()).add(b)
                witness.setdefault((a, b), _edge(src, dst, graph))
    cycles = find_cycles(units)
    for cycle in cycles:
        print("unit cycle: " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            print("    " + witness[(a, b)])
    assert not cycles, "import cycles between units:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_one_way():
    """No module imports a module of a later layer. Importing an unplaced unit counts as a
    violation; what an unplaced unit imports is not listed (test_every_top_level_module_is_
    placed_in_a_layer fails for it)."""
    graph = import_graph()
    upward = []
    for src, targets in sorted(graph.items()):
        a = unit_of(src)
        if a == ROOT_MODULE or a not in LAYER_OF:
            continue
        for dst in sorted(targets):
            b = unit_of(dst)
            if b == ROOT_MODULE:
                upward.append(f"{_edge(src, dst, graph)}: imports the package root")
            elif a != b and (b not in LAYER_OF or LAYER_OF[b] > LAYER_OF[a]):
                upward.append(f"{_edge(src, dst, graph)}: layer {LAYER_OF[a]} ({a}) imports "
                              f"layer {LAYER_OF.get(b, 'unplaced')} ({b})")
    for line in upward:
        print("upward: " + line)
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_formulas_never_import_the_model_builder_or_the_training_loop():
    """Stricter than the layers for the formulas: analysis never imports parallelize or train."""
    graph = import_graph()
    bad = [_edge(src, dst, graph) for src, targets in sorted(graph.items()) for dst in sorted(targets)
           if unit_of(src) == "analysis" and unit_of(dst) in ("train", "parallelize")]
    print("\n".join(bad))
    assert not bad, bad


def test_chapters_01_to_04_never_import_chapter_05s_layer():
    """The model layer holds chapter 05's MoELayer (model/moe.py) beside chapter 00's model, so
    the layer table alone lets dp, tp, pp and cp import it. They must not: what an MoE layer
    needs of an earlier chapter it says itself (MoELayer.tensor_parallel_plan, read by
    tp.apply_tensor_parallel), so the dependency points from chapter 05 to the earlier ones."""
    graph = import_graph()
    bad = [_edge(src, dst, graph) for src, targets in sorted(graph.items()) for dst in sorted(targets)
           if unit_of(src) in ("dp", "tp", "pp", "cp")
           and (dst == f"{PACKAGE}.model.moe" or dst.startswith(f"{PACKAGE}.model.moe.") or unit_of(dst) == "moe")]
    print("\n".join(bad))
    assert not bad, bad


# what runs training may import the loop: make demo's entry, and the harness that runs train_step
RUNS_TRAINING = {"run_report", "testing"}


def test_only_what_runs_training_imports_the_loop():
    """The loop is a leaf: checkpoint loading (resume), decoding (generate), the formulas read
    what they need from the layers below it, never from train.py."""
    graph = import_graph()
    bad = [_edge(src, dst, graph) for src, targets in sorted(graph.items()) for dst in sorted(targets)
           if unit_of(dst) == "train" and unit_of(src) not in RUNS_TRAINING | {"train", ROOT_MODULE}]
    print("\n".join(bad))
    assert not bad, bad


def test_one_model_class():
    classes = []
    for module, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("GPTModel"):
                classes.append(f"{module}.{node.name} (line {node.lineno})")
    print("model classes:", classes)
    assert len(classes) == 1 and classes[0].startswith(f"{PACKAGE}.model.gpt.GPTModel"), classes


def test_no_test_only_code_in_the_package():
    """Spawn targets of the tests live in tests/workers/, chapter experiments in
    chapters/NN_x/demo.py; the package holds the library only."""
    bad = sorted(str(path.relative_to(ROOT.parent)) for module, path in package_modules().items()
                 if path.name.startswith(("_workers", "_selftest"))
                 or unit_of(module) == "demos")
    print("test-only modules in the package:", bad)
    assert not bad, bad


# ---------------------------------------------------------------------------------------
# the checker itself, on a made-up graph
# ---------------------------------------------------------------------------------------
def test_find_cycles_reports_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_are_resolved(tmp_path):
    modules = {"minimegatron.dp": Path("dp/__init__.py"), "minimegatron.dp.zero": Path("dp/zero.py"),
               "minimegatron.comm": Path("comm/__init__.py"), "minimegatron.tp": Path("tp/__init__.py"),
               "minimegatron.tp.layers": Path("tp/layers.py")}
    source = ("from .. import comm\nfrom . import zero\nfrom ..tp.layers import X\n"
              "def f():\n    from minimegatron.tp import layers\n    import minimegatron.tp.layers.y\n")
    path = tmp_path / "ddp.py"
    path.write_text(source)
    missing = []
    found = imported_modules("minimegatron.dp.ddp", path, modules, missing)
    assert [t for t, _ in found] == ["minimegatron.comm", "minimegatron.dp.zero", "minimegatron.tp.layers",
                                     "minimegatron.tp.layers", "minimegatron.tp.layers"]
    assert missing == [("minimegatron.tp.layers.y", 6)]
