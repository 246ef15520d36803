#!/usr/bin/env bash
# The MTP measurement, prepared for a GPU machine with a real MTP model (NOT RUN: no model with MTP heads can be
# downloaded on the dev machines, and the tiny test fixtures' random weights make any speed-up meaningless).
# Needs specq with a CUDA build of llama-cpp-python (docs/gpu.md) and, as files on that machine:
#   TARGET  a target GGUF converted with its MTP layers, e.g. Qwen3.6-27B at Q4_K_M (llama.cpp arch qwen35,
#           qwen35.nextn_predict_layers = 1; `specq convert` keeps them, llama.cpp's convert_hf_to_gguf.py too)
#   DRAFT   optional: a same-family small draft, e.g. Qwen3.5-0.8B at Q8_0 (adds model, model,ngram to the modes)
# Usage:  TARGET=/models/qwen3.6-27b.Q4_K_M.gguf DRAFT=/models/qwen3.5-0.8b.Q8_0.gguf GPU=rtx4090 \
#           bash benchmarks/drafters_gpu.sh
# Writes benchmarks/results/drafters-mtp-$GPU.json: tokens/s of the target alone, ngram, mtp, mtp,ngram, auto (and
# model, model,ngram with a draft) on the general and the copy-heavy prompt sets, medians of 3 alternating runs.
set -euo pipefail
: "${TARGET:?set TARGET to a GGUF with MTP layers}"
GPU=${GPU:-gpu}
python3 -m specq.cli.main doctor
# --drafter mtp refuses a target without MTP layers in one line: check before the long run
python3 -m specq.cli.main bench --target "$TARGET" --drafter mtp --n-predict 32 --ngl 99 -q
args=(--target "$TARGET" --ngl 99 --ngl-draft 99 --n-predict 256 --repeat 3
      --out "benchmarks/results/drafters-mtp-$GPU.json")
if [ -n "${DRAFT:-}" ]; then args+=(--draft "$DRAFT"); else args+=(--no-draft); fi
python3 benchmarks/drafters.py "${args[@]}"
