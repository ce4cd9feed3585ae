#!/usr/bin/env bash
# The offload connector's CUDA path, in one run of a few minutes on a machine with a GPU (run it first there):
#   1. correctness against CUDA KV caches: pinned pool, copies on a side stream ordered after compute by events,
#      no device block overwritten while a store still reads it, and the reference engine's outputs unchanged
#      (the CUDA tests of plugins/offload; they skip without CUDA, so here a skip is a failure);
#   2. benchmarks/suite/offload_bandwidth.py --device cuda: the worker hooks' pinned D2H (save) / H2D (load) bandwidth
#      against torch's own pinned copy_ of the same bytes, side by side (target >= 0.9);
#   3. benchmarks/suite/vllm_e2e.py --device cuda: time to first token on evicted turns in a full vLLM engine on the GPU,
#      no connector / fit / offload / ExampleConnector side by side, the physical limit a pinned host-to-GPU copy.
#      Needs a CUDA build of vLLM: KVCONN_VLLM_PYTHON names its interpreter; without it this part is skipped
#      (said, not failed: parts 1 and 2 need only torch).
#   4. scripts/sglang_gpu_check.py: an sglang.Engine with HiCache whose L3 is kvconn's SGLang tier over Redis,
#      multi-turn chats whose history left the device and host tiers, tokens compared with HiCache without L3,
#      the pages L3 served counted. Needs a CUDA build of SGLang: KVCONN_SGLANG_PYTHON names its interpreter
#      (with kvconn-sdk, kvconn-sglang and kvconn-redis installed); without it this part is skipped (said).
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default: a new temporary directory; PYTHON=... picks the interpreter,
# default .venv/bin/python). Each part has its own time limit: parts 1-2 end within 5 minutes, parts 3 and 4 within 10 each.
# Needs a CUDA build of torch with the repository's packages installed (make install, then a CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA device: $PYTHON has no torch, a CPU-only torch, or sees no GPU" \
    "(torch.cuda.is_available() is False). Run this on a machine with an NVIDIA GPU and a CUDA build of torch;" \
    "the CPU paths are covered by 'make pytest'." >&2
  exit 2
fi
if [ -z "$OUT" ]; then OUT=$(mktemp -d -t kvconn-gpu-check.XXXXXX); fi
mkdir -p "$OUT"
"$PYTHON" -c 'import torch; print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")'
echo "== 1/4 correctness of offload against CUDA KV caches"
timeout 120 "$PYTHON" -m pytest -q -rs -p no:cacheprovider -k cuda \
  plugins/offload/tests/test_units.py plugins/offload/tests/test_engine.py \
  | tee "$OUT/correctness.txt"
if grep -q "SKIPPED" "$OUT/correctness.txt"; then
  echo "gpu-check: a CUDA test skipped although CUDA is available: see $OUT/correctness.txt" >&2
  exit 1
fi
echo "== 2/4 pinned bandwidth of the worker hooks vs torch's pinned copy_"
timeout 150 "$PYTHON" benchmarks/suite/offload_bandwidth.py --device cuda --json "$OUT/offload_bandwidth_cuda.json" \
  | tee "$OUT/offload_bandwidth_cuda.txt"
echo "== 3/4 vLLM end to end on the GPU"
if [ -z "${KVCONN_VLLM_PYTHON:-}" ]; then
  echo "gpu-check: part 3 skipped: KVCONN_VLLM_PYTHON names no interpreter with a CUDA build of vLLM"
else
  timeout 600 "$PYTHON" benchmarks/suite/vllm_e2e.py --device cuda --python "$KVCONN_VLLM_PYTHON" \
    --configs none,fit,bare,offload,example --json "$OUT/vllm_e2e_cuda.json" | tee "$OUT/vllm_e2e_cuda.txt"
fi
echo "== 4/4 SGLang on the GPU: HiCache with kvconn's storage tier (Redis) against HiCache without L3"
if [ -z "${KVCONN_SGLANG_PYTHON:-}" ]; then
  echo "gpu-check: part 4 skipped: KVCONN_SGLANG_PYTHON names no interpreter with a CUDA build of SGLang"
else
  timeout 600 scripts/with-redis-server.sh "$KVCONN_SGLANG_PYTHON" scripts/sglang_gpu_check.py \
    | tee "$OUT/sglang_gpu.txt"
fi
echo "gpu-check: done; figures in $OUT/ (record them in benchmarks/RESULTS.md with this command)"
