#!/usr/bin/env bash
# Debian packages the test suite needs: the Mooncake wheel's libraries
# (libibverbs1, librdmacm1), iproute2 for the network namespaces the
# Mooncake tests create, and redis-server for the kvconn-redis tests. Installs only what is missing; needs root for that.
set -euo pipefail
missing=()
for pkg in libibverbs1 librdmacm1 iproute2 util-linux redis-server; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: missing ${missing[*]}; run as root or install them (the Mooncake and Redis tests will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
