"""Interleaved partial RoPE, fused RMSNorm + RoPE, and the compressor close (pool + norm + RoPE + store).

Five launchers with the signatures of `dsv4.ops.ref`:
  rotary(x, cos, sin, inverse)              x: [T, ..., d] -> rotate pairs (2i, 2i+1) of the trailing rd
  norm_rope(x, weight, eps, cos, sin, store)
                                            RMSNorm over d (fp32 stats), cast, then rotary ;
                                            store = (dst, rows) also writes dst[rows[t]] (decode's
                                            window ring, in the same launch)
  norm_rope_qkv(q, kv, weight, eps, cos, sin, store)
                                            norm_rope of the attention's queries (no weight) and
                                            of its window K=V (weight, store) in one launch
  compress_store(kv, score, weight, eps, cos, sin, out, dest, rows=None, out_scale=None)
                                            out[dest] = norm_rope(softmax_slots(score) . kv),
                                            dest -1 = no store
  compress_keep(kv, gate, ape, positions, ratio, kv_state, score_state, rows)
                                            a decode step's compressor projections into the ring:
                                            kv_state[rows] = kv, score_state[rows] = gate + ape[phase]
Every op is one launch that reads its inputs once and writes its output once; the statistics, the
softmax pooling and the rotation live in registers. Rounding follows the reference: the normalised
value is cast to the output dtype before it is rotated, and the pooled value before it is normalised.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4.ops.device import cdiv, chain, chain_start, next_power_of_2
from dsv4.ops.kv_fp8 import round_bf16, store_entries, store_index_keys
from dsv4.quant import kv_entry_layout

# ---------------------------------------------------------------------------------------------
# Shared tile helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_tile(x, w_ptr, d, eps, HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr):
    # x: [BR, BD] fp32 (0 beyond d) ; w: [d] -> x * rsqrt(mean(x^2) + eps) (* w), fp32
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / d + eps)  # [BR]
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
        y = w[None, :] * y
    return y


@triton.jit
def rotate_tile(y, cos, sin, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # y: [BR, BD] fp32 ; cos/sin: [BR, BD/2] fp32, one per pair (2i, 2i+1) of the whole row
    # -> [BR, BD] fp32 with every pair rotated: (re*c - im*s, re*s + im*c)
    re, im = tl.split(tl.reshape(y, (BLOCK_R, BLOCK_D // 2, 2)))
    rot = tl.join(re * cos - im * sin, re * sin + im * cos)
    return tl.reshape(rot, (BLOCK_R, BLOCK_D))


# ---------------------------------------------------------------------------------------------
# rotary / norm_rope: rows of d channels, BLOCK_R rows per program
# ---------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_rows(
    pid,  # the program's block of BLOCK_R rows
    x_ptr,  # [T, R, d] bf16/fp32 (last dim contiguous)
    w_ptr,  # [d] norm weight (any float dtype) or a dummy when not HAS_WEIGHT
    cos_ptr,  # [T, rd/2] fp32
    sin_ptr,  # [T, rd/2] fp32
    out_ptr,  # [T, R, d] x.dtype, contiguous
    dst_ptr,  # [N, d] (HAS_STORE): also dst[dst_rows[t]] = out[t] (R = 1); ENTRIES: uint8 FP8
    dst_rows_ptr,  # [T] int rows of dst (HAS_STORE)
    stride_dst,
    n_rows,  # T * R
    R,  # rows per token (heads; 1 for [T, d])
    d,
    nope,  # d - rd: channels that pass through the rotation
    eps,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    INVERSE: tl.constexpr,
    HAS_STORE: tl.constexpr,
    ENTRIES: tl.constexpr,  # dst holds FP8 entries (`dsv4.ops.kv_fp8`)
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # read BLOCK_R * d elements (+ their cos/sin) ; write BLOCK_R * d elements (twice if HAS_STORE)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    t = rows // R
    h = rows % R
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d
    mask = row_ok[:, None] & col_ok[None, :]

    # ---- load x (upcast right away: fp32 math throughout)
    x_offs = t.to(tl.int64)[:, None] * stride_xt + h.to(tl.int64)[:, None] * stride_xh
    x = tl.load(x_ptr + x_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    # ---- RMSNorm over d, cast to the activation dtype as the reference does before RoPE
    if NORM:
        x = _rms_norm_tile(x, w_ptr, d, eps, HAS_WEIGHT, BLOCK_D)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)

    # ---- RoPE: pair j = channels (2j, 2j+1) uses cos/sin[t, j - nope/2] when 2j >= nope
    pairs = tl.arange(0, BLOCK_D // 2)
    pair_ok = row_ok[:, None] & ((pairs >= nope // 2) & (2 * pairs < d))[None, :]
    c_idx = pairs[None, :] - nope // 2
    cos = tl.load(cos_ptr + t.to(tl.int64)[:, None] * stride_ct + c_idx, mask=pair_ok, other=1.0)
    sin = tl.load(sin_ptr + t.to(tl.int64)[:, None] * stride_st + c_idx, mask=pair_ok, other=0.0)
    if INVERSE:
        sin = -sin
    rot = rotate_tile(x, cos, sin, BLOCK_R, BLOCK_D)
    y = tl.where((cols >= nope)[None, :], rot, x)  # the NoPE channels pass through exactly

    out_offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_STORE:
        d_rows = tl.load(dst_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        # cast as the reference does: to x.dtype first, then to dst's dtype (or FP8 entries)
        y_act = y.to(out_ptr.dtype.element_ty)
        if ENTRIES:
            store_entries(dst_ptr, d_rows * stride_dst, y_act.to(tl.float32), row_ok, d, nope,
                          BLOCK_R, BLOCK_D)  # fmt: skip
        else:
            d_offs = d_rows[:, None] * stride_dst + cols[None, :]
            tl.store(dst_ptr + d_offs, y_act.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])  # per-step counts: one compile
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, dst_ptr, dst_rows_ptr, stride_dst,
                      n_rows, R, d, nope, eps, stride_xt, stride_xh, stride_ct, stride_st,
                      NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INVERSE: tl.constexpr,
                      HAS_STORE: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    # rotary / norm_rope: the rows of _norm_rope_rows, BLOCK_R per program
    chain_start(PDL)
    _norm_rope_rows(tl.program_id(0), x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, dst_ptr,
                    dst_rows_ptr, stride_dst, n_rows, R, d, nope, eps, stride_xt, stride_xh,
                    stride_ct, stride_st, NORM, HAS_WEIGHT, INVERSE, HAS_STORE, ENTRIES, BLOCK_R,
                    BLOCK_D)  # fmt: skip


@triton.jit(do_not_specialize=["T", "q_programs"])  # per-step counts: one compile
def _norm_rope_qkv_kernel(q_ptr, q_out_ptr, H, stride_qt, stride_qh, kv_ptr, w_ptr, kv_out_ptr,
                          dst_ptr, dst_rows_ptr, stride_dst, stride_kvt, cos_ptr, sin_ptr, T, d,
                          nope, eps, stride_ct, stride_st, q_programs, HAS_STORE: tl.constexpr,
                          ENTRIES: tl.constexpr, BLOCK_RQ: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):  # fmt: skip
    # norm_rope_qkv: programs 0 .. q_programs - 1 take the query heads (BLOCK_RQ rows each, no
    # weight), the rest one kv row each (weight, the ring store)
    chain_start(PDL)
    pid = tl.program_id(0)
    if pid < q_programs:
        _norm_rope_rows(pid, q_ptr, q_ptr, cos_ptr, sin_ptr, q_out_ptr, q_out_ptr, q_ptr, 0,
                        T * H, H, d, nope, eps, stride_qt, stride_qh, stride_ct, stride_st, True,
                        False, False, False, False, BLOCK_RQ, BLOCK_D)  # fmt: skip
    else:
        _norm_rope_rows(pid - q_programs, kv_ptr, w_ptr, cos_ptr, sin_ptr, kv_out_ptr, dst_ptr,
                        dst_rows_ptr, stride_dst, T, 1, d, nope, eps, stride_kvt, 0, stride_ct,
                        stride_st, True, True, False, HAS_STORE, ENTRIES, 1, BLOCK_D)  # fmt: skip


@triton.jit(do_not_specialize=["n_rows"])  # per-step counts: one compile
def _rms_norm_kernel(
    x_ptr,  # [n_rows, d] (last dim contiguous)
    w_ptr,  # [d] norm weight or a dummy when not HAS_WEIGHT
    out_ptr,  # [n_rows, d] x.dtype, contiguous
    n_rows,
    d,
    eps,
    stride_x,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_R * d elements ; write BLOCK_R * d elements: one launch for the reference's
    # seven (upcast, square, mean, add, rsqrt, multiply, weight, cast)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _rms_norm_tile(x, w_ptr, d, eps, HAS_WEIGHT, BLOCK_D)
    tl.store(out_ptr + rows * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [..., d] -> RMSNorm over d with fp32 statistics, (fp32 weight *) then cast to x.dtype
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x dtype {x.dtype}"
    assert x.dim() >= 1 and x.stride(-1) == 1, (
        f"x must be contiguous in its last dim (shape {tuple(x.shape)}, strides {x.stride()})"
    )
    d = x.shape[-1]
    check_norm_weight(weight, d)
    x2 = x.reshape(-1, d)  # a view for the activations here; copies only odd layouts
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows == 0 or d == 0:
        return out
    block_d = next_power_of_2(d)
    block_r, num_warps = _rows_config(n_rows, block_d, 528 if x.is_cuda else 1)
    _rms_norm_kernel[(cdiv(n_rows, block_r),)](
        x2, x2 if weight is None else weight, out, n_rows, d, eps, x2.stride(0),
        HAS_WEIGHT=weight is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=num_warps, **chain(x.device),
    )  # fmt: skip
    return out


def _rows_config(n_rows: int, block_d: int, programs: int = 528) -> tuple[int, int]:
    """(BLOCK_R, num_warps): tiles of <= 4K elements, and enough programs to fill 132 SMs x 4
    (the CPU interpreter pays per program: ask for 1 there)."""
    max_r = max(1, 4096 // block_d)
    block_r = 1
    while block_r < max_r and n_rows >= 2 * block_r * programs:
        block_r *= 2
    num_warps = 4 if block_r * block_d >= 2048 else 2
    return block_r, num_warps


def check_norm_weight(weight: torch.Tensor | None, d: int) -> None:
    if weight is not None:
        assert weight.shape == (d,) and weight.is_contiguous(), (
            f"weight must be a contiguous [{d}] (got {tuple(weight.shape)})"
        )


def check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Shape/dtype checks shared by rotary and norm_rope; returns rd."""
    assert x.dim() >= 2, f"x must be [T, ..., d], got shape {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x dtype {x.dtype}"
    assert x.stride(-1) == 1, f"x must be contiguous in its last dim (strides {x.stride()})"
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32, (
        f"cos/sin must be fp32 (got {cos.dtype}, {sin.dtype})"
    )
    assert cos.dim() == 2 and cos.shape == sin.shape, (
        f"cos/sin must be [T, rd/2] alike (got {tuple(cos.shape)}, {tuple(sin.shape)})"
    )
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1, "cos/sin must be contiguous in the last dim"
    assert cos.shape[0] == x.shape[0], f"cos rows {cos.shape[0]} != x tokens {x.shape[0]}"
    d, rd = x.shape[-1], 2 * cos.shape[-1]
    assert 0 < rd <= d and (d - rd) % 2 == 0, f"bad rope dims rd={rd} for d={d}"
    return rd


def _launch_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: bool,
    inverse: bool,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    rd = check_rope(x, cos, sin)
    T, d = x.shape[0], x.shape[-1]
    if store is not None:
        _check_store(x, rd, *store)
        dst, dst_rows = store
    check_norm_weight(weight, d)
    R = math.prod(x.shape[1:-1])  # rows per token: heads (1 for [T, d])
    x3 = x.view(T, R, d)  # fails loudly on a layout that cannot be flattened
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if store is None:
        dst, dst_rows = out, cos  # dummies: HAS_STORE is off
    n_rows = T * R
    if n_rows == 0:
        return out
    block_d = next_power_of_2(d)
    block_r, num_warps = _rows_config(n_rows, block_d, 528 if x.is_cuda else 1)
    grid = (cdiv(n_rows, block_r),)
    _norm_rope_kernel[grid](
        x3,
        x3 if weight is None else weight,
        cos,
        sin,
        out,
        dst,
        dst_rows,
        dst.stride(0),
        n_rows,
        R,
        d,
        d - rd,
        eps,
        x3.stride(0),
        x3.stride(1),
        cos.stride(0),
        sin.stride(0),
        NORM=norm,
        HAS_WEIGHT=weight is not None,
        INVERSE=inverse,
        HAS_STORE=store is not None,
        ENTRIES=dst.dtype == torch.uint8,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **chain(x.device),
    )
    return out


def _check_store(x: torch.Tensor, rd: int, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    T, d = x.shape[0], x.shape[-1]
    assert x.dim() == 2, f"store takes x as [T, d] (got shape {tuple(x.shape)})"
    width = kv_entry_layout(d, rd)[2] if dst.dtype == torch.uint8 else d  # FP8 entries
    assert dst.dim() == 2 and dst.shape[1] == width and dst.stride(1) == 1, (
        f"store dst must be [N, {width}] with contiguous rows (got {tuple(dst.shape)}, "
        f"strides {dst.stride()})"
    )
    assert dst_rows.shape == (T,) and dst_rows.dtype in (torch.int32, torch.int64), (
        f"store rows must be int [{T}] (got {dst_rows.dtype} {tuple(dst_rows.shape)})"
    )
    assert dst_rows.is_contiguous() and dst.device == x.device == dst_rows.device, (
        "store rows must be contiguous and on x's device"
    )


def norm_rope_qkv(
    q: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # (norm_rope(q, None, ..), norm_rope(kv, weight, .., store)) in one launch: q [T, H, d], kv
    # [T, d] (the attention's queries and its window K=V, the same positions)
    rd = check_rope(q, cos, sin)
    assert check_rope(kv, cos, sin) == rd and q.dim() == 3, (
        f"q [T, H, d] and kv [T, d] alike (got {tuple(q.shape)}, {tuple(kv.shape)})"
    )
    T, H, d = q.shape
    assert kv.shape == (T, d) and kv.dtype == q.dtype, (
        f"kv must be [{T}, {d}] {q.dtype} (got {tuple(kv.shape)} {kv.dtype})"
    )
    assert weight is not None, "norm_rope_qkv: kv's norm weight"
    check_norm_weight(weight, d)
    if store is not None:
        _check_store(kv, rd, *store)
    dst, dst_rows = store if store is not None else (kv, cos)  # dummies: HAS_STORE is off
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    if T == 0:
        return q_out, kv_out
    block_d = next_power_of_2(d)
    block_r, num_warps = _rows_config(T * H, block_d, 528 if q.is_cuda else 1)
    q_programs = cdiv(T * H, block_r)
    _norm_rope_qkv_kernel[(q_programs + T,)](
        q, q_out, H, q.stride(0), q.stride(1), kv, weight, kv_out, dst, dst_rows, dst.stride(0),
        kv.stride(0), cos, sin, T, d, d - rd, eps, cos.stride(0), sin.stride(0), q_programs,
        HAS_STORE=store is not None, ENTRIES=dst.dtype == torch.uint8, BLOCK_RQ=block_r,
        BLOCK_D=block_d, num_warps=num_warps, **chain(q.device),
    )  # fmt: skip
    return q_out, kv_out


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    # x: [T, ..., d] ; cos/sin: [T, rd/2] fp32 -> x with the trailing rd channels rotated (fp32 math)
    return _launch_rows(x, None, 0.0, cos, sin, norm=False, inverse=inverse)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    # x: [T, ..., d] -> RMSNorm over d (fp32 stats, weight or none), cast, RoPE on the trailing rd ;
    # store = (dst [N, d], rows [T]): also dst[rows[t]] = out[t] in the same launch (x: [T, d])
    return _launch_rows(x, weight, eps, cos, sin, norm=True, inverse=False, store=store)


# ---------------------------------------------------------------------------------------------
# compress_store: one program per closed window
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_act(x, out_ptr, ENTRIES: tl.constexpr):
    # fp32 x rounded to the store's dtype, as the reference casts (FP8 entries: to bf16)
    if ENTRIES:
        return round_bf16(x)
    return x.to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _compress_store_kernel(
    kv_ptr,  # [n, slots, d] fp32, or (GATHER) [N, d] rows
    score_ptr,  # [n, slots, d] fp32, -inf = empty slot, or (GATHER) [N, d] rows
    rows_ptr,  # (GATHER) [n, slots] int rows of kv / score, -1 = empty slot
    w_ptr,  # [d] norm weight
    cos_ptr,  # [n, rd/2] fp32
    sin_ptr,  # [n, rd/2] fp32
    out_ptr,  # [rows, d] bf16/fp32 paged store (ENTRIES: uint8 FP8 entries; KEY_FP8: e4m3 codes)
    dest_ptr,  # [n] int rows of out, -1 = no store
    scale_ptr,  # KEY_FP8: [rows] fp32 scales of out's rows
    kv2_ptr,  # (CHUNK) [M, d] fp32: rows N.. of the sources (prefill: ring | chunk)
    score2_ptr,  # (CHUNK) [M, d] fp32
    n_first,  # (CHUNK) N: rows below it are kv / score's, the others kv2 / score2's (row - N)
    stride_kv2,
    stride_s2,
    slots,
    d,
    nope,
    eps,
    stride_kvn,
    stride_kvs,
    stride_sn,
    stride_ss,
    stride_ct,
    stride_st,
    stride_o0,
    stride_rn,
    HAS_WEIGHT: tl.constexpr,
    GATHER: tl.constexpr,
    CHUNK: tl.constexpr,  # (GATHER) a second row source
    ENTRIES: tl.constexpr,  # out holds FP8 entries of the bf16-rounded value
    KEY_FP8: tl.constexpr,  # out holds FP8 indexer keys of it (codes here, scales at scale_ptr)
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read 2 * slots * d fp32 (+ d weight, rd cos/sin) ; write d elements of out
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < d
    if GATHER:  # a window that is not stored is not pooled either
        if tl.load(dest_ptr + i) < 0:
            return

    # ---- per-channel softmax pooling over the slots, online over chunks of BLOCK_S slots
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        if GATHER:  # slot s of window i is row rows[i, s] of kv / score (-1: empty)
            r = tl.load(rows_ptr + i * stride_rn + s, mask=s < slots, other=-1).to(tl.int64)
            mask = (r >= 0)[:, None] & col_ok[None, :]
            z_at = score_ptr + r[:, None] * stride_ss + cols[None, :]
            a_at = kv_ptr + r[:, None] * stride_kvs + cols[None, :]
        else:
            mask = (s < slots)[:, None] & col_ok[None, :]
            z_at = score_ptr + i * stride_sn + s[:, None] * stride_ss + cols[None, :]
            a_at = kv_ptr + i * stride_kvn + s[:, None] * stride_kvs + cols[None, :]
        if CHUNK:  # rows from n_first on are the second source's
            in2 = (r >= n_first)[:, None]
            r2 = tl.maximum(r - n_first, 0)
            z = tl.load(z_at, mask=mask & ~in2, other=float("-inf"))
            a = tl.load(a_at, mask=mask & ~in2, other=0.0)
            z2_at = score2_ptr + r2[:, None] * stride_s2 + cols[None, :]
            z = tl.where(in2, tl.load(z2_at, mask=mask & in2, other=float("-inf")), z)
            a2_at = kv2_ptr + r2[:, None] * stride_kv2 + cols[None, :]
            a = tl.where(in2, tl.load(a2_at, mask=mask & in2, other=0.0), a)
        else:
            z = tl.load(z_at, mask=mask, other=float("-inf"))
            a = tl.load(a_at, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: keep sums at 0
        alpha = tl.exp(m - m_safe)
        p = tl.exp(z - m_safe[None, :])  # [BS, BD]
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * a, axis=0)
        m = m_new
    # [BD]; a channel whose slots are all empty gives NaN, as torch's softmax does
    pooled = acc / tl.where(col_ok, l_sum, 1.0)
    BF16: tl.constexpr = ENTRIES or KEY_FP8  # FP8 forms quantize the bf16-rounded value
    x = _round_act(tl.reshape(pooled, (1, BLOCK_D)), out_ptr, BF16)
    x = tl.where(col_ok[None, :], x, 0.0)

    # ---- RMSNorm (fp32 stats), cast to the store dtype, RoPE at the window's position
    x = _rms_norm_tile(x, w_ptr, d, eps, HAS_WEIGHT, BLOCK_D)
    x = _round_act(x, out_ptr, BF16)
    pairs = tl.arange(0, BLOCK_D // 2)
    pair_ok = ((pairs >= nope // 2) & (2 * pairs < d))[None, :]
    c_idx = pairs[None, :] - nope // 2
    cos = tl.load(cos_ptr + i * stride_ct + c_idx, mask=pair_ok, other=1.0)
    sin = tl.load(sin_ptr + i * stride_st + c_idx, mask=pair_ok, other=0.0)
    rot = rotate_tile(x, cos, sin, 1, BLOCK_D)
    y = tl.where((cols >= nope)[None, :], rot, x)

    # ---- store the entry at its pool row
    row = tl.load(dest_ptr + i).to(tl.int64)
    if ENTRIES:
        row_off = tl.zeros([1], tl.int64) + row * stride_o0
        store_entries(out_ptr, row_off, round_bf16(y), row_off >= 0, d, nope, 1, BLOCK_D)
    elif KEY_FP8:
        if row >= 0:
            store_index_keys(out_ptr + row * stride_o0, scale_ptr + row, round_bf16(y), d, BLOCK_D)
    elif row >= 0:
        tl.store(
            out_ptr + row * stride_o0 + cols[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=col_ok[None, :],
        )


def _compress_config(slots: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_S, num_warps): slot chunks of <= 16K elements per tensor (64 KB fp32)."""
    block_s = min(next_power_of_2(slots), max(1, 16384 // block_d))
    num_warps = min(16, max(2, block_s * block_d // 1024))
    return block_s, num_warps


def compress_store(
    kv: torch.Tensor,
    score: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    dest: torch.Tensor,
    rows: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    chunk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    # kv, score: [n, slots, d] fp32 (score -inf = empty slot), or with rows [n, slots] (-1 = empty
    # slot): [N, d] fp32 row sources, slot s of window i being row rows[i, s] (windows whose dest
    # is -1 are then skipped) ; chunk (with rows): a second [M, d] fp32 (kv, score) source whose
    # rows are N .. N+M-1 (prefill: the ring, then the chunk's own projections) ;
    # cos/sin: [n, rd/2] ; dest: [n] rows of out, -1 = no store
    # out[dest] = RoPE(RMSNorm(sum_slots softmax_slots(score) * kv)), in place ; out uint8: FP8
    # entries, or with out_scale [rows] fp32 FP8 indexer keys (`dsv4.quant.quant_index_keys`)
    gather = rows is not None
    if gather:
        assert kv.dim() == 2 and score.shape == kv.shape, (
            f"with rows, kv/score must be [N, d] alike (got {tuple(kv.shape)}, {tuple(score.shape)})"
        )
        assert rows.dim() == 2 and rows.dtype in (torch.int64, torch.int32), (
            f"rows must be [n, slots] int (got {tuple(rows.shape)} {rows.dtype})"
        )
        assert rows.stride(1) == 1 or rows.shape[1] <= 1, "rows must be contiguous in slots"
        (n, slots), d = rows.shape, kv.shape[1]
        strides = (0, kv.stride(0), 0, score.stride(0))  # a slot's row, not (window, slot)
        if chunk is not None:
            kv2, score2 = chunk
            assert kv2.dim() == 2 and kv2.shape[1] == d and score2.shape == kv2.shape, (
                f"chunk must be two [M, {d}] sources alike (got {tuple(kv2.shape)}, "
                f"{tuple(score2.shape)})"
            )
            assert kv2.dtype == score2.dtype == torch.float32, "chunk sources must be fp32"
            assert kv2.stride(-1) == score2.stride(-1) == 1, "chunk must be contiguous in d"
    else:
        assert chunk is None, "a second source (chunk) needs rows"
        assert kv.dim() == 3 and score.shape == kv.shape, (
            f"kv/score must be [n, slots, d] alike (got {tuple(kv.shape)}, {tuple(score.shape)})"
        )
        n, slots, d = kv.shape
        strides = (kv.stride(0), kv.stride(1), score.stride(0), score.stride(1))
    assert kv.dtype == torch.float32 and score.dtype == torch.float32, (
        f"kv/score must be fp32 (got {kv.dtype}, {score.dtype})"
    )
    assert kv.stride(-1) == 1 and score.stride(-1) == 1, "kv/score must be contiguous in d"
    key_fp8 = out_scale is not None
    entries = out.dtype == torch.uint8 and not key_fp8  # FP8 entries
    width = kv_entry_layout(d, 2 * cos.shape[-1])[2] if entries else d
    if key_fp8:
        assert out.dtype == torch.uint8 and out_scale.dtype == torch.float32, (
            f"FP8 indexer keys: out must be uint8 codes, out_scale fp32 (got {out.dtype}, "
            f"{out_scale.dtype})"
        )
        assert out_scale.shape == out.shape[:1] and out_scale.stride(0) == 1, (
            f"out_scale must be [{out.shape[0]}] contiguous (got {tuple(out_scale.shape)})"
        )
    assert out.dim() == 2 and out.shape[1] == width and out.stride(-1) == 1, (
        f"out must be [rows, {width}] contiguous in its last dim (got {tuple(out.shape)}, "
        f"strides {out.stride()})"
    )
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8), (
        f"out dtype {out.dtype}"
    )
    assert dest.shape == (n,) and dest.dtype in (torch.int64, torch.int32), (
        f"dest must be [{n}] int (got {tuple(dest.shape)} {dest.dtype})"
    )
    check_norm_weight(weight, d)
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32, "cos/sin must be fp32"
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == n, (
        f"cos/sin must be [{n}, rd/2] (got {tuple(cos.shape)}, {tuple(sin.shape)})"
    )
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1, "cos/sin must be contiguous in the last dim"
    rd = 2 * cos.shape[1]
    assert 0 < rd <= d and (d - rd) % 2 == 0, f"bad rope dims rd={rd} for d={d}"
    if n == 0:
        return
    block_d = next_power_of_2(d)
    block_s, num_warps = _compress_config(slots, block_d)
    kv2, score2 = chunk if chunk is not None else (kv, score)
    _compress_store_kernel[(n,)](
        kv, score, rows if gather else dest, kv if weight is None else weight, cos, sin, out, dest,
        out_scale if key_fp8 else kv, kv2, score2, kv.shape[0], kv2.stride(0), score2.stride(0),
        slots, d, d - rd, eps, *strides, cos.stride(0),
        sin.stride(0), out.stride(0), rows.stride(0) if gather else 0,
        HAS_WEIGHT=weight is not None, GATHER=gather, CHUNK=chunk is not None, ENTRIES=entries,
        KEY_FP8=key_fp8,
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=num_warps, **chain(kv.device),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# compress_keep: one program per (token, channel block)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _compress_keep_kernel(
    kv_ptr,  # [T, n] the W_kv projection (bf16 / fp32)
    gate_ptr,  # [T, n] the W_gate projection
    ape_ptr,  # [ratio, n] fp32 position bias of a window's slots
    pos_ptr,  # [T] int positions
    rows_ptr,  # [T] int ring rows, -1 = none
    kv_state_ptr,  # [N, n] fp32
    score_state_ptr,  # [N, n] fp32
    n,
    ratio,
    stride_kv,
    stride_gate,
    stride_ape,
    stride_kvs,
    stride_ss,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # the token's ring row as a [BLOCK] tensor (the interpreter takes tensor masks only)
    row = tl.load(rows_ptr + t).to(tl.int64) + tl.zeros([BLOCK], dtype=tl.int64)
    ok = (offs < n) & (row >= 0)
    phase = tl.load(pos_ptr + t).to(tl.int64) % ratio
    a = tl.load(kv_ptr + t * stride_kv + offs, mask=ok).to(tl.float32)
    z = tl.load(gate_ptr + t * stride_gate + offs, mask=ok).to(tl.float32)
    z += tl.load(ape_ptr + phase * stride_ape + offs, mask=ok)
    tl.store(kv_state_ptr + row * stride_kvs + offs, a, mask=ok)
    tl.store(score_state_ptr + row * stride_ss + offs, z, mask=ok)


def compress_keep(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    # kv, gate: [T, n] (column slices of one joined GEMM are fine) ; ape: [ratio, n] fp32 ;
    # positions, rows: [T] int (rows -1: no store) ; kv_state / score_state: [N, n] fp32, in place:
    # kv_state[rows] = kv (fp32), score_state[rows] = gate (fp32) + ape[position % ratio]
    T, n = kv.shape
    assert gate.shape == (T, n) and kv.stride(1) == gate.stride(1) == 1, (
        f"kv / gate must be [T, n] alike, contiguous in n (got {tuple(kv.shape)}, "
        f"{tuple(gate.shape)}, strides {kv.stride()}, {gate.stride()})"
    )
    assert ape.dtype == torch.float32 and ape.shape == (ratio, n) and ape.stride(1) == 1, (
        f"ape must be [{ratio}, {n}] fp32 (got {ape.dtype} {tuple(ape.shape)})"
    )
    for name, st in (("kv_state", kv_state), ("score_state", score_state)):
        assert st.dtype == torch.float32 and st.dim() == 2 and st.shape[1] == n, (
            f"{name} must be [N, {n}] fp32 (got {st.dtype} {tuple(st.shape)})"
        )
        assert st.stride(1) == 1, f"{name} must be contiguous in its last dim"
    for name, v in (("positions", positions), ("rows", rows)):
        assert v.shape == (T,) and v.dtype in (torch.int32, torch.int64) and v.stride(0) == 1, (
            f"{name} must be int [{T}] contiguous (got {v.dtype} {tuple(v.shape)})"
        )
    if T == 0:
        return
    block = min(1024, next_power_of_2(n))
    _compress_keep_kernel[(T, cdiv(n, block))](
        kv, gate, ape, positions, rows, kv_state, score_state, n, ratio,
        kv.stride(0), gate.stride(0), ape.stride(0), kv_state.stride(0), score_state.stride(0),
        BLOCK=block, num_warps=4 if block >= 512 else 1, **chain(kv.device),
    )  # fmt: skip
