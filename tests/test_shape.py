"""The house keeps its shape: packages by the process that runs them, arrows that only point down,
small functions and classes, modules that form a DAG, no private names imported across modules
(raytrain/ and experiments/).

Floors, top to bottom: the entry points (``raytrain/*.py``: api, cli, ...), ``tune`` (sweeps, auto
layout), ``driver`` (the user's process), ``control`` (the coordinator actor), ``worker`` (the worker
actors), and the pure packages under them all, which no process package may be imported by from below.
No production package imports the test library (``raytrain.testing``).
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raytrain"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_TOP_LEVEL_MODULES = 12
PROCESS_FLOORS = {"entry": 5, "tune": 4, "driver": 3, "control": 2, "worker": 1}
PURE = {"compat", "config", "pipeline", "models", "data", "checkpoint", "optim", "reports", "testing"}
"""Imported by every process; they import no process package (nor torch.distributed's groups)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Parsed once, when pytest collects this file (below): Python 3.11's ast.parse can fail with "AST
    constructor recursion depth mismatch" while another thread of the process (a Ray client's) compiles."""
    return {_module_name(f): ast.parse(f.read_text(), str(f)) for f in sorted(PACKAGE.rglob("*.py"))}


_modules()


def _package(module: str) -> str:
    """The package a dotted module belongs to: its first level under raytrain, or 'entry'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "entry"


def _floor(package: str) -> int:
    return 0 if package in PURE else PROCESS_FLOORS[package]


def _runtime_nodes(tree: ast.AST, top_level_only: bool = False):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        if not (top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            yield from _runtime_nodes(node, top_level_only)


def _imports(tree: ast.AST, top_level_only: bool = False) -> list[tuple[str, list[str]]]:
    """(dotted raytrain module, names) for every import of the package run at runtime (at any level,
    or outside functions and classes only)."""
    found = []
    for node in _runtime_nodes(tree, top_level_only):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "raytrain":
            if node.module == "raytrain":  # from raytrain import checkpoint: a module (or an entry's name)
                found += [(f"raytrain.{a.name}", []) for a in node.names]
            else:
                found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("raytrain.")]
    return found


def _third_party_imports(tree: ast.AST) -> set[str]:
    """Top-level packages imported outside functions (what importing the module costs)."""
    found = set()
    for node in _runtime_nodes(tree, top_level_only=True):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_only_entry_points_stay_at_the_top():
    top = sorted(f.name for f in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    packages = {d.name for d in PACKAGE.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    assert packages == PURE | set(PROCESS_FLOORS) - {"entry"}, sorted(packages)


def test_imports_point_down_the_floors_and_pure_packages_import_no_process_package():
    up = []
    for name, tree in _modules().items():
        mine = _package(name)
        for target, _ in _imports(tree):
            theirs = _package(target)
            if theirs == mine:
                continue
            if _floor(theirs) > _floor(mine) or (mine in PURE and theirs not in PURE):
                up.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert not up, up


def test_no_production_package_imports_the_test_library():
    """``raytrain.testing`` (the one-process reference, peak memory) serves tests and benchmarks: nothing a
    run executes depends on it (the fault spec is ``raytrain.config.faults``, the hook ``raytrain.worker.phases``)."""
    users = [f"{name} imports {target}" for name, tree in _modules().items() if _package(name) != "testing"
             for target, _ in _imports(tree) if _package(target) == "testing"]
    assert not users, users


def test_the_control_plane_imports_no_torch_at_module_level():
    heavy = {name: sorted(_third_party_imports(tree) & {"torch"}) for name, tree in _modules().items()
             if _package(name) == "control"}
    assert not any(heavy.values()), heavy


def test_the_coordinators_process_never_imports_torch():
    # The rule above reads each module alone; a package's __init__ or any module it imports could
    # still bring torch (1-2 s of CPU in every coordinator's start): import the coordinator as its
    # process does, and look.
    probe = "import sys, raytrain.control.coordinator; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_functions_and_classes_stay_small():
    too_long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: {size} lines (function)")
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                too_long.append(f"{name}.{node.name}: {size} lines (class)")
    assert not too_long, too_long


def test_modules_import_each_other_without_a_cycle():
    modules = _modules()
    graph = {name: {m for m, _ in _imports(tree) if m in modules and m != name} for name, tree in modules.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_private_name_is_imported_across_modules():
    sources = list(PACKAGE.rglob("*.py")) + list((REPO / "experiments").glob("*.py"))
    private = [f"{f.relative_to(REPO)}: {module}.{n}" for f in sources
               for module, names in _imports(ast.parse(f.read_text())) for n in names if n.startswith("_")]
    assert not private, private


def test_no_module_holds_the_coordinator():
    """The coordinator's collaborators (crew, ledger, repairs, evaluation) get what they need, not the
    coordinator: nothing outside its module imports the class (the driver creates its actor) or takes it."""
    holders = []
    for name, tree in _modules().items():
        if name == "raytrain.control.coordinator":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "raytrain.control.coordinator" \
                    and "Coordinator" in {a.name for a in node.names} and _package(name) != "driver":
                holders.append(f"{name} imports the coordinator")
            if isinstance(node, ast.arg) and node.annotation is not None and "Coordinator" in ast.unparse(node.annotation):
                holders.append(f"{name}: parameter {node.arg} takes the coordinator")
    assert not holders, holders
