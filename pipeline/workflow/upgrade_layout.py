"""`python -m pipeline upgrade-layout` (`make upgrade-layout`): carry a finished project across the package layout
without re-running a stage the move did not change.

The move of pipeline/'s modules into packages (workflow/, training/, planning/, hidden_states/, extraction/,
embedded/ and verification/) changed every stage's code deps in dvc.yaml: DVC records a dep by path and md5, so after the move every
stage looks changed and `dvc repro` would re-run them all (extraction included). This command re-records, with
`dvc commit -f`, exactly the stages whose only change is that move:

1. `dvc status` lists nothing for the stage but changed deps under pipeline/ (no params, data, upstream output,
   command or output changed: a stage that is stale for any other reason is left to `dvc repro`);
2. the code dvc.lock recorded for it is found, byte for byte (its md5), in git's history at its old path (a folder
   dep through DVC's cache of its listing, or rebuilt from git), and each of those modules is, at its new path
   (MOVED), the same program: the same syntax tree once the import statements are read as what they bind and the
   moved module names and paths in strings are read back as the old ones. A definition the layout moved to
   another module (MOVED_DEFINITIONS) is compared as itself, wherever the stage's code holds it; a name it wrote out
   as its value (INLINED) reads as that value. A module's docstring-only __init__.py, gained or lost by a folder
   dep, changes nothing.

The same command carries a project across the outputs made restorable from DVC's run-cache (train's
`artifacts/draft` no longer `persist: true`, verify's `reports/verify` and eval's `reports/eval.md` in DVC's cache
instead of `cache: false`): for DVC such a report is "not in cache", though it is the very file dvc.lock recorded, so
a stage whose only other change is that (and the moved code, as above) is re-recorded too, which puts the report in
the cache. A finished project's stages never entered the run-cache (DVC kept none for them), so every stage up to
date is re-recorded as well: `dvc commit -f` saves the run of the lock's inputs and outputs there, and a param
changed and changed back afterwards restores the finished results instead of running them.

Everything else is reported and left to `dvc repro`. `--dry-run` says what it would do and commits nothing.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from pipeline.errors import PipelineError

# old path -> new path of every module the layout moved
MOVED = {
    "pipeline/launcher.py": "pipeline/workflow/launcher.py",
    "pipeline/output_guard.py": "pipeline/workflow/output_guard.py",
    "pipeline/invalidation.py": "pipeline/workflow/invalidation.py",
    "pipeline/input_checks.py": "pipeline/workflow/input_checks.py",
    "pipeline/sweep.py": "pipeline/workflow/sweep.py",
    "pipeline/share.py": "pipeline/workflow/share.py",
    "pipeline/train_worker.py": "pipeline/training/worker.py",
    "pipeline/train_data.py": "pipeline/training/data.py",
    "pipeline/torchrun.py": "pipeline/training/torchrun.py",
    "pipeline/speculators_cpu.py": "pipeline/training/speculators_cpu.py",
    "pipeline/cpu_determinism.py": "pipeline/training/cpu_determinism.py",
    "pipeline/draft.py": "pipeline/training/draft.py",
    "pipeline/plan.py": "pipeline/planning/plan.py",
    "pipeline/plan_time.py": "pipeline/planning/extract_time.py",
    "pipeline/reference_plan.py": "pipeline/planning/reference.py",
    "pipeline/shards.py": "pipeline/hidden_states/format.py",
    "pipeline/shard_stats.py": "pipeline/hidden_states/stats.py",
    "pipeline/export.py": "pipeline/hidden_states/export.py",
    "pipeline/vllm_compat.py": "pipeline/extraction/vllm_compat.py",
    "pipeline/hs_connector.py": "pipeline/extraction/hs_connector.py",
    "pipeline/seed_shape.py": "pipeline/embedded/seed_shape.py",
    "pipeline/reference.py": "pipeline/verification/reference/model.py",
    "pipeline/streamed_reference.py": "pipeline/verification/reference/streamed.py",
    "pipeline/reference_cost.py": "pipeline/verification/reference/cost.py",
    "pipeline/verify_reference_check.py": "pipeline/verification/reference/check.py",
    "pipeline/agreement.py": "pipeline/verification/reference/agreement.py",
    "pipeline/verify_samples.py": "pipeline/verification/samples/scores.py",
    "pipeline/verify_sample_judge.py": "pipeline/verification/samples/judge.py",
    "pipeline/verify_sample_positions.py": "pipeline/verification/samples/positions.py",
    "pipeline/verify_sample_next_token.py": "pipeline/verification/samples/next_token.py",
    "pipeline/verify_fit.py": "pipeline/verification/samples/fit.py",
    "pipeline/verify_least_squares.py": "pipeline/verification/samples/least_squares.py",
    "pipeline/verify_whitening.py": "pipeline/verification/samples/whitening.py",
    "pipeline/verify_shards.py": "pipeline/verification/shards.py",
    "pipeline/verify_scan.py": "pipeline/verification/scan.py",
    "pipeline/verify_values.py": "pipeline/verification/values.py",
    "pipeline/verify_audit.py": "pipeline/verification/audit.py",
    "pipeline/verify_final_head.py": "pipeline/verification/final_head.py",
    "pipeline/verify_report.py": "pipeline/verification/report.py",
    "pipeline/shard_view.py": "pipeline/verification/shard_view.py",
    "pipeline/host_staging.py": "pipeline/verification/host_staging.py",
}
# definitions the layout moved from one module to another, old module name -> {name: its home, as the old layout
# named that module}: read as the same program when the definition itself is unchanged
MOVED_DEFINITIONS = {
    "pipeline.verify_scan": {"Finding": "pipeline.verify_report"},
}
# names the layout wrote out as their value where a module imported them (old layout's name -> the value)
INLINED = {
    "pipeline.reference_cost.BUDGET_PARAM": "verify.reference_memory_gib",
}


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


# new -> old, module names and paths, longest first (pipeline.planning.reference before anything shorter)
_BACK = sorted(((_module(n), _module(o)) for o, n in MOVED.items()), key=lambda p: -len(p[0]))
_BACK_PATHS = sorted(((n, o) for o, n in MOVED.items()), key=lambda p: -len(p[0]))
_BARE = sorted(MOVED, key=lambda o: -len(o))


def old_name(name: str) -> str:
    """A dotted name as the old layout spelled it (pipeline.hidden_states.format.read_header -> pipeline.shards...)."""
    for new, old in _BACK:
        if name == new or name.startswith(new + "."):
            return old + name[len(new):]
    return name


def old_text(text: str) -> str:
    """A string with the moved module names and paths written as before the move (a bare file name as its path)."""
    for new, old in _BACK_PATHS:
        text = re.sub(rf"(?<![\w/.]){re.escape(new)}\b", old, text)
    for new, old in _BACK:
        text = re.sub(rf"(?<![\w.]){re.escape(new)}\b", old, text)
    # a moved module's bare file name (`verify_scan.py`) is its old path, as its new path now reads
    for old in _BARE:
        text = re.sub(rf"(?<![\w/.-]){re.escape(old.rpartition('/')[2])}\b", old, text)
    return text


# a moved definition by either of its homes (old layout's names) -> the name it had at its first home
_DEFINED = {f"{home}.{name}": f"{module}.{name}" for module, names in MOVED_DEFINITIONS.items()
            for name, home in names.items()} | {f"{module}.{name}": f"{module}.{name}"
                                                 for module, names in MOVED_DEFINITIONS.items() for name in names}


def _targets(node: ast.Import | ast.ImportFrom) -> list[tuple[str | None, str]]:
    """(the local name bound or None for a plain `import a.b`, the old layout's name of what it binds) per name."""
    if isinstance(node, ast.Import):
        return [(a.asname, old_name(a.name)) for a in node.names]
    base = "." * node.level + (node.module or "")
    return [(a.asname or a.name, old_name(f"{base}.{a.name}")) for a in node.names]


def _bindings(node: ast.Import | ast.ImportFrom) -> list[str]:
    # a moved definition or an inlined name is bound on one side only: read as neither
    return [f"{local} = {target}" if local else f"import {target}" for local, target in _targets(node)
            if target not in _DEFINED and target not in INLINED]


class _Canonical(ast.NodeTransformer):
    """Each run of import statements -> one marker holding what they bind; strings -> the old layout's names;
    a name bound to an inlined one (INLINED) -> its value, merged into the f-string around it."""

    def __init__(self, inlined: dict[str, str] | None = None) -> None:
        self.inlined = inlined or {}

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str):
            node.value = old_text(node.value)
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.inlined:
            return ast.Constant(self.inlined[node.id])
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.JoinedStr:
        self.generic_visit(node)
        values: list[ast.expr] = []
        for v in node.values:
            if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Constant) and \
                    isinstance(v.value.value, str) and v.conversion == -1 and v.format_spec is None:
                v = v.value
            if isinstance(v, ast.Constant) and values and isinstance(values[-1], ast.Constant):
                values[-1] = ast.Constant(values[-1].value + v.value)
            else:
                values.append(v)
        node.values = values
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                setattr(node, field, list(_fold_imports(value)))
        return node


def _fold_imports(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    run: list[str] = []
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            run += _bindings(stmt)
            continue
        if run:
            yield ast.Expr(ast.Constant("imports: " + "; ".join(sorted(run))))
            run = []
        yield stmt
    if run:
        yield ast.Expr(ast.Constant("imports: " + "; ".join(sorted(run))))


def _defined_name(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return stmt.name
    if isinstance(stmt, ast.Assign | ast.AnnAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            return targets[0].id
    return None


def canonical(source: str, module: str | None = None, moved: dict[str, str] | None = None) -> str:
    """The module's syntax tree as the old layout would read it. `module` (its old layout's name) and `moved`: the
    definitions the layout moved out of it or into it (MOVED_DEFINITIONS) are taken out of its body into `moved`,
    by the name they had at their first home."""
    tree = ast.parse(source)
    inlined = {local or target: INLINED[target] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
               for local, target in _targets(node) if target in INLINED}
    tree = _Canonical(inlined).visit(tree)
    if module is not None:
        body = []
        for stmt in tree.body:
            name = _defined_name(stmt)
            if name is not None and (first := _DEFINED.get(f"{module}.{name}")):
                if moved is not None:
                    moved[first] = ast.dump(stmt)
                continue
            body.append(stmt)
        tree.body = body
    return ast.dump(tree)


def same_program(old_source: str, new_source: str, module: str | None = None) -> bool:
    """Whether a module moved by the layout is the program it was (imports and moved names aside). With `module`
    (its old layout's name), the definitions the layout moved into or out of it are set aside: stage_verdict compares
    them between the stage's old and new code."""
    return canonical(old_source, module) == canonical(new_source, module)


def docstring_only(source: str) -> bool:
    body = ast.parse(source).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


class _Git:
    def __init__(self, root: Path) -> None:
        self.root = root

    def run(self, *args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=self.root, capture_output=True, check=True).stdout

    def blob_with_md5(self, path: str, digest: str) -> bytes | None:
        """The version of `path` somewhere in git's history whose md5 is `digest`."""
        try:
            log = self.run("log", "--all", "--no-renames", "--pretty=format:", "--raw", "--no-abbrev", "--", path)
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None
        blobs = {b for line in log.decode().splitlines() if line.startswith(":") for b in line.split()[2:4]}
        for blob in sorted(blobs - {"0" * 40}):
            data = self.run("cat-file", "blob", blob)
            if md5(data) == digest:
                return data
        return None

    def tree_listings(self, folder: str) -> Iterable[list[dict]]:
        """DVC's listing ({md5, relpath}, sorted) of `folder` at each commit that touched it."""
        try:
            commits = self.run("log", "--all", "--pretty=format:%H", "--", folder).decode().split()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return
        for commit in commits:
            rows = self.run("ls-tree", "-r", commit, "--", folder + "/").decode().splitlines()
            listing = []
            for row in rows:
                meta, path = row.split("\t", 1)
                listing.append({"md5": md5(self.run("cat-file", "blob", meta.split()[2])),
                                "relpath": path[len(folder) + 1:]})
            yield sorted(listing, key=lambda e: e["relpath"])


def _dir_digest(listing: list[dict]) -> str:
    return md5(json.dumps(listing, sort_keys=True).encode()) + ".dir"


def _old_folder_listing(root: Path, git: _Git, folder: str, digest: str) -> list[dict] | None:
    """The files (relpath, md5) a folder dep held when dvc.lock recorded `digest`: from DVC's cache, else git."""
    cache = subprocess.run(["dvc", "cache", "dir"], cwd=root, capture_output=True, text=True).stdout.strip()
    value = digest.removesuffix(".dir")
    for base in (Path(cache), Path(cache) / "files" / "md5") if cache else ():
        f = base / value[:2] / (value[2:] + ".dir")
        if f.is_file():
            return json.loads(f.read_text())
    for listing in git.tree_listings(folder):
        if _dir_digest(listing) == digest:
            return listing
        # the byte-code Python wrote beside the sources when the stage ran, still on disk (git leaves it alone)
        sources = {e["relpath"].removesuffix(".py") for e in listing}
        pyc = [{"md5": md5(f.read_bytes()), "relpath": str(f.relative_to(root / folder))}
               for f in sorted((root / folder).rglob("__pycache__/*.pyc"))
               if str(f.relative_to(root / folder).parent.parent / f.name.split(".")[0]).removeprefix("./") in sources]
        if pyc and _dir_digest(with_pyc := sorted(listing + pyc, key=lambda e: e["relpath"])) == digest:
            return with_pyc
    return None


def _code_files(root: Path, deps: Iterable[str]) -> dict[str, bytes]:
    """The files of dvc.yaml code deps (folders walked, byte-code caches left out) and their bytes now."""
    files = {}
    for d in deps:
        p = root / d
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    files[str(f.relative_to(root))] = f.read_bytes()
        elif p.is_file():
            files[d] = p.read_bytes()
    return files


def _is_code(path: str) -> bool:
    return path == "pipeline" or path.startswith("pipeline/")


def cached_outs(spec: dict) -> set[str]:
    """The outputs of a dvc.yaml stage that DVC keeps in its cache (outs, metrics or plots without `cache: false`)."""
    found = set()
    for kind in ("outs", "metrics", "plots"):
        for o in spec.get(kind, []):
            path, opts = (o, {}) if isinstance(o, str) else next(iter(o.items()))
            if (opts or {}).get("cache", True):
                found.add(path)
    return found


def stage_verdict(root: Path, git: _Git, name: str, lock: dict, spec: dict, status: list) -> str | None:
    """None when the stage's only changes are the layout move and outputs now cached, else why it is left to
    `dvc repro`."""
    code_changed = False
    for entry in status:
        if isinstance(entry, dict) and set(entry) == {"changed outs"}:
            # "not in cache": the file is the one dvc.lock recorded, only DVC's cache lacks it
            others = sorted(o for o, why in entry["changed outs"].items() if why != "not in cache" or o not in cached_outs(spec))
            if others:
                return f"changed outputs: {', '.join(others)}"
            continue
        if not isinstance(entry, dict) or set(entry) != {"changed deps"}:
            return f"not only its code changed: {entry}"
        others = sorted(d for d in entry["changed deps"] if not _is_code(d))
        if others:
            return f"changed deps besides its code: {', '.join(others)}"
        code_changed = True
    if not code_changed:
        return None
    old: dict[str, bytes] = {}
    for dep in lock.get("deps", []):
        path, digest = dep["path"], dep.get("md5")
        if not _is_code(path):
            continue
        if digest is None:
            return f"dvc.lock has no md5 for {path}"
        if digest.endswith(".dir"):
            listing = _old_folder_listing(root, git, path, digest)
            if listing is None:
                return f"the code {path} held when it ran is not in git's history or DVC's cache"
            # byte-code caches are what the sources compile to: the sources decide
            entries = [(f"{path}/{e['relpath']}", e["md5"]) for e in listing
                       if "__pycache__" not in e["relpath"].split("/")]
        else:
            entries = [(path, digest)]
        for file, file_md5 in entries:
            data = git.blob_with_md5(file, file_md5)
            if data is None:
                return f"the {file} it ran is not in git's history"
            old[file] = data
    new = _code_files(root, [d for d in spec.get("deps", []) if isinstance(d, str) and _is_code(d)])
    for file in list(old):
        if file.endswith("__init__.py") and docstring_only(old[file].decode()) and MOVED.get(file, file) not in new:
            del old[file]
    for file in list(new):
        if file.endswith("__init__.py") and docstring_only(new[file].decode()) and \
                file not in {MOVED.get(f, f) for f in old}:
            del new[file]
    moved = {MOVED.get(f, f): f for f in old}
    if set(moved) != set(new):
        gained, lost = sorted(set(new) - set(moved)), sorted(set(moved) - set(new))
        return f"its code is not the moved code (new: {gained or '-'}; gone: {lost or '-'})"
    defined_old: dict[str, str] = {}
    defined_new: dict[str, str] = {}
    for path, was in moved.items():
        if path.endswith(".py"):
            module = _module(was)
            if canonical(old[was].decode(), module, defined_old) != canonical(new[path].decode(), module, defined_new):
                return f"{path} is not {was} moved: its code changed"
        elif old[was] != new[path]:
            return f"{path} changed"
    if defined_old != defined_new:
        changed = sorted(n for n in defined_old.keys() | defined_new.keys() if defined_old.get(n) != defined_new.get(n))
        return f"definitions the layout moved between modules changed: {', '.join(changed)}"
    return None


def upgrade(root: Path = Path("."), dry_run: bool = False, echo=print) -> list[str]:
    """Re-record (`dvc commit -f`) the stages the layout move and the newly cached outputs alone changed, and the
    stages up to date (into the run-cache); returns their names."""
    import yaml

    lock_file = root / "dvc.lock"
    if not lock_file.is_file():
        raise PipelineError("no dvc.lock here: nothing was run, so there is nothing to upgrade")
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    locked = yaml.safe_load(lock_file.read_text()).get("stages", {})
    proc = subprocess.run(["dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PipelineError(f"`dvc status` failed: {proc.stderr.strip()}")
    status = json.loads(proc.stdout or "{}")
    git = _Git(root)
    commit, left, current = [], {}, []
    for name in stages:
        if name not in status:
            if name in locked:
                current.append(name)
            continue
        if name not in locked:
            left[name] = "never run"
            continue
        why = stage_verdict(root, git, name, locked[name], stages[name], status[name])
        if why is None:
            commit.append(name)
        else:
            left[name] = why
    for name in commit:
        what = " and ".join(w for w, hit in (("only moved code", any("changed deps" in e for e in status[name])),
                                                ("outputs now cached", any("changed outs" in e for e in status[name]))) if hit)
        echo(f"{name}: {what}: re-recorded, not re-run")
    for name in current:
        echo(f"{name}: up to date: re-recorded into the run-cache, not re-run")
    for name, why in left.items():
        echo(f"{name}: left to `dvc repro` ({why})")
    if not dry_run and (commit or current):
        subprocess.run(["dvc", "commit", "-f", *commit, *current], cwd=root, check=True)
    return commit + current
