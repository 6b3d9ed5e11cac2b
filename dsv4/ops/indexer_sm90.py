"""Index scores for Hopper (sm_90) in Gluon, with the key gathers pipelined for real.

  scores_sm90(q, weights, keys, cand_idxs, skey, hist=None, key_scale=None)
      (as `indexer._scores`: writes the order-preserving int32 score keys into skey [T, C], and with
      hist counts them into the hist select's (fine, coarse) rows; `supported` says when)

Why a second kernel: Triton 3.6 compiles the score kernel's indirect gathers (the candidate
indices, then the key rows through them) with `cp.async.wait_group 0` at the top of every tile
(sm_90 PTX, docs/PERF.md, eleventh session), so each 64-key tile waits out a whole memory latency
and the loop issues on ~22% of its cycles. Here each program keeps NUM_BUF - 1 tiles of key rows in
flight by cp.async, and a tile's indices are loaded one iteration before its gather is issued (the
pattern of `sparse_attn_sm90`). S^T = K . Q^T runs on one warpgroup (keys on the MMA rows, so the
head sum stays inside each thread's quad); FP8 keys land raw in a staging buffer and are decoded
into the bf16 wgmma tile.

Not yet run on a GPU: `indexer` does not dispatch here while `SCORES` is False
(`tests/ops/test_indexer.py::test_gpu_sm90_scores` and `bench/probe_pieces.py --only index_sm90`
are the checks to run first). No CPU path: Gluon has no interpreter.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from dsv4.ops.device import num_sms
from dsv4.ops.indexer import COARSE_BINS, HIST_BINS, INT32_MIN, _score_tiles
from dsv4.ops.sparse_attn_sm90 import _gather, _tile_idx  # rows by cp.async, indices

SCORES = False  # indexer._scores dispatches here on sm_90 once test_gpu_sm90_scores has passed
HEADS = 64  # the MMA's N: every indexer head of a token
DIM = 128  # the key width (K of the MMA)


@gluon.jit
def _score_kernel(
    q_ptr,  # [T, 64, 128] bf16
    w_ptr,  # [T, 64] fp32 head weights (already scaled)
    k_ptr,  # [N, 128] bf16 key rows, or (KEY_FP8) uint8 e4m3 codes
    ks_ptr,  # KEY_FP8: [N] fp32 key scales
    idx_ptr,  # [T, C] int64 rows of k, -1 = not visible
    out_ptr,  # [T, C] int32 order-preserving score keys
    hist_ptr,  # HIST: [T, HIST_BINS] int32 fine counts
    coarse_ptr,  # HIST: [T, COARSE_BINS] int32 coarse counts
    C,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_it,
    stride_ot,
    BLOCK_N: gl.constexpr,  # keys per tile (the MMA's M: 64)
    TILES: gl.constexpr,  # tiles per program
    NUM_BUF: gl.constexpr,  # key tiles in shared memory (NUM_BUF - 1 in flight)
    HIST: gl.constexpr,
    KEY_FP8: gl.constexpr,
):
    # read TILES * BLOCK_N visible key rows + q_t + w_t ; write TILES * BLOCK_N int32
    H: gl.constexpr = 64
    D: gl.constexpr = 128
    pid_c = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    c0 = pid_c * TILES * BLOCK_N
    idx_row = idx_ptr + t * stride_it
    out_row = out_ptr + t * stride_ot

    # ---- layouts: S^T [BLOCK_N keys, 64 heads] on one warpgroup ; gathers 16 B per thread
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16]
    )
    if KEY_FP8:  # 8 threads x 16 codes per 128-B row
        g_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    else:  # 16 threads x 8 bf16 per 256-B row
        g_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # 1-D chunk / bins
    k_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)

    # ---- live tiles: up to the chunk's last visible candidate (decode suffix, causal prefill)
    offs_chunk = c0 + gl.arange(0, TILES * BLOCK_N, layout=c_layout)
    idx_chunk = gl.load(idx_row + offs_chunk, mask=offs_chunk < C, other=-1)
    last = gl.max(gl.where(idx_chunk >= 0, offs_chunk, -1), axis=0)
    n_live = (gl.maximum(last + 1 - c0, 0) + BLOCK_N - 1) // BLOCK_N
    end = gl.minimum(c0 + n_live * BLOCK_N, C)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], q_smem_layout)
    if KEY_FP8:  # raw codes NUM_BUF deep, decoded into one bf16 tile before its MMA
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        raw_smem = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, D], plain)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, D], k_smem_layout)
    else:
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], k_smem_layout)

    offs_gd = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    offs_gn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_h = gl.arange(0, H, layout=gl.SliceLayout(0, s_layout))

    # ---- q_t into shared memory (its own group, with the first tile) ; w_t along the MMA's N
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_qh = gl.arange(0, H, layout=gl.SliceLayout(1, q_layout))
    offs_qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q_at = q_ptr + t * stride_qt + offs_qh[:, None] * stride_qh + offs_qd[None, :]
    cp.async_copy_global_to_shared(q_smem, q_at)
    w = gl.load(w_ptr + t * stride_wt + offs_h)

    # ---- prologue: tiles 0 .. NUM_BUF - 2 in flight ; tile i's indices loaded one iteration
    # before its gather is issued, and again (in the score layout) one iteration before its math
    if KEY_FP8:
        dst = raw_smem
    else:
        dst = k_smem
    for b in gl.static_range(NUM_BUF - 1):
        idx = _tile_idx(idx_row, c0 + b * BLOCK_N, end, offs_gn)
        _gather(dst.index(b), k_ptr, stride_kn, idx, offs_gd)
    idx_next = _tile_idx(idx_row, c0 + (NUM_BUF - 1) * BLOCK_N, end, offs_gn)
    idx_s_next = _tile_idx(idx_row, c0, end, offs_sn)

    s_zero = gl.zeros([BLOCK_N, H], gl.float32, layout=s_layout)
    coarse = gl.zeros([COARSE_BINS], gl.int32, layout=c_layout)
    for i in range(n_live):
        # tile i landed (this thread's copies), visible to the async proxy and every thread, and
        # every warp is past tile i - 1's MMA: its buffer takes tile i + NUM_BUF - 1
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        gl.thread_barrier()
        nxt = i + NUM_BUF - 1
        _gather(dst.index(nxt % NUM_BUF), k_ptr, stride_kn, idx_next, offs_gd)
        idx_next = _tile_idx(idx_row, c0 + (nxt + 1) * BLOCK_N, end, offs_gn)
        idx_s = idx_s_next
        idx_s_next = _tile_idx(idx_row, c0 + (i + 1) * BLOCK_N, end, offs_sn)
        if KEY_FP8:  # codes -> bf16 (exact), visible to the MMA ; the scale comes after the sum
            codes = raw_smem.index(i % NUM_BUF).load(g_layout)
            kt = k_smem.index(0)
            kt.store(codes.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
        else:
            kt = k_smem.index(i % NUM_BUF)
        # ---- S^T = K . Q^T [BLOCK_N, 64] ; score = sum_h w_h relu(S_h)
        s = warpgroup_mma(kt, q_smem.permute((1, 0)), s_zero, use_acc=False)
        score = gl.sum(gl.maximum(s, 0.0) * w[None, :], axis=1)  # [BLOCK_N]
        vis = idx_s >= 0
        if KEY_FP8:  # relu(2^e x) = 2^e relu(x): the dequantized keys' scores
            score = score * gl.load(ks_ptr + gl.maximum(idx_s, 0), mask=vis, other=0.0)
        score = gl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0
        bits = score.to(gl.int32, bitcast=True)
        key = gl.where(vis, bits ^ ((bits >> 31) & 0x7FFFFFFF), INT32_MIN)
        offs_n = c0 + i * BLOCK_N + offs_sn
        gl.store(out_row + offs_n, key, mask=offs_n < C)
        if HIST:
            u = key.to(gl.uint32, bitcast=True) ^ 0x80000000  # unsigned order
            fine = hist_ptr + t * HIST_BINS + (u >> 16).to(gl.int32)
            one = gl.full([BLOCK_N], 1, gl.int32, layout=gl.SliceLayout(1, s_layout))
            gl.atomic_add(fine, one, mask=vis, sem="relaxed")
            coarse += gl.histogram((u >> 24).to(gl.int32), COARSE_BINS, mask=vis, layout=c_layout)
    cp.wait_group(0)

    # ---- tiles past the last live one: not visible
    for i in range(n_live, TILES):
        offs_n = c0 + i * BLOCK_N + offs_sn
        none = gl.full([BLOCK_N], INT32_MIN, gl.int32, layout=gl.SliceLayout(1, s_layout))
        gl.store(out_row + offs_n, none, mask=offs_n < C)
    if HIST:
        offs_b = gl.arange(0, COARSE_BINS, layout=c_layout)
        gl.atomic_add(coarse_ptr + t * COARSE_BINS + offs_b, coarse, mask=coarse != 0,
                      sem="relaxed")  # fmt: skip


def supported(q: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor | None = None) -> bool:
    """This kernel applies: an sm_90 GPU, bf16 q [T, 64, 128] with 16-byte rows, keys of 128 bf16
    (or, with key_scale, 128 e4m3 codes) whose rows start on 16 bytes."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype != torch.bfloat16 or tuple(q.shape[1:]) != (HEADS, DIM) or q.stride(2) != 1:
        return False
    want = torch.uint8 if key_scale is not None else torch.bfloat16
    row_bytes = keys.stride(0) * keys.element_size()
    return (
        keys.dtype == want
        and keys.shape[1] == DIM
        and keys.stride(1) == 1
        and keys.data_ptr() % 16 == 0
        and row_bytes % 16 == 0
        and q.data_ptr() % 16 == 0
        and (q.stride(0) * 2) % 16 == 0
        and (q.stride(1) * 2) % 16 == 0
    )


def scores_sm90(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    skey: torch.Tensor,
    hist: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: torch.Tensor | None = None,
    *,
    num_buf: int = 4,
    programs_per_sm: int = 2,
) -> None:
    """`indexer._scores` on the Gluon kernel (`supported(q, keys, key_scale)` must hold): score keys
    into skey [T, C]; hist: (fine, coarse) count rows, added to. num_buf: key tiles in shared
    memory; programs_per_sm: how the candidates are cut into programs."""
    assert supported(q, keys, key_scale), (
        "scores_sm90: needs sm_90, bf16 q [T, 64, 128], 128-wide bf16 keys or FP8 codes"
    )
    T, C = cand_idxs.shape
    w = weights.float()
    block_n = 64
    n_tiles = triton.cdiv(C, block_n)
    tiles = _score_tiles(T, n_tiles, programs_per_sm * num_sms(q.device))
    fine, coarse = hist if hist is not None else (skey, skey)
    _score_kernel[(triton.cdiv(n_tiles, tiles), T)](
        q, w, keys, key_scale if key_scale is not None else w, cand_idxs, skey, fine, coarse, C,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), cand_idxs.stride(0), skey.stride(0),
        BLOCK_N=block_n, TILES=tiles, NUM_BUF=num_buf, HIST=hist is not None,
        KEY_FP8=key_scale is not None, num_warps=4,
    )  # fmt: skip
