"""Qwen3.5 / Qwen3.6 (llama.cpp `qwen35`, and `qwen35moe`): Gated DeltaNet linear-attention layers, a gated
full-attention layer every few, and multi-token-prediction (MTP/NextN) blocks after the trunk.

What llama.cpp's loader (src/models/qwen35.cpp) reads, with the transforms its converter applies:
- RMSNorm weights are stored as w with the norm computing (1 + w); llama.cpp multiplies by the weight, so
  every norm gets +1, except the gated norm of the linear layers (`linear_attn.norm`), which multiplies by w.
- A_log becomes A = -exp(A_log). Both value transforms run in float32 on the checkpoint's values and are
  written as F32, never rounded back to BF16/F16 (transformers computes them so, and so does llama.cpp's
  converter from BF16). dt_bias is the `ssm_dt` bias; the conv kernel (C, 1, K) becomes (C, K) in F32.
- When a linear layer has fewer key than value heads, HF groups the value heads by key head; ggml broadcasts
  tiled, so the value heads are reordered (rows of qkv's V part, z, a, b, the conv's V channels, A, dt;
  columns of out_proj).
- MTP blocks `mtp.*` become extra layers n_trunk.. with `nextn.*` tensors; `--no-mtp` drops them.
- MoE: the fused [experts, 2 * n_ff, n_embd] gate_up tensor is written as ffn_gate_exps and ffn_up_exps; the
  router and the shared expert's gate stay F32. Checkpoints with one tensor per expert are refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import gguf
import numpy as np

from ..errors import ConversionError
from .checkpoint import TensorRef

log = logging.getLogger("specq.convert")

QWEN35 = gguf.MODEL_ARCH.QWEN35
QWEN35MOE = gguf.MODEL_ARCH.QWEN35MOE
ARCHS = (QWEN35, QWEN35MOE)
HF_ARCHS = {"Qwen3_5ForCausalLM": QWEN35, "Qwen3_5ForConditionalGeneration": QWEN35,
            "Qwen3_5MoeForCausalLM": QWEN35MOE, "Qwen3_5MoeForConditionalGeneration": QWEN35MOE}
# Transformers' Qwen3.5 rotary default; llama.cpp's loader requires the key, so it is always written.
DEFAULT_SECTIONS = (11, 11, 10, 0)
# gguf 0.19 predates this key; llama.cpp (src/llama-arch.cpp) names it so.
RECURRENT_LAYERS = getattr(getattr(gguf.Keys, "Attention", None), "RECURRENT_LAYERS",
                           "{arch}.attention.recurrent_layers")

_T = gguf.MODEL_TENSOR
_NEXTN = {"fc": _T.NEXTN_EH_PROJ, "pre_fc_norm_embedding": _T.NEXTN_ENORM, "pre_fc_norm_hidden": _T.NEXTN_HNORM,
          "norm": _T.NEXTN_SHARED_HEAD_NORM, "embed_tokens": _T.NEXTN_EMBED_TOKENS,
          "shared_head.head": _T.NEXTN_SHARED_HEAD_HEAD}
_SKIP_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


@dataclass(frozen=True)
class Qwen35Params:
    """The config.json fields beyond the dense ones."""

    n_trunk: int
    n_mtp: int  # MTP blocks written after the trunk (0: none in the checkpoint, or dropped)
    conv_kernel: int
    k_heads: int
    v_heads: int
    k_dim: int  # linear key head size
    v_dim: int  # linear value head size
    layer_types: tuple[bool, ...] | None  # True for a linear-attention layer, when config.json lists them
    full_attention_interval: int
    n_rot: int
    sections: tuple[int, int, int, int]
    n_expert: int = 0  # qwen35moe: routed experts (0: dense FFN)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def v_per_k(self) -> int:
        return self.v_heads // self.k_heads

    def is_linear(self, il: int) -> bool:
        if il >= self.n_trunk:
            return False
        if self.layer_types is not None:
            return self.layer_types[il]
        return (il + 1) % self.full_attention_interval != 0


def text_config(cfg: dict) -> dict:
    """A multimodal checkpoint keeps the language model's fields under text_config."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    if "intermediate_size" not in cfg and "moe_intermediate_size" in cfg:
        cfg["intermediate_size"] = cfg["moe_intermediate_size"]  # MoE configs may name only the expert size
    return cfg


def read_params(cfg: dict, head_dim: int, where: str, moe: bool = False) -> Qwen35Params:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    n_trunk = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_trunk or any(t not in ("linear_attention", "full_attention") for t in types):
            raise ConversionError(f"config.json layer_types does not list {n_trunk} linear_attention/full_attention "
                                  f"entries ({where}); the config is inconsistent")
        types = tuple(t == "linear_attention" for t in types)
    sections = rope.get("mrope_section")
    p = Qwen35Params(
        n_trunk=n_trunk, n_mtp=int(cfg.get("mtp_num_hidden_layers") or 0),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]), k_heads=int(cfg["linear_num_key_heads"]),
        v_heads=int(cfg["linear_num_value_heads"]), k_dim=int(cfg["linear_key_head_dim"]),
        v_dim=int(cfg["linear_value_head_dim"]), layer_types=types,
        full_attention_interval=int(cfg.get("full_attention_interval") or 4), n_rot=int(head_dim * partial),
        sections=tuple((list(sections) + [0, 0, 0, 0])[:4]) if sections else DEFAULT_SECTIONS)
    if moe:
        p = replace(p, n_expert=int(cfg["num_experts"]), n_expert_used=int(cfg["num_experts_per_tok"]),
                    n_ff_exp=int(cfg["moe_intermediate_size"]),
                    n_ff_shexp=int(cfg.get("shared_expert_intermediate_size") or 0))
    if p.v_heads % p.k_heads:
        raise ConversionError(f"linear_num_value_heads {p.v_heads} is not a multiple of linear_num_key_heads "
                              f"{p.k_heads} ({where}); the config is inconsistent")
    if p.k_dim != p.v_dim:
        # llama.cpp's qwen35 loader sizes both from one key (ssm.state_size)
        raise ConversionError(f"linear key and value head sizes differ ({p.k_dim} vs {p.v_dim}, {where}); "
                              "llama.cpp's qwen35 supports equal sizes only")
    return p


def write_hparams(w: gguf.GGUFWriter, p: Qwen35Params) -> None:
    """The keys llama.cpp's qwen35 loader reads beyond the dense ones (block_count already counts MTP)."""
    w.add_ssm_conv_kernel(p.conv_kernel)
    w.add_ssm_state_size(p.k_dim)
    w.add_ssm_group_count(p.k_heads)
    w.add_ssm_time_step_rank(p.v_heads)
    w.add_ssm_inner_size(p.v_dim * p.v_heads)
    if p.layer_types is not None:
        w.add_array(RECURRENT_LAYERS.format(arch=w.arch), [p.is_linear(i) for i in range(p.n_trunk + p.n_mtp)])
    w.add_full_attention_interval(p.full_attention_interval)
    w.add_rope_dimension_count(p.n_rot)
    w.add_rope_dimension_sections(list(p.sections))
    if p.n_mtp:
        w.add_nextn_predict_layers(p.n_mtp)
    if p.n_expert:
        w.add_expert_count(p.n_expert)
        w.add_expert_used_count(p.n_expert_used)
        w.add_expert_feed_forward_length(p.n_ff_exp)
        if p.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(p.n_ff_shexp)


# ---- names ---------------------------------------------------------------------------------------
_MTP = re.compile(r"^(?:model\.)?mtp\.(.+)$")
_MTP_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _gguf_names(hf: str, n_trunk: int, n_block: int, nmap: gguf.TensorNameMap) -> tuple[list[str], int | None]:
    """(GGUF names, empty when unknown; MTP index or None) for one checkpoint tensor name."""
    hf = hf.replace("model.language_model.", "model.", 1)
    m = _MTP.match(hf)
    mtp = None
    if m:
        rest = m.group(1)
        lm = _MTP_LAYER.match(rest)
        if lm:
            mtp = int(lm.group(1))
            hf = f"model.layers.{n_trunk + mtp}.{lm.group(2)}"
        else:
            base, _, suffix = rest.rpartition(".")
            if base not in _NEXTN:
                return [], None
            return [f"{gguf.TENSOR_NAMES[_NEXTN[base]].format(bid=n_trunk)}.{suffix}"], 0
        if n_trunk + mtp >= n_block:
            return [], mtp
    if hf.endswith(".linear_attn.dt_bias"):
        hf = hf[: -len("dt_bias")] + "dt_proj.bias"
    if hf.endswith((".mlp.experts.down_proj", ".mlp.experts.gate_up_proj")):
        hf += ".weight"  # fused expert tensors come without the suffix
    if hf.endswith(".mlp.experts.gate_up_proj.weight"):
        # one [experts, 2 * n_ff, n_embd] tensor: gate rows first, then up (written as two tensors, as upstream)
        gate = nmap.get_name(hf.replace("gate_up_proj", "gate_proj"), try_suffixes=(".weight",))
        up = nmap.get_name(hf.replace("gate_up_proj", "up_proj"), try_suffixes=(".weight",))
        return ([gate, up] if gate and up else []), mtp
    name = nmap.get_name(hf, try_suffixes=(".weight", ".bias"))
    return ([name] if name else []), mtp


def map_tensors(spec, raw: dict[str, TensorRef], where: str, keep_mtp: bool):
    """(spec with the MTP count it will write, GGUF name -> tensor); checks every shape llama.cpp will read."""
    p: Qwen35Params = spec.qwen35
    found_mtp: set[int] = set()
    for hf in raw:
        m = _MTP.match(hf.replace("model.language_model.", "model.", 1))
        if m:
            lm = _MTP_LAYER.match(m.group(1))
            found_mtp.add(int(lm.group(1)) if lm else 0)
    n_mtp = (max(found_mtp) + 1 if found_mtp else 0) if keep_mtp else 0
    if keep_mtp and p.n_mtp and not found_mtp:
        log.info("%s: config.json announces %d MTP block(s) but the checkpoint has none; converting without",
                 where, p.n_mtp)
    p = replace(p, n_mtp=n_mtp)
    n_block = p.n_trunk + n_mtp
    spec = replace(spec, n_layer=n_block, qwen35=p)
    nmap = gguf.get_tensor_name_map(spec.arch, n_block)
    tensors: dict[str, TensorRef] = {}
    for hf, ref in raw.items():
        if hf.startswith(_SKIP_PREFIXES) or hf.endswith("rotary_emb.inv_freq"):
            continue
        if p.n_expert and re.search(r"\.mlp\.experts\.\d+\.", hf):
            raise ConversionError(f"checkpoint stores its experts one tensor each ({hf}, {where}); specq converts "
                                  "Qwen3.5-MoE checkpoints with fused expert tensors (as Qwen publishes them)")
        names, mtp = _gguf_names(hf, p.n_trunk, n_block, nmap)
        if mtp is not None and not keep_mtp:
            continue
        if not names:
            raise ConversionError(f"tensor {hf} has no llama.cpp equivalent for {spec.hf_arch} ({where}); the "
                                  f"checkpoint is not a plain {spec.hf_arch}")
        for name in names:  # a fused gate_up tensor feeds two
            tensors[name] = ref
    check_shapes(spec, tensors, where)
    return spec, tensors


def expected(spec, n_vocab: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (checkpoint shape, required), as llama.cpp's qwen35 loader creates the tensors."""
    p: Qwen35Params = spec.qwen35
    e, hd, ff = spec.n_embd, spec.head_dim, spec.n_ff
    key, value = p.k_dim * p.k_heads, p.v_dim * p.v_heads
    out = {"token_embd.weight": ((n_vocab, e), True), "output_norm.weight": ((e,), True),
           "output.weight": ((n_vocab, e), False)}

    def full_attention(b: str) -> None:
        out.update({b + "attn_q.weight": ((2 * hd * spec.n_head, e), True),
                    b + "attn_k.weight": ((hd * spec.n_head_kv, e), True),
                    b + "attn_v.weight": ((hd * spec.n_head_kv, e), True),
                    b + "attn_output.weight": ((e, hd * spec.n_head), True),
                    b + "attn_q_norm.weight": ((hd,), True), b + "attn_k_norm.weight": ((hd,), True)})

    for il in range(p.n_trunk + p.n_mtp):
        b = f"blk.{il}."
        out.update({b + "attn_norm.weight": ((e,), True), b + "post_attention_norm.weight": ((e,), True)})
        if p.n_expert:
            n, f, fs = p.n_expert, p.n_ff_exp, p.n_ff_shexp
            out.update({b + "ffn_gate_inp.weight": ((n, e), True),
                        b + "ffn_gate_exps.weight": ((n, 2 * f, e), True),  # the fused gate_up tensor
                        b + "ffn_up_exps.weight": ((n, 2 * f, e), True),
                        b + "ffn_down_exps.weight": ((n, e, f), True)})
            if fs:
                out.update({b + "ffn_gate_inp_shexp.weight": ((1, e), True),
                            b + "ffn_gate_shexp.weight": ((fs, e), True), b + "ffn_up_shexp.weight": ((fs, e), True),
                            b + "ffn_down_shexp.weight": ((e, fs), True)})
        else:
            out.update({b + "ffn_gate.weight": ((ff, e), True), b + "ffn_up.weight": ((ff, e), True),
                        b + "ffn_down.weight": ((e, ff), True)})
        if il >= p.n_trunk:
            full_attention(b)
            out.update({b + "nextn.eh_proj.weight": ((e, 2 * e), True), b + "nextn.enorm.weight": ((e,), True),
                        b + "nextn.hnorm.weight": ((e,), True),
                        b + "nextn.shared_head_norm.weight": ((e,), False),
                        b + "nextn.embed_tokens.weight": ((n_vocab, e), False),
                        b + "nextn.shared_head_head.weight": ((n_vocab, e), False)})
        elif p.is_linear(il):
            out.update({b + "attn_qkv.weight": ((2 * key + value, e), True),
                        b + "attn_gate.weight": ((value, e), True),
                        b + "ssm_conv1d.weight": ((2 * key + value, 1, p.conv_kernel), True),
                        b + "ssm_dt.bias": ((p.v_heads,), True), b + "ssm_a": ((p.v_heads,), True),
                        b + "ssm_beta.weight": ((p.v_heads, e), True), b + "ssm_alpha.weight": ((p.v_heads, e), True),
                        b + "ssm_norm.weight": ((p.v_dim,), True), b + "ssm_out.weight": ((e, value), True)})
        else:
            full_attention(b)
    return out


def check_shapes(spec, tensors: dict[str, TensorRef], where: str) -> None:
    embd = tensors.get("token_embd.weight")
    if embd is None:
        return  # the caller reports the missing embedding
    want = expected(spec, embd.shape[0])
    for name, ref in tensors.items():
        if name not in want:
            raise ConversionError(f"checkpoint tensor {ref.name} ({name}) is not part of llama.cpp's {spec.arch_name} "
                                  f"model with this config.json ({where}); the checkpoint does not match its config")
        shape = want[name][0]
        if ref.shape != shape and not (name.endswith("ssm_conv1d.weight") and ref.shape == (shape[0], shape[2])):
            raise ConversionError(f"checkpoint tensor {ref.name} has shape {list(ref.shape)}, config.json implies "
                                  f"{list(shape)} ({where}); the checkpoint does not match its config: fetch it again")
    for name, (shape, required) in want.items():
        if required and name not in tensors:
            raise ConversionError(f"checkpoint lacks the tensor for {name} ({where}); a {spec.hf_arch} with this "
                                  "config.json needs it: the checkpoint is incomplete, fetch it again")


# ---- transforms ----------------------------------------------------------------------------------
def v_head_runs(p: Qwen35Params, head: int, offset: int = 0) -> list[tuple[int, int]]:
    """Source row ranges, in output order, that turn value heads grouped by key head into tiled order."""
    if p.v_per_k == 1:
        return [(offset, offset + p.v_heads * head)]
    return [(offset + (k * p.v_per_k + j) * head, offset + (k * p.v_per_k + j + 1) * head)
            for j in range(p.v_per_k) for k in range(p.k_heads)]


def _perm(runs: list[tuple[int, int]], offset: int = 0) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in runs]) - offset


def adjust_job(job, p: Qwen35Params) -> None:
    """Set the transform of one tensor job (name, shape and type already set from the checkpoint)."""
    name, ref = job.name, job.ref
    key = p.k_dim * p.k_heads
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        # in float32 from the checkpoint's values, as transformers (1.0 + weight.float()) and llama.cpp compute
        job.values = lambda x: x + np.float32(1.0)
    elif name.endswith(".ssm_a"):
        perm = _perm(v_head_runs(p, 1))
        job.transform = lambda c: c[perm]
        # A = -exp(A_log.float()), rounded once to float32 (numpy's float32 exp can be 1 ulp off; torch's was not)
        job.values = lambda x: -np.exp(x.astype(np.float64))
    elif name.endswith(".ssm_dt.bias"):
        perm = _perm(v_head_runs(p, 1))
        job.transform = lambda c: c[perm]
    elif name.endswith(".ssm_conv1d.weight"):
        job.shape = (ref.shape[0], ref.shape[-1])
        job.out_type = gguf.GGMLQuantizationType.F32
        job.row_runs = [(0, 2 * key)] + v_head_runs(p, p.v_dim, 2 * key)
        job.transform = lambda c: c.reshape(len(c), -1)
    elif name.endswith(".attn_qkv.weight"):
        job.row_runs = [(0, 2 * key)] + v_head_runs(p, p.v_dim, 2 * key)
    elif name.endswith(".attn_gate.weight"):
        job.row_runs = v_head_runs(p, p.v_dim)
    elif name.endswith((".ssm_alpha.weight", ".ssm_beta.weight")):
        job.row_runs = v_head_runs(p, 1)
    elif name.endswith(".ssm_out.weight") and p.v_per_k > 1:
        perm = _perm(v_head_runs(p, p.v_dim))
        job.transform = lambda c: c[:, perm]
    elif name.endswith((".ffn_gate_exps.weight", ".ffn_up_exps.weight")):
        f = p.n_ff_exp
        job.shape = (ref.shape[0], f) + ref.shape[2:]
        job.transform = (lambda c: c[:, :f]) if ".ffn_gate_exps." in name else (lambda c: c[:, f:])
    elif name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")):
        job.out_type = gguf.GGMLQuantizationType.F32  # router weights stay F32, as upstream writes them


def mtp_names(p: Qwen35Params, names) -> list[str]:
    """The tensors of the MTP blocks among `names`."""
    return [n for n in names if (m := re.match(r"^blk\.(\d+)\.", n)) and int(m.group(1)) >= p.n_trunk]
