"""Write a synthetic deep hybrid pair: a qwen35 (Gated DeltaNet) target several times its draft's cost,
with the draft close to the target.

The draft is a random-weight qwen35 model of `--draft-layers` layers. The target has the same embeddings,
output head and the first `--draft-layers` layers (copied), then `--target-layers - --draft-layers` more layers
whose writes to the residual stream (ffn_down, ssm_out, attn_output) are scaled by `--eps`: the target costs
what its depth costs, and its greedy choice mostly agrees with the draft's. Both keep every 4th layer full
attention, so the target's recurrent state and KV cache grow with its depth. The EOS row of the output head is
zero so that greedy decoding does not stop early. F32, the tiny test vocabulary (byte-level BPE).

    python benchmarks/hybrid_pair.py OUTDIR [--target-layers 24] [--draft-layers 4] [--eps 0.05]

Acceptance on random weights says only how close the two models were made; the point is the cost of rollback
and verify on a hybrid target at a depth ratio like a real pair's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tinymodels import TinyQwen35Spec, qwen35_weights, vocab, write_qwen35_weights  # noqa: E402

# wide enough that the weights, not Python, dominate a token's cost on a CPU
WIDE = TinyQwen35Spec(n_layer=24, n_embd=512, n_ff=1536, n_ctx=8192, n_head=8, n_head_kv=2, head_dim=64, n_rot=16,
                      rope_sections=(4, 2, 2, 0), linear_k_heads=4, linear_v_heads=8, linear_head_dim=64)
WRITES = ("ffn_down.weight", "ssm_out.weight", "attn_output.weight")


def write_pair(out: Path, target_layers: int, draft_layers: int, eps: float, seed: int = 0) -> dict:
    if draft_layers % WIDE.full_attention_interval or target_layers <= draft_layers:
        sys.exit("draft layers must be a multiple of 4 (one full-attention layer per 4) and fewer than the target's")
    out.mkdir(parents=True, exist_ok=True)
    t_spec, d_spec = replace(WIDE, n_layer=target_layers), replace(WIDE, n_layer=draft_layers)
    n_vocab = len(vocab(WIDE.n_merges)[0])
    w = qwen35_weights(t_spec, n_vocab, seed, with_mtp=False)
    w["output.weight"][:3] = 0.0  # the special tokens (EOS, <|im_start|>, <|im_end|>) never win a greedy step
    for k in w:
        if k.startswith("blk.") and int(k.split(".")[1]) >= draft_layers and k.endswith(WRITES):
            w[k] = w[k] * np.float32(eps)
    draft_w = {k: v for k, v in w.items() if not k.startswith("blk.") or int(k.split(".")[1]) < draft_layers}
    target = write_qwen35_weights(out / f"hybrid-target-{target_layers}L.gguf", t_spec, w,
                                  name=f"specq-hybrid-target-{target_layers}L")
    draft = write_qwen35_weights(out / f"hybrid-draft-{draft_layers}L.gguf", d_spec, draft_w,
                                 name=f"specq-hybrid-draft-{draft_layers}L")
    info = {"target": str(target), "draft": str(draft), "eps": eps, "seed": seed,
            "target_spec": asdict(t_spec), "draft_spec": asdict(d_spec),
            "target_bytes": target.stat().st_size, "draft_bytes": draft.stat().st_size}
    (out / "hybrid-pair.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--target-layers", type=int, default=24)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    info = write_pair(a.out, a.target_layers, a.draft_layers, a.eps, a.seed)
    print(f"{info['target']} ({info['target_bytes'] / 2**20:.0f} MiB)\n{info['draft']} ({info['draft_bytes'] / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
