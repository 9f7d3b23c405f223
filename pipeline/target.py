"""The resolved target model: where it is, what it is (fingerprint), and its shape.

The model stage writes `artifacts/model/target.json`; every later stage reads it through
`load_target()`, which also re-fingerprints a real model directory so that a model changed
in place after the model stage ran is an error, not silently mixed data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.layout import TARGET_JSON

# Files whose *content* defines the model's behaviour apart from the weights.
CONTENT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
REQUIRED_FILES = ("config.json",)


class TargetError(PipelineError):
    pass


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_model_dir(path: Path) -> None:
    """Fail early, naming what is missing, before anything loads."""
    if not path.is_dir():
        raise TargetError(f"model.path: {path} is not a directory; point it at a local HF model directory or use 'embedded'")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise TargetError(f"model.path: {path} lacks {', '.join(missing)}; it must be a Hugging Face model directory")
    if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
        raise TargetError(f"model.path: {path} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        raise TargetError(f"model.path: {path} has no tokenizer (tokenizer.json or tokenizer.model)")


def fingerprint_model_dir(path: Path) -> dict:
    """Content hashes of config/tokenizer/template files; names and sizes of weight files.

    Hashing ~1 TB of weights would take hours; names and sizes catch a swapped checkpoint,
    and the config/tokenizer hashes catch everything that changes meaning without the weights.
    """
    files = {name: sha256_file(path / name) for name in CONTENT_FILES if (path / name).is_file()}
    weights = {
        p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    }
    fp = {"files": files, "weights": weights}
    fp["sha256"] = sha256_json(fp)
    return fp


@dataclass(frozen=True)
class Target:
    path: Path
    embedded: bool
    fingerprint: dict
    trust_remote_code: bool = False

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    @property
    def num_layers(self) -> int:
        cfg = self.config
        cfg = cfg.get("text_config", cfg)
        return int(cfg["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        cfg = self.config
        cfg = cfg.get("text_config", cfg)
        return int(cfg["hidden_size"])

    @property
    def vocab_size(self) -> int:
        cfg = self.config
        cfg = cfg.get("text_config", cfg)
        return int(cfg["vocab_size"])

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "embedded": self.embedded,
            "fingerprint": self.fingerprint,
            "trust_remote_code": self.trust_remote_code,
        }


def write_target(target: Target, out: Path = TARGET_JSON) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(target.to_json(), indent=2, sort_keys=True) + "\n")
    tmp.replace(out)


def load_target(path: Path = TARGET_JSON, recheck: bool = True) -> Target:
    if not path.is_file():
        raise TargetError(f"{path} not found: run the model stage first (`make model` or `dvc repro model`)")
    raw = json.loads(path.read_text())
    target = Target(
        path=Path(raw["path"]),
        embedded=raw["embedded"],
        fingerprint=raw["fingerprint"],
        trust_remote_code=raw.get("trust_remote_code", False),
    )
    if recheck:
        check_model_dir(target.path)
        now = fingerprint_model_dir(target.path)
        if now["sha256"] != target.fingerprint["sha256"]:
            raise TargetError(
                f"the model at {target.path} changed since the model stage fingerprinted it "
                f"({target.fingerprint['sha256'][:12]} -> {now['sha256'][:12]}); "
                "re-run it with `dvc repro -f model` so every downstream stage re-runs on the new model"
            )
    return target
