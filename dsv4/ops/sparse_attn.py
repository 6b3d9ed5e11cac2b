"""Sparse attention over index lists: shared K=V rows gathered through `topk_idxs`, sink, scale.

  sparse_attn(q, kv, attn_sink, topk_idxs, scale) -> o      (signature of `dsv4.ops.ref.sparse_attn`)

All H heads of a query token run on the tensor cores together: S = Q[H, D] . K[BLOCK_N, D]^T with
M = H, then O += P . K (the gathered row is both key and value). Key rows are gathered from up to
three sources (window ring | new tokens | paged compressed entries) addressed as one concatenation,
picking the source by index range, so the paged pool is never copied. When T is small the key list
of a token is split across programs for occupancy (flash-decoding): each split writes its running
(max, sum, unnormalised output) in fp32 and a combine kernel merges them with the sink. When T is
large (prefill) one program per token walks all its keys and writes o directly. Rows may be FP8
state entries (uint8, `--kv-cache-dtype fp8`): the gather decodes them exactly (`kv_fp8`).

On an sm_90 GPU, from SM90_MIN_TOKENS tokens of 64 x 512 bf16 heads (decode steps and prefill
chunks alike; FP8 entries from SM90_MIN_TOKENS_FP8), the launcher hands over to the Gluon kernel
in `sparse_attn_sm90`, which splits each key tile between the two warpgroups (Triton cannot
express that layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.device import (
    autotune,
    cdiv,
    chain,
    chain_start,
    next_power_of_2,
    num_sms,
    pdl,
    shared_memory,
)
from dsv4.ops.kv_fp8 import decode_mode, load_entries
from dsv4.ops.rope import check_rope, rotary, rotate_tile
from dsv4.quant import kv_entry_layout

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = (
    32  # measured on an H200: T=1, K=640 is fastest at 20 splits (13.3 vs 14.4 us at 10)
)
FIXED_TILE_MAX_PROGRAMS = 2  # up to this many 64-head (token, head block)s: FEW_TOKENS_TILE(_FP8)
FEW_TOKENS_TILE = dict(BLOCK_N=32, DV_SPLIT=1, BLOCK_H=16, KEYS_ON_M=False, PREFETCH=False,
                       num_warps=4, num_stages=2)  # fmt: skip
# over FP8 entries: the output channels split over two programs, no pipelining (H200, T=1: 9.39
# us against 10.43 for FEW_TOKENS_TILE, which takes 128 KB of shared memory there)
FEW_TOKENS_TILE_FP8 = dict(BLOCK_N=32, DV_SPLIT=2, BLOCK_H=16, KEYS_ON_M=False, PREFETCH=False,
                           num_warps=4, num_stages=1)  # fmt: skip
# Shared memory a fixed tile takes (the most of sm_90, sm_100 and sm_120 with Triton 3.6 and 3.9:
# tests/ops/test_targets.py compiles them). Triton does not shrink a config to fit, so a GPU
# with less (sm_120: 99 KB) autotunes instead of failing to launch
FEW_TOKENS_SHARED = 52 * 1024  # 49.1 KB
FEW_TOKENS_FP8_SHARED = 68 * 1024  # 64 KB
# from this many tokens on an sm_90 GPU, 64 x 512 heads: the Gluon kernel
# (dsv4/ops/sparse_attn_sm90.py). bf16 rows: H200, T=64: 30.5 vs 39.1 us, T=16: 19.2 vs 17.5;
# a 4096-token prefill chunk's three sources (CSA, 128 + 512 keys) 1178 vs 2036 us.
# FP8 entries (decoded in shared memory): T=64 40.9 vs 65.1, T=16 21.7 vs 28.6, T=1 18.1 vs 10.3
SM90_MIN_TOKENS = 32
SM90_MIN_TOKENS_FP8 = 16
WINDOW_KEYS = (
    128  # a sliding window's keys (prefill tiles are tuned for at most this many, or more)
)
PROGRAMS_PER_SPLIT = 2  # H200, T=16: 21.9 vs 23.35 us with 1; T=1 and T=64 the same
# FP8 entries on a GPU: `kv_fp8.load_entries`' DECODE (None: `fp8_decode`'s choice)
FP8_DECODE = None
# FP8 entries from this many 64-head programs on a GPU the Gluon kernel does not take (not sm_90,
# several kv sources): keys on the MMA rows (the decoded tile is
# operand A, and unlike the other tiles the gathers keep cp.async in the sm_90 PTX), the SMs
# filled once (H200, T=64: 64.8 us with 2 splits, 110.4 with 1, autotuned 83.2; T=16 stays
# autotuned: 28.5 vs 35.5)
FP8_MANY_TOKENS = 32
FP8_MANY_TOKENS_TILE = dict(BLOCK_N=32, DV_SPLIT=1, BLOCK_H=64, KEYS_ON_M=True, PREFETCH=False,
                            num_warps=8, num_stages=3)  # fmt: skip
FP8_MANY_TOKENS_SHARED = 180 * 1024  # sm_90 148.3 KB, sm_100 / sm_120 176.3 KB
# finite "no key yet" running max: empty splits and all -1 rows stay NaN-free
NEG = tl.constexpr(-1.0e30)


# Autotune tiles for GPUs with 99 KB of shared memory (sm_120): over FP8 entries every tile of
# _configs takes 114-344 KB there (the decoded [BN, 512] tile is staged in shared memory once per
# dot operand), so without these an sm_120 GPU had no config to run FP8 state on. sm_120, Triton
# 3.9: 72 / 80 / 96 / 64 KB over FP8 entries (tests/ops/test_targets.py); not timed on sm_120.
# GPUs with SMALL_SHARED_ABOVE bytes per program or more autotune without them (_prune)
SMALL_SHARED_ABOVE = 200 * 1024
SMALL_SHARED_SHAPES = [
    (16, 1, 16, 4, 2, False, False),
    (32, 1, 16, 4, 1, False, False),
    (16, 1, 64, 4, 1, False, False),
    (32, 2, 16, 4, 1, False, False),
]


def _configs() -> list[triton.Config]:
    # BLOCK_N keys per step ; DV_SPLIT programs share the output channels of one (token, split) ;
    # BLOCK_H heads per program (64 = all heads of a token; 16 / 32 = more, shorter programs, the
    # gathered rows re-read from L2 by each head block: what a single token wants).
    # DV_SPLIT=1: the [64, 512] fp32 accumulator takes 8 warps (128 regs/thread); Triton gives S
    # (a dot feeding a dot) warps along M only, so both warpgroups compute all of S.
    # DV_SPLIT=2: 4 warps hold half the accumulator each and both programs recompute S.
    # Shared memory at H=64, D=512 bf16: Q 64 KB + (num_stages - 1) * BLOCK_N KB of gathered
    # rows, so (16, 2, 4, 2) fits two programs per SM. Spills on sm_90 (Triton 3.6, ptxas 13.0):
    # none except (64, 1|2, 64): 8 / 16 B, (32, 1, 32): 96 B, (64, 1, 16): 208 B.
    shapes = [  # (BLOCK_N, DV_SPLIT, BLOCK_H, num_warps, num_stages, KEYS_ON_M, PREFETCH)
        (16, 1, 64, 8, 3, False, False),
        (32, 1, 64, 8, 3, False, False),
        (64, 1, 64, 8, 3, False, False),
        (16, 2, 64, 4, 2, False, False),
        (32, 2, 64, 4, 3, False, False),
        (64, 2, 64, 4, 3, False, False),
        (32, 1, 16, 4, 2, False, False),
        (32, 1, 32, 4, 2, False, False),
        (64, 1, 16, 4, 2, False, False),
        (32, 2, 16, 4, 2, False, False),
        # keys on the MMA rows: the [512, 64] accumulator O^T splits over the warpgroups along
        # the channels and S^T [BN, 64] is an operand B (shared memory), not a register operand
        # A, so Triton need not give every warpgroup all of S (not yet timed on a GPU).
        # sm_90 with Triton 3.6 + ptxas 13.0: 205 / 103 / 206 / 50 KB of shared memory; 56, 0,
        # 48, 0 bytes spilled ((128, 1, 64, 8, 1) spilled 312 B and was dropped)
        (64, 1, 64, 8, 2, True, False),
        (32, 1, 64, 8, 3, True, False),
        (64, 2, 64, 4, 3, True, False),
        (32, 1, 16, 4, 2, True, False),
        # PREFETCH: the indices of tile i+1 come from a plain load in iteration i (loop-carried),
        # so the pipeliner sees the row gather as an ordinary load and keeps num_stages - 1 tiles
        # in flight (without it, Triton 3.6 waits for every copy at the top of each iteration)
        (32, 1, 64, 8, 4, False, True),
        (32, 1, 64, 8, 3, False, True),
        (16, 1, 64, 8, 6, False, True),
        (32, 2, 64, 4, 4, False, True),
        (32, 1, 16, 4, 4, False, True),
        (64, 1, 16, 4, 3, False, True),
        *SMALL_SHARED_SHAPES,
    ]
    return [
        triton.Config(
            {"BLOCK_N": n, "DV_SPLIT": dv, "BLOCK_H": bh, "KEYS_ON_M": km, "PREFETCH": pf},
            num_warps=w,
            num_stages=st,
        )
        for n, dv, bh, w, st, km, pf in shapes
    ]


def shape_tile(shape: tuple) -> dict:
    """A row of _configs' shapes (BLOCK_N, DV_SPLIT, BLOCK_H, warps, stages, KEYS_ON_M, PREFETCH)
    as a tile for `sparse_attn(..., config=)`."""
    n, dv, bh, w, st, km, pf = shape
    return dict(BLOCK_N=n, DV_SPLIT=dv, BLOCK_H=bh, KEYS_ON_M=km, PREFETCH=pf, num_warps=w,
                num_stages=st)  # fmt: skip


def _shape(c: triton.Config) -> tuple:
    # a config as its row of _configs' shapes
    k = c.kwargs
    return (k["BLOCK_N"], k["DV_SPLIT"], k["BLOCK_H"], c.num_warps, c.num_stages, k["KEYS_ON_M"],
            k["PREFETCH"])  # fmt: skip


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    # tl.dot needs K >= 16: a DV_SPLIT program dots over D / DV_SPLIT channels ; head blocks
    # above the padded head count are only waste ; the small-shared-memory tiles only where the
    # others may not fit (the host-timed autotuner picks among more candidates less reliably:
    # H200, T=16 bf16 three sources, 20.75 us in one run with them, 17.9-18.0 in two others)
    d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    h = kwargs.get("H_PAD", named_args.get("H_PAD"))
    small_gpu = shared_memory(named_args["q_ptr"].device) < SMALL_SHARED_ABOVE
    ok = [
        c
        for c in configs
        if d // c.kwargs["DV_SPLIT"] >= 16
        and c.kwargs["BLOCK_H"] <= max(16, h)
        and (small_gpu or _shape(c) not in SMALL_SHARED_SHAPES)
    ]
    return ok or configs[:1]


@triton.jit
def _gather_rows(rows, valid, c0, mask, q, D, NOPE, ENTRIES: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, DECODE: tl.constexpr):  # fmt: skip
    # channels c0 .. c0 + BC - 1 (mask: < D) of the rows (invalid rows: zeros) in q's dtype
    if ENTRIES:  # FP8 entries decoded exactly, then cast (bf16 holds every e4m3 * 2^k)
        kv = load_entries(rows, valid, c0, D, NOPE, BLOCK_N, BLOCK_C, DECODE).to(q.dtype)
    else:
        offs = c0 + tl.arange(0, BLOCK_C)
        kv = tl.load(rows[:, None] + offs[None, :], mask=valid[:, None] & mask[None, :], other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
    return kv


# ---------------------------------------------------------------------------------------------
# Main kernel: one program per (token, key split, head block x channel part)
# ---------------------------------------------------------------------------------------------


# stride_mt = splits * 2H changes per step (a served late compile where 2H is not a multiple of 16)
@triton.jit(
    do_not_specialize=["n0", "n1", "K", "keys_per_split", "stride_it", "stride_mt", "tune_key"]
)
def _sparse_attn_kernel(
    q_ptr,  # [T, H, D] bf16/fp32 (last dim contiguous)
    kv0_ptr,  # [n0, D] rows 0..n0-1 of the concatenation (row stride stride_k0n)
    kv1_ptr,  # [n1, D] rows n0..n0+n1-1 (a dummy when NUM_SRC < 2)
    kv2_ptr,  # [n2, D] rows n0+n1.. (a dummy when NUM_SRC < 3)
    sink_ptr,  # [H] fp32
    idx_ptr,  # [T, K] int32/int64 rows of the concatenation, -1 = none
    o_ptr,  # [T, H, D] q.dtype (written when not SPLIT)
    part_ptr,  # [T, S, H, D] fp32 unnormalised split outputs (written when SPLIT)
    ml_ptr,  # [T, S, 2, H] fp32 split running max (log2 units) and sum (written when SPLIT)
    n0,
    n1,
    H,
    K,
    keys_per_split,
    qk_scale,  # scale * log2(e)
    tune_key,  # autotuning bucket only
    stride_qt,
    stride_qh,
    stride_k0n,
    stride_k1n,
    stride_k2n,
    stride_it,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_mt,
    stride_ms,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # D padded to a power of 2 >= 16 (channels >= D masked)
    H_PAD: tl.constexpr,  # H padded to a power of 2 (autotuning key, prune)
    NUM_SRC: tl.constexpr,
    SPLIT: tl.constexpr,
    ALIGNED: tl.constexpr,  # all kv rows start on 16-byte boundaries (ENTRIES: 8-byte)
    ENTRIES: tl.constexpr,  # kv rows are FP8 entries (uint8, `dsv4.ops.kv_fp8`)
    NOPE: tl.constexpr,  # ENTRIES: channels stored as e4m3 (the rest are the bf16 rope part)
    FP8_DECODE: tl.constexpr,  # ENTRIES: `kv_fp8.load_entries`' DECODE (1 on a GPU)
    UPCAST: tl.constexpr,  # interpreter: compute on fp32 copies of bf16 loads
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (ignored for bf16)
    BLOCK_N: tl.constexpr,
    DV_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KEYS_ON_M: tl.constexpr,  # keys on the MMA rows (S^T, O^T): no S recomputed per warpgroup
    PREFETCH: tl.constexpr,  # indices one tile ahead (a loop-carried plain load)
    PDL: tl.constexpr,  # chained launch (device.chain); the combine may launch early
):
    # read BLOCK_H*D q + keys_per_split*(D + 1) gathered elements ; write BLOCK_H*D/DV_SPLIT
    # (+ 2*BLOCK_H when SPLIT)
    chain_start(PDL)
    BLOCK_DV: tl.constexpr = BLOCK_D // DV_SPLIT
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    hb = tl.program_id(2) // DV_SPLIT
    dv = tl.program_id(2) % DV_SPLIT

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] heads (padded up to >= 16)
    mask_h = offs_h < H
    offs_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)  # [BDV] this program's output channels
    mask_v = offs_v < D

    # ---- queries of token t, all heads: [BH, BDV] own channels (+ [BH, BDV] the other half)
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q = tl.load(q_rows + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if DV_SPLIT == 2:
        offs_w = (1 - dv) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        mask_w = offs_w < D
        q_w = tl.load(q_rows + offs_w[None, :], mask=mask_h[:, None] & mask_w[None, :], other=0.0)
        if UPCAST:
            q_w = q_w.to(tl.float32)

    # ---- sources 1 and 2 as element offsets from kv0_ptr
    ELT: tl.constexpr = kv0_ptr.dtype.element_ty.primitive_bitwidth // 8
    base1 = (kv1_ptr.to(tl.int64) - kv0_ptr.to(tl.int64)) // ELT
    base2 = (kv2_ptr.to(tl.int64) - kv0_ptr.to(tl.int64)) // ELT

    # ---- online softmax over this split's keys (log2 domain)
    k_begin = split * keys_per_split
    k_end = tl.minimum(k_begin + keys_per_split, K)
    m_i = tl.full([BLOCK_H], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if KEYS_ON_M:
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    idx_row = idx_ptr + t * stride_it
    if PREFETCH:  # the next tile's indices, loaded one iteration ahead (see _configs)
        offs_n = k_begin + tl.arange(0, BLOCK_N)
        idx_next = tl.load(idx_row + offs_n, mask=offs_n < k_end, other=-1)
    for start in range(k_begin, k_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if PREFETCH:
            idx = idx_next.to(tl.int32)
            offs_next = offs_n + BLOCK_N
            idx_next = tl.load(idx_row + offs_next, mask=offs_next < k_end, other=-1)
        else:
            idx = tl.load(idx_row + offs_n, mask=offs_n < k_end, other=-1).to(tl.int32)
        valid = idx >= 0
        idx = tl.where(valid, idx, 0)
        # element offset of each key row from kv0_ptr, the source chosen by index range  [BN]:
        # the row within its source and the source's stride in int32 (rows < 2^31, checked by
        # the launcher), one widening multiply-add. The all-int64 select chain took ~35 SASS
        # instructions per row and a third of the loop's stall samples (H200, T=64: 45.2 ->
        # 39.1 us with this form, T=16: 20.1 -> 17.4)
        if NUM_SRC == 1:
            off = idx.to(tl.int64) * stride_k0n
        elif NUM_SRC == 2:
            in1 = idx >= n0
            local = idx - tl.where(in1, n0, 0)
            stride = tl.where(in1, stride_k1n, stride_k0n)
            off = tl.where(in1, base1, 0) + local.to(tl.int64) * stride
        else:
            in1 = idx >= n0
            in2 = idx >= n0 + n1
            local = idx - tl.where(in2, n0 + n1, tl.where(in1, n0, 0))
            stride = tl.where(in2, stride_k2n, tl.where(in1, stride_k1n, stride_k0n))
            base = tl.where(in2, base2, tl.where(in1, base1, 0))
            off = base + local.to(tl.int64) * stride
        if ALIGNED:  # every row starts on 16 (entries: 8) bytes: restore what the select hides
            off = tl.multiple_of(off, 8 if ENTRIES else 16 // ELT)  # (else no vector loads)
        rows = kv0_ptr + off
        # gathered K = V rows: [BN, BDV] (+ [BN, BDV] the other half for S)
        kv = _gather_rows(
            rows, valid, dv * BLOCK_DV, mask_v, q, D, NOPE, ENTRIES, UPCAST, BLOCK_N, BLOCK_DV,
            FP8_DECODE,
        )  # fmt: skip
        if DV_SPLIT == 2:
            kv_w = _gather_rows(
                rows, valid, (1 - dv) * BLOCK_DV, mask_w, q, D, NOPE, ENTRIES, UPCAST, BLOCK_N,
                BLOCK_DV, FP8_DECODE,
            )  # fmt: skip
        if KEYS_ON_M:  # S^T [BN, BH]: keys on the MMA rows, O^T = K^T P^T [BDV, BH]
            s = tl.dot(kv, tl.trans(q), input_precision=PRECISION)
            if DV_SPLIT == 2:
                s = tl.dot(kv_w, tl.trans(q_w), s, input_precision=PRECISION)
            s = tl.where(valid[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(kv), p.to(kv.dtype), acc, input_precision=PRECISION)
        else:  # S [BH, BN]: heads on the MMA rows, O = P K [BH, BDV]
            s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
            if DV_SPLIT == 2:
                s = tl.dot(q_w, tl.trans(kv_w), s, input_precision=PRECISION)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=PRECISION)
        m_i = m_new

    # ---- epilogue: partials for the combine, or the sink-normalised output ([h, v] tiles, or
    # [v, h] with KEYS_ON_M: the pointers follow the accumulator, nothing is transposed)
    if KEYS_ON_M:
        hv = offs_h[None, :] * stride_ph + offs_v[:, None]
        mask_hv = mask_h[None, :] & mask_v[:, None]
    else:
        hv = offs_h[:, None] * stride_ph + offs_v[None, :]
        mask_hv = mask_h[:, None] & mask_v[None, :]
    if SPLIT:
        tl.store(part_ptr + t * stride_pt + split * stride_ps + hv, acc, mask=mask_hv)
        ml = ml_ptr + t * stride_mt + split * stride_ms + offs_h
        mask_ml = offs_h < tl.where(dv == 0, H, 0)  # one channel part writes (max, sum)
        tl.store(ml, m_i, mask=mask_ml)
        tl.store(ml + H, l_i, mask=mask_ml)
    else:
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0) * 1.4426950408889634  # log2 e
        m_all = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_all)
        inv = alpha / (l_i * alpha + tl.exp2(sink - m_all))  # the sink only joins the denominator
        if KEYS_ON_M:
            out = acc * inv[None, :]
            o_hv = offs_h[None, :] * stride_oh + offs_v[:, None]
        else:
            out = acc * inv[:, None]
            o_hv = offs_h[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptr + t * stride_ot + o_hv, out.to(o_ptr.dtype.element_ty), mask=mask_hv)


_sparse_attn_tuned = autotune(_configs(), ["tune_key", "D", "H_PAD", "SPLIT"], _prune)(
    _sparse_attn_kernel
)


# ---------------------------------------------------------------------------------------------
# Combine kernel: merge the splits of one (token, head) with the sink
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_splits", "stride_mt"])
def _sparse_attn_combine_kernel(
    part_ptr,  # [T, S, H, D] fp32
    ml_ptr,  # [T, S, 2, H] fp32
    sink_ptr,  # [H] fp32
    o_ptr,  # [T, H, D] q.dtype
    H,
    D,
    num_splits,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_mt,
    stride_ms,
    stride_ot,
    stride_oh,
    cos_ptr,  # RD: [T, RD/2] fp32 cos / sin of the tokens' positions
    sin_ptr,
    stride_ct,
    stride_st,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # griddepcontrol (sm_90+): launched early, wait for the partials here
    RD: tl.constexpr = 0,  # > 0: the inverse RoPE on the last RD channels of o, as rope.rotary
):
    # read num_splits * (BLOCK_D + 2) fp32 ; write BLOCK_D elements
    # One pass, the splits merged online like the keys of a split: the (max, sum) and the partial
    # rows of a block of splits are loaded together, so a block costs one round trip to L2 (the
    # two-pass form, maxima first, took 4.5 us at T=1 with 20 splits on an H200: as long as the
    # attention kernel itself). The sink starts the running max and the denominator.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    ml = ml_ptr + t * stride_mt + h
    parts = part_ptr + t * stride_pt + h * stride_ph + offs_d[None, :]

    # o = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M the running max
    m_run = tl.load(sink_ptr + h) * 1.4426950408889634  # log2 units like the split maxima
    chain_start(PDL)
    denom = tl.full([], 1.0, tl.float32)  # 2^(sink - m_run)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_splits
        m_s = tl.load(ml + offs_s * stride_ms, mask=mask_s, other=NEG)
        l_s = tl.load(ml + offs_s * stride_ms + H, mask=mask_s, other=0.0)
        a = tl.load(
            parts + offs_s[:, None] * stride_ps, mask=mask_s[:, None] & mask_d[None, :], other=0.0
        )
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        rescale = tl.exp2(m_run - m_new)
        w = tl.exp2(m_s - m_new)  # [BS]
        denom = denom * rescale + tl.sum(w * l_s, 0)
        acc = acc * rescale + tl.sum(a * w[:, None], 0)
        m_run = m_new
    o = acc / denom
    if RD > 0:  # o cast to its dtype, then rotated back in fp32 and cast again (the unfused pair)
        o = tl.reshape(o.to(o_ptr.dtype.element_ty).to(tl.float32), (1, BLOCK_D))
        pairs = tl.program_id(2) * (BLOCK_D // 2) + tl.arange(0, BLOCK_D // 2)
        c_idx = pairs - (D - RD) // 2
        turned = (c_idx >= 0) & (2 * pairs < D)
        cos = tl.load(cos_ptr + t * stride_ct + c_idx, mask=turned, other=1.0)
        sin = -tl.load(sin_ptr + t * stride_st + c_idx, mask=turned, other=0.0)
        rot = rotate_tile(o, cos[None, :], sin[None, :], 1, BLOCK_D)
        o = tl.reshape(tl.where((offs_d >= D - RD)[None, :], rot, o), (BLOCK_D,))
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty),
             mask=mask_d)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def rows_aligned(kv: tuple[torch.Tensor, ...], align: int) -> bool:
    """Every row of every kv source starts on `align` bytes (its base and its row stride)."""
    return all(
        s.data_ptr() % align == 0 and s.stride(0) * s.element_size() % align == 0 for s in kv
    )


def _merge_adjacent(kv: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Sources that continue one another in memory (one allocation, the same row stride) as one
    view: the same concatenation, fewer index ranges to resolve per gathered row (the engine's
    ring and compressed entries share an allocation; one source cut the loop by 20% of its SASS
    instructions on sm_90). Empty sources add no rows and are dropped."""
    out: list[torch.Tensor] = []
    for src in kv:
        if src.shape[0] == 0:
            continue
        prev = out[-1] if out else None
        follows = (
            prev is not None
            and src.stride() == prev.stride()
            and src.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and src.data_ptr()
            == prev.data_ptr() + prev.shape[0] * prev.stride(0) * prev.element_size()
        )
        if follows:
            out[-1] = prev.as_strided((prev.shape[0] + src.shape[0], prev.shape[1]), prev.stride())
        else:
            out.append(src)
    out = out or [kv[0]]
    return tuple(out)


def fp8_decode(q: torch.Tensor) -> int:
    """How FP8 entries are decoded: `kv_fp8.decode_mode`, or on a GPU FP8_DECODE when set."""
    if FP8_DECODE is None or q.device.type != "cuda":
        return decode_mode(q.device)
    return FP8_DECODE


def fixed_tile(programs: int, h_pad: int, entries: bool, shared: int) -> dict | None:
    """The tile for `programs` (token, 64-head block)s on a GPU with `shared` bytes of shared
    memory per program (`device.shared_memory`) where one was measured to beat the autotuner's
    host-timed pick, else None (autotune: configs that do not fit the GPU are skipped):
    - a few programs: FEW_TOKENS_TILE (H200, T=1: the autotuner chose BN 32 / DV 2 / 64 heads
      at 9.99 us of device time; this tile measures 8.34), over FP8 entries FEW_TOKENS_TILE_FP8;
    - FP8 entries of 64 heads from FP8_MANY_TOKENS programs: FP8_MANY_TOKENS_TILE, one
      program per split (the launcher then fills the SMs once), where it fits."""
    if programs <= FIXED_TILE_MAX_PROGRAMS:
        tile, need = (
            (FEW_TOKENS_TILE_FP8, FEW_TOKENS_FP8_SHARED)
            if entries
            else (FEW_TOKENS_TILE, FEW_TOKENS_SHARED)
        )
        return tile if shared >= need else None
    if entries and h_pad >= 64 and programs >= FP8_MANY_TOKENS:
        return FP8_MANY_TOKENS_TILE if shared >= FP8_MANY_TOKENS_SHARED else None
    return None


def _tune_key(programs: int, num_splits: int, keys_per_split: int, sms: int) -> int:
    """The autotuner's key: octaves of the programs and of the keys per split. A prefill (one
    split filling the SMs) is tuned per programs octave and two key classes only (the window
    alone, or more), so a prefix hit's chunk at any position meets a tuned key: the key
    counts' octaves were late autotunes in a served burst (docs/PERF.md thirty-third session)."""
    key = 32 * min(programs * num_splits, 1 << 14).bit_length()
    if num_splits == 1 and programs >= sms:
        return key + 1 + (keys_per_split > WINDOW_KEYS)
    return key + min(keys_per_split, 1 << 14).bit_length()


def _default_splits(
    programs: int, K: int, device: torch.device, per_split: int = PROGRAMS_PER_SPLIT
) -> int:
    # split each token's keys until the grid fills the SMs once, keeping >= MIN_KEYS_PER_SPLIT keys
    # (each (token, head block, split) counted as per_split programs: DV_SPLIT tiles)
    sms = num_sms(device) // per_split
    if programs >= sms:
        return 1
    return max(1, min(sms // programs, cdiv(K, MIN_KEYS_PER_SPLIT)))


def _combine(
    part: torch.Tensor,
    ml: torch.Tensor,
    attn_sink: torch.Tensor,
    o: torch.Tensor,
    num_splits: int,
    early: bool,
    inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """o from the split partials (part [T, S, H, D], ml [T, S, 2, H]) and the sink; early: launched
    with PDL, waiting for the partials in the kernel (the attention kernel lets it launch).
    inv_rope: (cos, sin) [T, rd/2]: then rotary(o, cos, sin, inverse=True) in the same launch."""
    T, H, D = o.shape
    BLOCK_D = max(16, next_power_of_2(D))
    # few rows (one token's heads): many one-warp programs of 32 channels, the splits reduced
    # inside the warp (H200, T=1, 20 splits: 3.45 us vs 5.55 with 128 channels on 4 warps);
    # many rows: whole rows on 4 warps (T=64: 11.6 us, 12.2-48 us for the narrow forms)
    few = T * H < 512
    block_d = min(BLOCK_D, 32) if few else BLOCK_D
    # every split in one block where the [BLOCK_S, BLOCK_D] fp32 tile stays <= 8K elements
    block_s = min(next_power_of_2(num_splits), max(1, 8192 // block_d))
    cos, sin = inv_rope if inv_rope is not None else (ml, ml)
    rd = 0 if inv_rope is None else check_rope(o, cos, sin)
    _sparse_attn_combine_kernel[(T, H, cdiv(D, block_d))](
        part, ml, attn_sink, o, H, D, num_splits,
        part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1),
        o.stride(0), o.stride(1), cos, sin, cos.stride(0), sin.stride(0),
        BLOCK_S=block_s, BLOCK_D=block_d, PDL=pdl(o.device), RD=rd, launch_pdl=early,
        num_warps=1 if few else 4,
    )  # fmt: skip


def _finish(
    o: torch.Tensor,
    part: torch.Tensor,
    ml: torch.Tensor,
    attn_sink: torch.Tensor,
    num_splits: int,
    early: bool,
    inv_rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The attention kernels' output: split, o from the partials (`_combine`, RoPE undone in its
    launch); unsplit, o as written, with RoPE undone by a rotary launch when inv_rope is given."""
    if num_splits > 1:
        _combine(part, ml, attn_sink, o, num_splits, early, inv_rope)
        return o
    return o if inv_rope is None else rotary(o, *inv_rope, inverse=True)


def sparse_attn(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    scale: float,
    rope_dim: int = 0,
    *,
    inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """o[t, h] = sum_j softmax_j([scale q_h.kv_j ; sink_h]) kv_j over the rows j = topk_idxs[t] >= 0
    of the concatenation of `kv` (never materialised), the sink's probability mass dropped.

    inv_rope: (cos, sin) [T, rd/2] fp32: o comes out as `rope.rotary(o, cos, sin, inverse=True)`,
    in the combine's launch when the keys are split (otherwise a rotary launch of its own).

    kv rows are q's dtype, or all uint8 FP8 entries (`dsv4.quant.kv_entry_layout(D, rope_dim)`),
    decoded inside the gather.

    num_splits: key splits per token (default: fill the SMs once; 1 = no combine pass).
    config: force the tile config {"BLOCK_N", "DV_SPLIT", "BLOCK_H", "KEYS_ON_M", "num_warps",
    "num_stages"} instead of
    autotuning (the interpreter uses a fixed default unless given one).
    """
    # ---- checks
    assert q.dim() == 3, f"q must be [T, H, D] (got shape {tuple(q.shape)})"
    assert q.dtype in (torch.bfloat16, torch.float32), f"q must be bf16 or fp32 (got {q.dtype})"
    assert q.stride(2) == 1, f"q's last dim must be contiguous (strides {q.stride()})"
    T, H, D = q.shape
    BLOCK_D = max(16, next_power_of_2(D))  # tiles padded; channels >= D masked
    kv = tuple(kv)
    assert 1 <= len(kv) <= 3, f"kv must hold 1..3 row tensors (got {len(kv)})"
    entries = kv[0].dtype == torch.uint8
    # FP8 entries: e4m3 channels and row bytes (checks rope_dim)
    nope, _, width = kv_entry_layout(D, rope_dim) if entries else (D, 0, D)
    for i, src in enumerate(kv):
        assert src.dtype == (torch.uint8 if entries else q.dtype), (
            f"kv[{i}] dtype {src.dtype}: the sources must all be q's dtype {q.dtype} or all "
            "uint8 FP8 entries"
        )
        assert src.dim() == 2 and src.shape[1] == width, (
            f"kv[{i}] must be [N, {width}]{' (FP8 entries)' if entries else ''} "
            f"(got shape {tuple(src.shape)})"
        )
        assert src.stride(1) == 1 or src.shape[0] == 0, (
            f"kv[{i}] rows must be contiguous (strides {src.stride()})"
        )
        assert src.device == q.device, f"kv[{i}] is on {src.device}, q on {q.device}"
    assert attn_sink.shape == (H,) and attn_sink.dtype == torch.float32, (
        f"attn_sink must be fp32 [{H}] (got {attn_sink.dtype} {tuple(attn_sink.shape)})"
    )
    assert attn_sink.is_contiguous(), "attn_sink must be contiguous"
    assert topk_idxs.dim() == 2 and topk_idxs.shape[0] == T, (
        f"topk_idxs must be [T={T}, K] (got shape {tuple(topk_idxs.shape)})"
    )
    assert topk_idxs.dtype in (torch.int32, torch.int64), (
        f"topk_idxs must be int32 or int64 (got {topk_idxs.dtype})"
    )
    K = topk_idxs.shape[1]
    assert topk_idxs.stride(1) == 1 or K <= 1, (
        f"topk_idxs rows must be contiguous (strides {topk_idxs.stride()})"
    )

    kv = _merge_adjacent(kv)
    sm90_min = SM90_MIN_TOKENS_FP8 if entries else SM90_MIN_TOKENS
    if config is None and num_splits is None and T >= sm90_min:
        from dsv4.ops import sparse_attn_sm90  # Gluon (no interpreter): Hopper GPUs only

        if sparse_attn_sm90.supported(q, kv, rope_dim):
            return sparse_attn_sm90.sparse_attn_sm90(
                q, kv, attn_sink, topk_idxs, scale, rope_dim, inv_rope=inv_rope, checked=True
            )

    # ---- allocate
    o = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0 or K == 0:
        return o.zero_()  # only the sink remains: its mass is dropped (and rotates to 0)
    H_PAD = max(16, next_power_of_2(H))
    head_blocks = cdiv(H, min(64, H_PAD))  # the split heuristic counts 64-head programs
    if config is None and q.is_cuda:  # measured fixed tiles where the autotuner picks badly
        config = fixed_tile(T * head_blocks, H_PAD, entries, shared_memory(q.device))
    if num_splits is None:
        per_split = 1 if config is FP8_MANY_TOKENS_TILE else PROGRAMS_PER_SPLIT
        num_splits = _default_splits(T * head_blocks, K, q.device, per_split)
    assert num_splits >= 1, f"num_splits must be >= 1 (got {num_splits})"
    keys_per_split = cdiv(K, num_splits)
    if keys_per_split > 16:
        keys_per_split = cdiv(keys_per_split, 16) * 16
    num_splits = cdiv(K, keys_per_split)  # no empty splits
    split = num_splits > 1
    if split:
        part = torch.empty((T, num_splits, H, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((T, num_splits, 2, H), dtype=torch.float32, device=q.device)
    else:
        part = ml = o  # unused

    # ---- launch: gather + attention, then (split) the combine
    srcs = kv + (kv[0],) * (3 - len(kv))
    n0 = srcs[0].shape[0]
    n1 = srcs[1].shape[0] if len(kv) > 1 else 0
    rows = sum(s.shape[0] for s in kv)
    assert rows < 2**31, f"the kv sources hold {rows} rows: indices must fit int32"
    assert max(s.stride(0) for s in kv) < 2**31, "kv row strides must fit int32"
    tune_key = _tune_key(T * head_blocks, num_splits, keys_per_split, num_sms(q.device))
    args = (
        q, *srcs, attn_sink, topk_idxs, o, part, ml,
        n0, n1, H, K, keys_per_split, scale * LOG2E, tune_key,
        q.stride(0), q.stride(1), *(s.stride(0) for s in srcs), topk_idxs.stride(0),
        o.stride(0), o.stride(1),
        part.stride(0), part.stride(1), part.stride(2) if split else 0,
        ml.stride(0), ml.stride(1),
    )  # fmt: skip
    align = 8 if entries else 16  # bytes on which every row starts (for vector loads)
    consts = dict(
        D=D,
        BLOCK_D=BLOCK_D,
        H_PAD=H_PAD,
        NUM_SRC=len(kv),
        SPLIT=split,
        ALIGNED=rows_aligned(kv, align),
        ENTRIES=entries,
        NOPE=nope,
        FP8_DECODE=fp8_decode(q) if entries else 0,
        UPCAST=q.device.type != "cuda",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **chain(q.device),
    )

    def grid(meta: dict) -> tuple[int, int, int]:
        return (T, num_splits, cdiv(H, meta["BLOCK_H"]) * meta["DV_SPLIT"])

    if config is None and q.device.type == "cuda":
        _sparse_attn_tuned[grid](*args, **consts)
    else:
        cfg = dict(BLOCK_N=16, DV_SPLIT=1, BLOCK_H=min(64, H_PAD), KEYS_ON_M=False, PREFETCH=False)
        cfg = cfg | dict(num_warps=4, num_stages=1) | (config or {})
        assert cfg["DV_SPLIT"] in (1, 2) and BLOCK_D // cfg["DV_SPLIT"] >= 16, f"bad config {cfg}"
        assert cfg["BLOCK_H"] >= 16, f"bad config {cfg}: tl.dot needs BLOCK_H >= 16"
        _sparse_attn_kernel[grid](*args, **consts, **cfg)

    # the combine launched early: PDL on this device
    return _finish(o, part, ml, attn_sink, num_splits, consts["PDL"], inv_rope)
