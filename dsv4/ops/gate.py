"""MoE router in two launches: the gate's dot products, then per token the scores, top-k, weights.

One launcher with the signature of `dsv4.ops.ref.moe_gate`:
  moe_gate(x, weight, bias, k, route_scale, idx=None) -> (weights [T, k] fp32, idx [T, k] int64)

The reference upcasts x and the [E, D] gate weight to fp32 (a 4 MB copy at Flash sizes), then runs
a GEMM, softplus, sqrt, a bias add, a sort, a gather and a normalisation: about a dozen launches.
Here `_gate_dots_kernel` splits D over programs and writes fp32 partial dots (bf16 products are
exact in the fp32 accumulator, as in the reference's fp32 GEMM); `_gate_route_kernel` sums the
partials in a fixed order and, per token in registers, takes sqrt(softplus), selects the k largest
of score + bias (equal values: the lower expert id, like the reference's stable sort) or reads the
fixed experts of hash routing, and normalises the chosen scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops import ref
from dsv4.ops.device import cdiv, chain, chain_start, next_power_of_2, num_sms, split_reduction


@triton.jit(do_not_specialize=["T", "stride_ps"])  # per-step counts: one compile
def _gate_dots_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [E, D]
    part_ptr,  # [splits, T, E] fp32
    T,
    E,
    D,
    d_per_split,  # a multiple of BLOCK_K
    stride_xt,
    stride_we,
    stride_ps,
    stride_pt,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the CPU interpreter: fp32 operands
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_T x BLOCK_E x d_per_split worth of x and w tiles ; write BLOCK_T * BLOCK_E floats
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(2)
    e_ok = offs_e < E
    t_ok = offs_t < T
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    k_start = split * d_per_split
    k_end = tl.minimum(k_start + d_per_split, D)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(
            x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
            mask=t_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_e[None, :].to(tl.int64) * stride_we + offs_k[:, None],
            mask=k_ok[:, None] & e_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_E]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out = part_ptr + split * stride_ps + offs_t[:, None] * stride_pt + offs_e[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _softplus(z):
    # torch's softplus (threshold 20): z above it, else log1p(exp(z)), log1p as log(u) e / (u - 1)
    e = tl.exp(tl.minimum(z, 20.0))  # (the branch above 20 is not taken: keep it finite)
    u = 1.0 + e
    d = u - 1.0  # 0 when e is below half an ulp of 1: log1p(e) = e there
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.where(z > 20.0, z, lp)


@triton.jit(do_not_specialize=["splits", "stride_ps"])  # per-step counts: one compile
def _gate_route_kernel(
    part_ptr,  # [splits, T, E] fp32
    bias_ptr,  # [E] fp32 (not HASH)
    idx_in_ptr,  # [T, K] int64 (HASH)
    w_out_ptr,  # [T, K] fp32
    idx_out_ptr,  # [T, K] int64
    E,
    splits,
    route_scale,
    stride_ps,
    stride_pt,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    S_PAD: tl.constexpr,  # >= splits, power of 2
    HASH: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read splits * E partials (+ E bias) ; write K weights and K ids
    # Latency is the chain here (one program per token, one warp): every split's partials come in
    # one load and one sum, and each of the k picks is one max over packed (value, id) keys
    t = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_e = tl.arange(0, E_PAD)
    offs_j = tl.arange(0, K_PAD)
    e_ok = offs_e < E
    parts = part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + offs_e[None, :]
    part = tl.load(parts, mask=(offs_s[:, None] < splits) & e_ok[None, :], other=0.0)
    scores = tl.sqrt(_softplus(tl.sum(part, 0)))
    if HASH:
        ids = tl.load(idx_in_ptr + t * K + offs_j, mask=offs_j < K, other=0)
    else:
        sel = scores + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0)
        sel = tl.where(e_ok & (sel == sel), sel, float("-inf"))  # NaN is never picked
        # key: sel's order-preserving int32 bits above the complemented id, so one max picks the
        # largest value and, among equal values, the lower id
        bits = sel.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (E_PAD - 1 - offs_e).to(tl.int64)
        ids = tl.zeros([K_PAD], tl.int64)
        for j in tl.static_range(K):
            top = tl.max(key, 0)
            i = E_PAD - 1 - (top & 0xFFFFFFFF)
            ids = tl.where(offs_j == j, tl.minimum(i, E - 1), ids)
            key = tl.where(offs_e == i, -(2**63), key)
    # (a hash id outside [0, E) reads an in-range score rather than past the register tile)
    pick = tl.minimum(tl.maximum(tl.where(offs_j < K, ids, 0), 0), E_PAD - 1)
    chosen = tl.gather(scores, pick.to(tl.int32), 0)
    chosen = tl.where(offs_j < K, chosen, 0.0)
    weights = chosen / tl.sum(chosen, 0) * route_scale
    tl.store(w_out_ptr + t * K + offs_j, weights, mask=offs_j < K)
    tl.store(idx_out_ptr + t * K + offs_j, ids, mask=offs_j < K)


def moe_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    route_scale: float,
    idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D] ; weight: [E, D] ; bias: [E] fp32 (selection only) ; idx: [T, k] fixed experts
    # (hash routing; bias unused) -> (weights [T, k] fp32, idx [T, k] int64)
    on_gpu = x.is_cuda
    if x.dtype != weight.dtype or (on_gpu and x.dtype != torch.bfloat16):
        return ref.moe_gate(x, weight, bias, k, route_scale, idx)  # fp32 checking runs
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x {tuple(x.shape)} and gate weight {tuple(weight.shape)} must be [T, D] and [E, D]"
    )
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x / gate weight rows must be contiguous"
    T, D = x.shape
    E = weight.shape[0]
    assert 0 < k <= E, f"k={k} must be in [1, {E}]"
    if idx is None:
        assert bias is not None and bias.shape == (E,) and bias.dtype == torch.float32, (
            f"bias must be fp32 [{E}] (got {None if bias is None else (bias.dtype, bias.shape)})"
        )
        assert bias.is_contiguous(), "bias must be contiguous"
    else:
        assert idx.shape == (T, k) and idx.dtype == torch.int64 and idx.is_contiguous(), (
            f"idx must be contiguous int64 [{T}, {k}] (got {idx.dtype} {tuple(idx.shape)})"
        )
    w_out = torch.empty((T, k), dtype=torch.float32, device=x.device)
    idx_out = torch.empty((T, k), dtype=torch.int64, device=x.device)
    if T == 0:
        return w_out, idx_out
    block_t = min(64, max(16, next_power_of_2(T)))
    block_e, block_k = 16, 128
    programs = cdiv(E, block_e) * cdiv(T, block_t)
    d_per_split, splits = split_reduction(D, block_k, programs, 2 * num_sms(x.device), 16)
    part = torch.empty((splits, T, E), dtype=torch.float32, device=x.device)
    _gate_dots_kernel[(cdiv(E, block_e), cdiv(T, block_t), splits)](
        x, weight, part, T, E, D, d_per_split, x.stride(0), weight.stride(0),
        part.stride(0), part.stride(1),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, UPCAST=not on_gpu,
        PRECISION="ieee" if not on_gpu else "tf32", num_warps=4, num_stages=3 if on_gpu else 1,
        **chain(x.device),
    )  # fmt: skip
    _gate_route_kernel[(T,)](
        part, part if bias is None else bias, w_out if idx is None else idx, w_out, idx_out,
        E, splits, float(route_scale), part.stride(0), part.stride(1),
        K=k, K_PAD=next_power_of_2(k), E_PAD=next_power_of_2(E),
        S_PAD=next_power_of_2(splits), HASH=idx is not None, num_warps=1, **chain(x.device),
    )  # fmt: skip
    return w_out, idx_out
