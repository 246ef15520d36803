"""Conversion throughput and peak RSS for a ~200 MB and a >= 2 GB synthetic BF16 checkpoint.

Usage: python benchmarks/convert_rss.py [--quant Q8_0] [--arch llama|qwen35] [--workdir DIR]

Each conversion runs in its own child process; its peak RSS is the child's ru_maxrss (os.wait4).
The two checkpoints share width and vocabulary (so the largest tensor is the same) and differ in
depth; a streaming writer must show the same peak RSS for both. Files are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

WIDTH, FF, HEADS, VOCAB = 2048, 5632, 16, 32000
SIZES = {"small": 1, "large": 20}  # layers: ~0.23 GB and ~2.2 GB (2085 MiB) of BF16 weights
# qwen35 (Gated DeltaNet + a full-attention layer every 4th + one MTP block), same width and vocabulary:
# 16 key / 32 value linear heads of 128 (the value heads are reordered while streaming), 4 KV heads of 128.
QWEN35_SIZES = {"small": 4, "large": 16}  # ~0.7 GB and ~2.5 GB of BF16 weights
LIN_K, LIN_V, LIN_D, KV_HEADS = 16, 32, 128, 4


def qwen35_shapes(n_layer: int) -> tuple[dict, dict]:
    """(config.json, tensor shapes) of a synthetic Qwen3_5ForCausalLM."""
    cfg = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": WIDTH, "intermediate_size": FF,
           "num_hidden_layers": n_layer, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": WIDTH // HEADS, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
           "vocab_size": VOCAB, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": LIN_D, "linear_value_head_dim": LIN_D,
           "linear_num_key_heads": LIN_K, "linear_num_value_heads": LIN_V, "full_attention_interval": 4,
           "mtp_num_hidden_layers": 1}
    hd, key, value = WIDTH // HEADS, LIN_K * LIN_D, LIN_V * LIN_D
    shapes = {"model.embed_tokens.weight": (VOCAB, WIDTH), "model.norm.weight": (WIDTH,)}

    def layer(p: str, linear: bool) -> dict:
        s = {p + "input_layernorm.weight": (WIDTH,), p + "post_attention_layernorm.weight": (WIDTH,),
             p + "mlp.gate_proj.weight": (FF, WIDTH), p + "mlp.up_proj.weight": (FF, WIDTH),
             p + "mlp.down_proj.weight": (WIDTH, FF)}
        if linear:
            a = p + "linear_attn."
            s |= {a + "in_proj_qkv.weight": (2 * key + value, WIDTH), a + "in_proj_z.weight": (value, WIDTH),
                  a + "in_proj_a.weight": (LIN_V, WIDTH), a + "in_proj_b.weight": (LIN_V, WIDTH),
                  a + "conv1d.weight": (2 * key + value, 1, 4), a + "dt_bias": (LIN_V,), a + "A_log": (LIN_V,),
                  a + "norm.weight": (LIN_D,), a + "out_proj.weight": (WIDTH, value)}
        else:
            a = p + "self_attn."
            s |= {a + "q_proj.weight": (2 * HEADS * hd, WIDTH), a + "k_proj.weight": (KV_HEADS * hd, WIDTH),
                  a + "v_proj.weight": (KV_HEADS * hd, WIDTH), a + "o_proj.weight": (WIDTH, HEADS * hd),
                  a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        return s

    for i in range(n_layer):
        shapes |= layer(f"model.layers.{i}.", (i + 1) % 4 != 0)
    shapes |= {"mtp.fc.weight": (WIDTH, 2 * WIDTH), "mtp.pre_fc_norm_embedding.weight": (WIDTH,),
               "mtp.pre_fc_norm_hidden.weight": (WIDTH,), "mtp.norm.weight": (WIDTH,)}
    shapes |= layer("mtp.layers.0.", False)
    return cfg, shapes


def tokenizer_json() -> dict:
    """A minimal byte-level BPE (256 byte tokens, one merge) with Qwen2's pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): i for i, c in enumerate(cs)}
    vocab["ĠĠ"] = 256
    regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    return {
        "version": "1.0", "added_tokens": [{"id": 257, "content": "<|endoftext|>", "special": True,
                                            "single_word": False, "lstrip": False, "rstrip": False,
                                            "normalized": False}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["Ġ Ġ"], "byte_fallback": False},
    }


def write_checkpoint(d: Path, n_layer: int, arch: str = "llama") -> int:
    """Write config, tokenizer and model.safetensors tensor by tensor; returns the weight bytes."""
    d.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": WIDTH, "intermediate_size": FF,
           "num_hidden_layers": n_layer, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": VOCAB,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    shapes = {"model.embed_tokens.weight": (VOCAB, WIDTH), "model.norm.weight": (WIDTH,)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (WIDTH,), p + "post_attention_layernorm.weight": (WIDTH,),
                   p + "self_attn.q_proj.weight": (WIDTH, WIDTH), p + "self_attn.k_proj.weight": (WIDTH, WIDTH),
                   p + "self_attn.v_proj.weight": (WIDTH, WIDTH), p + "self_attn.o_proj.weight": (WIDTH, WIDTH),
                   p + "mlp.gate_proj.weight": (FF, WIDTH), p + "mlp.up_proj.weight": (FF, WIDTH),
                   p + "mlp.down_proj.weight": (WIDTH, FF)}
    if arch == "qwen35":
        cfg, shapes = qwen35_shapes(n_layer)
        (d / "config.json").write_text(json.dumps(cfg))
    header, off = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 20, dtype=np.float32) * 0.02).view(np.uint32) >> 16  # 1 Mi BF16 values
    block = block.astype(np.uint16).tobytes()
    with (d / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name, shape in shapes.items():
            left = int(np.prod(shape)) * 2
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    return off


CHILD = """
import sys, time
from specq.convert.pipeline import convert_pair
t0 = time.perf_counter()
convert_pair(sys.argv[1], sys.argv[2], quant=None if sys.argv[3] == "none" else sys.argv[3], threads=0)
print(time.perf_counter() - t0)
"""


def run_child(args: list[str]) -> tuple[float, int]:
    """(seconds reported by the child, peak RSS in bytes)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"conversion failed ({p.returncode}): {err.decode()[-2000:]}")
    return float(out.decode().strip().splitlines()[-1]), ru.ru_maxrss * 1024


def baseline_rss() -> int:
    p = subprocess.Popen([sys.executable, "-c", "import specq.convert.pipeline"])
    _, _, ru = os.wait4(p.pid, 0)
    return ru.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="none", help="also quantize (e.g. Q8_0); default: write BF16 only")
    ap.add_argument("--arch", default="llama", choices=("llama", "qwen35"))
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specq-convert-bench-", dir=a.workdir))
    need = 2.7e9 * (2 + (1 if a.quant != "none" else 0)) + 0.5e9
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"not enough free disk in {work}: need {need / 1e9:.1f} GB, have {free / 1e9:.1f} GB")
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "arch": a.arch, "quant": a.quant, "baseline_import_rss_mb": round(baseline_rss() / 2**20, 1), "runs": []}
    try:
        for label, n_layer in (QWEN35_SIZES if a.arch == "qwen35" else SIZES).items():
            src = work / f"src-{label}"
            weight_bytes = write_checkpoint(src, n_layer, a.arch)
            secs, rss = run_child([str(src), str(work / f"out-{label}"), a.quant])
            out_bytes = sum(f.stat().st_size for f in (work / f"out-{label}").glob("*.gguf"))
            results["runs"].append({
                "checkpoint": label, "n_layer": n_layer, "weights_mb": round(weight_bytes / 2**20, 1),
                "largest_tensor_mb": round(VOCAB * WIDTH * 2 / 2**20, 1), "output_mb": round(out_bytes / 2**20, 1),
                "seconds": round(secs, 2), "mb_per_s": round(weight_bytes / 2**20 / secs, 1),
                "peak_rss_mb": round(rss / 2**20, 1)})
            shutil.rmtree(src)
            shutil.rmtree(work / f"out-{label}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
