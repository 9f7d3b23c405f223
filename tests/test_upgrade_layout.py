"""The upgrade across the package layout (pipeline/workflow/upgrade_layout.py): which code counts as only moved.

The command itself runs DVC on a finished project; these are its rules, fast: the move table against the tree,
and the comparison of a module before and after the move.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.workflow.upgrade_layout import MOVED, canonical, docstring_only, old_name, old_text, same_program

ROOT = Path(__file__).resolve().parents[1]

OLD = '''"""Reads shards (pipeline/shards.py)."""
from __future__ import annotations

import json

from pipeline import shards, vllm_compat
from pipeline.train_data import index_shards

WORKER = "pipeline.train_worker"


def f(path):
    from pipeline import shard_stats
    return shards.read_header(path), shard_stats, vllm_compat, index_shards, json
'''

NEW = '''"""Reads shards (pipeline/hidden_states/format.py)."""
from __future__ import annotations

import json

from pipeline.extraction import vllm_compat
from pipeline.hidden_states import format as shards
from pipeline.training.data import index_shards

WORKER = "pipeline.training.worker"


def f(path):
    from pipeline.hidden_states import stats as shard_stats
    return shards.read_header(path), shard_stats, vllm_compat, index_shards, json
'''


def test_the_move_table_matches_the_tree() -> None:
    assert all(not (ROOT / old).exists() for old in MOVED), "a module the table moves is still at its old path"
    assert all((ROOT / new).is_file() for new in MOVED.values()), "a module the table moves is not at its new path"


def test_new_names_read_back_as_old() -> None:
    assert old_name("pipeline.hidden_states.format.read_header") == "pipeline.shards.read_header"
    assert old_name("pipeline.planning.reference") == "pipeline.reference_plan"
    assert old_name("pipeline.verification.reference.model.ReferenceModel") == "pipeline.reference.ReferenceModel"
    assert old_name("pipeline.params") == "pipeline.params"  # not moved
    assert old_text("see pipeline/training/worker.py and `python -m pipeline.workflow.share`") == \
        "see pipeline/train_worker.py and `python -m pipeline.share`"
    # a bare file name, as docstrings wrote the modules beside them, reads as the path the move wrote in its place
    assert old_text("the verdicts (verify_sample_judge.py)") == old_text("the verdicts (pipeline/verification/samples/judge.py)")
    assert old_text("Units (reference_cost.py)") == old_text("Units (pipeline/verification/reference/cost.py)")
    assert old_text("planning/plan.py, cost.py") == "planning/plan.py, cost.py"


def test_a_module_whose_imports_alone_changed_is_the_same_program() -> None:
    assert same_program(OLD, NEW)


def test_an_edit_beyond_the_imports_is_not() -> None:
    assert not same_program(OLD, NEW.replace("shards.read_header(path)", "shards.read_header(path, 1)"))
    assert not same_program(OLD, NEW.replace('"pipeline.training.worker"', '"pipeline.training.other"'))
    # an import that binds another module, or moves into another scope, is a change
    assert not same_program(OLD, NEW.replace("import format as shards", "import stats as shards"))
    assert not same_program(OLD, NEW.replace("import json\n", "").replace("    return shards", "    import json\n    return shards"))


def test_a_docstring_only_init_is_no_code() -> None:
    assert docstring_only((ROOT / "pipeline/workflow/__init__.py").read_text())
    assert not docstring_only((ROOT / "pipeline/stages/__init__.py").read_text())


# Finding moved from the scan to the report, and the report wrote the budget param's name out (MOVED_DEFINITIONS,
# INLINED): the stage's code compares as the same program, the definition compared as itself
FINDING = """
@dataclass
class Finding:
    check: str
    severity: str = "fail"
"""
OLD_SCAN = f"""from dataclasses import dataclass

from pipeline.reference import ReferenceModel
{FINDING}

def scan():
    return Finding("structure"), ReferenceModel
"""
NEW_SCAN = """from dataclasses import dataclass

from pipeline.verification.reference.model import ReferenceModel
from pipeline.verification.report import Finding


def scan():
    return Finding("structure"), ReferenceModel
"""
OLD_REPORT = """from pipeline.reference_cost import BUDGET_PARAM
from pipeline.verify_scan import Finding


def line(s):
    return [Finding("x")], f"because {s['why']} ({BUDGET_PARAM}). Reference models"
"""
NEW_REPORT = f"""from dataclasses import dataclass
{FINDING}

def line(s):
    return [Finding("x")], f"because {{s['why']}} (verify.reference_memory_gib). Reference models"
"""


def test_a_moved_definition_is_compared_as_itself() -> None:
    old, new = {}, {}
    assert canonical(OLD_SCAN, "pipeline.verify_scan", old) == canonical(NEW_SCAN, "pipeline.verify_scan", new)
    assert canonical(OLD_REPORT.replace("from pipeline.reference_cost import BUDGET_PARAM\n", "")
                     .replace(" ({BUDGET_PARAM})", " (verify.reference_memory_gib)"), "pipeline.verify_report", old) \
        == canonical(NEW_REPORT.replace("from dataclasses import dataclass\n", ""), "pipeline.verify_report", new)
    assert old == new and list(old) == ["pipeline.verify_scan.Finding"]
    # the definition edited on the way is not
    changed = {}
    canonical(NEW_REPORT.replace('"fail"', '"warn"'), "pipeline.verify_report", changed)
    assert changed != old
    # without the move table's module the definition stays in place: a module losing it is a change
    assert not same_program(OLD_SCAN, NEW_SCAN)


def test_an_inlined_name_reads_as_its_value() -> None:
    assert canonical(OLD_REPORT.replace("from pipeline.verify_scan import Finding\n", "")) == \
        canonical(NEW_REPORT.replace(f"from dataclasses import dataclass\n{FINDING}", ""))
    assert canonical(OLD_REPORT.replace("from pipeline.verify_scan import Finding\n", "")) != \
        canonical(NEW_REPORT.replace(f"from dataclasses import dataclass\n{FINDING}", "")
                  .replace("(verify.reference_memory_gib)", "(verify.reference_memory)"))
