"""The layout holds: no import circle, no import of a package above the importer, the axes
never import each other, one ordered apply_plan, and no source file over 400 lines.

Imports are read from the source (every `import meshsplit...` and `from meshsplit... import`,
also inside functions and TYPE_CHECKING blocks), so the check needs no import to run.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "meshsplit"
LEVELS = {
    "plan": 0, "batch": 0, "phases": 0, "data": 0, "models": 0, "batchnorm": 0, "mesh": 0,
    "gather": 0, "precision": 0, "plan_values": 0, "sharded_views": 0, "batchnorm_subclasses": 0,
    "job": 1,
    "tensor": 2, "pipeline": 2, "data_parallel": 2, "experts": 2, "memory": 2,
    "runtime": 3,
    "planner": 4,
    "cli": 5,
    "__init__": 6, "__main__": 6,
}  # fmt: skip
"""cli -> planner -> runtime -> axes and memory -> job -> mesh, plan, batch (DESIGN.md)."""
AXES = {"tensor", "pipeline", "data_parallel", "experts"}


def _module(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports() -> dict[str, set[str]]:
    """meshsplit module -> the meshsplit modules it imports (a name imported from a package
    counts as the submodule when one exists by that name)."""
    modules = {_module(p): p for p in SOURCE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
                submodules = [n for n in names if n.removeprefix("meshsplit.") in modules]
                targets = submodules if len(submodules) == len(names) else [node.module]
            else:
                continue
            for target in targets:
                if target.startswith("meshsplit."):
                    inner = target.removeprefix("meshsplit.")
                    while inner and inner not in modules:
                        inner = inner.rpartition(".")[0]
                    if inner and inner != name:
                        found.add(inner)
        graph[name] = found
    return graph


def _top(module: str) -> str:
    return module.split(".")[0]


def test_no_import_runs_up_the_layers_or_across_the_axes() -> None:
    wrong = []
    for module, imported in _imports().items():
        for target in imported:
            here, there = _top(module), _top(target)
            if here == there:
                continue
            if LEVELS[there] > LEVELS[here] or (here in AXES and there in AXES):
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_no_import_circle() -> None:
    graph = _imports()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_no_source_file_over_400_lines() -> None:
    long = {str(p): n for p in SOURCE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_every_package_is_placed_in_the_layers() -> None:
    assert {_top(m) for m in _imports()} <= set(LEVELS)


def test_one_ordered_apply_plan() -> None:
    defined = [
        path.relative_to(SOURCE)
        for path in SOURCE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "apply_plan"
    ]
    assert defined == [Path("runtime/apply_plan.py")]
    source = (SOURCE / "runtime" / "apply_plan.py").read_text()
    steps = [
        int(line.split(".")[0].strip("# "))
        for line in source.splitlines()
        if line.strip()[:4].startswith("# ") and line.strip()[2:3].isdigit()
    ]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 6
