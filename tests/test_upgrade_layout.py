"""The upgrade across the package layout (pipeline/workflow/upgrade_layout.py): which code counts as only moved.

The command itself runs DVC on a finished project; these are its rules, fast: the move table against the tree,
and the comparison of a module before and after the move.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.workflow.upgrade_layout import MOVED, docstring_only, old_name, old_text, same_program

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
    assert old_name("pipeline.reference") == "pipeline.reference"  # not moved
    assert old_text("see pipeline/training/worker.py and `python -m pipeline.workflow.share`") == \
        "see pipeline/train_worker.py and `python -m pipeline.share`"


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
