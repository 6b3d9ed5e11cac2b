"""Where does a launcher's host time go? Host microseconds per call of each Triton op at decode
shapes (no sync inside the loop), plus a cProfile of the slowest. Usage: python3 bench/host_overhead.py"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from dsv4.bench.cases_linear import _fp8_weight
from dsv4.ops import indexer, linear, mhc, rope, sparse_attn


def host_us(fn, n: int = 200) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    H, D = 64, 512
    ring = torch.randn(128, D, device=dev, dtype=bf)
    pool = torch.randn(1 << 16, D, device=dev, dtype=bf)
    q = torch.randn(1, H, D, device=dev, dtype=bf)
    new = torch.randn(1, D, device=dev, dtype=bf)
    idx = torch.randint(0, 1 << 16, (1, 640), device=dev)
    sink = torch.randn(H, device=dev)
    x = torch.randn(1, 4, 4096, device=dev, dtype=bf)
    fn = torch.randn(24, 16384, device=dev) * 0.01
    sc, base = torch.rand(3, device=dev), torch.randn(24, device=dev)
    cos, sin = torch.rand(1, 32, device=dev), torch.rand(1, 32, device=dev)
    keys = torch.randn(1 << 15, 128, device=dev, dtype=bf)
    qi, w = torch.randn(1, 64, 128, device=dev, dtype=bf), torch.randn(1, 64, device=dev)
    cand = torch.arange(1 << 15, device=dev)[None]
    w_a, s_a = _fp8_weight(1024, 4096, dev, torch.Generator(device=dev).manual_seed(0))
    x1, x64 = (
        torch.randn(1, 4096, device=dev, dtype=bf),
        torch.randn(64, 4096, device=dev, dtype=bf),
    )
    calls = {
        "sparse_attn split": lambda: sparse_attn.sparse_attn(q, (ring, new, pool), sink, idx, 0.04),
        "sparse_attn 1 split": lambda: sparse_attn.sparse_attn(
            q, (ring, new, pool), sink, idx, 0.04, num_splits=1
        ),
        "hc_pre": lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20),
        "norm_rope": lambda: rope.norm_rope(q, None, 1e-6, cos, sin),
        "index_topk": lambda: indexer.index_topk(qi, w, keys, cand, 512),
        "linear wq_a T=1 (fp8)": lambda: linear.linear(x1, w_a, "fp8", s_a),
        "linear wq_a T=64 (fp8)": lambda: linear.linear(x64, w_a, "fp8", s_a),
        "torch add (baseline)": lambda: new + new,
    }
    for name, f in calls.items():  # median of 5 runs: the device machine's host varies ~30%
        runs = sorted(host_us(f) for _ in range(5))
        print(f"{name:<24} {runs[2]:8.1f} us host per call (min {runs[0]:.1f}, max {runs[-1]:.1f})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        calls["sparse_attn split"]()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
