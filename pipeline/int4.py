"""INT4 weight-only checkpoints in compressed-tensors' `pack-quantized` format (W4A16, grouped, the
Kimi-K2.5 INT4 layout): write one from a float checkpoint, and dequantize one Linear's weight back.

Layout (compressed-tensors' PackedQuantizationCompressor, whose compress/decompress we call): a
quantized Linear `X` is stored as `X.weight_packed` (int32, eight 4-bit values per element along the
input dimension), `X.weight_scale` ([out, in / group_size], the checkpoint's float dtype) and
`X.weight_shape` ([out, in]); symmetric, so no zero point. `config.json`'s `quantization_config`
names the scheme and the modules left in float (`ignore`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from pipeline.errors import PipelineError

PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")
# Kimi-K2.5 INT4 quantizes only the routed experts; a model without experts: every decoder Linear
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj$")


def scheme_of(config: dict):
    """The (single) weight scheme of a compressed-tensors pack-quantized config, or None when the
    checkpoint is not quantized; anything else this reference cannot read is an error."""
    q = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not q:
        return None
    from compressed_tensors.quantization import QuantizationScheme

    groups = q.get("config_groups") or {}
    formats = {g.get("format") or q.get("format") for g in groups.values()}
    if q.get("quant_method") != "compressed-tensors" or formats != {"pack-quantized"} or len(groups) != 1:
        raise PipelineError(
            f"model.path: quantization_config {q.get('quant_method')}/{sorted(map(str, formats))} with {len(groups)} group(s): "
            "verify's reference reads compressed-tensors pack-quantized (W4A16) checkpoints with one scheme only"
        )
    scheme = QuantizationScheme.model_validate(next(iter(groups.values())))
    if scheme.input_activations is not None or scheme.weights is None or scheme.weights.type != "int":
        raise PipelineError("model.path: quantization_config is not weight-only integer (W*A16); verify's reference cannot dequantize it")
    return scheme


def is_packed(name: str) -> bool:
    return name.endswith(PACKED_SUFFIXES)


def packed_names(prefix: str, locations: dict) -> list[str]:
    """The tensors storing quantized Linear `prefix`'s weight (empty when it is stored in float)."""
    return [prefix + s for s in PACKED_SUFFIXES if prefix + s in locations]


def dequantize(prefix: str, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
    """Linear `prefix`'s float weight [out, in] from its packed tensors (in the scale's dtype)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    local = {s[1:]: tensors[prefix + s] for s in PACKED_SUFFIXES if prefix + s in tensors}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"]


def w4a16_scheme(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size),
        format="pack-quantized",
    )


def quantize_linear(weight: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """weight [out, in] -> {weight_packed, weight_scale, weight_shape}: symmetric min-max scales per group."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    g = scheme.weights.group_size
    out_features, in_features = weight.shape
    if in_features % g:
        raise PipelineError(f"model.embedded.quantization: input size {in_features} is not a multiple of group size {g}")
    groups = weight.float().reshape(out_features, in_features // g, g)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    return {k: v for k, v in PackedQuantizationCompressor.compress(state, scheme).items() if k != "weight_zero_point"}


def quantization_config(scheme, float_linears: list[str]) -> dict:
    """config.json's quantization_config for a pack-quantized checkpoint whose float Linears are `float_linears`."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(mode="json")},
        "ignore": sorted(float_linears),  # the Linears left in float, by module name
        "kv_cache_scheme": None,
    }


def quantize_checkpoint(src: Path, dst: Path, group_size: int = 32, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write `src` (a float safetensors checkpoint) to `dst` as W4A16 pack-quantized: the routed
    experts where there are any (as Kimi-K2.5 INT4), else every decoder Linear; the rest in `dtype`.
    Other files are copied. Returns what was quantized."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    scheme = w4a16_scheme(group_size)
    files = sorted(Path(src).glob("*.safetensors"))
    names = [n for f in files for n in safe_open(str(f), "pt").keys()]
    pattern = ROUTED_EXPERT if any(ROUTED_EXPERT.search(n[: -len(".weight")]) for n in names) else DECODER_LINEAR
    dst.mkdir(parents=True, exist_ok=True)
    quantized, float_linears, weight_map = [], [], {}
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                prefix = name.removesuffix(".weight")
                linear = name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
                if linear and pattern.search(prefix):
                    out |= {f"{prefix}.{k}": v.contiguous() for k, v in quantize_linear(tensor.to(dtype), scheme).items()}
                    quantized.append(prefix)
                    continue
                float_linears += [prefix] if linear else []
                # the router's correction bias stays fp32, as DeepSeek-V3 / Kimi checkpoints keep it
                keep = not tensor.is_floating_point() or "e_score_correction_bias" in name
                out[name] = tensor if keep else tensor.to(dtype)
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, file.name)
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for other in Path(src).iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "model.safetensors.index.json":
            shutil.copy2(other, dst / other.name)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = quantization_config(scheme, float_linears)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"quantized_linears": len(quantized), "group_size": group_size, "scheme": "W4A16 pack-quantized"}


def dequantize_checkpoint(src: Path, dst: Path) -> None:
    """Write an INT4 checkpoint's dequantized weights as a float checkpoint (the scales' dtype): the
    model vLLM's INT4 kernels compute, in float, for a whole-model reference of the same weights."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((Path(src) / "config.json").read_text())
    scheme = scheme_of(config)
    dst.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        prefixes = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
        out = {n: t for n, t in tensors.items() if not is_packed(n)}
        out |= {f"{p}.weight": dequantize(p, tensors, scheme).contiguous() for p in prefixes}
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
    for other in Path(src).iterdir():
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy2(other, dst / other.name)
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
