"""Manifold-constrained hyper-connections (mHC): fused `hc_pre`, `hc_post`, `hc_head` in Triton.

Same signatures and semantics as `dsv4.ops.ref`. The mix projection `fn . flatten(x)` ([M, n*D] fp32 by
[T, n*D]) is a split-K reduction: at decode the 1.5 MB `fn` (M = 24 rows of 16384) must be streamed by many
programs at once. Every output (rsqrt norm, pre / post weights, the Sinkhorn comb, the collapse
y = sum_i pre_i x_i) needs the whole reduction of its token, so there are two dependent kernels:
split-K partials [splits, T, M+1], then the finish (fixed-order sums, rsqrt / sigmoid, the collapse
re-reading x, one more program per token for the 4x4 Sinkhorn beside it). Given the block's norm
weight, the finish collapses each token's whole row in one program and applies the RMSNorm there,
so the block's attn_norm / ffn_norm (and the model's final norm, through hc_head) take no launch.
Tried in one launch and slower on an H200 (docs/PERF.md): the last split program finishing alone
(11.5 vs 7.6 us at T=1), and a grid-wide barrier with each program collapsing its own D columns
(10.8 vs 9.2 us at T=1; the last arrival then runs every token's Sinkhorn in turn, 94 us at T=16).
No atomics: the results are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.libdevice import fast_dividef

from dsv4.ops.device import cdiv, chain, chain_start, next_power_of_2, pdl
from dsv4.ops.kv_fp8 import cast_rne, rne_bf16
from dsv4.ops.rope import check_norm_weight

PDL_MAX_T = 16  # tokens up to which the finish kernel is launched early (see _hc_collapse)
FAST_SINKHORN = True  # div.approx in the Sinkhorn iterations on a GPU (bench switch)
# the one-program-per-token collapse + RMSNorm (norm_weight): columns per step and warps of that
# finish launch (its Sinkhorn program runs on as many). H200 (`PROBE=mhc_norm`), T = 1 / 16 / 64
# against hc_pre then rms_norm (9.40 / 10.01 / 13.76 us): 4 warps x 2048 columns 8.02 / 8.53 /
# 12.50 us (x 4096 the same; x 1024 8.68 / 9.16 / 12.78); 2 warps x 2048 8.46 / 8.94 / 12.89;
# 8 x 2048 8.28 / 8.90 / 12.88; 1 warp x 512 13.6 / 14.5 / 21.9; 4 x 512 20.1 / 27.3 / 23.8
NORM_BLOCK_D = 2048
NORM_WARPS = 4
# tokens up to which hc_post_pre's hc_post launch also computes the next hc_pre's partials (H200,
# graph us, fused vs hc_post + hc_pre: T=1 7.76 vs 10.39, T=16 10.47 vs 14.18; decode step batch 1
# 7.11 -> 7.05 ms: docs/PERF.md, twentieth session)
POST_PRE_MAX_T = 16
# its programs: columns of 16..64 for about this many (H200, T=1..16: 16, 16, 16, 32, 64 columns
# were each the best of 16 / 32 / 64)
_POST_PRE_PROGRAMS = 1024
_TARGET_PROGRAMS = 128  # about one program per SM on an H200 (132 SMs): best of 64..1024 measured


class _MixConfig(NamedTuple):
    """Tiles of the split-K mix projection and of the collapse."""

    block_t: int  # tokens per program; 1 = broadcast-multiply-sum, >= 16 = tl.dot
    block_k: int  # n*D elements per inner step
    split_k: int  # n*D elements per program (a multiple of block_k)
    block_d: int  # D elements per collapse program
    num_warps: int  # of the split-K kernel (T=64, 32-token tiles: 4 warps 14.2 us, 8 warps 17.5)


def _mix_config(T: int, M: int, K: int, D: int, programs: int = _TARGET_PROGRAMS) -> _MixConfig:
    """Heuristic tiles for T tokens, M mix rows, K = n*D: ~`programs` programs to stream `fn` and x,
    and a workspace [splits, T, M+1] fp32 of at most max(512 KB, 1/8 of bf16 x)."""
    block_t = 1 if T == 1 else min(64, max(16, next_power_of_2(T)))
    if block_t == 64 and T <= 64:
        block_t = 32  # two token blocks at T=64: more programs, half the workspace of 256 splits
    block_k = min(128 if block_t == 1 else 64, next_power_of_2(K))
    n_tblocks = cdiv(T, block_t)
    max_splits = cdiv(K, block_k)
    ws_bytes = max(1 << 19, T * K // 4)
    want = max(1, min(programs // n_tblocks, ws_bytes // (T * (M + 1) * 4)))
    splits = min(max_splits, 1 << (want.bit_length() - 1))
    split_k = cdiv(cdiv(K, splits), block_k) * block_k
    # collapse: (T, D / block_d) programs, block_d in [256, 1024]: ~256 programs from T = 16 up
    chunks = max(1, programs // T)
    block_d = min(1024, max(256, next_power_of_2(cdiv(D, chunks))))
    block_d = min(block_d, next_power_of_2(D))
    return _MixConfig(block_t, block_k, split_k, block_d, 8 if block_t >= 64 else 4)


# ---------------------------------------------------------------------------------------------------
# kernel 1: split-K partial mixes (shared by hc_pre and hc_head)
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "stride_wss"])  # per-step counts: one compile
def _hc_mixes_partial_kernel(
    x_ptr,  # [T, K] (x: [T, n, D] contiguous, K = n*D), bf16 / fp32
    fn_ptr,  # [M, K] fp32
    ws_ptr,  # [splits, T, M+1] fp32: cols 0..M-1 partial fn . x, col M partial sum(x^2)
    T,
    K,
    split_k,
    stride_xt,
    stride_fnm,
    stride_wss,
    stride_wst,
    M: tl.constexpr,
    M_PAD: tl.constexpr,  # >= 16, power of 2
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # chained launch (device.chain); the finish kernel may launch early
):
    # read BLOCK_T*split_k x elements and M*split_k fn floats ; write BLOCK_T*(M+1) floats
    chain_start(PDL)
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, M_PAD)
    mask_t = offs_t < T
    mask_m = offs_m < M
    k_start = pid_s * split_k
    k_end = tl.minimum(k_start + split_k, K)

    acc = tl.zeros((BLOCK_T, M_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
            mask=mask_t[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        fn = tl.load(
            fn_ptr + offs_m[:, None] * stride_fnm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [M_PAD, BLOCK_K] fp32
        sq += tl.sum(x * x, axis=1)
        if BLOCK_T == 1:
            # one token: fp32 broadcast-multiply-sum
            acc += tl.sum(x[:, None, :] * fn[None, :, :], axis=2)
        else:
            # tf32x3 keeps fp32 accuracy (bf16 x is exact in tf32; fn is split hi + lo)
            acc = tl.dot(x, tl.trans(fn), acc, input_precision="tf32x3")

    # ---- store partials: [BLOCK_T, M] mixes and the sum of squares in column M
    acc = tl.where(offs_m[None, :] == M, sq[:, None], acc)
    ws = ws_ptr + pid_s * stride_wss + offs_t[:, None] * stride_wst + offs_m[None, :]
    tl.store(ws, acc, mask=mask_t[:, None] & (offs_m[None, :] <= M))


# ---------------------------------------------------------------------------------------------------
# kernel 2: finish the reduction, sigmoid / Sinkhorn, collapse the streams
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _pre_weights(ws_t, mask_s, scale_ptr, base_ptr, K, norm_eps, hc_eps, M: tl.constexpr,
                 N: tl.constexpr, N_PAD: tl.constexpr):  # fmt: skip
    # ws_t: [S_PAD] pointers to one token's partials (masked by mask_s) -> (r, pre):
    # r = rsqrt(mean(x^2) + eps) over all n*D, pre = sigmoid(m[0:n] * r * s0 + base) + eps, 0 past n.
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    sq = tl.sum(tl.load(ws_t + M, mask=mask_s, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(sq / K + norm_eps)
    mask_sn = mask_s[:, None] & mask_n[None, :]
    mix_pre = tl.sum(
        tl.load(ws_t[:, None] + offs_n[None, :], mask=mask_sn, other=0.0),
        axis=0,
    )
    s0 = tl.load(scale_ptr)
    base_pre = tl.load(base_ptr + offs_n, mask=mask_n, other=0.0)
    pre = tl.sigmoid(mix_pre * r * s0 + base_pre) + hc_eps
    return r, tl.where(mask_n, pre, 0.0)


@triton.jit
def _collapse_tile(x_ptr, t, pre, offs_d, D, stride_xt, stride_xn, N: tl.constexpr,
                   N_PAD: tl.constexpr):  # fmt: skip
    # sum_i pre_i x[t, i, offs_d] in fp32 (0 past D)
    offs_n = tl.arange(0, N_PAD)
    mask_d = offs_d < D
    x = tl.load(
        x_ptr + t * stride_xt + offs_n[:, None] * stride_xn + offs_d[None, :],
        mask=(offs_n[:, None] < N) & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [N_PAD, BLOCK_D]
    return tl.sum(pre[:, None] * x, axis=0)


@triton.jit
def _collapse(x_ptr, y_ptr, t, pre, offs_d, D, stride_xt, stride_xn, stride_yt, N: tl.constexpr,
              N_PAD: tl.constexpr, RNE_BF16: tl.constexpr):  # fmt: skip
    # y[t, offs_d] = sum_i pre_i x[t, i, offs_d] in fp32
    y = _collapse_tile(x_ptr, t, pre, offs_d, D, stride_xt, stride_xn, N, N_PAD)
    y = cast_rne(y, y_ptr.dtype.element_ty, RNE_BF16)
    tl.store(y_ptr + t * stride_yt + offs_d, y, mask=offs_d < D)


@triton.jit
def _collapse_norm(x_ptr, y_ptr, nw_ptr, t, pre, D, eps, stride_xt, stride_xn, stride_yt,
                   N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                   D_CHUNKS: tl.constexpr, RNE_BF16: tl.constexpr):  # fmt: skip
    # the token's whole row: y = the collapse in y's dtype, then the reference's rms_norm of it,
    # y * rsqrt(mean(y^2) + eps) * w in fp32, cast back. Two passes over x (the second from L1)
    ty: tl.constexpr = y_ptr.dtype.element_ty
    sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c in tl.static_range(D_CHUNKS):
        offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        y = _collapse_tile(x_ptr, t, pre, offs_d, D, stride_xt, stride_xn, N, N_PAD)
        y = cast_rne(y, ty, RNE_BF16).to(tl.float32)
        sq += y * y
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
    for c in tl.static_range(D_CHUNKS):
        offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        y = _collapse_tile(x_ptr, t, pre, offs_d, D, stride_xt, stride_xn, N, N_PAD)
        y = cast_rne(y, ty, RNE_BF16).to(tl.float32)
        w = tl.load(nw_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        y = cast_rne(w * (y * rstd), ty, RNE_BF16)
        tl.store(y_ptr + t * stride_yt + offs_d, y, mask=offs_d < D)


@triton.jit
def _post_comb(ws_t, mask_s, r, t, scale_ptr, base_ptr, post_ptr, comb_ptr, hc_eps, sinkhorn_iters,
               N: tl.constexpr, N_PAD: tl.constexpr, FAST_DIV: tl.constexpr):  # fmt: skip
    # post[t] = 2 sigmoid(m[n:2n] * r * s1 + base[n:2n]) ; comb[t] = Sinkhorn of the n x n logits
    # m[2n + j*n + k] * r * s2 + base[2n + j*n + k]
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    mask_sn = mask_s[:, None] & mask_n[None, :]
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    mix_post = tl.sum(
        tl.load(ws_t[:, None] + N + offs_n[None, :], mask=mask_sn, other=0.0),
        axis=0,
    )
    base_post = tl.load(base_ptr + N + offs_n, mask=mask_n, other=0.0)
    post = 2.0 * tl.sigmoid(mix_post * r * s1 + base_post)
    tl.store(post_ptr + t * N + offs_n, post, mask=mask_n)

    jk = offs_n[:, None] * N + offs_n[None, :]  # [N_PAD, N_PAD]
    mask_jk = mask_n[:, None] & mask_n[None, :]
    mix_comb = tl.sum(
        tl.load(
            ws_t[:, None, None] + 2 * N + jk[None, :, :],
            mask=mask_s[:, None, None] & mask_jk[None, :, :],
            other=0.0,
        ),
        axis=0,
    )
    base_comb = tl.load(base_ptr + 2 * N + jk, mask=mask_jk, other=0.0)
    logits = mix_comb * r * s2 + base_comb
    logits = tl.where(mask_jk, logits, float("-inf"))

    # fp32 Sinkhorn: row softmax + eps, column norm, then (iters - 1) x (row norm, column norm),
    # eps inside every denominator
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    c = e / tl.sum(e, axis=1)[:, None] + hc_eps
    c = tl.where(mask_jk, c, 0.0)
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        if FAST_DIV:  # div.approx (MUFU reciprocal + multiply) on the serial chain: <= 2 ulp
            c = fast_dividef(c, tl.sum(c, axis=1)[:, None] + hc_eps)
            c = fast_dividef(c, tl.sum(c, axis=0)[None, :] + hc_eps)
        else:
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * N * N + jk, c, mask=mask_jk)


@triton.jit(do_not_specialize=["splits", "stride_wss"])  # per-step counts: one compile
def _hc_pre_finish_kernel(
    x_ptr,  # [T, n, D] bf16 / fp32
    ws_ptr,  # [splits, T, M+1] fp32
    scale_ptr,  # [3] (hc_pre) or [1] (hc_head) fp32
    base_ptr,  # [M] fp32
    y_ptr,  # [T, D] x.dtype
    nw_ptr,  # [D] the norm weight after the collapse (NORM)
    post_ptr,  # [T, n] fp32 (HAS_COMB)
    comb_ptr,  # [T, n, n] fp32 (HAS_COMB)
    D,
    K,
    splits,
    norm_eps,
    hc_eps,
    sinkhorn_iters,
    stride_xt,
    stride_xn,
    stride_wss,
    stride_wst,
    stride_yt,
    M: tl.constexpr,  # (2+n)*n (hc_pre) or n (hc_head)
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_COMB: tl.constexpr,
    NORM: tl.constexpr,  # one program per token collapses the whole row and applies the RMSNorm
    D_CHUNKS: tl.constexpr,  # NORM: cdiv(D, BLOCK_D)
    RNE_BF16: tl.constexpr,  # the interpreter with bf16 x: round on the bits
    PDL: tl.constexpr,  # griddepcontrol (sm_90+): when launched early, wait for the partials here
    FAST_DIV: tl.constexpr,  # Sinkhorn iterations with div.approx (GPU; the interpreter lacks it)
):
    # read n*BLOCK_D x + splits*(n+1) floats ; write BLOCK_D y ; with HAS_COMB one more program per
    # token (pid_d = cdiv(D, BLOCK_D), or 1 with NORM) writes post and the Sinkhorn comb beside
    # the collapse
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    mask_s = offs_s < splits
    ws_t = ws_ptr + t * stride_wst + offs_s * stride_wss
    chain_start(PDL)
    r, pre = _pre_weights(ws_t, mask_s, scale_ptr, base_ptr, K, norm_eps, hc_eps, M, N, N_PAD)
    if NORM:
        extra = pid_d > 0
        if pid_d == 0:
            _collapse_norm(x_ptr, y_ptr, nw_ptr, t, pre, D, norm_eps, stride_xt, stride_xn,
                           stride_yt, N, N_PAD, BLOCK_D, D_CHUNKS, RNE_BF16)  # fmt: skip
    else:
        extra = pid_d * BLOCK_D >= D
        if not extra:
            offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
            _collapse(x_ptr, y_ptr, t, pre, offs_d, D, stride_xt, stride_xn, stride_yt, N, N_PAD,
                      RNE_BF16)  # fmt: skip
    if HAS_COMB:
        if extra:  # the extra program: its Sinkhorn runs beside the collapse
            _post_comb(ws_t, mask_s, r, t, scale_ptr, base_ptr, post_ptr, comb_ptr, hc_eps,
                       sinkhorn_iters, N, N_PAD, FAST_DIV)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# hc_post: X'[k] = post[k] y + sum_j comb[j, k] X[j]
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _hc_post_kernel(
    y_ptr,  # [T, D]
    res_ptr,  # [T, n, D]
    post_ptr,  # [T, n] fp32
    comb_ptr,  # [T, n, n] fp32
    out_ptr,  # [T, n, D] y.dtype
    fn_ptr,  # MIX: [M, n*D] fp32, the next hc_pre's mix projection
    ws_ptr,  # MIX: [splits = cdiv(D, BLOCK_D), T, M+1] fp32 partials (as _hc_mixes_partial_kernel's)
    D,
    stride_yt,
    stride_rt,
    stride_rn,
    stride_ot,
    stride_on,
    stride_fnm,
    stride_wss,
    stride_wst,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MIX: tl.constexpr = False,  # also the next hc_pre's split-K partials of the new streams
    M: tl.constexpr = 1,
    M_PAD: tl.constexpr = 16,
    RNE_BF16: tl.constexpr = False,  # the interpreter with bf16 streams: round on the bits
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_D y + n*BLOCK_D residual + n + n*n floats ; write n*BLOCK_D (MIX: + read M*n*BLOCK_D
    # fn floats, write M+1 partials)
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    y = tl.load(y_ptr + t * stride_yt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + offs_n, mask=mask_n, other=0.0)
    out = post[:, None] * y[None, :]  # [N_PAD, BLOCK_D] fp32
    for j in tl.static_range(N):
        # comb[j, :] scales stream j into every output stream k; the fma spelled out, so every
        # launch rounds alike (left to the compiler, hc_post and hc_post_pre's fused form gave
        # streams a bit apart at T=64 on an H200)
        comb_j = tl.load(comb_ptr + t * N * N + j * N + offs_n, mask=mask_n, other=0.0)
        res_j = tl.load(res_ptr + t * stride_rt + j * stride_rn + offs_d, mask=mask_d, other=0.0)
        out = tl.fma(comb_j[:, None], res_j.to(tl.float32)[None, :], out)
    out_ptrs = out_ptr + t * stride_ot + offs_n[:, None] * stride_on + offs_d[None, :]
    mask_nd = mask_n[:, None] & mask_d[None, :]
    x = cast_rne(out, out_ptr.dtype.element_ty, RNE_BF16)
    tl.store(out_ptrs, x, mask=mask_nd)
    if MIX:
        # the new streams as stored (the next hc_pre reads them in their dtype): this chunk's part of
        # fn . flatten(x') and of sum(x'^2), split = pid_d
        x = tl.where(mask_nd, x.to(tl.float32), 0.0)
        offs_m = tl.arange(0, M_PAD)
        k = offs_n[:, None] * D + offs_d[None, :]  # [N_PAD, BLOCK_D] columns of fn
        fn = tl.load(
            fn_ptr + offs_m[:, None, None] * stride_fnm + k[None, :, :],
            mask=(offs_m < M)[:, None, None] & mask_nd[None, :, :],
            other=0.0,
        )  # [M_PAD, N_PAD, BLOCK_D]
        acc = tl.sum(tl.sum(fn * x[None, :, :], axis=2), axis=1)
        sq = tl.sum(tl.sum(x * x, axis=1), axis=0)
        acc = tl.where(offs_m == M, sq, acc)
        tl.store(ws_ptr + pid_d * stride_wss + t * stride_wst + offs_m, acc, mask=offs_m <= M)


# ---------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------


def _check_mix_args(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    rows: int,
    n_scales: int,
) -> None:
    assert x.dim() == 3, f"x must be [T, n, D] (got shape {tuple(x.shape)})"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x dtype {x.dtype}"
    assert x.is_contiguous(), f"x must be contiguous (strides {x.stride()})"
    _, n, D = x.shape
    assert hc_fn.shape == (rows, n * D), f"hc_fn shape {tuple(hc_fn.shape)} != {(rows, n * D)}"
    assert hc_fn.dtype == torch.float32 and hc_fn.is_contiguous(), (
        f"hc_fn must be contiguous fp32 (dtype {hc_fn.dtype}, strides {hc_fn.stride()})"
    )
    assert hc_scale.shape == (n_scales,) and hc_scale.dtype == torch.float32, (
        f"hc_scale must be fp32 [{n_scales}] (got {hc_scale.dtype} {tuple(hc_scale.shape)})"
    )
    assert hc_base.shape == (rows,) and hc_base.dtype == torch.float32, (
        f"hc_base must be fp32 [{rows}] (got {hc_base.dtype} {tuple(hc_base.shape)})"
    )
    assert hc_scale.is_contiguous() and hc_base.is_contiguous(), "hc_scale / hc_base not contiguous"


def _hc_collapse(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    has_comb: bool,
    norm_weight: torch.Tensor | None = None,
    cfg: _MixConfig | None = None,
    finish_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre when has_comb (M = (2+n)n rows) else hc_head (M = n rows): split-K partials, then
    the finish; with norm_weight the collapse goes through RMSNorm(norm_weight, norm_eps) in the
    finish (one program per token: 2 launches where the norm took a third).
    finish_warps: one warp was fastest on an H200 at T = 1, 16, 64 (the 4x4 Sinkhorn reduces
    within a warp: 9.6 vs 11.2 us at T = 1); NORM_WARPS with norm_weight."""
    T, n, D = x.shape
    M, K = hc_fn.shape
    if T == 0:
        return (x.new_empty((0, D)), x.new_empty((0, n), dtype=torch.float32),
                x.new_empty((0, n, n), dtype=torch.float32))  # fmt: skip
    # the CPU interpreter pays per program: few large ones there ; a given cfg also sets the norm's
    # column step (tests)
    norm_block = cfg.block_d if cfg is not None else NORM_BLOCK_D
    cfg = cfg or _mix_config(T, M, K, D, _TARGET_PROGRAMS if x.is_cuda else 1)
    assert cfg.split_k % cfg.block_k == 0, f"split_k {cfg.split_k} % block_k {cfg.block_k}"
    splits = cdiv(K, cfg.split_k)
    ws = torch.empty((splits, T, M + 1), dtype=torch.float32, device=x.device)

    # x: read T*n*D here and again in the finish (from L2 at decode, from HBM at long prefill) ;
    # fn: read M*n*D fp32 once per token block ; ws: write + read splits*T*(M+1) fp32
    grid1 = (splits, cdiv(T, cfg.block_t))
    _hc_mixes_partial_kernel[grid1](
        x, hc_fn, ws, T, K, cfg.split_k, x.stride(0), hc_fn.stride(0), ws.stride(0), ws.stride(1),
        M=M, M_PAD=max(16, next_power_of_2(M + 1)), BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **chain(x.device),
    )  # fmt: skip
    return _finish(x, ws, hc_scale, hc_base, norm_eps, hc_eps, sinkhorn_iters, has_comb,
                   norm_weight, cfg.block_d, norm_block, finish_warps)  # fmt: skip


def _finish(
    x: torch.Tensor,
    ws: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    has_comb: bool,
    norm_weight: torch.Tensor | None,
    collapse_block: int | None = None,
    norm_block: int | None = None,
    finish_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The finish launch over the split-K partials ws [splits, T, M+1] of x: (y, post, comb)."""
    T, n, D = x.shape
    splits, M = ws.shape[0], ws.shape[2] - 1
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    post = torch.empty((T, n), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=x.device)
    # the finish launched early (programmatic dependent launch) where it measured faster on an
    # H200: T=1 8.15 vs 8.5 us, T=16 8.8 vs 9.1; not at T=64 (12.8 vs 12.0: 1088 waiting programs)
    griddep = pdl(x.device)
    early = griddep and T <= PDL_MAX_T
    norm = norm_weight is not None
    if finish_warps is None:
        finish_warps = NORM_WARPS if norm else 1
    if norm:
        check_norm_weight(norm_weight, D)
        block_d = min(norm_block or NORM_BLOCK_D, next_power_of_2(D))
        grid2 = (T, 1 + int(has_comb))
    else:
        block_d = collapse_block or _mix_config(T, M, n * D, D).block_d
        grid2 = (T, cdiv(D, block_d) + int(has_comb))
    _hc_pre_finish_kernel[grid2](
        x, ws, hc_scale, hc_base, y, norm_weight if norm else y, post, comb, D, n * D, splits,
        float(norm_eps), float(hc_eps), int(sinkhorn_iters), x.stride(0), x.stride(1),
        ws.stride(0), ws.stride(1), y.stride(0), M=M, N=n, N_PAD=next_power_of_2(n),
        S_PAD=next_power_of_2(splits), BLOCK_D=block_d, HAS_COMB=has_comb, NORM=norm,
        D_CHUNKS=cdiv(D, block_d), RNE_BF16=rne_bf16(x),
        PDL=griddep, launch_pdl=early,
        FAST_DIV=FAST_SINKHORN and x.is_cuda, num_warps=finish_warps,
    )  # fmt: skip
    return y, post, comb


def _check_pre_args(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    sinkhorn_iters: int,
) -> None:
    n = x.shape[1] if x.dim() == 3 else 0
    _check_mix_args(x, hc_fn, hc_scale, hc_base, (2 + n) * n, 3)
    assert sinkhorn_iters >= 1, f"sinkhorn_iters must be >= 1 (got {sinkhorn_iters})"


def hc_pre(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [T, n, D] -> y: [T, D] x.dtype (collapse, then RMSNorm with norm_weight if given), post:
    # [T, n] fp32, comb: [T, n, n] fp32
    _check_pre_args(x, hc_fn, hc_scale, hc_base, sinkhorn_iters)
    return _hc_collapse(
        x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps, sinkhorn_iters, True, norm_weight
    )


def hc_head(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [T, n, D] -> [T, D]: sigmoid-weighted collapse, no Sinkhorn (then RMSNorm with
    # norm_weight if given)
    n = x.shape[1] if x.dim() == 3 else 0
    _check_mix_args(x, hc_fn, hc_scale, hc_base, n, 1)
    return _hc_collapse(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps, 1, False, norm_weight)[0]


def _check_post_args(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[int, int, int]:
    assert residual.dim() == 3, f"residual must be [T, n, D] (got {tuple(residual.shape)})"
    T, n, D = residual.shape
    assert y.shape == (T, D), f"y shape {tuple(y.shape)} != {(T, D)}"
    assert post.shape == (T, n) and post.dtype == torch.float32, (
        f"post must be fp32 [{T}, {n}] (got {post.dtype} {tuple(post.shape)})"
    )
    assert comb.shape == (T, n, n) and comb.dtype == torch.float32, (
        f"comb must be fp32 [{T}, {n}, {n}] (got {comb.dtype} {tuple(comb.shape)})"
    )
    assert y.stride(-1) == 1 and residual.stride(-1) == 1, (
        f"y / residual need unit stride in D (strides {y.stride()}, {residual.stride()})"
    )
    assert post.is_contiguous() and comb.is_contiguous(), "post / comb must be contiguous"
    return T, n, D


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    # X'[k] = post[k] * y + sum_j comb[j, k] * X[j]   (comb consumed transposed), fp32 math
    T, n, D = _check_post_args(y, residual, post, comb)
    out = torch.empty((T, n, D), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    _post_launch(y, residual, post, comb, out, min(next_power_of_2(D), 256 if T <= 16 else 1024))
    return out


def _post_launch(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    block_d: int,
    hc_fn: torch.Tensor | None = None,
    ws: torch.Tensor | None = None,
) -> None:
    # the hc_post kernel over D chunks of block_d; with hc_fn the next hc_pre's partials into ws
    T, n, D = residual.shape
    mix = hc_fn is not None
    M = hc_fn.shape[0] if mix else 1
    _hc_post_kernel[(T, cdiv(D, block_d))](
        y, residual, post, comb, out, hc_fn if mix else y, ws if mix else y, D, y.stride(0),
        residual.stride(0), residual.stride(1), out.stride(0), out.stride(1),
        hc_fn.stride(0) if mix else 0, ws.stride(0) if mix else 0, ws.stride(1) if mix else 0,
        N=n, N_PAD=next_power_of_2(n), BLOCK_D=block_d, MIX=mix, M=M,
        M_PAD=max(16, next_power_of_2(M + 1)),
        RNE_BF16=rne_bf16(y), num_warps=4, **chain(y.device),
    )  # fmt: skip


def hc_post_pre(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
    fused: bool | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, ...]:
    # hc_post(y, residual, post, comb) -> x', then hc_pre(x', hc_fn, ...): (x', y', post', comb').
    # Up to POST_PRE_MAX_T tokens the hc_post launch also computes hc_pre's split-K partials of x'
    # (one D chunk of every stream per program), so hc_pre's partial launch and its re-read of x'
    # go; then hc_pre's finish. fused: force either form, block_d: the fused form's chunk (tests,
    # bench)
    T, n, D = _check_post_args(y, residual, post, comb)
    if fused is None:
        fused = T <= POST_PRE_MAX_T
    if T == 0 or not fused:
        x = hc_post(y, residual, post, comb)
        return (x,) + hc_pre(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps, sinkhorn_iters,
                             norm_weight)  # fmt: skip
    x = torch.empty((T, n, D), dtype=y.dtype, device=y.device)
    _check_pre_args(x, hc_fn, hc_scale, hc_base, sinkhorn_iters)
    M = hc_fn.shape[0]
    # ~_POST_PRE_PROGRAMS programs stream fn, at most 64 columns each (the fn tile in registers)
    block_d = block_d or min(64, max(16, next_power_of_2(T * D // _POST_PRE_PROGRAMS)))
    splits = cdiv(D, block_d)
    ws = torch.empty((splits, T, M + 1), dtype=torch.float32, device=x.device)
    _post_launch(y, residual, post, comb, x, block_d, hc_fn, ws)
    return (x,) + _finish(x, ws, hc_scale, hc_base, norm_eps, hc_eps, sinkhorn_iters, True,
                          norm_weight)  # fmt: skip
