"""Sparse attention of a causal prefill chunk at Flash's shapes (64 heads x 512, window 128, top-512
CSA entries or all HCA entries): the model's three key sources (ring | new rows | compressed pool)
through the Triton kernel, against the same rows as one allocation through the Gluon sm90 kernel
(the decode path's), and the launcher's choice for the three (the Gluon kernel since the
forty-fifth session), device µs (CUDA-graph replays, L2 cleared) and the tensor FLOP rate
(token-key pairs x 64 x 512 x 4)."""

from __future__ import annotations

import argparse
import statistics

import torch

from dsv4.bench.cases_sparse_attn import _Dims, _prefill_idx, _sources
from dsv4.bench.ops import _graph_us
from dsv4.ops import sparse_attn_sm90
from dsv4.ops.sparse_attn import sparse_attn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096@512,4096@1024h,1024@512")
    p.add_argument("--tiles", default="64x2,32x4,32x3", help="sm90 BLOCK_N x NUM_BUF variants")
    ns = p.parse_args()
    torch.manual_seed(0)
    dims = _Dims(H=64, D=512, window=128, seqs=1, pool_per_seq=32768, rope_dim=64)
    ring, pool = _sources(dims, "cuda")
    for spec in ns.shapes.split(","):
        t, sel = spec.split("@")
        T, hca = int(t), sel.endswith("h")
        sel = int(sel.rstrip("h"))
        idx = _prefill_idx(dims, T, sel, hca, "cuda")
        q = torch.randn(T, 64, 512, device="cuda").to(torch.bfloat16)
        new = torch.randn(T, 512, device="cuda").to(torch.bfloat16)
        sink = torch.randn(64, device="cuda")
        ang = torch.rand(T, 32, device="cuda") * 6.0
        rope = (torch.cos(ang), torch.sin(ang))
        three = (ring, new, pool)
        one = (torch.cat([ring, new, pool]),)
        scale = 512**-0.5
        pairs = int((idx >= 0).sum())
        flop = pairs * 64 * 512 * 4
        runs = [  # (num_splits=1 keeps the launcher on the Triton kernel)
            ("triton, 3 sources", lambda: sparse_attn(q, three, sink, idx, scale, 64, inv_rope=rope,
                                                      num_splits=1)),
            ("triton, 1 source", lambda: sparse_attn(q, one, sink, idx, scale, 64, inv_rope=rope,
                                                     num_splits=1)),
            ("dispatch, 3 sources", lambda: sparse_attn(q, three, sink, idx, scale, 64,
                                                        inv_rope=rope)),
        ]  # fmt: skip
        for tile in ns.tiles.split(","):
            bn, nb = (int(x) for x in tile.split("x"))
            runs.append((f"sm90 {bn}x{nb}, 1 source", lambda bn=bn, nb=nb: sparse_attn_sm90.sparse_attn_sm90(
                q, one, sink, idx, scale, 64, inv_rope=rope, num_splits=1, block_n=bn, num_buf=nb)))  # fmt: skip
        base = runs[0][1]().float()
        for name, fn in runs:
            try:
                err = (fn().float() - base).abs().max().item()
                us = statistics.median(_graph_us(fn, 3) or [float("nan")])
            except Exception as e:  # noqa: BLE001  (a variant that does not compile or fit)
                print(f"T={T:5d}: {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(
                f"T={T:5d} K=128+{sel}{' HCA' if hca else ''}: {name:<22} {us:9.1f} us, "
                f"{flop / us / 1e6:6.1f} TFLOP/s, max |diff| vs the first {err:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
