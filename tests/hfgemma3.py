"""Tiny Gemma 3 checkpoints (Gemma3ForCausalLM, and the text part of Gemma3ForConditionalGeneration) with a
Gemma-style SentencePiece tokenizer, and an independent numpy forward pass with Hugging Face's Gemma 3 semantics.

Nothing here comes from specq.convert: the tests compare the converter against code that shares none of it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfmodels import SPM_CORPUS, read_safetensors, write_safetensors

# Gemma's tokenizer.model: <pad> <eos> <bos> <unk> first, then user-defined pieces matched in any text.
USER_SYMBOLS = ["<mask>", "[@BOS@]", "<unused0>", "<unused1>", "<start_of_turn>", "<end_of_turn>",
                "<start_of_image>", "<end_of_image>"]
SPECIAL_ADDED = {"<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"}  # "special": true
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_CORPUS = SPM_CORPUS + (
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\nParis.<end_of_turn>\n"
    "The weather is nice today and the garden is full of flowers in every colour.\n"
)


def train_gemma_spm(vocab_size: int = 600) -> bytes:
    """A tiny tokenizer.model trained as Gemma's: BPE, byte fallback, split digits, no dummy prefix, identity."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(GEMMA_CORPUS.splitlines() * 3), model_writer=buf, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, minloglevel=2,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=USER_SYMBOLS)
    return buf.getvalue()


@dataclass(frozen=True)
class GemmaSpec:
    n_layer: int = 7  # layers 0-4 and 6 slide, layer 5 is global (Gemma 3's 5:1 pattern)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32  # not n_embd / n_head, as in the real models
    n_ff: int = 128
    sliding_window: int = 8
    layer_types: tuple[str, ...] | None = None  # None: sliding_window_pattern 6
    rope_theta: float = 1_000_000.0
    rope_local: float = 10_000.0
    rope_factor: float | None = 8.0  # linear scaling of the global layers (Gemma-3-4B and up)
    softcap: float | None = None
    multimodal: bool = False  # Gemma3ForConditionalGeneration layout: text_config, prefixed names, a vision tower
    new_layout: bool = False  # transformers 5: model.language_model.*, rope_parameters per layer type
    extra_rows: int = 0
    image_token: bool = False  # <image_soft_token> past the pieces, as Gemma 3 lists it (a row only with extra_rows)
    embed_scale: float = 0.5  # 0.1: the layers, not the (tied) input token, decide the output; greedy text varies
    seed: int = 0
    dtype: str = "BF16"
    rms_eps: float = 1e-6

    def is_local(self, i: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[i] == "sliding_attention"
        return (i + 1) % 6 != 0


def text_prefix(spec: GemmaSpec) -> str:
    if not spec.multimodal:
        return "model."
    return "model.language_model." if spec.new_layout else "language_model.model."


def make_weights(spec: GemmaSpec, n_rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_head_kv * hd

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32)

    def norm(n):  # Gemma norms are stored as an offset from 1 (the model multiplies by 1 + w)
        return (0.3 * rng.standard_normal(n)).astype(np.float32)

    p0 = text_prefix(spec)
    w = {p0 + "embed_tokens.weight": mat(n_rows, d, spec.embed_scale), p0 + "norm.weight": norm(d)}
    for i in range(spec.n_layer):
        p = f"{p0}layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(q, d)
        w[p + "self_attn.k_proj.weight"] = mat(kv, d)
        w[p + "self_attn.v_proj.weight"] = mat(kv, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, q)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "pre_feedforward_layernorm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = mat(ff, d)
        w[p + "mlp.up_proj.weight"] = mat(ff, d)
        w[p + "mlp.down_proj.weight"] = mat(d, ff)
        w[p + "post_feedforward_layernorm.weight"] = norm(d)
    if spec.multimodal:  # a stand-in vision tower and projector: the converter must leave them out
        vt = "model.vision_tower." if spec.new_layout else "vision_tower."
        mp = "model.multi_modal_projector." if spec.new_layout else "multi_modal_projector."
        w[vt + "vision_model.embeddings.patch_embedding.weight"] = mat(16, 12)
        w[vt + "vision_model.post_layernorm.weight"] = norm(16)
        w[mp + "mm_input_projection_weight"] = mat(16, d)
        w[mp + "mm_soft_emb_norm.weight"] = norm(16)
    return w


def write_gemma3_checkpoint(d: Path, spec: GemmaSpec, proto: bytes) -> Path:
    """config.json, tokenizer.model, tokenizer_config.json and model.safetensors, laid out as Google ships them."""
    import sentencepiece as spm

    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.model").write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    added = {}
    for text in ["<pad>", "<eos>", "<bos>", "<unk>", *USER_SYMBOLS]:
        i = sp.piece_to_id(text)
        added[str(i)] = {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": text in SPECIAL_ADDED}
    if spec.image_token:
        i = sp.vocab_size()
        (d / "added_tokens.json").write_text(json.dumps({"<image_soft_token>": i}), encoding="utf-8")
        added[str(i)] = {"content": "<image_soft_token>", "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
    tcfg = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
            "added_tokens_decoder": added, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "unk_token": "<unk>", "chat_template": GEMMA_TEMPLATE, "model_max_length": 4096,
            "spaces_between_special_tokens": False}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg), encoding="utf-8")
    n_rows = sp.vocab_size() + spec.extra_rows
    text = {
        "model_type": "gemma3_text", "hidden_size": spec.n_embd, "intermediate_size": spec.n_ff,
        "num_hidden_layers": spec.n_layer, "num_attention_heads": spec.n_head,
        "num_key_value_heads": spec.n_head_kv, "head_dim": spec.head_dim, "query_pre_attn_scalar": spec.head_dim,
        "sliding_window": spec.sliding_window, "rms_norm_eps": spec.rms_eps, "vocab_size": n_rows,
        "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": spec.softcap, "attn_logit_softcapping": None,
    }
    if spec.layer_types is not None:
        text["layer_types"] = list(spec.layer_types)
    else:
        text["sliding_window_pattern"] = 6
    scaling = {"rope_type": "linear", "factor": spec.rope_factor} if spec.rope_factor else None
    if spec.new_layout:
        text["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta,
                                                      **(scaling or {})},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local}}
    else:
        text.update(rope_theta=spec.rope_theta, rope_local_base_freq=spec.rope_local, rope_scaling=scaling)
    dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[spec.dtype]
    if spec.multimodal:
        # as google/gemma-3-27b-it: the text_config lists only what differs from Gemma3TextConfig's defaults
        defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
                    "attn_logit_softcapping": None, "final_logit_softcapping": None}
        slim = {k: v for k, v in text.items() if k not in defaults or defaults[k] != v}
        slim["max_position_embeddings"] = 4096
        cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": slim,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16},
               "mm_tokens_per_image": 256, "eos_token_id": [1, sp.piece_to_id("<end_of_turn>")],
               "torch_dtype": dtype}
    else:
        cfg = {"architectures": ["Gemma3ForCausalLM"], **text, "bos_token_id": 2, "eos_token_id": 1,
               "pad_token_id": 0, "torch_dtype": dtype}
    (d / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 2, "eos_token_id": [1, sp.piece_to_id("<end_of_turn>")], "pad_token_id": 0}),
        encoding="utf-8")
    write_safetensors(d / "model.safetensors", make_weights(spec, n_rows), spec.dtype)
    return d


# ---- reference forward pass (transformers' Gemma3ForCausalLM, in float64) ---------------------------
def _rms1(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x: np.ndarray, theta: float, factor: float) -> np.ndarray:
    """x: (T, H, D), rotate-half RoPE; linear scaling divides the frequencies by factor."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d) / factor
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(d: Path, spec: GemmaSpec, tokens: list[int]) -> np.ndarray:
    w = read_safetensors(d / "model.safetensors")
    p0, hd, eps, t = text_prefix(spec), spec.head_dim, spec.rms_eps, len(tokens)
    emb = w[p0 + "embed_tokens.weight"]
    x = emb[tokens] * np.sqrt(spec.n_embd)
    i_pos, j_pos = np.arange(t)[:, None], np.arange(t)[None, :]
    causal = j_pos <= i_pos
    window = causal & (i_pos - j_pos < spec.sliding_window)
    group = spec.n_head // spec.n_head_kv
    for i in range(spec.n_layer):
        p = f"{p0}layers.{i}."
        local = spec.is_local(i)
        theta, factor = (spec.rope_local, 1.0) if local else (spec.rope_theta, spec.rope_factor or 1.0)
        h = _rms1(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, spec.n_head, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, spec.n_head_kv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, spec.n_head_kv, hd)
        q = _rope(_rms1(q, w[p + "self_attn.q_norm.weight"], eps), theta, factor)
        k = _rope(_rms1(k, w[p + "self_attn.k_norm.weight"], eps), theta, factor)
        allowed = window if local else causal
        out = np.empty((t, spec.n_head, hd))
        for hh in range(spec.n_head):
            s = q[:, hh] @ k[:, hh // group].T / np.sqrt(hd)  # query_pre_attn_scalar = head_dim
            s = np.where(allowed, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // group]
        a = out.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = x + _rms1(a, w[p + "post_attention_layernorm.weight"], eps)
        h = _rms1(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        m = (_gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        m = m @ w[p + "mlp.down_proj.weight"].T
        x = x + _rms1(m, w[p + "post_feedforward_layernorm.weight"], eps)
    logits = _rms1(x, w[p0 + "norm.weight"], eps) @ emb.T  # tied
    if spec.softcap:
        logits = np.tanh(logits / spec.softcap) * spec.softcap
    return logits
