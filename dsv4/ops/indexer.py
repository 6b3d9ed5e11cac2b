"""Lightning indexer: scores over the visible compressed entries, then an exact top-k.

One launcher with the signature of `dsv4.ops.ref.index_topk`:
  index_topk(q, weights, keys, cand_idxs, topk, key_scale=None, weight_scale=1.0, *, sort=True)
  -> [T, min(topk, C)] int64 positions

score(t, c) = sum_h w_th * relu(q_th . keys[cand[t, c]]) in fp32 (keys: values, or with key_scale
FP8 indexer keys, `dsv4.quant.quant_index_keys`: codes decoded exactly, times the key's scale after
the head sum), then the positions of the largest
scores in descending order; equal scores resolve to the lower position (a stable descending sort),
positions that are not visible (cand = -1) come out as -1. sort=False (the model: attention takes
the entries as a set) returns the same positions in an order that depends only on the inputs, with
no sort: position order (levels), or the winners above the threshold bin in position order and then
the bin's picks by descending score (hist).

Kernels:
  _index_score_kernel   per (token, chunk of candidates): gather the key rows through cand_idxs,
                        S^T = K . Q[Hi, d]^T on tensor cores, relu, weighted sum over heads, and write
                        each score as an order-preserving int32 key (-inf / not visible -> INT32_MIN);
                        for the hist select also count each key into its token's histograms of the
                        key's top 16 bits (global atomics) and top 6 bits (one flush per program).
  _index_hist_select_kernel  (decode rows of <= HIST_MAX_TOKENS tokens longer than one segment)
                        per (segment, token): the bin of the k-th largest key from the counts, then
                        the segment's keys above that bin (winners) and in it (candidates) filed to
                        scratch; the row's last program sorts winners + candidates (packed as below),
                        keeps k, and zeroes the counts it used. A threshold bin too full for the sort
                        first keeps its best candidates by a bitwise search (_keep_largest).
                        Unsorted: each segment files its winners into K slots of its own, and the
                        last program copies them out in segment order and ranks the candidates
                        against each other in registers (_hist_emit; no sort up to HIST_CAND).
  _index_select_kernel  (the other rows: "levels")
                        per (row, segment of <= BLOCK_L keys), all in registers: a bitwise search
                        finds the k-th largest key (counting reductions from the highest bit where
                        the keys differ, until exactly k keys are at or above the prefix), then the
                        winners are compacted in position order. Ties at the threshold keep the
                        lowest positions, so the winners are exactly the first k of a stable
                        descending sort. A long row (C > BLOCK_L) is cut into segments whose
                        local top-k are packed as (key << 32 | C-1-pos) int64 and selected again;
                        the last level sorts the k winners by packed value (higher key, then lower
                        position) and writes positions.
Scores of visible entries are finite for finite inputs; -0.0 is folded into +0.0 so the two tie.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.ops.device import arrival_counts, cdiv, chain, chain_start, next_power_of_2, num_sms, pdl
from dsv4.ops.kv_fp8 import decode_codes, decode_mode
from dsv4.ops.ref import counted_rows

INT32_MIN = tl.constexpr(-(2**31))  # key of an entry that is not visible: below every finite score
INT64_MIN = tl.constexpr(-(2**63))  # packed padding: key INT32_MIN, position C-1 (decodes to -1)
PDL_MAX_PROGRAMS = 32  # select grids up to this size launch early (see index_topk, _hist_select)
SEGMENT = 4096  # keys per select program (at least 4 * the padded k); longer rows take more levels
HIST_BINS = tl.constexpr(65536)  # hist select: fine bins, the top 16 bits of a key (unsigned order)
# and coarse bins, the top 6 bits, counted by a tl.histogram per tile: with 256 bins (the top 8)
# that cost the T=16 score kernel 3.7 us over the fine counts alone, with 64 about nothing (H200)
COARSE_BINS = tl.constexpr(64)
FINE_PER_COARSE = tl.constexpr(HIST_BINS.value // COARSE_BINS.value)
# key bits below a coarse bin
COARSE_SHIFT = tl.constexpr(32 - (COARSE_BINS.value.bit_length() - 1))
ZERO_W = tl.constexpr(4096 // COARSE_BINS.value)  # fine bins of each coarse bin zeroed per store
HIST_MAX_TOKENS = 16  # rows a hist select handles at once (its zeroed workspace holds this many;
# at T=64 the counting costs the score kernel more than the levels select takes: 185 + 10 vs 194 us)
HIST_FAST = 1024  # the final sort's width: winners + threshold-bin candidates up to this are sorted
HIST_CAND = 128  # unsorted output: threshold-bin candidates up to this are ranked without a sort
SORT_ALWAYS = False  # serve sort=False sorted as well (the A/B switch of the unsorted selects)

# ---------------------------------------------------------------------------------------------
# Scores: gather keys, tensor-core dot over the heads, relu, weighted head sum
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tiles", "T"])
def _index_score_kernel(
    q_ptr,  # [T, Hi, d] bf16/fp32 (d contiguous)
    w_ptr,  # [T, Hi] any float dtype, times w_scale in fp32
    k_ptr,  # [N, d] key rows (d contiguous; KEY_FP8: uint8 e4m3 codes)
    ks_ptr,  # KEY_FP8: [N] fp32 key scales
    idx_ptr,  # [T, C] int64 rows of k, -1 = not visible
    out_ptr,  # [T, C] int32 order-preserving score keys
    hist_ptr,  # HIST: [T, HIST_BINS] int32 counts of the keys' top 16 bits (unsigned order)
    coarse_ptr,  # HIST: [T, COARSE_BINS] int32 counts of their top bits
    counts_ptr,  # HAS_COUNTS: [T] int64, token t sees positions < counts[t] (TB > 1 only)
    C,
    Hi,
    d,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_it,
    stride_ot,
    w_scale,
    tiles,  # candidate tiles of BLOCK_N per program (<= SCAN; a runtime count: one compile for all)
    UPCAST: tl.constexpr,  # compute the dot in fp32 (interpreter, fp32 or mixed inputs)
    PRECISION: tl.constexpr,  # "ieee" when UPCAST, else "tf32" (ignored for bf16)
    KEYS_ON_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN: tl.constexpr,  # tiles the visibility scan spans: 1 when tiles is 1, else MAX_SCORE_TILES
    HIST: tl.constexpr,  # count the visible keys into the token's histograms (hist select)
    PDL: tl.constexpr,  # chained launch (device.chain); the first select may launch early
    KEY_FP8: tl.constexpr = False,  # FP8 indexer keys: codes decoded exactly, scale after the sum
    DECODE: tl.constexpr = 0,  # KEY_FP8: `kv_fp8.decode_codes` (1: the GPU's conversion)
    T=1,  # tokens (TB > 1: the last block's tokens past T are masked)
    TB: tl.constexpr = 1,  # tokens a program scores over each key tile it gathers (`_shared_scores`)
    HAS_COUNTS: tl.constexpr = False,  # TB > 1: the tokens' rows are one list, masked by counts
):
    # read tiles*BLOCK_N visible key rows (d each) + q_t + w_t ; write tiles*BLOCK_N int32
    # (HIST: + one atomic add per visible key, COARSE_BINS per program)
    if TB > 1:
        _shared_scores(q_ptr, w_ptr, k_ptr, ks_ptr, idx_ptr, counts_ptr, out_ptr, C, Hi, d,
                       stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot, w_scale,
                       tiles, T, UPCAST, PRECISION, BLOCK_H, BLOCK_D, BLOCK_N, SCAN, PDL, KEY_FP8,
                       DECODE, TB, HAS_COUNTS)  # fmt: skip
        return
    chain_start(PDL)
    pid_c = tl.program_id(0)
    t = tl.program_id(1)
    c0 = pid_c * tiles * BLOCK_N
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    out_row = out_ptr + t.to(tl.int64) * stride_ot

    # ---- tiles past the chunk's last visible candidate (decode suffix, causal prefill) are skipped
    offs_chunk = c0 + tl.arange(0, SCAN * BLOCK_N)
    in_chunk = (offs_chunk < C) & (offs_chunk < c0 + tiles * BLOCK_N)
    idx_chunk = tl.load(idx_row + offs_chunk, mask=in_chunk, other=-1)
    last = tl.max(tl.where(idx_chunk >= 0, offs_chunk, -1))  # -1 when none is visible
    n_live = (tl.maximum(last + 1 - c0, 0) + BLOCK_N - 1) // BLOCK_N

    # ---- q_t: [BLOCK_H, BLOCK_D] (heads and channels past Hi, d are 0) ; w_t: [BLOCK_H] fp32
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < Hi
    d_ok = offs_d < d
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    w = w * w_scale  # the reference's weights.float() * scale, in fp32
    coarse = tl.zeros([COARSE_BINS], tl.int32)
    row_t = t.to(tl.int64)

    for i in range(0, n_live):
        # ---- gather BLOCK_N key rows: [BLOCK_N, BLOCK_D], 2*d contiguous bytes per row (bf16)
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        in_c = offs_n < C
        idx, kt = _key_tile(idx_row, offs_n, in_c, k_ptr, stride_kn, offs_d, d_ok, q.dtype,
                            UPCAST, KEY_FP8, DECODE)  # fmt: skip
        vis = idx >= 0
        # ---- S^T = K . Q^T: [BLOCK_N, BLOCK_H] fp32 ; score = sum_h w_h relu(S_h). Keys on M
        # put the head sum along the accumulator's rows: a reduction inside each warp
        if KEYS_ON_M:
            s = tl.dot(kt, tl.trans(q), input_precision=PRECISION)
            score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)  # [BLOCK_N] fp32
        else:  # S = Q . K^T [BLOCK_H, BLOCK_N]: the head sum crosses warps
            s = tl.dot(q, tl.trans(kt), input_precision=PRECISION)
            score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        if KEY_FP8:  # relu(2^e x) = 2^e relu(x): the same fp32 values as the dequantized keys'
            score = score * tl.load(ks_ptr + idx, mask=vis, other=0.0)
        key = tl.where(vis, _order_key(score), INT32_MIN)
        tl.store(out_row + offs_n, key, mask=in_c)
        if HIST:  # (tile by tile: T=16 +6.3 us over the scores alone; one pass after the loop +14)
            u = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned order
            fine = hist_ptr + row_t * HIST_BINS + (u >> 16).to(tl.int32)
            tl.atomic_add(fine, 1, mask=vis, sem="relaxed")
            coarse += tl.histogram((u >> COARSE_SHIFT).to(tl.int32), COARSE_BINS, mask=vis)

    for i in range(n_live, tiles):
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_n, tl.full([BLOCK_N], INT32_MIN, tl.int32), mask=offs_n < C)

    if HIST:
        offs_b = tl.arange(0, COARSE_BINS)
        coarse_row = coarse_ptr + row_t * COARSE_BINS
        tl.atomic_add(coarse_row + offs_b, coarse, mask=coarse != 0, sem="relaxed")


@triton.jit
def _key_tile(idx_row, offs_n, in_c, k_ptr, stride_kn, offs_d, d_ok, dtype: tl.constexpr,
              UPCAST: tl.constexpr, KEY_FP8: tl.constexpr, DECODE: tl.constexpr):  # fmt: skip
    # (the rows idx_row[offs_n] [BLOCK_N], -1 past in_c; those key rows gathered as a
    # [BLOCK_N, BLOCK_D] tile of `dtype`, -1 rows zeros, fp32 when UPCAST); FP8 codes are exact
    # in bf16 / fp16 (the scale, 2^e, comes after the sum)
    idx = tl.load(idx_row + offs_n, mask=in_c, other=-1)
    vis = idx >= 0
    k_at = k_ptr + idx[:, None] * stride_kn + offs_d[None, :]
    if KEY_FP8:
        kt = decode_codes(tl.load(k_at, mask=vis[:, None] & d_ok[None, :], other=0), DECODE)
        kt = kt.to(dtype)
    else:
        kt = tl.load(k_at, mask=vis[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    return idx, kt


@triton.jit
def _order_key(score):
    # fp32 scores -> order-preserving int32 keys: -0.0 folded into +0.0 (they tie in the
    # reference), then the magnitude bits of negatives flipped
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _shared_scores(q_ptr, w_ptr, k_ptr, ks_ptr, idx_ptr, counts_ptr, out_ptr, C, Hi, d,
                   stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot, w_scale,
                   tiles, T, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SCAN: tl.constexpr, PDL: tl.constexpr, KEY_FP8: tl.constexpr,
                   DECODE: tl.constexpr, TB: tl.constexpr, HAS_COUNTS: tl.constexpr):  # fmt: skip
    # TB consecutive tokens whose candidate rows are one list, each seeing a prefix of it (one
    # sequence's causal chunk: a row visible to a token is visible to the later ones, at the same
    # position): the last token's row is gathered once a tile and scored for all TB tokens in one
    # dot, S^T = K . [Q_t0; Q_t1; ...]^T [BLOCK_N, TB * BLOCK_H]; each token masks its own -1s
    # (HAS_COUNTS: the rows are the one list itself, stride_it 0, and token t's prefix is its
    # first counts[t] positions: no [tokens x entries] table is read)
    chain_start(PDL)
    pid_c = tl.program_id(0)
    t0 = tl.program_id(1) * TB
    c0 = pid_c * tiles * BLOCK_N
    t_last = tl.minimum(t0 + TB, T) - 1
    last_row = idx_ptr + t_last.to(tl.int64) * stride_it

    offs_chunk = c0 + tl.arange(0, SCAN * BLOCK_N)
    in_chunk = (offs_chunk < C) & (offs_chunk < c0 + tiles * BLOCK_N)
    if HAS_COUNTS:
        in_chunk &= offs_chunk < tl.load(counts_ptr + t_last)
    idx_chunk = tl.load(last_row + offs_chunk, mask=in_chunk, other=-1)
    last = tl.max(tl.where(idx_chunk >= 0, offs_chunk, -1))
    n_live = (tl.maximum(last + 1 - c0, 0) + BLOCK_N - 1) // BLOCK_N

    # ---- q of the block's tokens: [TB * BLOCK_H, BLOCK_D], row r = token t0 + r // BLOCK_H,
    # head r % BLOCK_H ; w likewise [TB * BLOCK_H] (rows past T or Hi are 0)
    offs_r = tl.arange(0, TB * BLOCK_H)
    r_tok = t0 + offs_r // BLOCK_H
    r_h = offs_r % BLOCK_H
    r_ok = (r_tok < T) & (r_h < Hi)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    q = tl.load(
        q_ptr
        + r_tok.to(tl.int64)[:, None] * stride_qt
        + r_h[:, None] * stride_qh
        + offs_d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + r_tok.to(tl.int64) * stride_wt + r_h, mask=r_ok, other=0.0).to(tl.float32)
    w = w * w_scale
    offs_tb = t0 + tl.arange(0, TB)
    tb_ok = offs_tb < T
    if HAS_COUNTS:
        count = tl.load(counts_ptr + offs_tb, mask=tb_ok, other=0)

    for i in range(0, n_live):
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        in_c = offs_n < C
        idx, kt = _key_tile(last_row, offs_n, in_c, k_ptr, stride_kn, offs_d, d_ok, q.dtype,
                            UPCAST, KEY_FP8, DECODE)  # fmt: skip
        vis = idx >= 0
        s = tl.dot(kt, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, TB * BLOCK_H]
        p = tl.maximum(s, 0.0) * w[None, :]
        score = tl.sum(tl.reshape(p, [BLOCK_N, TB, BLOCK_H]), axis=2)  # [BLOCK_N, TB]
        if KEY_FP8:
            score = score * tl.load(ks_ptr + idx, mask=vis, other=0.0)[:, None]
        key = _order_key(score)
        # each token's own visibility (its row: the same entries, a prefix of them)
        # (HAS_COUNTS: stride_it 0, the one list read again in the dot's layout, as a table row
        # is: `vis` lies in the gather's layout)
        own = tl.load(
            idx_ptr + offs_tb.to(tl.int64)[None, :] * stride_it + offs_n[:, None],
            mask=in_c[:, None] & tb_ok[None, :],
            other=-1,
        )
        own = own >= 0
        if HAS_COUNTS:
            own &= offs_n[:, None] < count[None, :]
        key = tl.where(own, key, INT32_MIN)
        out_at = out_ptr + offs_tb.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
        tl.store(out_at, key, mask=in_c[:, None] & tb_ok[None, :])

    for i in range(n_live, tiles):
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        out_at = out_ptr + offs_tb.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
        none = tl.full([BLOCK_N, TB], INT32_MIN, tl.int32)
        tl.store(out_at, none, mask=(offs_n < C)[:, None] & tb_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Selection: bitwise k-th largest on register-resident keys, compaction in position order, sort
# ---------------------------------------------------------------------------------------------


@triton.jit
def _min_count(v_a, n_a, v_b, n_b):
    # (least value, how many times it occurs)
    n = tl.where(v_a == v_b, n_a + n_b, tl.where(v_a < v_b, n_a, n_b))
    return tl.minimum(v_a, v_b), n


@triton.jit
def _open_bits(hi, not_lo, WIDE: tl.constexpr):
    # largest key hi and ~least key not_lo (unsigned, 32 or WIDE 64 bits) -> (prefix, bit): the
    # bits above the highest one where they differ (common to every key), and that highest bit
    # (0 when hi == lo)
    low = hi ^ ~not_lo  # smeared down from its highest set bit: the bits still open
    low |= low >> 1
    low |= low >> 2
    low |= low >> 4
    low |= low >> 8
    low |= low >> 16
    if WIDE:
        low |= low >> 32
    return hi & ~low, low ^ (low >> 1)


@triton.jit
def _unpack_positions(packed, C):
    # packed (key << 32 | C-1-pos) int64 -> pos, -1 where the key is INT32_MIN (not visible)
    pos = C - 1 - (packed & 0xFFFFFFFF)
    return tl.where((packed >> 32).to(tl.int32) == INT32_MIN, -1, pos)


@triton.jit
def _kth_largest(u, valid, kk):
    # u: [BL] uint32 keys (unsigned order) ; valid: [BL] ; kk: 1 <= kk <= count(valid)
    # -> (thr, need): the kk-th largest valid u, and how many of the elements equal to thr to keep.
    # Bit by bit from the top: keep a bit when at least kk keys are >= the prefix with it set.
    # Latency is the chain of block-wide reductions (two barriers each, and one more before the
    # shared scratch is reused), so the chain is cut short:
    # - the bits above the highest one where the largest and the least valid key differ are
    #   common to all keys and are not searched (largest == least: that is the answer);
    # - once exactly kk keys are >= the prefix, the answer is the least of them: one (min, count)
    #   reduction ends the search;
    # - `above` counts the valid keys past the open range [prefix, prefix | (2 * bit - 1)], which
    #   is the last count that dropped a bit: no count of the keys above the answer at the end.
    # CPU simulation on Flash-like scores (4096 keys, kk=512): ~18 steps, ~20 reductions a level
    # instead of 33. H200 (bench/probe_pieces.py select, 4096 keys): 8.5 us with 8 warps (9.8 with
    # 16), was ~11.5 us for the full 33-reduction search, itself about 3 us less than 4
    # tl.histogram passes. Tried and slower: 4 bits a step (8 reductions of 16 counts over a
    # [BL, 16] compare, 45-53 us per level: the 16x compare work outweighs the fewer barriers).
    zero = tl.full([], 0, tl.uint32)
    # max of (u, ~u) side by side: the largest and the least key in one reduction
    hi, not_lo = tl.split(tl.max(tl.join(tl.where(valid, u, zero), tl.where(valid, ~u, zero)), 0))
    prefix, bit = _open_bits(hi, not_lo, False)
    above = tl.full([], 0, tl.int32)
    count = kk - 1  # anything but kk
    while (bit != 0) & (count != kk):
        cand = prefix | bit
        count = tl.sum((valid & (u >= cand)).to(tl.int32), axis=0)
        above = tl.where(count >= kk, above, count)
        prefix = tl.where(count >= kk, cand, prefix)
        bit = bit >> 1
    thr = prefix
    need = kk - above
    if count == kk:  # exactly kk keys are >= prefix: thr is the least of them, keep all its copies
        top = valid & (u >= prefix)
        thr, need = tl.reduce((tl.where(top, u, ~zero), top.to(tl.int32)), 0, _min_count)
    return thr, need


@triton.jit
def _index_select_kernel(
    in_ptr,  # [R, L] int32 keys (position = column) or int64 packed (key << 32 | C-1-pos)
    out_ptr,  # FINAL: [R, K] int64 positions ; else [R, n_seg*K] int64 packed winners per segment
    L,
    C,
    K,
    stride_ir,
    stride_or,
    PACKED: tl.constexpr,
    FINAL: tl.constexpr,
    SORT: tl.constexpr,  # FINAL: order the winners by score (else they stay in position order)
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # griddepcontrol (sm_90+): when launched early, wait for the keys here
):
    # read BLOCK_L keys (4 or 8 B) ; write K int64 (FINAL: + K int64 scratch, read back once)
    seg = tl.program_id(0)
    r = tl.program_id(1)
    offs = seg * BLOCK_L + tl.arange(0, BLOCK_L)
    valid = offs < L
    in_row = in_ptr + r.to(tl.int64) * stride_ir
    if PDL:
        gdc_launch_dependents()  # the next level may launch, and wait in turn
        gdc_wait()
    # only the 32-bit keys stay live through the search (the packed values are re-read or rebuilt
    # for the winners alone): fewer registers, so fewer warps can hold a segment without spills
    if PACKED:
        key = (tl.load(in_row + offs, mask=valid, other=INT64_MIN) >> 32).to(tl.int32)
    else:
        key = tl.load(in_row + offs, mask=valid, other=INT32_MIN)

    # ---- the kk-th largest key of the segment, kk = min(K, segment length)
    kk = tl.minimum(K, tl.minimum(L - seg * BLOCK_L, BLOCK_L))
    u = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # signed order -> unsigned order
    thr, need = _kth_largest(u, valid, kk)

    # ---- winners: every key above thr, and the first `need` (lowest positions) equal to it
    eq = (valid & (u == thr)).to(tl.int32)
    eq_before = tl.cumsum(eq, 0) - eq
    sel = (valid & (u > thr)) | ((eq != 0) & (eq_before < need))
    sel_i = sel.to(tl.int32)
    slot = tl.cumsum(sel_i, 0) - sel_i  # compaction keeps the position order
    if PACKED:
        packed = tl.load(in_row + offs, mask=sel, other=INT64_MIN)
    else:
        packed = (key.to(tl.int64) << 32) | (C - 1 - offs).to(tl.int64)
    out_row = out_ptr + r.to(tl.int64) * stride_or + seg * K
    offs_k = tl.arange(0, BLOCK_K)
    if FINAL:
        # ---- sort the kk = K winners (packed: higher key, then lower position) and decode
        tl.store(out_row + slot, packed, mask=sel)  # the output row doubles as scratch
        tl.debug_barrier()
        win = tl.load(out_row + offs_k, mask=offs_k < kk, other=INT64_MIN, cache_modifier=".cg")
        if SORT:
            win = tl.sort(win, descending=True)
        res = _unpack_positions(win, C)
        tl.debug_barrier()
        tl.store(out_row + offs_k, res, mask=offs_k < K)
    else:
        tl.store(out_row + slot, packed, mask=sel)
        pad = tl.full([BLOCK_K], INT64_MIN, tl.int64)
        tl.store(out_row + offs_k, pad, mask=(offs_k >= kk) & (offs_k < K))


# ---------------------------------------------------------------------------------------------
# Selection from histograms (decode rows): the score kernel counted each token's keys by their
# top 16 bits, so the bin of the k-th largest key is read off the counts; one pass files the keys
# above that bin (winners, fewer than k) and in it (candidates), and the last program of a row
# sorts winners + candidates and keeps the first k
# ---------------------------------------------------------------------------------------------


@triton.jit
def _threshold_bin(h, kk, NB: tl.constexpr):
    # h: [NB] counts of bins in ascending key order ; kk >= 1 -> (b, above): the highest bin b with
    # at least kk keys at or above it (-1 when fewer than kk keys are counted), and the keys above b
    offs = tl.arange(0, NB)
    at_or_above = tl.cumsum(h, 0, reverse=True)
    b = tl.max(tl.where(at_or_above >= kk, offs, -1))
    return b, tl.sum(tl.where(offs > b, h, 0))


@triton.jit
def _flip(v):
    # int64 -> uint64 in the same order
    return v.to(tl.uint64, bitcast=True) ^ (tl.full([], 1, tl.uint64) << 63)


@triton.jit
def _flipped(at, m):
    # masked L2 load of int64 values in their unsigned order (0 where masked)
    return tl.where(m, _flip(tl.load(at, mask=m, other=0, cache_modifier=".cg")), 0)


@triton.jit
def _keep_largest(row, n, need, BLOCK: tl.constexpr):
    # row[0:n]: distinct packed int64 values, 1 <= need <= n -> the `need` largest now at
    # row[0:need] (in place). The slow path of the hist select (a threshold bin too full to sort:
    # many equal or very close scores): a bitwise search for the need-th largest in the unsigned
    # order, each step one counting pass over the row, from the highest bit where the largest and
    # least differ, until exactly `need` values are at or above the prefix
    offs = tl.arange(0, BLOCK)
    hi = tl.full([], 0, tl.uint64)
    not_lo = tl.full([], 0, tl.uint64)
    for c0 in range(0, n, BLOCK):
        m = c0 + offs < n
        u = _flipped(row + c0 + offs, m)
        hi = tl.maximum(hi, tl.max(u))
        not_lo = tl.maximum(not_lo, tl.max(tl.where(m, ~u, 0)))
    prefix, bit = _open_bits(hi, not_lo, True)
    count = need - 1  # anything but need
    while (bit != 0) & (count != need):
        cand = prefix | bit
        count = need * 0
        for c0 in range(0, n, BLOCK):
            m = c0 + offs < n
            u = _flipped(row + c0 + offs, m)
            count += tl.sum((m & (u >= cand)).to(tl.int32))
        prefix = tl.where(count >= need, cand, prefix)
        bit = bit >> 1
    # values are distinct: exactly `need` are >= prefix ; compact them to the front in row order
    kept = need * 0
    for c0 in range(0, n, BLOCK):
        m = c0 + offs < n
        v = tl.load(row + c0 + offs, mask=m, other=0, cache_modifier=".cg")
        sel = m & (_flip(v) >= prefix)
        sel_i = sel.to(tl.int32)
        tl.debug_barrier()  # every load of this chunk before a store may overwrite it
        tl.store(row + kept + tl.cumsum(sel_i, 0) - sel_i, v, mask=sel)
        kept += tl.sum(sel_i)
    tl.debug_barrier()


@triton.jit
def _hist_emit(buf_row, cand_row, wcnt_row, out_row, n_win, n_cand, C, K, n_seg,
               BLOCK_K: tl.constexpr, NSEG: tl.constexpr, CAND: tl.constexpr):  # fmt: skip
    # the unsorted output of a row: the winners (segment s's at buf_row[s*K ..], wcnt_row[s] of
    # them) in position order at 0 .. n_win, then the K - n_win best threshold-bin candidates
    # (cand_row[0 .. n_cand], distinct packed values) by descending value, then -1
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, NSEG)
    cnt = tl.load(wcnt_row + offs_s, mask=offs_s < n_seg, other=0, cache_modifier=".cg")
    incl = tl.cumsum(cnt, 0)
    # output slot j < n_win holds winner j - excl[s] of the segment s with excl[s] <= j < incl[s]
    in_seg = (incl - cnt)[None, :] <= offs_k[:, None]
    in_seg &= offs_k[:, None] < incl[None, :]
    src = tl.sum(tl.where(in_seg, (offs_s * K - (incl - cnt))[None, :], 0), 1) + offs_k
    w = tl.load(buf_row + src, mask=offs_k < n_win, other=INT64_MIN, cache_modifier=".cg")
    tl.store(out_row + offs_k, _unpack_positions(w, C), mask=offs_k < n_win)
    need = K - n_win
    if n_cand <= CAND:  # rank the candidates against each other: no sort
        offs_c = tl.arange(0, CAND)
        ok = offs_c < n_cand
        v = tl.load(cand_row + offs_c, mask=ok, other=INT64_MIN, cache_modifier=".cg")
        rank = tl.sum(((v[None, :] > v[:, None]) & ok[None, :]).to(tl.int32), 1)
        pick = ok & (rank < need)
        tl.store(out_row + n_win + rank, _unpack_positions(v, C), mask=pick)
        n_pick = tl.minimum(need, n_cand)
    else:  # a threshold bin too full to rank at once: keep its best, then sort those
        _keep_largest(cand_row, n_cand, need, CAND)
        kept = tl.load(cand_row + offs_k, mask=offs_k < need, other=INT64_MIN, cache_modifier=".cg")
        kept = tl.sort(kept, descending=True)
        tl.store(out_row + n_win + offs_k, _unpack_positions(kept, C), mask=offs_k < need)
        n_pick = need
    tl.store(out_row + offs_k, tl.full([BLOCK_K], -1, tl.int64),
             mask=(offs_k >= n_win + n_pick) & (offs_k < K))  # fmt: skip


@triton.jit
def _index_hist_select_kernel(
    key_ptr,  # [T, C] int32 score keys (INT32_MIN = not visible)
    hist_ptr,  # [T, HIST_BINS] int32 fine counts ; zero again when the kernel returns
    coarse_ptr,  # [T, COARSE_BINS] int32 coarse counts ; zero again
    count_ptr,  # [T] int64: winners filed | candidates filed << 24 | programs done << 48 ; zero again
    buf_ptr,  # [T, K + C] int64 scratch: winners at 0.., candidates at K..
    out_ptr,  # [T, K] int64 positions
    C,
    K,
    stride_kt,
    stride_bt,
    stride_ot,
    wcnt_ptr,  # not SORT: [T, n_seg] int32 winners of each segment
    BLOCK_L: tl.constexpr,  # keys filed per program
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,  # winners + candidates up to this many are sorted at once (>= 2 * BLOCK_K)
    PDL: tl.constexpr,
    SORT: tl.constexpr = True,  # else: winners in position order, then the threshold bin's picks
    NSEG: tl.constexpr = 1,  # not SORT: segments of a row, rounded up to a power of 2
    CAND: tl.constexpr = 128,  # not SORT: threshold-bin candidates ranked in registers up to this
):
    # read COARSE_BINS + FINE_PER_COARSE counts + BLOCK_L keys ; write the winners and candidates
    # among them (int64) ; the last program of a row: + <= FAST int64, write K int64, zero the
    # used bins
    seg = tl.program_id(0)
    t = tl.program_id(1)
    t64 = t.to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = seg * BLOCK_L + tl.arange(0, BLOCK_L)
    key = tl.load(key_ptr + t64 * stride_kt + offs, mask=offs < C, other=INT32_MIN)
    # ---- the bin of the K-th largest key: its coarse bin, then the fine bin inside it
    offs_b = tl.arange(0, COARSE_BINS)
    coarse = tl.load(coarse_ptr + t64 * COARSE_BINS + offs_b)
    cb, above_c = _threshold_bin(coarse, K, COARSE_BINS)
    offs_f = tl.arange(0, FINE_PER_COARSE)
    fine = tl.load(
        hist_ptr + t64 * HIST_BINS + cb * FINE_PER_COARSE + offs_f,
        mask=offs_f < tl.where(cb >= 0, FINE_PER_COARSE, 0),  # (no bool & scalar: interpreter)
        other=0,
    )
    fb, above_f = _threshold_bin(fine, K - above_c, FINE_PER_COARSE)
    thr_bin = tl.where(cb >= 0, cb * FINE_PER_COARSE + fb, -1)  # -1: fewer than K visible, all win
    n_win = above_c + above_f

    # ---- file this segment's winners (bin above) and candidates (the bin), position order kept
    vis = key != INT32_MIN
    bin = ((key.to(tl.uint32, bitcast=True) ^ 0x80000000) >> 16).to(tl.int32)
    win = (vis & (bin > thr_bin)).to(tl.int32)
    cand = (vis & (bin == thr_bin)).to(tl.int32)
    both = win + (cand << 16)  # one scan for both slots (BLOCK_L < 65536)
    before = tl.cumsum(both, 0) - both
    n_both = tl.sum(both)
    count = count_ptr + t
    filed = (n_both & 0xFFFF).to(tl.int64) | ((n_both >> 16).to(tl.int64) << 24)
    packed = (key.to(tl.int64) << 32) | (C - 1 - offs).to(tl.int64)
    buf_row = buf_ptr + t64 * stride_bt
    if SORT:
        before_w = tl.atomic_add(count, filed, sem="relaxed")  # one atomic for both bases
        base_w = (before_w & 0xFFFFFF).to(tl.int32)
        base_c = ((before_w >> 24) & 0xFFFFFF).to(tl.int32)
        cand_row = buf_row + K
    else:  # the winners in the segment's own K slots, in position order; candidates after them
        base_w = seg * K
        before_c = tl.atomic_add(count, filed & ~0xFFFFFF, sem="relaxed")
        base_c = ((before_c >> 24) & 0xFFFFFF).to(tl.int32)
        cand_row = buf_row + tl.num_programs(0) * K
        tl.store(wcnt_ptr + t64 * tl.num_programs(0) + seg, n_both & 0xFFFF)
    tl.store(buf_row + base_w + (before & 0xFFFF), packed, mask=win != 0)
    tl.store(cand_row + base_c + (before >> 16), packed, mask=cand != 0)

    # ---- the row's last program: sort winners + the best candidates, keep K, zero the counts
    tl.debug_barrier()  # every store of this program before its arrival is released
    arrived = tl.atomic_add(count, tl.full([], 1, tl.int64) << 48, sem="acq_rel")
    if (arrived >> 48) == tl.num_programs(0) - 1:  # every other program filed before it arrived
        n_cand = ((arrived >> 24) & 0xFFFFFF).to(tl.int32)
        offs_k = tl.arange(0, BLOCK_K)
        out_row = out_ptr + t64 * stride_ot
        if SORT:
            if n_win + n_cand > FAST:
                _keep_largest(cand_row, n_cand, K - n_win, FAST)
                n_cand = K - n_win
            offs_f = tl.arange(0, FAST)
            src = tl.where(offs_f < n_win, offs_f, K + offs_f - n_win)
            vals = tl.load(
                buf_row + src, mask=offs_f < n_win + n_cand, other=INT64_MIN, cache_modifier=".cg"
            )
            top = tl.topk(vals, BLOCK_K)  # descending: higher key, then lower position
            tl.store(out_row + offs_k, _unpack_positions(top, C), mask=offs_k < K)
        else:
            _hist_emit(buf_row, cand_row, wcnt_ptr + t64 * tl.num_programs(0), out_row, n_win,
                       n_cand, C, K, tl.num_programs(0), BLOCK_K, NSEG, CAND)  # fmt: skip
        # the fine bins of every coarse bin in use (ZERO_W of each a store), the coarse bins and
        # the counts
        offs_z = tl.arange(0, ZERO_W)
        fine_at = hist_ptr + t64 * HIST_BINS + offs_b[:, None] * FINE_PER_COARSE + offs_z[None, :]
        for f0 in range(0, FINE_PER_COARSE, ZERO_W):
            zero = tl.zeros([COARSE_BINS, ZERO_W], tl.int32)
            tl.store(fine_at + f0, zero, mask=(coarse != 0)[:, None])
        tl.store(coarse_ptr + t64 * COARSE_BINS + offs_b, tl.zeros([COARSE_BINS], tl.int32))
        tl.store(count, tl.zeros([], tl.int64))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _hist_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fine [HIST_MAX_TOKENS, HIST_BINS] int32, coarse [.., COARSE_BINS] int32, counts [..] int64)
    of the hist select: zero between calls (its last program per row zeroes what the call used),
    so calls on one stream and CUDA-graph replays share them (`device.arrival_counts`)."""
    nf, nc = HIST_MAX_TOKENS * HIST_BINS.value, HIST_MAX_TOKENS * COARSE_BINS.value
    ws = arrival_counts("index_topk", device, nf + nc + 2 * HIST_MAX_TOKENS)
    return (
        ws[:nf].view(-1, HIST_BINS.value),
        ws[nf : nf + nc].view(-1, COARSE_BINS.value),
        ws[nf + nc :].view(torch.int64),
    )


def _hist_select(
    skey: torch.Tensor,
    out: torch.Tensor,
    segment: int,
    warps: int,
    early: bool | None = None,
    sort: bool = True,
) -> None:
    """The hist select's kernel on score keys [T, C] counted into the workspace -> out [T, K]
    (early: launch it while the score kernel runs, its programs waiting there; default for small
    grids: at T=16 (128 programs) the sorted select took 5.8 us longer in bench ops and the
    unsorted one gained nothing in the graph-replayed step, docs/PERF.md. sort=False: the winners
    in position order, then the threshold bin's picks, no sort)."""
    (T, C), K = skey.shape, out.shape[1]
    fine, coarse, counts = _hist_workspace(skey.device)
    block_k = max(16, next_power_of_2(K))
    block_l = min(next_power_of_2(C), segment)
    n_seg = cdiv(C, block_l)
    buf = torch.empty(T, (K if sort else n_seg * K) + C, dtype=torch.int64, device=skey.device)
    wcnt = buf if sort else torch.empty(T, n_seg, dtype=torch.int32, device=skey.device)
    griddep = pdl(skey.device)
    _index_hist_select_kernel[(n_seg, T)](
        skey, fine, coarse, counts, buf, out, C, K,
        skey.stride(0), buf.stride(0), out.stride(0), wcnt,
        BLOCK_L=block_l,
        BLOCK_K=block_k,
        FAST=max(2 * block_k, min(HIST_FAST, next_power_of_2(C))),
        SORT=sort,
        NSEG=next_power_of_2(n_seg),
        CAND=HIST_CAND,
        PDL=griddep,
        launch_pdl=griddep and (n_seg * T <= PDL_MAX_PROGRAMS if early is None else early),
        num_warps=warps,
    )  # fmt: skip


MAX_SCORE_TILES = 16  # candidate tiles a score program takes at most (q is re-read per program)
# tokens of one sequence's chunk a score program takes together (one_sequence). H200, 128K, T=2048,
# the scores alone: 3536 us one token a program, 2877 two, 2461 four (docs/PERF.md)
SHARED_TOKENS = 4


def _score_tiles(T: int, n_tiles: int, programs: int) -> int:
    # candidate tiles per program: about `programs` programs, at most MAX_SCORE_TILES
    per = max(1, (T * n_tiles) // programs)
    return min(MAX_SCORE_TILES, 1 << (per.bit_length() - 1), next_power_of_2(n_tiles))


class ScoreConfig(NamedTuple):
    """Tiles of the score kernel. The default is the best of the H200 sweep
    (bench/sweep_kernels.py, 2026-11-29): within 1% of 1 program per SM, 3-4 stages."""

    block_n: int = 64  # candidates per tile
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2
    keys_on_m: bool = True  # keys on the MMA rows: the head sum stays inside a warp


def _scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    cfg: ScoreConfig = ScoreConfig(),  # noqa: B008  (immutable)
    hist: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: torch.Tensor | None = None,
    weight_scale: float = 1.0,
    shared: int = 1,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores as order-preserving int32 keys: [T, C] (INT32_MIN = not visible). `hist`: (fine,
    coarse) count rows of the hist select, added to. `key_scale`: FP8 indexer keys.
    `weight_scale`: the head weights are weights.float() * weight_scale. shared > 1: the tokens'
    rows are one list, each token seeing a prefix of it (`index_topk`'s one_sequence): that many
    tokens a program share each key tile (not with hist); `counts` [T] int64 with shared: the
    rows are one list (stride 0) and token t sees its first counts[t] positions."""
    (T, Hi, d), C = q.shape, cand_idxs.shape[1]
    assert shared == 1 or (hist is None and cfg.keys_on_m), "shared tokens: keys on M, no hist"
    assert counts is None or shared > 1, "counts: shared tokens only"
    skey = torch.empty(T, C, dtype=torch.int32, device=q.device)
    key_fp8 = key_scale is not None
    same = q.dtype == keys.dtype or key_fp8  # codes are decoded into q's dtype
    tensor_core = q.is_cuda and same and q.dtype != torch.float32
    block_n = cfg.block_n if C >= 64 else max(16, next_power_of_2(C))
    n_tiles = cdiv(C, block_n)
    blocks = cdiv(T, shared)
    tiles = _score_tiles(blocks, n_tiles, cfg.programs_per_sm * num_sms(q.device, 1))
    _index_score_kernel[(cdiv(n_tiles, tiles), blocks)](
        q, weights, keys, key_scale if key_fp8 else weights, cand_idxs, skey,
        *(hist or (skey, skey)),
        skey if counts is None else counts,
        C, Hi, d,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), cand_idxs.stride(0),
        skey.stride(0), float(weight_scale), tiles,
        UPCAST=not tensor_core,
        PRECISION="tf32" if tensor_core else "ieee",
        KEYS_ON_M=cfg.keys_on_m,
        BLOCK_H=max(16, next_power_of_2(Hi)),
        BLOCK_D=max(16, next_power_of_2(d)),
        BLOCK_N=block_n,
        SCAN=1 if tiles == 1 else MAX_SCORE_TILES,
        HIST=hist is not None,
        KEY_FP8=key_fp8,
        DECODE=decode_mode(q.device),
        T=T,
        TB=shared,
        HAS_COUNTS=counts is not None,
        num_warps=cfg.num_warps if shared == 1 else max(cfg.num_warps, 2 * shared),
        num_stages=cfg.num_stages,
        **chain(q.device),
    )  # fmt: skip
    return skey


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    topk: int,
    key_scale: torch.Tensor | None = None,
    weight_scale: float = 1.0,
    *,
    segment: int = SEGMENT,
    sort: bool = True,
    select: str | None = None,
    select_warps: int | None = None,
    score_config: ScoreConfig | None = None,
    one_sequence: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    # q: [T, Hi, d] ; weights: [T, Hi] ; keys: [N, d] rows ; cand_idxs: [T, C] int64, -1 = not
    # visible -> [T, min(topk, C)] int64 positions 0..C-1 in descending score order (sort), -1 = none
    # (key_scale [N] fp32: keys are FP8 indexer keys, uint8 e4m3 codes, `quant.quant_index_keys`;
    # weight_scale: the head weights are weights.float() * weight_scale, in the score kernel)
    # (sort=False: any order that depends only on the inputs -- levels: position order ; hist: the
    # winners above the threshold bin in position order, then the bin's picks by score -- unless
    # SORT_ALWAYS ; segment: keys per select program ; select: "hist" or "levels", default hist for
    # rows longer than one segment ;
    # select_warps: warps of a select program ; score_config: the score kernel's tiles -- knobs
    # for bench/probe_pieces.py and the tests ; one_sequence: every token's visible rows are the
    # same list's prefix, later tokens seeing at least as many (one sequence's causal chunk): a
    # chunk of more than HIST_MAX_TOKENS tokens shares key tiles, SHARED_TOKENS a program ;
    # counts [T]: token t sees only positions < counts[t], `ref.index_topk`'s rule: with
    # one_sequence the rows may be one list expanded (stride 0), read without a table)
    T, Hi, d = q.shape
    C = cand_idxs.shape[1]
    sort = sort or SORT_ALWAYS
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q dtype {q.dtype}"
    if key_scale is None:
        assert keys.dtype in (torch.bfloat16, torch.float16, torch.float32), (
            f"keys dtype {keys.dtype} (uint8 FP8 indexer keys need key_scale)"
        )
    else:
        assert keys.dtype == torch.uint8 and key_scale.dtype == torch.float32, (
            f"FP8 indexer keys: uint8 codes and fp32 scales (got {keys.dtype}, {key_scale.dtype})"
        )
        assert key_scale.shape == keys.shape[:1] and key_scale.stride(0) == 1, (
            f"key_scale {tuple(key_scale.shape)} must be [{keys.shape[0]}] contiguous"
        )
    assert weights.is_floating_point(), f"weights dtype {weights.dtype}"
    assert q.stride(2) == 1, f"q must be contiguous in d (strides {q.stride()})"
    assert keys.dim() == 2 and keys.shape[1] == d, f"keys {tuple(keys.shape)} vs d={d}"
    assert keys.stride(1) == 1, f"keys must be contiguous in d (strides {keys.stride()})"
    assert weights.shape == (T, Hi) and weights.stride(1) == 1, (
        f"weights {tuple(weights.shape)} strides {weights.stride()} vs [T={T}, Hi={Hi}]"
    )
    assert cand_idxs.dtype == torch.int64 and cand_idxs.dim() == 2, (
        f"cand_idxs {cand_idxs.dtype} {tuple(cand_idxs.shape)}"
    )
    assert cand_idxs.shape[0] == T and cand_idxs.stride(1) == 1, (
        f"cand_idxs {tuple(cand_idxs.shape)} strides {cand_idxs.stride()} vs T={T}"
    )
    assert topk > 0, f"topk must be positive, got {topk}"
    assert T < 65536, f"at most 65535 tokens per call (T={T})"
    K = min(topk, C)
    out = torch.empty(T, K, dtype=torch.int64, device=q.device)
    if T == 0 or K == 0:
        return out
    cfg = score_config or ScoreConfig()
    shared = SHARED_TOKENS if one_sequence and T > HIST_MAX_TOKENS and cfg.keys_on_m else 1
    if counts is not None:
        assert counts.shape == (T,) and counts.device == q.device, (
            f"counts {tuple(counts.shape)} on {counts.device} vs T={T} on {q.device}"
        )
        if shared == 1:  # (a table, as the other paths read it)
            cand_idxs, counts = counted_rows(cand_idxs, counts), None
        else:
            counts = counts.to(torch.int64)

    block_k = max(16, next_power_of_2(K))
    max_l = max(segment, 4 * block_k)
    griddep = pdl(q.device)
    if select is None:
        select = "hist" if C > max_l and T <= HIST_MAX_TOKENS else "levels"
    assert select in ("hist", "levels"), f"select must be 'hist' or 'levels', got {select!r}"
    if select == "hist":
        assert T <= HIST_MAX_TOKENS, f"hist select: T <= {HIST_MAX_TOKENS} (T={T})"
        # the packed filing counts (24 bits each) and the one scan of both (16 bits each)
        assert C < 2**24 and segment < 2**16, (
            f"hist select: C < 2^24, segment < 2^16 ({C}, {segment})"
        )
        fine, coarse, _ = _hist_workspace(q.device)
        skey = _scores(q, weights, keys, cand_idxs, cfg, (fine, coarse), key_scale, weight_scale)
        _hist_select(skey, out, segment, select_warps or 16, sort=sort)
        return out

    skey = _scores(q, weights, keys, cand_idxs, cfg, None, key_scale, weight_scale, shared, counts)

    # ---- top-k: segments of <= max_l keys per program until one segment holds a whole row
    x, L = skey, C
    while True:
        final = L <= max_l
        block_l = max(16, next_power_of_2(L)) if final else max_l
        n_seg = cdiv(L, block_l)
        dst = out if final else torch.empty(T, n_seg * K, dtype=torch.int64, device=q.device)
        # launched early (programmatic dependent launch) only as a small grid: on an H200, T=1
        # 27.1 vs 28.5 us, but T=16 (128 first-level programs) 72.0 vs 70.1
        early = griddep and n_seg * T <= PDL_MAX_PROGRAMS
        _index_select_kernel[(n_seg, T)](
            x, dst, L, C, K, x.stride(0), dst.stride(0),
            PACKED=x.dtype == torch.int64,
            FINAL=final,
            SORT=sort,
            BLOCK_L=block_l,
            BLOCK_K=block_k,
            PDL=griddep,
            launch_pdl=early,
            num_warps=select_warps or min(8, max(4, block_l // 512)),
        )  # fmt: skip
        if final:
            return out
        x, L = dst, n_seg * K
