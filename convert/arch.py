"""Supported Hugging Face architectures: config.json -> llama.cpp hyper-parameters and tensor names.

Names and keys come from gguf's own tables (MODEL_ARCH, TensorNameMap, the GGUFWriter key helpers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from ..errors import ConversionError
from . import gemma3, qwen35
from .source import read_json

SUPPORTED = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    **qwen35.HF_ARCHS,
    **{name: gemma3.GEMMA3 for name in gemma3.HF_ARCHS},
}
# HF tensors that carry no weights llama.cpp needs.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ArchSpec:
    """What the converter needs from config.json."""

    hf_arch: str
    arch: gguf.MODEL_ARCH
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    vocab_size: int
    tied: bool
    torch_dtype: str | None
    rope_scaling: dict = field(default_factory=dict)
    explicit_head_dim: bool = False
    qwen35: qwen35.Qwen35Params | None = None  # qwen35 only
    gemma: gemma3.Gemma3Params | None = None  # gemma3 only

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    @property
    def permute_qk(self) -> bool:
        # HF stores Llama's q/k rows for rotate-half RoPE; llama.cpp's LLAMA graph wants them interleaved.
        return self.arch == gguf.MODEL_ARCH.LLAMA


def read_config(path: Path, where: str) -> ArchSpec:
    cfg = read_json(path / "config.json", "config.json")
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else cfg.get("model_type", "?")
    if hf_arch not in SUPPORTED:
        raise ConversionError(f"unsupported architecture {hf_arch} ({where}); specq converts "
                              f"{', '.join(SUPPORTED)}")
    if cfg.get("auto_map"):
        # We never import model code; a custom architecture would silently convert wrong.
        raise ConversionError(f"checkpoint declares custom model code (auto_map in {where}); specq never runs "
                              "remote code and converts only the standard architectures")
    if SUPPORTED[hf_arch] in qwen35.ARCHS:
        cfg = qwen35.text_config(cfg)
    if SUPPORTED[hf_arch] == gemma3.GEMMA3:
        cfg = gemma3.text_config(cfg)
    try:
        n_embd = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        explicit = cfg.get("head_dim") is not None
        spec = ArchSpec(
            hf_arch=hf_arch,
            arch=SUPPORTED[hf_arch],
            n_layer=int(cfg["num_hidden_layers"]),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg["head_dim"]) if explicit else n_embd // n_head,
            n_ff=int(cfg["intermediate_size"]),
            n_ctx=int(cfg.get("max_position_embeddings") or 4096),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
                             or 10000.0),
            vocab_size=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            rope_scaling=dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}),
            explicit_head_dim=explicit,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"config.json lacks or mangles a required field ({where}: {e}); "
                              "the checkpoint is incomplete")
    if spec.n_head % spec.n_head_kv:
        raise ConversionError(f"num_attention_heads {spec.n_head} is not a multiple of num_key_value_heads "
                              f"{spec.n_head_kv} ({where}); the config is inconsistent")
    if spec.arch in qwen35.ARCHS:
        try:
            rs = {k: v for k, v in spec.rope_scaling.items() if v != "mrope"}  # text positions: plain RoPE
            p = qwen35.read_params(cfg, spec.head_dim, where, moe=spec.arch == qwen35.QWEN35MOE)
            spec = replace(spec, qwen35=p, rope_scaling=rs)
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"config.json lacks or mangles a Qwen3.5 field ({where}: {e}); "
                                  "the checkpoint is incomplete")
    if spec.arch == gemma3.GEMMA3:
        try:
            p = gemma3.read_params(cfg, where)
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"config.json mangles a Gemma 3 field ({where}: {e}); the checkpoint is incomplete")
        spec = replace(spec, rope_theta=p.rope_theta, rope_scaling={}, gemma=p)  # scaling: global layers only
    return spec


def write_hparams(w: gguf.GGUFWriter, s: ArchSpec) -> None:
    """The hyper-parameters llama.cpp reads for these architectures."""
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_theta)
    if s.arch == gguf.MODEL_ARCH.LLAMA:
        w.add_rope_dimension_count(s.head_dim)
    if s.explicit_head_dim:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    rs = s.rope_scaling
    rope_type = (rs.get("rope_type") or rs.get("type") or "").lower()
    factor = rs.get("factor")
    if rope_type == "linear" and factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(factor))
    elif rope_type == "yarn" and factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(factor))
        w.add_rope_scaling_orig_ctx_len(int(rs.get("original_max_position_embeddings", s.n_ctx)))
    elif rope_type not in ("", "default", "llama3"):
        raise ConversionError(f"unsupported RoPE scaling {rope_type!r} in {s.hf_arch}; specq handles linear, "
                              "yarn and llama3")
    if s.qwen35 is not None:
        qwen35.write_hparams(w, s.qwen35)
    if s.gemma is not None:
        gemma3.write_hparams(w, s.gemma)


def rope_freqs(s: ArchSpec) -> np.ndarray | None:
    """Llama 3.1-style RoPE scaling is a per-frequency factor tensor (as llama.cpp's converter writes it)."""
    rs = s.rope_scaling
    if (rs.get("rope_type") or rs.get("type") or "").lower() != "llama3":
        return None
    dim = s.head_dim
    freqs = 1.0 / (s.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(rs.get("factor", 8.0))
    lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


class NameMap:
    """HF tensor name -> GGUF tensor name for one architecture and depth."""

    def __init__(self, s: ArchSpec):
        self._map = gguf.get_tensor_name_map(s.arch, s.n_layer)
        self._allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[s.arch]}
        self.spec = s

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF name, None for tensors llama.cpp does not use; ConversionError for unknown ones."""
        if hf_name.endswith(SKIPPED_SUFFIXES):
            return None
        if self.spec.gemma is not None:
            hf_name = gemma3.text_name(hf_name)  # multimodal checkpoints: the language model's part
            if hf_name is None:
                return None
        name = self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConversionError(f"tensor {hf_name} has no llama.cpp equivalent for {self.spec.hf_arch}; "
                                  "the checkpoint is not a plain " + self.spec.hf_arch)
        base = name.rsplit(".", 1)[0]
        generic = base.replace(base.split(".")[1], "{bid}", 1) if base.startswith("blk.") else base
        if generic not in self._allowed:
            raise ConversionError(f"tensor {hf_name} ({name}) is not part of llama.cpp's {self.spec.arch_name} "
                                  f"model; the checkpoint is not a plain {self.spec.hf_arch}")
        return name
