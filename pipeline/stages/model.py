"""Model stage: resolve the target (build the embedded one, or check a local HF dir) into target.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline import int4
from pipeline.atomic import atomic_dir, atomic_write_text
from pipeline.console import say
from pipeline.embedded import corpus, tiny_deepseek_v3, tiny_llama
from pipeline.embedded.tokenizer import corpus_texts, train_tokenizer
from pipeline.layout import METRICS, MODEL_DIR, TARGET_JSON
from pipeline.params import ModelParams
from pipeline.target import Target, TargetError, check_model_dir, fingerprint_model_dir, write_target

METRICS_JSON = METRICS / "model.json"


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except json.JSONDecodeError as e:
        raise TargetError(f"{config}: not valid JSON ({e})") from None


def build_embedded(params: ModelParams) -> dict:
    conversations = corpus.generate()
    tok = train_tokenizer(corpus_texts(conversations), params.embedded.vocab_size)
    with atomic_dir(MODEL_DIR) as tmp:
        builder = tiny_deepseek_v3 if params.embedded.architecture == "deepseek_v3" else tiny_llama
        metrics = builder.build(params.embedded, tok, conversations, tmp)
        if params.embedded.quantization == "w4a16":
            metrics |= quantize_in_place(tmp, params.embedded.quantization_group_size)
    # target.json lives inside MODEL_DIR, which atomic_dir just replaced: write it after the rename
    write_target(Target(path=MODEL_DIR, embedded=True, fingerprint=fingerprint_model_dir(MODEL_DIR)))
    return {"architecture": params.embedded.architecture, **metrics}


def quantize_in_place(model_dir: Path, group_size: int) -> dict:
    """Replace a float checkpoint in `model_dir` by its INT4 (W4A16 pack-quantized) version."""
    staged = model_dir / "_w4a16"
    metrics = int4.quantize_checkpoint(model_dir, staged, group_size=group_size)
    for old in model_dir.glob("*.safetensors"):
        old.unlink()
    for new in staged.iterdir():
        new.replace(model_dir / new.name)
    staged.rmdir()
    return metrics


def resolve_local(params: ModelParams) -> dict:
    path = Path(params.path)
    if path.resolve() == MODEL_DIR.resolve():
        raise TargetError(f"model.path: {path} is this stage's own output directory; point it at the model elsewhere")
    check_model_dir(path)
    if not has_chat_template(path):
        raise TargetError(
            f"model.path: {path} has no chat template (no chat_template.jinja, chat_template.json, or "
            f"'chat_template' in tokenizer_config.json); add one so conversations can be rendered like at serving time"
        )
    target = Target(path=path, embedded=False, fingerprint=fingerprint_model_dir(path),
                    trust_remote_code=params.trust_remote_code)
    # MODEL_DIR holds only target.json now: a stale embedded build must not linger beside it
    with atomic_dir(MODEL_DIR) as tmp:
        write_target(target, tmp / TARGET_JSON.name)
    return {"weights_bytes": sum(target.fingerprint["weights"].values())}


def _fit(metrics: dict) -> str:
    """How well it learned (untrained, train_steps 0: no loss to state)."""
    if metrics.get("final_loss") is None:
        return "untrained (random weights)"
    return (f"final loss {metrics['final_loss']:.4f}, next-token accuracy {metrics['unseen_assistant_accuracy']:.3f} "
            "on unseen assistant turns")


def run(params: ModelParams) -> None:
    t0 = time.time()
    metrics = build_embedded(params) if params.is_embedded else resolve_local(params)
    metrics = {"embedded": params.is_embedded, **metrics, "wall_seconds": round(time.time() - t0, 1)}
    atomic_write_text(METRICS_JSON, json.dumps(metrics, indent=2) + "\n")
    if params.is_embedded:
        say(f"[model] the embedded {metrics['architecture']} target: {metrics['parameters'] / 1e6:.2f} M parameters trained "
            f"{metrics['steps']} steps of {metrics['tokens_per_step']} tokens on {metrics['device']} in "
            f"{metrics['train_seconds']:.0f} s, " + _fit(metrics) + "; saved "
            + ("as INT4 (w4a16)" if params.embedded.quantization == "w4a16" else f"in {metrics['saved_dtype']}")
            + f" at {MODEL_DIR} (all figures: {METRICS_JSON})")
    else:
        say(f"[model] target at {params.path}: {metrics['weights_bytes'] / 2**30:.2f} GiB of weights, checked")
