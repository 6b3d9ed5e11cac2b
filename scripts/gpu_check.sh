#!/usr/bin/env bash
# All GPU tests and benchmarks in one call (for the lent H200). Results go under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
export PYTHONPATH=$PWD  # the device has no network: run from the tree
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
echo "gpu tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt"
