"""The import graph of pipeline/, drawn from the source with ast: no circle, no module below the stages imports one,
the packages below the stages import only downward (PACKAGES), and every stage's dvc.yaml deps list the code that
decides its outputs (all it imports but the plumbing named below).

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
    assert "pipeline.extraction.inputs" in GRAPH["pipeline.planning.plan"]
    assert "pipeline.extraction.engine" in GRAPH["pipeline.extraction.ray"]  # inside a method
    assert "pipeline.stages" in GRAPH["pipeline.cli"]
    assert "pipeline.verification.samples.scores" in GRAPH["pipeline.verification.scan"]


def test_no_import_circle_in_pipeline() -> None:
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_below_the_stages_imports_a_stage() -> None:
    climbs = {m: sorted(n for n in GRAPH[m] if is_stage(n)) for m in GRAPH if not is_stage(m)}
    assert not {m: n for m, n in climbs.items() if n}, "modules below the stages import stage modules"


# The packages below the stages, highest first. A module in one imports, of pipeline, only its own package, the
# packages after it in this list and the modules at pipeline/'s top (never a stage, the stage registry or the entry);
# so no package imports upward and there is no circle between packages.
PACKAGES = [
    "pipeline.workflow",  # around `run <stage>`: launcher, output guard, invalidation, input checks, sweep, share
    "pipeline.planning",  # `make plan`: the extraction's bytes, wall time and memory, verify's reference cost
    "pipeline.embedded",  # the targets we build (their CPU training pins its arithmetic as training does)
    "pipeline.training",  # the draft's trainer: worker, data, torchrun, speculators on CPU, CPU arithmetic, draft
    "pipeline.extraction",  # the engine side of extract: inputs, capacity, output, engines, the vLLM glue
    "pipeline.verification",  # verify's machinery: the shard scan, its checks and report; per-sample tests; reference
    "pipeline.hidden_states",  # the shard format extract writes and the others read, its statistics, export
    "pipeline.install",  # `make setup` and `make bundle`: the stacks, the venv, bundles (standard library only)
]
# The entry, above everything; nothing imports it.
ENTRY = {"pipeline.__main__", "pipeline.cli"}
# The base at pipeline/'s top: every package may import it, and it imports nothing but itself.
BASE = {"pipeline.params", "pipeline.layout", "pipeline.errors", "pipeline.atomic", "pipeline.progress", "pipeline.console",
        "pipeline.watchdog", "pipeline.target", "pipeline.chat_data", "pipeline.int4"}


def package_of(module: str) -> str | None:
    """The package (pipeline.stages or one of PACKAGES) `module` belongs to, None for a module at the top."""
    for p in ("pipeline.stages", *PACKAGES):
        if module == p or module.startswith(p + "."):
            return p
    return None


def test_the_packages_exist_and_hold_their_modules() -> None:
    for p in PACKAGES:
        assert p in MODULES and MODULES[p].name == "__init__.py", f"{p} is not a package"
        assert any(package_of(m) == p and m != p for m in MODULES), f"{p} holds no module"


def test_no_package_imports_upward() -> None:
    """A package's modules import no stage, not the entry, and no package above them in PACKAGES."""
    climbs = {}
    for i, pkg in enumerate(PACKAGES):
        allowed = set(PACKAGES[i:])
        for m in (m for m in GRAPH if package_of(m) == pkg):
            bad = sorted(n for n in GRAPH[m] if n in ENTRY or (q := package_of(n)) is not None and q not in allowed)
            if bad:
                climbs[m] = bad
    assert climbs == {}, f"modules importing upward: {climbs}"


def test_the_base_imports_only_the_base() -> None:
    assert all(m in MODULES for m in BASE)
    outside = {m: sorted(GRAPH[m] - BASE) for m in BASE if GRAPH[m] - BASE}
    assert outside == {}, f"base modules importing beyond the base: {outside}"


def test_no_import_circle_between_packages() -> None:
    """The graph with each package drawn as one box (a module at the top as its own) has no circle."""
    def box(m: str) -> str:
        return package_of(m) or m

    boxes: dict[str, set[str]] = {}
    for m, ns in GRAPH.items():
        boxes.setdefault(box(m), set()).update(box(n) for n in ns if box(n) != box(m))
    assert find_cycle(boxes) is None, " -> ".join(find_cycle(boxes))


# Inside verification: its sub-packages, highest first. A module in one imports, of verification, only its own
# sub-package, the sub-packages after it and VERIFICATION_BASE: the top modules of verification below them all,
# which import no sub-package. So the top modules that use a sub-package stand above it, and there is no circle.
VERIFICATION = "pipeline.verification"
SUBPACKAGES = [
    "pipeline.verification.samples",  # the per-sample tests: scores, positions, next token, fit, verdicts
    "pipeline.verification.reference",  # the transformers reference forward, whole or streamed, its cost, the check
]
VERIFICATION_BASE = {"pipeline.verification.report", "pipeline.verification.shard_view",
                     "pipeline.verification.host_staging"}


def subpackage_of(module: str) -> str | None:
    for p in SUBPACKAGES:
        if module == p or module.startswith(p + "."):
            return p
    return None


def test_verification_sub_packages_import_downward() -> None:
    assert all(p in MODULES and MODULES[p].name == "__init__.py" for p in SUBPACKAGES)
    assert all(m in MODULES and subpackage_of(m) is None and package_of(m) == VERIFICATION for m in VERIFICATION_BASE)
    climbs = {}
    for i, sub in enumerate(SUBPACKAGES):
        allowed = set(SUBPACKAGES[i:])
        for m in (m for m in GRAPH if subpackage_of(m) == sub):
            bad = sorted(n for n in GRAPH[m] if package_of(n) == VERIFICATION and n != VERIFICATION
                         and subpackage_of(n) not in allowed and n not in VERIFICATION_BASE)
            if bad:
                climbs[m] = bad
    for m in VERIFICATION_BASE:
        if bad := sorted(n for n in GRAPH[m] if subpackage_of(n) is not None):
            climbs[m] = bad
    assert climbs == {}, f"verification modules importing upward: {climbs}"


def test_no_import_circle_inside_verification() -> None:
    """verification's modules with each sub-package drawn as one box have no circle."""
    def box(m: str) -> str:
        return subpackage_of(m) or m

    boxes: dict[str, set[str]] = {}
    for m, ns in GRAPH.items():
        if package_of(m) == VERIFICATION:
            boxes.setdefault(box(m), set()).update(box(n) for n in ns if package_of(n) == VERIFICATION and box(n) != box(m))
    assert find_cycle(boxes) is None, " -> ".join(find_cycle(boxes))


# What a stage's dvc.yaml `deps:` may leave out of the code it imports: plumbing that moves or names things without
# deciding what any stage computes (an edit to it must not re-run a GPU-day extraction) ...
PLUMBING = {
    "pipeline.atomic": "writes a file whole or not at all",
    "pipeline.hidden_states.disk_write": "writes given bytes at the disk's rate (tuning it must not re-run extract)",
    "pipeline.errors": "error types",
    "pipeline.layout": "where outputs live (moving one is a dvc.yaml edit anyway)",
    "pipeline.params": "the params schema: every value a stage reads is a params.yaml key its `params:` list tracks",
    "pipeline.progress": "progress bars",
    "pipeline.console": "where a stage's lines go: the console or logs/<stage>.log",
    "pipeline.watchdog": "how long a silent engine is waited for; a run that finishes wrote the same bytes",
    "pipeline.target": "reads target.json (a dep through artifacts/model) and hashes files",
    "pipeline.workflow.invalidation": "the table the `params:` lists follow",
}
# ... and, per stage, modules imported for another stage's sake
_CONNECTOR = {
    "pipeline.extraction.hs_connector": "extraction's KV connector, imported lazily by vllm_compat",
    "pipeline.hidden_states.fp8": "the connector's fp8 quantizer: extraction's storage, not this stage's",
    "pipeline.hidden_states.storage": "the storage dtypes the fp8 quantizer names",
    "pipeline.hidden_states.stats": "the statistics the connector records beside the fp8 states",
}
IMPORTED_ONLY = {
    "check": _CONNECTOR,
    "regenerate": _CONNECTOR,
    "eval": _CONNECTOR,
    "train": {"pipeline.hidden_states.stats": "the statistics the shard format writes, not what it reads"},
}


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH.get(m, ())
    return seen


def test_each_stage_depends_on_the_code_that_decides_its_outputs() -> None:
    """dvc.yaml lists, for every stage, each pipeline module its entry imports (directly or not) but the plumbing
    above: a module that decides a stage's outputs and is not listed would let an edit to it leave a stale output in
    place (an edit to pipeline/verification/samples/fit.py would otherwise not re-run verify)."""
    import yaml

    stages = yaml.safe_load((PIPELINE.parent / "dvc.yaml").read_text())["stages"]
    missing = {}
    for stage, spec in stages.items():
        listed = {d for d in spec.get("deps", []) if isinstance(d, str)}
        skip = PLUMBING.keys() | IMPORTED_ONLY.get(stage, {}).keys()
        files = {str(MODULES[m].relative_to(PIPELINE.parent)) for m in closure(f"pipeline.stages.{stage}") - skip - {"pipeline"}}
        absent = sorted(f for f in files if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in listed))
        if absent:
            missing[stage] = absent
    assert missing == {}, f"dvc.yaml deps lack the code that decides these stages' outputs: {missing}"


def test_a_code_folder_in_deps_is_all_the_stages_code() -> None:
    """A stage names a package folder in its deps only when every module in it is code the stage runs (else an edit
    to a module it never imports would re-run it), and DVC leaves Python's byte-code caches out of folders."""
    import yaml

    stages = yaml.safe_load((PIPELINE.parent / "dvc.yaml").read_text())["stages"]
    loose = {}
    for stage, spec in stages.items():
        runs = closure(f"pipeline.stages.{stage}")
        for d in (d for d in spec.get("deps", []) if isinstance(d, str) and d.startswith("pipeline")):
            folder = PIPELINE.parent / d
            if folder.is_dir():
                unused = sorted(str(p.relative_to(PIPELINE.parent)) for p in folder.rglob("*.py")
                                if p.name != "__init__.py" and module_name(p) not in runs)
                if unused:
                    loose[f"{stage}: {d}"] = unused
    assert loose == {}, f"folders in dvc.yaml deps holding modules the stage does not run: {loose}"
    ignored = (PIPELINE.parent / ".dvcignore").read_text().split()
    assert "__pycache__/" in ignored, ".dvcignore must leave __pycache__/ out of the code folders dvc.yaml names"
