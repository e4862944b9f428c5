"""The layout holds: the layers of pyproject.toml's import-linter contracts, no import cycle (imports
inside functions included), the public API, private names kept inside their subpackage, and the
size limits (a module of at most 600 lines, a function of 80, a class of 300) with each exception
named and its reason given."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import networkx as nx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("autoconf", "profiler")

# Over the limits, with the reason; each may not grow past the size given (a ratchet).
LONG = {
    "autoconf/specs/model.py": (632, "ModelSpec's ~50 documented fields, its schema and derived shapes"),
    "class ModelSpec": (542, "one frozen dataclass: ~50 fields, each with its docstring, and derived shapes"),
    "class Framework": (360, "a framework's defaults as data: one documented field per behaviour"),
    "def plan": (180, "the sweep's orchestration: budget, grid, networks, methods, placement, result"),
    "def search": (162, "the search's orchestration: space, study, sampler, exhaustive pass, placement"),
    "def run": (164, "the profiler's measurement sequence on one rank; also PointOptimizer.run (84)"),
    "def plan_report": (144, "the plan command's report, table by table"),
    "def block_times": (145, "one transformer block's kernels in order, each priced by its roofline"),
    "def build_parser": (128, "the command line's flags, declared in one place"),
    "def _compile": (103, "the schedule simulation's compiled dependency graph (hot path, one function)"),
    "def cmd_plan": (97, "the plan command's flags to options"),
    "def timeline_figure": (100, "one matplotlib figure, element by element"),
    "def _run_shared": (99, "the schedule simulation under processor sharing (hot path, one function)"),
    "def train": (99, "the reference trainer's step loop on one rank"),
    "def check": (94, "every validity rule of a configuration, each with its reason, in one place"),
    "def cmd_search": (88, "the search command: inputs, search, verification, emission, output"),
    "def time_memory_figure": (82, "one matplotlib figure, element by element"),
}
LIMITS = {"module": 600, "def": 80, "class": 300}


def _sources():
    for pkg in PACKAGES:
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def _module_name(rel: str) -> str:
    name = rel[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def test_the_layer_contracts_hold():
    pytest.importorskip("importlinter")
    # lint-imports reads pyproject.toml's [tool.importlinter] contracts from the working directory
    p = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                        "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert ", 0 broken." in p.stdout, p.stdout[-3000:]


def test_no_import_cycle_even_inside_functions():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    g = nx.DiGraph()
    for m in graph.modules:
        for imported in graph.find_modules_directly_imported_by(m):
            # a module's import of its own package's __init__ is how Python loads it, not a cycle
            if not m.startswith(imported + "."):
                g.add_edge(m, imported)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == []


def test_private_names_stay_inside_their_subpackage():
    def owner(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == "autoconf" and len(parts) > 2 else parts[0]

    leaks = []
    for rel, path in _sources():
        me = _module_name(rel)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and owner(node.module) != owner(me):
                        leaks.append(f"{rel}:{node.lineno} imports {node.module}.{a.name}")
    assert leaks == []


def test_the_public_api_resolves_without_torch():
    code = ("import sys, autoconf\n"
            "missing = [n for n in autoconf.__all__ if getattr(autoconf, n, None) is None]\n"
            "print(missing, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.stdout.split() == ["[]", "False"], p.stdout + p.stderr
    import autoconf
    assert {"load_model", "load_cluster", "ParallelConfig", "estimate", "search", "plan", "emit",
            "load_plan"} <= set(autoconf.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autoconf.nope  # noqa: B018


def _sizes():
    for rel, path in _sources():
        src = open(path).read()
        yield rel, "module", src.count("\n")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                yield f"{rel}:{node.name}", kind, node.end_lineno - node.lineno + 1


def test_modules_functions_and_classes_stay_short_or_say_why():
    over = []
    for where, kind, n in _sizes():
        if n <= LIMITS[kind]:
            continue
        key = where if kind == "module" else f"{kind} {where.split(':')[-1]}"
        allowed = LONG.get(key)
        if allowed is None or n > allowed[0]:
            over.append(f"{where}: {kind} of {n} lines (limit {LIMITS[kind]}"
                        + (f", allowed {allowed[0]})" if allowed else ")"))
    assert over == []


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (no packages under tests/): two alike fail collection."""
    seen: dict = {}
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                seen.setdefault(f, []).append(os.path.relpath(os.path.join(dirpath, f), ROOT))
    assert {f: p for f, p in seen.items() if len(p) > 1} == {}
