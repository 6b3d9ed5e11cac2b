"""Routed experts of a MoE layer: two grouped GEMMs with the MXFP4 weights decoded in the kernel.

One launcher with the signature of `dsv4.ops.ref.moe_experts`:
  moe_experts(x, weights, idx, experts, shared=None) -> [T, D] fp32 (+ shared)

y_t = sum_j Expert_{idx[t,j]}(x_t, weights[t,j]): per (token, slot) pair g = min(x W1^T, limit),
u = clamp(x W3^T, -limit, limit), h = silu(g) * u * weight (rounded to x.dtype), out = h W2^T.

The weights stay per-expert parameters (their state_dict keys are the checkpoint's). A table of
where each expert's weights and scales lie (int64 [6, E] offsets, in 16-byte units from expert 0's
w1 weight / scale, so the compiler knows the pointers are 16-byte aligned and vectorizes the loads)
is built once per ModuleList and cached. Routing runs on the device without a host sync:
the T*k pairs are sorted by expert and each expert's rows are padded to a multiple of BLOCK_M,
giving every row-block one expert and BLOCK_M pair ids (-1 = padding). The number of row-blocks has
a static bound, so the grids are static and blocks past the real count exit at once. Expert
parallelism: `experts` holds the rank's experts only and idx names the others -1; such pairs are in
no row-block (the GEMV form: their blocks exit at once), and the slot sum skips their rows.

  _moe_gate_up_kernel  per (row-block, inter tile): gather x rows, W1 and W3 tiles decoded from
                       e2m1 nibbles and e8m0 scales, two dots; epilogue clamp, silu * u, routing
                       weight; h [T*k, inter] in x.dtype, pair-major.
  _moe_down_kernel     per (row-block, D tile): h rows times decoded W2^T; out [T*k, D] in x.dtype
                       (the reference's w2 output dtype), summed over the k slots in fp32 by torch.

On an sm_90 GPU, from moe_sm90.MIN_PAIRS to moe_sm90.MAX_PAIRS pairs of bf16 x, the Gluon kernels of
`dsv4.ops.moe_sm90` run instead (the codes decoded by inline PTX straight into the wgmma register
operand; 1.81x tl.dot_scaled at batch 64 on an H200). Otherwise the codes are decoded one of three
ways: by the kernels' own bit decode (`_mxfp4_tile`: fp32
weights times the scale, then x.dtype) into a tensor-core dot; for bf16/fp16 x on a GPU from
DOT_SCALED_MIN_PAIRS pairs, by `tl.dot_scaled` on the packed codes (the compiler's decode, exact in
bf16; fewer instructions per weight, which bound these kernels); or, on a GPU up to GEMV_MAX_PAIRS
pairs, in the GEMV form (`_mxfp4_gemv`): one pair per row-block, the 8 codes of each 32-bit word
decoded by inline PTX (a Triton decode in the interpreter), one fp32 fma per weight on the CUDA
cores and the scale once per 32-group. All give the same products (exact: e2m1 * 2^k times a bf16
is exact in fp32); only the summation order differs.

Cast points follow `Expert.forward`: the gate/up results are rounded to x.dtype before the clamp,
h is rounded to x.dtype before w2 and each pair's w2 output is rounded to x.dtype before the sum.
Weight formats other than "fp4" fall back to the reference.
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.ops import ref
from dsv4.ops.device import autotune, cdiv, chain, chain_start, next_power_of_2
from dsv4.ops.kv_fp8 import cast_rne, exp2i, rne_bf16

_DOT_TYPES = (torch.float32, torch.bfloat16, torch.float16)  # x dtypes with a kernel path
# tl.dot_scaled on the packed codes for bf16/fp16 x from this many (token, slot) pairs: on an
# H200 7-9% faster at T=16 / 64 (k=6), within noise at T=1 (bench/probe_pieces.py moe)
DOT_SCALED_MIN_PAIRS = 64
# its tiles (fixed, no autotuning): the best of those measured at T = 16 and 64, 3% ahead of the
# autotuner's picks (749.6 vs 774.0 and 1777.5 vs 1809.8 us)
DOT_SCALED_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
# the GEMV form (one pair per row-block, products summed on the CUDA cores) up to this many pairs
# on a GPU: batch <= 8 at k=6. H200 (bench/probe_pieces.py moe_gemv), routed experts at T = 1, 2,
# 4, 8: 57.2 vs 85.5, 95.6 vs 148.8, 166.5 vs 269.7, 301.7 vs 469.2 us for the dot form.
# It reads an expert's weights once per pair, so experts shared by several tokens are read again
GEMV_MAX_PAIRS = 48
# its tiles: 1024-wide steps (the 256-wide ones of the ninth session took 77.5 / 118.8 / 203 /
# 371 us); up to 8 pairs the next step's codes and x load before this step's math (PREFETCH:
# -4 us at T=1, +1-14 us at T = 2-8)
GEMV_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3, "PREFETCH": False}
# <= 8 pairs: 8 rows x 512 columns on 2 warps under a 128-register cap (ptxas -v, sm_90a: no
# spills in either kernel; 8 programs an SM where 16 x 1024 on 4 warps took 255 registers and 2).
# H200, T=1 (eighteenth session, moe_gemv, twice each): 47.06 / 47.17 us against 50.26 / 50.25
GEMV_CONFIG_ONE = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "num_stages": 3, "PREFETCH": True,
                   "maxnreg": 128}  # fmt: skip
MXFP4_BLOCK = tl.constexpr(32)  # one e8m0 scale per 32 weights of a row
# rows of the address table (globals a kernel reads must be constexpr)
W1, W3, W2 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # int8 packed weights
S1, S3, S2 = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5)  # e8m0 scales


def _configs() -> list[triton.Config]:
    # BLOCK_N output columns, BLOCK_K reduction step (multiple of 32: whole scale groups).
    # Decode (few rows per block) is bound by reading the packed weights: 0.5 B + 1/32 B per
    # weight, so the tiles aim for enough programs (T=1, k=6: 6 row-blocks x inter / BLOCK_N)
    shapes = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
        (32, 128, 4, 3),
        (32, 256, 4, 3),
        (64, 128, 4, 3),
        (64, 256, 8, 3),
        (64, 64, 4, 4),
        (128, 64, 8, 3),
        (128, 128, 8, 3),
    ]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    # the reduction loop has no tail: BLOCK_K must divide K
    k = kwargs.get("K", named_args.get("K"))
    fits = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0]
    # K is a multiple of 32 (checked by the launcher): one whole scale group per step always fits
    return fits or [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2)]


# ---------------------------------------------------------------------------------------------
# MXFP4 tile decode: int8 [BLOCK_N, BLOCK_K/2] nibbles + e8m0 [BLOCK_N, BLOCK_K/32] -> fp32
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mxfp4_raw(w_ptr, s_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    # read BLOCK_N * BLOCK_K / 2 packed bytes + BLOCK_N * BLOCK_K / 32 scale bytes: the codes uint8
    # [BLOCK_N, BLOCK_K/2] and e8m0 scales uint8 [BLOCK_N, BLOCK_K/32], as tl.dot_scaled takes them
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // MXFP4_BLOCK + tl.arange(0, BLOCK_K // MXFP4_BLOCK)
    b = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_b[None, :], mask=n_ok[:, None], other=0)
    s = tl.load(s_ptr + offs_n[:, None] * stride_s + offs_g[None, :], mask=n_ok[:, None], other=0)
    return b.to(tl.uint8, bitcast=True), s.to(tl.uint8, bitcast=True)


@triton.jit
def _e8m0_scale(s):
    # e8m0 scale bytes (uint8) -> fp32 2^(S-127) times 2^14, which the e2m1 decodes below leave
    # out (S <= 240)
    return exp2i(s.to(tl.int32) - 113)


@triton.jit
def _mxfp4_tile(
    w_ptr, s_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    # the tile of `_mxfp4_raw` decoded: fp32 [BLOCK_N, BLOCK_K]
    b, s = _mxfp4_raw(w_ptr, s_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N, BLOCK_K)
    b = b.to(tl.int16)
    # e2m1 code (sign | e1 e0 m) -> fp16 bits (sign << 15 | e1 e0 m << 9): value * 2^-14 exactly,
    # code 1 (0.5) landing on an fp16 subnormal that the fp32 upcast keeps exact.
    # low nibble = even column, high nibble = odd column
    lo = ((b & 0x08) << 12) | ((b & 0x07) << 9)
    hi = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # interleave even/odd columns
    scale = _e8m0_scale(s)
    w = tl.reshape(w, (BLOCK_N, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK)) * scale[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


# ---------------------------------------------------------------------------------------------
# GEMV form (batch <= 8): 32-bit words of 8 codes, the products summed per scale group
# ---------------------------------------------------------------------------------------------

# e2m1 code i of a 32-bit word (bits 4i..4i+3: column i, low nibble first) -> fp16 bits
# (sign << 15 | e1 e0 m << 9, the value times 2^-14 as _mxfp4_tile) for codes i and i+4 in the two
# halves of one register (a shift, a shift, two masks), then one cvt per code
_E2M1_WORDS_ASM = tl.constexpr(
    "\n".join(
        ["{", ".reg .b32 a, b;", ".reg .b16 l, u;"]
        + [
            line
            for i in range(4)
            for line in (
                f"shl.b32 a, $8, {12 - 4 * i};" if i < 3 else "mov.b32 a, $8;",
                f"shl.b32 b, $8, {9 - 4 * i};" if i < 3 else "shr.b32 b, $8, 3;",
                "and.b32 a, a, 0x80008000;",
                "and.b32 b, b, 0x0E000E00;",
                "or.b32 a, a, b;",
                "mov.b32 {l, u}, a;",
                f"cvt.f32.f16 ${i}, l;",
                f"cvt.f32.f16 ${i + 4}, u;",
            )
        ]
        + ["}"]
    )
)


@triton.jit
def _e2m1_code(words, i: tl.constexpr):
    # code i of each int32 word -> fp32 value * 2^-14 (the interpreter's form of the asm)
    c = (words >> (4 * i)) & 0xF
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_words(words, ASM: tl.constexpr):
    # int32 [..] words of 8 e2m1 codes -> 8 fp32 tensors [..]: column 8j + i of word j, * 2^-14
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_WORDS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return (_e2m1_code(words, 0), _e2m1_code(words, 1), _e2m1_code(words, 2),
                _e2m1_code(words, 3), _e2m1_code(words, 4), _e2m1_code(words, 5),
                _e2m1_code(words, 6), _e2m1_code(words, 7))  # fmt: skip


@triton.jit
def _gemv_x(v_ptr, k0, BLOCK_K: tl.constexpr):
    # the GEMV form's x for k0..k0+BLOCK_K as 8 fp32 [BLOCK_K / 8] tensors: column 8j + i in the
    # i-th (the order of the codes in a word)
    v_at = v_ptr + k0 + 8 * tl.arange(0, BLOCK_K // 8)
    return (tl.load(v_at).to(tl.float32), tl.load(v_at + 1).to(tl.float32),
            tl.load(v_at + 2).to(tl.float32), tl.load(v_at + 3).to(tl.float32),
            tl.load(v_at + 4).to(tl.float32), tl.load(v_at + 5).to(tl.float32),
            tl.load(v_at + 6).to(tl.float32), tl.load(v_at + 7).to(tl.float32))  # fmt: skip


@triton.jit
def _gemv_codes(w_ptr, s_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_K: tl.constexpr):
    # read BLOCK_N * BLOCK_K / 2 packed bytes + BLOCK_N * BLOCK_K / 32 scales: the codes as int32
    # words of 8 [BLOCK_N, BLOCK_K / 8] and the scale bytes [BLOCK_N, BLOCK_K / 32]
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(
        w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_w // 4) + offs_w[None, :],
        mask=n_ok[:, None],
        other=0,
    )
    offs_g = k0 // MXFP4_BLOCK + tl.arange(0, BLOCK_K // MXFP4_BLOCK)
    sc = tl.load(s_ptr + offs_n[:, None] * stride_s + offs_g[None, :], mask=n_ok[:, None], other=0)
    return words, sc


@triton.jit
def _mxfp4_gemv(codes, v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    # codes (`_gemv_codes`) and v (`_gemv_x`) of one step -> sum_k W[n, k] v[k] per scale group:
    # fp32 [BLOCK_N, BLOCK_K / 32]. Each code is decoded once and meets its v in one fma; the
    # scale multiplies a group's sum
    words, sc = codes
    c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_words(words, ASM)
    t = c0 * v[0][None, :]
    t += c1 * v[1][None, :]
    t += c2 * v[2][None, :]
    t += c3 * v[3][None, :]
    t += c4 * v[4][None, :]
    t += c5 * v[5][None, :]
    t += c6 * v[6][None, :]
    t += c7 * v[7][None, :]
    scale = _e8m0_scale(sc.to(tl.uint8, bitcast=True))
    t = tl.sum(tl.reshape(t, (BLOCK_N, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK // 8)), 2)
    return t * scale


# ---------------------------------------------------------------------------------------------
# SwiGLU of given w1 / w3 outputs (the shared expert): one launch for the reference's ~7
# ---------------------------------------------------------------------------------------------


@triton.jit
def _swiglu(g, u, limit):
    # fp32: silu(min(g, limit)) * clamp(u, -limit, limit)
    g = tl.minimum(g, limit)
    return g * tl.sigmoid(g) * tl.minimum(tl.maximum(u, -limit), limit)


@triton.jit
def _swiglu_kernel(
    g_ptr, u_ptr, w_ptr, h_ptr, n_cols, limit, stride_g, stride_u, stride_h,
    HAS_WEIGHT: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):  # fmt: skip
    chain_start(PDL)
    # read 2 * BLOCK elements (+ 1 weight) ; write BLOCK
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    h = _swiglu(g, u, limit)
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + row).to(tl.float32)
    h = cast_rne(h, h_ptr.dtype.element_ty, RNE_BF16)
    tl.store(h_ptr + row * stride_h + cols, h, mask=ok)


def swiglu(
    g: torch.Tensor, u: torch.Tensor, limit: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    # g, u: [T, I] -> silu(min(g, limit)) * clamp(u, -limit, limit) (* weights[:, None]) in
    # g.dtype (signature and semantics of dsv4.ops.ref.swiglu)
    assert g.dim() == 2 and u.shape == g.shape, f"g, u must be [T, I] alike ({g.shape}, {u.shape})"
    assert g.stride(1) == 1 and u.stride(1) == 1, "g, u must be contiguous in I"
    assert weights is None or weights.shape == (g.shape[0],), f"weights must be [{g.shape[0]}]"
    T, n = g.shape
    h = torch.empty_like(g)
    if T == 0 or n == 0:
        return h
    block = min(1024, next_power_of_2(n))
    w = weights.contiguous() if weights is not None else g
    _swiglu_kernel[(T, cdiv(n, block))](
        g, u, w, h, n, float(limit), g.stride(0), u.stride(0), h.stride(0),
        HAS_WEIGHT=weights is not None, RNE_BF16=rne_bf16(g),
        BLOCK=block, num_warps=4, **chain(g.device),
    )  # fmt: skip
    return h


# ---------------------------------------------------------------------------------------------
# The k slots of each token summed in fp32, plus the shared expert: one launch for the reference's
# copy, sum, copy and add
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sum_slots_kernel(out_ptr, idx_ptr, shared_ptr, y_ptr, D, stride_o, stride_s, stride_y,
                      K: tl.constexpr, HAS_IDX: tl.constexpr, HAS_SHARED: tl.constexpr,
                      RNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):  # fmt: skip
    chain_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):  # slot order, as the reference's sum over dim 1
        v = tl.load(out_ptr + (t * K + j) * stride_o + cols, mask=ok).to(tl.float32)
        if HAS_IDX:  # a slot whose id is < 0 (another rank's expert): its row was never written,
            # so its values (any bits, NaN too) are dropped; read with the id, not after it
            v = tl.where(tl.load(idx_ptr + t * K + j) >= 0, v, 0.0)
        acc += v
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_s + cols, mask=ok).to(tl.float32)
    tl.store(y_ptr + t * stride_y + cols, cast_rne(acc, y_ptr.dtype.element_ty, RNE_BF16), mask=ok)


def sum_slots(
    out: torch.Tensor,
    k: int,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    # out: [T*k, D] each (token, slot) pair's expert output -> [T, D]: sum over the k slots
    # (+ shared [T, D]) in fp32, returned in out_dtype (rounded to nearest in the same launch);
    # idx [T, k]: the slots whose id is < 0 are left out (their rows of out are not read)
    P, D = out.shape
    T = P // k
    y = torch.empty((T, D), dtype=out_dtype, device=out.device)
    if T == 0:
        return y
    assert idx is None or idx.shape == (T, k), f"idx {tuple(idx.shape)} for {T} tokens x {k}"
    block = min(1024, next_power_of_2(D))
    s = shared if shared is not None else out
    ids = idx.reshape(-1).contiguous() if idx is not None else out
    _sum_slots_kernel[(T, cdiv(D, block))](
        out, ids, s, y, D, out.stride(0), s.stride(0), y.stride(0),
        K=k, HAS_IDX=idx is not None, HAS_SHARED=shared is not None,
        RNE_BF16=rne_bf16(out, out_dtype), BLOCK=block, num_warps=4,
        **chain(out.device),
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# Gate/up: h = silu(min(x W1^T, l)) * clamp(x W3^T, -l, l) * weight
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_rows(rows_ptr, pid_m, offs_m, BLOCK_M: tl.constexpr, GEMV: tl.constexpr):
    # the row-block's pair ids: its run of `align_rows`'s rows, or (GEMV: one pair per row-block,
    # in pair order, no align_rows) the block's own index
    if GEMV:
        rows = pid_m * BLOCK_M + offs_m
    else:
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + offs_m).to(tl.int32)
    return rows


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,  # [T, D] bf16/fp16/fp32 (D contiguous)
    rw_ptr,  # [T*k] fp32 routing weights, pair p = t*k + j
    rows_ptr,  # [NB*BLOCK_M] int32 pair ids per row-block, -1 = padding
    blk_ptr,  # [NB] int32 expert of each row-block, -1 = past the real count (GEMV: the router's int64 ids)
    tbl_ptr,  # [6, E] int64 offsets in UNIT bytes: w1, w3 (from wbase), s1, s3 (from sbase), ...
    wbase_ptr,  # int8: expert 0's w1 ; packed weights int8 [out, in/2] lie at wbase + UNIT * off
    sbase_ptr,  # uint8: expert 0's w1 scale ; e8m0 scales [out, in/32] lie at sbase + UNIT * off
    h_ptr,  # [T*k, I] x.dtype
    N,  # inter
    K,  # D
    E,
    limit,
    tune_key,  # autotune bucket of the row-block count (unused in the body)
    stride_xt,
    stride_ht,
    stride_w,  # K / 2
    stride_s,  # K / 32
    TOPK: tl.constexpr,
    UNIT: tl.constexpr,  # 16 when every weight and scale address is 16-byte aligned (vector loads)
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter / fp32 x)
    RNE_BF16: tl.constexpr,  # round to bf16 on the bits (interpreter)
    PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr,  # tl.dot_scaled on the packed codes instead of _mxfp4_tile
    X_FMT: tl.constexpr,  # x's format for tl.dot_scaled: "bf16" / "fp16"
    GEMV: tl.constexpr,  # BLOCK_M = 1: products and sums on the CUDA cores, no dot
    ASM: tl.constexpr,  # GEMV: decode the codes by inline PTX (a GPU; the interpreter has none)
    PREFETCH: tl.constexpr,  # GEMV: load the next step's codes and x before this step's math
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_N rows of W1 and W3 (K/2 + K/32 B each) + BLOCK_M x rows ; write BLOCK_M x BLOCK_N
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)

    # ---- the block's pairs and its expert's weights
    offs_m = tl.arange(0, BLOCK_M)
    rows = _block_rows(rows_ptr, pid_m, offs_m, BLOCK_M, GEMV)
    r_ok = rows >= 0
    pair = tl.where(r_ok, rows, 0).to(tl.int64)
    tok = pair // TOPK
    w1_ptr = wbase_ptr + tl.load(tbl_ptr + W1 * E + e) * UNIT
    w3_ptr = wbase_ptr + tl.load(tbl_ptr + W3 * E + e) * UNIT
    s1_ptr = sbase_ptr + tl.load(tbl_ptr + S1 * E + e) * UNIT
    s3_ptr = sbase_ptr + tl.load(tbl_ptr + S3 * E + e) * UNIT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # ---- x [BLOCK_M, K] . W1^T, W3^T [K, BLOCK_N]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_g = tl.zeros((BLOCK_N, BLOCK_K // MXFP4_BLOCK), dtype=tl.float32)  # GEMV: group sums
    part_u = tl.zeros((BLOCK_N, BLOCK_K // MXFP4_BLOCK), dtype=tl.float32)
    x_rows = x_ptr + tok[:, None] * stride_xt
    x_one = x_ptr + (tl.max(rows, 0) // TOPK).to(tl.int64) * stride_xt  # GEMV's x row (BLOCK_M 1)
    # GEMV: the one pair's x row against the [BLOCK_N, BLOCK_K] codes, on the CUDA cores; with
    # PREFETCH the next step's codes and x load before this step's math (the last step reloads
    # its own, from L1 / L2)
    if GEMV and PREFETCH:
        xv = _gemv_x(x_one, 0, BLOCK_K)
        cg = _gemv_codes(w1_ptr, s1_ptr, offs_n, n_ok, 0, stride_w, stride_s, BLOCK_K)
        cu = _gemv_codes(w3_ptr, s3_ptr, offs_n, n_ok, 0, stride_w, stride_s, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if GEMV:
            if PREFETCH:
                kn = tl.minimum(k0 + BLOCK_K, K - BLOCK_K)
                xv_k, cg_k, cu_k = xv, cg, cu
                xv = _gemv_x(x_one, kn, BLOCK_K)
                cg = _gemv_codes(w1_ptr, s1_ptr, offs_n, n_ok, kn, stride_w, stride_s, BLOCK_K)
                cu = _gemv_codes(w3_ptr, s3_ptr, offs_n, n_ok, kn, stride_w, stride_s, BLOCK_K)
            else:
                xv_k = _gemv_x(x_one, k0, BLOCK_K)
                cg_k = _gemv_codes(w1_ptr, s1_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_K)
                cu_k = _gemv_codes(w3_ptr, s3_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_K)
            part_g += _mxfp4_gemv(cg_k, xv_k, BLOCK_N, BLOCK_K, ASM)
            part_u += _mxfp4_gemv(cu_k, xv_k, BLOCK_N, BLOCK_K, ASM)
        elif DOT_SCALED:  # the compiler's e2m1 decode and scale (exact in bf16), then the dot
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            bg, sg = _mxfp4_raw(w1_ptr, s1_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N,
                                BLOCK_K)  # fmt: skip
            bu, su = _mxfp4_raw(w3_ptr, s3_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N,
                                BLOCK_K)  # fmt: skip
            acc_g = tl.dot_scaled(x, None, X_FMT, tl.trans(bg), sg, "e2m1", acc_g, fast_math=True)
            acc_u = tl.dot_scaled(x, None, X_FMT, tl.trans(bu), su, "e2m1", acc_u, fast_math=True)
        else:
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            wg = _mxfp4_tile(w1_ptr, s1_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N, BLOCK_K)
            wu = _mxfp4_tile(w3_ptr, s3_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N, BLOCK_K)
            if UPCAST:
                x = x.to(tl.float32)
            else:  # e2m1 * 2^k is exact in bf16/fp16 (in range)
                wg = wg.to(x.dtype)
                wu = wu.to(x.dtype)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)

    if GEMV:
        acc_g = tl.reshape(tl.sum(part_g, 1), (BLOCK_M, BLOCK_N))
        acc_u = tl.reshape(tl.sum(part_u, 1), (BLOCK_M, BLOCK_N))

    # ---- epilogue: the linears' x.dtype outputs, clamp, silu * u, routing weight -> x.dtype
    out_ty = h_ptr.dtype.element_ty
    g = cast_rne(acc_g, out_ty, RNE_BF16).to(tl.float32)
    u = cast_rne(acc_u, out_ty, RNE_BF16).to(tl.float32)
    rw = tl.load(rw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
    h = _swiglu(g, u, limit) * rw[:, None]
    h_ptrs = h_ptr + pair[:, None] * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, cast_rne(h, out_ty, RNE_BF16), mask=r_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Down: out = h W2^T per pair
# ---------------------------------------------------------------------------------------------


@triton.jit
def _moe_down_kernel(
    h_ptr,  # [T*k, I] x.dtype
    rows_ptr,  # [NB*BLOCK_M] int32 pair ids, -1 = padding
    blk_ptr,  # [NB] int32 expert per row-block, -1 = none (GEMV: the router's int64 ids)
    tbl_ptr,  # [6, E] int64 offsets in UNIT bytes (see _moe_gate_up_kernel)
    wbase_ptr,
    sbase_ptr,
    out_ptr,  # [T*k, D] x.dtype
    N,  # D
    K,  # inter
    E,
    tune_key,
    stride_ht,
    stride_ot,
    stride_w,  # K / 2
    stride_s,  # K / 32
    UNIT: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr,  # tl.dot_scaled on the packed codes instead of _mxfp4_tile
    X_FMT: tl.constexpr,  # x's format for tl.dot_scaled: "bf16" / "fp16"
    GEMV: tl.constexpr,  # BLOCK_M = 1: products and sums on the CUDA cores, no dot
    ASM: tl.constexpr,  # GEMV: decode the codes by inline PTX (a GPU; the interpreter has none)
    PREFETCH: tl.constexpr,  # GEMV: load the next step's codes and x before this step's math
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_N rows of W2 (K/2 + K/32 B each) + BLOCK_M h rows ; write BLOCK_M x BLOCK_N
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)

    # ---- the block's pairs and its expert's W2
    offs_m = tl.arange(0, BLOCK_M)
    rows = _block_rows(rows_ptr, pid_m, offs_m, BLOCK_M, GEMV)
    r_ok = rows >= 0
    pair = tl.where(r_ok, rows, 0).to(tl.int64)
    w2_ptr = wbase_ptr + tl.load(tbl_ptr + W2 * E + e) * UNIT
    s2_ptr = sbase_ptr + tl.load(tbl_ptr + S2 * E + e) * UNIT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # ---- h [BLOCK_M, K] . W2^T [K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_K // MXFP4_BLOCK), dtype=tl.float32)  # GEMV: group sums
    h_rows = h_ptr + pair[:, None] * stride_ht
    h_one = h_ptr + tl.max(rows, 0).to(tl.int64) * stride_ht  # GEMV's h row (BLOCK_M 1)
    if GEMV and PREFETCH:  # as in the gate-up kernel
        hv = _gemv_x(h_one, 0, BLOCK_K)
        c2 = _gemv_codes(w2_ptr, s2_ptr, offs_n, n_ok, 0, stride_w, stride_s, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if GEMV:
            if PREFETCH:
                kn = tl.minimum(k0 + BLOCK_K, K - BLOCK_K)
                hv_k, c2_k = hv, c2
                hv = _gemv_x(h_one, kn, BLOCK_K)
                c2 = _gemv_codes(w2_ptr, s2_ptr, offs_n, n_ok, kn, stride_w, stride_s, BLOCK_K)
            else:
                hv_k = _gemv_x(h_one, k0, BLOCK_K)
                c2_k = _gemv_codes(w2_ptr, s2_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_K)
            part += _mxfp4_gemv(c2_k, hv_k, BLOCK_N, BLOCK_K, ASM)
        elif DOT_SCALED:
            h = tl.load(h_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            b, sc = _mxfp4_raw(w2_ptr, s2_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N,
                               BLOCK_K)  # fmt: skip
            acc = tl.dot_scaled(h, None, X_FMT, tl.trans(b), sc, "e2m1", acc, fast_math=True)
        else:
            h = tl.load(h_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            w = _mxfp4_tile(w2_ptr, s2_ptr, offs_n, n_ok, k0, stride_w, stride_s, BLOCK_N, BLOCK_K)
            if UPCAST:
                h = h.to(tl.float32)
            else:
                w = w.to(h.dtype)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)

    if GEMV:
        acc = tl.reshape(tl.sum(part, 1), (BLOCK_M, BLOCK_N))
    o_ptrs = out_ptr + pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(
        o_ptrs,
        cast_rne(acc, out_ptr.dtype.element_ty, RNE_BF16),
        mask=r_ok[:, None] & n_ok[None, :],
    )


_gate_up_tuned = autotune(_configs(), ["N", "K", "tune_key"], _prune)(_moe_gate_up_kernel)
_down_tuned = autotune(_configs(), ["N", "K", "tune_key"], _prune)(_moe_down_kernel)


# ---------------------------------------------------------------------------------------------
# Host side: address tables (cached per ModuleList) and the routing alignment
# ---------------------------------------------------------------------------------------------

# ModuleList -> (probe, table): the probe catches parameters moved or replaced since the build
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_params() -> None:
    """Drop what was derived from the experts' parameters (`ops.forget_params`): the address
    tables (after sleep mode every expert's storage lies elsewhere, and their probe sees only the
    first and the last expert) and the sm_90 kernels' scale check (a weight update may write
    any expert's scales; its probe sees the first and the last)."""
    _TABLES.clear()
    sm90 = sys.modules.get("dsv4.ops.moe_sm90")  # (imported only on sm_90)
    if sm90 is not None:
        sm90._SCALES.clear()


def _probe(experts: torch.nn.ModuleList) -> tuple:
    first, last = experts[0], experts[-1]
    return (
        len(experts),
        first.w1.weight.data_ptr(),
        first.w1.weight.device,
        last.w2.weight.data_ptr(),
        last.w2.scale.data_ptr(),
    )


class ExpertTable(NamedTuple):
    """Where each expert's MXFP4 tensors lie: base + unit * offset, per expert and tensor."""

    offs: torch.Tensor  # int64 [6, E]: w1, w3, w2 from wbase ; s1, s3, s2 from sbase (in units)
    unit: int  # 16 when every address is 16-byte aligned, else 1
    wbase: torch.Tensor  # int8: expert 0's w1 weight
    sbase: torch.Tensor  # uint8 view of expert 0's w1 scale


def expert_table(experts: torch.nn.ModuleList) -> ExpertTable:
    """The MXFP4 tensors' offsets of every expert (all "fp4" with the same shapes), built once per
    ModuleList and reused while its parameters stay where they are."""
    probe = _probe(experts)
    hit = _TABLES.get(experts)
    if hit is not None and hit[0] == probe:
        return hit[1]
    e0 = experts[0]
    shapes = [(lin.weight.shape, lin.scale.shape) for lin in (e0.w1, e0.w3, e0.w2)]
    addrs = []
    for i, ex in enumerate(experts):
        lins = (ex.w1, ex.w3, ex.w2)
        for lin, (ws, ss) in zip(lins, shapes):
            assert lin.fmt == "fp4", f"expert {i}: weight format {lin.fmt!r} is not 'fp4'"
            assert lin.weight.dtype == torch.int8 and lin.weight.shape == ws, (
                f"expert {i}: packed weight {lin.weight.dtype} {tuple(lin.weight.shape)} "
                f"(expected int8 {tuple(ws)})"
            )
            assert lin.scale.dtype == torch.float8_e8m0fnu and lin.scale.shape == ss, (
                f"expert {i}: scale {lin.scale.dtype} {tuple(lin.scale.shape)} "
                f"(expected float8_e8m0fnu {tuple(ss)})"
            )
            assert lin.weight.is_contiguous() and lin.scale.is_contiguous(), (
                f"expert {i}: weight/scale must be contiguous"
            )
            assert lin.weight.device == e0.w1.weight.device, (
                f"expert {i} is on {lin.weight.device}, expert 0 on {e0.w1.weight.device}"
            )
        addrs.append(
            [lin.weight.data_ptr() for lin in lins] + [lin.scale.data_ptr() for lin in lins]
        )
    wbase, sbase = e0.w1.weight, e0.w1.scale.view(torch.uint8)
    a = torch.tensor(addrs, dtype=torch.int64).t()  # [6, E] addresses
    a[:3] -= wbase.data_ptr()
    a[3:] -= sbase.data_ptr()
    unit = (
        16
        if bool((a % 16 == 0).all()) and wbase.data_ptr() % 16 == sbase.data_ptr() % 16 == 0
        else 1
    )
    table = ExpertTable((a // unit).contiguous().to(wbase.device), unit, wbase, sbase)
    _TABLES[experts] = (probe, table)
    return table


def num_row_blocks(pairs: int, n_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(count_e / block_m) over the experts that receive pairs."""
    used = min(n_experts, pairs)
    return (pairs + used * (block_m - 1)) // block_m


ALIGN_MAX_PAIRS = 1024  # pairs up to which align_rows is one Triton program (decode, verify)


@triton.jit(do_not_specialize=["P", "NB"])  # per-step counts: one compile
def _align_rows_kernel(
    idx_ptr,  # [P] int64 expert of each pair (pair p = t*k + j), < 0: none (left out)
    rows_ptr,  # [NB*BLOCK_M] int32 out: pair ids grouped by expert, -1 padding
    experts_ptr,  # [NB] int32 out: expert of each row-block, -1 past the real ones
    scratch_ptr,  # [2*E_PAD] int32: each expert's first block and first pair (gathered back)
    P,
    NB,
    E_PAD: tl.constexpr,  # >= the expert count, power of 2
    P_PAD: tl.constexpr,  # >= P, power of 2
    R_PAD: tl.constexpr,  # >= NB*BLOCK_M, power of 2
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # the torch form below in one program: counts by histogram, block / pair offsets by prefix
    # sums, the pairs ordered by (expert, pair id) in one sort, then scattered to their rows.
    # Pairs with an id < 0 count as padding: in no histogram bin, sorted last, never stored
    offs = tl.arange(0, P_PAD)
    e = tl.load(idx_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
    ok = e >= 0
    e = tl.maximum(e, 0)
    counts = tl.histogram(e, E_PAD, mask=ok)  # [E_PAD]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    offs_e = tl.arange(0, E_PAD)
    tl.store(scratch_ptr + offs_e, tl.cumsum(blocks, 0) - blocks)  # first block of each expert
    tl.store(scratch_ptr + E_PAD + offs_e, tl.cumsum(counts, 0) - counts)  # its first pair
    offs_r = tl.arange(0, R_PAD)
    tl.store(rows_ptr + offs_r, tl.full([R_PAD], -1, tl.int32), mask=offs_r < NB * BLOCK_M)
    tl.store(experts_ptr + offs_r, tl.full([R_PAD], -1, tl.int32), mask=offs_r < NB)

    # sorted by expert, then pair id (stable): key e * P_PAD + p, padding sorts last
    key = tl.sort(tl.where(ok, e * P_PAD + offs, E_PAD * P_PAD), 0)
    ok_s = key < E_PAD * P_PAD
    e_s = key // P_PAD
    tl.debug_barrier()  # scratch and the -1 fills are written before they are read / overwritten
    first_block = tl.load(scratch_ptr + e_s, mask=ok_s, other=0)
    first_pair = tl.load(scratch_ptr + E_PAD + e_s, mask=ok_s, other=0)
    pos = first_block * BLOCK_M + (offs - first_pair)  # sorted position - first pair = rank
    tl.store(rows_ptr + pos, key % P_PAD, mask=ok_s)
    tl.store(experts_ptr + pos // BLOCK_M, e_s, mask=ok_s)  # a block's pairs write the same value


def align_rows(
    idx: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] expert ids -> (rows int32 [NB*block_m] pair ids grouped by expert, each expert's run
    padded with -1 to a multiple of block_m ; experts int32 [NB], -1 past the real blocks).
    NB = num_row_blocks(T*k, E, block_m); device ops only, no host sync. Up to ALIGN_MAX_PAIRS
    pairs one Triton launch, else ~15 torch launches. Pairs whose id is < 0 (expert parallelism:
    another rank's expert) are in no row; NB stays a bound (fewer pairs, fewer blocks)."""
    flat = idx.reshape(-1)
    P, dev = flat.numel(), flat.device
    NB = num_row_blocks(P, n_experts, block_m)
    if 0 < P <= ALIGN_MAX_PAIRS:
        rows = torch.empty(NB * block_m, dtype=torch.int32, device=dev)
        experts = torch.empty(NB, dtype=torch.int32, device=dev)
        e_pad = next_power_of_2(n_experts)
        scratch = torch.empty(2 * e_pad, dtype=torch.int32, device=dev)
        _align_rows_kernel[(1,)](
            flat.long().contiguous(), rows, experts, scratch, P, NB,
            E_PAD=e_pad, P_PAD=next_power_of_2(P),
            R_PAD=next_power_of_2(NB * block_m), BLOCK_M=block_m, num_warps=4,
            **chain(dev),
        )  # fmt: skip
        return rows, experts
    # the pairs with an id < 0 as an extra expert n_experts: sorted last, their rows written to
    # one spare slot past the end (cut off), as are their blocks' experts
    flat = flat.long()
    flat = torch.where(flat < 0, n_experts, flat)
    order = flat.argsort(stable=True)  # pair ids sorted by expert
    e_sorted = flat[order]
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    first_block = blocks.cumsum(0) - blocks  # exclusive prefix sums
    first_pair = counts.cumsum(0) - counts
    rank = torch.arange(P, device=dev) - first_pair[e_sorted]
    pos = first_block[e_sorted] * block_m + rank  # padded row of each sorted pair
    pos = torch.where(e_sorted < n_experts, pos, NB * block_m)  # left out: the spare slot
    rows = torch.full((NB * block_m + 1,), -1, dtype=torch.int32, device=dev)
    rows[pos] = order.to(torch.int32)
    experts = torch.full((NB + 1,), -1, dtype=torch.int32, device=dev)
    experts[pos // block_m] = e_sorted.to(torch.int32)  # duplicates write the same value
    return rows[:-1], experts[:-1]


def gemv_config(pairs: int, D: int, I: int) -> dict:  # noqa: E741
    """The GEMV form's tiles for `pairs` (token, slot) pairs: GEMV_CONFIG_ONE up to 8 pairs, else
    GEMV_CONFIG, BLOCK_K halved until it divides D and I (multiples of 32)."""
    config = dict(GEMV_CONFIG_ONE if pairs <= 8 else GEMV_CONFIG)
    while D % config["BLOCK_K"] or I % config["BLOCK_K"]:
        config["BLOCK_K"] //= 2
    return config


def _sm90(x: torch.Tensor, pairs: int, D: int, I: int, table: ExpertTable,  # noqa: E741
          experts: torch.nn.ModuleList) -> bool:  # fmt: skip
    # the Gluon kernels of `moe_sm90` by default: they can run (an sm_90 GPU, ...), the pair count
    # is in their range and every scale in theirs (checked once per expert set)
    if not x.is_cuda:
        return False
    from dsv4.ops import moe_sm90  # Gluon (no interpreter): Hopper GPUs only

    return (
        moe_sm90.MIN_PAIRS <= pairs <= moe_sm90.MAX_PAIRS
        and moe_sm90.supported(x, D, I, table.unit)
        and moe_sm90.scales_in_range(experts)
    )


def _fp4(experts: torch.nn.ModuleList) -> bool:
    e0 = experts[0]
    return all(getattr(e0, n).fmt == "fp4" for n in ("w1", "w3", "w2"))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    experts: torch.nn.ModuleList,
    config: dict | None = None,
    dot_scaled: bool | None = None,
    gemv: bool | None = None,
    sm90: bool | None = None,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    # x: [T, D] ; weights: [T, k] fp32 ; idx: [T, k] int64 in [0, E) or -1 -> [T, D] out_dtype
    # (the sum in fp32, then cast), plus shared [T, D] (the shared expert's output) when given, in
    # the launch that sums the k slots. An id of -1 (expert parallelism: the pair's expert lives
    # on another rank, experts holding this rank's only) contributes nothing: no row-block
    # computes the pair and the slot sum leaves its (unwritten) row out
    # (config: fixed tiles instead of the autotuner, BLOCK_M among them ; dot_scaled:
    # tl.dot_scaled instead of the kernels' own decode, default from DOT_SCALED_MIN_PAIRS pairs
    # of bf16/fp16 x on a GPU ;
    # gemv: one pair per row-block, products on the CUDA cores, default up to GEMV_MAX_PAIRS pairs
    # on a GPU ; sm90: the Gluon kernels of `moe_sm90`, default where they apply and no other
    # knob is given -- knobs for bench/probe_pieces.py and the tests)
    if len(experts) == 0 or not _fp4(experts) or x.dtype not in _DOT_TYPES:
        return ref.moe_experts(x, weights, idx, experts, shared, out_dtype)

    # ---- check
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, D] rows (shape {tuple(x.shape)})"
    T, D = x.shape
    assert idx.dim() == 2 and idx.shape[0] == T, f"idx {tuple(idx.shape)} vs x {tuple(x.shape)}"
    assert weights.shape == idx.shape, f"weights {tuple(weights.shape)} vs idx {tuple(idx.shape)}"
    assert weights.is_floating_point(), f"weights dtype {weights.dtype} is not floating"
    assert not idx.is_floating_point(), f"idx dtype {idx.dtype} is not an integer type"
    e0 = experts[0]
    I = e0.w1.weight.shape[0]  # noqa: E741
    assert e0.w1.weight.shape[1] * 2 == D, f"experts take dim {e0.w1.weight.shape[1] * 2}, x {D}"
    assert D % 32 == 0 and I % 32 == 0, f"dim {D} and inter {I} must be multiples of 32"
    E, k = len(experts), idx.shape[1]
    table = expert_table(experts)
    assert table.offs.device == x.device, f"experts on {table.offs.device}, x on {x.device}"

    # ---- allocate
    P = T * k
    assert shared is None or (shared.shape == (T, D) and shared.stride(1) == 1), (
        f"shared must be [{T}, {D}] rows (got {tuple(shared.shape)})"
    )
    if P == 0:
        y = torch.zeros((T, D), dtype=torch.float32, device=x.device)
        return (y if shared is None else y + shared.float()).to(out_dtype)
    rw = weights.reshape(-1).float().contiguous()  # [P] fp32
    if sm90 is None:
        sm90 = (
            config is None
            and dot_scaled is None
            and gemv is None
            and _sm90(x, P, D, I, table, experts)
        )
    elif sm90:  # asked for: a clear error where the kernels cannot run
        from dsv4.ops import moe_sm90

        assert moe_sm90.supported(x, D, I, table.unit), (
            f"sm90 experts: need an sm_90 GPU, bf16 x, dim / inter multiples of "
            f"{moe_sm90.CONFIG['BLOCK_K']} and 16-byte aligned experts (x {x.dtype} on {x.device}, "
            f"dim {D}, inter {I}, alignment {table.unit})"
        )
        assert moe_sm90.scales_in_range(experts), (
            f"sm90 experts: an e8m0 scale outside [{moe_sm90.SCALE_MIN}, {moe_sm90.SCALE_MAX}]"
        )
    if sm90:
        from dsv4.ops import moe_sm90  # Gluon (no interpreter): Hopper GPUs only

        rows, blk = align_rows(idx, E, moe_sm90.block_m(P))
        out = moe_sm90.experts(x, rw, rows, blk, table, k, I, float(e0.limit))
        return sum_slots(out, k, shared, out_dtype, idx)
    # the GEMV form loads the codes as 32-bit words: every expert's tensors 16-byte aligned
    if gemv is None:
        gemv = x.is_cuda and P <= GEMV_MAX_PAIRS and table.unit == 16
    assert not (gemv and x.is_cuda and table.unit != 16), "gemv: expert weights not 16-B aligned"
    block_m = 1 if gemv else (config or {}).get("BLOCK_M") or (16 if P < 2048 else 64)
    if gemv:  # one pair per row-block, in pair order: the router's ids are the blocks' experts
        # (an id < 0 is a block that exits at once, as align_rows's padding blocks)
        rows = blk = idx.reshape(-1)
    else:
        rows, blk = align_rows(idx, E, block_m)
    NB = blk.numel()
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    out = torch.empty((P, D), dtype=x.dtype, device=x.device)

    # ---- launch: gate/up, then down; the k slots are summed in fp32
    upcast = x.device.type != "cuda" or x.dtype == torch.float32
    if dot_scaled is None:
        dot_scaled = x.is_cuda and P >= DOT_SCALED_MIN_PAIRS
    scaled = dot_scaled and x.dtype != torch.float32 and not gemv
    consts = dict(UPCAST=upcast, RNE_BF16=rne_bf16(x), PRECISION="ieee", BLOCK_M=block_m, UNIT=table.unit,
                  DOT_SCALED=scaled, X_FMT="bf16" if x.dtype == torch.bfloat16 else "fp16",
                  GEMV=gemv, ASM=gemv and x.is_cuda, PREFETCH=False) | chain(x.device)  # fmt: skip
    tune_key = NB.bit_length()
    limit = float(e0.limit)

    def grid(n: int):  # noqa: ANN202
        return lambda meta: (NB, cdiv(n, meta["BLOCK_N"]))

    tbl = (table.offs, table.wbase, table.sbase)
    args1 = (
        x, rw, rows, blk, *tbl, h, I, D, E, limit, tune_key,
        x.stride(0), h.stride(0), D // 2, D // 32,
    )  # fmt: skip
    args2 = (
        h, rows, blk, *tbl, out, D, I, E, tune_key,
        h.stride(0), out.stride(0), I // 2, I // 32,
    )  # fmt: skip
    fits = D % DOT_SCALED_CONFIG["BLOCK_K"] == I % DOT_SCALED_CONFIG["BLOCK_K"] == 0
    if config is None and scaled and fits:
        config = DOT_SCALED_CONFIG
    if config is None and gemv and x.device.type == "cuda":
        config = gemv_config(P, D, I)
    if config is None and x.device.type == "cuda":
        _gate_up_tuned[grid(I)](*args1, TOPK=k, **consts)
        _down_tuned[grid(D)](*args2, **consts)
    else:
        bk = 32 if x.device.type != "cuda" else 128
        cfg = {"BLOCK_N": 64, "BLOCK_K": bk, "num_warps": 4, "num_stages": 1} | (config or {})
        assert D % cfg["BLOCK_K"] == 0 and I % cfg["BLOCK_K"] == 0, f"bad config {cfg}"
        _moe_gate_up_kernel[grid(I)](*args1, TOPK=k, **(consts | cfg))
        _moe_down_kernel[grid(D)](*args2, **(consts | cfg))
    return sum_slots(out, k, shared, out_dtype, idx)
