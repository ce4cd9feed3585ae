#!/usr/bin/env bash
# Run a command with a throw-away redis-server (127.0.0.1, a free port, no persistence) whose address is in
# KVCONN_REDIS_URL (the redis connector's default server); the server is stopped by its PID afterwards.
# Without redis-server installed, the command runs with the redis connector disabled (and says so).
set -euo pipefail
if ! command -v redis-server >/dev/null; then
  echo "with-redis-server: redis-server is not installed (scripts/install-system-deps.sh); redis is left out" >&2
  KVCONN_DISABLE_PLUGINS="${KVCONN_DISABLE_PLUGINS:+$KVCONN_DISABLE_PLUGINS,}redis" exec "$@"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no >/dev/null 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
KVCONN_REDIS_URL="redis://127.0.0.1:$port/0" "$@"
