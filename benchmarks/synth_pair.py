"""Write a large-shaped target + draft GGUF pair with random weights, fast, for GPU speed measurements.

Random weights measure what they can measure honestly: tokens/s, the verify cost of 1..k+1 tokens and the
draft cost (acceptance on random weights means nothing). Quantized blocks are written directly: a pool of
random blocks with valid fp16 scales, calibrated with gguf's dequantizer to a 1/sqrt(n_in) spread, is tiled
over each tensor, so an 8B-class Q4_K target is written at disk speed without running a quantizer.

    python benchmarks/synth_pair.py OUTDIR [--target 7b] [--draft 0.5b] [--target-quant q4_k] [--draft-quant q8_0]

Both models share one byte-level BPE vocabulary padded to the shape's vocab size; the EOS row of output.weight
is zero so greedy decoding never stops early.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int = 32768


# Qwen2.5-7B and -0.5B shapes (llama architecture, no biases); "tiny-*" for a CPU check of this script.
SHAPES = {
    "7b": Shape(28, 3584, 28, 4, 18944, 152064),
    "0.5b": Shape(24, 896, 14, 2, 4864, 152064),
    "tiny-target": Shape(2, 256, 4, 2, 512, 1024, 4096),
    "tiny-draft": Shape(1, 128, 4, 2, 256, 1024, 4096),
}
QUANTS = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0, "f16": Q.F16}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
POOL_BLOCKS = 8192


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable characters for the 256 byte values, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = {b: chr(b) for b in bs}, 0
    for b in range(256):
        if b not in cs:
            cs[b] = chr(256 + n)
            n += 1
    return [cs[b] for b in range(256)]


def vocabulary(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials, the 256 byte tokens, a few merges, padding to n_vocab."""
    chars = bytes_to_unicode()
    sp = chars[ord(" ")]
    pairs = [(sp, "t"), ("h", "e"), ("i", "n"), (sp, "a"), ("e", "r"), (sp, "s"), ("o", "n"), ("r", "e")]
    tokens = SPECIALS + chars + [a + b for a, b in pairs]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    if n_vocab < len(tokens):
        raise SystemExit(f"vocab {n_vocab} is smaller than the {len(tokens)} base tokens")
    pad = n_vocab - len(tokens)
    return (tokens + [f"[PAD{i}]" for i in range(pad)], types + [gguf.TokenType.UNUSED] * pad,
            [f"{a} {b}" for a, b in pairs])


def _raw_pool(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with unit fp16 scales (d = 1; Q4_K's dmin = 7.5 so the values centre on zero)."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    pool = rng.integers(0, 256, size=(POOL_BLOCKS, size), dtype=np.uint8)
    one, dmin = np.array([1.0], np.float16).view(np.uint8), np.array([7.5], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        pool[:, 0:2], pool[:, 2:4] = one, dmin
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16] (int8), d
        pool[:, 208:210] = one
    elif qtype == Q.Q8_0:  # d, qs[32] (int8)
        pool[:, 0:2] = one
    return pool


def block_pool(qtype: Q, std: float, rng: np.random.Generator) -> np.ndarray:
    """A pool of blocks (or F16 values as bytes) whose dequantized values have the given spread."""
    if qtype == Q.F16:
        return (rng.standard_normal(POOL_BLOCKS * 256) * std).astype(np.float16).view(np.uint8).reshape(POOL_BLOCKS, 512)
    pool = _raw_pool(qtype, rng)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    unit = gguf.quants.dequantize(pool.reshape(-1), qtype)
    scale = std / float(np.std(unit))
    # Scale the fp16 d (and dmin) fields; the quantized integers stay as drawn.
    fields = {Q.Q4_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)], Q.Q8_0: [(0, 2)]}[qtype]
    for a, b in fields:
        d = pool[:, a:b].copy().view(np.float16).astype(np.float32) * scale
        pool[:, a:b] = d.astype(np.float16).view(np.uint8)
    vals = gguf.quants.dequantize(pool.reshape(-1), qtype)
    if not np.all(np.isfinite(vals)):
        raise SystemExit(f"non-finite values in the {qtype.name} pool")
    return pool


def tensor_bytes(pool: np.ndarray, qtype: Q, rows: int, cols: int, rng: np.random.Generator,
                 zero_rows: tuple[int, ...] = ()) -> np.ndarray:
    """rows × cols weights (ggml: ne0 = cols) as raw bytes, tiled from the pool at a random offset."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == Q.F16:
        flat = pool.reshape(-1)
        n = rows * cols * 2
        reps = -(-n // flat.size) + 1
        start = int(rng.integers(0, flat.size // 2)) * 2
        data = np.tile(flat, reps)[start:start + n].reshape(rows, cols * 2)
    else:
        if cols % block:
            raise SystemExit(f"{cols} columns are not a multiple of {qtype.name}'s block of {block}")
        nb = rows * cols // block
        reps = -(-nb // len(pool)) + 1
        start = int(rng.integers(0, len(pool)))
        data = np.tile(pool, (reps, 1))[start:start + nb].reshape(rows, cols // block * size)
    data = np.ascontiguousarray(data)
    for r in zero_rows:
        data[r] = 0
    return data


def write_model(path: Path, shape: Shape, quant: str, seed: int) -> dict:
    """Write one llama-architecture GGUF with random weights; returns a small description."""
    qtype = QUANTS[quant]
    out_q = Q.Q6_K if qtype == Q.Q4_K else qtype  # as in Q4_K_M: the output matrix one step up
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary(shape.n_vocab)
    hd = shape.n_embd // shape.n_head
    kv = hd * shape.n_head_kv

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"specq-synthetic-{path.stem}")
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(1e6)
    w.add_file_type({Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M, Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
                     Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.F16: gguf.LlamaFileType.MOSTLY_F16}[qtype])
    w.add_vocab_size(shape.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    # (name, rows, cols, type, zero rows); norms are F32 ones.
    mats = [("token_embd.weight", shape.n_vocab, shape.n_embd, qtype, ())]
    for i in range(shape.n_layer):
        mats += [(f"blk.{i}.attn_q.weight", shape.n_embd, shape.n_embd, qtype, ()),
                 (f"blk.{i}.attn_k.weight", kv, shape.n_embd, qtype, ()),
                 (f"blk.{i}.attn_v.weight", kv, shape.n_embd, qtype, ()),
                 (f"blk.{i}.attn_output.weight", shape.n_embd, shape.n_embd, qtype, ()),
                 (f"blk.{i}.ffn_gate.weight", shape.n_ff, shape.n_embd, qtype, ()),
                 (f"blk.{i}.ffn_up.weight", shape.n_ff, shape.n_embd, qtype, ()),
                 (f"blk.{i}.ffn_down.weight", shape.n_embd, shape.n_ff, qtype, ())]
    mats.append(("output.weight", shape.n_vocab, shape.n_embd, out_q, (0,)))  # row 0 = EOS: logit 0, never top
    norms = [f"blk.{i}.{n}.weight" for i in range(shape.n_layer) for n in ("attn_norm", "ffn_norm")]
    norms.append("output_norm.weight")

    def nbytes(rows, cols, qt):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        return rows * cols // block * size

    for name, rows, cols, qt, _ in mats:
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), nbytes(rows, cols, qt), raw_dtype=qt)
    for name in norms:
        w.add_tensor_info(name, (shape.n_embd,), np.dtype(np.float32), 4 * shape.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pools: dict[tuple[Q, int], np.ndarray] = {}
    total = 0
    for name, rows, cols, qt, zero in mats:
        std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(cols)
        key = (qt, int(std * 1e6))
        if key not in pools:
            pools[key] = block_pool(qt, std, rng)
        data = tensor_bytes(pools[key], qt, rows, cols, rng, zero)
        w.write_tensor_data(data)
        total += data.nbytes
    ones = np.ones(shape.n_embd, np.float32)
    for _ in norms:
        w.write_tensor_data(ones)
        total += ones.nbytes
    w.close()
    return {"path": str(path), "shape": asdict(shape), "quant": quant, "bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--target", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--draft", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--target-quant", default="q4_k", choices=sorted(QUANTS))
    ap.add_argument("--draft-quant", default="q8_0", choices=sorted(QUANTS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    if SHAPES[a.target].n_vocab != SHAPES[a.draft].n_vocab:
        raise SystemExit("target and draft shapes must share a vocabulary size")
    info = {}
    for role, shape, quant, seed in (("target", a.target, a.target_quant, a.seed),
                                     ("draft", a.draft, a.draft_quant, a.seed + 1)):
        t0 = time.perf_counter()
        info[role] = write_model(a.outdir / f"{role}-{shape}-{quant}.gguf", SHAPES[shape], quant, seed)
        info[role]["write_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
