"""FP8 (e4m3, 128x128 UE8M0 block scales) linear layers at decode sizes, the weights read as stored.

The reference (`dsv4.ops.ref.linear`) dequantizes the whole weight on every call and runs a bf16
GEMM: at decode that is five passes over ~130 MB of weights per layer instead of one over the
packed bytes. Here each program streams a [BLOCK_N, 128] fp8 tile per step, converts it to the
activation dtype (exact: an e4m3 value fits bf16's mantissa and exponent), takes the tile's dot
with the activations in fp32 and scales the partial by its block scale 2^(s-127) (exact, a power
of two). Same products as the reference, summed in fp32 in another order.

One row of x (batch-1 decode, GEMV_MAX_ROWS) takes the GEMV form: it reads the codes as [BLOCK_N,
STEP, 128] tiles, decodes each once to fp32 and meets x in one fma, and loads the next step before
this step's math. The tensor-core form would convert every code into an MMA operand through shared
memory for a 16-row tile holding one real row.

`grouped_linear` (the attention output's wo_a: group g of x times rows g*R..g*R+R-1) is the same
kernel with a group axis. Few output tiles (wq_a, wkv at batch 1) split the reduction over more
programs: each writes an fp32 partial and counts itself in (an atomic per output tile); the last
split of a tile sums the partials in split order (deterministic) and writes the outputs, so there
is no second launch. Past MAX_ROWS rows (prefill chunks) the weight is dequantized once per call
(`dequant`: one pass, the reference's bits) for cuBLAS, amortised over many rows; so it is for fp32
activations on a GPU (checking runs).

On an sm_90 GPU the weights of 16 MB and more (wq_b, wo_a, wo_b, the shared expert's joined w1 /
w3) take the Gluon kernel of `dsv4.ops.linear_sm90` at 1..64 rows instead: the codes decoded in
registers straight into the wgmma operand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops import ref
from dsv4.ops.device import (
    arrival_counts,
    cdiv,
    chain,
    chain_start,
    next_power_of_2,
    num_sms,
    split_reduction,
)
from dsv4.ops.kv_fp8 import cast_rne, decode_codes, decode_mode, exp2i, rne_bf16

FP8_BLOCK = 128  # the scale tile of the checkpoint format
# rows (tokens) up to which the Triton fp8 kernels run; more take the sm90 kernel (to its
# MAX_ROWS) or the weight dequantized once by `dequant` for cuBLAS. H200 (bench/probe_pieces.py
# rows): at 128 rows dequant + cuBLAS beat the Triton form on five of Flash's six projections
# (wq_b 53.2 vs 64.8 us, wkv 11.6 vs 10.4 the exception), from 192 rows on all six. The
# reference's own dequantization takes ~290 us on a 32 MB weight, `dequant` 29 us
MAX_ROWS = 64
DENSE_MAX_ROWS = 64  # the same for bf16 weights (cuBLAS above)
GEMV_MAX_ROWS = 1  # rows up to which the GEMV form runs (one fp32 fma per code)
DENSE_MAX_BYTES = 16 << 20  # bf16 weights up to this size take the kernel on a GPU
# the GEMV form's (output rows per program, scale blocks of K a step): from GEMV_TILES[0][0]
# weight rows on, the first; below, the second (H200, bench/probe_pieces.py linear, T=1 against
# the tensor-core form: wq_b 15.8 vs 17.5 us and wo_a 16.8 vs 19.0 at 64 x 1; wo_b 17.3 vs 19.2,
# wq_a 6.2 vs 6.7, wkv 4.9 vs 5.7, shared w1 7.7 vs 8.6 at 8 x 8. At T=2 a row per program
# is slower than the tensor-core form: 5.9-33.7 vs 5.8-18.9 us)
GEMV_TILES = ((8192, (64, 1)), (0, (8, 8)))


@triton.jit
def _block_scale(s_rows, k0, r_ok):
    # the UE8M0 block scales 2^(s - 127) of the rows' 128-blocks at column k0
    return exp2i(tl.load(s_rows + k0 // 128, mask=r_ok, other=127).to(tl.int32) - 127)


@triton.jit
def _gemv_weights(w_at, s_at, k0, k_end, r_ok, BLOCK_K: tl.constexpr, STEP: tl.constexpr,
                  SCALED: tl.constexpr):  # fmt: skip
    # the GEMV form's weight loads for the step at k0 (nothing past k_end): codes [BLOCK_N, STEP,
    # BLOCK_K] uint8 (or bf16 weights), scale exponents [BLOCK_N, STEP] int32 (127 unscaled)
    col = tl.arange(0, STEP)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    w = tl.load(w_at + k0, mask=r_ok[:, None, None] & (k0 + col < k_end)[None, :, :], other=0)
    if SCALED:
        block_ok = k0 + tl.arange(0, STEP) * BLOCK_K < k_end
        s = tl.load(s_at + k0 // BLOCK_K, mask=r_ok[:, None] & block_ok[None, :], other=127)
    else:
        s = tl.full([r_ok.shape[0], STEP], 127, tl.int32)
    return w, s.to(tl.int32)


@triton.jit
def _gemv_x(x_at, k0, k_end, BLOCK_K: tl.constexpr, STEP: tl.constexpr):
    # the GEMV form's x [STEP, BLOCK_K] for the step at k0
    col = tl.arange(0, STEP)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    return tl.load(x_at + k0, mask=k0 + col < k_end, other=0.0)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, G, K] activations (G = 1 for linear)
    w_ptr,  # [G*R, K] float8_e4m3fn
    s_ptr,  # [cdiv(G*R, 128), cdiv(K, 128)] float8_e8m0fnu, read as uint8
    y_ptr,  # [M, G, R] x.dtype
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = 128: one scale column per step
    UPCAST: tl.constexpr,  # the CPU interpreter: fp32 operands (it mis-computes bf16 dots)
    PRECISION: tl.constexpr,  # "ieee" for fp32 activations
    GEMV: tl.constexpr = False,  # the GEMV form (w_ptr: the codes as uint8)
    STEP: tl.constexpr = 1,  # GEMV: scale blocks (BLOCK_K each) of K a step
    DECODE: tl.constexpr = 0,  # GEMV: `kv_fp8.decode_codes` (1: the GPU's conversion)
    SCALED: tl.constexpr = True,  # fp8 codes with block scales, else weights in x's dtype
    PDL: tl.constexpr = False,  # chained launch (device.chain); GEMV: the first weights load first
):
    # read BLOCK_N * k_per_split fp8 bytes + BLOCK_M * k_per_split activations ;
    # write BLOCK_M * BLOCK_N outputs (with splits: fp32 partials, and the tile's last split
    # reads them all back from L2 and writes the outputs)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_gk = tl.program_id(2)  # group * SPLIT_K + split
    n_splits = tl.cdiv(K, k_per_split)
    g = pid_gk // n_splits
    split = pid_gk % n_splits
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    r_ok = offs_r < R
    rows = (g * R + offs_r).to(tl.int64)  # weight rows of this group
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + g * stride_xg
    w_cols = w_ptr + rows[None, :] * stride_wn  # the tile is read as [BLOCK_K, BLOCK_N]
    s_rows = s_ptr + (rows // 128) * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if GEMV:  # one row of x (BLOCK_M = 1): each code decoded once and met in one fp32 fma
        offs_j = tl.arange(0, STEP)  # STEP scale blocks of K a step
        col = offs_j[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [STEP, BLOCK_K]
        w_at = w_ptr + rows[:, None, None] * stride_wn + col[None, :, :]  # [BLOCK_N, STEP, BLOCK_K]
        x_at = x_ptr + pid_m.to(tl.int64) * stride_xm + g * stride_xg + col
        s_at = s_rows[:, None] + offs_j[None, :]  # [BLOCK_N, STEP]
        # launched behind the previous kernel (device.chain), the program loads its first weights
        # (nothing writes them) before it waits for that kernel, and x after
        w_next, s_next = _gemv_weights(w_at, s_at, k_start, k_end, r_ok, BLOCK_K, STEP, SCALED)
        chain_start(PDL)
        x_next = _gemv_x(x_at, k_start, k_end, BLOCK_K, STEP)
        for k0 in range(k_start, k_end, BLOCK_K * STEP):
            # the next step's codes, x and scales load before this step's math: no load waits
            # behind the math, and twice the codes are in flight
            w = decode_codes(w_next, DECODE) if SCALED else w_next.to(tl.float32)
            xk = x_next.to(tl.float32)
            scale = exp2i(s_next - 127)  # UE8M0 2^(s - 127)
            k1 = k0 + BLOCK_K * STEP
            w_next, s_next = _gemv_weights(w_at, s_at, k1, k_end, r_ok, BLOCK_K, STEP, SCALED)
            x_next = _gemv_x(x_at, k1, k_end, BLOCK_K, STEP)
            acc += tl.sum(tl.sum(w * xk[None, :, :], axis=2) * scale, axis=1)[None, :]
    else:
        chain_start(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            else:
                w = w.to(x.dtype)
            part = tl.dot(x, w, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
            if SCALED:
                acc += part * _block_scale(s_rows, k0, r_ok)[None, :]
            else:
                acc += part

    mask = m_ok[:, None] & r_ok[None, :]
    tile = offs_m[:, None] * stride_ym + g * stride_yg + offs_r[None, :]  # [M, G, R] offsets
    if n_splits > 1:
        # split-K fixup in the kernel (no second launch): store the partial, count the arrival;
        # the split that arrives last sums all partials in split order (deterministic) and resets
        # the count for the next launch
        tl.store(ws_ptr + split * stride_ws + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        counter = count_ptr + (g * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(n_splits):  # through L2: other programs wrote them
                acc += tl.load(ws_ptr + sp * stride_ws + tile, mask=mask, cache_modifier=".cg")
            tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed")
    else:
        tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)


MAX_SPLIT_TILES = 1 << 16  # output tiles a split launch may have (the counters are shared)


def _tile_counters(device: torch.device) -> torch.Tensor:
    """Arrival counts of the split-K fixup, one per output tile (`device.arrival_counts`)."""
    return arrival_counts("linear", device, MAX_SPLIT_TILES)


def _grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    tiles: tuple[int, ...] | None = None,
    gemv: bool | None = None,
    sm90: bool | None = None,
) -> torch.Tensor:
    """x [M, G, K] times weight [G*R, K] per group -> [M, G, R] x.dtype: fp8 with its block
    scale, or (scale None) a weight in x's dtype.
    tiles: force (BLOCK_N, K splits[, GEMV step]) instead of the heuristic; gemv: force the GEMV
    form on or off (default: up to GEMV_MAX_ROWS rows); sm90: the Gluon kernel of `linear_sm90`
    on or off (fp8; default: where it applies and no other knob is set) -- knobs for
    bench/probe_pieces.py linear."""
    M, G, K = x.shape
    N = weight.shape[0]
    scaled = scale is not None
    if scaled:
        assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (
            f"fp8 weight must be float8_e4m3fn [out, in] (got {weight.dtype} {tuple(weight.shape)})"
        )
        exp = (cdiv(N, FP8_BLOCK), cdiv(K, FP8_BLOCK))
        assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == exp, (
            f"fp8 scale must be float8_e8m0fnu {exp} (got {scale.dtype} {tuple(scale.shape)})"
        )
        assert scale.stride(1) == 1, "the fp8 scale needs unit stride along the reduction"
    else:
        assert weight.dtype == x.dtype and weight.dim() == 2, (
            f"weight must be {x.dtype} [out, in] (got {weight.dtype} {tuple(weight.shape)})"
        )
    assert weight.shape[1] == K and N % G == 0, (
        f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} ({G} groups)"
    )
    assert weight.stride(1) == 1 and x.stride(2) == 1, (
        "weight and x need unit stride along the reduction"
    )
    R = N // G  # a group's rows may start inside a scale block: each row reads its own block
    on_gpu = x.device.type == "cuda"
    if not scaled:
        sm90 = False
    elif sm90 is None:  # the default decides quietly (and checks `supported` once)
        sm90 = tiles is None and gemv is None and _sm90(x, weight, G)
    elif sm90:  # asked for: a clear error where the kernel cannot run
        from dsv4.ops import linear_sm90

        assert linear_sm90.supported(x, weight, G), (
            f"sm90 linear: needs an sm_90 GPU, bf16 x of 1..{linear_sm90.MAX_ROWS} rows, K a "
            f"multiple of {linear_sm90.BLOCK_K} and {linear_sm90.CONFIG['BLOCK_N']}-row groups "
            f"(x {x.dtype} {tuple(x.shape)} on {x.device}, weight {tuple(weight.shape)})"
        )
    if sm90:
        from dsv4.ops import linear_sm90  # Gluon (no interpreter): Hopper GPUs only

        return linear_sm90.fp8_grouped(x, weight, scale, _tile_counters(x.device))
    gemv = M <= GEMV_MAX_ROWS if gemv is None else gemv
    sms = num_sms(x.device)
    if gemv:  # a row of x per program; tiles: GEMV_TILES by the weight's rows
        block_m = 1
        block_n, step = GEMV_TILES[0][1] if N >= GEMV_TILES[0][0] else GEMV_TILES[1][1]
        if not scaled:  # 2-byte weights: half the blocks a step, the same bytes (and registers)
            step = max(1, step // 2)
    else:
        # output tiles of 128 rows down to 32 until the grid covers the SMs twice (H200 sweep,
        # bench/probe_pieces.py linear, T=1: wq_a 9.0 us, wkv 8.1, wo_b 20.3 at 32 rows x 8/8/4
        # splits; 16-row tiles or 1 split 12-33 us; wq_b 17.6 at 64 rows, 1 split)
        block_m, step = min(64, max(16, next_power_of_2(M))), 1
        block_n = min(128, max(16, next_power_of_2(R)))
        while block_n > 32 and cdiv(R, block_n) * cdiv(M, block_m) * G < 2 * sms:
            block_n //= 2
    tiles_m = cdiv(M, block_m)
    if tiles is not None:
        block_n, step = tiles[0], tiles[2] if gemv and len(tiles) > 2 else step
    # then up to 8 K splits toward 4 programs per SM
    programs = cdiv(R, block_n) * tiles_m * G
    most, target = (8, 4 * sms) if tiles is None else (tiles[1], tiles[1] * programs)
    k_per_split, splits = split_reduction(K, FP8_BLOCK * step, programs, target, most)
    y = torch.empty((M, G, R), dtype=x.dtype, device=x.device)
    ws = torch.empty((splits, M, G, R), dtype=torch.float32, device=x.device) if splits > 1 else y
    grid = (cdiv(R, block_n), tiles_m, G * splits)
    assert splits == 1 or grid[0] * grid[1] * G <= MAX_SPLIT_TILES, f"{grid} {G}: too many tiles"
    codes = weight.view(torch.uint8) if gemv and scaled else weight
    scales = scale.view(torch.uint8) if scaled else codes  # (a dummy unscaled)
    _fp8_linear_kernel[grid](
        x, codes, scales, y, ws, _tile_counters(x.device), M, R, K, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), scale.stride(0) if scaled else 0,
        y.stride(0), y.stride(1), ws.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, UPCAST=not on_gpu,
        PRECISION="ieee" if x.dtype == torch.float32 or not on_gpu else "tf32",
        GEMV=gemv, STEP=step, DECODE=decode_mode(x.device), SCALED=scaled,
        num_warps=4, num_stages=4 if on_gpu and not gemv else 1, **chain(x.device),
    )  # fmt: skip
    return y


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr,
                    RNE_BF16: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # read BLOCK_N x BLOCK_K e4m3 codes and their block scales ; write them times 2^(s - 127) in
    # out's dtype (the fp32 product, rounded once: the reference's bits). The weight loads go
    # ahead of the chain's wait (no kernel writes weights)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < N) & (cols[None, :] < K)
    codes = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=ok, other=0)
    sb = tl.load(s_ptr + (rows // 128)[:, None] * stride_s + (cols // 128)[None, :], mask=ok,
                 other=127).to(tl.int32)  # fmt: skip
    chain_start(PDL)
    v = decode_codes(codes, DECODE) * exp2i(sb - 127)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             cast_rne(v, out_ptr.dtype.element_ty, RNE_BF16), mask=ok)  # fmt: skip


def dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [N, K] with its 128x128 UE8M0 block scales -> dtype [N, K], the bits of
    `quant.dequant_fp8` where the products are normal fp32 numbers (any checkpoint's scales) in one
    pass: 3 bytes an element moved, where the reference's fp32 steps take ~290 us on a 32 MB weight
    (H200)."""
    N, K = weight.shape
    exp = (cdiv(N, FP8_BLOCK), cdiv(K, FP8_BLOCK))
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1, (
        f"fp8 weight must be float8_e4m3fn [out, in] rows (got {weight.dtype} {tuple(weight.shape)})"
    )
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == exp, (
        f"fp8 scale must be float8_e8m0fnu {exp} (got {scale.dtype} {tuple(scale.shape)})"
    )
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    block_n, block_k = 32, 256
    grid = (cdiv(N, block_n), cdiv(K, block_k))
    _dequant_kernel[grid](
        weight.view(torch.uint8), scale.view(torch.uint8), out, N, K,
        weight.stride(0), scale.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        DECODE=decode_mode(weight.device), RNE_BF16=rne_bf16(out), num_warps=4,
        **chain(weight.device),
    )  # fmt: skip
    return out


def _for_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str,
    scale: torch.Tensor | None,
    scale2: torch.Tensor | None,
) -> tuple:
    # (weight, fmt, scale, scale2) for the reference past the kernels' rows: on a GPU an fp8
    # weight dequantized by `dequant` (one pass, the reference's bits) for its cuBLAS call; else
    # as they are (the reference's own steps)
    if fmt == "fp8" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return dequant(weight, scale, x.dtype), "dense", None, None
    return weight, fmt, scale, scale2


def _sm90(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    # the Gluon kernel of `linear_sm90` by default, where it can run (an sm_90 GPU, bf16 x, the
    # widths, up to its MAX_ROWS): a weight of MIN_WEIGHT_BYTES or more, or rows past one 64-row
    # tile (verify steps: H200, bench/probe_pieces.py rows, at 128-256 rows within 2 us of dequant
    # + cuBLAS on the small weights, ahead of the Triton form from 128 rows but on wkv)
    if x.device.type != "cuda":  # the CPU path does not import Gluon
        return False
    from dsv4.ops import linear_sm90  # Gluon (no interpreter): Hopper GPUs only

    wide = x.shape[0] > linear_sm90.BLOCK_M_MAX
    big = weight.numel() >= linear_sm90.MIN_WEIGHT_BYTES
    return (wide or big) and linear_sm90.supported(x, weight, groups)


def _kernel_serves(x: torch.Tensor, weight: torch.Tensor, fmt: str) -> bool:
    # x [rows, G, K]. fp8: bf16 activations, up to MAX_ROWS rows (past them, where the sm90
    # kernel takes them); fp32 only in the interpreter (on sm_90 its FMA dot tiles spill: fp32
    # runs are for checking, the reference serves them). "dense": bf16 weights of at most
    # DENSE_MAX_BYTES (the compressors' wkv / wgate, the indexer's weights_proj; not the head) on a
    # GPU, chained like every kernel, where cuBLAS took a split-K GEMM and its reduce
    rows = x.shape[0]
    if rows == 0:
        return False
    if fmt == "dense":
        small = weight.numel() * weight.element_size() <= DENSE_MAX_BYTES
        bf16 = x.dtype == weight.dtype == torch.bfloat16
        return x.is_cuda and bf16 and small and rows <= DENSE_MAX_ROWS
    dtypes = (torch.bfloat16,) if x.is_cuda else (torch.bfloat16, torch.float32)
    if fmt != "fp8" or x.dtype not in dtypes:
        return False
    return rows <= MAX_ROWS or _sm90(x, weight, x.shape[1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str = "dense",
    scale: torch.Tensor | None = None,
    scale2: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [..., in] ; weight: [out, in] in `fmt` ; y: [..., out] in x.dtype
    K = x.shape[-1]
    rows = x.numel() // max(K, 1)
    if not _kernel_serves(x.reshape(rows, 1, K), weight, fmt):
        return ref.linear(x, *_for_reference(x, weight, fmt, scale, scale2))
    y = _grouped(x.reshape(rows, 1, K), weight, scale)
    return y.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str = "dense",
    scale: torch.Tensor | None = None,
    scale2: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [T, G, K] ; weight: [G*R, K] (group g = rows g*R..g*R+R-1) ; y: [T, G, R]
    if not _kernel_serves(x, weight, fmt):
        return ref.grouped_linear(x, *_for_reference(x, weight, fmt, scale, scale2))
    return _grouped(x, weight, scale)
