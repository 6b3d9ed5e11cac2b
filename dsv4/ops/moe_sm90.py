"""Routed experts for Hopper (sm_90) in Gluon: MXFP4 weights decoded in registers straight into the
wgmma A operand.

  experts(x, rw, rows, blk, table, topk, I, limit) -> [T*k, D] bf16, each (token, slot) pair's
  expert output (the launcher `dsv4.ops.moe.moe_experts` sums the k slots and decides when this
  applies: `supported`, `scales_in_range`)

Why a second kernel: `tl.dot_scaled` and the Triton kernels' own decode spend ~8 instructions per
weight turning e2m1 codes into a tensor-core operand (docs/PERF.md, eighth session), and at decode
batches every weight meets only a few rows, so the experts were bound by instruction issue at ~1.4
TB/s. Triton cannot keep a decoded operand in the registers wgmma reads (it goes through shared
memory); Gluon states the layout.

Swap AB: out^T [BN, BM] = W [BN, K] . x^T [K, BM]. The BN weight rows of one expert are the
register operand A (the DotOperandLayout of the wgmma layout); the row-block's BM (token, slot)
pairs are operand B. Per BK-column step, cp.async brings x's rows and the weight words (32-bit, 8
codes each; shared memory swizzled so the A-layout reads fall on distinct banks) NUM_BUF - 1 steps
ahead; each row's e8m0 scales of a step (one int32 word per 4 groups of 32 columns) load one step
ahead into registers. Addresses are scalar bases plus 32-bit offsets, which keeps the gate-up
kernel under the 128 registers that let 4 programs share an SM.

Decode. The checkpoint packs column c of a weight row as nibble c % 8 of 32-bit word c // 8 (low
nibble first). Two words (w, w+1) sit in one thread's consecutive registers; one inline-PTX block
makes, for i = 0..7, a bf16x2 of code i of both: the sign to bit 15 and e1 e0 m to bits 8..6, which
is the e2m1 value times 2^-126 (the code 0.5 lands on a bf16 subnormal), times 2^(S - 64) for the
words' e8m0 scale S (words w, w+1 share their 32-column group; a prmt picks its byte). That is the
weight times 2^-63, exact for S in [SCALE_MIN, SCALE_MAX]; the epilogue multiplies the fp32 sums by
2^63. Per two weights the decode is a mask, an integer multiply that places sign and magnitude at
once, a mask and the bf16 multiply (`_planes`; it was two shifts, two masks and an or: the down
kernel's SASS went from 800 to 768 instructions, the loop from 4.05 to ~3.8 per weight). Nsight: 57% (gate-up, 3 programs per SM
before the register cap; 65.5% with it, 4 per SM) and 70% (down, 4 per SM) of issue slots busy.

The 8 tensors A_i [BN, BK/8] (code i of each word: columns 8w + i) meet x's columns 8w + i, so x is
permuted once per call within each BK-column block (`permute_columns`: column 8w + i moves to
i * BK/8 + w) and operand B of A_i is one contiguous [BM, BK/8] slice. The gate-up kernel writes
h in the down kernel's permuted order, so the down kernel gathers plain rows.

Prefill-sized row-blocks (WIDE_MIN pairs and more) take a warp-specialised form of the same
kernel (`_experts_ws_kernel`, `WS`): a load partition brings each step's x tile and weight words
into NUM_BUF buffers by cp.async and signals an mbarrier per buffer; two MMA partitions (one
warpgroup of 64 weight rows each) decode and multiply, free the buffer through a second mbarrier,
and store their own rows. The one-partition kernel's warps met at a CTA barrier every step; here
the MMA warpgroups wait only for their data, so one decodes while the other's MMAs run.

No CPU path: Gluon has no interpreter. `tests/ops/test_moe_sm90.py` checks the column permutations
and runs the decode's PTX in a small interpreter against `quant.dequant_mxfp4` on the CPU; on an
sm_90 GPU it reads every weight back bit for bit and checks the kernels against the reference.
"""

from __future__ import annotations

import weakref

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsv4.ops.device import chain, chain_start, is_sm90

# tiles: BLOCK_N weight rows per program (one warpgroup's wgmma M), BLOCK_K columns per step,
# BLOCK_M pairs per row-block (wgmma N), NUM_BUF steps of x and weight words in shared memory
# (NUM_BUF - 1 in flight); maxnreg: a register cap for (gate-up, down). H200
# (bench/probe_pieces.py moe_sm90, nineteenth session: one MMA a step), routed experts at
# T = 8 / 16 / 64: 222.4 / 373.2 / 901.0 us, against 443.6 / 741.2 / 1761.7 (tl.dot_scaled).
# Fourteenth session, per code plane MMAs: 246.7 / 411.5 / 964.2 us. Uncapped, the gate-up kernel takes
# 139 registers and 3 programs fit an SM (251.1 / 425.1 / 1012.3 us); at 128 it fits 4 with no
# spills (ptxas -v, sm_90a). Slower: a cap of 96 (5 programs, 60-156 B of spills: +20-33%),
# NUM_BUF 3 (+11-21%), BLOCK_M 16 (+5-27%), BLOCK_K 128, BLOCK_N 128 on 8 warps, and each
# half-matrix's MMAs left in flight while the next half decodes (+7-20%: more registers)
CONFIG = {"BLOCK_N": 64, "BLOCK_K": 256, "BLOCK_M": 8, "NUM_BUF": 2, "num_warps": 4,
          "maxnreg": (128, 128)}  # fmt: skip
# the pair counts it takes by default: from batch 2 at k=6 (batch 1: the GEMV form, 57.4 against
# 61.7 us) to MAX_PAIRS (verify steps and prefill chunks; up to the twenty-seventh session the
# limit was 512 pairs, and a verify step at batch 64 took tl.dot_scaled at half the speed)
MIN_PAIRS = 7
MAX_PAIRS = 65536  # past it (~11K tokens a step) tl.dot_scaled; the kernel's offsets are 32-bit
# pairs per row-block by pair count (up to, BLOCK_M): CONFIG's at decode batches, wider blocks for
# prefill chunks and wide verify steps, where each block reads its expert's weights once. H200
# (bench/probe_pieces.py moe_sm90 / moe_prefill / moe_big: Flash's routed experts, uniform random
# routing), BLOCK_M 8 / 16 / 32 against tl.dot_scaled: T = 128 / 256: 1189 / 1433 us at 8 against
# 2252 / 2391; T = 512: 2324 / 1713 / 2227 against 3285; T = 1024: 4090 / 3002 / 2590 against 3388.
# Twenty-eighth session, WIDE tiles: T = 2048: 3230 us at 64 (4593 at 128) against 3789;
# T = 4096: 4972 at 128 (6019 at 64) against 7110
ROW_BLOCKS = ((2048, None), (3072, 16), (6144, 32), (16384, 64), (MAX_PAIRS, 128))
# the tiles of row-blocks of WIDE_MIN pairs and more (where WIDE's BLOCK_N divides the output
# width): two warpgroups of 64 weight rows, no register cap (the accumulators of 64-128 pairs
# take it). moe_big at T = 2048, BLOCK_M 64: 3230 us against 3346 with CONFIG's tiles uncapped;
# T = 4096, BLOCK_M 128: 4972 against 6034; NUM_BUF 3 slower or past shared memory
WIDE_MIN = 64
WIDE = {"BLOCK_N": 128, "num_warps": 8, "maxnreg": (None, None)}
# those row-blocks on the warp-specialised kernel (`_experts_ws_kernel`): two MMA partitions of
# num_warps (one warpgroup, 64 weight rows, MMA_REGS registers each) and a load partition of
# LOAD_WARPS warps with LOAD_REGS registers; maxnreg bounds the whole program (12 warps: 168 x 384
# threads fill the register file). ptxas -v (sm_90a): no spills (72 B in the load partition at 56
# registers). BOTH_MAX_M: W1's and W3's MMAs in flight together up to this BLOCK_M. H200 (probe
# moe_ws, thirty-first session), Flash's routed experts at T = 2048 / 4096 tokens (row-blocks of
# 64 / 128): 3053-3064 / 4238-4262 us with both in flight, 3087 / 4093-4134 us one after the other,
# against 3208-3224 / 4799-4800 on the WIDE tiles; 3 buffers 3118 / 4218-4236, 2 buffers 3345 /
# 4426-4441; one MMA partition of 8 warps (the two warpgroups in step through its barriers)
# 3210-3232 / 4296-4297
WS = {"BLOCK_N": 128, "BLOCK_K": 128, "NUM_BUF": 4, "num_warps": 4, "MMA_REGS": 216,
      "LOAD_WARPS": 4, "LOAD_REGS": 72, "BOTH_MAX_M": 64, "maxnreg": (168, 168)}  # fmt: skip
WARP_SPECIALIZED = True  # WIDE row-blocks take WS (False: the WIDE tiles of `_experts_kernel`)


def block_m(pairs: int) -> int:
    """Pairs per row-block (BLOCK_M) for a call of `pairs` pairs: CONFIG's up to 2048, wider above
    (`ROW_BLOCKS`); the caller aligns the rows to it (`moe.align_rows`)."""
    for most, bm in ROW_BLOCKS:
        if pairs <= most:
            return bm or CONFIG["BLOCK_M"]
    return ROW_BLOCKS[-1][1]


# e8m0 scales S for which 2^(S - 64) is a normal bf16 and the 0.5 code's weight 2^(S - 191) is
# exact in bf16: experts with a scale outside are left to the Triton kernels
SCALE_MIN, SCALE_MAX = 58, 191
W1, W3, W2 = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # rows of the address table
S1, S3, S2 = gl.constexpr(3), gl.constexpr(4), gl.constexpr(5)
TWO_63 = gl.constexpr(9.223372036854775808e18)  # 2^63: undoes the decode's 2^-63


def _planes(src: str, out0: int) -> list[str]:
    # the 4 codes of each 16-bit half of `src` -> $out0 .. $out0+3, one bf16x2 per code: the sign
    # to bit 15 and e1 e0 m to bits 8..6, times f (2^(S - 64) in both halves). Code j of both
    # halves alone (a mask), then one multiply by 2^a + 2^b places the sign (shifted by a) and
    # e1 e0 m (by b) at once: the two shifted copies share no bit, so the sum is their OR; a mask
    # keeps those bits. Codes 2 and 3 are codes 0 and 1 of `src` >> 8 (b would be negative)
    lines = [f"shr.b32 r, {src}, 8;"]
    for j in range(4):
        word = src if j < 2 else "r"
        nibble, spread = (0x000F000F, 0x1040) if j % 2 == 0 else (0x00F000F0, 0x0104)
        lines += [
            f"and.b32 u, {word}, {nibble:#010x};",
            f"mul.lo.u32 u, u, {spread:#06x};",  # 2^12 + 2^6, or 2^8 + 2^2
            "and.b32 u, u, 0x81C081C0;",
            f"mul.rn.bf16x2 ${out0 + j}, u, f;",
        ]
    return lines


def _decode_asm() -> str:
    # $8, $9: words w, w+1 ; $10, $12: the row's e8m0 scales of the step plus 63 in each byte
    # (groups 0-3, 4-7) ; $14: the words' group w // 4 in all four nibbles (a byte selector)
    # -> $0..$7: bf16x2 of code i of word w (low half) and of word w+1 (high half) times 2^(S - 64)
    lines = [
        "{",
        ".reg .b32 lo, hi, u, r, f;",
        "prmt.b32 lo, $8, $9, 0x5410;",  # codes 0..3 of w | codes 0..3 of w+1
        "prmt.b32 hi, $8, $9, 0x7632;",  # codes 4..7
        "prmt.b32 f, $10, $12, $14;",  # S + 63 in every byte
        "and.b32 f, f, 0x00FF00FF;",
        "shl.b32 f, f, 7;",  # bf16x2 2^(S - 64): exponent field S + 63 in both halves
    ]
    return "\n".join(lines + _planes("lo", 0) + _planes("hi", 4) + ["}"])


DECODE_ASM = gl.constexpr(_decode_asm())
SCALE_BIAS = gl.constexpr(0x3F3F3F3F)  # 63 added to each scale byte (no carries: S + 63 <= 254)


@gluon.jit
def _scales(s_base, s_offs, step, SW: gl.constexpr):  # noqa: ANN001, ANN202
    # the step's scale bytes of each row (SW int32 words: 4 groups of 32 columns each) + 63 each
    lo = gl.load((s_base + step * SW) + s_offs) + SCALE_BIAS
    if SW == 2:
        hi = gl.load((s_base + step * SW + 1) + s_offs) + SCALE_BIAS
    else:
        hi = lo
    return lo, hi


@gluon.jit
def _cat2(a, b):  # noqa: ANN001, ANN202
    # [R, C] and [R, C] -> [R, 2C]: a's columns, then b's
    t = gl.join(a, b).permute(0, 2, 1)
    return t.reshape(t.shape[0], 2 * t.shape[2])


@gluon.jit
def _mma_step(words, sc, sel, xs, acc, a_l: gl.constexpr):  # noqa: ANN001, ANN202
    # acc += W x^T over one step: the 8 decoded code planes joined into one [BN, BK] operand
    # (plane i as columns i*BK/8 .. (i+1)*BK/8, the permuted x's order), one MMA (async; the
    # operand is returned to stay alive until the wait). In the A-operand layout each plane's
    # registers already hold its columns of the joined tile, so the join moves no data
    lo, hi = sc
    a0, a1, a2, a3, a4, a5, a6, a7 = gl.inline_asm_elementwise(
        DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
        [words, lo[:, None], hi[:, None], sel[None, :]], dtype=(gl.bfloat16,) * 8,
        is_pure=True, pack=2,
    )  # fmt: skip
    w = _cat2(_cat2(_cat2(a0, a1), _cat2(a2, a3)), _cat2(_cat2(a4, a5), _cat2(a6, a7)))
    w = gl.convert_layout(w, a_l, assert_trivial=True)
    acc = warpgroup_mma(w, xs.permute((1, 0)), acc, is_async=True)
    return acc, w


@gluon.jit
def _wait(acc, w):  # noqa: ANN001, ANN202
    # the MMA of a step done; the operand it reads stays alive until then
    return warpgroup_mma_wait(0, deps=[acc, w])[0]


@gluon.jit
def _round_bf16(v):  # noqa: ANN001, ANN202
    return v.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _issue(x_smem, wa_smem, wb_smem, b, step, n_steps, x_ptr, x_offs, x_ok, wa, wb, w_tile,
           BLOCK_K: gl.constexpr, GATE_UP: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # step `step`'s x tile and weight words into buffer b by cp.async, one commit group (past the
    # last step the last step's again: the group count stays uniform). Addresses are scalar bases
    # plus 32-bit offsets: 64-bit pointer tensors held across the loop cost the gate-up kernel
    # ~20 registers
    k = gl.minimum(step, n_steps - 1)
    cp.async_copy_global_to_shared(x_smem.index(b), (x_ptr + k * BLOCK_K) + x_offs, mask=x_ok)
    cp.async_copy_global_to_shared(wa_smem.index(b), (wa + k * (BLOCK_K // 8)) + w_tile)
    if GATE_UP:
        cp.async_copy_global_to_shared(wb_smem.index(b), (wb + k * (BLOCK_K // 8)) + w_tile)
    cp.commit_group()


@gluon.jit
def _expert_tensors(tbl_ptr, wbase_ptr, sbase_ptr, e, E, GATE_UP: gl.constexpr):  # noqa: ANN001, ANN202
    # expert e's weight words and scale words: (W1, W3, S1, S3), or (W2, W2, S2, S2)
    if GATE_UP:
        wa = wbase_ptr + gl.load(tbl_ptr + W1 * E + e) * 16
        wb = wbase_ptr + gl.load(tbl_ptr + W3 * E + e) * 16
        sa = sbase_ptr + gl.load(tbl_ptr + S1 * E + e) * 16
        sb = sbase_ptr + gl.load(tbl_ptr + S3 * E + e) * 16
    else:
        wa = wbase_ptr + gl.load(tbl_ptr + W2 * E + e) * 16
        sa = sbase_ptr + gl.load(tbl_ptr + S2 * E + e) * 16
        wb, sb = wa, sa
    i32 = gl.pointer_type(gl.int32)
    return wa.to(i32), wb.to(i32), sa.to(i32), sb.to(i32)


@gluon.jit
def _experts_kernel(
    x_ptr,  # gate-up: x [T, K] bf16 with permuted columns ; down: h [P, K] (permuted by gate-up)
    rw_ptr,  # [P] fp32 routing weights (gate-up)
    rows_ptr,  # [NB * BLOCK_M] int32 pair ids per row-block, -1 = padding
    blk_ptr,  # [NB] int32 expert of each row-block, -1 = past the real count
    tbl_ptr,  # [6, E] int64 offsets in 16-byte units (`moe.expert_table`)
    wbase_ptr,  # int8: expert 0's w1 weight
    sbase_ptr,  # uint8: expert 0's w1 scale
    out_ptr,  # gate-up: h [P, N] bf16, columns permuted for the down kernel ; down: out [P, N]
    N,
    K,
    E,
    limit,
    stride_xt,
    stride_ot,
    GATE_UP: gl.constexpr,  # W1 and W3 with the SwiGLU epilogue, else W2
    TOPK: gl.constexpr,  # gate-up: pair p reads x row p // TOPK
    H_BK: gl.constexpr,  # gate-up: the down kernel's BLOCK_K (h's column order)
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,  # 128 or 256: a row's scales of a step are 1 or 2 int32 words
    NUM_BUF: gl.constexpr,
    PDL: gl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_N rows of W1 and W3 (or W2): K/2 + K/32 bytes each, + BLOCK_M x rows ; write
    # BLOCK_M x BLOCK_N
    NW: gl.constexpr = gl.num_warps()
    BK8: gl.constexpr = BLOCK_K // 8
    SW: gl.constexpr = BLOCK_K // 128
    # a row-block's programs are neighbours on the grid (they run together and share its x rows
    # in L2): H200 routed experts at T = 1024 / 4096 tokens 1-2% faster than row-blocks first,
    # the same at decode batches (probe moe_order of 85407b6, thirtieth session)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    e = gl.load(blk_ptr + pid_m)
    if e < 0:
        return
    e = e.to(gl.int64)

    # ---- layouts: acc [BN, BM] on the wgmma layout, the weights in its A-operand layout
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # x tiles [BM, BK]: each BK/8-column slice is one swizzle atom wide (a wgmma B operand)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=BK8 * 2, element_bitwidth=16, rank=2
    )
    # weight words [BN, BK/8]: 16-byte chunks XOR-swizzled by row, so the 8 rows a warp reads at
    # once in the A layout fall on different banks
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    TPW_K: gl.constexpr = BLOCK_K // 8 if BLOCK_K // 8 < 32 else 32
    g_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [NW, 1], [1, 0])
    gw_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BK8 // 4), BK8 // 4], [NW, 1], [1, 0])

    # ---- the expert's weight rows and scales, the block's x rows
    offs_gn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gw_l))
    offs_gw = gl.arange(0, BK8, layout=gl.SliceLayout(0, gw_l))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    offs_w = gl.arange(0, BK8, layout=gl.SliceLayout(0, a_l))
    sel = (offs_w // 4) * 0x1111  # the byte selector of each word's scale group
    words_per_row = K // 8
    wa, wb, sa, sb = _expert_tensors(tbl_ptr, wbase_ptr, sbase_ptr, e, E, GATE_UP)
    w_tile = offs_gn[:, None] * words_per_row + offs_gw[None, :]
    s_offs = offs_n * (K // 128)

    offs_gm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, g_l))
    offs_gk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, g_l))
    pair_g = gl.load(rows_ptr + pid_m * BLOCK_M + offs_gm)
    x_row = gl.maximum(pair_g, 0) // TOPK  # TOPK = 1 in the down kernel
    x_offs = x_row[:, None] * stride_xt + offs_gk[None, :]
    x_ok = (pair_g >= 0)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], x_sl)
    wa_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N, BK8], w_sl)
    if GATE_UP:
        wb_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N, BK8], w_sl)
    else:
        wb_smem = wa_smem

    # ---- prologue: steps 0 .. NUM_BUF - 2 in flight; scales one step ahead in registers
    n_steps = K // BLOCK_K
    for pb in gl.static_range(NUM_BUF - 1):
        _issue(x_smem, wa_smem, wb_smem, pb, pb, n_steps, x_ptr, x_offs, x_ok, wa, wb,
               w_tile, BLOCK_K, GATE_UP)  # fmt: skip
    sa0 = _scales(sa, s_offs, 0, SW)
    sb0 = _scales(sb, s_offs, 0, SW)
    acc_a = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    acc_b = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)

    for step in range(n_steps):
        s1 = gl.minimum(step + 1, n_steps - 1)
        sa_k, sa0 = sa0, _scales(sa, s_offs, s1, SW)
        if GATE_UP:
            sb_k, sb0 = sb0, _scales(sb, s_offs, s1, SW)
        # step's tiles landed for every thread; every warp is past step - 1's MMAs and reads, so
        # its buffer takes step + NUM_BUF - 1
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        gl.thread_barrier()
        nxt = step + NUM_BUF - 1
        _issue(x_smem, wa_smem, wb_smem, nxt % NUM_BUF, nxt, n_steps, x_ptr, x_offs, x_ok, wa,
               wb, w_tile, BLOCK_K, GATE_UP)  # fmt: skip
        cur = step % NUM_BUF
        xs = x_smem.index(cur)
        # one matrix at a time: its decoded tile (64 registers) lives until its MMA is done
        acc_a, w = _mma_step(wa_smem.index(cur).load(a_l), sa_k, sel, xs, acc_a, a_l)
        acc_a = _wait(acc_a, w)
        if GATE_UP:
            acc_b, w = _mma_step(wb_smem.index(cur).load(a_l), sb_k, sel, xs, acc_b, a_l)
            acc_b = _wait(acc_b, w)
    cp.wait_group(0)
    _epilogue(acc_a, acc_b, rw_ptr, rows_ptr, out_ptr, pid_n * BLOCK_N, pid_m, N, limit,
              stride_ot, mma, GATE_UP, H_BK, BLOCK_M, BLOCK_N)  # fmt: skip


@gluon.jit
def _epilogue(acc_a, acc_b, rw_ptr, rows_ptr, out_ptr, row0, pid_m, N, limit, stride_ot,
              mma: gl.constexpr, GATE_UP: gl.constexpr, H_BK: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # acc [BLOCK_N, BLOCK_M]: output columns row0.. of the row-block's pairs, stored in bf16 (the
    # reference's cast points: each linear's output)
    offs_on = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    pair = gl.load(rows_ptr + pid_m * BLOCK_M + offs_om)
    pair_ok = pair >= 0
    ok = pair_ok[None, :] & (offs_on < N)[:, None]
    pair = gl.maximum(pair, 0).to(gl.int64)
    a = _round_bf16(acc_a * TWO_63)
    if GATE_UP:
        u = _round_bf16(acc_b * TWO_63)
        g = gl.minimum(a, limit)
        u = gl.minimum(gl.maximum(u, -limit), limit)
        rw = gl.load(rw_ptr + pair, mask=pair_ok, other=0.0)
        h = g / (1.0 + gl.exp(-g)) * u * rw[None, :]
        # column c of h lies at c // H_BK * H_BK + c % 8 * (H_BK / 8) + c % H_BK // 8
        c = offs_on
        col = c // H_BK * H_BK + c % 8 * (H_BK // 8) + c % H_BK // 8
        gl.store(out_ptr + pair[None, :] * stride_ot + col[:, None], h.to(gl.bfloat16), mask=ok)
    else:
        o_ptrs = out_ptr + pair[None, :] * stride_ot + offs_on[:, None]
        gl.store(o_ptrs, a.to(gl.bfloat16), mask=ok)


# ---------------------------------------------------------------------------------------------
# Warp-specialised form (prefill-sized row-blocks)
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _ws_loads(x_smem, wa_smem, wb_smem, ready, empty, x_ptr, rows_ptr, pid_m, stride_xt, wa, wb,
              pid_n, K, TOPK: gl.constexpr, GATE_UP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # the load partition: every step's x tile and weight words into the buffer the MMA
    # partition freed (`empty`), by cp.async; `ready` completes when this partition's copies of
    # the step have landed (each thread arrives once its own copies are done)
    NW: gl.constexpr = gl.num_warps()
    NUM_BUF: gl.constexpr = x_smem.shape[0]
    BK8: gl.constexpr = BLOCK_K // 8
    TPW_K: gl.constexpr = BLOCK_K // 8 if BLOCK_K // 8 < 32 else 32
    g_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [NW, 1], [1, 0])
    gw_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BK8 // 4), BK8 // 4], [NW, 1], [1, 0])
    offs_gm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, g_l))
    offs_gk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, g_l))
    pair_g = gl.load(rows_ptr + pid_m * BLOCK_M + offs_gm)
    x_offs = (gl.maximum(pair_g, 0) // TOPK)[:, None] * stride_xt + offs_gk[None, :]
    x_ok = (pair_g >= 0)[:, None]
    offs_gn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gw_l))
    offs_gw = gl.arange(0, BK8, layout=gl.SliceLayout(0, gw_l))
    w_tile = offs_gn[:, None] * (K // 8) + offs_gw[None, :]
    for step in range(K // BLOCK_K):
        b = step % NUM_BUF
        # the buffer's previous step read by every MMA warp (a fresh barrier passes phase 1)
        mbarrier.wait(empty.index(b), ((step // NUM_BUF) & 1) ^ 1)
        cp.async_copy_global_to_shared(x_smem.index(b), (x_ptr + step * BLOCK_K) + x_offs,
                                       mask=x_ok)  # fmt: skip
        cp.async_copy_global_to_shared(wa_smem.index(b), (wa + step * BK8) + w_tile)
        if GATE_UP:
            cp.async_copy_global_to_shared(wb_smem.index(b), (wb + step * BK8) + w_tile)
        cp.mbarrier_arrive(ready.index(b), increment_count=False)


@gluon.jit
def _ws_mma(x_smem, wa_smem, wb_smem, ready, empty, sa, sb, rw_ptr, rows_ptr, out_ptr, pid_n,
            pid_m, N, K, limit, stride_ot, HALF: gl.constexpr, GATE_UP: gl.constexpr,
            H_BK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, BOTH: gl.constexpr):  # fmt: skip  # noqa: ANN001, ANN202
    # an MMA partition (one warpgroup): weight rows HALF * BLOCK_N / 2 .. of the program's. Per
    # step: wait for the buffer, decode its half of the weight words in registers into the
    # wgmma A operand, multiply by the x tile, free the buffer (each partition arrives once);
    # then its own epilogue. The two partitions synchronise only through the buffers, so one
    # decodes while the other's MMAs run. BOTH: W1's and W3's MMAs in flight together (two
    # decoded tiles live), else one after the other
    NW: gl.constexpr = gl.num_warps()
    NUM_BUF: gl.constexpr = x_smem.shape[0]
    BH: gl.constexpr = BLOCK_N // 2
    BK8: gl.constexpr = BLOCK_K // 8
    SW: gl.constexpr = BLOCK_K // 128
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row0 = pid_n * BLOCK_N + HALF * BH
    offs_n = row0 + gl.arange(0, BH, layout=gl.SliceLayout(1, a_l))
    offs_w = gl.arange(0, BK8, layout=gl.SliceLayout(0, a_l))
    sel = (offs_w // 4) * 0x1111
    s_offs = offs_n * (K // 128)
    n_steps = K // BLOCK_K
    sa0 = _scales(sa, s_offs, 0, SW)
    sb0 = _scales(sb, s_offs, 0, SW)
    acc_a = gl.zeros([BH, BLOCK_M], gl.float32, layout=mma)
    acc_b = gl.zeros([BH, BLOCK_M], gl.float32, layout=mma)
    for step in range(n_steps):
        b = step % NUM_BUF
        s1 = gl.minimum(step + 1, n_steps - 1)
        sa_k, sa0 = sa0, _scales(sa, s_offs, s1, SW)
        if GATE_UP:
            sb_k, sb0 = sb0, _scales(sb, s_offs, s1, SW)
        mbarrier.wait(ready.index(b), (step // NUM_BUF) & 1)
        fence_async_shared()  # the cp.async writes before the MMA's reads
        xs = x_smem.index(b)
        wa = wa_smem.index(b).slice(HALF * BH, BH).load(a_l)
        acc_a, wa = _mma_step(wa, sa_k, sel, xs, acc_a, a_l)
        if GATE_UP:
            if BOTH:
                wb = wb_smem.index(b).slice(HALF * BH, BH).load(a_l)
                acc_b, wb = _mma_step(wb, sb_k, sel, xs, acc_b, a_l)
                acc_a, acc_b, wa, wb = warpgroup_mma_wait(0, deps=[acc_a, acc_b, wa, wb])
            else:
                acc_a = _wait(acc_a, wa)
                wb = wb_smem.index(b).slice(HALF * BH, BH).load(a_l)
                acc_b, wb = _mma_step(wb, sb_k, sel, xs, acc_b, a_l)
                acc_b = _wait(acc_b, wb)
        else:
            acc_a = _wait(acc_a, wa)
        mbarrier.arrive(empty.index(b), count=1)
    _epilogue(acc_a, acc_b, rw_ptr, rows_ptr, out_ptr, row0, pid_m, N, limit, stride_ot, mma,
              GATE_UP, H_BK, BLOCK_M, BH)  # fmt: skip


@gluon.jit
def _experts_ws_kernel(
    x_ptr, rw_ptr, rows_ptr, blk_ptr, tbl_ptr, wbase_ptr, sbase_ptr, out_ptr, N, K, E, limit,
    stride_xt, stride_ot,
    GATE_UP: gl.constexpr,
    TOPK: gl.constexpr,
    H_BK: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_BUF: gl.constexpr,
    MMA_REGS: gl.constexpr,  # the second MMA partition's registers (the first, the default
    # partition, gets what maxnreg leaves)
    LOAD_WARPS: gl.constexpr,  # the load partition's warps
    LOAD_REGS: gl.constexpr,  # and its registers
    BOTH: gl.constexpr,
    PDL: gl.constexpr = False,
):  # fmt: skip  # noqa: ANN001
    # `_experts_kernel`'s arguments and result. Its per-step CTA barrier and cp.async issue were
    # where its prefill-sized programs waited (Nsight, docs/PERF.md thirtieth session): here a
    # load partition fills NUM_BUF buffers ahead, and two MMA partitions (num_warps = 4 each)
    # take BLOCK_N / 2 weight rows each; mbarriers hand the buffers over
    chain_start(PDL)
    BK8: gl.constexpr = BLOCK_K // 8
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    e = gl.load(blk_ptr + pid_m)
    if e < 0:
        return
    wa, wb, sa, sb = _expert_tensors(tbl_ptr, wbase_ptr, sbase_ptr, e.to(gl.int64), E, GATE_UP)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=BK8 * 2, element_bitwidth=16, rank=2
    )
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_M, BLOCK_K], x_sl)
    wa_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N, BK8], w_sl)
    if GATE_UP:
        wb_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N, BK8], w_sl)
    else:
        wb_smem = wa_smem
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=LOAD_WARPS * 32)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize(
        [
            (_ws_mma, (x_smem, wa_smem, wb_smem, ready, empty, sa, sb, rw_ptr, rows_ptr, out_ptr,
                       pid_n, pid_m, N, K, limit, stride_ot, 0, GATE_UP, H_BK, BLOCK_M, BLOCK_N,
                       BLOCK_K, BOTH)),
            (_ws_mma, (x_smem, wa_smem, wb_smem, ready, empty, sa, sb, rw_ptr, rows_ptr, out_ptr,
                       pid_n, pid_m, N, K, limit, stride_ot, 1, GATE_UP, H_BK, BLOCK_M, BLOCK_N,
                       BLOCK_K, BOTH)),
            (_ws_loads, (x_smem, wa_smem, wb_smem, ready, empty, x_ptr, rows_ptr, pid_m,
                         stride_xt, wa, wb, pid_n, K, TOPK, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K)),
        ],
        [gl.num_warps(), LOAD_WARPS],
        [MMA_REGS, LOAD_REGS],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def permute_columns(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """[T, K] -> [T, K]: within each block_k-column block, column 8w + i moves to i * block_k/8 + w
    (the order of the kernels' code planes)."""
    T, K = x.shape
    return x.reshape(T, K // block_k, block_k // 8, 8).transpose(2, 3).reshape(T, K)


def permuted_column(c: torch.Tensor | int, block_k: int):  # noqa: ANN201
    """Where `permute_columns` puts column c (the gate-up kernel's store of h)."""
    return c // block_k * block_k + c % 8 * (block_k // 8) + c % block_k // 8


# ModuleList -> (probe, scales in range): checked once per expert set (a host sync)
_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scale_probe(experts: torch.nn.ModuleList) -> tuple:
    # where the first and last experts' scales lie and their version counters: an expert set
    # moved, replaced or written in place (a checkpoint load, `init_random_`) is checked again
    first, last = experts[0].w1.scale, experts[-1].w2.scale
    return len(experts), first.data_ptr(), last.data_ptr(), first._version, last._version


def scales_in_range(experts: torch.nn.ModuleList) -> bool:
    """Every e8m0 scale of the experts lies in [SCALE_MIN, SCALE_MAX] (cached per expert set; a
    write into the scales of an expert other than the first and the last one goes unnoticed)."""
    probe = _scale_probe(experts)
    hit = _SCALES.get(experts)
    if hit is not None and hit[0] == probe:
        return hit[1]
    lo, hi = [], []
    for ex in experts:
        for lin in (ex.w1, ex.w3, ex.w2):
            s = lin.scale.view(torch.uint8)
            lo.append(s.min())
            hi.append(s.max())
    ok = int(torch.stack(lo).min()) >= SCALE_MIN and int(torch.stack(hi).max()) <= SCALE_MAX
    _SCALES[experts] = (probe, ok)
    return ok


def supported(x: torch.Tensor, D: int, I: int, unit: int) -> bool:  # noqa: E741
    """These kernels can run: an sm_90 GPU, bf16 x, widths that BLOCK_K and BLOCK_N divide, every
    expert tensor 16-byte aligned. (Whether they should: MIN_PAIRS..MAX_PAIRS pairs and
    `scales_in_range`, decided by `moe.moe_experts`.)"""
    if not is_sm90(x.device):
        return False
    bk, bn = CONFIG["BLOCK_K"], CONFIG["BLOCK_N"]
    return x.dtype == torch.bfloat16 and D % bk == I % bk == D % bn == I % bn == 0 and unit == 16


def _tiles(bm: int, N: int) -> dict:
    # the tiles of a kernel with row-blocks of bm pairs and N output columns
    if bm >= WIDE_MIN and N % WIDE["BLOCK_N"] == 0:
        return CONFIG | (WS if WARP_SPECIALIZED else WIDE)
    return CONFIG


def _launch(
    gate_up: bool,
    x: torch.Tensor,
    rw: torch.Tensor,
    rows: torch.Tensor,
    blk: torch.Tensor,
    table,
    out: torch.Tensor,
    topk: int,
    limit: float,
    h_bk: int = 0,
) -> None:  # noqa: ANN001
    # one kernel over N = out's columns, K = x's: gate-up (W1, W3, SwiGLU) or down (W2)
    # pairs per row-block (BLOCK_M): as the rows were aligned (`block_m`) ; h_bk: the down
    # kernel's BLOCK_K (gate-up: the column order of h)
    bm, N, K = rows.numel() // max(blk.numel(), 1), out.shape[1], x.shape[1]
    cfg = _tiles(bm, N)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    assert rows.numel() == blk.numel() * bm and bm in (8, 16, 32, 64, 128), (
        f"rows {rows.numel()} for {blk.numel()} blocks: not blocks of 8, 16, 32, 64 or 128 pairs"
    )
    # the kernel's x and weight offsets are 32-bit
    assert x.shape[0] * x.stride(0) < 2**31, f"x of {x.shape[0]} rows x {x.stride(0)}"
    cap = cfg["maxnreg"][0 if gate_up else 1]
    assert blk.numel() < 65536, f"{blk.numel()} row-blocks: past the grid's second axis"
    ws = {k: cfg[k] for k in ("MMA_REGS", "LOAD_WARPS", "LOAD_REGS") if k in cfg}
    if ws:
        ws["BOTH"] = bm <= cfg["BOTH_MAX_M"]
    kernel = _experts_ws_kernel if ws else _experts_kernel
    kernel[(N // bn, blk.numel())](
        x, rw, rows, blk, table.offs, table.wbase, table.sbase, out, N, K, table.offs.shape[1],
        float(limit), x.stride(0), out.stride(0), GATE_UP=gate_up, TOPK=topk, H_BK=h_bk or bk,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_BUF=cfg["NUM_BUF"], **ws,
        num_warps=cfg["num_warps"], **({"maxnreg": cap} if cap else {}), **chain(x.device),
    )  # fmt: skip


def down(h: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, table, D: int) -> torch.Tensor:  # noqa: ANN001
    """h [P, I] bf16 with columns in `permute_columns` order -> [P, D] bf16: h W2^T per pair."""
    out = torch.empty((h.shape[0], D), dtype=h.dtype, device=h.device)
    _launch(False, h, h, rows, blk, table, out, 1, 0.0)
    return out


def experts(
    x: torch.Tensor,
    rw: torch.Tensor,
    rows: torch.Tensor,
    blk: torch.Tensor,
    table,  # noqa: ANN001 (moe.ExpertTable)
    topk: int,
    I: int,  # noqa: E741
    limit: float,
) -> torch.Tensor:
    """x [T, D] bf16, rw [P] fp32, rows / blk from `moe.align_rows(idx, E, block_m(P))` ->
    [P, D] bf16: each (token, slot) pair's expert output, the routing weight applied before w2."""
    bm = rows.numel() // max(blk.numel(), 1)
    gate_up, dn = _tiles(bm, I), _tiles(bm, x.shape[1])
    h = torch.empty((rw.numel(), I), dtype=x.dtype, device=x.device)
    _launch(True, permute_columns(x, gate_up["BLOCK_K"]), rw, rows, blk, table, h, topk, limit,
            dn["BLOCK_K"])  # fmt: skip
    return down(h, rows, blk, table, x.shape[1])
