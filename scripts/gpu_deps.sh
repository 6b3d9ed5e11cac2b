#!/usr/bin/env bash
# The server's pure-python dependencies that the lent GPU machine's image lacks (it has no network),
# unpacked into .gpu_deps/ (gitignored) for `run`'s carry; gpu_check.sh puts them on PYTHONPATH.
#   scripts/gpu_deps.sh [PYTHON_VERSION]   (the device image: 3.12)
set -euo pipefail
PY=${1:-3.12}
DEST=.gpu_deps
TMP=$(mktemp -d)
python3 -m pip download fastapi uvicorn --python-version "$PY" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$TMP" -q
rm -rf "$DEST" && mkdir -p "$DEST"
for w in "$TMP"/*.whl; do
  case $(basename "$w") in  # already in the device image (torch / transformers bring them)
    h11-*|anyio-*|click-*|idna-*|typing_extensions-*) continue ;;
  esac
  python3 -m zipfile -e "$w" "$DEST"
done
rm -rf "$TMP"
du -sh "$DEST"
