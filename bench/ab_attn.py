"""Temporary A/B: HEAD's sparse_attn (bench/ab_old_sparse_attn.py) against the working tree."""
import sys

import torch

sys.path.insert(0, "bench")
import ab_old_sparse_attn as old  # noqa: E402
from probe_pieces import us  # noqa: E402

from dsv4.bench.probe_inputs import AttnDecode  # noqa: E402
from dsv4.ops import sparse_attn as new  # noqa: E402

attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
for T in (1, 16, 64):
    q, kv, sink, idx = attn.tokens(T)
    nbytes = T * idx.shape[1] * 512 * 2 + 2 * q.numel() * 2
    a = new.sparse_attn(q, kv, sink, idx, 0.04).float()
    b = old.sparse_attn(q, kv, sink, idx, 0.04).float()
    print(f"T={T} max diff new vs old {float((a - b).abs().max()):.2e}")
    for rep in range(2):
        for name, m in (("old (int64 select)", old), ("new (int32 select)", new)):
            t = us(f"attn T={T} {name}", lambda m=m: m.sparse_attn(q, kv, sink, idx, 0.04))
            print(f"    {nbytes / t / 1e3:.0f} GB/s", flush=True)
