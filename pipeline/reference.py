"""A transformers forward of the target, in vLLM's layer-id convention: the yardstick for verify.

State k (0 <= k < N) is transformers' `output_hidden_states[k]` (the input of decoder layer k);
state N is the last decoder layer's output *before* the final norm, taken with a forward hook
because transformers' `hidden_states[N]` is after the norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ReferenceModel:
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

    @torch.inference_mode()
    def final_logits(self, final_state: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(h)) for final (pre-norm) states [T, H]: what the target predicts."""
        h = final_state.to(self.device).to(self.dtype)
        return self.lm_head(self.final_norm(h)).float()
