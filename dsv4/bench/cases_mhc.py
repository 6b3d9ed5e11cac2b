"""mHC benchmark cases: hc_pre, hc_post, hc_head at decode (T = 1, 16, 64) and prefill (T = 4096)."""

from __future__ import annotations

import torch

from dsv4.bench.ops import Case
from dsv4.ops import mhc, ref, rope

EPS = 1e-6
SINKHORN_ITERS = 20


def _inputs(T: int, n: int, D: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    M, K = (2 + n) * n, n * D
    cpu = {
        "x": 3 * torch.randn(T, n, D, generator=g),
        "fn": torch.randn(M, K, generator=g) / K**0.5,
        "scale": 0.5 + 1.5 * torch.rand(3, generator=g),
        "base": torch.randn(M, generator=g),
        "head_fn": torch.randn(n, K, generator=g) / K**0.5,
        "head_scale": 0.5 + 1.5 * torch.rand(1, generator=g),
        "head_base": torch.randn(n, generator=g),
        "y": torch.randn(T, D, generator=g),
        "post": 2 * torch.rand(T, n, generator=g),
        "comb": torch.rand(T, n, n, generator=g),
        "norm_w": 0.5 + torch.rand(D, generator=g),
    }
    act = {"x", "y"}  # bf16 activations; mHC parameters, post and comb stay fp32
    return {k: v.to(device=device, dtype=torch.bfloat16 if k in act else torch.float32)
            for k, v in cpu.items()}  # fmt: skip


def cases(device: str, quick: bool) -> list[Case]:
    n, D = 4, (64 if quick else 4096)
    out: list[Case] = []
    for T in (1, 5) if quick else (1, 16, 64, 4096):
        t = _inputs(T, n, D, device)
        x, y, post, comb = t["x"], t["y"], t["post"], t["comb"]
        M, K = (2 + n) * n, n * D
        shape = f"T={T} n={n} D={D}"
        act = x.element_size()
        # read x + fn (+ scale, base) ; write y (bf16) + post + comb (fp32)
        pre_bytes = T * K * act + M * K * 4 + (3 + M) * 4 + T * D * act + T * (n + n * n) * 4
        pre_args = (x, t["fn"], t["scale"], t["base"], EPS, EPS, SINKHORN_ITERS)
        out.append(Case(
            "hc_pre", shape,
            run=lambda a=pre_args: mhc.hc_pre(*a),
            ref=lambda a=pre_args: ref.hc_pre(*a),
            bytes=pre_bytes,
            target_us=8.0 if T == 1 and not quick else None,
            target_bw=0.5 if T == 64 and not quick else None,
        ))  # fmt: skip
        # with the block's RMSNorm in the finish (+ the norm weight read), and the unfused pair
        # it replaces (hc_pre, then rms_norm: y written and read once more)
        w = t["norm_w"]
        norm_args = pre_args + (w,)
        out.append(Case(
            "hc_pre+norm", shape,
            run=lambda a=norm_args: mhc.hc_pre(*a),
            ref=lambda a=norm_args: ref.hc_pre(*a),
            bytes=pre_bytes + D * 4,
        ))  # fmt: skip
        out.append(Case(
            "hc_pre,norm", shape,
            run=lambda a=pre_args, w=w: rope.rms_norm(mhc.hc_pre(*a)[0], w, EPS),
            ref=lambda a=norm_args: ref.hc_pre(*a)[0],
            bytes=pre_bytes + D * 4,
        ))  # fmt: skip
        # hc_post, then the next hc_pre (with its norm) on the new streams: the fused form, a
        # decode form (each token's programs read fn: T x 1.5 MB from L2)
        pp_args = (y, x, post, comb, t["fn"], t["scale"], t["base"], EPS, EPS, SINKHORN_ITERS, w)
        if T <= 64:
            out.append(Case(
                "hc_post_pre", shape,
                run=lambda a=pp_args: mhc.hc_post_pre(*a, fused=True),
                ref=lambda a=pp_args: ref.hc_post_pre(*a),
                bytes=T * D * act + 2 * T * K * act + T * (n + n * n) * 4 + M * K * 4 + T * D * act,
            ))  # fmt: skip
        # read y + residual + post + comb ; write n streams
        post_bytes = T * D * act + 2 * T * K * act + T * (n + n * n) * 4
        post_args = (y, x, post, comb)
        out.append(Case(
            "hc_post", shape,
            run=lambda a=post_args: mhc.hc_post(*a),
            ref=lambda a=post_args: ref.hc_post(*a),
            bytes=post_bytes,
        ))  # fmt: skip
        # read x + head fn (+ scale, base) ; write y
        head_bytes = T * K * act + n * K * 4 + (1 + n) * 4 + T * D * act
        head_args = (x, t["head_fn"], t["head_scale"], t["head_base"], EPS, EPS)
        out.append(Case(
            "hc_head", shape,
            run=lambda a=head_args: mhc.hc_head(*a),
            ref=lambda a=head_args: ref.hc_head(*a),
            bytes=head_bytes,
        ))  # fmt: skip
    return out
