"""The house keeps its shape: small functions and classes, modules that form a DAG, no private
names imported across modules (raytrain/ and experiments/)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raytrain"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250


def _modules() -> dict[str, ast.Module]:
    return {f.stem: ast.parse(f.read_text(), str(f)) for f in sorted(PACKAGE.glob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(raytrain module, names) for every import of the package, at any level, run at runtime."""
    found = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "raytrain":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.append((parts[1], [a.name for a in node.names]))
            else:
                found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".")[1], []) for a in node.names if a.name.startswith("raytrain.")]
    return found


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
    sources = list(PACKAGE.glob("*.py")) + list((REPO / "experiments").glob("*.py"))
    private = [f"{f.relative_to(REPO)}: {module}.{n}" for f in sources
               for module, names in _imports(ast.parse(f.read_text())) for n in names if n.startswith("_")]
    assert not private, private
