"""Where each stage's outputs live. Stages talk through these files, never through globals."""

from pathlib import Path

ARTIFACTS = Path("artifacts")
METRICS = Path("metrics")
REPORTS = Path("reports")

# check stage (first; every stage depends on it): the same bytes whenever the inputs are valid
CHECKED = ARTIFACTS / "check.json"

# model stage: the embedded target's HF directory (when built) + target.json (always)
MODEL_DIR = ARTIFACTS / "model"
TARGET_JSON = MODEL_DIR / "target.json"

# regenerate stage (before prepare): the chat data with every assistant turn rewritten by the
# target (conversations.jsonl, OpenAI messages + source_line) and regenerate.json (provenance);
# with data.regenerate.enabled false only regenerate.json ({"enabled": false})
REGENERATED_DIR = ARTIFACTS / "regenerated"
REGENERATED_CONVERSATIONS = REGENERATED_DIR / "conversations.jsonl"
REGENERATED_META = REGENERATED_DIR / "regenerate.json"

# prepare stage: HF `datasets` Arrow dataset (sample_id, input_ids, loss_mask, seq_len),
# held-out eval prompts, token frequencies of the loss-masked tokens
PREPARED_DIR = ARTIFACTS / "prepared"
PREPARED_DATASET = PREPARED_DIR / "dataset"
HELDOUT_PROMPTS = PREPARED_DIR / "heldout.jsonl"
TOKEN_FREQ = PREPARED_DIR / "token_freq.json"

# extract stage: shard-NNNNN.safetensors + shard-NNNNN.json manifests + extract_meta.json
HIDDEN_STATES_DIR = ARTIFACTS / "hidden_states"

# verify stage: a deterministic verdict that train depends on (so a verify-only param change
# that does not change the verdict does not retrain), plus metrics and a human report
VERIFY_VERDICT = ARTIFACTS / "verify" / "verdict.json"

# train stage: speculators checkpoints (<epoch>/ dirs); final.json points at the draft vLLM loads
DRAFT_DIR = ARTIFACTS / "draft"
FINAL_POINTER = DRAFT_DIR / "final.json"
TRAIN_METRICS = METRICS / "train.json"
TRAIN_CURVE = METRICS / "train_curve.csv"
