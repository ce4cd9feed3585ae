#!/usr/bin/env bash
# A CPU-only venv with vLLM 0.33.0's scheduler (scripts/install-vllm-venv.sh scheduler) plus LMCache 0.5.6, to
# validate LMCache's multi-process connector against its own server (docs/vllm.md, "LMCache").
# LMCache goes in without its dependency list (it names CUDA wheels: cupy, cufile, nvtx); what follows is what
# importing its MP server and its vLLM connector needs on this CPU, pinned inside LMCache's own ranges.
# Usage: scripts/install-lmcache-venv.sh [VENV_PATH]   (default <repo>/.venv-lmcache; $TORCH as for install-vllm-venv)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-lmcache}"
PY="$VENV/bin/python"
CHECK="import lmcache.v1.multiprocess.http_server, lmcache.integration.vllm.lmcache_mp_connector, kvconn_vllm"

if [ -x "$PY" ] && "$PY" -c "$CHECK" >/dev/null 2>&1; then
    echo "LMCache already importable in $VENV; nothing to do"
    exit 0
fi

"$REPO_ROOT/scripts/install-vllm-venv.sh" scheduler "$VENV"
"$PY" -m pip install --quiet --no-deps "lmcache==0.5.6"
"$PY" -m pip install --quiet "${TORCH:-torch==2.13.0}" \
    "numpy==2.2.6" "numba==0.65.0" "prometheus_client==0.24.1" \
    "opentelemetry-api==1.40.0" "opentelemetry-sdk==1.40.0" "opentelemetry-exporter-prometheus==0.61b0" \
    "httpx==0.29.0" "uvicorn==0.55.0" "sortedcontainers==2.4.0" "cryptography==51.0.1" "blake3==1.0.11"
# kvconn itself, from this checkout (its CLI, the vLLM adapter and its conformance driver's entry point).
"$PY" -m pip install --quiet -e "$REPO_ROOT/sdk" -e "$REPO_ROOT/cli" -e "$REPO_ROOT/adapters/vllm"
"$PY" -c "$CHECK; import lmcache; print('lmcache', lmcache.__version__, 'installed in $VENV')"
