"""The package keeps its shape: subpackages along the data flow that import nothing after
them, a short wiring module, short functions, no import cycle.

Shape drifts when nobody looks (the wiring module once grew back from 188 to 284 lines), so
these are checked with every test run, from the code's own syntax: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cdc_join"
MAX_WIRING_LINES = 200
MAX_FUNCTION_LINES = 60
#: The package's parts in the order data moves through them: the shared modules first, then
#: the storage seam, the checkpoint and the session, then landing → join → silver → checks,
#: the run that wires them, the command line. A part imports only parts before it (or itself).
FLOW = [
    "errors",
    "schemas",
    "locations",
    "expressions",
    "config",
    "columns",
    "changeset",
    "report",
    "storage",
    "checkpoint",
    "class_archive",
    "session",
    "landing",
    "join",
    "silver",
    "checks",
    "run",
    "cli",
]


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join([*name.split(".")[: -node.level], node.module])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def _part(module: str) -> str | None:
    """The part of the flow a module belongs to (``None``: the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_wiring_module_stays_short():
    lines = len((PACKAGE / "run" / "pipeline.py").read_text().splitlines())
    assert lines <= MAX_WIRING_LINES, f"run/pipeline.py has {lines} lines (at most {MAX_WIRING_LINES})"


def test_every_part_of_the_package_is_in_the_flow():
    parts = {_part(name) for name in _modules()} - {None}
    assert parts == set(FLOW), sorted(parts ^ set(FLOW))


def test_no_import_runs_back_up_the_flow():
    # The package's __init__ is its public face (Pipeline, load_config): it may name anything.
    modules = _modules()
    known = set(modules)
    up = [
        f"{name} imports {target}"
        for name, tree in modules.items()
        if _part(name) is not None
        for target in _imports(name, tree, known)
        if _part(target) is not None and FLOW.index(_part(target)) > FLOW.index(_part(name))
    ]
    assert not up, up


def test_each_subpackage_says_what_it_does_and_what_it_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in text, f"{init.parent.name}/__init__.py does not say what it may import"


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_no_two_modules_import_each_other_even_through_others():
    modules = _modules()
    known = set(modules)
    # A package's __init__ hands its modules' names on: importing it is importing them.
    graph = {name: _imports(name, tree, known) for name, tree in modules.items()}
    packages = {n for n in known if (PACKAGE.parent / n.replace(".", "/") / "__init__.py").exists()}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and start not in packages and node not in packages:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in seen and nxt not in packages:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, cycles[:5]
