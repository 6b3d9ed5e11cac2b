"""FP8 projections (e4m3, 128x128 UE8M0 block scales) for Hopper (sm_90) in Gluon at decode batches:
the codes decoded in registers straight into the wgmma A operand.

  fp8_grouped(x, weight, scale) -> [M, G, R], as `dsv4.ops.linear._grouped` (which decides when
  this applies: `supported`, MIN_WEIGHT_BYTES)

Why a second kernel: the Triton form converts each e4m3 tile to bf16 and stores it to shared memory
for the MMA (its dot's B operand), and re-reads x's whole [M, K] per 32-128 output rows. At 64
rows of x it ran at 22-33% of copy bandwidth (wo_a / wo_b 38 us for 32 MB, docs/PERF.md fourth
session); the projections were ~150 us a layer of a batch-64 decode step.

Swap AB: y^T [BN, BM] = W [BN, K] . x^T [K, BM]. The program's BLOCK_N = 64 weight rows (one
warpgroup's wgmma M) are the register operand A; BLOCK_M rows of x (wgmma N, 8..64) are operand B
in shared memory. Per 128-column step cp.async brings the weight tile [64, 128] (bytes, 16-byte
chunks XOR-swizzled by row so the A-layout reads fall on distinct banks) and x's tile, NUM_BUF - 1
steps ahead; the step's one UE8M0 scale (64 rows lie in one 128-row scale block) loads a step
ahead.

Decode, per two codes (c0, c1) of adjacent columns (one bf16x2 of the A operand): a prmt
sign-extends each into one 16-bit half; shifted left by 4 and masked with 0x87F0, a half holds the
sign at bit 15 and e3..e0 m2..m0 at bits 10..4: the e4m3 value times 2^-120 as a bf16 (the
subnormal codes land on bf16 subnormals). One mul.bf16x2 by 2^(s - 7) then rounds the weight
times its block scale 2^(s - 127) once, as the reference's bf16 dequantization does: exact for
scales from 3, and the reference's rounded subnormals below. The MMA sums the products in fp32:
the reference's products (dequantized bf16 weight times bf16 x) in another order. A step whose
scale is above SCALE_MAX (none in a real checkpoint; 2^(s - 7) is no bf16 there) decodes at
SCALE_MAX and multiplies by 2^(s - SCALE_MAX) once more. The e4m3 NaN codes (0x7F, 0xFF) and the
e8m0 NaN scale (255) would read as finite weights: the checkpoint loader rejects them.

Few output tiles split K (each split stores an fp32 partial and counts itself in; the last to
arrive sums them in split order), as the Triton form does. No CPU path: Gluon has no
interpreter; `tests/ops/test_linear_sm90.py` runs the decode's PTX in a small interpreter on the
CPU and the kernel against the reference on an sm_90 GPU.
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

from dsv4.ops.device import (
    cdiv,
    chain,
    chain_start,
    is_sm90,
    next_power_of_2,
    num_sms,
    split_reduction,
)

BLOCK_K = 128  # columns per step: one scale block
# BLOCK_N weight rows per program (64 per warpgroup: num_warps = BLOCK_N / 16), NUM_BUF steps of
# x and weight tiles in shared memory (NUM_BUF - 1 in flight) up to 16 rows of x, NUM_BUF_WIDE
# above (x's tiles take the shared memory), a register cap. H200 (bench/probe_pieces.py
# linear_sm90), the 32 MB projections (wq_b, wo_a, wo_b) at T = 1 / 16 / 64: 14.4-15.9 /
# 14.9-18.2 / 17.5-25.3 us against 17.6-19.2 / 17.7-19.5 / 26.8-36.1 for the Triton form.
# Slower: NUM_BUF 6; 128 rows on 8 warps (at T=64 wo_a 40.7 against 25.0 us)
CONFIG = {"BLOCK_N": 64, "NUM_BUF": 4, "NUM_BUF_WIDE": 2, "maxnreg": 128}
# the weights it takes by default: from 16 MB (wq_b, wo_a, wo_b and the shared expert's joined
# w1 / w3). On the smaller ones (wq_a 4 MB, wkv 2 MB, w1 8 MB) the Triton forms were as fast or
# faster: 1 launch of a few us where the copy is 1-2 us
MIN_WEIGHT_BYTES = 1 << 24
BLOCK_M_MAX = 64  # rows of x a program takes (wgmma N <= 64 here)
# rows of x it takes, in BLOCK_M_MAX-row tiles (each tile reads the weight again, mostly from
# L2): verify steps of speculative decoding (batch 64 with 1-3 drafts: 128-256 rows). Past them
# `linear.dequant` + cuBLAS is faster. H200 (bench/probe_pieces.py rows), wq_b / wo_a / wo_b at
# 256 rows 55.1 / 46.2 / 48.3 us against 57.9 / 60.6 / 63.8, at 512 rows 105.0 / 90.7 / 86.3
# against 79.7 / 75.5 / 73.6
MAX_ROWS = 256
# the largest e8m0 scale s for which the factor 2^(s - 7) is a bf16 (below it, down to s = 0, one
# rounding multiply gives the reference's bf16 weight, its rounded subnormals included); a step's
# scale above is clamped to it and the rest applied by a second multiply
SCALE_MAX = 134
_S_MAX = gl.constexpr(SCALE_MAX)


def _decode_asm(two: bool = False) -> str:
    # $1: two codes (column k in the low byte, k + 1 in the high) ; $2: 2^(s - 7) in both bf16
    # halves (two: then times $4 too) -> $0: bf16x2 of the two weights. With pack=2 each int32
    # operand comes as two registers: f is $2, $3 and f2 is $4, $5 (the same values)
    lines = [
        "{",
        ".reg .b32 t;",
        "cvt.u32.u16 t, $1;",
        "prmt.b32 t, t, t, 0x9180;",  # each code sign-extended to 16 bits: [c0, s0, c1, s1]
        "shl.b32 t, t, 4;",
        "and.b32 t, t, 0x87F087F0;",  # sign -> 15, e3..e0 m2..m0 -> 10..4, per half
    ]
    if two:
        lines += ["mul.rn.bf16x2 t, t, $2;", "mul.rn.bf16x2 $0, t, $4;"]
    else:
        lines += ["mul.rn.bf16x2 $0, t, $2;"]
    return "\n".join(lines + ["}"])


DECODE_ASM = gl.constexpr(_decode_asm())
DECODE_ASM_TWO = gl.constexpr(_decode_asm(two=True))


@gluon.jit
def _bf16x2_exp2(e):  # noqa: ANN001, ANN202
    # 2^e (a normal bf16: -126 <= e <= 127) in both bf16 halves of an int32
    return ((e + 127) << 7) | ((e + 127) << 23)


@gluon.jit
def _copy_w(w_smem, b, step, n_steps, w_at, BLOCK_K: gl.constexpr):  # noqa: ANN001, ANN202
    # step `step`'s weight tile into buffer b by cp.async (past the last step the last step's
    # again: the commit group count stays uniform)
    cp.async_copy_global_to_shared(w_smem.index(b), w_at + gl.minimum(step, n_steps - 1) * BLOCK_K)


@gluon.jit
def _copy_x(x_smem, b, step, n_steps, x_at, x_ok, BLOCK_K: gl.constexpr):  # noqa: ANN001, ANN202
    # step `step`'s x tile into buffer b by cp.async (as `_copy_w`)
    k = gl.minimum(step, n_steps - 1) * BLOCK_K
    cp.async_copy_global_to_shared(x_smem.index(b), x_at + k, mask=x_ok)


@gluon.jit
def _scale(s_at, step, n_steps):  # noqa: ANN001, ANN202
    # the step's UE8M0 scale s
    return gl.load(s_at + gl.minimum(step, n_steps - 1)).to(gl.int32)


@gluon.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, G, K] bf16
    w_ptr,  # [G*R, K] e4m3 codes as uint8
    s_ptr,  # [cdiv(G*R, 128), K / 128] UE8M0 scales as uint8
    y_ptr,  # [M, G, R] bf16
    ws_ptr,  # [splits, M, G, R] fp32 partials (a dummy without splits)
    count_ptr,  # [>= output tiles] int32 arrivals per output tile, 0 between launches
    M,
    R,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xg,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_yg,
    stride_ws,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_BUF: gl.constexpr,
    PDL: gl.constexpr = False,  # chained launch (device.chain): the prologue's weights load first
):
    # read BLOCK_N * k_per_split codes + BLOCK_M * k_per_split activations ; write BLOCK_M *
    # BLOCK_N outputs (with splits: fp32 partials, and the tile's last split sums them from L2)
    NW: gl.constexpr = gl.num_warps()
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_gk = gl.program_id(2)  # group * splits + split
    n_splits = gl.cdiv(K, k_per_split)
    g = pid_gk // n_splits
    split = pid_gk % n_splits
    k_start = split * k_per_split
    n_steps = gl.cdiv(gl.minimum(k_per_split, K - k_start), BLOCK_K)

    # ---- layouts: acc [BN, BM] on the wgmma layout, the weights in its A-operand layout
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # weight bytes [BN, BK]: 16-byte chunks XOR-swizzled by row (the 8 rows a warp reads at once
    # in the A layout fall on different banks)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    g_l: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [NW, 1], [1, 0]
    )
    gw_l: gl.constexpr = gl.BlockedLayout(
        [1, 16], [32 // (BLOCK_K // 16), BLOCK_K // 16], [NW, 1], [1, 0]
    )

    # ---- the program's weight rows (one scale row), x rows
    row0 = g * R + pid_n * BLOCK_N  # the group's rows start on a multiple of BLOCK_N
    offs_gn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gw_l))
    offs_gk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gw_l))
    w_at = (w_ptr + row0.to(gl.int64) * stride_wn + k_start) + (
        offs_gn[:, None] * stride_wn + offs_gk[None, :]
    )
    s_at = s_ptr + (row0 // 128) * stride_sn + k_start // BLOCK_K
    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, g_l))
    offs_xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, g_l))
    x_at = (x_ptr + g * stride_xg + k_start) + (offs_xm[:, None] * stride_xm + offs_xk[None, :])
    x_ok = (offs_xm < M)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], x_sl)
    w_smem = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, BLOCK_K], w_sl)

    # ---- prologue: steps 0 .. NUM_BUF - 2 in flight; the scale a step ahead. Launched behind the
    # previous kernel (device.chain), the program starts the weights' copies (one commit group:
    # nothing writes weights) before it waits for that kernel, and x's after
    for pb in gl.static_range(NUM_BUF - 1):
        _copy_w(w_smem, pb, pb, n_steps, w_at, BLOCK_K)
    cp.commit_group()
    s_next = _scale(s_at, 0, n_steps)
    chain_start(PDL)
    for pb in gl.static_range(NUM_BUF - 1):
        _copy_x(x_smem, pb, pb, n_steps, x_at, x_ok, BLOCK_K)
        cp.commit_group()
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    for step in range(n_steps):
        # the decode's factor 2^(s - 7), for s clamped to SCALE_MAX (and the rest)
        s = s_next
        s_in = gl.minimum(s, _S_MAX)
        f = gl.zeros([BLOCK_N, BLOCK_K], gl.int32, layout=a_l) + _bf16x2_exp2(s_in - 7)
        s_next = _scale(s_at, step + 1, n_steps)
        # step's tiles landed for every thread; every warp is past step - 1's MMAs and reads,
        # so its buffer takes step + NUM_BUF - 1
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        gl.thread_barrier()
        nxt = step + NUM_BUF - 1
        _copy_x(x_smem, nxt % NUM_BUF, nxt, n_steps, x_at, x_ok, BLOCK_K)
        _copy_w(w_smem, nxt % NUM_BUF, nxt, n_steps, w_at, BLOCK_K)
        cp.commit_group()
        cur = step % NUM_BUF
        # (the codes load inside each branch, so each decodes as it loads)
        if s == s_in:
            codes = w_smem.index(cur).load(a_l)
            a = gl.inline_asm_elementwise(
                DECODE_ASM, "=r,h,r,r", [codes, f], dtype=gl.bfloat16, is_pure=True, pack=2
            )
        else:  # a scale above SCALE_MAX (none in a real checkpoint): a second multiply by
            # 2^(s - s_in), the reference's bf16 dequantization bit for bit
            f2 = gl.zeros([BLOCK_N, BLOCK_K], gl.int32, layout=a_l) + _bf16x2_exp2(s - s_in)
            codes = w_smem.index(cur).load(a_l)
            a = gl.inline_asm_elementwise(
                DECODE_ASM_TWO, "=r,h,r,r,r,r", [codes, f, f2], dtype=gl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        acc = warpgroup_mma(a, x_smem.index(cur).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc, a])[0]
    cp.wait_group(0)

    # ---- epilogue: y[m, g, r] = acc[r, m]
    offs_r = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    mask = (offs_m < M)[None, :] & (offs_r < R)[:, None]
    tile = offs_m[None, :] * stride_ym + g * stride_yg + offs_r[:, None]
    if n_splits > 1:
        # split-K fixup in the kernel: store the partial, count the arrival; the split that
        # arrives last sums all partials in split order (deterministic) and resets the count
        gl.store(ws_ptr + split * stride_ws + tile, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial is stored before the release below
        counter = count_ptr + (g * gl.num_programs(1) + pid_m) * gl.num_programs(0) + pid_n
        if gl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
            for sp in range(n_splits):  # through L2: other programs wrote them
                acc += gl.load(ws_ptr + sp * stride_ws + tile, mask=mask, cache_modifier=".cg")
            gl.store(y_ptr + tile, acc.to(gl.bfloat16), mask=mask)
            gl.atomic_xchg(counter, 0, sem="relaxed")
    else:
        gl.store(y_ptr + tile, acc.to(gl.bfloat16), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def supported(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """This kernel can run: an sm_90 GPU, bf16 x of 1..MAX_ROWS rows, K a multiple of BLOCK_K and
    each group's rows a multiple of BLOCK_N (a program's rows lie in one 128-row scale block).
    (Whether it should: `dsv4.ops.linear` decides, by the weight's size.)"""
    if not is_sm90(x.device):
        return False
    M, K = x.shape[0], weight.shape[1]
    R = weight.shape[0] // groups
    return (
        x.dtype == torch.bfloat16
        and 0 < M <= MAX_ROWS
        and K % BLOCK_K == 0
        and R % CONFIG["BLOCK_N"] == 0
    )


def fp8_grouped(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """x [M, G, K] bf16 times e4m3 weight [G*R, K] (scale [cdiv(G*R, 128), K/128] UE8M0) per
    group -> [M, G, R] bf16. counts: the split-K arrival counts, one per output tile, zero between
    launches (the Triton form's, `linear._tile_counters`). The caller checks shapes, dtypes and
    strides (`linear._grouped`)."""
    M, G, K = x.shape
    R = weight.shape[0] // G
    bn = CONFIG["BLOCK_N"]
    block_m = min(BLOCK_M_MAX, max(8, next_power_of_2(M)))
    tiles_m = cdiv(M, block_m)
    programs = R // bn * tiles_m * G
    sms = num_sms(x.device)
    k_per_split, splits = split_reduction(K, BLOCK_K, programs, 4 * sms, 8)
    y = torch.empty((M, G, R), dtype=x.dtype, device=x.device)
    ws = torch.empty((splits, M, G, R), dtype=torch.float32, device=x.device) if splits > 1 else y
    grid = (R // bn, tiles_m, G * splits)
    assert splits == 1 or grid[0] * grid[1] * G <= counts.numel(), f"{grid} {G}: too many tiles"
    _fp8_linear_kernel[grid](
        x, weight.view(torch.uint8), scale.view(torch.uint8), y, ws,
        counts, M, R, K, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), scale.stride(0), y.stride(0), y.stride(1),
        ws.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K,
        NUM_BUF=CONFIG["NUM_BUF"] if block_m <= 16 else CONFIG["NUM_BUF_WIDE"],
        num_warps=bn // 16, maxnreg=CONFIG["maxnreg"], **chain(x.device),
    )  # fmt: skip
    return y
