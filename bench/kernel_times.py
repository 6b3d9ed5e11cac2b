"""Per-kernel device time inside one op call (torch profiler): which launch of a multi-kernel op
(sparse_attn main + combine, hc_pre partial + finish, index_topk scores + select levels, the
experts' gate-up + down with --only moe, the 32 MB FP8 projections with --only linear) takes the
time. L2 is warm (back-to-back calls), so this is the kernels' execution chain, not HBM.
Usage: python3 bench/kernel_times.py [--json FILE] [--only NAME] [--plain]"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.bench.cases_indexer import _inputs as index_inputs
from dsv4.bench.probe_inputs import AttnDecode, hc_pre_params
from dsv4.ops import indexer, mhc, sparse_attn


def kernel_us(fn, calls: int = 20) -> dict[str, float]:  # noqa: ANN001
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:60]] += e.device_time / calls
    return dict(total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--plain", action="store_true", help="only run each case (under ncu)")
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    ns = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    attn = AttnDecode(g)
    fn, sc, base = hc_pre_params(g)
    x = torch.randn(1, 4, 4096, device="cuda", dtype=bf, generator=g)
    x64 = torch.randn(64, 4, 4096, device="cuda", dtype=bf, generator=g)
    # under ncu (--plain) no autotuning (ncu would replay every trial): the sweep's best T=64 tile
    t64 = {"BLOCK_N": 64, "DV_SPLIT": 1, "BLOCK_H": 64, "num_warps": 8, "num_stages": 3}
    t64_fixed = {"num_splits": 2, "config": t64} if ns.plain else {}
    attn1, attn64 = attn.tokens(1), attn.tokens(64)
    q64, kv64, sink64, idx64 = attn64
    one64 = (
        torch.cat(kv64),
    )  # one kv source: the engine's decode form (the Gluon kernel on sm_90)
    cases = {
        "sparse_attn T=1 K=640": lambda: sparse_attn.sparse_attn(*attn1, 0.04),
        "sparse_attn T=64 K=640": lambda: sparse_attn.sparse_attn(*attn64, 0.04, **t64_fixed),
        "sparse_attn one_source T=64 K=640": lambda: sparse_attn.sparse_attn(
            q64, one64, sink64, idx64, 0.04
        ),
        "hc_pre T=1": lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20),
        "hc_pre T=64": lambda: mhc.hc_pre(x64, fn, sc, base, 1e-6, 1e-6, 20),
    }
    for T in (1, 16):
        qi, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        cases[f"index_topk T={T} C=32768"] = lambda qi=qi, w=w, keys=keys, cand=cand: (
            indexer.index_topk(qi, w, keys, cand, 512)
        )
    if "moe" in ns.only:  # routed experts at Flash sizes (256 MXFP4 experts, k=6): 3.4 GB
        from dsv4.bench.cases_moe import random_experts
        from dsv4.ops import moe

        experts = random_experts(4096, 2048, 256, "cuda")
        for T in (1, 16, 64):
            idx = torch.rand(T, 256, generator=g, device="cuda").argsort(-1)[:, :6]
            wts = torch.rand(T, 6, generator=g, device="cuda") / 6
            xm = torch.randn(T, 4096, generator=g, device="cuda").to(bf)
            cases[f"moe T={T}"] = lambda a=(xm, wts, idx, experts): moe.moe_experts(*a)
    if "linear" in ns.only:  # the FP8 projections of 32 MB at one row (the GEMV form)
        from dsv4.bench.cases_linear import FLASH, _fp8_weight
        from dsv4.ops import linear

        for name, N, K, G in FLASH:
            if N * K >= 32 << 20:
                w8, s8 = _fp8_weight(N, K, "cuda", g)
                xl = torch.randn(1, G, K, device="cuda", dtype=bf, generator=g)
                cases[f"linear {name} T=1"] = lambda a=(xl, w8, s8): linear._grouped(*a)
    out = {}
    for name, f in cases.items():
        if ns.only not in name:
            continue
        if ns.plain:
            for _ in range(2):
                f()
            torch.cuda.synchronize()
            continue
        out[name] = kernel_us(f)
        print(name)
        for k, v in sorted(out[name].items(), key=lambda kv: -kv[1]):
            print(f"    {v:8.2f} us  {k}")
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
