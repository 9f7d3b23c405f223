"""A transformers forward of the target, in vLLM's layer-id convention: the yardstick for verify.

State k (0 <= k < N) is transformers' `output_hidden_states[k]` (the input of decoder layer k);
state N is the last decoder layer's output *before* the final norm, taken with a forward hook
because transformers' `hidden_states[N]` is after the norm.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.hidden_states.format import read_header

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FinalLogits:
    """lm_head(norm(h)) for final (pre-norm) states [T, H]: what the target predicts (for a class
    with `final_norm`, `lm_head`, `device` and `dtype`)."""

    @torch.inference_mode()
    def final_logits(self, final_state: torch.Tensor) -> torch.Tensor:
        h = final_state.to(self.device).to(self.dtype)
        return self.lm_head(self.final_norm(h)).float()


@dataclass
class ReferenceModel(FinalLogits):
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @classmethod
    def load(cls, path: Path, dtype: str, trust_remote_code: bool = False, device: str | None = None) -> ReferenceModel:
        """Load the target; on the GPU when there is one (`device` overrides), else on the CPU.

        `states` and `final_logits` return tensors on that device.
        """
        from transformers import AutoModelForCausalLM

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # Load directly in the target dtype: casting an fp32 model with .to(bf16) also rounds
        # RoPE's inv_freq buffer, which alone dropped cosine to 0.72 at late positions.
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=DTYPES[dtype],
            trust_remote_code=trust_remote_code,
            **({} if device == "cpu" else {"device_map": device}),
        )
        model.eval()
        return cls(model=model, dtype=DTYPES[dtype], device=torch.device(device))

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @torch.inference_mode()
    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """All N+1 states for one sequence: [N+1, T, H] in the model's dtype."""
        captured: dict[str, torch.Tensor] = {}

        def hook(_module, _inputs, output):
            captured["last"] = output[0] if isinstance(output, tuple) else output

        handle = self.decoder_layers[-1].register_forward_hook(hook)
        try:
            out = self.model(input_ids=input_ids.to(self.device)[None], output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hidden = [h[0] for h in out.hidden_states[:-1]]  # drop the post-norm last entry
        last = captured["last"]
        hidden.append(last[0] if last.dim() == 3 else last)
        return torch.stack(hidden)


@dataclass
class FinalHeadModel(FinalLogits):
    """The target's final norm and lm_head alone, in fp32, on the reference's device: all that the
    final-state pass needs, so it can start while the full references are still loading."""

    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    device: torch.device
    seconds: float
    dtype: torch.dtype = torch.float32


def load_final_head(path: Path, trust_remote_code: bool = False, device: str | None = None) -> FinalHeadModel | str:
    """The target's own final-norm and lm_head modules (built from its config on the meta device),
    with their weights read from the checkpoint by name; a tied lm_head reads the embedding. Where
    that cannot be done exactly (names not in the checkpoint, shapes differ, modules with buffers)
    returns why, and the stage takes the head from the full fp32 reference instead."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
    try:
        norm, head = skeleton.model.norm, skeleton.get_output_embeddings()
    except AttributeError as e:
        return f"no model.norm / output embeddings ({e})"
    if any(True for m in (norm, head) for _ in m.buffers()):
        return "the final norm or lm_head has buffers"
    names_of: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    locations = tensor_locations(path)
    if device.type == "cuda":
        torch.cuda.init()
    for module in (norm, head):
        state = {}
        for local, p in module.named_parameters():
            found = next((n for n in names_of[id(p)] if n in locations), None)
            if found is None:
                return f"{names_of[id(p)]} not in the checkpoint"
            with safe_open(str(locations[found]), framework="pt", device=str(device)) as f:
                tensor = f.get_tensor(found)
            if tuple(tensor.shape) != tuple(p.shape):
                return f"{found} has shape {list(tensor.shape)}, the model wants {list(p.shape)}"
            state[local] = tensor.float()
        module.load_state_dict(state, strict=True, assign=True)
        module.eval()
    return FinalHeadModel(final_norm=norm, lm_head=head, device=device, seconds=time.perf_counter() - started)


def tensor_locations(path: Path) -> dict[str, Path]:
    """Tensor name -> the checkpoint file holding it (the index where there is one, else headers)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= dict.fromkeys(read_header(file)[0], file)
    return out


# safetensors dtype names of the floating-point dtypes a checkpoint can hold
_SAFETENSORS_FLOAT = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_float_elements(path: Path) -> dict[str, int]:
    """Elements per floating-point dtype over a checkpoint's tensors, from its safetensors headers."""
    counts: dict[str, int] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for entry in read_header(file)[0].values():
            if entry["dtype"].startswith(("I", "U", "BOOL")):
                continue
            name = _SAFETENSORS_FLOAT.get(entry["dtype"], entry["dtype"])
            counts[name] = counts.get(name, 0) + math.prod(entry["shape"])
    return counts


@dataclass
class References:
    """The fp32 reference and, for a low-precision capture, an independent reference in the
    capture's dtype (the bf16 tolerance calibrates on it); how they were built and how long it took."""

    fp32: ReferenceModel
    low: ReferenceModel | None
    how: str
    seconds: float


def load_references(path: Path, captured_dtype: str, trust_remote_code: bool = False, device: str | None = None) -> References:
    """Load what verify compares against, reading the checkpoint once where that is exact.

    A checkpoint stored in the capture's dtype (a bf16 model extracted in bf16, the usual case) is
    loaded once, in that dtype, built directly (never cast from fp32); the fp32 reference is then its
    parameters upcast on the device, which is exactly what loading the checkpoint in fp32 gives
    (a bf16 -> fp32 cast is lossless; buffers computed at init, e.g. RoPE's inv_freq, must already
    be fp32 in the low-precision model, and are copied). Otherwise the two are loaded separately.
    """
    started = time.perf_counter()
    if captured_dtype == "float32":
        fp32 = ReferenceModel.load(path, "float32", trust_remote_code, device)
        return References(fp32, None, "fp32 checkpoint load", time.perf_counter() - started)
    stored = checkpoint_float_elements(path)
    if stored and set(stored) <= {captured_dtype, "float32"}:
        low = ReferenceModel.load(path, captured_dtype, trust_remote_code, device)
        kept_fp32 = sum(t.numel() for t in low.model.state_dict().values() if t.dtype == torch.float32)
        if any(b.is_floating_point() and b.dtype != torch.float32 for b in low.model.buffers()):
            reason = "the model keeps low-precision buffers"
        elif kept_fp32 != stored.get("float32", 0):
            # tensors stored in fp32 (e.g. DeepSeek-V3's e_score_correction_bias) must stay fp32
            # in the low-precision model, else its upcast would not be the fp32 checkpoint's values
            reason = f"{stored.get('float32', 0)} elements are stored in fp32, {kept_fp32} kept in fp32 by the {captured_dtype} model"
        else:
            fp32 = upcast(low)
            how = f"one {captured_dtype} checkpoint load; fp32 reference = its parameters upcast on {low.device}"
            return References(fp32, low, how, time.perf_counter() - started)
    else:
        low, reason = None, f"the checkpoint holds {sorted(stored) or 'no safetensors'}, not only {captured_dtype}"
    fp32 = ReferenceModel.load(path, "float32", trust_remote_code, device)
    low = low or ReferenceModel.load(path, captured_dtype, trust_remote_code, device)
    return References(fp32, low, f"two checkpoint loads ({reason})", time.perf_counter() - started)


def upcast(low: ReferenceModel) -> ReferenceModel:
    """An fp32 copy of a model whose floating buffers are fp32: parameters cast, buffers copied.

    deepcopy with each parameter pre-mapped to its fp32 copy keeps tied weights tied and never
    holds a second low-precision copy of the weights.
    """
    with torch.no_grad():
        memo = {id(p): torch.nn.Parameter(p.detach().float(), requires_grad=False) for p in low.model.parameters()}
    model = copy.deepcopy(low.model, memo)
    model.config.dtype = torch.float32
    return ReferenceModel(model=model.eval(), dtype=torch.float32, device=low.device)
