"""The code's shape, checked from its source with ``ast``: no import cycles among lowcomm's
modules, and no function in ``src/`` longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "lowcomm"

#: The longest function ``src/`` may hold, in lines (decorators and docstring included).
MAX_FUNCTION_LINES = 60

#: Functions allowed to stay longer, ``module.py:qualified.name`` -> why. Each entry is a debt
#: with its reason; the test fails when one is no longer needed, so the list only shrinks.
LONG_FUNCTIONS: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SOURCE.rglob("*.py"):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(child) for child in ast.walk(node))
    return hidden


def import_graph() -> dict[str, set[str]]:
    """Module -> the lowcomm modules it imports, at module level or inside a function (an
    import deferred into a function is still a dependency, only a later one)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        imported: list[str] = []
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                imported += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported += [f"{node.module}.{alias.name}" for alias in node.names]
        graph[module] = {target for name in imported if (target := resolve(name))} - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_among_lowcomm_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_detector_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "lowcomm.config" in import_graph()["lowcomm.train.checkpoint"]


def long_functions(source: Path = SOURCE) -> dict[str, int]:
    """Every function (methods and nested functions included) longer than
    :data:`MAX_FUNCTION_LINES`, as ``path/relative/to/lowcomm.py:qualified.name`` -> lines."""
    found: dict[str, int] = {}
    for path in sorted(source.rglob("*.py")):
        where = path.relative_to(source).as_posix()
        _collect(ast.parse(path.read_text()), where, "", found)
    return found


def _collect(node: ast.AST, where: str, prefix: str, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                lines = (child.end_lineno or child.lineno) - first + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{where}:{name}"] = lines
            _collect(child, where, f"{name}.", found)
        else:
            _collect(child, where, prefix, found)


def test_no_function_in_src_is_over_60_lines() -> None:
    found = long_functions()
    offenders = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS}
    assert offenders == {}, f"split these into named pieces (lines): {offenders}"
    stale = sorted(set(LONG_FUNCTIONS) - set(found))
    assert stale == [], f"no longer over {MAX_FUNCTION_LINES} lines, drop from LONG_FUNCTIONS"


def test_the_length_checker_counts_decorators_docstrings_and_nested_functions(
    tmp_path: Path,
) -> None:
    body = "".join(f"            x{i} = {i}\n" for i in range(56))
    (tmp_path / "m.py").write_text(
        "@staticmethod\ndef short():\n    pass\n\n\nclass C:\n    @property\n"
        f'    def long(self):\n        """doc"""\n\n        def inner():\n{body}'
    )
    assert long_functions(tmp_path) == {"m.py:C.long": 61}
