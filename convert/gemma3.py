"""Gemma 3 (llama.cpp architecture `gemma3`): config.json with transformers' defaults, the text part of the
multimodal checkpoint, the RMSNorm weight offset and the sliding-window hyper-parameters.

Follows llama.cpp's converter (conversion/gemma.py, Gemma3Model) and loader (src/models/gemma3.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from ..errors import ConversionError

GEMMA3 = gguf.MODEL_ARCH.GEMMA3
HF_ARCHS = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")

# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config lists only what differs from them.
TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}
LOADER_SWA_PATTERN = 6  # llama.cpp's gemma3 loader assumes this pattern when the file names none
LAYERS_27B = 62  # llama.cpp scales attention by 1/sqrt(n_embd/n_head) for this depth, by 1/sqrt(head_dim) otherwise

# Multimodal checkpoints: the language model's tensors under a prefix, the vision tower's skipped.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# Gemma3RMSNorm computes x * (1 + w): llama.cpp's RMS norm multiplies by w, so the converter stores w + 1.
_NORMS = {gguf.TENSOR_NAMES[t] for t in (gguf.MODEL_TENSOR.OUTPUT_NORM, gguf.MODEL_TENSOR.ATTN_NORM,
                                         gguf.MODEL_TENSOR.ATTN_POST_NORM, gguf.MODEL_TENSOR.FFN_NORM,
                                         gguf.MODEL_TENSOR.FFN_POST_NORM, gguf.MODEL_TENSOR.ATTN_Q_NORM,
                                         gguf.MODEL_TENSOR.ATTN_K_NORM)}


@dataclass(frozen=True)
class Gemma3Params:
    """The hyper-parameters gemma3 has beyond a Llama-like model."""

    swa_layers: tuple[bool, ...]  # True for a sliding-window (local) layer
    rope_theta: float  # global layers
    sliding_window: int
    rope_theta_swa: float
    rope_scale_factor: float | None  # linear RoPE scaling of the global layers (Gemma-3-4B and up: 8)
    final_logit_softcapping: float | None
    query_pre_attn_scalar: float

    @property
    def default_pattern(self) -> bool:
        n = len(self.swa_layers)
        return self.swa_layers == tuple(i % LOADER_SWA_PATTERN < LOADER_SWA_PATTERN - 1 for i in range(n))


def text_config(cfg: dict) -> dict:
    """config.json as one flat dict with transformers' defaults (text_config over the root, as upstream)."""
    merged = {**cfg, **(cfg.get("text_config") or {})}
    return {**TEXT_DEFAULTS, **{k: v for k, v in merged.items() if v is not None}}


def _rope(c: dict, where: str) -> tuple[float, float, float | None]:
    """(global theta, local theta, global linear factor) from rope_scaling (transformers 4) or rope_parameters (5)."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", c["rope_theta"]))
        theta_swa = float(local.get("rope_theta", c["rope_local_base_freq"]))
        if (local.get("rope_type") or "default") != "default":
            raise ConversionError(f"RoPE scaling on the sliding-window layers ({where}: {local}); llama.cpp's "
                                  "gemma3 scales only the global layers")
    else:
        full = c.get("rope_scaling") or params
        theta, theta_swa = float(full.get("rope_theta", c["rope_theta"])), float(c["rope_local_base_freq"])
    kind = (full.get("rope_type") or full.get("type") or "default").lower()
    if kind == "default":
        return theta, theta_swa, None
    if kind == "linear" and full.get("factor"):
        return theta, theta_swa, float(full["factor"])
    raise ConversionError(f"unsupported RoPE scaling {kind!r} for Gemma 3 ({where}); specq converts linear "
                          "scaling (as the Gemma 3 checkpoints use) or none")


def read_params(c: dict, where: str) -> Gemma3Params:
    """The gemma3 hyper-parameters of a flat text config; refuses what llama.cpp's graph would compute differently."""
    n_layer = int(c["num_hidden_layers"])
    if c.get("layer_types"):
        kinds = list(c["layer_types"])
        if len(kinds) != n_layer or not set(kinds) <= {"sliding_attention", "full_attention"}:
            raise ConversionError(f"layer_types does not list {n_layer} sliding_attention/full_attention layers "
                                  f"({where}); the config is inconsistent")
        swa = tuple(k == "sliding_attention" for k in kinds)
    else:
        p = int(c["sliding_window_pattern"])
        swa = tuple(p > 1 and (i + 1) % p != 0 for i in range(n_layer))
    if c.get("attn_logit_softcapping") is not None:
        raise ConversionError(f"attn_logit_softcapping is set ({where}); Gemma 3 has none and llama.cpp's gemma3 "
                              "graph ignores it: this is not a Gemma 3 checkpoint")
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise ConversionError(f"hidden activation {act!r} ({where}); llama.cpp's gemma3 computes GELU with the tanh "
                              "approximation (gelu_pytorch_tanh)")
    n_embd, n_head, head_dim = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["head_dim"])
    scalar = float(c["query_pre_attn_scalar"])
    expected = n_embd / n_head if n_layer == LAYERS_27B else head_dim
    if scalar != expected:
        raise ConversionError(f"query_pre_attn_scalar is {scalar:g} ({where}) but llama.cpp's gemma3 scales "
                              f"attention by 1/sqrt({expected:g}) for a {n_layer}-layer model; the converted "
                              "model would compute different logits")
    theta, theta_swa, factor = _rope(c, where)
    softcap = c.get("final_logit_softcapping")
    return Gemma3Params(swa, theta, int(c["sliding_window"]), theta_swa, factor,
                        float(softcap) if softcap else None, scalar)


def write_hparams(w: gguf.GGUFWriter, p: Gemma3Params) -> None:
    """The gemma3 keys beyond the common ones (context, sizes, heads, rms eps, head dim, rope base)."""
    w.add_rope_freq_base_swa(p.rope_theta_swa)
    if any(p.swa_layers):
        w.add_sliding_window(p.sliding_window)
        if not p.default_pattern:
            w.add_sliding_window_pattern(list(p.swa_layers))
    if p.rope_scale_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(p.rope_scale_factor)
    if p.final_logit_softcapping:
        w.add_final_logit_softcapping(p.final_logit_softcapping)


def text_name(hf_name: str) -> str | None:
    """The language model's tensor name in Gemma3ForCausalLM's layout; None for the vision tower."""
    if hf_name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


def is_norm(gguf_name: str) -> bool:
    base = gguf_name.rsplit(".", 1)[0]
    if base.startswith("blk."):
        base = base.split(".", 2)[2]
        return "blk.{bid}." + base in _NORMS
    return base in _NORMS


def norm_plus_one(values: np.ndarray) -> np.ndarray:
    """A Gemma RMSNorm weight in float32, shifted as llama.cpp's converter does (in float32, no rounding)."""
    return values.astype(np.float32) + np.float32(1.0)
