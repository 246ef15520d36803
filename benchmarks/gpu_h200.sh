#!/usr/bin/env bash
# One prepared GPU run for a lent H200 (NOT YET RUN ON A GPU: no machine was lent when it was written).
# Here first:  bash benchmarks/prepare_gpu_carry.sh
# Then the device call, from the repo root:  run(command="bash benchmarks/gpu_h200.sh", carry=[".gpu"], timeout_s=600)
# Stages, each with its own time limit so that results so far always come back under $OUT:
#   1. build llama-cpp-python for sm_90 only from the carried trimmed sdist (16 cores)
#   2. write a Qwen2.5-7B-shaped Q4_K target + 0.5B-shaped Q8_0 draft with random weights (~5 GB)
#   3. specq doctor / specq plan on the real device; 4. verify cost of 1..17 tokens and the draft's cost;
#   5. specq bench baseline vs speculative (full offload), and the target as its own draft (acceptance ~1).
set -uo pipefail
OUT=${OUT:-/tmp/specq-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
stage() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - T0) )); }  # seconds left of the device call
lim() { local s=$(( $(left) - $1 )); [ "$s" -lt 30 ] && s=30; echo "$s"; }  # a stage's limit, keeping $1 s back

stage "machine"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -1 || true
python3 --version

stage "1. build llama-cpp-python (CUDA, sm_90)"
mkdir -p /tmp/src /tmp/wheel
tar xzf .gpu/llama_cpp_python-*-trimmed.tar.gz -C /tmp/src
SRC=$(ls -d /tmp/src/llama_cpp_python-*)
# The image's python3 is itself a venv (with torch, numpy, scikit-build-core): install beside it, not into it.
export PYTHONPATH=/tmp/site:/tmp/pkgs PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DLLAVA_BUILD=OFF \
 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
tb=$(date +%s)
timeout 420 python3 -m pip wheel -v --no-deps --no-build-isolation --no-cache-dir -w /tmp/wheel "$SRC" > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - tb ))s (build.log: last lines below)"; tail -5 "$OUT/build.log"
[ $rc -eq 0 ] || { stage "build failed; stopping"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheel/llama_cpp_python-*.whl
LIB=$(python3 -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
ls -la "$LIB"
echo "sm_90 cubins in libggml-cuda: $(cuobjdump --list-elf "$LIB"/libggml-cuda.so 2>/dev/null | grep -c sm_90)"

# specq without installing: the repo root is the `specq` package.
mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/specq
SPECQ="python3 -m specq.cli.main"

stage "2. synthetic pair"
python3 benchmarks/synth_pair.py /tmp/pair --target 7b --draft 0.5b --target-quant q4_k --draft-quant q8_0
T=/tmp/pair/target-7b-q4_k.gguf; D=/tmp/pair/draft-0.5b-q8_0.gguf

stage "3. doctor and plan"
$SPECQ doctor --json > "$OUT/doctor.json"; $SPECQ doctor | tail -1
$SPECQ plan --target $T --draft $D --vram 0.9 --json > "$OUT/plan.json"; $SPECQ plan --target $T --draft $D --vram 0.9 -q

stage "4. verify cost"
timeout $(lim 150) python3 benchmarks/verify_cost.py --target $T --draft $D --ngl 999 --k 16 \
  --ctx 4096 --threads 8 --out "$OUT/verify.json"

stage "5. bench: baseline vs speculative, full offload"
timeout $(lim 60) $SPECQ bench --target $T --draft $D --ngl 999 --ngl-draft 999 --n-predict 256 \
  --repeat 3 --draft-max 8 --threads 8 --json "$OUT/bench.json" -q
stage "5b. the target as its own draft (acceptance near 1: the loop's cost at full acceptance)"
timeout $(lim 10) $SPECQ bench --target $T --draft $T --ngl 999 --ngl-draft 999 --n-predict 256 \
  --repeat 2 --draft-max 8 --threads 8 --no-baseline --json "$OUT/bench_self.json" -q

stage "summary"
python3 benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
