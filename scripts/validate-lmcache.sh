#!/usr/bin/env bash
# Start LMCache's multi-process server on 127.0.0.1 (free ports), validate its vLLM connector through
# `kvconn validate --engine vllm --vllm-connector LMCacheMPConnector`, stop the server. Extra arguments go to
# kvconn validate (e.g. --check 'KV04*' --json). The server's log: $LMCACHE_LOG (default a temporary file).
# Usage: scripts/validate-lmcache.sh [VENV_PATH] [-- kvconn validate arguments...]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv-lmcache"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then VENV="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
PY="$VENV/bin/python"
LOG="${LMCACHE_LOG:-$(mktemp -t lmcache-server.XXXXXX.log)}"
read -r ZMQ_PORT HTTP_PORT < <("$PY" -c "
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in socks))")

export LMCACHE_DISABLE_BANNER=1
# --supported-transfer-mode auto: the server serves both transfer modes (its default, lmcache_driven, lacks the
# engine-driven handlers a CPU worker picks under the connector's own default, mp_transfer_mode=auto).
"$PY" -m lmcache.v1.multiprocess.http_server --host 127.0.0.1 --port "$ZMQ_PORT" \
    --http-host 127.0.0.1 --http-port "$HTTP_PORT" --l1-size-gb 1 --eviction-policy LRU \
    --supported-transfer-mode auto --disable-observability >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    grep -q "Application startup complete" "$LOG" && break
    kill -0 "$SERVER" 2>/dev/null || { echo "LMCache's server exited; its log ($LOG):" >&2; tail -20 "$LOG" >&2; exit 1; }
    sleep 1
done
grep -q "Application startup complete" "$LOG" || { echo "LMCache's server did not start in 120 s ($LOG)" >&2; exit 1; }

CONFIG="{\"lmcache.mp.host\": \"tcp://127.0.0.1\", \"lmcache.mp.port\": $ZMQ_PORT, \"lmcache.mp.mq_timeout\": 30, \"lmcache.mp.mp_transfer_mode\": \"${LMCACHE_TRANSFER_MODE:-lmcache_driven}\"}"
"$VENV/bin/kvconn" validate --engine vllm --vllm-connector LMCacheMPConnector --config "$CONFIG" "$@"
