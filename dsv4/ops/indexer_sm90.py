"""Index scores of one sequence's prefill chunk for Hopper (sm_90) in Gluon: the MMA of one key
tile in flight while the scores of the tile before it are summed and stored.

  shared_scores_sm90(q, weights, keys, cand_idxs, weight_scale, counts) -> skey [T, C]
      (as `indexer._scores(..., shared=SHARED_TOKENS, counts=counts)`: the order-preserving int32
      score keys, INT32_MIN where a token does not see the key; `supported` says when)

Why a second kernel: the Triton form of the shared-token scores (`indexer._shared_scores`, four
tokens a key tile) runs at ~450 TFLOP/s on an H200 (45% of the bf16 tensor peak; 371 at 1M
context, docs/PERF.md forty-third session), and a 2048-token chunk at 1M context spends most of
its CSA layers' time there. Its sm_90 TTGIR shows why: each tile's `warp_group_dot` is followed
at once by its wait, so the tensor cores idle while the 64 x 256 scores are rectified, weighted,
summed over the heads and stored; and only 2 key buffers with `async_wait 0`, so each tile also
waits out its gather's round trip.

Here one program (8 warps, two warpgroups, each the MMA of two tokens' 128 heads) holds the
TB = 4 tokens' q [256, 128] in shared memory and NUM_BUF key tiles [64, 128]: NUM_BUF - 2 tiles'
gathers in flight (cp.async, each tile's rows loaded one iteration ahead), tile i's MMA issued
asynchronously, then tile i - 1's accumulator (the other register set) waited for and reduced.
S^T = K . Q^T puts the keys on the MMA rows, so each token's head sum stays inside a thread's quad.

What it gained (H200, docs/PERF.md forty-seventh session): 6% at 1M context (64-token slices,
670.7 -> 631.5 us), and it is 2-6% slower from 256K to 512K and at 128K, so `indexer` takes it
only past SHARED_SM90_MIN_KEYS candidates. Its parts at 1M: the MMAs and the scores alone (no
gathers) 444 us, ~620 TFLOP/s; the gathers alone 362 us (~3 TB/s of tiles from L2); together
632: the two overlap only in part, and the MMA with both operands in shared memory at N = 128 a
warpgroup is itself at ~63% of the tensor peak.

Keys are bf16 rows [N, 128] gathered through the sequence's one list of rows (cand_idxs, each
token's row of it: the table, or with counts one list with stride 0 and token t seeing its first
counts[t] positions). FP8 indexer keys stay on the Triton kernel. No CPU path: Gluon has no
interpreter; `tests/ops/test_indexer.py::test_gpu_sm90_shared_scores` compares it with the Triton
kernel bit for bit on the GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4.ops.device import cdiv, chain, chain_start, is_sm90, num_sms
from dsv4.ops.sparse_attn_sm90 import _tile_idx  # the rows of a tile's candidates, -1 past the end

HEADS = 64  # indexer heads of a token
DIM = 128  # the key width (K of the MMA)
TOKENS = 4  # tokens a program scores over each key tile (the MMA's N: 4 x 64 heads)
BLOCK_N = 64  # keys a tile (the MMA's M)
# key tiles in shared memory: NUM_BUF - 2 gathers in flight (q 64 KB + 64 KB). H200, T=64 at 1M
# / T=2048 at 128K: 4 bufs 631.5 / 2354 us, 6 716.0 / 2624 (a buffer index mod 6 is a division),
# 8 648.6 / 2384 (docs/PERF.md forty-seventh session)
NUM_BUF = 4
# key tiles a program takes: the grid is about WAVES programs an SM (one program an SM fits)
WAVES = 4
MIN_TILES, MAX_TILES = 8, 256
SCAN = 1024  # candidates the live-tile scan reads at a time (the table form)
INT32_MIN = gl.constexpr(-(2**31))


@gluon.jit
def _gather(buf, k_ptr, stride_kn, rows, offs_d, ON: gl.constexpr):  # noqa: ANN001, ANN202
    # key rows into buf by cp.async (-1: zeros), one commit group (not ON: an empty one)
    if ON:
        at = k_ptr + gl.maximum(rows, 0).to(gl.int64)[:, None] * stride_kn + offs_d[None, :]
        cp.async_copy_global_to_shared(buf, at, mask=(rows >= 0)[:, None])
    cp.commit_group()


@gluon.jit
def _issue(k_smem, i, q_t, s_zero, NUM_BUF: gl.constexpr):  # noqa: ANN001, ANN202
    # tile i landed (this thread's copies), visible to the async proxy and every thread (and
    # every warp is past tile i - 2's MMA): S^T = K . Q^T of tile i issued asynchronously
    cp.wait_group(NUM_BUF - 3)
    fence_async_shared()
    gl.thread_barrier()
    return warpgroup_mma(k_smem.index(i % NUM_BUF), q_t, s_zero, use_acc=False, is_async=True)


@gluon.jit
def _refill(k_smem, i, k_ptr, stride_kn, rows_next, offs_gd, last_row, c0, end, offs_gn,
            BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, ON: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # tile i + NUM_BUF - 2 into tile i - 2's buffer (tiles i - 1 .. i + NUM_BUF - 3 are in the
    # others) ; the rows of the tile after it loaded
    _gather(k_smem.index((i + NUM_BUF - 2) % NUM_BUF), k_ptr, stride_kn, rows_next, offs_gd, ON)
    return _tile_idx(last_row, c0 + (i + NUM_BUF - 1) * BLOCK_N, end, offs_gn)


@gluon.jit
def _emit(acc, w, k0, offs_n, offs_t, t_ok, count, idx_ptr, out_ptr, C, stride_it, stride_ot,
          TB: gl.constexpr, H: gl.constexpr, BLOCK_N: gl.constexpr,
          HAS_COUNTS: gl.constexpr, ON: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # the tile at k0: score [BLOCK_N, TB] = sum_h w_h relu(S_h), as order keys, each token's own
    # visibility (its row of the table; with counts the one list and its count), stored ; offs_n,
    # offs_t, t_ok, count lie in the score's layout ; not ON: nothing (probes)
    if not ON:
        return
    p = gl.maximum(acc, 0.0) * w[None, :]
    score = gl.sum(gl.reshape(p, [BLOCK_N, TB, H]), axis=2)
    # (`indexer._order_key`, spelled again: a Triton function does not take Gluon layouts)
    score = gl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0 (they tie in the reference)
    bits = score.to(gl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    n = k0 + offs_n
    in_c = (n < C)[:, None] & t_ok[None, :]
    own = gl.load(idx_ptr + offs_t.to(gl.int64)[None, :] * stride_it + n[:, None], mask=in_c,
                  other=-1) >= 0  # fmt: skip
    if HAS_COUNTS:
        own &= n[:, None] < count[None, :]
    key = gl.where(own, key, INT32_MIN)
    gl.store(out_ptr + offs_t.to(gl.int64)[None, :] * stride_ot + n[:, None], key, mask=in_c)


@gluon.jit
def _shared_score_kernel(
    q_ptr,  # [T, 64, 128] bf16 (128 contiguous)
    w_ptr,  # [T, 64] head weights (any float dtype), times w_scale in fp32
    k_ptr,  # [N, 128] bf16 key rows
    idx_ptr,  # [T, C] int64 rows of k, -1 = not visible (HAS_COUNTS: stride_it may be 0)
    counts_ptr,  # HAS_COUNTS: [T] int64, token t sees positions < counts[t]
    out_ptr,  # [T, C] int32 order-preserving score keys
    C,
    T,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_it,
    stride_ot,
    w_scale,
    tiles,  # key tiles a program takes (runtime: one compile for all)
    TB: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr,
    SCAN: gl.constexpr,
    HAS_COUNTS: gl.constexpr,
    PDL: gl.constexpr = False,  # chained launch (device.chain)
    BLOCK_FIRST: gl.constexpr = False,  # grid (token blocks, key chunks)
    MODE: gl.constexpr = 0,  # probes: 1 the gathers alone (no scores: the MMAs compile away), 2 no gathers, 3 neither
):
    # read the live key tiles of [c0, c0 + tiles * BLOCK_N) (the last token's visible prefix) + q
    # and w of TB tokens ; write tiles * BLOCK_N x TB int32
    H: gl.constexpr = 64
    D: gl.constexpr = 128
    NQ: gl.constexpr = TB * H
    gl.static_assert(NUM_BUF >= 3, "NUM_BUF: tiles i - 1 and i and at least one gather")
    chain_start(PDL)
    if BLOCK_FIRST:  # programs next to each other share key tiles (L2)
        pid_c = gl.program_id(1)
        t0 = gl.program_id(0) * TB
    else:
        pid_c = gl.program_id(0)
        t0 = gl.program_id(1) * TB
    c0 = pid_c * tiles * BLOCK_N
    c1 = gl.minimum(c0 + tiles * BLOCK_N, C)
    t_last = gl.minimum(t0 + TB, T) - 1
    last_row = idx_ptr + t_last.to(gl.int64) * stride_it

    # ---- layouts: S^T [BLOCK_N keys, TB x 64 heads], each warpgroup two tokens' heads ; gathers
    # 16 B a thread (16 threads a 256-B row)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, NQ // 2, 16]
    )
    g_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    c_layout: gl.constexpr = gl.BlockedLayout([4], [32], [8], [0])  # 1-D scans
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, D], gl.bfloat16)

    # ---- live tiles: up to the last token's last visible candidate
    if HAS_COUNTS:
        c_end = gl.minimum(c1, gl.load(counts_ptr + t_last).to(gl.int32))
    else:
        offs_scan = gl.arange(0, SCAN, layout=c_layout)
        last = -1
        for s0 in range(c0, c1, SCAN):
            at = s0 + offs_scan
            rows = gl.load(last_row + at, mask=at < c1, other=-1)
            last = gl.maximum(last, gl.max(gl.where(rows >= 0, at, -1), axis=0))
        c_end = last + 1
    n_live = gl.maximum(c_end - c0 + BLOCK_N - 1, 0) // BLOCK_N
    end = gl.minimum(c0 + n_live * BLOCK_N, C)

    offs_gd = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    offs_gn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    offs_r = gl.arange(0, NQ, layout=gl.SliceLayout(0, s_layout))
    # the scores' layout [BLOCK_N, TB] (the head sum's, as the compiler lays it out)
    s_zero = gl.zeros([BLOCK_N, NQ], gl.float32, layout=s_layout)
    r_layout: gl.constexpr = gl.sum(gl.reshape(s_zero, [BLOCK_N, TB, H]), axis=2).type.layout
    offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, r_layout))
    offs_t = t0 + gl.arange(0, TB, layout=gl.SliceLayout(0, r_layout))
    t_ok = offs_t < T
    count = offs_t  # (unused without counts)
    if HAS_COUNTS:
        count = gl.load(counts_ptr + offs_t, mask=t_ok, other=0).to(gl.int32)

    if n_live > 0:
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, D], q_smem_layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], k_smem_layout)
        # ---- q of the TB tokens (rows past T: zeros) with the first tile's group ; w along N
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        offs_qr = gl.arange(0, NQ, layout=gl.SliceLayout(1, q_layout))
        offs_qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        q_tok = t0 + offs_qr // H
        q_at = (q_ptr + q_tok.to(gl.int64)[:, None] * stride_qt
                + (offs_qr % H)[:, None] * stride_qh + offs_qd[None, :])  # fmt: skip
        cp.async_copy_global_to_shared(q_smem, q_at, mask=(q_tok < T)[:, None])
        r_tok = t0 + offs_r // H
        w = gl.load(w_ptr + r_tok.to(gl.int64) * stride_wt + offs_r % H, mask=r_tok < T,
                    other=0.0).to(gl.float32) * w_scale  # fmt: skip

        # ---- prologue: tiles 0 .. NUM_BUF - 2 in flight, tile 0's MMA issued
        for b in gl.static_range(NUM_BUF - 1):
            rows = _tile_idx(last_row, c0 + b * BLOCK_N, end, offs_gn)
            _gather(k_smem.index(b), k_ptr, stride_kn, rows, offs_gd, MODE < 2)
        rows_next = _tile_idx(last_row, c0 + (NUM_BUF - 1) * BLOCK_N, end, offs_gn)
        q_t = q_smem.permute((1, 0))
        acc_a = _issue(k_smem, 0, q_t, s_zero, NUM_BUF)
        # two register sets, tiles alternating between them (an accumulator carried from one
        # iteration into the next while its MMA runs would be moved, and ptxas then serializes
        # every wgmma): tile i's MMA runs while tile i - 1's scores are summed and stored
        for j in range(0, (n_live - 1) // 2):
            i = 2 * j + 1
            acc_b = _issue(k_smem, i, q_t, s_zero, NUM_BUF)
            rows_next = _refill(k_smem, i, k_ptr, stride_kn, rows_next, offs_gd, last_row, c0,
                                end, offs_gn, BLOCK_N, NUM_BUF, MODE < 2)  # fmt: skip
            acc_a = warpgroup_mma_wait(1, deps=[acc_a])
            _emit(acc_a, w, c0 + (i - 1) * BLOCK_N, offs_sn, offs_t, t_ok, count, idx_ptr,
                  out_ptr, C, stride_it, stride_ot, TB, H, BLOCK_N, HAS_COUNTS, MODE % 2 == 0)  # fmt: skip
            acc_a = _issue(k_smem, i + 1, q_t, s_zero, NUM_BUF)
            rows_next = _refill(k_smem, i + 1, k_ptr, stride_kn, rows_next, offs_gd, last_row,
                                c0, end, offs_gn, BLOCK_N, NUM_BUF, MODE < 2)  # fmt: skip
            acc_b = warpgroup_mma_wait(1, deps=[acc_b])
            _emit(acc_b, w, c0 + i * BLOCK_N, offs_sn, offs_t, t_ok, count, idx_ptr,
                  out_ptr, C, stride_it, stride_ot, TB, H, BLOCK_N, HAS_COUNTS, MODE % 2 == 0)  # fmt: skip
        if n_live % 2 == 0:  # the last tile, n_live - 1, into acc_b
            last_b = _issue(k_smem, n_live - 1, q_t, s_zero, NUM_BUF)
            done_a = warpgroup_mma_wait(1, deps=[acc_a])
            _emit(done_a, w, c0 + (n_live - 2) * BLOCK_N, offs_sn, offs_t, t_ok, count, idx_ptr,
                  out_ptr, C, stride_it, stride_ot, TB, H, BLOCK_N, HAS_COUNTS, MODE % 2 == 0)  # fmt: skip
            done_b = warpgroup_mma_wait(0, deps=[last_b])
            _emit(done_b, w, c0 + (n_live - 1) * BLOCK_N, offs_sn, offs_t, t_ok, count, idx_ptr,
                  out_ptr, C, stride_it, stride_ot, TB, H, BLOCK_N, HAS_COUNTS, MODE % 2 == 0)  # fmt: skip
        else:
            done_a = warpgroup_mma_wait(0, deps=[acc_a])
            _emit(done_a, w, c0 + (n_live - 1) * BLOCK_N, offs_sn, offs_t, t_ok, count, idx_ptr,
                  out_ptr, C, stride_it, stride_ot, TB, H, BLOCK_N, HAS_COUNTS, MODE % 2 == 0)  # fmt: skip
        cp.wait_group(0)

    # ---- tiles past the last live one: seen by none of the TB tokens
    none = gl.full([BLOCK_N, TB], INT32_MIN, gl.int32, layout=g_layout)
    offs_nn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    offs_tn = t0 + gl.arange(0, TB, layout=gl.SliceLayout(0, g_layout))
    for i in range(n_live, (c1 - c0 + BLOCK_N - 1) // BLOCK_N):
        n = c0 + i * BLOCK_N + offs_nn
        at = out_ptr + offs_tn.to(gl.int64)[None, :] * stride_ot + n[:, None]
        gl.store(at, none, mask=(n < c1)[:, None] & (offs_tn < T)[None, :])


def supported(q: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor | None = None) -> bool:
    """This kernel applies: an sm_90 GPU, bf16 q [T, 64, 128] with 16-byte rows, bf16 keys of 128
    whose rows start on 16 bytes (FP8 keys: the Triton kernel)."""
    if q.device.type != "cuda" or not is_sm90(q.device) or key_scale is not None:
        return False
    if q.dtype != torch.bfloat16 or tuple(q.shape[1:]) != (HEADS, DIM) or q.stride(2) != 1:
        return False
    return (
        keys.dtype == torch.bfloat16
        and keys.shape[1] == DIM
        and keys.stride(1) == 1
        and keys.data_ptr() % 16 == 0
        and (keys.stride(0) * 2) % 16 == 0
        and q.data_ptr() % 16 == 0
        and (q.stride(0) * 2) % 16 == 0
        and (q.stride(1) * 2) % 16 == 0
    )


def program_tiles(blocks: int, n_tiles: int, programs: int) -> int:
    """Key tiles a program takes: about WAVES programs an SM over `programs` SMs, a power of two
    in [MIN_TILES, MAX_TILES]."""
    per = max(1, (blocks * n_tiles) // (WAVES * programs))
    return max(MIN_TILES, min(MAX_TILES, 1 << (per.bit_length() - 1)))


def shared_scores_sm90(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    weight_scale: float = 1.0,
    counts: torch.Tensor | None = None,
    *,
    num_buf: int = NUM_BUF,
    tiles: int | None = None,
    mode: int = 0,
    block_first: bool = False,
) -> torch.Tensor:
    """`indexer._scores` with shared tokens on the Gluon kernel (`supported(q, keys)` must hold):
    score keys [T, C] int32. counts [T] int64: the rows are one list (stride 0 allowed) and token
    t sees its first counts[t] positions. num_buf, tiles, mode, block_first: knobs for probes."""
    assert supported(q, keys), "shared_scores_sm90: needs sm_90, bf16 q [T, 64, 128], bf16 keys"
    T, C = cand_idxs.shape
    skey = torch.empty(T, C, dtype=torch.int32, device=q.device)
    if T == 0 or C == 0:
        return skey
    n_tiles = cdiv(C, BLOCK_N)
    blocks = cdiv(T, TOKENS)
    tiles = tiles or program_tiles(blocks, n_tiles, num_sms(q.device))
    launch = chain(q.device)
    grid = (cdiv(n_tiles, tiles), blocks)
    _shared_score_kernel[grid[::-1] if block_first else grid](
        q, weights, keys, cand_idxs, skey if counts is None else counts, skey,
        C, T, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), cand_idxs.stride(0),
        skey.stride(0), float(weight_scale), tiles,
        TB=TOKENS, BLOCK_N=BLOCK_N, NUM_BUF=num_buf, SCAN=SCAN, HAS_COUNTS=counts is not None,
        PDL=launch["PDL"], launch_pdl=launch["launch_pdl"], MODE=mode,
        BLOCK_FIRST=block_first, num_warps=8,
    )  # fmt: skip
    return skey
