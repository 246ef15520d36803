"""Check a GGUF file, from its header and tensor table, for what llama.cpp would assert on or refuse.

llama.cpp aborts the whole process on some bad files (a duplicate token text is a GGML_ASSERT in
llama-vocab.cpp) and reports others only as "failed to load". These checks run in Python before
llama.cpp sees the file, so the user gets one line naming the cause and where it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import ModelFileError
from .gguf_header import GGUFHeader, SkippedArray, read_header

TOKENS_KEY = "tokenizer.ggml.tokens"
REDO = "convert or download the model again"

# llama.cpp's default BOS id per tokenizer model when the file names none (llama-vocab.cpp); None: no BOS.
_DEFAULT_BOS = {"llama": 1, "gpt2": 11, "bert": 101, "t5": None, "rwkv": None, "no_vocab": None, "none": None,
                "plamo2": 1}


@dataclass(frozen=True)
class Expected:
    """One tensor the architecture needs: its name, ggml shape (ne0 first) and whether it may be absent."""

    name: str
    shape: tuple[int, ...]
    required: bool = True


def check_model_file(path: str | os.PathLike) -> GGUFHeader:
    """Raise ModelFileError (cause and where) for a file llama.cpp would abort on or refuse; return its header."""
    h = read_header(path, keep=(TOKENS_KEY,))
    check_tensor_data(h)
    n_tokens = check_vocabulary(h)
    check_bos(h, n_tokens)
    check_tensors(h, n_tokens)
    return h


def check_tensor_data(h: GGUFHeader) -> None:
    """Every tensor's bytes lie inside the file (a cut download fails here, not deep in llama.cpp)."""
    for t in h.tensors:
        start = h.data_offset + t.offset
        end = start + t.nbytes
        if end > h.file_size:
            raise ModelFileError(f"model file is truncated ({h.path}: tensor {t.name} needs bytes {start}..{end}, "
                                 f"the file has {h.file_size}); {REDO}")


def check_vocabulary(h: GGUFHeader) -> int | None:
    """The token count; a duplicate token text is refused (llama.cpp asserts on it)."""
    tokens = h.metadata.get(TOKENS_KEY)
    if tokens is None:
        return None  # llama.cpp reports a missing vocabulary itself, without aborting
    if isinstance(tokens, SkippedArray) or not isinstance(tokens, list):
        raise ModelFileError(f"the token list is not a list of strings ({h.path}: {TOKENS_KEY}); {REDO}")
    first: dict[str, int] = {}
    for i, text in enumerate(tokens):
        j = first.setdefault(text, i)
        if j != i:
            raise ModelFileError(f"the vocabulary has a duplicate token text ({h.path}: tokens {j} and {i} are "
                                 f"both {text!r}); llama.cpp would abort on it: {REDO}")
    return len(tokens)


def check_bos(h: GGUFHeader, n_tokens: int | None) -> None:
    """add_bos needs a BOS id in range (llama.cpp asserts when it tokenizes)."""
    if n_tokens is None or h.metadata.get("tokenizer.ggml.add_bos_token") is not True:
        return
    model = str(h.metadata.get("tokenizer.ggml.model", ""))
    bos = h.metadata.get("tokenizer.ggml.bos_token_id")
    if not (isinstance(bos, int) and 0 <= bos < n_tokens):
        bos = _DEFAULT_BOS.get(model, 1)  # llama.cpp falls back to the tokenizer's default
        if bos is not None and bos >= n_tokens:
            bos = None
    if bos is None:
        raise ModelFileError(f"the file asks for a BOS token but has none ({h.path}: tokenizer.ggml.add_bos_token "
                             f"is true, tokenizer.ggml.bos_token_id is {h.metadata.get('tokenizer.ggml.bos_token_id')}"
                             f" of {n_tokens} tokens); llama.cpp would abort when tokenizing: {REDO}")


def _dims(h: GGUFHeader) -> dict[str, int] | None:
    """The hyper-parameters the tensor shapes depend on, or None when one is missing or not a number."""
    try:
        n_embd, n_head = int(h.arch_key("embedding_length")), int(h.arch_key("attention.head_count"))
        n_head_kv = int(h.arch_key("attention.head_count_kv", n_head))
        head_k = int(h.arch_key("attention.key_length", n_embd // n_head))
        head_v = int(h.arch_key("attention.value_length", head_k))
        return {"n_embd": n_embd, "n_head": n_head, "n_layer": int(h.arch_key("block_count")),
                "n_ff": int(h.arch_key("feed_forward_length")), "head_k": head_k, "head_v": head_v,
                "k_gqa": head_k * n_head_kv, "v_gqa": head_v * n_head_kv}
    except (TypeError, ValueError, ZeroDivisionError):
        return None  # per-layer lists (hybrid models) or gaps: llama.cpp names those itself


def expected_tensors(h: GGUFHeader, n_vocab: int) -> list[Expected] | None:
    """What llama.cpp's llama/qwen2/qwen3 loaders create (src/models/*.cpp); None for other architectures."""
    if h.arch not in ARCHS or h.arch_key("expert_count", 0):
        return None
    d = _dims(h)
    if d is None:
        return None
    fused = {int(t.name.split(".")[1]) for t in h.tensors if t.name.endswith("attn_qkv.weight")}
    return architecture_tensors(h.arch, d, n_vocab, fused)


ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def architecture_tensors(arch: str, d: dict[str, int], n_vocab: int, fused: set[int] = frozenset()) -> list[Expected]:
    """The tensors of a dense llama/qwen2/qwen3 model with dimensions `d` (see _dims), in ggml order.

    `fused`: layers that carry one attn_qkv instead of attn_q/k/v. The converter checks a checkpoint
    against the same list, so what it writes is what llama.cpp will load."""
    e = d["n_embd"]
    if arch == "gemma3":
        return gemma3_tensors(d, n_vocab)
    # as the loaders read them: qwen2 sizes q by n_embd, and both qwens size k like v
    q = e if arch == "qwen2" else d["head_k"] * d["n_head"]
    k_gqa = d["k_gqa"] if arch == "llama" else d["v_gqa"]
    out = [Expected("token_embd.weight", (e, n_vocab)), Expected("output_norm.weight", (e,)),
           Expected("output.weight", (e, n_vocab), required=False)]
    for i in range(d["n_layer"]):
        b = f"blk.{i}."
        sep = i not in fused
        out += [Expected(b + "attn_norm.weight", (e,)), Expected(b + "attn_q.weight", (e, q), sep),
                Expected(b + "attn_k.weight", (e, k_gqa), sep), Expected(b + "attn_v.weight", (e, d["v_gqa"]), sep),
                Expected(b + "attn_q.bias", (q,), False), Expected(b + "attn_k.bias", (k_gqa,), False),
                Expected(b + "attn_v.bias", (d["v_gqa"],), False),
                Expected(b + "attn_output.weight", (q, e)), Expected(b + "ffn_norm.weight", (e,)),
                Expected(b + "ffn_gate.weight", (e, d["n_ff"])), Expected(b + "ffn_down.weight", (d["n_ff"], e)),
                Expected(b + "ffn_up.weight", (e, d["n_ff"]))]
        if arch == "qwen3":
            out += [Expected(b + "attn_q_norm.weight", (d["head_k"],)), Expected(b + "attn_k_norm.weight", (d["head_k"],))]
    return out


def gemma3_tensors(d: dict[str, int], n_vocab: int) -> list[Expected]:
    """What llama.cpp's gemma3 loader creates (src/models/gemma3.cpp): q/k norms, norms after attention and FFN."""
    e, q = d["n_embd"], d["head_k"] * d["n_head"]
    out = [Expected("token_embd.weight", (e, n_vocab)), Expected("output_norm.weight", (e,)),
           Expected("output.weight", (e, n_vocab), required=False)]
    for i in range(d["n_layer"]):
        b = f"blk.{i}."
        out += [Expected(b + "attn_norm.weight", (e,)), Expected(b + "attn_q.weight", (e, q)),
                Expected(b + "attn_k.weight", (e, d["k_gqa"])), Expected(b + "attn_v.weight", (e, d["v_gqa"])),
                Expected(b + "attn_output.weight", (q, e)), Expected(b + "post_attention_norm.weight", (e,)),
                Expected(b + "attn_q_norm.weight", (d["head_k"],)), Expected(b + "attn_k_norm.weight", (d["head_k"],)),
                Expected(b + "ffn_norm.weight", (e,)), Expected(b + "ffn_gate.weight", (e, d["n_ff"])),
                Expected(b + "ffn_up.weight", (e, d["n_ff"])), Expected(b + "ffn_down.weight", (d["n_ff"], e)),
                Expected(b + "post_ffw_norm.weight", (e,))]
    return out


# Architectures whose token_embd/output rows are not the token count (llama.cpp src/models/*.cpp).
ROWS_NOT_VOCAB = ("eagle3", "qwen3vl", "wavtokenizer-dec")


def check_tensors(h: GGUFHeader, n_tokens: int | None) -> None:
    """Embedding/output rows match the vocabulary; the architecture's tensors are all there, in their shapes."""
    if not h.tensors:
        return  # a vocabulary-only file: llama.cpp loads it as such and refuses it for generation itself
    by_name = {t.name: t for t in h.tensors}
    embd = by_name.get("token_embd.weight")
    for name in ("token_embd.weight", "output.weight"):
        t = by_name.get(name)
        if h.arch in ROWS_NOT_VOCAB or t is None or n_tokens is None or len(t.shape) != 2:
            continue
        if t.shape[1] != n_tokens:
            raise ModelFileError(f"{name} has {t.shape[1]} rows but the vocabulary has {n_tokens} tokens "
                                 f"({h.path}); the file is inconsistent: {REDO}")
    n_vocab = n_tokens if n_tokens is not None else (embd.shape[1] if embd and len(embd.shape) == 2 else None)
    if n_vocab is None:
        return
    for x in expected_tensors(h, n_vocab) or ():
        t = by_name.get(x.name)
        if t is None:
            if x.required:
                raise ModelFileError(f"tensor {x.name} is missing ({h.path}); a {h.arch} model needs it: {REDO}")
            continue
        if tuple(t.shape) != x.shape:
            raise ModelFileError(f"tensor {x.name} has shape {list(t.shape)}, a {h.arch} model with these "
                                 f"hyper-parameters needs {list(x.shape)} ({h.path}); {REDO}")
