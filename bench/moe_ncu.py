"""The routed experts' sm90 kernels at Flash width once per token count, for Nsight Compute.

  ncu -k regex:_experts_kernel python3 bench/moe_ncu.py [T ...]   (default: 512 4096)

Each T runs twice (the first call compiles); uniform random routing as `probe_pieces.py`'s moe
probes (256 MXFP4 experts, D 4096, inter 2048, k = 6).
"""

from __future__ import annotations

import sys

import torch
from probe_pieces import _moe_experts, _moe_tokens

from dsv4.ops import moe

if __name__ == "__main__":
    experts = _moe_experts()
    for T in [int(a) for a in sys.argv[1:]] or [512, 4096]:
        x, weights, idx, _ = _moe_tokens(T, experts)
        for _ in range(2):
            moe.moe_experts(x, weights, idx, experts, sm90=True)
        torch.cuda.synchronize()
        print(f"T={T} done", flush=True)
