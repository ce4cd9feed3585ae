#!/usr/bin/env bash
# Hard-link identical files across this repository's virtualenvs. `make test` builds five of them, each with its
# own copy of torch (750 MB) and two with triton (1 GB): linking saves about 4.8 GB of the 12 GB, so CI fits a
# smaller disk. Safe because pip and Python never write into an installed file: they unlink and replace it,
# which leaves the other venvs' link untouched. Incremental: a second run over linked venvs takes seconds.
# Usage: scripts/share-venv-files.sh VENV...     (venvs that do not exist yet are left out)
set -euo pipefail

if ! command -v hardlink >/dev/null; then
    echo "share-venv-files: no 'hardlink' (Debian's util-linux); each venv keeps its own copies" >&2
    exit 0
fi
existing=()
for venv in "$@"; do
    [ -d "$venv" ] && existing+=("$venv")
done
# --ignore-time: pip stamps each file with its install time, so equal files differ only in mtime.
[ "${#existing[@]}" -gt 1 ] && hardlink --ignore-time --quiet "${existing[@]}"
exit 0
