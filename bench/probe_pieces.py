"""Where inside the decode kernels does device time go? Differences of variants (device time, L2
cleared): hc_pre with 1 vs 20 Sinkhorn iterations, sparse attention with and without the split +
combine, the indexer's scores vs scores + select vs torch.topk on packed keys.
Usage: python3 bench/probe_pieces.py"""

from __future__ import annotations

import torch

from dsv4.bench.ops import _graph_us
from dsv4.ops import indexer, mhc, sparse_attn


def us(fn) -> float:  # noqa: ANN001
    return sorted(_graph_us(fn, 3))[1]


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    # ---- hc_pre
    fn = torch.randn(24, 16384, device=dev, generator=g) * 0.01
    sc, base = torch.rand(3, device=dev, generator=g), torch.randn(24, device=dev, generator=g)
    for T in (1, 64):
        x = torch.randn(T, 4, 4096, device=dev, dtype=bf, generator=g)
        for it in (1, 20):
            print(
                f"hc_pre T={T} iters={it}: {us(lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, it)):.2f}"
            )  # noqa: B023
        print(
            f"hc_head T={T}: {us(lambda: mhc.hc_head(x, fn[:4], sc[:1], base[:4], 1e-6, 1e-6)):.2f}"
        )  # noqa: B023
    # ---- sparse attention T=1, K=640
    H, D = 64, 512
    pool = torch.randn(1 << 20, D, device=dev, dtype=bf, generator=g)
    ring = torch.randn(128, D, device=dev, dtype=bf, generator=g)
    q = torch.randn(1, H, D, device=dev, dtype=bf, generator=g)
    new = torch.randn(1, D, device=dev, dtype=bf, generator=g)
    sink = torch.randn(H, device=dev, generator=g)
    idx = torch.cat(
        [
            torch.arange(128, device=dev),
            129 + torch.randint(0, 1 << 20, (512,), device=dev, generator=g),
        ]
    )[None]
    for s in (1, 2, 5, 10, 20):
        t = us(lambda: sparse_attn.sparse_attn(q, (ring, new, pool), sink, idx, 0.04, num_splits=s))  # noqa: B023
        print(f"sparse_attn T=1 K=640 splits={s}: {t:.2f}")
    idx0 = idx[:, :64]
    print(
        f"sparse_attn T=1 K=64 splits=1: {us(lambda: sparse_attn.sparse_attn(q, (ring, new, pool), sink, idx0, 0.04, num_splits=1)):.2f}"
    )
    # ---- indexer
    C = 32768
    for T in (1, 16):
        keys = torch.randn(T * C + 64, 128, device=dev, dtype=bf, generator=g)
        qi = torch.randn(T, 64, 128, device=dev, dtype=bf, generator=g)
        w = torch.randn(T, 64, device=dev, generator=g)
        cand = torch.randperm(keys.shape[0], device=dev, generator=g)[: T * C].view(T, C)
        pos = torch.arange(C, device=dev)

        def packed_topk():  # noqa: ANN202
            sk = indexer._scores(qi, w, keys, cand)  # noqa: B023
            key = (sk.to(torch.int64) << 32) | (C - 1 - pos)  # noqa: B023
            return torch.topk(key, 512, dim=1).values

        sk = indexer._scores(qi, w, keys, cand)
        print(
            f"indexer T={T}: scores {us(lambda: indexer._scores(qi, w, keys, cand)):.2f}  "  # noqa: B023
            f"scores+select {us(lambda: indexer.index_topk(qi, w, keys, cand, 512)):.2f}  "  # noqa: B023
            f"scores+torch.topk(packed) {us(packed_topk):.2f}  "
            f"torch.topk(int32) alone {us(lambda: torch.topk(sk, 512, dim=1)):.2f}"
        )  # noqa: B023


if __name__ == "__main__":
    main()
