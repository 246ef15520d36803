"""Hugging Face transformers' cross-vocabulary assisted generation on a GGUF pair, for comparison with specq's.

Runs in a scratch venv outside the suite (the tests never import it; it does not import specq):

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch-2.13.0+cpu-*.whl  # a CPU-only torch wheel (the default one pulls CUDA)
    /tmp/hfvenv/bin/pip install transformers==5.20.2 gguf sentencepiece tokenizers protobuf numpy accelerate
    /tmp/hfvenv/bin/python benchmarks/hf_assisted.py --target T.gguf --assistant D.gguf [--temp 0.7] \\
        --n-predict 96 [--reference benchmarks/results/crossvocab-...json] --out benchmarks/results/hf-assisted-X.json

Both models and tokenizers load from the local GGUF files (`from_pretrained(dir, gguf_file=name)`, weights
dequantized to F32). Each prompt of the built-in "general" set (models/prompts/default.jsonl) runs as raw text
(the tokenizer adds BOS as its GGUF says), first with the target alone, then with
`generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)`: greedy runs transformers' string-level
path (AssistedCandidateGeneratorDifferentTokenizers: decode, re-encode, align), sampling its token-level one
(UniversalSpeculativeDecodingGenerator: vocabulary intersection, assistant head pruned to it, speculative
sampling). Every verification step's `update_candidate_strategy(input_ids, scores, num_matches)` is recorded:
drafted = scores.shape[1] - 1 (the candidate tokens the target verified, in target tokens), accepted =
num_matches. Also counted: target and assistant forward passes. --reference (a benchmarks/drafters.py JSON of
the same pair) compares prompt token counts and the target-alone tokens with llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import candidate_generator as cg

PROMPTS = Path(__file__).resolve().parent.parent / "models" / "prompts" / "default.jsonl"


def read_prompts(path: Path) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["name"] for r in rows], [r["prompt"] for r in rows]


def load(path: Path):
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers 5.20 leaves tokenizer.ggml.add_bos_token out (Gemma's is true); llama.cpp honours it
    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    tok.add_bos_token = bool(field.contents()) if field is not None else False
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


class Counter:
    """Forward passes of a model (a pre-hook) and, for the candidate generator, each verification step."""

    def __init__(self):
        self.steps: list[tuple[int, int]] = []
        self.classes: set[str] = set()
        self.forwards = {"target": 0, "assistant": 0}

    def hook(self, model, role: str) -> None:
        def pre(*_):
            self.forwards[role] += 1
        model.register_forward_pre_hook(pre)

    def patch(self, cls) -> None:
        original = cls.update_candidate_strategy
        counter = self

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            counter.classes.add(type(self).__name__)
            counter.steps.append((int(scores.shape[1]) - 1, int(num_matches)))
            return original(self, input_ids, scores, num_matches)
        cls.update_candidate_strategy = update_candidate_strategy

    def reset(self) -> None:
        self.steps.clear()
        self.forwards = dict.fromkeys(self.forwards, 0)


def run(target, ids, n_predict: int, temp: float, seed: int, counter: Counter, **assist) -> dict:
    sampling = {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0} if temp > 0 else {"do_sample": False}
    counter.reset()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.generate(ids, max_new_tokens=n_predict, **sampling, **assist)
    wall = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    drafted = sum(d for d, _ in counter.steps)
    accepted = sum(a for _, a in counter.steps)
    row = {"tokens": new, "n_new": len(new), "wall_s": round(wall, 3), "target_forwards": counter.forwards["target"]}
    if assist:
        row |= {"steps": len(counter.steps), "drafted": drafted, "accepted": accepted,
                "accept_rate": accepted / drafted if drafted else None,
                "assistant_forwards": counter.forwards["assistant"], "per_step": counter.steps[:]}
    return row


def reference(path: Path | None) -> dict:
    """llama.cpp's target-alone runs from a benchmarks/drafters.py JSON, by prompt name (first repeat)."""
    if path is None:
        return {}
    runs = json.loads(path.read_text())["sets"][0]["runs"]
    return {r["prompt_name"]: r for r in runs if r["drafter"] == "baseline" and r["repeat"] == 0}


def assistant_schedule(assistant, fixed: int | None) -> dict:
    cfg = assistant.generation_config
    if fixed is not None:
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = fixed, "constant"
        cfg.assistant_confidence_threshold = 0.0
    defaults = cfg._get_default_generation_params()  # what the candidate generator fills in for unset fields
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
            "assistant_lookbehind", "target_lookbehind")
    return {k: defaults.get(k) if getattr(cfg, k) is None else getattr(cfg, k) for k in keys}


def totals(rows: list[dict]) -> dict:
    failed = [r["prompt_name"] for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    a = [r["assisted"] for r in rows]
    s = {k: sum(x[k] for x in a) for k in ("drafted", "accepted", "steps", "n_new", "target_forwards",
                                            "assistant_forwards", "wall_s")}
    s["accept_rate"] = s["accepted"] / s["drafted"] if s["drafted"] else None
    s["alone_n_new"] = sum(r["alone"]["n_new"] for r in rows)
    s["alone_target_forwards"] = sum(r["alone"]["target_forwards"] for r in rows)
    s["alone_wall_s"] = round(sum(r["alone"]["wall_s"] for r in rows), 3)
    s["identical_to_alone"] = sum(bool(r["identical_to_alone"]) for r in rows)
    s["prompts_counted"], s["prompts_failed"] = len(rows), failed
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--assistant", type=Path, required=True)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-predict", type=int, default=96)
    ap.add_argument("--num-assistant-tokens", type=int, help="fixed draft length (constant, confidence 0)")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--limit-prompts", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", type=Path, help="a drafters.py JSON of the same pair (llama.cpp)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names, prompts = read_prompts(a.prompts)
    names, prompts = names[:a.limit_prompts], prompts[:a.limit_prompts]
    ttok, target = load(a.target)
    atok, assistant = load(a.assistant)
    schedule = assistant_schedule(assistant, a.num_assistant_tokens)
    counter = Counter()
    counter.hook(target, "target")
    counter.hook(assistant, "assistant")
    cls = cg.UniversalSpeculativeDecodingGenerator if a.temp > 0 else cg.AssistedCandidateGeneratorDifferentTokenizers
    counter.patch(cls)
    ref = reference(a.reference)
    rows = []
    for name, prompt in zip(names, prompts):
        ids = ttok(prompt, return_tensors="pt").input_ids
        alone = run(target, ids, a.n_predict, a.temp, a.seed, counter)
        try:
            assisted = run(target, ids, a.n_predict, a.temp, a.seed, counter, assistant_model=assistant,
                           tokenizer=ttok, assistant_tokenizer=atok)
        except RuntimeError as e:  # kept in the JSON, left out of the totals
            rows.append({"prompt_name": name, "n_prompt": ids.shape[1], "alone": alone, "error": repr(e)})
            print(f"{name:10s} assisted generation failed: {e!r}", file=sys.stderr, flush=True)
            continue
        row = {"prompt_name": name, "n_prompt": ids.shape[1], "alone": alone, "assisted": assisted,
               "identical_to_alone": alone["tokens"] == assisted["tokens"],
               "text_alone": ttok.decode(alone["tokens"]), "text_assisted": ttok.decode(assisted["tokens"])}
        if name in ref:
            r = ref[name]
            row["llamacpp"] = {"n_prompt": r["n_prompt"], "alone_tokens_equal": r["tokens"] == alone["tokens"],
                               "common_prefix": next((i for i, (x, y) in enumerate(zip(r["tokens"], alone["tokens"]))
                                                      if x != y), min(len(r["tokens"]), len(alone["tokens"])))}
        rows.append(row)
        print(f"{name:10s} n_prompt {row['n_prompt']:4d}  accepted {assisted['accepted']}/{assisted['drafted']}"
              f"  target fwd {assisted['target_forwards']} (alone {alone['target_forwards']})"
              f"  identical {row['identical_to_alone']}  {assisted['wall_s']:.1f}s (alone {alone['wall_s']:.1f}s)",
              file=sys.stderr, flush=True)
    result = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "target": a.target.name,
              "assistant": a.assistant.name, "temp": a.temp, "seed": a.seed, "n_predict": a.n_predict,
              "generator_classes": sorted(counter.classes), "assistant_schedule": schedule, "threads": a.threads,
              "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                           "python": platform.python_version()},
              "totals": totals(rows), "prompts": rows}
    print(json.dumps(result["totals"]), flush=True)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
