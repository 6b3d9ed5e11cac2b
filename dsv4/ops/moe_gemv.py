"""Routed experts at batch <= 8 (the GEMV form) in Gluon: x read straight into the layout of the
weight words, so no step passes x through shared memory.

  experts(x, rw, idx, table, topk, I, limit) -> [T*k, D] bf16, each (token, slot) pair's expert
  output (the launcher `dsv4.ops.moe.moe_experts` sums the k slots and decides when this applies)

Why a second GEMV: the Triton GEMV form (`moe._mxfp4_gemv`) loads x as 8 strided slices and the
compiler moves each into the words' layout through shared memory: 20 `BAR.SYNC` a step beside
`STSM` / `LDS`, 5.2 instructions per weight in the gate-up loop (SASS, sm_90a; docs/PERF.md,
eighteenth session), at 51-56% of issue slots busy. Here the layouts are stated: each thread holds
4 consecutive 32-bit words (32 columns, one e8m0 scale group) of a weight row, and loads the x
values of those columns itself, in the same layout (neighbouring threads read the same x from L1).

Per program: one (token, slot) pair, BLOCK_N weight rows of its expert, all K columns in BLOCK_K
steps. Per word the 8 codes are decoded by the Triton GEMV's PTX (`moe._E2M1_WORDS_ASM`: the
e2m1 value times 2^-14 in fp32, exact), meet their x in 8 fp32 fmas, and the word's sum is
multiplied by its group's 2^(S-127) * 2^14 and added to a per-(row, word) fp32 accumulator, summed
over the words once after the loop. The products are the reference's (exact in fp32); only the
summation order differs. The epilogue is the Triton kernels': each linear's output rounded to
bf16; gate-up: min(g, limit), clamp(u), silu(g) * u * routing weight, h in bf16.

No CPU path: Gluon has no interpreter. `tests/ops/test_moe.py` checks it against the reference on
a GPU (marked), beside the Triton GEMV form.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4.ops.device import chain, chain_start

# tiles: BLOCK_N weight rows per program, BLOCK_K columns per step (BLOCK_K / 32 threads of a warp
# along a row, each 4 words), warps
CONFIG = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2}
W1, W3, W2 = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # rows of the address table
S1, S3, S2 = gl.constexpr(3), gl.constexpr(4), gl.constexpr(5)


def _words_asm() -> str:
    from dsv4.ops.moe import _E2M1_WORDS_ASM  # one decode for both GEMV forms

    return _E2M1_WORDS_ASM.value


WORDS_ASM = gl.constexpr(_words_asm())


@gluon.jit
def _bf16_pair(v):  # noqa: ANN001, ANN202
    # int32 of two bf16 (low half first) -> their fp32 values
    return (v << 16).to(gl.float32, bitcast=True), (v & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _x_step(x_row, k0, offs_w):  # noqa: ANN001, ANN202
    # the step's x in the words' column layout: 8 fp32 [G, 4] (word w = 4g + j), the i-th holding
    # x[k0 + 8w + i] (each thread the x of its own words, as two 8-byte loads a word)
    xq = (x_row + k0).to(gl.pointer_type(gl.int64)) + 2 * offs_w
    lo = gl.load(xq)
    hi = gl.load(xq + 1)
    x0, x1 = _bf16_pair(lo.to(gl.int32))
    x2, x3 = _bf16_pair((lo >> 32).to(gl.int32))
    x4, x5 = _bf16_pair(hi.to(gl.int32))
    x6, x7 = _bf16_pair((hi >> 32).to(gl.int32))
    return x0, x1, x2, x3, x4, x5, x6, x7


@gluon.jit
def _word_sums(words, xs):  # noqa: ANN001, ANN202
    # words [BN, G, 4] int32 (8 codes each, column 8w + i in nibble i), xs (`_x_step`) -> per word
    # sum_i code_i * x[8w + i], fp32 (times 2^-14)
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        WORDS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(gl.float32,) * 8,
        is_pure=True, pack=1,
    )  # fmt: skip
    t = c0 * xs[0][None]
    t += c1 * xs[1][None]
    t += c2 * xs[2][None]
    t += c3 * xs[3][None]
    t += c4 * xs[4][None]
    t += c5 * xs[5][None]
    t += c6 * xs[6][None]
    t += c7 * xs[7][None]
    return t


@gluon.jit
def _step_loads(x_row, wa, wb, sa, sb, w_offs, s_offs, n_ok, offs_w, k0, GATE_UP: gl.constexpr):  # noqa: ANN001, ANN202
    # one step's x, the words and scales of W1 (W2), and of W3 (gate-up; else W1's again)
    xs = _x_step(x_row, k0, offs_w)
    words_a = gl.load((wa + k0 // 8) + w_offs, mask=n_ok[:, :, None], other=0)
    sc_a = gl.load((sa + k0 // 32) + s_offs, mask=n_ok, other=0)
    if GATE_UP:
        words_b = gl.load((wb + k0 // 8) + w_offs, mask=n_ok[:, :, None], other=0)
        sc_b = gl.load((sb + k0 // 32) + s_offs, mask=n_ok, other=0)
    else:
        words_b, sc_b = words_a, sc_a
    return xs, words_a, sc_a, words_b, sc_b


@gluon.jit
def _scale(s):  # noqa: ANN001, ANN202
    # e8m0 scale bytes -> fp32 2^(S-127) times 2^14, which the decode leaves out (S <= 240)
    return ((s.to(gl.int32) + 14) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _round_bf16(v):  # noqa: ANN001, ANN202
    return v.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _gemv_kernel(
    x_ptr,  # gate-up: x [T, K] bf16 ; down: h [P, K] bf16
    rw_ptr,  # [P] fp32 routing weights (gate-up)
    idx_ptr,  # [P] int64 expert of each (token, slot) pair (the router's ids, flattened)
    tbl_ptr,  # [6, E] int64 offsets in 16-byte units (`moe.expert_table`)
    wbase_ptr,  # int8: expert 0's w1 weight
    sbase_ptr,  # uint8: expert 0's w1 scale
    out_ptr,  # gate-up: h [P, N] bf16 ; down: out [P, N] bf16
    N,
    K,
    E,
    limit,
    stride_xt,
    stride_ot,
    stride_w,  # K / 8: 32-bit words of a weight row (an argument, so its divisibility is known)
    stride_s,  # K / 32: scale bytes of a row
    GATE_UP: gl.constexpr,  # W1 and W3 with the SwiGLU epilogue, else W2
    TOPK: gl.constexpr,  # gate-up: pair p reads x row p // TOPK
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    PREFETCH: gl.constexpr = False,  # load the next step before this step's math
    PDL: gl.constexpr = False,  # chained launch (device.chain)
):
    chain_start(PDL)
    # read BLOCK_N rows of W1 and W3 (or W2): K/2 + K/32 bytes each, + one x row ; write BLOCK_N
    NW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = BLOCK_K // 32  # scale groups a step: a thread's 4 words are one group
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // G, G, 1], [NW, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)  # [BN, G]: a scale, a group's sum
    LX: gl.constexpr = gl.SliceLayout(0, L3)  # [G, 4]: the step's words of a row (their x)
    p = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(idx_ptr + p).to(gl.int64)

    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LS))
    offs_g = gl.arange(0, G, layout=gl.SliceLayout(0, LS))
    offs_xg = gl.arange(0, G, layout=gl.SliceLayout(1, LX))
    offs_xj = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))
    offs_w = 4 * offs_xg[:, None] + offs_xj[None, :]  # [G, 4] word of the step
    n_ok = (offs_n < N)[:, None]
    if GATE_UP:
        wa = wbase_ptr + gl.load(tbl_ptr + W1 * E + e) * 16
        wb = wbase_ptr + gl.load(tbl_ptr + W3 * E + e) * 16
        sa = sbase_ptr + gl.load(tbl_ptr + S1 * E + e) * 16
        sb = sbase_ptr + gl.load(tbl_ptr + S3 * E + e) * 16
    else:
        wa = wbase_ptr + gl.load(tbl_ptr + W2 * E + e) * 16
        sa = sbase_ptr + gl.load(tbl_ptr + S2 * E + e) * 16
        wb, sb = wa, sa
    wa = wa.to(gl.pointer_type(gl.int32))
    wb = wb.to(gl.pointer_type(gl.int32))
    w_offs = (offs_n * stride_w)[:, None, None] + offs_w[None, :, :]  # [BN, G, 4] words of a step
    s_offs = offs_n[:, None] * stride_s + offs_g[None, :]  # [BN, G] scale bytes of a step
    x_row = x_ptr + (p // TOPK).to(gl.int64) * stride_xt

    acc_a = gl.zeros([BLOCK_N, G], gl.float32, layout=LS)
    acc_b = gl.zeros([BLOCK_N, G], gl.float32, layout=LS)
    if PREFETCH:  # the next step's words, scales and x load before this step's math
        nxt = _step_loads(x_row, wa, wb, sa, sb, w_offs, s_offs, n_ok, offs_w, 0, GATE_UP)
    n_steps = K // BLOCK_K
    for step in range(n_steps):
        k0 = step * BLOCK_K  # (a multiple of BLOCK_K the compiler sees: 16-byte word loads)
        if PREFETCH:  # (past the last step: step 0 again, unused)
            cur = nxt
            kn = (step + 1) % n_steps * BLOCK_K
            nxt = _step_loads(x_row, wa, wb, sa, sb, w_offs, s_offs, n_ok, offs_w, kn, GATE_UP)
        else:
            cur = _step_loads(x_row, wa, wb, sa, sb, w_offs, s_offs, n_ok, offs_w, k0, GATE_UP)
        xs, words_a, sc_a, words_b, sc_b = cur
        acc_a += gl.sum(_word_sums(words_a, xs), axis=2) * _scale(sc_a)
        if GATE_UP:
            acc_b += gl.sum(_word_sums(words_b, xs), axis=2) * _scale(sc_b)

    # ---- epilogue (the reference's cast points: each linear's output in bf16)
    ok = offs_n < N
    a = _round_bf16(gl.sum(acc_a, axis=1))
    o_ptrs = out_ptr + p.to(gl.int64) * stride_ot + offs_n
    if GATE_UP:
        u = _round_bf16(gl.sum(acc_b, axis=1))
        g = gl.minimum(a, limit)
        u = gl.minimum(gl.maximum(u, -limit), limit)
        rw = gl.load(rw_ptr + p)
        h = g / (1.0 + gl.exp(-g)) * u * rw
        gl.store(o_ptrs, h.to(gl.bfloat16), mask=ok)
    else:
        gl.store(o_ptrs, a.to(gl.bfloat16), mask=ok)


def supported(x: torch.Tensor, D: int, I: int, unit: int) -> bool:  # noqa: E741
    """Whether the kernels can run: a CUDA GPU (sm_80+), bf16 x, dim and inter multiples of
    BLOCK_K, every expert tensor 16-byte aligned (`ExpertTable.unit`)."""
    bk = CONFIG["BLOCK_K"]
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 8
        and D % bk == 0
        and I % bk == 0
        and unit == 16
    )


def experts(
    x: torch.Tensor,
    rw: torch.Tensor,
    idx: torch.Tensor,
    table,  # noqa: ANN001  (moe.ExpertTable)
    topk: int,
    I: int,  # noqa: E741
    limit: float,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, D] bf16, rw [P] fp32, idx [P] int64 (P = T * topk, pair p = token p // topk) ->
    [P, D] bf16: each pair's expert output (gate-up with the SwiGLU, then down). config: tiles
    other than CONFIG (bench/probe_pieces.py)."""
    T, D = x.shape
    P = idx.numel()
    E = table.offs.shape[1]
    h = torch.empty((P, I), dtype=torch.bfloat16, device=x.device)
    out = torch.empty((P, D), dtype=torch.bfloat16, device=x.device)
    cfg = dict(config or CONFIG)
    bn, bk, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    assert D % bk == 0 and I % bk == 0 and 32 <= bk <= 1024, f"BLOCK_K {bk} vs dim {D}, inter {I}"
    opts = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    opts["PREFETCH"] = cfg.get("PREFETCH", False)
    tbl = (table.offs, table.wbase, table.sbase)
    _gemv_kernel[(P, triton.cdiv(I, bn))](
        x, rw, idx, *tbl, h, I, D, E, limit, x.stride(0), h.stride(0), D // 8, D // 32,
        GATE_UP=True, TOPK=topk, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **opts, **chain(x.device),
    )  # fmt: skip
    _gemv_kernel[(P, triton.cdiv(D, bn))](
        h, rw, idx, *tbl, out, D, I, E, limit, h.stride(0), out.stride(0), I // 8, I // 32,
        GATE_UP=False, TOPK=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **opts, **chain(x.device),
    )  # fmt: skip
    return out
