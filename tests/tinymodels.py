"""Tiny GGUF models written with gguf-py in well under a second, for engine tests.

Llama architecture, a few layers, small width, a small byte-level BPE vocabulary (GPT-2 style) whose
merges are learned from a fixed text. Different seeds give unrelated models; `noise_from` makes a
draft that is a perturbed copy of another model, so it agrees with it often but not always.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs.\n"
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.\n"
    "for i in range(10): print(i * i)  # squares 0 1 4 9 16 25 36 49 64 81\n"
    "你好，世界。今天天气很好。 emoji: 🙂🚀 numbers 12345 67890\n"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_bpe(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """A plain byte-level BPE trainer: returns (tokens, merges)."""
    b2u = bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in text.replace("\n", " \n ").split(" "):
        if w:
            key = tuple(b2u[b] for b in (" " + w).encode("utf-8"))
            words[key] = words.get(key, 0) + 1
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return tokens, merges


@dataclass(frozen=True)
class TinySpec:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 2048
    n_merges: int = 200
    extra_rows: int = 0  # padding rows beyond the real vocabulary (like Qwen's 152064 vs 151936)


_VOCAB_CACHE: dict[int, tuple[list[str], list[str]]] = {}


def vocab(n_merges: int) -> tuple[list[str], list[str]]:
    if n_merges not in _VOCAB_CACHE:
        toks, merges = train_bpe(CORPUS, n_merges)
        _VOCAB_CACHE[n_merges] = (SPECIALS + toks, merges)
    return _VOCAB_CACHE[n_merges]


def weights(spec: TinySpec, n_rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.n_embd // spec.n_head
    kv = hd * spec.n_head_kv

    def mat(rows, cols, scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    w = {
        "token_embd.weight": mat(n_rows, d, 1.0),
        "output_norm.weight": np.ones(d, np.float32),
        "output.weight": mat(n_rows, d, 2.0 / np.sqrt(d)),
    }
    for i in range(spec.n_layer):
        w[f"blk.{i}.attn_norm.weight"] = np.ones(d, np.float32)
        w[f"blk.{i}.attn_q.weight"] = mat(d, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.attn_k.weight"] = mat(kv, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.attn_v.weight"] = mat(kv, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.attn_output.weight"] = mat(d, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.ffn_norm.weight"] = np.ones(d, np.float32)
        w[f"blk.{i}.ffn_gate.weight"] = mat(ff, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.ffn_up.weight"] = mat(ff, d, 1.0 / np.sqrt(d))
        w[f"blk.{i}.ffn_down.weight"] = mat(d, ff, 1.0 / np.sqrt(ff))
    return w


def write_tiny_gguf(path: str | Path, seed: int = 0, spec: TinySpec = TinySpec(),
                    noise_from: tuple[int, float] | None = None, eos_id: int = 0,
                    token_override: dict[int, str] | None = None, edit_weights=None,
                    bos_id: int | None = 1, add_bos: bool = False, tokenizer_model: str = "gpt2") -> Path:
    """Write a tiny llama-architecture GGUF to `path`.

    noise_from=(base_seed, scale): the weights of model `base_seed` plus scale × fresh noise (seeded by `seed`).
    token_override: replace the text of some token ids (to make an incompatible vocabulary).
    edit_weights: a function dict -> dict over the tensors before they are written (bad-file tests);
    bos_id None writes no BOS id.
    """
    path = Path(path)
    tokens, merges = vocab(spec.n_merges)
    tokens = list(tokens)
    for i, t in (token_override or {}).items():
        tokens[i] = t
    n_real = len(tokens)
    n_rows = n_real + spec.extra_rows
    if noise_from is not None:
        base_seed, scale = noise_from
        w = weights(spec, n_rows, base_seed)
        noise = weights(spec, n_rows, seed)
        w = {k: (v + scale * noise[k] if v.ndim == 2 else v) for k, v in w.items()}
    else:
        w = weights(spec, n_rows, seed)
    if edit_weights is not None:
        w = edit_weights(w)
    all_tokens = tokens + [f"[PAD{i}]" for i in range(spec.extra_rows)]
    types = ([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (n_real - len(SPECIALS))
             + [gguf.TokenType.UNUSED] * spec.extra_rows)

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"specq-tiny-{seed}")
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(n_rows)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(all_tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, arr in w.items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
