"""Layering: every import in labkit/ and kernels/ points down the stack, and no modules import
each other in a circle.

The layers, bottom to top (a module may import its own layer or any layer below):

    0  labkit.errors, labkit.utils, labkit.paths,     named errors, small helpers, repo paths,
       labkit.config                                  EngineConfig (read by every layer)
    1  labkit.model                                   config, the model, reference generate
    2  labkit.kv                                      blocks, paged KV, attention backends, KV ops
    3  labkit.kernels (kernels/)                      Triton kernels beside their references
    4  labkit.sched                                   requests, the scheduler
    5  labkit.engine                                  LLM, LLMEngine, executors, trace
    6  labkit.spec, labkit.sim, labkit.parallel,      features built on the engine
       labkit.quant, labkit.train, labkit.compress,
       labkit.lora
    7  labkit.serve                                   the HTTP service
    8  labkit.router                                  many servers behind one address
    9  labkit.viz, labkit.bench, labkit.exercises,    what a learner runs, and the package
       labkit.cli, labkit (its __init__)              itself: the lazy public API and the
                                                      composition root that plugs spec and the
                                                      Triton backend into the layers below

The same stack as labkit/README.md's map. quant, train and compress sit in layer 6 by what they
import today: quant needs model (its quantized linears wrap the model's), kernels (the Triton
dequant matmuls) and train (calibration text comes from the training corpus); train needs only
model; compress is empty. None sits lower: nothing below the engine needs them (the INT8 KV
cache's quantize step lives in kv/).

Both module-level imports and imports inside functions count: a lazy import still ties the two
modules together, it only hides the tie until run time. ``if TYPE_CHECKING:`` imports count
too (they are read by the type checker the same way).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("labkit.errors", "labkit.utils", "labkit.paths", "labkit.config"),
    ("labkit.model",),
    ("labkit.kv",),
    ("labkit.kernels",),
    ("labkit.sched",),
    ("labkit.engine",),
    ("labkit.spec", "labkit.sim", "labkit.parallel", "labkit.quant", "labkit.train",
     "labkit.compress", "labkit.lora"),
    ("labkit.serve",),
    ("labkit.router",),
    ("labkit.viz", "labkit.bench", "labkit.exercises", "labkit.cli", "labkit"),
]

# Known upward imports, each (importer, imported module). Empty since core's redesign landed
# (issue 12): the errors moved to labkit.errors, the simulator executor to labkit.sim, the INT8
# KV quantize into kv/, and spec is plugged in by the composition root. Keep it empty.
KNOWN_UPWARD: set[tuple[str, str]] = set()


# ---- the checker --------------------------------------------------------------------------------
def module_name(path: Path, root: Path) -> str:
    """labkit/kv/cache.py -> labkit.kv.cache; kernels/nf4.py -> labkit.kernels.nf4 (it installs
    as labkit.kernels); a package's __init__.py is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["labkit", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def collect_modules(root: Path) -> dict[str, Path]:
    files = [*root.glob("labkit/**/*.py"), *root.glob("kernels/**/*.py")]
    return {module_name(p, root): p for p in sorted(files)}


def imports_of(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """labkit modules ``name`` imports anywhere in its file (module level and in functions).
    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module, else ``pkg``."""
    known = set(modules)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "labkit" or t.startswith("labkit."):
                while t not in known and "." in t:  # labkit.x.y.attr -> the module that exists
                    t = t.rsplit(".", 1)[0]
                if t != name:
                    out.add(t)
    return out


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int:
    """Index of the layer whose longest prefix matches ``module``."""
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS "
                             "(and to the docstring's diagram)")
    return best


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = collect_modules(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]
                   ) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if layer_of(b, layers) > layer_of(a, layers))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# ---- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module, LAYERS)


def test_no_upward_imports(graph):
    found = upward_imports(graph, LAYERS)
    new = [f"{a} imports {b} (layer {layer_of(a, LAYERS)} -> {layer_of(b, LAYERS)})"
           for a, b in found if (a, b) not in KNOWN_UPWARD]
    assert not new, "upward imports:\n  " + "\n  ".join(new)


def test_allowlist_is_not_stale(graph):
    """An entry that no longer occurs must leave the list, so the list only ever shrinks."""
    stale = KNOWN_UPWARD - set(upward_imports(graph, LAYERS))
    assert not stale, f"fixed, remove from KNOWN_UPWARD: {sorted(stale)}"


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


# ---- negative controls: the checker on a synthetic tree ------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


CLEAN = {
    "labkit/__init__.py": "",
    "labkit/errors.py": "class LabkitError(Exception): ...\n",
    "labkit/model/__init__.py": "",
    "labkit/model/llama.py": "from labkit.errors import LabkitError\n",
    "labkit/kv/__init__.py": "",
    "labkit/kv/cache.py": "from labkit.model import llama\n",
    "kernels/__init__.py": "",
    "kernels/nf4.py": "from . import _common\nfrom labkit.kv.cache import x\n",
    "kernels/_common.py": "",
    "labkit/engine/__init__.py": "",
    "labkit/engine/llm.py": "from labkit.kv.cache import *\nimport labkit.kernels.nf4\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    g = import_graph(_tree(tmp_path, CLEAN))
    assert g["labkit.kv.cache"] == {"labkit.model.llama"}  # `from pkg import module`
    assert g["labkit.engine.llm"] == {"labkit.kv.cache", "labkit.kernels.nf4"}  # `import a.b`
    assert g["labkit.kernels.nf4"] == {"labkit.kernels._common", "labkit.kv.cache"}  # relative
    assert upward_imports(g, LAYERS) == [] and import_cycles(g) == []


def test_checker_flags_an_upward_import_inside_a_function(tmp_path):
    bad = dict(CLEAN)
    bad["labkit/kv/cache.py"] += "def f():\n    from labkit.engine.llm import x\n"
    g = import_graph(_tree(tmp_path, bad))
    assert upward_imports(g, LAYERS) == [("labkit.kv.cache", "labkit.engine.llm")]
    assert import_cycles(g) == [["labkit.engine.llm", "labkit.kernels.nf4", "labkit.kv.cache"]]


def test_checker_flags_the_engine_importing_a_feature(tmp_path):
    bad = dict(CLEAN, **{"labkit/spec/__init__.py": "",
                         "labkit/spec/executor.py": "from labkit.engine import llm\n"})
    bad["labkit/engine/llm.py"] += "import labkit.spec.executor\n"
    g = import_graph(_tree(tmp_path, bad))
    assert ("labkit.engine.llm", "labkit.spec.executor") in upward_imports(g, LAYERS)
    assert ["labkit.engine.llm", "labkit.spec.executor"] in import_cycles(g)


def test_checker_flags_a_cycle_within_one_layer(tmp_path):
    bad = dict(CLEAN, **{"labkit/exercises/__init__.py": "",
                         "labkit/exercises/checks.py": "def f():\n"
                                                       "    from labkit.exercises import a\n",
                         "labkit/exercises/a.py": "from labkit.exercises.checks import f\n"})
    g = import_graph(_tree(tmp_path, bad))
    assert upward_imports(g, LAYERS) == []
    assert import_cycles(g) == [["labkit.exercises.a", "labkit.exercises.checks"]]


def test_checker_on_the_real_tree_with_an_added_upward_import(tmp_path):
    """The negative control on the real code: model importing the engine is caught."""
    g = {k: set(v) for k, v in import_graph(ROOT).items()}
    g["labkit.model.llama"].add("labkit.engine.llm_engine")
    assert ("labkit.model.llama", "labkit.engine.llm_engine") in upward_imports(g, LAYERS)


def test_exercise_solutions_are_read_only_by_inject(graph):
    """The spoilers are a leaf: checkers take their references from labkit, never from them."""
    readers = {m for m, deps in graph.items() if "labkit.exercises.solutions" in deps}
    assert readers == {"labkit.exercises.inject"}
    readers = {m for m, deps in graph.items() if "labkit.exercises.triton_solutions" in deps}
    assert readers == {"labkit.exercises.solutions"}


def test_one_repo_root():
    """Only labkit/paths.py climbs from ``__file__`` to the repository root."""
    climbers = [str(p.relative_to(ROOT)) for p in collect_modules(ROOT).values()
                if "__file__" in (text := p.read_text()) and ".parents[" in text]
    assert climbers == ["labkit/paths.py"]
