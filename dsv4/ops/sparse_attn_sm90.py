"""Sparse attention (decode steps and prefill chunks) for Hopper (sm_90) in Gluon: the layout
Triton cannot express.

  sparse_attn_sm90(q, kv, attn_sink, topk_idxs, scale) -> o   (as `dsv4.ops.sparse_attn`, for
  64 heads, 512 channels, bf16, 1..3 kv sources of bf16 rows or FP8 entries; `supported` says when)

Why a second kernel: in the Triton kernel S = Q K^T feeds a second dot, so Triton puts all warps
of S along M (the 64 heads) and both warpgroups compute all of S; the loop is latency bound at
~30% of HBM bandwidth (docs/PERF.md). Here the two warpgroups split each tile of keys (S [64, BN]
has warps [4, 2]: warpgroup g computes the scores of keys g*BN/2 ..), the row max and sum cross
the warpgroups through shared memory, P goes to shared memory once, and each warpgroup
accumulates its half of the 512 output channels over every key of the tile (O [64, 512] has
warps [4, 2] too: O[:, g*256 ..] += P K[:, g*256 ..]). Gathered rows arrive by cp.async
NUM_BUF - 1 tiles ahead. Two splits (T = 45..66 on an H200, the batch-64 decode) finish inside
the kernel: with bf16 rows each split publishes the half of its partial the other split owns,
waits for the other's half and writes o for its own 32 heads (`_half_finish`); with FP8 entries
split 1 waits for split 0's whole partial and writes all of o (`_fixup`); both with the inverse
RoPE. Other split counts use the Triton kernel's combine. Prefill
chunks (one program a token, unsplit) come here too: their three sources (ring, the chunk's new
rows, the entries) are addressed from one pointer by index range (`_rows`), and o is written
with the inverse RoPE (`_finish_rope`). H200, T=4096, 128 + 512 keys: 1178 us against the Triton
kernel's 2036 (docs/PERF.md, forty-fifth session). Both epilogues stage acc (fp32, 128 KB) in the
kv buffers once the loop is done: bf16 rows' tiles, or q with FP8 entries' raw tiles, which
are one allocation for this (FP8, H200, T=64: 40.8 -> 37.7 us against the combine
launch; T=1024 unsplit: 491 -> 436 us against a rotary launch; forty-sixth session).

H200, T=64, 640 keys, 2 splits (docs/PERF.md): 30.3 us against the Triton kernel's 39.1. The
gathers alone (MODE=1, partials and combine included) take 25 us and the math alone (MODE=2)
27.6, so neither hides the other: the fp32 partials of 2 splits double the bytes of the gathered
rows, and one 64-key tile of math takes ~2.4 us where its tensor and shared-memory work is ~1.

No CPU path: Gluon has no interpreter. The Triton kernel in `sparse_attn` is the reference
this one is tested against on the GPU (tests/ops/test_sparse_attn.py).
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

from dsv4.ops import sparse_attn as _triton
from dsv4.ops.device import arrival_counts, cdiv, chain, chain_start, is_sm90, num_sms
from dsv4.ops.rope import check_rope
from dsv4.quant import kv_entry_layout

HEADS = 64  # one warpgroup's M: all heads of a token
DIM = 512  # the K = V row (the rope part is rotated into it)
ROPE = 64  # FP8 entries: the bf16 rope channels (the other 448 are e4m3)
# FP8 entries through this kernel (gathered raw by cp.async, decoded into the wgmma tile, FlashMLA's
# design; `test_gpu_sm90_entries`; H200 `bench/probe_pieces.py --only attn_fp8`: T=64 40.9 us
# against the Triton kernel's 65.1)
FP8_ENTRIES = True
NEG = gl.constexpr(-1.0e30)  # finite "no key yet" running max (as the Triton kernel)
# the epilogues' chunks of o (rows x 128 channels, 4 channels a thread): staged acc read back, the
# peer's published rows, o written
CHUNK = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0]))
# two splits finish in the kernel (`_fixup`, `_half_finish`): they combine their partials and
# write o (with the inverse RoPE), instead of the Triton kernel's combine launch
# (H200, T=64, 640 keys, one source: 31.7 -> 29.4 us, `bench ops`; docs/PERF.md 36th session)
FIXUP = True
FIXUP_MAX_TOKENS = 4096  # tokens the semaphores cover (two splits fill an H200 from 45 to 66)
# bf16 rows: the two splits of a token each combine half of its heads (`_half_finish`): each
# publishes the peer's half of its partial (64 KB, not split 0's whole 128 KB) and writes its own
# half of o, in parallel. They wait on each other, so the launcher takes this where every program
# can be resident at once (2T <= SMs at one program per SM); otherwise split 1 combines all
# (`_fixup`). H200, graph replays, the same bits: T=64 with the inverse RoPE 27.1 -> 25.9 us,
# T=48 26.0 -> 24.5 (1 of it from staging acc after the flag, not before); FP8 entries slower
# (T=64 37.78 -> 38.6: 244 B of spills), so not there. Polling the rows in a sentinel-filled
# workspace instead of a flag was slower still (33.6 us; docs/PERF.md, forty-ninth session)
FIXUP_HALVES = True
# ... and where fewer SMs serve the process than the device reports (an MPS client's active-thread
# limit, a green context), split 0 stops waiting for a split 1 that is not resident after this
# many reads of its signal (each an L2 round trip) and hands split 1 the whole combine:
# no hang, the same bits (`_half_finish`; `test_gpu_sm90_halves_handover`). H200, T=64 with the
# inverse RoPE: 25.84 -> 26.00 us against the unbounded wait; every split 0 giving up at once
# (0 reads) 28.0, the one-way combine 26.9 (docs/PERF.md, fiftieth session)
HALVES_POLLS = 1024
# FP8 entries: S over a tile's first 256 channels in flight while the other 256 decode
OVERLAP = True


@gluon.jit
def _tile_idx(idx_row, k0, k_end, offs):  # noqa: ANN001, ANN202
    # the kv rows of keys k0 + offs (-1 past k_end)
    k = k0 + offs
    return gl.load(idx_row + k, mask=k < k_end, other=-1)


@gluon.jit
def _rows(kv_ptr, src, idx, NUM_SRC: gl.constexpr, ALIGN: gl.constexpr):  # noqa: ANN001, ANN202
    # pointers to rows idx (-1: row 0, masked by the caller) of the concatenation of NUM_SRC <= 3
    # sources: src = (n0, n1, stride0, stride1, stride2, at1, at2), source i > 0 at element
    # offset at_i from source 0 (kv_ptr). Every row starts on ALIGN bytes (`supported`), which
    # is asserted on the pointers themselves: source 0 may start on fewer than the 16 bytes a
    # launch assumes of a pointer argument, and an FP8 entry's 8-byte copies need it. (NUM_SRC
    # stays out of the tuple: there it became a runtime branch)
    n0, n1, stride0, stride1, stride2, at1, at2 = src
    j = gl.maximum(idx, 0).to(gl.int64)
    off = j * stride0
    if NUM_SRC > 1:
        off = gl.where(j >= n0, at1 + (j - n0) * stride1, off)
    if NUM_SRC > 2:
        off = gl.where(j >= n0 + n1, at2 + (j - n0 - n1) * stride2, off)
    return gl.multiple_of(kv_ptr + off, ALIGN)


@gluon.jit
def _gather(buf, kv_ptr, src, idx, offs_gd, NUM_SRC: gl.constexpr):  # noqa: ANN001, ANN202
    # rows idx of the sources into buf by cp.async (-1: zeros), one commit group
    rows = _rows(kv_ptr, src, idx, NUM_SRC, 16)
    cp.async_copy_global_to_shared(buf, rows[:, None] + offs_gd[None, :], mask=(idx >= 0)[:, None])
    cp.commit_group()


@gluon.jit
def _copy_rows(dst, at, ok, N: gl.constexpr, VALID: gl.constexpr, lay: gl.constexpr):
    # dst [BN, N] <- N elements from each row pointer at [BN] by cp.async (rows not ok and
    # columns >= VALID: zeros)
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, lay))
    at = gl.convert_layout(at, gl.SliceLayout(1, lay))
    ok = gl.convert_layout(ok, gl.SliceLayout(1, lay))
    mask = ok[:, None] & (cols < VALID)[None, :]
    cp.async_copy_global_to_shared(dst, at[:, None] + cols[None, :], mask=mask)


@gluon.jit
def _gather_entries(raw, rope, sc, kv_ptr, src, idx, BLOCK_N: gl.constexpr, NOPE: gl.constexpr,
                    NUM_SRC: gl.constexpr):  # fmt: skip
    # FP8 entries idx of the sources (uint8 rows, 8-byte aligned; -1: zeros) by cp.async, one
    # commit group: the e4m3 codes into raw [BN, 512], the bf16 rope bits into rope [BN, 64]
    # (int16), the scale bytes (after the codes and the 64 rope values) into sc [BN, 8]
    rows = _rows(kv_ptr, src, idx, NUM_SRC, 8)  # [BN] (entries start on 8 bytes)
    ok = idx >= 0
    _copy_rows(raw, rows, ok, 512, NOPE, gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
    _copy_rows(rope, (rows + NOPE).to(gl.pointer_type(gl.int16)), ok, 64, 64,
               gl.BlockedLayout([1, 4], [2, 16], [8, 1], [1, 0]))  # fmt: skip
    _copy_rows(sc, rows + (NOPE + 128), ok, 8, 8, gl.BlockedLayout([1, 8], [32, 1], [8, 1], [1, 0]))
    cp.commit_group()


@gluon.jit
def _decode_entries(raw, rope, sc, dst, NOPE: gl.constexpr, J0: gl.constexpr = 0,
                    J1: gl.constexpr = -1, ROPE_TOO: gl.constexpr = True):  # fmt: skip
    # gathered FP8 entries -> bf16 values in dst [BN, 512] (the wgmma tile), exactly: each 64-wide
    # block j in J0 .. J1 (default: all) of codes times its scale 2^(S - 127), then the rope bits
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    for j in gl.static_range(J0, NOPE // 64 if J1 < 0 else J1):
        codes = raw.slice(64 * j, 64, dim=1).load(lay)
        s = sc.slice(j, 1, dim=1).load(lay)  # [BN, 1]
        scale = (s.to(gl.int32) << 23).to(gl.float32, bitcast=True)
        v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale
        dst.slice(64 * j, 64, dim=1).store(v.to(gl.bfloat16))
    if ROPE_TOO:
        dst.slice(NOPE, 64, dim=1).store(rope.load(lay).to(gl.bfloat16, bitcast=True))


@gluon.jit
def _softmax(s, valid, qk_scale, m_i, l_i):  # noqa: ANN001, ANN202
    # one tile's online-softmax step (log2 domain): P, the rescale of what came before, new m, l
    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _sink_factor(m, l, sink_ptr, offs_h):  # noqa: ANN001, ANN202, E741
    # 1 / (l + 2^(sink - m)) with every term rescaled to max(m, sink): the sink joins only the
    # denominator (log2 units, like m)
    sink = gl.load(sink_ptr + offs_h) * 1.4426950408889634
    m_all = gl.maximum(m, sink)
    alpha = gl.exp2(m - m_all)
    return alpha / (l * alpha + gl.exp2(sink - m_all))


@gluon.jit
def _normalise(acc, m, l, sink_ptr, offs_h):  # noqa: ANN001, ANN202, E741
    # the unsplit output: acc over the sink-augmented denominator
    return acc * _sink_factor(m, l, sink_ptr, offs_h)[:, None]


@gluon.jit
def _mul_rn(a, b):  # noqa: ANN001, ANN202
    # a * b rounded on its own (never fused into an FMA whose form could differ between builds)
    return gl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _peer_part(peer_rows, c, cols, CH: gl.constexpr):  # noqa: ANN001, ANN202
    # channels c*CH .. of the peer split's published partial (fp32, from L2)
    return gl.load(peer_rows + (c * CH + cols)[None, :], cache_modifier=".cg")


@gluon.jit
def _combine_part(own, b, c, w0, w1, o_rows, cols, CH: gl.constexpr, c_layout: gl.constexpr):  # noqa: ANN001, ANN202
    # o channels c*CH .. = w0 * split 0's partial (b) + w1 * split 1's (own), products rounded
    # on their own
    a = own.slice(c * CH, CH, dim=1).load(c_layout)
    out = _mul_rn(b, w0) + _mul_rn(a, w1)
    gl.store(o_rows + (c * CH + cols)[None, :], out.to(gl.bfloat16))


@gluon.jit
def _combine_part_rope(own, b, c, w0, w1, o_rows, cols, cos_row, sin_row, CH: gl.constexpr,
                       RD: gl.constexpr, c_layout: gl.constexpr):  # fmt: skip
    # `_combine_part` for the chunk holding the last RD channels, RoPE undone on them in
    # registers as `rope.rotary` does it: o rounded to bf16, each pair (2j, 2j+1) rotated back
    # in fp32 by position t's (cos, -sin) and rounded again (`rope.rotate_tile`'s expressions)
    gl.static_assert(RD <= CH, "the RoPE channels lie in the last chunk")
    a = own.slice(c * CH, CH, dim=1).load(c_layout)
    out = (_mul_rn(b, w0) + _mul_rn(a, w1)).to(gl.bfloat16).to(gl.float32)
    re, im = gl.split(gl.reshape(out, [out.shape[0], CH // 2, 2]))
    pair = gl.arange(0, CH // 2, layout=gl.SliceLayout(0, re.type.layout)) - (CH - RD) // 2
    rope = (pair >= 0)[None, :]
    cos = gl.load(cos_row + pair, mask=pair >= 0, other=1.0)[None, :]
    sin = -gl.load(sin_row + pair, mask=pair >= 0, other=0.0)[None, :]
    re_t = gl.where(rope, re * cos - im * sin, re)
    im_t = gl.where(rope, re * sin + im * cos, im)
    turned = gl.convert_layout(gl.reshape(gl.join(re_t, im_t), [out.shape[0], CH]), c_layout)
    gl.store(o_rows + (c * CH + cols)[None, :], turned.to(gl.bfloat16))


@gluon.jit
def _staged(acc, kv_smem):  # noqa: ANN001, ANN202
    # acc stored in shared memory (fp32 over the free bf16 kv buffers, swizzled so the MMA
    # layout's row pairs store without bank conflicts) -> that buffer
    st_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    gl.static_assert(  # (bf16 buffers; the launcher stages only where they hold acc)
        kv_smem.shape[0] * kv_smem.shape[1] * kv_smem.shape[2] * 2
        >= acc.shape[0] * acc.shape[1] * 4,
        "the kv buffers hold less than acc",
    )
    own = kv_smem._reinterpret(gl.float32, [acc.shape[0], acc.shape[1]], st_layout)
    own.store(acc)
    return own


@gluon.jit
def _stage(acc, m_o, l_o, kv_smem, CH: gl.constexpr):  # noqa: ANN001, ANN202
    # acc -> shared memory (fp32 [64, 512] over the free bf16 kv buffers, swizzled so the MMA
    # layout's row pairs store without bank conflicts), to be written in CH-channel chunks:
    # (own, rows, cols, m, l), the last three in the chunks' layout
    own = _staged(acc, kv_smem)
    c_layout: gl.constexpr = CHUNK
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, c_layout))
    cols = gl.arange(0, CH, layout=gl.SliceLayout(0, c_layout))
    m = gl.convert_layout(m_o, gl.SliceLayout(1, c_layout))
    l = gl.convert_layout(l_o, gl.SliceLayout(1, c_layout))  # noqa: E741
    return own, rows, cols, m, l


@gluon.jit
def _write_o(own, b0, b1, b2, b3, w0, w1, o_rows, cols, cos_row, sin_row, CH: gl.constexpr,
             RD: gl.constexpr, c_layout: gl.constexpr):  # fmt: skip
    # o's four CH-channel chunks from the staged acc (own) and the peer's parts b0..b3
    # (`_combine_part`), RoPE undone on the last RD channels when RD > 0
    _combine_part(own, b0, 0, w0, w1, o_rows, cols, CH, c_layout)
    _combine_part(own, b1, 1, w0, w1, o_rows, cols, CH, c_layout)
    _combine_part(own, b2, 2, w0, w1, o_rows, cols, CH, c_layout)
    if RD > 0:  # (the last RD channels lie in the last chunk)
        _combine_part_rope(own, b3, 3, w0, w1, o_rows, cols, cos_row, sin_row, CH, RD, c_layout)
    else:
        _combine_part(own, b3, 3, w0, w1, o_rows, cols, CH, c_layout)


@gluon.jit
def _finish_rope(acc, m_o, l_o, kv_smem, t, sink_ptr, o_ptr, cos_ptr, sin_ptr, stride_ot,
                 stride_oh, stride_ct, stride_st, RD: gl.constexpr):  # fmt: skip
    # the unsplit output with the inverse RoPE on its last RD channels: `_normalise`'s values
    # (the same factor), staged in the free kv buffers and written in 128-channel chunks as
    # `_fixup`'s split 1 writes them (the peer's part zero), the last chunk rotated in registers
    H: gl.constexpr = 64
    CH: gl.constexpr = 128
    own, rows, cols, m, l = _stage(acc, m_o, l_o, kv_smem, CH)  # noqa: E741
    c_layout: gl.constexpr = cols.type.layout.parent
    w1 = _sink_factor(m, l, sink_ptr, rows)[:, None]
    w0 = gl.zeros([H, 1], gl.float32, c_layout)
    zero = gl.zeros([H, CH], gl.float32, c_layout)
    gl.thread_barrier()  # every thread's acc is in shared memory
    o_rows = o_ptr + t * stride_ot + rows[:, None] * stride_oh
    _write_o(own, zero, zero, zero, zero, w0, w1, o_rows, cols, cos_ptr + t * stride_ct,
             sin_ptr + t * stride_st, CH, RD, c_layout)  # fmt: skip


@gluon.jit
def _split_weights(m0, l0, m1, l1, sink_ptr, rows):  # noqa: ANN001, ANN202
    # the weights [rows, 1] of two partials (m0, l0) and (m1, l1) in o: each one's rescale over the
    # sink-augmented denominator of both (products rounded on their own: the same bits in every
    # compiled variant, RD or not, and with the partials swapped: fp32 sums commute exactly)
    sink = gl.load(sink_ptr + rows) * 1.4426950408889634
    m_all = gl.maximum(gl.maximum(m0, m1), sink)
    e0 = gl.exp2(m0 - m_all)
    e1 = gl.exp2(m1 - m_all)
    den = (_mul_rn(e0, l0) + _mul_rn(e1, l1)) + gl.exp2(sink - m_all)
    return (e0 / den)[:, None], (e1 / den)[:, None]


@gluon.jit
def _fixup(acc, m_o, l_o, kv_smem, t, split, part_ptr, ml_ptr, sem_ptr, sink_ptr, o_ptr, cos_ptr,
           sin_ptr, stride_pt, stride_ph, stride_mt, stride_ot, stride_oh, stride_ct, stride_st,
           RD: gl.constexpr):  # fmt: skip
    # two splits of token t finish here without a combine launch. Split 0 publishes its partial
    # (acc, m, l) and a flag; split 1 stages its own acc in the free kv buffers, waits for the
    # flag and writes o from both, then zeroes the flag. Split 1 waits only for a program that
    # comes before it in launch order (every (t, 0) is dispatched before any (t, 1): resident
    # or done, so no deadlock, as stream-K's fixups rely on)
    H: gl.constexpr = 64
    D: gl.constexpr = 512
    CH: gl.constexpr = 128  # output channels per combine step (the peer's 4 loaded at once)
    o_layout: gl.constexpr = acc.type.layout
    offs_h = gl.arange(0, H, layout=gl.SliceLayout(1, o_layout))
    offs_v = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    flag = sem_ptr + 2 * t + 1
    if split == 0:
        hv = offs_h[:, None] * stride_ph + offs_v[None, :]
        gl.store(part_ptr + t * stride_pt + hv, acc)
        ml = ml_ptr + t * stride_mt + offs_h
        gl.store(ml, m_o)
        gl.store(ml + H, l_o)
        gl.thread_barrier()  # every thread's partial before the flag
        gl.atomic_xchg(flag, 1, sem="release")
    else:
        own, rows, cols, m_own, l_own = _stage(acc, m_o, l_o, kv_smem, CH)  # own acc staged
        c_layout: gl.constexpr = cols.type.layout.parent
        ready = gl.atomic_add(flag, 0, sem="acquire")
        while ready == 0:
            ready = gl.atomic_add(flag, 0, sem="acquire")
        gl.thread_barrier()  # the peer's partial is visible to every thread; own acc stored
        # the peer's partial all at once (one round trip), then the weights from (m, l) of both
        peer_rows = part_ptr + t * stride_pt + rows[:, None] * stride_ph
        b0 = _peer_part(peer_rows, 0, cols, CH)
        b1 = _peer_part(peer_rows, 1, cols, CH)
        b2 = _peer_part(peer_rows, 2, cols, CH)
        b3 = _peer_part(peer_rows, 3, cols, CH)
        ml_peer = ml_ptr + t * stride_mt + rows
        m0 = gl.load(ml_peer, cache_modifier=".cg")  # (split 0's: the peer's)
        l0 = gl.load(ml_peer + H, cache_modifier=".cg")
        w0, w1 = _split_weights(m0, l0, m_own, l_own, sink_ptr, rows)
        o_rows = o_ptr + t * stride_ot + rows[:, None] * stride_oh
        _write_o(own, b0, b1, b2, b3, w0, w1, o_rows, cols, cos_ptr + t * stride_ct,
                 sin_ptr + t * stride_st, CH, RD, c_layout)  # fmt: skip
        gl.store(flag, 0)  # zero between launches (only the two splits of t touch it)


@gluon.jit
def _half_o(own, H0: gl.constexpr, peer_part, ml_peer, ml_me, t, sink_ptr, o_ptr, cos_ptr,
            sin_ptr, stride_ph, stride_ot, stride_oh, stride_ct, stride_st,
            RD: gl.constexpr):  # fmt: skip
    # o for heads H0 .. H0 + 32 of token t from this split's staged acc (own) and the peer's
    # published rows (peer_part, fp32) with both splits' (m, l): the weights and products of
    # `_fixup`, so its bits whichever split writes them (the additions commute)
    H: gl.constexpr = 64
    HALF: gl.constexpr = 32
    CH: gl.constexpr = 128  # output channels per combine step (the peer's 4 loaded at once)
    c_layout: gl.constexpr = CHUNK  # [HALF, CH]
    rows = H0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, c_layout))
    cols = gl.arange(0, CH, layout=gl.SliceLayout(0, c_layout))
    peer_rows = peer_part + rows[:, None] * stride_ph
    b0 = _peer_part(peer_rows, 0, cols, CH)
    b1 = _peer_part(peer_rows, 1, cols, CH)
    b2 = _peer_part(peer_rows, 2, cols, CH)
    b3 = _peer_part(peer_rows, 3, cols, CH)
    m_p = gl.load(ml_peer + rows, cache_modifier=".cg")
    l_p = gl.load(ml_peer + H + rows, cache_modifier=".cg")
    m_m = gl.load(ml_me + rows, cache_modifier=".cg")  # (this program's, published before)
    l_m = gl.load(ml_me + H + rows, cache_modifier=".cg")
    w_p, w_m = _split_weights(m_p, l_p, m_m, l_m, sink_ptr, rows)
    o_rows = o_ptr + t * stride_ot + rows[:, None] * stride_oh
    _write_o(own.slice(H0, HALF, dim=0), b0, b1, b2, b3, w_p, w_m, o_rows, cols,
             cos_ptr + t * stride_ct, sin_ptr + t * stride_st, CH, RD, c_layout)  # fmt: skip


@gluon.jit
def _half_finish(acc, m_o, l_o, kv_smem, t, part_ptr, ml_ptr, sem_ptr, sink_ptr, o_ptr, cos_ptr,
                 sin_ptr, polls, stride_pt, stride_ps, stride_ph, stride_mt, stride_ms, stride_ot,
                 stride_oh, stride_ct, stride_st, ME: gl.constexpr, RD: gl.constexpr):  # fmt: skip
    # split ME of token t's two: publish the peer's half of the heads of acc (fp32 rows, with m, l
    # of every head) and signal it, stage its own acc in the free kv buffers (off the signals'
    # round trip), wait for the peer's rows and write o for its own half of the heads
    # (`_half_o`). Two words a token, zero between launches:
    #   sem[2t]      split 0's: 1 its rows for split 1 are out; 3 split 1 took them (so the
    #                halves); 2 split 0 gave the combine up to split 1; 4 all its rows are out
    #   sem[2t + 1]  split 1's: 1 its rows for split 0 are out
    # Split 1 waits only for split 0, which comes before it in launch order (resident or done, as
    # `_fixup`), and its wait is the claim itself (1 -> 3, acquire only: the claim publishes
    # nothing), so the claim costs it no round trip of its own.
    # Split 0 waits for split 1 at most `polls` reads: a split 1 that is not resident (fewer SMs
    # than the launcher counted: an MPS client's limit, a green context) would never come while
    # every SM holds a waiting split 0. Unless split 1 has taken the rows by then, split 0 gives
    # the combine up (1 -> 2), publishes the rest of its partial (-> 4) and leaves, and split 1
    # writes all 64 heads (the same bits).
    H: gl.constexpr = 64
    HALF: gl.constexpr = 32
    D: gl.constexpr = 512
    CH: gl.constexpr = 128
    PEER: gl.constexpr = 1 - ME
    o_layout: gl.constexpr = acc.type.layout
    offs_h = gl.arange(0, H, layout=gl.SliceLayout(1, o_layout))
    offs_v = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    theirs = (offs_h >= PEER * HALF) & (offs_h < PEER * HALF + HALF)
    hv = offs_h[:, None] * stride_ph + offs_v[None, :]
    part_me = part_ptr + t * stride_pt + ME * stride_ps
    gl.store(part_me + hv, acc, mask=theirs[:, None] & (offs_v < D)[None, :])
    ml_me = ml_ptr + t * stride_mt + ME * stride_ms
    gl.store(ml_me + offs_h, m_o)
    gl.store(ml_me + H + offs_h, l_o)
    gl.thread_barrier()  # every thread's published rows before the signal
    said0 = sem_ptr + 2 * t  # split 0's word
    said1 = sem_ptr + 2 * t + 1  # split 1's word
    gl.atomic_xchg(said0 if ME == 0 else said1, 1, sem="release")
    own = _staged(acc, kv_smem)  # while the signals cross (read back past a barrier)
    part_peer = part_ptr + t * stride_pt + PEER * stride_ps
    ml_peer = ml_ptr + t * stride_mt + PEER * stride_ms
    if ME == 0:
        ready = gl.atomic_add(said1, 0, sem="acquire")
        n = 0
        while (ready == 0) & (n < polls):
            ready = gl.atomic_add(said1, 0, sem="acquire")
            n += 1
        gave = ready * 0
        if ready == 0:  # split 1 has not come: give the combine up, unless it has taken the rows
            gave = (gl.atomic_cas(said0, 1, 2, sem="acq_rel") == 1).to(gl.int32)
            if gave == 0:  # it has (it is running: its signal comes)
                while ready == 0:
                    ready = gl.atomic_add(said1, 0, sem="acquire")
        gl.thread_barrier()  # the peer's rows are visible to every thread, own acc is staged
        if gave == 1:  # the rest of the partial (this split's own heads) from the staged acc
            c_layout: gl.constexpr = CHUNK
            rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, c_layout))
            cols = gl.arange(0, CH, layout=gl.SliceLayout(0, c_layout))
            mine = own.slice(0, HALF, dim=0)
            for c in gl.static_range(D // CH):
                a = mine.slice(c * CH, CH, dim=1).load(c_layout)
                gl.store(part_me + rows[:, None] * stride_ph + (c * CH + cols)[None, :], a)
            gl.thread_barrier()  # every thread's rows before the signal
            gl.atomic_xchg(said0, 4, sem="release")
        else:
            _half_o(own, 0, part_peer, ml_peer, ml_me, t, sink_ptr, o_ptr, cos_ptr, sin_ptr,
                    stride_ph, stride_ot, stride_oh, stride_ct, stride_st, RD)  # fmt: skip
            gl.store(said1, 0)  # zero between launches (split 1 signals nothing more)
    else:
        seen = gl.atomic_cas(said0, 1, 3, sem="acquire")
        while seen == 0:
            seen = gl.atomic_cas(said0, 1, 3, sem="acquire")
        gl.thread_barrier()  # the peer's rows are visible to every thread, own acc is staged
        _half_o(own, HALF, part_peer, ml_peer, ml_me, t, sink_ptr, o_ptr, cos_ptr, sin_ptr,
                stride_ph, stride_ot, stride_oh, stride_ct, stride_st, RD)  # fmt: skip
        if seen != 1:  # split 0 gave the combine up: its heads too, once all its rows are out
            while seen != 4:
                seen = gl.atomic_add(said0, 0, sem="acquire")
            gl.thread_barrier()
            _half_o(own, 0, part_peer, ml_peer, ml_me, t, sink_ptr, o_ptr, cos_ptr, sin_ptr,
                    stride_ph, stride_ot, stride_oh, stride_ct, stride_st, RD)  # fmt: skip
            gl.store(said1, 0)  # (split 0 reads it no more)
        gl.store(said0, 0)  # zero between launches (a late give-up finds 0, not 1: it fails)


@gluon.jit
def _decode_kernel(
    q_ptr,  # [T, 64, 512] bf16
    kv_ptr,  # source 0: [n0, 512] bf16 rows or FP8 entries (row stride stride_k0)
    idx_ptr,  # [T, K] int32/int64 rows of kv, -1 = none
    sink_ptr,  # [64] fp32
    o_ptr,  # [T, 64, 512] bf16 (written when not SPLIT, or by the last split with FIXUP)
    part_ptr,  # [T, S, 64, 512] fp32 unnormalised split outputs (SPLIT)
    ml_ptr,  # [T, S, 2, 64] fp32 (SPLIT)
    sem_ptr,  # FIXUP: [T, 2] int32 the splits' signals (`_fixup`, `_half_finish`), zero after
    cos_ptr,  # FIXUP and RD: [T, RD/2] fp32 cos / sin of the tokens' positions (inverse RoPE)
    sin_ptr,
    polls,  # HALVES: split 0's reads of split 1's signal before it hands over (`_half_finish`)
    K,
    keys_per_split,
    qk_scale,  # scale * log2(e)
    stride_qt,
    stride_qh,
    n0,  # rows of source 0 and 1 (indices count through the sources in order)
    n1,
    stride_k0,
    stride_k1,
    stride_k2,
    at1,  # element offsets of sources 1 and 2 from kv_ptr (any sign)
    at2,
    stride_it,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_mt,
    stride_ms,
    stride_ct,
    stride_st,
    BLOCK_N: gl.constexpr,  # keys per tile (BLOCK_N / 2 per warpgroup for S)
    NUM_BUF: gl.constexpr,  # gathered tiles in shared memory (NUM_BUF - 1 in flight)
    SPLIT: gl.constexpr,
    MODE: gl.constexpr = 0,  # probes only: 1 = the gathers alone, 2 = the math alone (tile 0)
    ENTRIES: gl.constexpr = False,  # kv rows are FP8 entries (uint8, `dsv4.ops.kv_fp8`; MODE 0)
    NOPE: gl.constexpr = 448,  # ENTRIES: e4m3 channels (then 64 bf16 rope, 8 scale bytes)
    PDL: gl.constexpr = False,  # chained launch (device.chain)
    FIXUP: gl.constexpr = False,  # two splits: split 1 combines them here (no combine launch)
    RD: gl.constexpr = 0,  # > 0: the inverse RoPE on o's last RD channels (FIXUP or unsplit)
    NUM_SRC: gl.constexpr = 1,  # kv sources (1..3)
    OVERLAP: gl.constexpr = False,  # ENTRIES: S of the first 256 channels beside the rest's decode
    HALVES: gl.constexpr = False,  # FIXUP: each split combines half the heads (`_half_finish`)
):
    chain_start(PDL)
    src = (n0, n1, stride_k0, stride_k1, stride_k2, at1, at2)
    H: gl.constexpr = 64
    D: gl.constexpr = 512
    t = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)

    # ---- layouts: S [64, BN] and O [64, 512] on 2 warpgroups side by side (warps [4, 2])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    # gathers: 8 bf16 (16 B) per thread, a warp on 256 contiguous channels of one row
    g_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], gl.bfloat16)

    p_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BLOCK_N], p_smem_layout)
    if ENTRIES:  # raw entries NUM_BUF deep, decoded into one bf16 tile before its MMAs. Raw tiles
        # that fit in 64 KB share one allocation with q (q, then the raw tiles from RAW_AT), which
        # the epilogue stages acc over. (Not with the bf16 tile: the decode's loads of raw tiles
        # and stores to that tile in one allocation read as hazards, a barrier every 64 channels)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        RAW_Q: gl.constexpr = H * D * 2 // (BLOCK_N * 512)  # raw tiles in q's bytes
        if NUM_BUF <= RAW_Q:
            q_pool = gl.allocate_shared_memory(gl.bfloat16, [2, H, D], q_smem_layout)
            q_smem = q_pool.index(0)
            raw_smem = q_pool._reinterpret(gl.uint8, [2 * RAW_Q, BLOCK_N, 512], plain)
            RAW_AT: gl.constexpr = RAW_Q
            stage_smem = q_pool
        else:  # (nothing to stage in: the launcher's `staged` is false)
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], q_smem_layout)
            raw_smem = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 512], plain)
            RAW_AT: gl.constexpr = 0
            stage_smem = raw_smem
        rope_smem = gl.allocate_shared_memory(gl.int16, [NUM_BUF, BLOCK_N, 64], plain)
        sc_smem = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 8], plain)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, D], kv_smem_layout)
    else:
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], q_smem_layout)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], kv_smem_layout)
        stage_smem = kv_smem

    offs_gd = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    offs_gn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    # ---- q of token t (group 0, with the first tile)
    offs_qh = gl.arange(0, H, layout=gl.SliceLayout(1, g_layout))
    q_ptrs = q_ptr + t * stride_qt + offs_qh[:, None] * stride_qh + offs_gd[None, :]
    cp.async_copy_global_to_shared(q_smem, q_ptrs)

    k_begin = split * keys_per_split
    k_end = gl.minimum(k_begin + keys_per_split, K)
    n_tiles = gl.cdiv(k_end - k_begin, BLOCK_N)
    idx_row = idx_ptr + t * stride_it

    # ---- prologue: tiles 0 .. NUM_BUF - 2 in flight (a group each, empty past the end). The
    # indices of a tile are loaded one iteration before its gather is issued (loop-carried), so
    # no index load sits between a wait and the next gather (H200, T=64: 32.0 -> 30.5 us)
    for b in gl.static_range(NUM_BUF - 1):
        idx = _tile_idx(idx_row, k_begin + b * BLOCK_N, k_end, offs_gn)
        if ENTRIES:
            _gather_entries(raw_smem.index(RAW_AT + b), rope_smem.index(b), sc_smem.index(b), kv_ptr,
                            src, idx, BLOCK_N, NOPE, NUM_SRC)  # fmt: skip
        else:
            _gather(kv_smem.index(b), kv_ptr, src, idx, offs_gd, NUM_SRC)
    idx_next = _tile_idx(idx_row, k_begin + (NUM_BUF - 1) * BLOCK_N, k_end, offs_gn)
    valid_next = _tile_idx(idx_row, k_begin, k_end, offs_sn) >= 0

    m_i = gl.full([H], NEG, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([H, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([H, BLOCK_N], gl.float32, layout=s_layout)

    for i in range(n_tiles):
        # tile i landed (this thread's copies), visible to the async proxy and every thread
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        gl.thread_barrier()
        # every warp is past tile i - 1's MMAs: its buffer takes tile i + NUM_BUF - 1
        nxt = i + NUM_BUF - 1
        if ENTRIES:
            nb = nxt % NUM_BUF
            _gather_entries(raw_smem.index(RAW_AT + nb), rope_smem.index(nb), sc_smem.index(nb), kv_ptr,
                            src, idx_next, BLOCK_N, NOPE, NUM_SRC)  # fmt: skip
        elif MODE != 2:
            _gather(kv_smem.index(nxt % NUM_BUF), kv_ptr, src, idx_next, offs_gd, NUM_SRC)
        else:
            cp.commit_group()
        idx_next = _tile_idx(idx_row, k_begin + (nxt + 1) * BLOCK_N, k_end, offs_gn)
        valid = valid_next
        valid_next = _tile_idx(idx_row, k_begin + (i + 1) * BLOCK_N, k_end, offs_sn) >= 0
        if ENTRIES:  # tile i's entries -> the bf16 tile, visible to the MMAs of every warp
            cb = i % NUM_BUF
            kv = kv_smem.index(0)
            raw_i, rope_i, sc_i = (
                raw_smem.index(RAW_AT + cb),
                rope_smem.index(cb),
                sc_smem.index(cb),
            )
            if OVERLAP:  # S over the first 256 channels in flight while the rest decode
                _decode_entries(raw_i, rope_i, sc_i, kv, NOPE, 0, 4, False)
                fence_async_shared()
                gl.thread_barrier()
                s_half = warpgroup_mma(q_smem.slice(0, 256, dim=1),
                                       kv.slice(0, 256, dim=1).permute((1, 0)), s_zero,
                                       use_acc=False, is_async=True)  # fmt: skip
                _decode_entries(raw_i, rope_i, sc_i, kv, NOPE, 4, NOPE // 64, True)
            else:
                _decode_entries(raw_i, rope_i, sc_i, kv, NOPE)
            fence_async_shared()
            gl.thread_barrier()
        if MODE != 1:
            if not ENTRIES:
                kv = kv_smem.index(i % NUM_BUF if MODE == 0 else 0)
            if ENTRIES and OVERLAP:
                s = warpgroup_mma(q_smem.slice(256, 256, dim=1),
                                  kv.slice(256, 256, dim=1).permute((1, 0)), s_half,
                                  is_async=True)  # fmt: skip
                s = warpgroup_mma_wait(0, deps=[s])  # (one dep: the tensor itself)
            else:
                s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
            p, alpha, m_i, l_i = _softmax(s, valid, qk_scale, m_i, l_i)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_smem, kv, acc)
            gl.thread_barrier()  # p_smem is rewritten by the next tile

    cp.wait_group(0)

    # ---- epilogue: the in-kernel combine, partials for the combine launch, or the sink-normalised
    # output
    offs_h = gl.arange(0, H, layout=gl.SliceLayout(1, o_layout))
    offs_v = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    if FIXUP:
        gl.thread_barrier()  # every warp is past its last MMA: the kv buffers are free
        if not HALVES:
            _fixup(acc, m_o, l_o, stage_smem, t, split, part_ptr, ml_ptr, sem_ptr, sink_ptr, o_ptr,
                   cos_ptr, sin_ptr, stride_pt, stride_ph, stride_mt, stride_ot, stride_oh,
                   stride_ct, stride_st, RD)  # fmt: skip
        elif split == 0:
            _half_finish(acc, m_o, l_o, stage_smem, t, part_ptr, ml_ptr, sem_ptr, sink_ptr, o_ptr,
                         cos_ptr, sin_ptr, polls, stride_pt, stride_ps, stride_ph, stride_mt,
                         stride_ms, stride_ot, stride_oh, stride_ct, stride_st, 0, RD)  # fmt: skip
        else:
            _half_finish(acc, m_o, l_o, stage_smem, t, part_ptr, ml_ptr, sem_ptr, sink_ptr, o_ptr,
                         cos_ptr, sin_ptr, polls, stride_pt, stride_ps, stride_ph, stride_mt,
                         stride_ms, stride_ot, stride_oh, stride_ct, stride_st, 1, RD)  # fmt: skip
    elif SPLIT:
        hv = offs_h[:, None] * stride_ph + offs_v[None, :]
        gl.store(part_ptr + t * stride_pt + split * stride_ps + hv, acc)
        ml = ml_ptr + t * stride_mt + split * stride_ms + offs_h
        gl.store(ml, m_o)
        gl.store(ml + H, l_o)
    elif RD > 0:
        gl.thread_barrier()  # every warp is past its last MMA: the kv buffers are free
        _finish_rope(acc, m_o, l_o, stage_smem, t, sink_ptr, o_ptr, cos_ptr, sin_ptr, stride_ot,
                     stride_oh, stride_ct, stride_st, RD)  # fmt: skip
    else:
        out = _normalise(acc, m_o, l_o, sink_ptr, offs_h)
        o_hv = offs_h[:, None] * stride_oh + offs_v[None, :]
        gl.store(o_ptr + t * stride_ot + o_hv, out.to(gl.bfloat16))


def supported(
    q: torch.Tensor, kv: tuple[torch.Tensor, ...], rope_dim: int = 0, entries: bool | None = None
) -> bool:
    """This kernel applies: an sm_90 GPU, bf16, 64 heads of 512 channels, one to three kv sources
    (the decode step's ring | entries, a prefill chunk's ring, new rows and entries) of bf16 rows
    that start on 16 bytes (or, when `entries`, FP8 entries of 448 + 64 rope channels whose rows
    start on 8 bytes; default: FP8_ENTRIES)."""
    entries = FP8_ENTRIES if entries is None else entries
    if not is_sm90(q.device):
        return False
    if q.dtype != torch.bfloat16 or tuple(q.shape[1:]) != (HEADS, DIM) or q.stride(2) != 1:
        return False
    if not 1 <= len(kv) <= 3:
        return False
    q_ok = q.data_ptr() % 16 == 0 and q.stride(1) * 2 % 16 == 0 and q.stride(0) * 2 % 16 == 0
    if kv[0].dtype == torch.uint8:
        width, align = kv_entry_layout(DIM, ROPE)[2], 8
        ok = entries and rope_dim == ROPE
    else:
        width, align = DIM, 16
        ok = kv[0].dtype == torch.bfloat16
    return (
        ok
        and q_ok
        and all(
            src.dtype == kv[0].dtype and tuple(src.shape[1:]) == (width,) and src.stride(1) == 1
            for src in kv
        )
        and _triton.rows_aligned(kv, align)
    )


def _sources(kv: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    # the kernel's (n0, n1, stride_k0, stride_k1, stride_k2, at1, at2): rows of the first two
    # sources, row strides, and where sources 1 and 2 start, in elements from source 0
    base, size = kv[0].data_ptr(), kv[0].element_size()
    rows = [src.shape[0] for src in kv] + [0, 0]
    strides = [src.stride(0) for src in kv] + [0, 0]
    at = [(src.data_ptr() - base) // size for src in kv] + [0, 0]
    return (rows[0], rows[1], *strides[:3], at[1], at[2])


def sparse_attn_sm90(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    scale: float,
    rope_dim: int = 0,
    *,
    inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_buf: int = 2,
    mode: int = 0,
    checked: bool = False,
) -> torch.Tensor:
    """`dsv4.ops.sparse_attn` on the Gluon kernel for 1..3 kv sources (`supported(q, kv)` must
    hold; `sparse_attn` merges adjacent sources before it hands over). inv_rope: as `sparse_attn`'s
    (in this kernel where it writes o from staged buffers, else in the combine's or a rotary
    launch).
    num_splits:
    key splits per token (default: fill the SMs once); block_n / num_buf: keys per tile and
    tiles in shared memory; mode: probes only (1 = the gathers alone, 2 = the math alone);
    checked: the caller has just found `supported(q, kv, rope_dim)` (`sparse_attn`'s dispatch),
    so it is not asked again."""
    assert checked or supported(q, kv, rope_dim, entries=True), (
        "sparse_attn_sm90: needs sm_90, bf16 [T, 64, 512] q, 1..3 kv sources (bf16 or FP8 entries)"
    )
    entries = kv[0].dtype == torch.uint8
    assert not (entries and mode), "sparse_attn_sm90: the probe modes read bf16 rows"
    T = q.shape[0]
    K = topk_idxs.shape[1]
    assert topk_idxs.dim() == 2 and topk_idxs.shape[0] == T and topk_idxs.stride(1) == 1
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or K == 0:
        return o.zero_()
    if num_splits is None:  # fill the SMs once (one program per SM: 200 KB of shared memory)
        num_splits = max(1, min(num_sms(q.device) // T, cdiv(K, 2 * block_n)))
    keys_per_split = cdiv(cdiv(K, num_splits), block_n) * block_n
    num_splits = cdiv(K, keys_per_split)
    split = num_splits > 1
    if split:
        part = torch.empty((T, num_splits, HEADS, DIM), dtype=torch.float32, device=q.device)
        ml = torch.empty((T, num_splits, 2, HEADS), dtype=torch.float32, device=q.device)
    else:
        part = ml = o
    # o written from the kv buffers (the in-kernel combine, the in-kernel RoPE): buffers that hold
    # an fp32 [64, 512] (bf16 rows' tiles, or FP8 entries' raw tiles with q), and
    # Flash's 64 rope channels when RoPE is asked for
    if entries:  # q and the raw tiles (when these fit in q's 64 KB)
        stage_bytes = 2 * HEADS * DIM * 2 if num_buf * block_n * DIM <= HEADS * DIM * 2 else 0
    else:  # the bf16 tiles
        stage_bytes = num_buf * block_n * DIM * 2
    staged = mode == 0 and stage_bytes >= HEADS * DIM * 4
    rope_ok = inv_rope is None or 2 * inv_rope[0].shape[-1] == ROPE
    fixup = FIXUP and num_splits == 2 and T <= FIXUP_MAX_TOKENS and staged and rope_ok  # combine
    halves = fixup and FIXUP_HALVES and not entries and 2 * T <= num_sms(q.device)  # all resident
    sem = arrival_counts("sparse_attn_sm90", q.device, 2 * FIXUP_MAX_TOKENS) if fixup else ml
    # the inverse RoPE in the kernel where it writes o (the in-kernel combine, or unsplit);
    # otherwise in the combine's launch or a rotary launch
    in_kernel = inv_rope is not None and rope_ok and staged and (fixup or not split)
    cos, sin = inv_rope if in_kernel else (ml, ml)
    rd = check_rope(o, cos, sin) if in_kernel else 0
    launch = chain(q.device)
    _decode_kernel[(T, num_splits)](
        q, kv[0], topk_idxs, attn_sink, o, part, ml, sem, cos, sin, HALVES_POLLS,
        K, keys_per_split, scale * _triton.LOG2E,
        q.stride(0), q.stride(1), *_sources(kv), topk_idxs.stride(0), o.stride(0), o.stride(1),
        part.stride(0), part.stride(1), part.stride(2) if split else 0, ml.stride(0), ml.stride(1),
        cos.stride(0), sin.stride(0),
        BLOCK_N=block_n, NUM_BUF=num_buf, SPLIT=split, MODE=mode, ENTRIES=entries,
        NOPE=DIM - ROPE, FIXUP=fixup, RD=rd, NUM_SRC=len(kv), OVERLAP=entries and OVERLAP and mode == 0,
        HALVES=halves, num_warps=8, **launch,
    )  # fmt: skip
    if fixup or in_kernel:
        return o
    # the Triton kernel's combine (launched early in the chain) or inverse RoPE
    return _triton._finish(o, part, ml, attn_sink, num_splits, launch["launch_pdl"], inv_rope)
