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
    return _write_llama(path, f"specq-tiny-{seed}", spec, all_tokens, types, merges, w, bos_id, eos_id, add_bos,
                        tokenizer_model)


def _write_llama(path: Path, name: str, spec: TinySpec, tokens: list[str], types: list, merges: list[str],
                 w: dict[str, np.ndarray], bos_id: int | None, eos_id: int, add_bos: bool,
                 tokenizer_model: str = "gpt2") -> Path:
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
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
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    return _finish(writer, w, path)


def _finish(writer: "gguf.GGUFWriter", w: dict[str, np.ndarray], path: Path) -> Path:
    """Add the tensors and write the file."""
    for name, arr in w.items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bigram_weights(spec: TinySpec, corpus_tokens: list[int], n_rows: int, sharpness: float = 3.0,
                   mix: float = 0.0) -> dict[str, np.ndarray]:
    """Weights of a model that continues text as the corpus does: every block's output projections are zero and
    each token's embedding is a one-hot, so the logits after a token are `sharpness` × its row of the corpus's
    token bigram log-probabilities. Its greedy text reads like the corpus, and it drafts for a copy of itself over
    another vocabulary as far as the text allows (write_reindexed)."""
    counts = np.full((n_rows, n_rows), 0.02)
    np.add.at(counts, (np.asarray(corpus_tokens[:-1]), np.asarray(corpus_tokens[1:])), 1.0)
    np.fill_diagonal(counts, 1e-4)  # never a token after itself: greedy text does not stall on one token
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    d = spec.n_embd
    assert d >= n_rows, "a bigram model needs n_embd >= its vocabulary"
    w = weights(spec, n_rows, 0)
    w["token_embd.weight"] = np.eye(n_rows, d, dtype=np.float32) * np.float32(np.sqrt(d))  # rms 1: norm keeps it
    w["output.weight"] = np.zeros((n_rows, d), np.float32)
    w["output.weight"][:, :n_rows] = (logp.T * sharpness / np.sqrt(d)).astype(np.float32)
    for i in range(spec.n_layer):
        w[f"blk.{i}.attn_output.weight"] *= mix
        w[f"blk.{i}.ffn_down.weight"] *= mix
    return w


BIGRAM = TinySpec(n_embd=384, n_head=4, n_head_kv=2, n_ff=64)


def write_bigram_gguf(path: str | Path, spec: TinySpec = BIGRAM, sharpness: float = 3.0, mix: float = 0.0) -> Path:
    """A tiny model that continues text as CORPUS does (bigram_weights), over the tiny vocabulary."""
    from specq.native.llama import ffi
    path = Path(path)
    write_tiny_gguf(path, seed=0, spec=spec)
    with ffi.Model(path, vocab_only=True) as m:
        toks = m.tokenize(CORPUS.replace("    ", ""), add_special=False, parse_special=False)
    tokens, _ = vocab(spec.n_merges)
    w = bigram_weights(spec, toks, len(tokens), sharpness, mix)
    return write_tiny_gguf(path, seed=0, spec=spec, edit_weights=lambda _: w)


def write_tiny_over_vocab(path: str | Path, vocab_file: str | Path, seed: int = 0,
                          spec: TinySpec = TinySpec(n_embd=16, n_head=2, n_head_kv=1, n_ff=32)) -> Path:
    """A tiny llama model (random weights) over a real vocabulary: every tokenizer field of `vocab_file` (one of
    llama.cpp's vocab-only `ggml-vocab-*.gguf`) copied, one embedding and output row per token."""
    path = Path(path)
    r = gguf.GGUFReader(str(vocab_file))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"specq-tiny-over-{Path(vocab_file).stem}")
    for k, v in (("context_length", spec.n_ctx), ("embedding_length", spec.n_embd), ("block_count", spec.n_layer),
                 ("feed_forward_length", spec.n_ff), ("attention.head_count", spec.n_head),
                 ("attention.head_count_kv", spec.n_head_kv), ("rope.dimension_count", spec.n_embd // spec.n_head)):
        w.add_uint32(f"{arch}.{k}", v)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    for name, f in r.fields.items():
        if name.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    return _finish(w, weights(spec, n_vocab, seed), path)


def merge_leaves(spec: TinySpec = TinySpec(), removed: set[str] = frozenset()) -> list[str]:
    """The merged tokens of the tiny vocabulary that no later merge uses once `removed` are gone: removing one
    (and its merge) splits its text into the two tokens it was merged from, and nothing else changes."""
    tokens, merges = vocab(spec.n_merges)
    used = {part for m in merges if m.replace(" ", "") not in removed for part in m.split(" ")}
    return [t for t in tokens[len(SPECIALS) + 256:] if t not in used and t not in removed]


def write_reindexed(path: str | Path, base: Path, remove: list[str], spec: TinySpec = TinySpec(),
                    seed: int = 0) -> Path:
    """The tiny model at `base` with its vocabulary re-indexed: the tokens `remove` (merge leaves)
    and their merges dropped, so their text splits in two; every other token's id permuted (seeded), its
    embedding and output rows moved with it. The same network over another vocabulary: a draft of the original
    drafts for it across vocabularies."""
    path = Path(path)
    tokens, merges = vocab(spec.n_merges)
    assert set(remove) <= {t for t in tokens[len(SPECIALS) + 256:]}
    w = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(base)).tensors}
    keep = [i for i, t in enumerate(tokens) if t not in set(remove)]
    order = [keep[i] for i in np.random.default_rng(seed).permutation(len(keep))]
    new_tokens = [tokens[i] for i in order]
    types = [gguf.TokenType.CONTROL if i < len(SPECIALS) else gguf.TokenType.NORMAL for i in order]
    new_merges = [m for m in merges if m.replace(" ", "") not in set(remove)]
    for name in ("token_embd.weight", "output.weight"):
        w[name] = w[name][order]
    return _write_llama(path, f"specq-tiny-{Path(base).stem}-reindexed", spec, new_tokens, types, new_merges, w,
                        order.index(1), order.index(0), False)


# -- tiny hybrid Qwen3.5 (llama.cpp architecture "qwen35") ------------------------------------------------


@dataclass(frozen=True)
class TinyQwen35Spec:
    """Shapes of a tiny Qwen3.5: Gated DeltaNet (linear-attention) layers, every 4th layer full attention."""
    n_layer: int = 4
    n_embd: int = 64
    n_ff: int = 128
    n_ctx: int = 2048
    n_merges: int = 200
    full_attention_interval: int = 4
    # full-attention layers: gated queries (Q and its gate share one projection), GQA, head_dim ≠ n_embd / n_head
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 8                             # partial rotary, as Qwen3.5 (a quarter of head_dim)
    rope_sections: tuple[int, ...] = (2, 1, 1, 0)  # interleaved M-RoPE sections; they sum to n_rot / 2
    # linear-attention layers (Gated DeltaNet)
    linear_k_heads: int = 2                    # ssm.group_count
    linear_v_heads: int = 4                    # ssm.time_step_rank
    linear_head_dim: int = 16                  # ssm.state_size; llama.cpp takes it for both key and value heads
    conv_kernel: int = 4

    def is_full_attention(self, il: int) -> bool:
        return (il + 1) % self.full_attention_interval == 0


def qwen35_weights(spec: TinyQwen35Spec, n_vocab: int, seed: int, with_mtp: bool,
                   mtp_bigram: bool = False) -> dict[str, np.ndarray]:
    """Random Qwen3.5 weights in GGUF layout (numpy shape = reversed ggml shape). The MTP block is drawn
    after the trunk, so a model with and one without it share their trunk weights. mtp_bigram: see
    write_tiny_qwen35."""
    rng = np.random.default_rng(seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim
    kd = spec.linear_head_dim * spec.linear_k_heads   # key_dim of the linear layers
    vd = spec.linear_head_dim * spec.linear_v_heads   # value_dim (= ssm.inner_size)

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (1 / np.sqrt(cols) if scale is None else scale)).astype(np.float32)

    def norm(n):
        # Qwen3.5 keeps RMSNorm weights as offsets from 1; the converter adds the 1, so a GGUF holds values near 1.0
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def attention(b):
        return {
            b + "attn_q.weight": mat(2 * spec.n_head * hd, d),  # per head: hd query rows, then hd gate rows
            b + "attn_k.weight": mat(spec.n_head_kv * hd, d),
            b + "attn_v.weight": mat(spec.n_head_kv * hd, d),
            b + "attn_output.weight": mat(d, spec.n_head * hd),
            b + "attn_q_norm.weight": norm(hd),
            b + "attn_k_norm.weight": norm(hd),
        }

    def ffn(b):
        return {b + "ffn_gate.weight": mat(ff, d), b + "ffn_up.weight": mat(ff, d), b + "ffn_down.weight": mat(d, ff)}

    w = {"token_embd.weight": mat(n_vocab, d, 1.0), "output_norm.weight": norm(d),
         "output.weight": mat(n_vocab, d, 2.0 / np.sqrt(d))}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        w[b + "attn_norm.weight"] = norm(d)
        w[b + "post_attention_norm.weight"] = norm(d)
        if spec.is_full_attention(il):
            w.update(attention(b))
        else:
            w[b + "attn_qkv.weight"] = mat(2 * kd + vd, d)   # rows: q heads, k heads, v heads
            w[b + "attn_gate.weight"] = mat(vd, d)           # z, the output gate
            w[b + "ssm_conv1d.weight"] = mat(2 * kd + vd, spec.conv_kernel, 0.5)
            w[b + "ssm_beta.weight"] = mat(spec.linear_v_heads, d)
            w[b + "ssm_alpha.weight"] = mat(spec.linear_v_heads, d)
            w[b + "ssm_dt.bias"] = np.full(spec.linear_v_heads, -1.0, np.float32)
            # stored as A = −exp(A_log) (what the converter writes): negative, so the state decays
            w[b + "ssm_a"] = -rng.uniform(1.0, 8.0, spec.linear_v_heads).astype(np.float32)
            # the gated output norm is the one Qwen3.5 norm stored as is (no +1 in the converter)
            w[b + "ssm_norm.weight"] = norm(spec.linear_head_dim)
            w[b + "ssm_out.weight"] = mat(d, vd)
        w.update(ffn(b))
    if with_mtp:
        # one NextN block after the trunk: a full-attention decoder layer fed by
        # eh_proj([enorm(embedding of the next token), hnorm(the trunk's last hidden state)])
        b = f"blk.{spec.n_layer}."
        w[b + "attn_norm.weight"] = norm(d)
        w[b + "post_attention_norm.weight"] = norm(d)
        w.update(attention(b))
        w.update(ffn(b))
        w[b + "nextn.eh_proj.weight"] = mat(d, 2 * d)
        w[b + "nextn.enorm.weight"] = norm(d)
        w[b + "nextn.hnorm.weight"] = norm(d)
        w[b + "nextn.shared_head_norm.weight"] = norm(d)
        if mtp_bigram:
            # the block mostly passes the token's embedding to the shared output head (a bigram guess), with a
            # part of the trunk's hidden state mixed in, so that the state it is paired with changes its output
            w[b + "nextn.eh_proj.weight"][:, :d] = np.eye(d, dtype=np.float32)
            w[b + "nextn.eh_proj.weight"][:, d:] *= 0.3
            w[b + "attn_output.weight"] *= 0.1
            w[b + "ffn_down.weight"] *= 0.1
    if mtp_bigram:
        # a trunk whose layers add less to the embedding: its next token often follows the current one's bigram
        # guess, and still depends on the context
        for k in w:
            if k.startswith("blk.") and int(k.split(".")[1]) < spec.n_layer and k.endswith(
                    ("ffn_down.weight", "ssm_out.weight", "attn_output.weight")):
                w[k] = w[k] * np.float32(0.3)
    return w


def write_tiny_qwen35(path: str | Path, seed: int = 0, n_layer: int = 4, noise_from: tuple[int, float] | None = None,
                      with_mtp: bool = False, spec: TinyQwen35Spec | None = None, eos_id: int = 0,
                      mtp_bigram: bool = False) -> Path:
    """Write a tiny hybrid Qwen3.5 GGUF (llama.cpp arch `qwen35`, F32) with the tiny llama models' vocabulary.

    llama.cpp gives it hybrid memory: recurrent state for the linear-attention layers, a KV cache for the
    full-attention ones. noise_from=(base_seed, scale): model `base_seed`'s weights plus scale × fresh noise
    (seeded by `seed`) on every matrix, a draft that often agrees. with_mtp: one NextN (MTP) block as layer
    n_layer, counted in block_count and announced by nextn_predict_layers; llama.cpp skips it unless the model
    is loaded with load_mtp. `spec`, when given, sets every shape (its n_layer wins over `n_layer`).
    mtp_bigram: an MTP block that drafts useful tokens (it mostly maps the token to its bigram guess through the
    shared output head) and a trunk with scaled-down layers that often agrees with it (about 40% greedy).
    """
    path = Path(path)
    spec = spec or TinyQwen35Spec(n_layer=n_layer)
    tokens, merges = vocab(spec.n_merges)
    n_vocab = len(tokens)
    w = qwen35_weights(spec, n_vocab, noise_from[0] if noise_from else seed, with_mtp, mtp_bigram)
    if noise_from is not None:
        noise = qwen35_weights(spec, n_vocab, seed, with_mtp, mtp_bigram)
        w = {k: (v + noise_from[1] * noise[k] if v.ndim == 2 else v) for k, v in w.items()}
    return write_qwen35_weights(path, spec, w, name=f"specq-tiny-qwen35-{seed}", with_mtp=with_mtp, eos_id=eos_id)


def write_qwen35_weights(path: str | Path, spec: TinyQwen35Spec, w: dict[str, np.ndarray], name: str,
                         with_mtp: bool = False, eos_id: int = 0) -> Path:
    """Write qwen35 weights (as qwen35_weights returns them, possibly edited) with the tiny vocabulary."""
    path = Path(path)
    tokens, merges = vocab(spec.n_merges)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35]
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(name)
    wr.add_context_length(spec.n_ctx)
    wr.add_embedding_length(spec.n_embd)
    wr.add_block_count(spec.n_layer + int(with_mtp))  # llama.cpp: trunk layers = block_count − nextn layers
    if with_mtp:
        wr.add_nextn_predict_layers(1)
    wr.add_feed_forward_length(spec.n_ff)
    wr.add_head_count(spec.n_head)
    wr.add_head_count_kv(spec.n_head_kv)
    wr.add_key_length(spec.head_dim)
    wr.add_value_length(spec.head_dim)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_dimension_count(spec.n_rot)
    wr.add_rope_dimension_sections(list(spec.rope_sections))  # required by the qwen35 loader
    wr.add_rope_freq_base(10000.0)
    wr.add_full_attention_interval(spec.full_attention_interval)
    wr.add_ssm_conv_kernel(spec.conv_kernel)
    wr.add_ssm_state_size(spec.linear_head_dim)
    wr.add_ssm_group_count(spec.linear_k_heads)
    wr.add_ssm_time_step_rank(spec.linear_v_heads)
    wr.add_ssm_inner_size(spec.linear_head_dim * spec.linear_v_heads)
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    return _write_vocab_and_tensors(wr, path, tokens, merges, eos_id, w)


# -- tiny sliding-window Gemma 3 (llama.cpp architecture "gemma3") ----------------------------------------


@dataclass(frozen=True)
class TinyGemma3Spec:
    """Shapes of a tiny Gemma 3: local (sliding-window) layers with a global one every `swa_pattern` layers,
    as llama.cpp's gemma3 loader lays them out (pattern 6: layers 5, 11, ... are global)."""
    n_layer: int = 6
    n_embd: int = 64
    n_ff: int = 128
    n_ctx: int = 2048
    n_merges: int = 200
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    sliding_window: int = 8
    swa_pattern: int = 6
    rope_base: float = 1_000_000.0      # global layers
    rope_base_swa: float = 10_000.0     # local layers
    final_logit_softcapping: float = 0.0  # Gemma 3 has none; llama.cpp applies one only if the key is > 0


def gemma3_weights(spec: TinyGemma3Spec, n_vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random Gemma 3 weights in GGUF layout (numpy shape = reversed ggml shape)."""
    rng = np.random.default_rng(seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.head_dim

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (1 / np.sqrt(cols) if scale is None else scale)).astype(np.float32)

    def norm(n):
        # Gemma stores RMSNorm weights as offsets from 1; the converter adds the 1
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # llama.cpp scales the embedding by sqrt(n_embd) on input; a separate output matrix (Gemma 3 ties them,
    # llama.cpp allows both) keeps a random model's greedy output from collapsing onto a few tokens
    w = {"token_embd.weight": mat(n_vocab, d, 1.0 / np.sqrt(d)), "output_norm.weight": norm(d),
         "output.weight": mat(n_vocab, d, 2.0 / np.sqrt(d))}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        w.update({
            b + "attn_norm.weight": norm(d),
            b + "attn_q.weight": mat(spec.n_head * hd, d),
            b + "attn_k.weight": mat(spec.n_head_kv * hd, d),
            b + "attn_v.weight": mat(spec.n_head_kv * hd, d),
            b + "attn_output.weight": mat(d, spec.n_head * hd),
            b + "attn_q_norm.weight": norm(hd),
            b + "attn_k_norm.weight": norm(hd),
            b + "post_attention_norm.weight": norm(d),
            b + "ffn_norm.weight": norm(d),
            b + "ffn_gate.weight": mat(ff, d),
            b + "ffn_up.weight": mat(ff, d),
            b + "ffn_down.weight": mat(d, ff),
            b + "post_ffw_norm.weight": norm(d),
        })
    return w


def write_tiny_gemma3(path: str | Path, seed: int = 0, noise_from: tuple[int, float] | None = None,
                      spec: TinyGemma3Spec = TinyGemma3Spec(), eos_id: int = 0) -> Path:
    """Write a tiny sliding-window Gemma 3 GGUF (llama.cpp arch `gemma3`, F32) with the tiny models' vocabulary.

    llama.cpp gives it an iSWA cache: a full-size KV cache for the global layers and a small one for the
    local layers, whose cells are reused once their positions leave the window. noise_from=(base_seed, scale):
    model `base_seed`'s weights plus scale × fresh noise (seeded by `seed`), a draft that often agrees."""
    path = Path(path)
    tokens, merges = vocab(spec.n_merges)
    n_vocab = len(tokens)
    w = gemma3_weights(spec, n_vocab, noise_from[0] if noise_from else seed)
    if noise_from is not None:
        noise = gemma3_weights(spec, n_vocab, seed)
        w = {k: (v + noise_from[1] * noise[k] if v.ndim == 2 else v) for k, v in w.items()}

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3]
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"specq-tiny-gemma3-{seed}")
    wr.add_context_length(spec.n_ctx)
    wr.add_embedding_length(spec.n_embd)
    wr.add_block_count(spec.n_layer)
    wr.add_feed_forward_length(spec.n_ff)
    wr.add_head_count(spec.n_head)
    wr.add_head_count_kv(spec.n_head_kv)
    wr.add_key_length(spec.head_dim)
    wr.add_value_length(spec.head_dim)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_freq_base(spec.rope_base)
    wr.add_rope_freq_base_swa(spec.rope_base_swa)
    wr.add_sliding_window(spec.sliding_window)
    wr.add_sliding_window_pattern(spec.swa_pattern)
    if spec.final_logit_softcapping > 0:
        wr.add_final_logit_softcapping(spec.final_logit_softcapping)
    wr.add_file_type(gguf.LlamaFileType.ALL_F32)
    return _write_vocab_and_tensors(wr, path, tokens, merges, eos_id, w)


def _write_vocab_and_tensors(wr: "gguf.GGUFWriter", path: Path, tokens: list[str], merges: list[str], eos_id: int,
                             w: dict[str, np.ndarray]) -> Path:
    """The byte-level BPE vocabulary, chat template and tensors shared by the tiny qwen35 and gemma3 files."""
    n_vocab = len(tokens)
    wr.add_vocab_size(n_vocab)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (n_vocab - len(SPECIALS)))
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(eos_id)
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    for name, arr in w.items():
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
