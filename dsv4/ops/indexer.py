"""Lightning indexer: scores over the visible compressed entries, then an exact top-k.

One launcher with the signature of `dsv4.ops.ref.index_topk`:
  index_topk(q, weights, keys, cand_idxs, topk) -> [T, min(topk, C)] int64 entry positions

score(t, c) = sum_h w_th * relu(q_th . keys[cand[t, c]]) in fp32, then the positions of the largest
scores in descending order; equal scores resolve to the lower position (a stable descending sort),
positions that are not visible (cand = -1) come out as -1.

Two kernels:
  _index_score_kernel   per (token, chunk of candidates): gather the key rows through cand_idxs,
                        S^T = K . Q[Hi, d]^T on tensor cores, relu, weighted sum over heads, and write
                        each score as an order-preserving int32 key (-inf / not visible -> INT32_MIN).
  _index_select_kernel  per (row, segment of <= BLOCK_L keys), all in registers: a bitwise search
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

from dsv4.ops.device import num_sms, pdl

INT32_MIN = tl.constexpr(-(2**31))  # key of an entry that is not visible: below every finite score
INT64_MIN = tl.constexpr(-(2**63))  # packed padding: key INT32_MIN, position C-1 (decodes to -1)
PDL_MAX_PROGRAMS = 32  # select grids up to this size launch early (see index_topk)
SEGMENT = 4096  # keys per select program (at least 4 * the padded k); longer rows take more levels

# ---------------------------------------------------------------------------------------------
# Scores: gather keys, tensor-core dot over the heads, relu, weighted head sum
# ---------------------------------------------------------------------------------------------


@triton.jit
def _index_score_kernel(
    q_ptr,  # [T, Hi, d] bf16/fp32 (d contiguous)
    w_ptr,  # [T, Hi] any float dtype (already scaled)
    k_ptr,  # [N, d] key rows (d contiguous)
    idx_ptr,  # [T, C] int64 rows of k, -1 = not visible
    out_ptr,  # [T, C] int32 order-preserving score keys
    C,
    Hi,
    d,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_it,
    stride_ot,
    UPCAST: tl.constexpr,  # compute the dot in fp32 (interpreter, fp32 or mixed inputs)
    PRECISION: tl.constexpr,  # "ieee" when UPCAST, else "tf32" (ignored for bf16)
    KEYS_ON_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,  # candidate tiles of BLOCK_N per program
    PDL: tl.constexpr,  # let the first select launch now (it waits for these scores itself)
):
    # read TILES*BLOCK_N visible key rows (d each) + q_t + w_t ; write TILES*BLOCK_N int32
    if PDL:
        gdc_launch_dependents()
    pid_c = tl.program_id(0)
    t = tl.program_id(1)
    c0 = pid_c * TILES * BLOCK_N
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    out_row = out_ptr + t.to(tl.int64) * stride_ot

    # ---- tiles past the chunk's last visible candidate (decode suffix, causal prefill) are skipped
    offs_chunk = c0 + tl.arange(0, TILES * BLOCK_N)
    idx_chunk = tl.load(idx_row + offs_chunk, mask=offs_chunk < C, other=-1)
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

    for i in range(0, n_live):
        # ---- gather BLOCK_N key rows: [BLOCK_N, BLOCK_D], 2*d contiguous bytes per row (bf16)
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        in_c = offs_n < C
        idx = tl.load(idx_row + offs_n, mask=in_c, other=-1)
        vis = idx >= 0
        kt = tl.load(
            k_ptr + idx[:, None] * stride_kn + offs_d[None, :],
            mask=vis[:, None] & d_ok[None, :],
            other=0.0,
        )
        # ---- S^T = K . Q^T: [BLOCK_N, BLOCK_H] fp32 ; score = sum_h w_h relu(S_h). Keys on M
        # put the head sum along the accumulator's rows: a reduction inside each warp
        if UPCAST:
            kt = kt.to(tl.float32)
        if KEYS_ON_M:
            s = tl.dot(kt, tl.trans(q), input_precision=PRECISION)
            score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)  # [BLOCK_N] fp32
        else:  # S = Q . K^T [BLOCK_H, BLOCK_N]: the head sum crosses warps
            s = tl.dot(q, tl.trans(kt), input_precision=PRECISION)
            score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0 (they tie in the reference)
        # ---- order-preserving int32: flip the magnitude bits of negatives
        bits = score.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = tl.where(vis, key, INT32_MIN)
        tl.store(out_row + offs_n, key, mask=in_c)

    for i in range(n_live, TILES):
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_n, tl.full([BLOCK_N], INT32_MIN, tl.int32), mask=offs_n < C)


# ---------------------------------------------------------------------------------------------
# Selection: bitwise k-th largest on register-resident keys, compaction in position order, sort
# ---------------------------------------------------------------------------------------------


@triton.jit
def _min_count(v_a, n_a, v_b, n_b):
    # (least value, how many times it occurs)
    n = tl.where(v_a == v_b, n_a + n_b, tl.where(v_a < v_b, n_a, n_b))
    return tl.minimum(v_a, v_b), n


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
    low = hi ^ ~not_lo  # smeared down from its highest set bit: the bits still open
    low |= low >> 1
    low |= low >> 2
    low |= low >> 4
    low |= low >> 8
    low |= low >> 16
    prefix = hi & ~low
    bit = low ^ (low >> 1)  # the highest open bit ; 0 when hi == lo
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
        pos = C - 1 - (win & 0xFFFFFFFF)
        res = tl.where((win >> 32).to(tl.int32) == INT32_MIN, -1, pos)
        tl.debug_barrier()
        tl.store(out_row + offs_k, res, mask=offs_k < K)
    else:
        tl.store(out_row + slot, packed, mask=sel)
        pad = tl.full([BLOCK_K], INT64_MIN, tl.int64)
        tl.store(out_row + offs_k, pad, mask=(offs_k >= kk) & (offs_k < K))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _score_tiles(T: int, n_tiles: int, programs: int) -> int:
    # candidate tiles per program: about `programs` programs, at most 16 tiles (q is re-read per
    # program)
    per = max(1, (T * n_tiles) // programs)
    return min(16, 1 << (per.bit_length() - 1), triton.next_power_of_2(n_tiles))


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
) -> torch.Tensor:
    """Scores as order-preserving int32 keys: [T, C] (INT32_MIN = not visible)."""
    (T, Hi, d), C = q.shape, cand_idxs.shape[1]
    skey = torch.empty(T, C, dtype=torch.int32, device=q.device)
    tensor_core = q.is_cuda and q.dtype == keys.dtype and q.dtype != torch.float32
    block_n = cfg.block_n if C >= 64 else max(16, triton.next_power_of_2(C))
    n_tiles = triton.cdiv(C, block_n)
    tiles = _score_tiles(T, n_tiles, cfg.programs_per_sm * num_sms(q.device, 1))
    _index_score_kernel[(triton.cdiv(n_tiles, tiles), T)](
        q, weights, keys, cand_idxs, skey,
        C, Hi, d,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), cand_idxs.stride(0),
        skey.stride(0),
        UPCAST=not tensor_core,
        PRECISION="tf32" if tensor_core else "ieee",
        KEYS_ON_M=cfg.keys_on_m,
        BLOCK_H=max(16, triton.next_power_of_2(Hi)),
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=block_n,
        TILES=tiles,
        PDL=pdl(q.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return skey


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    topk: int,
    *,
    segment: int = SEGMENT,
    sort: bool = True,
    select_warps: int | None = None,
    score_config: ScoreConfig | None = None,
) -> torch.Tensor:
    # q: [T, Hi, d] ; weights: [T, Hi] ; keys: [N, d] rows ; cand_idxs: [T, C] int64, -1 = not
    # visible -> [T, min(topk, C)] int64 positions 0..C-1 in descending score order, -1 = none
    # (segment: keys per first-level select program ; sort=False leaves the winners in position
    # order ; select_warps: warps of a select program ; score_config: the score kernel's tiles --
    # knobs for bench/probe_pieces.py)
    T, Hi, d = q.shape
    C = cand_idxs.shape[1]
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q dtype {q.dtype}"
    assert keys.dtype in (torch.bfloat16, torch.float16, torch.float32), f"keys dtype {keys.dtype}"
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

    skey = _scores(q, weights, keys, cand_idxs, score_config or ScoreConfig())

    # ---- top-k: segments of <= max_l keys per program until one segment holds a whole row
    block_k = max(16, triton.next_power_of_2(K))
    max_l = max(segment, 4 * block_k)
    x, L = skey, C
    griddep = pdl(q.device)
    while True:
        final = L <= max_l
        block_l = max(16, triton.next_power_of_2(L)) if final else max_l
        n_seg = triton.cdiv(L, block_l)
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
