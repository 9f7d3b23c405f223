"""The import graph of pipeline/, drawn from the source with ast: no circle, and no module below the stages imports one.

Every `import pipeline.x` / `from pipeline.x import y` counts, at module level or inside a function
(a lazy import still runs back up). `from pipeline.stages import SECTION` names the stage registry
in pipeline/stages/__init__.py, not a stage module, and is allowed (the CLI dispatches stages by it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"


def module_name(path: Path) -> str:
    parts = path.relative_to(PIPELINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PIPELINE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The pipeline module `name` refers to (a package's __init__ when it is a package), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "pipeline" and (target := resolve(name)) and target != module:
                found.add(target)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def is_stage(module: str) -> bool:
    return module.startswith("pipeline.stages.")


def test_the_graph_sees_the_known_imports() -> None:
    # a guard that the parser reads the imports at all (lazy ones included)
    assert "pipeline.extraction.engine" in GRAPH["pipeline.stages.extract"]
    assert "pipeline.extraction.inputs" in GRAPH["pipeline.plan"]
    assert "pipeline.extraction.engine" in GRAPH["pipeline.extraction.ray"]  # inside a method
    assert "pipeline.stages" in GRAPH["pipeline.cli"]


def test_no_import_circle_in_pipeline() -> None:
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_below_the_stages_imports_a_stage() -> None:
    climbs = {m: sorted(n for n in GRAPH[m] if is_stage(n)) for m in GRAPH if not is_stage(m)}
    assert not {m: n for m, n in climbs.items() if n}, "modules below the stages import stage modules"
