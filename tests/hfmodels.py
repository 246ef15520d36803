"""Tiny Hugging Face-format checkpoints for the convert tests, and an independent numpy forward pass.

Everything here is written by hand or with the `tokenizers` package; nothing comes from specq.convert,
so the tests compare the converter against an implementation that does not share its code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tinymodels import CHAT_TEMPLATE, CORPUS

QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
OTHER_CORPUS = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt "
                "ut labore et dolore magna aliqua. 12 34 56 ") * 3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEST_TEXT = ("Hello world! 你好，世界。🙂🚀 emoji\n"
             "def f(x):\n    return x * 12345 + 67  # code\n"
             "The fox's 3.14159 numbers: 2024-01-02  \t tabs and   spaces")


@dataclass(frozen=True)
class HFSpec:
    arch: str = "LlamaForCausalLM"  # or Qwen2ForCausalLM, Qwen3ForCausalLM
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # Qwen3 sets it explicitly (may differ from n_embd / n_head)
    n_ff: int = 128
    tied: bool = False
    extra_rows: int = 0  # embedding rows beyond the tokenizer's tokens (padding)
    pretok: str = "qwen2"  # qwen2, llama3 or smollm
    corpus: str = CORPUS
    vocab_size: int = 360
    seed: int = 0
    dtype: str = "BF16"  # BF16, F16 or F32 weights
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6


# ---- tokenizer ------------------------------------------------------------------------------------
def make_tokenizer(spec: HFSpec) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if spec.pretok == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        regex = QWEN2_REGEX if spec.pretok == "qwen2" else LLAMA3_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS + (["<|begin_of_text|>"] if spec.pretok == "llama3" else [])
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([spec.corpus] * 4, trainer)
    if spec.pretok == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def tokenizer_files(spec: HFSpec, d: Path) -> Tokenizer:
    tok = make_tokenizer(spec)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": spec.pretok == "llama3",
           "bos_token": "<|begin_of_text|>" if spec.pretok == "llama3" else None,
           "model_max_length": 2048}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return tok


# ---- safetensors by hand --------------------------------------------------------------------------
def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """tensors are float32; stored as dtype (BF16 via round-to-nearest-even bits)."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":
            raw = to_bf16_bits(arr).tobytes()
        else:
            raw = arr.astype(np.float16 if dtype == "F16" else np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors as float64 (the reference forward pass reads the checkpoint, never our GGUF)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, {"F16": np.float16, "F32": np.float32}[info["dtype"]])
        out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


# ---- checkpoint -----------------------------------------------------------------------------------
def head_dim(spec: HFSpec) -> int:
    return spec.head_dim or spec.n_embd // spec.n_head


def make_weights(spec: HFSpec, n_rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    d, ff, hd = spec.n_embd, spec.n_ff, head_dim(spec)
    q, kv = spec.n_head * hd, spec.n_head_kv * hd

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or 1.0 / np.sqrt(cols))).astype(np.float32)

    def vec(n, center=1.0, spread=0.1):
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(n_rows, d, 1.0), "model.norm.weight": vec(d)}
    if not spec.tied:
        w["lm_head.weight"] = mat(n_rows, d, 2.0 / np.sqrt(d))
    for i in range(spec.n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(d)
        w[p + "post_attention_layernorm.weight"] = vec(d)
        w[p + "self_attn.q_proj.weight"] = mat(q, d)
        w[p + "self_attn.k_proj.weight"] = mat(kv, d)
        w[p + "self_attn.v_proj.weight"] = mat(kv, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, q)
        if spec.arch == "Qwen2ForCausalLM":
            w[p + "self_attn.q_proj.bias"] = vec(q, 0.0, 0.5)
            w[p + "self_attn.k_proj.bias"] = vec(kv, 0.0, 0.5)
            w[p + "self_attn.v_proj.bias"] = vec(kv, 0.0, 0.5)
        if spec.arch == "Qwen3ForCausalLM":
            w[p + "self_attn.q_norm.weight"] = vec(hd)
            w[p + "self_attn.k_norm.weight"] = vec(hd)
        w[p + "mlp.gate_proj.weight"] = mat(ff, d)
        w[p + "mlp.up_proj.weight"] = mat(ff, d)
        w[p + "mlp.down_proj.weight"] = mat(d, ff)
    return w


def write_checkpoint(d: Path, spec: HFSpec = HFSpec(), tokenizer: Tokenizer | None = None) -> Path:
    """Write config.json, tokenizer files and model.safetensors for a tiny model into d."""
    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_files(spec, d) if tokenizer is None else tokenizer
    if tokenizer is not None:
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                             "eos_token": "<|im_end|>"}), encoding="utf-8")
    n_real = tok.get_vocab_size(with_added_tokens=True)
    n_rows = n_real + spec.extra_rows
    eos = tok.token_to_id("<|im_end|>")
    cfg = {
        "architectures": [spec.arch], "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                                                     "Qwen3ForCausalLM": "qwen3"}[spec.arch],
        "hidden_size": spec.n_embd, "intermediate_size": spec.n_ff, "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head, "num_key_value_heads": spec.n_head_kv,
        "max_position_embeddings": 2048, "rms_norm_eps": spec.rms_eps, "rope_theta": spec.rope_theta,
        "vocab_size": n_rows, "tie_word_embeddings": spec.tied, "torch_dtype": {"BF16": "bfloat16",
                                                                              "F16": "float16", "F32": "float32"}[spec.dtype],
        "bos_token_id": tok.token_to_id("<|begin_of_text|>") if spec.pretok == "llama3" else eos,
        "eos_token_id": eos, "hidden_act": "silu",
    }
    if spec.head_dim:
        cfg["head_dim"] = spec.head_dim
    (d / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    write_safetensors(d / "model.safetensors", make_weights(spec, n_rows), spec.dtype)
    return d


# ---- reference forward pass (Hugging Face semantics: rotate-half RoPE) ----------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x: (T, H, D) -> rotated, HF's rotate_half convention."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_logits(d: Path, spec: HFSpec, tokens: list[int]) -> np.ndarray:
    w = read_safetensors(d / "model.safetensors")
    hd, eps, t = head_dim(spec), spec.rms_eps, len(tokens)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    group = spec.n_head // spec.n_head_kv
    for i in range(spec.n_layer):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T + w.get(p + f"self_attn.{n}_proj.bias", 0.0)
                   for n in "qkv")
        q = q.reshape(t, spec.n_head, hd)
        k = k.reshape(t, spec.n_head_kv, hd)
        v = v.reshape(t, spec.n_head_kv, hd)
        if spec.arch == "Qwen3ForCausalLM":
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, spec.rope_theta), _rope(k, spec.rope_theta)
        out = np.empty((t, spec.n_head, hd))
        for hh in range(spec.n_head):
            s = q[:, hh] @ k[:, hh // group].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // group]
        x = x + out.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ head.T


def variant(spec: HFSpec, **kw) -> HFSpec:
    return replace(spec, **kw)


# ---- SentencePiece checkpoints (Llama 2 / Mistral v0.1 style) -------------------------------------
SPM_CORPUS = CORPUS + (
    "int main(void) { return printf(\"%d\\n\", 42); }\n"
    "x = [1, 2, 3]; y = {'key': 3.14159}  # 2024-01-02\n"
    "  two  spaces   and\tone tab\n"
    "今天天气很好，我们去公园散步。世界你好。\n"
)
LLAMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{{ message['content'] }} [/INST]{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def train_spm(vocab_size: int = 480, corpus: str = SPM_CORPUS, model_type: str = "bpe") -> bytes:
    """A tiny tokenizer.model trained as Llama 2's: BPE, byte fallback, split digits, no normalization."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines() * 3), model_writer=buf, model_type=model_type,
        vocab_size=vocab_size, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return buf.getvalue()


def spm_hf_tokenizer(proto: bytes) -> Tokenizer:
    """tokenizer.json as transformers' LlamaConverter writes it for a SentencePiece BPE model."""
    import sentencepiece as spm
    from tokenizers import AddedToken, normalizers

    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    merges = []
    for piece, i in vocab.items():  # every split of a piece into two pieces, ranked by the merged piece
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(i, vocab[a], vocab[b], a, b) for a, b in pairs]
    merges = [(a, b) for *_, a, b in sorted(merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def write_spm_checkpoint(d: Path, spec: HFSpec, proto: bytes, tokenizer_json: bool = True) -> Path:
    """A Llama 2-style checkpoint: tokenizer.model (+ tokenizer.json), tokenizer_config.json as HF saves it."""
    import sentencepiece as spm

    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.model").write_bytes(proto)
    if tokenizer_json:
        spm_hf_tokenizer(proto).save(str(d / "tokenizer.json"))
    special = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, t in enumerate(("<unk>", "<s>", "</s>"))}
    cfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
           "added_tokens_decoder": special, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "pad_token": None, "legacy": False, "chat_template": LLAMA2_CHAT_TEMPLATE, "model_max_length": 2048}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    n_rows = spm.SentencePieceProcessor(model_proto=proto).vocab_size() + spec.extra_rows
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.n_embd,
        "intermediate_size": spec.n_ff, "num_hidden_layers": spec.n_layer, "num_attention_heads": spec.n_head,
        "num_key_value_heads": spec.n_head_kv, "max_position_embeddings": 2048, "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta, "vocab_size": n_rows, "tie_word_embeddings": spec.tied,
        "torch_dtype": {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[spec.dtype],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "hidden_act": "silu",
    }
    (d / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}), encoding="utf-8")
    write_safetensors(d / "model.safetensors", make_weights(spec, n_rows), spec.dtype)
    return d
