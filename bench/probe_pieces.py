"""Where inside the decode kernels does device time go? Differences of variants (device time, L2
cleared), against the fixed cost of any launch measured the same way:
  - floors: an empty Triton kernel (1 and 132 programs), one 4-byte load + store;
  - hc_pre / hc_head by token count, 1 vs 20 Sinkhorn iterations;
  - sparse attention at T=1, K=640: splits, unsplit, only 64 keys;
  - the indexer: scores alone (paged and scattered rows), select segment sizes and warps,
    torch.topk for comparison;
  - attn_sm90: the Gluon sm_90 attention against the Triton one at T=64 / 32 / 16, with its
    gathers alone and its math alone; attn_tlb: the same with each token's picks in its own
    region; gather / tma_gather: the floor of the access pattern (rows gathered and summed, no
    math; ld.global / cp.async, or one TMA copy per row);
  - gather_runs: the same gathers in runs of 1-16 consecutive rows (1-16 KB pieces);
  - index_floor: the indexer's key reads with no math (contiguous, paged, TMA pages);
  - moe: the routed experts' decode paths (own decode, tl.dot_scaled) and tiles; moe_sm90: the
    Gluon sm_90 experts against tl.dot_scaled and the GEMV form, T = 1..64; moe_gemv: the GEMV
    form's tiles and register caps at batch 1;
  - moe_prefill: the sm90 experts at wider row-blocks against tl.dot_scaled, T = 512..4096;
  - moe_big: the experts at 2048 / 4096-token chunks: tl.dot_scaled, own decode and sm90 tiles;
  - moe_ws: the warp-specialised sm90 experts (several tiles) against the WIDE tiles, T = 2048, 4096;
    and against the default tiles at T = 512, 1024;
  - rows: the FP8 projections and the routed experts at 64-1024 rows (verify steps, small
    prefill chunks): the reference, the Triton and the sm_90 forms;
  - read_floor: one kernel's read of a 32 / 80 MB weight stream (L2 cleared by a memset, by a
    read, or warm) beside the batch-1 projections and experts and the issue's target cases.
Usage: python3 bench/probe_pieces.py [--only floors,attn_sm90,...] [--json FILE]"""

from __future__ import annotations

import argparse
import contextlib
import json
from unittest.mock import patch

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.extra.cuda import globaltimer

from dsv4.bench.cases_indexer import _inputs as index_inputs
from dsv4.bench.ops import _graph_us
from dsv4.bench.probe_inputs import AttnDecode, hc_pre_params
from dsv4.ops import indexer, mhc, ref, sparse_attn

ROWS: list[dict] = []


def us(name: str, fn, cold: bool = True, nbytes: int = 0, rw: int = 1, note: str = "",  # noqa: ANN001
       clean: bool = False) -> float:  # fmt: skip
    # device time, L2 cleared before every call (cold=False: back-to-back calls, L2 warm; clean:
    # cleared by a read, so no dirty lines are left for fn to write back);
    # nbytes: also print the rate (rw=2: the bytes are read and written, as by a copy)
    t = sorted(_graph_us(fn, 3, cold=cold, clean=clean))[1]
    ROWS.append({"probe": name, "us": t})
    print(f"{name:<60}{t:>9.2f} us", flush=True)
    if nbytes:
        print(f"    {rw * nbytes / t / 1e3:.0f} GB/s{note}", flush=True)
    return t


def copy_floor(name: str, nbytes: int) -> float:
    # torch copy_ of nbytes (read + write): the copy bandwidth of this run, beside a probe's rows
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return us(name, lambda: y.copy_(x), nbytes=nbytes, rw=2, note=" (read + write)")


@triton.jit
def _empty_kernel(p):
    pass


@triton.jit
def _one_load_kernel(src, dst):
    tl.store(dst, tl.load(src) + 1.0)


def floors() -> None:
    a = torch.zeros(1024, device="cuda")
    b = torch.zeros(1024, device="cuda")
    us("floor: empty kernel, 1 program", lambda: _empty_kernel[(1,)](a))
    us("floor: empty kernel, 132 programs", lambda: _empty_kernel[(132,)](a))
    us("floor: one 4-byte load + store", lambda: _one_load_kernel[(1,)](a, b))
    us("floor: torch a.add_(1) on 4 KB", lambda: a.add_(1))


# ---- the least any hc_pre at T=64 can take: its bytes (x 2 MB bf16, fn 1.5 MB fp32, y 0.5 MB)
# with its dependency (every output needs a sum over all n*D inputs of its token), as two
# launches (split-K partials, then the collapse) or one launch with a grid-wide barrier


@triton.jit
def _phase_a(x_ptr, fn_ptr, ws_ptr, K, SPLIT: tl.constexpr, T: tl.constexpr):
    g = tl.program_id(0)
    offs_k = g * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(x_ptr + tl.arange(0, T)[:, None] * K + offs_k[None, :]).to(tl.float32)
    fn = tl.load(
        fn_ptr + tl.arange(0, 32)[:, None] * K + offs_k[None, :],
        mask=tl.arange(0, 32)[:, None] < 24,
    )
    part = tl.sum(x * x, 1) + tl.sum(tl.sum(fn, 1), 0)
    tl.store(ws_ptr + g * T + tl.arange(0, T), part)


@triton.jit
def _phase_b(
    x_ptr, ws_ptr, y_ptr, pid, K, D, G: tl.constexpr, T: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = pid // (D // BLOCK_D)
    offs_d = (pid % (D // BLOCK_D)) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.sum(tl.load(ws_ptr + tl.arange(0, G) * T + t), 0)
    x = tl.load(x_ptr + t * K + tl.arange(0, 4)[:, None] * D + offs_d[None, :]).to(tl.float32)
    tl.store(y_ptr + t * D + offs_d, (tl.sum(x, 0) * r).to(tl.bfloat16))


@triton.jit
def _phase_b_kernel(
    x_ptr, ws_ptr, y_ptr, K, D, G: tl.constexpr, T: tl.constexpr, BLOCK_D: tl.constexpr
):
    _phase_b(x_ptr, ws_ptr, y_ptr, tl.program_id(0), K, D, G, T, BLOCK_D)


@triton.jit
def _phase_ab_kernel(x_ptr, fn_ptr, ws_ptr, y_ptr, bar_ptr, K, D, SPLIT: tl.constexpr,
                     G: tl.constexpr, T: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    _phase_a(x_ptr, fn_ptr, ws_ptr, K, SPLIT, T)
    # sense-reversal grid barrier: bar[0] arrivals, bar[1] generation, bar[2] timeouts
    gen0 = tl.atomic_add(bar_ptr + 1, 0, sem="relaxed")
    if tl.atomic_add(bar_ptr, 1, sem="acq_rel") == G - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
        tl.atomic_add(bar_ptr + 1, 1, sem="release")
    else:
        i = 0
        while (tl.atomic_add(bar_ptr + 1, 0, sem="acquire") == gen0) & (i < 100000):
            i += 1
        if i >= 100000:
            tl.atomic_add(bar_ptr + 2, 1)
    _phase_b(x_ptr, ws_ptr, y_ptr, tl.program_id(0), K, D, G, T, BLOCK_D)


def probe_phases() -> None:
    T, n, D = 64, 4, 4096
    K = n * D
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn(24, K, device="cuda")
    y = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
    bar = torch.zeros(3, dtype=torch.int32, device="cuda")
    nbytes = x.numel() * 2 + fn.numel() * 4 + y.numel() * 2
    print(f"hc_pre T=64: {nbytes / 1e6:.2f} MB; at 50% of 4.25 TB/s {nbytes / 0.5 / 4.25e6:.2f} us")
    for G in (128, 256, 512):  # split programs of phase A (and programs of the fused form)
        ws = torch.empty(G, T, device="cuda")
        bd = T * D // G  # one (token, D chunk) per program of B

        def a() -> None:
            _phase_a[(G,)](x, fn, ws, K, SPLIT=K // G, T=T, num_warps=4)  # noqa: B023

        def b() -> None:
            _phase_b_kernel[(T * D // bd,)](x, ws, y, K, D, G=G, T=T, BLOCK_D=bd, num_warps=4)  # noqa: B023

        def ab() -> None:
            a()
            b()

        def fused() -> None:
            _phase_ab_kernel[(G,)](
                x,
                fn,
                ws,
                y,
                bar,
                K,
                D,
                SPLIT=K // G,
                G=G,
                T=T,
                BLOCK_D=bd,
                num_warps=4,  # noqa: B023
            )

        us(f"phases G={G}: A alone (split-K partials)", a)
        us(f"phases G={G}: B alone (collapse)", b)
        us(f"phases G={G}: A then B (two launches)", ab)
        us(f"phases G={G}: A | grid barrier | B (one launch)", fused)
    torch.cuda.synchronize()
    print(f"grid barrier timeouts: {int(bar[2])}")


def probe_combine() -> None:
    # the sparse-attention combine alone: warps and channel chunk per program
    H, D = 64, 512
    for T, S in ((1, 20), (64, 3)):
        part = torch.randn(T, S, H, D, device="cuda")
        ml = torch.randn(T, S, 2, H, device="cuda").abs()
        sink = torch.randn(H, device="cuda")
        o = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
        bs = triton.next_power_of_2(S)
        for bd in (32, 64, 128, 512):
            for w in (1, 2, 4):
                us(
                    f"combine T={T} splits={S} block_d={bd} warps={w}",
                    lambda bd=bd, w=w: sparse_attn._sparse_attn_combine_kernel[  # noqa: B023
                        (T, H, D // bd)
                    ](
                        part,
                        ml,
                        sink,
                        o,
                        H,
                        D,
                        S,
                        part.stride(0),
                        part.stride(1),  # noqa: B023
                        part.stride(2),
                        ml.stride(0),
                        ml.stride(1),
                        o.stride(0),
                        o.stride(1),  # noqa: B023
                        BLOCK_S=bs,
                        BLOCK_D=bd,
                        num_warps=w,
                    ),
                )


def probe_mhc() -> None:
    # hc_pre / hc_head by token count; 1 vs 20 Sinkhorn iterations (the serial tail of the finish)
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    fh, bh = fn[:4].contiguous(), base[:4].contiguous()
    for T in (1, 16, 64):
        x = torch.randn(T, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        for it in (1, 20):
            us(
                f"hc_pre T={T} iters={it}",
                lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, it),  # noqa: B023
            )
        us(f"hc_head T={T}", lambda: mhc.hc_head(x, fh, sc[:1], bh, 1e-6, 1e-6))  # noqa: B023
        us(
            f"hc_pre T={T} iters=20, L2 warm",
            lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20),  # noqa: B023
            cold=False,
        )


def _attn_tile(
    bn: int, dv: int, bh: int, warps: int, stages: int, prefetch: bool, keys_on_m: bool = False
) -> dict:
    # a sparse_attn `config` from a probe's tile tuple
    return {"BLOCK_N": bn, "DV_SPLIT": dv, "BLOCK_H": bh, "KEYS_ON_M": keys_on_m,
            "PREFETCH": prefetch, "num_warps": warps, "num_stages": stages}  # fmt: skip


def probe_attn_tiles() -> None:
    # sparse attention at T=64 / 16 / 1: the autotuned default against fixed tiles x splits, with
    # the gathered key bytes as a fraction of this run's copy bandwidth (printed by 'floors')
    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    tiles = {  # name: (BLOCK_N, DV_SPLIT, BLOCK_H, warps, stages, PREFETCH)
        "bn64 dv1 st3": (64, 1, 64, 8, 3, False),
        "bn32 dv1 st4 pf": (32, 1, 64, 8, 4, True),
        "bn32 dv1 st3 pf": (32, 1, 64, 8, 3, True),
        "bn16 dv1 st6 pf": (16, 1, 64, 8, 6, True),
        "bn32 dv2 st4 pf": (32, 2, 64, 4, 4, True),
        "bn32 dv2 st3": (32, 2, 64, 4, 3, False),
        "bn16 dv2 st2": (16, 2, 64, 4, 2, False),
        "bn16 dv2 st2 pf": (16, 2, 64, 4, 2, True),
        "bh32 bn32 dv2 w2 st2 pf": (32, 2, 32, 2, 2, True),
        "bh32 bn32 dv2 w2 st3 pf": (32, 2, 32, 2, 3, True),
        "bh32 bn16 dv2 w2 st4 pf": (16, 2, 32, 2, 4, True),
    }
    for T, split_list in ((64, (1, 2, 4)), (16, (4, 8)), (1, (10, 20))):
        q, kv, sink, idx = attn.tokens(T)
        nbytes = T * idx.shape[1] * 512 * 2 + 2 * q.numel() * 2
        for fill in (1, 2, 1, 2):  # the split heuristic counting 1 or 2 programs per split
            sparse_attn.PROGRAMS_PER_SPLIT = fill
            us(
                f"attn T={T} default, {fill} program(s) per split",
                lambda: sparse_attn.sparse_attn(q, kv, sink, idx, 0.04),  # noqa: B023
                nbytes=nbytes,
            )
        sparse_attn.PROGRAMS_PER_SPLIT = 1
        if T == 1:
            split_list = ()  # noqa: PLW2901  (T=1: the default only)
        for name, tile in tiles.items():
            cfg = _attn_tile(*tile)
            for sp in split_list:
                try:
                    us(
                        f"attn T={T} {name} splits={sp}",
                        lambda c=cfg, sp=sp: sparse_attn.sparse_attn(  # noqa: B023
                            q,
                            kv,
                            sink,
                            idx,
                            0.04,
                            num_splits=sp,
                            config=c,  # noqa: B023
                        ),
                        nbytes=nbytes,
                    )
                except Exception as e:  # noqa: BLE001  (a tile that does not fit)
                    print(f"attn T={T} {name} splits={sp}: {str(e)[:60]}", flush=True)


def probe_sinkhorn() -> None:
    # div.approx against div.full in the Sinkhorn iterations, interleaved twice
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    for T in (1, 16, 64):
        x = torch.randn(T, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        for fast in (False, True, False, True):
            mhc.FAST_SINKHORN = fast
            us(
                f"hc_pre T={T} sinkhorn div.{'approx' if fast else 'full'}",
                lambda: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20),  # noqa: B023
            )
    mhc.FAST_SINKHORN = True


def probe_mhc_norm() -> None:
    # hc_pre with the block's RMSNorm in the finish (one program a token) against the unfused pair
    # (hc_pre, then rms_norm), by the norm launch's warps and column step, each twice
    from dsv4.ops import rope

    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    w = torch.rand(4096, device="cuda", generator=g) + 0.5
    for T in (1, 16, 64):
        x = torch.randn(T, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2):
            us(
                f"hc_pre T={T} then rms_norm",
                lambda: rope.rms_norm(mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20)[0], w, 1e-6),  # noqa: B023
            )
            for warps, block in (
                (4, 1024),
                (4, 2048),
                (4, 4096),
                (2, 1024),
                (2, 2048),
                (8, 1024),
                (8, 2048),
            ):
                mhc.NORM_BLOCK_D = block
                us(
                    f"hc_pre+norm T={T} {warps} warps, {block} columns a step",
                    lambda: mhc._hc_collapse(
                        x,
                        fn,
                        sc,
                        base,
                        1e-6,
                        1e-6,
                        20,
                        True,
                        w,  # noqa: B023
                        finish_warps=warps,
                    ),  # noqa: B023  # fmt: skip
                )
    mhc.NORM_BLOCK_D = 2048


def probe_post_pre() -> None:
    # the attention sublayer's hc_post + the FFN's hc_pre (with its norm): two launches + the finish
    # (hc_post, then hc_pre's partials) against hc_post computing the partials (hc_post_pre's fused
    # form) by its column chunk, each twice
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    w = torch.rand(4096, device="cuda", generator=g) + 0.5
    for T in (1, 2, 4, 8, 16):
        x = torch.randn(T, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        post = torch.rand(T, 4, device="cuda", generator=g) * 2
        comb = torch.rand(T, 4, 4, device="cuda", generator=g)
        args = (y, x, post, comb, fn, sc, base, 1e-6, 1e-6, 20, w)
        for _ in range(2):
            us(f"hc_post, hc_pre T={T}", lambda a=args: mhc.hc_post_pre(*a, fused=False))
            for bd in (None, 16, 32, 64):
                us(f"hc_post_pre T={T} chunk {bd or 'default'}",
                   lambda a=args, bd=bd: mhc.hc_post_pre(*a, fused=True, block_d=bd))  # fmt: skip


def probe_prep() -> None:
    # a static decode step's index lists (Batch.build_static + prepare, what the engine's CUDA
    # graphs replay every step) for the bench's sliding + CSA + HCA layers at Flash width: the torch
    # builders against the one-launch form (decode_lists.FUSED), each twice
    from dsv4.bench.step import _layer_list, bench_args
    from dsv4.ops import decode_lists
    from dsv4.state import Batch, DecodeState

    args, _ = bench_args("flash", _layer_list("sliding,csa,hca"))
    default = decode_lists.FUSED
    for L in (4096, 131072):
        for B in (1, 16, 64):
            state = DecodeState(args, B, L, torch.bfloat16, "cuda")
            slots = torch.arange(B, device="cuda")
            starts = torch.full((B,), L - 1 - 37, device="cuda")

            def step(state=state, slots=slots, starts=starts, L=L) -> None:  # noqa: ANN001
                Batch.build_static(slots, starts, state, L).prepare(args)

            for _ in range(2):
                for fused in (False, True):
                    decode_lists.FUSED = fused
                    us(f"prep B={B} L={L} {'one launch' if fused else 'torch builders'}", step)
            del state
    decode_lists.FUSED = default


def probe_bound() -> None:
    # what a CUDA graph's position bound costs past the visible entries: the static lists hold
    # bound // ratio entry slots, -1 past a sequence's count, and the indexer and HCA attention walk
    # them all. 32768 visible CSA entries (128K context) at slots x 1 / 1.25 / 2 (the bounds of four
    # steps an octave against powers of two); HCA: 128 window + 1024 visible entries likewise
    for T in (1, 16):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        for f in (1, 1.25, 2):
            pad = torch.full((T, int(32768 * (f - 1))), -1, dtype=torch.long, device="cuda")
            c = torch.cat([cand, pad], 1)
            us(f"bound x{f}: index_topk T={T} visible 32768 slots {c.shape[1]}",
               lambda c=c: indexer.index_topk(q, w, keys, c, 512))  # noqa: B023  # fmt: skip
    for T in (1, 16, 64):
        dec = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
        q, kv, sink, idx = dec.tokens(T)
        win = idx[:, :128]  # the ring rows; then pool rows (the pool starts at row 128 + T)
        ent = 128 + T + torch.randint(0, dec.pool.shape[0], (T, 1024), device="cuda")
        for f in (1, 1.25, 2):
            pad = torch.full((T, int(1024 * (f - 1))), -1, dtype=torch.long, device="cuda")
            i = torch.cat([win, ent, pad], 1)
            us(f"bound x{f}: HCA sparse_attn T={T} 128 + 1024 visible, slots {i.shape[1]}",
               lambda i=i: sparse_attn.sparse_attn(q, kv, sink, i, 0.04))  # noqa: B023  # fmt: skip


def probe_mhc_splits() -> None:
    # hc_pre at T=1: split programs of the partial kernel x D chunk of the collapse programs
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    x = torch.randn(1, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    for programs in (16, 32, 64, 128, 256):
        for block_d in (256, 1024, 4096):
            cfg = mhc._mix_config(1, 24, 16384, 4096, programs)._replace(block_d=block_d)
            us(
                f"hc_pre T=1 {16384 // cfg.split_k} splits, collapse block_d={block_d}",
                lambda: mhc._hc_collapse(x, fn, sc, base, 1e-6, 1e-6, 20, True, cfg=cfg),  # noqa: B023
            )


def probe_attn_sm90() -> None:
    # the Gluon Hopper kernel against the Triton one on one kv source (the engine's decode form)
    from dsv4.ops import sparse_attn_sm90 as sm90

    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    for T in (64, 32, 16):
        q, kv, sink, idx = attn.tokens(T)
        one = (torch.cat(kv),)
        nbytes = T * idx.shape[1] * 512 * 2 + 2 * q.numel() * 2
        want = sparse_attn.sparse_attn(q, one, sink, idx, 0.04)
        sp_t = sparse_attn._default_splits(T, idx.shape[1], q.device)  # given splits: Triton
        for _ in range(2):
            us(
                f"attn T={T} triton, {sp_t} splits",
                lambda: sparse_attn.sparse_attn(q, one, sink, idx, 0.04, num_splits=sp_t),  # noqa: B023
                nbytes=nbytes,
            )
            us(
                f"attn T={T} default (sm90 from SM90_MIN_TOKENS)",
                lambda: sparse_attn.sparse_attn(q, one, sink, idx, 0.04),  # noqa: B023
                nbytes=nbytes,
            )
        for bn, nb in ((64, 2), (32, 4)):
            for sp in {64: (2,), 32: (None, 2), 16: (None,), 1: (None,)}[T]:
                name = f"attn T={T} sm90 bn{bn} nb{nb} splits={sp}"
                kw = dict(num_splits=sp, block_n=bn, num_buf=nb)
                out = sm90.sparse_attn_sm90(q, one, sink, idx, 0.04, **kw)
                err = float((out.float() - want.float()).abs().max())
                us(
                    name,
                    lambda kw=kw: sm90.sparse_attn_sm90(q, one, sink, idx, 0.04, **kw),
                    nbytes=nbytes,
                    note=f"  max|diff| {err:.1e}",
                )  # noqa: B023
                for mode in (1, 2) if T == 64 else ():  # the gathers alone, the math alone
                    us(
                        f"{name} {('', 'loads', 'math')[mode]} only",
                        lambda kw=kw, mode=mode: sm90.sparse_attn_sm90(  # noqa: B023
                            q,
                            one,
                            sink,
                            idx,
                            0.04,
                            **kw,
                            mode=mode,  # noqa: B023
                        ),
                    )


def probe_attn_fixup() -> None:
    # the Gluon kernel's two splits: the combine launch, split 1 combining all heads in the kernel
    # (sm90.FIXUP, one way) and each split combining half the heads (FIXUP_HALVES), bare and with
    # the inverse RoPE (the model's form), with the differences between them. Each variant twice,
    # interleaved (A B C A B C), so drift between them shows
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.ops.rope import rotary

    variants = {"combine launch": (False, False), "fixup one way": (True, False),
                "fixup halves": (True, True)}  # fmt: skip
    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    for T in (64, 48):
        q, kv, sink, idx = attn.tokens(T)
        one = (torch.cat(kv),)
        cs = (torch.randn(T, 32, device="cuda"), torch.randn(T, 32, device="cuda"))
        nbytes = T * idx.shape[1] * 512 * 2 + 2 * q.numel() * 2
        want = ref.sparse_attn(q.float(), tuple(k.float() for k in one), sink, idx, 0.04)
        bn, nb = 64, 2  # (the default tile)
        outs = {}
        for rope in (True, False):
            for _ in range(2):
                for name, (fix, halves) in variants.items():
                    with (
                        patch.object(sm90, "FIXUP", fix),
                        patch.object(sm90, "FIXUP_HALVES", halves),
                    ):
                        kw = dict(
                            num_splits=2, block_n=bn, num_buf=nb, inv_rope=cs if rope else None
                        )
                        outs[rope, name] = sm90.sparse_attn_sm90(q, one, sink, idx, 0.04, **kw)
                        err = float((outs[rope, name].float() - want).norm() / want.norm())
                        us(
                            f"attn T={T} sm90 bn{bn} nb{nb}{' inv_rope' if rope else ''} {name}",
                            lambda kw=kw: sm90.sparse_attn_sm90(q, one, sink, idx, 0.04, **kw),  # noqa: B023
                            nbytes=nbytes,
                            note=f"  rel err {err:.1e}",
                        )
        for name in ("fixup one way", "fixup halves"):
            diff = float(
                (outs[False, name].float() - outs[False, "combine launch"].float()).abs().max()
            )
            exact = torch.equal(outs[True, name], rotary(outs[False, name], *cs, inverse=True))
            print(
                f"    T={T} bn{bn} {name}: max|it - combine launch| {diff:.2e}, rope bit-exact {exact}"
            )
        same = torch.equal(outs[False, "fixup one way"], outs[False, "fixup halves"])
        same_r = torch.equal(outs[True, "fixup one way"], outs[True, "fixup halves"])
        print(f"    T={T} bn{bn}: halves == one way bit for bit: bare {same}, inv_rope {same_r}")
    copy_floor("attn fixup: copy_ of 64 MiB", 64 << 20)


def probe_attn_fp8_fixup() -> None:
    # the Gluon kernel over FP8 entries in the model's form (with the inverse RoPE): two splits
    # combined in the kernel (acc staged over the raw tiles and the bf16 tile) against the combine
    # launch, and unsplit with the RoPE in the kernel against a rotary launch after it
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.ops.rope import rotary
    from dsv4.quant import quant_kv_entries

    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    for T in (64, 48, 256, 1024):
        q, kv, sink, idx = attn.tokens(T)
        one8 = (quant_kv_entries(torch.cat(kv), 64),)
        cs = (torch.randn(T, 32, device="cuda"), torch.randn(T, 32, device="cuda"))
        nb8 = T * idx.shape[1] * 584 + 4 * q.numel()
        plain = sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64)
        turned = sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64, inv_rope=cs)
        exact = torch.equal(turned, rotary(plain, *cs, inverse=True))
        with patch.object(sm90, "OVERLAP", False):
            no_overlap = sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64)

        def run(label: str, note: str) -> None:
            us(label, lambda: sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64, inv_rope=cs),  # noqa: B023
               nbytes=nb8, note=note)  # fmt: skip

        for ov in (False, True, False, True):  # the decode beside S's first half, the model's form
            with patch.object(sm90, "OVERLAP", ov):
                o = sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64)
                err = float((o.float() - no_overlap.float()).abs().max())
                run(
                    f"attn T={T} fp8 sm90 inv_rope overlap {ov}", f"  max|o - no overlap| {err:.1e}"
                )
        if T * 2 <= 132:  # two splits (split 1 combines: FIXUP_HALVES is for bf16 rows)
            for fix in (False, True, False, True):
                with patch.object(sm90, "FIXUP", fix):
                    run(f"attn T={T} fp8 sm90 inv_rope {'fixup' if fix else 'combine launch'}",
                        f"  rope bit-exact {exact}")  # fmt: skip
        else:  # one split
            for _ in range(2):
                us(
                    f"attn T={T} fp8 sm90 unsplit + rotary launch",
                    lambda: rotary(
                        sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64), *cs, inverse=True
                    ),  # noqa: B023
                    nbytes=nb8,
                )
                us(
                    f"attn T={T} fp8 sm90 unsplit, RoPE in the kernel",
                    lambda: sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64, inv_rope=cs),  # noqa: B023
                    nbytes=nb8,
                    note=f"  rope bit-exact {exact}",
                )
    copy_floor("attn fp8 fixup: copy_ of 64 MiB", 64 << 20)


def probe_attn_tlb() -> None:
    # T=64 gathers: picks uniform over a 1 GB pool vs each token's own region (the engine's
    # layout: a sequence's entries together), the Triton kernel and the sm90 one (full, loads only)
    from dsv4.ops import sparse_attn_sm90 as sm90

    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    T = 64
    q, kv, sink, idx = attn.tokens(T)
    one = (torch.cat(kv),)
    nbytes = T * idx.shape[1] * 512 * 2 + 2 * q.numel() * 2
    g = torch.Generator(device="cuda").manual_seed(1)
    pool0 = 128 + T
    for region in (1 << 20, 1 << 14, 1 << 12, 1 << 10):
        if region == 1 << 20:
            ix = idx
        else:
            base = pool0 + torch.arange(T, device="cuda")[:, None] * region
            pick = torch.rand(T, region, device="cuda", generator=g).topk(512, dim=1).indices
            ix = torch.cat([idx[:, :128], base + pick], 1).contiguous()
        for name, fn in (
            ("triton", lambda ix=ix: sparse_attn.sparse_attn(q, one, sink, ix, 0.04)),
            ("sm90", lambda ix=ix: sm90.sparse_attn_sm90(q, one, sink, ix, 0.04, num_splits=2)),
            (
                "sm90 loads only",
                lambda ix=ix: sm90.sparse_attn_sm90(q, one, sink, ix, 0.04, num_splits=2, mode=1),
            ),
            (
                "sm90 splits=1 loads only",
                lambda ix=ix: sm90.sparse_attn_sm90(q, one, sink, ix, 0.04, num_splits=1, mode=1),
            ),
        ):
            us(f"attn T=64 picks in {region}-row regions: {name}", fn, nbytes=nbytes)


@triton.jit
def _gather_sum_kernel(kv_ptr, idx_ptr, out_ptr, K, keys_per_split, stride_kn, stride_it,
                       BN: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    # the gathers of sparse attention with no math: rows idx[t, split's keys] summed
    t = tl.program_id(0)
    sp = tl.program_id(1)
    k0 = sp * keys_per_split
    k1 = tl.minimum(k0 + keys_per_split, K)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BN, D], tl.float32)
    for s in tl.range(k0, k1, BN, num_stages=STAGES):
        offs = s + tl.arange(0, BN)
        idx = tl.load(idx_ptr + t * stride_it + offs, mask=offs < k1, other=0)
        rows = kv_ptr + idx.to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
        acc += tl.load(rows, mask=(offs < k1)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * tl.num_programs(1) + sp) * D + offs_d, tl.sum(acc, 0))


def _gather_rows(T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    # the rows T decode tokens' sparse attention gathers: the sources as one [N, 512] bf16
    # tensor, int32 indices [T, 640] into it and the bytes gathered
    _, kv, _, idx = AttnDecode(torch.Generator(device="cuda").manual_seed(0)).tokens(T)
    return torch.cat(kv), idx.to(torch.int32).contiguous(), T * idx.shape[1] * 512 * 2


def probe_gather() -> None:
    # how fast can 64 tokens x 640 random 1 KB rows be gathered at all? Plain loads (stages 1:
    # ld.global into registers, many programs per SM) and cp.async pipelines (stages > 1)
    T = 64
    one, ix, nbytes = _gather_rows(T)
    K = ix.shape[1]
    for bn, stages, warps in (
        (16, 1, 4),
        (32, 1, 4),
        (16, 1, 8),
        (32, 1, 8),
        (16, 3, 4),
        (32, 3, 8),
    ):
        for splits in (1, 2, 10):
            kps = triton.cdiv(K, splits)
            out = torch.empty(T * splits, 512, device="cuda")
            us(
                f"gather T=64 x 640 rows: BN {bn}, stages {stages}, {warps} warps, {splits} splits",
                lambda bn=bn, stages=stages, warps=warps, splits=splits, kps=kps, out=out: (
                    _gather_sum_kernel[(T, splits)](
                        one,
                        ix,
                        out,
                        K,
                        kps,
                        one.stride(0),
                        ix.stride(0),
                        BN=bn,
                        D=512,
                        STAGES=stages,
                        num_warps=warps,
                    )  # fmt: skip
                ),
                nbytes=nbytes,
            )
    copy_floor("copy of the same bytes (torch copy_)", nbytes)


def probe_gather_runs() -> None:
    # is the gather rate of scattered 1 KB rows set by the access pattern? T=64 tokens x 640 rows
    # of the 1M-row pool (none shared between tokens), in runs of R consecutive rows at random
    # R-aligned places: the same bytes as sparse attention's T=64 case, in 1 KB to 16 KB pieces.
    # Two of the gather floor's configurations (probe_gather), and copy_ of the same bytes
    from dsv4.ops import sparse_attn_sm90 as sm90

    T, K = 64, 640
    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    pool = attn.pool
    q = attn.tokens(T)[0]
    g = torch.Generator(device="cuda").manual_seed(2)
    nbytes = T * K * 512 * 2
    _, _, _, shared = attn.tokens(T)  # (the attention probes' rows: one ring shared by all)
    cases = {"attention probes' rows (shared ring + 512 picks)": (torch.cat(attn.tokens(T)[1]),
                                                                  shared.to(torch.int32))}  # fmt: skip
    for run in (1, 2, 4, 8, 16):
        starts = torch.randint(0, pool.shape[0] // run, (T, K // run), device="cuda", generator=g)
        ix = (starts[:, :, None] * run + torch.arange(run, device="cuda")).reshape(T, K)
        cases[f"runs of {run} rows ({run} KB)"] = (pool, ix.to(torch.int32).contiguous())
    for name, (src, ix) in cases.items():
        for bn, stages, warps, splits in ((16, 1, 4, 10), (32, 3, 8, 2)):
            kps = triton.cdiv(K, splits)
            out = torch.empty(T * splits, 512, device="cuda")
            us(
                f"gather runs T=64 x 640: {name}; BN {bn}, stages {stages}, {warps} warps, "
                f"{splits} splits",
                lambda bn=bn, stages=stages, warps=warps, splits=splits, kps=kps, out=out, src=src,
                ix=ix: _gather_sum_kernel[(T, splits)](
                    src, ix, out, K, kps, src.stride(0), ix.stride(0), BN=bn, D=512,
                    STAGES=stages, num_warps=warps,
                ),
                nbytes=nbytes,
            )  # fmt: skip
        us(f"gather runs T=64 x 640: {name}; sm90 attention (2 splits, fixup)",
           lambda src=src, ix=ix: sm90.sparse_attn_sm90(q, (src,), attn.sink, ix, 0.04,
                                                        num_splits=2), nbytes=nbytes)  # fmt: skip
    copy_floor("gather runs: copy_ of the same bytes", nbytes)


@gluon.jit
def _tma_issue(kv_desc, idx_row, smem, bars, j, k0, k1, BN: gl.constexpr, NUM_BUF: gl.constexpr,
               SWIZZLED: gl.constexpr):  # fmt: skip
    # tile j of the split: each key row (1 KB) as one [2, 256] box of the [2N, 256] view, or
    # (SWIZZLED) as 8 boxes [1, 64], box c at row r of the buffer's 128B-swizzled [BN, 64] tile c
    bar = bars.index(j % NUM_BUF)
    mbarrier.expect(bar, BN * 1024)
    for r in gl.static_range(BN):
        row = gl.maximum(gl.load(idx_row + gl.minimum(k0 + j * BN + r, k1 - 1)), 0)
        if SWIZZLED:
            for c in gl.static_range(8):
                dst = smem.index((j % NUM_BUF) * 8 + c).slice(r, 1, dim=0)
                tma.async_copy_global_to_shared(kv_desc, [row, c * 64], bar, dst)
        else:
            tma.async_copy_global_to_shared(
                kv_desc, [row * 2, 0], bar, smem.index((j % NUM_BUF) * BN + r)
            )


@gluon.jit
def _tma_gather_kernel(kv_desc, idx_ptr, out_ptr, K, keys_per_split, stride_it,
                       BN: gl.constexpr, NUM_BUF: gl.constexpr, SWIZZLED: gl.constexpr = False):  # fmt: skip
    # the gathers of sparse attention by TMA (NUM_BUF - 1 tiles in flight), no math: how fast can
    # Hopper's copy engine gather the rows cp.async could not. SWIZZLED: as wgmma-ready tiles
    # (8 boxes a key, written into an unswizzled view of the same bytes: Gluon does not slice a
    # swizzled layout inside its 8-row atom)
    t = gl.program_id(0)
    sp = gl.program_id(1)
    k0 = sp * keys_per_split
    k1 = gl.minimum(k0 + keys_per_split, K)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    n_tiles = gl.cdiv(k1 - k0, BN)
    if SWIZZLED:
        raw_l: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=16, rank=2
        )
        smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF * 8, BN, 64], raw_l)
    else:
        smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF * BN, 2, 256], kv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(bars.index(i), count=1)
    # the split's indices into L1 with one vector load: the scalar loads of the issue then hit
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = k0 + gl.arange(0, 1024, layout=lay)
    warm = gl.sum(gl.load(idx_row + offs, mask=offs < k1, other=0), 0)
    for j in gl.static_range(NUM_BUF - 1):
        if j < n_tiles:
            _tma_issue(kv_desc, idx_row, smem, bars, j, k0, k1, BN, NUM_BUF, SWIZZLED)
    for j in range(n_tiles):
        if j + NUM_BUF - 1 < n_tiles:
            _tma_issue(kv_desc, idx_row, smem, bars, j + NUM_BUF - 1, k0, k1, BN, NUM_BUF,
                       SWIZZLED)  # fmt: skip
        mbarrier.wait(bars.index(j % NUM_BUF), (j // NUM_BUF) & 1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(bars.index(i))
    gl.store(out_ptr + t * gl.num_programs(1) + sp, warm)


def probe_tma_gather() -> None:
    # the gathers of T=64 sparse attention (64 x 640 random 1 KB rows) by TMA, one copy per row,
    # against the best cp.async / ld.global gather (probe_gather) and copy_ of the same bytes
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T = 64
    one, ix, nbytes = _gather_rows(T)
    K = ix.shape[1]
    rows2 = one.view(-1, 256)  # a 1 KB row = a [2, 256] box
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(rows2, list(rows2.shape), list(rows2.stride()), [2, 256], layout)
    for bn, nb in ((16, 4), (16, 8), (32, 4), (32, 6), (64, 2), (64, 3)):
        for splits in (1, 2, 5, 10):
            kps = triton.cdiv(K, splits)
            out = torch.empty(T * splits, dtype=torch.int32, device="cuda")
            us(
                f"tma gather T=64 x 640 rows: BN {bn}, {nb} buffers, {splits} splits",
                lambda bn=bn, nb=nb, splits=splits, kps=kps, out=out: _tma_gather_kernel[
                    (T, splits)
                ](desc, ix, out, K, kps, ix.stride(0), BN=bn, NUM_BUF=nb, num_warps=4),
                nbytes=nbytes,
            )
    out = torch.empty(T * 10, 512, device="cuda")
    us(
        "gather T=64 x 640 rows (ld.global): BN 16, 4 warps, 10 splits",
        lambda: _gather_sum_kernel[(T, 10)](
            one, ix, out, K, 64, one.stride(0), ix.stride(0), BN=16, D=512, STAGES=1, num_warps=4
        ),
        nbytes=nbytes,
    )
    copy_floor("copy of the same bytes (torch copy_)", nbytes)


@gluon.jit
def _tma_swizzle_kernel(desc, idx_ptr, out_ptr, ROWS: gl.constexpr):
    # ROWS rows of the pool, one TMA box [1, 64] each (128B-swizzle descriptor), written at row r
    # (r * 128 bytes) of an unswizzled buffer, then read back through the 128B-swizzled layout:
    # right only if the copy engine swizzles by the destination address (not by the box's rows)
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    raw_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    raw = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], raw_l)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, ROWS * 128)
    for r in gl.static_range(ROWS):
        tma.async_copy_global_to_shared(
            desc, [gl.load(idx_ptr + r), 0], bar, raw.slice(r, 1, dim=0)
        )
    mbarrier.wait(bar, 0)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = raw._reinterpret(gl.bfloat16, [ROWS, 64], sl).load(lay)
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, lay))
    gl.store(out_ptr + offs_r[:, None] * 64 + offs_c[None, :], v)
    mbarrier.invalidate(bar)


def probe_tma_swizzle() -> None:
    # can Hopper's TMA write one key row into row (key % 8) of a 128B-swizzled tile (what wgmma
    # reads), by boxes [1, 64] at 128-byte offsets? Checked against the rows; then the T=64
    # attention gathers in that form (8 boxes a key) timed beside the [2, 256]-box gathers
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    sl = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [1, 64], sl)
    idx = torch.randperm(4096, device="cuda", generator=g)[:64].to(torch.int32)
    out = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    _tma_swizzle_kernel[(1,)](desc, idx, out, ROWS=64, num_warps=4)
    want = pool[idx.long(), :64]
    r = torch.arange(64, device="cuda")[:, None]
    c = torch.arange(64, device="cuda")[None, :]
    box_relative = pool[idx.long()[:, None], ((c // 8) ^ (r % 8)) * 8 + c % 8]
    print(f"tma [1, 64] boxes into a 128B-swizzled tile: rows right {int((out == want).all(1).sum())}"
          f"/64 (address swizzle), {int((out == box_relative).all(1).sum())}/64 (box-relative)",
          flush=True)  # fmt: skip
    T = 64
    one, ix, nbytes = _gather_rows(T)
    K = ix.shape[1]
    desc = TensorDescriptor(one, list(one.shape), list(one.stride()), [1, 64], sl)
    for bn, nb, splits in ((16, 4, 5), (16, 4, 2), (32, 3, 2)):
        kps = triton.cdiv(K, splits)
        o = torch.empty(T * splits, dtype=torch.int32, device="cuda")
        us(
            f"tma swizzled gather T=64 x 640 rows: BN {bn}, {nb} buffers, {splits} splits",
            lambda bn=bn, nb=nb, splits=splits, kps=kps, o=o: _tma_gather_kernel[(T, splits)](
                desc, ix, o, K, kps, ix.stride(0), BN=bn, NUM_BUF=nb, SWIZZLED=True, num_warps=4
            ),
            nbytes=nbytes,
        )
    _box_gather_references(one, ix, nbytes)


def _box_gather_references(one: torch.Tensor, ix: torch.Tensor, nbytes: int) -> None:
    # the eighth session's best gather by [2, 256] TMA boxes (row-major tiles wgmma cannot read),
    # and a plain copy of the same bytes: the references a gather probe is read against
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, K = ix.shape
    rows2 = one.view(-1, 256)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc2 = TensorDescriptor(rows2, list(rows2.shape), list(rows2.stride()), [2, 256], layout)
    kps = triton.cdiv(K, 5)
    o = torch.empty(T * 5, dtype=torch.int32, device="cuda")
    us(
        f"tma gather T={T} x {K} rows ([2, 256] boxes): BN 16, 4 buffers, 5 splits",
        lambda: _tma_gather_kernel[(T, 5)](
            desc2, ix, o, K, kps, ix.stride(0), BN=16, NUM_BUF=4, num_warps=4
        ),
        nbytes=nbytes,
    )
    copy_floor("copy of the same bytes (torch copy_)", nbytes)


# ---- 1D bulk copies (cp.async.bulk) by inline PTX on `global_smem`: rows at any 16-byte stride
# (Gluon 3.6 has no 1D bulk copy; the twenty-third session found that inline PTX may address the
# kernel's shared memory as `global_smem` + the offset of its one buffer, 0 in the sm_90a PTX)


@gluon.jit
def _bar_init(bar_off, count, pred):  # noqa: ANN001, ANN202
    # mbarrier.init at byte bar_off of shared memory (lanes where pred)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; setp.ne.s32 p, $2, 0; mov.u32 a, global_smem; "
        "add.u32 a, a, $1; @p mbarrier.init.shared::cta.b64 [a], $3; "
        "@p fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r,r",
        [bar_off, pred.to(gl.int32), count],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _bar_expect(bar_off, nbytes, pred):  # noqa: ANN001, ANN202
    # arrive on the barrier at bar_off, expecting nbytes of bulk copies (lanes where pred)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; setp.ne.s32 p, $2, 0; mov.u32 a, global_smem; "
        "add.u32 a, a, $1; @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [a], $3; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r",
        [bar_off, pred.to(gl.int32), nbytes],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _bulk_row(dst_off, src, bar_off, pred, NBYTES: gl.constexpr):  # noqa: ANN001, ANN202
    # one NBYTES-byte row from global address src (int64) to byte dst_off of shared memory,
    # completing on the barrier at bar_off (lanes where pred)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a, b; setp.ne.s32 p, $3, 0; mov.u32 a, global_smem; "
        "add.u32 b, a, $4; add.u32 a, a, $1; "
        f"@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [a], [$2], {NBYTES}, [b]; "
        "mov.u32 $0, 0; }",
        "=r,r,l,r,r",
        [dst_off, src, pred.to(gl.int32), bar_off],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _bar_wait(bar_off, phase):  # noqa: ANN001, ANN202
    # every lane waits for the barrier at bar_off to complete phase `phase`
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
        "WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [a], $2; @!p bra WAIT; "
        "mov.u32 $0, 0; }",
        "=r,r,r",
        [bar_off, phase],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _bulk_issue(idx_row, kv_addr, j, k0, k1, tid, BN: gl.constexpr, NUM_BUF: gl.constexpr):  # noqa: ANN001, ANN202
    # tile j of the split: BN key rows (1 KB each) into buffer j % NUM_BUF, rows 1040 bytes apart;
    # its barrier in the pad of the buffers' row `slot`
    slot = j % NUM_BUF
    kidx = k0 + j * BN + tid
    ok = (tid < BN) & (kidx < k1)
    row = gl.load(idx_row + kidx, mask=ok, other=0)
    n = gl.minimum(k1 - (k0 + j * BN), BN)
    bar = slot * 1040 + 1024 + tid * 0
    _bar_expect(bar, n * 1024 + tid * 0, tid == 0)
    src = kv_addr + gl.maximum(row, 0).to(gl.int64) * 1024
    _bulk_row((slot * BN + tid) * 1040, src, bar, ok, 1024)


@gluon.jit
def _bulk_gather_kernel(kv_ptr, idx_ptr, out_ptr, K, keys_per_split, stride_it,
                        BN: gl.constexpr, NUM_BUF: gl.constexpr, CHECK: gl.constexpr):  # fmt: skip
    # the gathers of sparse attention by 1D bulk copies (NUM_BUF - 1 tiles in flight), rows
    # 1040 bytes apart (the 16-byte pad keeps reads of 8 rows' same columns off one bank, what a
    # key tile read as wgmma's register operand needs); CHECK: every tile read back through the
    # padded layout and stored (out [T, K, 512] bf16), else no math
    NT: gl.constexpr = 32 * gl.num_warps()
    t = gl.program_id(0)
    sp = gl.program_id(1)
    k0 = sp * keys_per_split
    k1 = gl.minimum(k0 + keys_per_split, K)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    n_tiles = gl.cdiv(k1 - k0, BN)
    # the kernel's one buffer (at byte 0 of shared memory: checked on the compiled kernel by
    # the probe): rows of 512 bf16 + 16 pad bytes; buffer b's barrier in row b's pad
    pad_l: gl.constexpr = gl.PaddedSharedLayout.with_identity_for(
        [[512, 8]], [NUM_BUF * BN, 512], [1, 0]
    )
    raw = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF * BN, 512], pad_l)
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tid = gl.arange(0, NT, layout=lay)
    kv_addr = kv_ptr.to(gl.int64, bitcast=True)
    _bar_init(tid * 1040 + 1024, tid * 0 + 1, tid < NUM_BUF)
    gl.thread_barrier()
    for j in gl.static_range(NUM_BUF - 1):
        if j < n_tiles:
            _bulk_issue(idx_row, kv_addr, j, k0, k1, tid, BN, NUM_BUF)
    acc = tid * 0
    for j in range(n_tiles):
        # (every thread waited on the buffer the next copies reuse one iteration ago; the CTA
        # barrier keeps a slow thread's reads of it before them)
        gl.thread_barrier()
        if j + NUM_BUF - 1 < n_tiles:
            _bulk_issue(idx_row, kv_addr, j + NUM_BUF - 1, k0, k1, tid, BN, NUM_BUF)
        acc += _bar_wait((j % NUM_BUF) * 1040 + 1024 + tid * 0, ((j // NUM_BUF) & 1) + tid * 0)
        if CHECK:
            c_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, gl.num_warps()], [1, 0])
            r = gl.arange(0, BN, layout=gl.SliceLayout(1, c_l))
            c = gl.arange(0, 512, layout=gl.SliceLayout(0, c_l))
            kidx = k0 + j * BN + r
            dst = out_ptr + (t.to(gl.int64) * K + kidx[:, None]) * 512 + c[None, :]
            for b in gl.static_range(NUM_BUF):
                if j % NUM_BUF == b:
                    tile = raw.slice(b * BN, BN, dim=0).load(c_l)
                    gl.store(dst, tile, mask=(kidx < k1)[:, None])
    if not CHECK:
        keep = raw.slice(0, 1, dim=0).load(
            gl.BlockedLayout([1, 4], [1, 32], [1, gl.num_warps()], [1, 0])
        )
        gl.store(
            out_ptr + (t * gl.num_programs(1) + sp) * NT + tid,
            acc + gl.sum(gl.sum(keep.to(gl.float32), 1), 0).to(gl.int32),
        )


def probe_bulk_gather() -> None:
    # can 1D bulk copies (cp.async.bulk, inline PTX) gather the T=64 attention rows as fast as
    # the [2, 256] TMA boxes (72% of copy bandwidth, eighth session), and at a 1040-byte row
    # stride (what conflict-free reads of a key tile as wgmma's register operand need)? Checked
    # against the rows first
    T = 64
    one, ix, nbytes = _gather_rows(T)
    K = ix.shape[1]
    t4 = 4
    out = torch.zeros(t4, K, 512, dtype=torch.bfloat16, device="cuda")
    ck = _bulk_gather_kernel[(t4, 2)](
        one, ix, out, K, triton.cdiv(K, 2), ix.stride(0), BN=32, NUM_BUF=2, CHECK=True,
        num_warps=4,
    )  # fmt: skip
    torch.cuda.synchronize()
    ok = int((out == one[ix[:t4].long()]).all(-1).sum())
    # (a wrong base of the buffer in the inline PTX, or another allocation below it, puts rows
    # elsewhere: this count catches both)
    print(f"bulk gather: rows right {ok}/{t4 * K}; shared bytes {ck.metadata.shared}", flush=True)
    for bn, nb, splits in ((16, 4, 5), (16, 4, 10), (16, 8, 5), (32, 2, 2), (32, 4, 2),
                           (32, 4, 5), (64, 2, 2), (16, 8, 2)):  # fmt: skip
        kps = triton.cdiv(K, splits)
        o = torch.empty(T * splits * 128, dtype=torch.int32, device="cuda")
        us(
            f"bulk gather T=64 x 640 rows: BN {bn}, {nb} buffers, {splits} splits",
            lambda bn=bn, nb=nb, splits=splits, kps=kps, o=o: _bulk_gather_kernel[(T, splits)](
                one, ix, o, K, kps, ix.stride(0), BN=bn, NUM_BUF=nb, CHECK=False, num_warps=4
            ),
            nbytes=nbytes,
        )
    _box_gather_references(one, ix, nbytes)


def probe_attn_fp8() -> None:
    # decode attention over FP8 entries (584 B rows) against the same rows in bf16, one source
    # (the engine's decode form): the default, and fixed tiles x splits with the GPU's decode
    # (`kv_fp8.load_entries` DECODE 1; the tenth session's first run also timed 0 and a bf16 one)
    from dsv4.quant import quant_kv_entries

    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    tiles = {  # name: (BLOCK_N, DV_SPLIT, BLOCK_H, warps, stages, PREFETCH[, KEYS_ON_M])
        "bn16 dv1 st4 pf": (16, 1, 64, 8, 4, True),
        "bn32 dv2 st3 pf": (32, 2, 64, 4, 3, True),
        "bh16 bn32 st2": (32, 1, 16, 4, 2, False),
        # keys on the MMA rows: the decoded tile is operand A (registers), and the sm_90 PTX keeps
        # cp.async for the gathers (8-11 of them), which the other FP8 tiles lose
        "km bn64 st2": (64, 1, 64, 8, 2, False, True),
        "km bn32 st3": (32, 1, 64, 8, 3, False, True),
        "km bh16 bn32 st2": (32, 1, 16, 4, 2, False, True),
        "km bn64 dv2 st3": (64, 2, 64, 4, 3, False, True),
    }
    for T, split_list in ((64, (1, 2)), (16, (4,)), (1, (20,))):
        q, kv, sink, idx = attn.tokens(T)
        rows = torch.cat(kv)
        ent = quant_kv_entries(rows, 64)
        one, one8 = (rows,), (ent,)
        sparse_attn.FP8_DECODE = 0
        want = sparse_attn.sparse_attn(q, one8, sink, idx, 0.04, 64, config=dict(BLOCK_N=16))
        keys = T * idx.shape[1]
        us(f"attn T={T} bf16 default", lambda: sparse_attn.sparse_attn(q, one, sink, idx, 0.04),  # noqa: B023
           nbytes=keys * 1024 + 4 * q.numel())  # fmt: skip
        nb8 = keys * 584 + 4 * q.numel()
        sparse_attn.FP8_DECODE = None
        us(f"attn T={T} fp8 default", lambda: sparse_attn.sparse_attn(q, one8, sink, idx, 0.04, 64),  # noqa: B023
           nbytes=nb8)  # fmt: skip
        from dsv4.ops import sparse_attn_sm90 as sm90

        for bn, nb in ((64, 2), (32, 4)):  # the Gluon kernel over entries, at two tilings
            kw = dict(block_n=bn, num_buf=nb)
            out = sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64, **kw)
            err = float((out.float() - want.float()).abs().max())
            us(f"attn T={T} fp8 sm90 bn{bn} nb{nb}",
               lambda kw=kw: sm90.sparse_attn_sm90(q, one8, sink, idx, 0.04, 64, **kw),  # noqa: B023
               nbytes=nb8, note=f" (max err {err:.1e})")  # fmt: skip
        for dec in (1,):
            sparse_attn.FP8_DECODE = dec
            for name, tile in tiles.items():
                cfg = _attn_tile(*tile)
                for sp in split_list:
                    try:
                        out = sparse_attn.sparse_attn(
                            q, one8, sink, idx, 0.04, 64, num_splits=sp, config=cfg
                        )
                        err = float((out.float() - want.float()).abs().max())
                        us(
                            f"attn T={T} fp8 dec{dec} {name} splits={sp}",
                            lambda c=cfg, sp=sp: sparse_attn.sparse_attn(  # noqa: B023
                                q,
                                one8,
                                sink,
                                idx,
                                0.04,
                                64,
                                num_splits=sp,
                                config=c,  # noqa: B023
                            ),
                            nbytes=nb8,
                            note=f" (max err {err:.1e})",
                        )
                    except Exception as e:  # noqa: BLE001  (a tile that does not fit: say so)
                        print(f"attn T={T} fp8 dec{dec} {name} splits={sp}: {type(e).__name__}")
        sparse_attn.FP8_DECODE = None
    copy_floor("copy of 64 MiB (torch copy_)", 1 << 26)


def probe_small_shared() -> None:
    # decode attention over FP8 entries with the tiles that fit sm_120's 99 KB (the only ones an
    # sm_120 GPU can run there), on this GPU, against this GPU's own dispatch: what they cost
    # relative to the tiles they replace (not an sm_120 timing)
    from dsv4.quant import quant_kv_entries

    attn = AttnDecode(torch.Generator(device="cuda").manual_seed(0))
    for T in (1, 16, 64):
        q, kv, sink, idx = attn.tokens(T)
        one8 = (quant_kv_entries(torch.cat(kv), 64),)
        nb8 = T * idx.shape[1] * 584 + 4 * q.numel()
        us(f"attn T={T} fp8 default", lambda: sparse_attn.sparse_attn(q, one8, sink, idx, 0.04, 64),  # noqa: B023
           nbytes=nb8)  # fmt: skip
        for i, shape in enumerate(sparse_attn.SMALL_SHARED_SHAPES):
            cfg = sparse_attn.shape_tile(shape)
            us(f"attn T={T} fp8 SMALL_SHARED_SHAPES[{i}] {shape}",
               lambda c=cfg: sparse_attn.sparse_attn(q, one8, sink, idx, 0.04, 64, config=c),  # noqa: B023
               nbytes=nb8)  # fmt: skip
    copy_floor("copy of 64 MiB (torch copy_)", 1 << 26)


def probe_attn() -> None:
    q, kv, sink, idx = AttnDecode(torch.Generator(device="cuda").manual_seed(0)).tokens(1)
    us("sparse_attn T=1 K=640 default", lambda: sparse_attn.sparse_attn(q, kv, sink, idx, 0.04))
    us(
        "sparse_attn T=1 K=640 default, L2 warm",
        lambda: sparse_attn.sparse_attn(q, kv, sink, idx, 0.04),
        cold=False,
    )
    for st in (1, 2):
        for bn, dv in ((32, 1), (32, 2), (64, 1), (16, 1)):
            cfg = {"BLOCK_N": bn, "DV_SPLIT": dv, "BLOCK_H": 16, "num_warps": 4, "num_stages": st}
            us(
                f"sparse_attn T=1 K=640 BH=16 BN={bn} DV={dv} stages={st} splits=20",
                lambda: sparse_attn.sparse_attn(q, kv, sink, idx, 0.04, num_splits=20, config=cfg),  # noqa: B023
            )
    for bh in (16, 32):
        for s in (10, 20):
            cfg = {"BLOCK_N": 32, "DV_SPLIT": 1, "BLOCK_H": bh, "num_warps": 4, "num_stages": 2}
            us(
                f"sparse_attn T=1 K=640 BH={bh} BN=32 splits={s}",
                lambda: sparse_attn.sparse_attn(q, kv, sink, idx, 0.04, num_splits=s, config=cfg),  # noqa: B023
            )
    cfg = {"BLOCK_N": 64, "DV_SPLIT": 1, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2}
    us(
        "sparse_attn T=1 K=64 BH=16 unsplit (one program per head block)",
        lambda: sparse_attn.sparse_attn(q, kv, sink, idx[:, :64], 0.04, num_splits=1, config=cfg),
    )


def probe_indexer() -> None:
    # index_topk at 128K context: scores alone (and with the hist select's counting), the levels
    # select against the hist select, the hist select's segment and warps, and its slow path
    fine, coarse, counts = indexer._hist_workspace(torch.device("cuda"))
    for T in (1, 16, 64):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        nbytes = T * 32768 * 128 * 2
        us(f"indexer T={T}: scores", lambda: indexer._scores(q, w, keys, cand), nbytes=nbytes)  # noqa: B023
        selects = ("levels", "hist") if T <= indexer.HIST_MAX_TOKENS else ("levels",)
        if T <= indexer.HIST_MAX_TOKENS:
            us(
                f"indexer T={T}: scores + hist counts",
                lambda: indexer._scores(q, w, keys, cand, hist=(fine, coarse)),  # noqa: B023
                nbytes=nbytes,
            )
            for ws in (fine, coarse, counts):  # the counts above were never consumed
                ws.zero_()
        for select in selects:
            us(
                f"indexer T={T}: index_topk select={select}",
                lambda s=select: indexer.index_topk(q, w, keys, cand, 512, select=s),  # noqa: B023
                nbytes=nbytes,
            )
        if T > indexer.HIST_MAX_TOKENS:
            continue
        want = indexer.index_topk(q, w, keys, cand, 512, select="levels")
        got = indexer.index_topk(q, w, keys, cand, 512, select="hist")
        print(f"indexer T={T}: hist == levels: {bool((got == want).all())}")
        for seg in (2048, 4096, 8192):
            for sw in (8, 16, 32):
                us(
                    f"indexer T={T}: hist segment={seg} warps={sw}",
                    lambda s=seg, n=sw: indexer.index_topk(  # noqa: B023
                        q, w, keys, cand, 512, segment=s, select_warps=n, select="hist"
                    ),
                    nbytes=nbytes,
                )
    # the slow path: integer scores, so the threshold bin holds thousands of equal keys
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-2, 3, (16, 64, 128), device="cuda", generator=g).bfloat16()
    keys = torch.randint(-2, 3, (16 * 32768, 128), device="cuda", generator=g).bfloat16()
    w = torch.randint(-2, 4, (16, 64), device="cuda", generator=g).float() * 0.5
    cand = torch.randperm(16 * 32768, device="cuda", generator=g).view(16, 32768)
    for select in ("levels", "hist"):
        us(
            f"indexer T=16 integer scores (ties): select={select}",
            lambda s=select: indexer.index_topk(q, w, keys, cand, 512, select=s),
        )


@triton.jit
def _topk_probe(x_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr):
    # one program: load N int64, keep the K largest sorted (TOPK) or none, store K
    x = tl.load(x_ptr + tl.arange(0, N))
    if TOPK:
        x = tl.topk(x, K)
        tl.store(out_ptr + tl.arange(0, K), x)
    else:
        tl.store(out_ptr + tl.arange(0, N), x)


def _select_variant(q, w, keys, cand, want, sort: bool, segment: int, warps: int) -> None:  # noqa: ANN001
    # index_topk T=16 at 128K with the hist select of `segment` keys x `warps` a program, timed
    # and checked against `want` (the levels select's; unsorted: as sets)
    kw = dict(segment=segment, select_warps=warps, sort=sort, select="hist")
    got = indexer.index_topk(q, w, keys, cand, 512, **kw)
    torch.cuda.synchronize()
    same = (
        torch.equal(got, want)
        if sort
        else all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, want))
    )
    us(
        f"index_topk T=16 128K {'sorted' if sort else 'unsorted'} segment {segment} x {warps} warps{'' if same else ' WRONG'}",
        lambda: indexer.index_topk(q, w, keys, cand, 512, **kw),
    )


def probe_select_sweep() -> None:
    # index_topk T=16 at 128K (32768 candidates) by the hist select's segment (keys per program)
    # and warps: sorted and unsorted, each checked against the levels select first
    T = 16
    q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
    want = indexer.index_topk(q, w, keys, cand, 512, select="levels")
    for sort in (False, True):
        for segment in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                if segment // (32 * warps) < 1:
                    continue
                _select_variant(q, w, keys, cand, want, sort, segment, warps)
    copy_floor("select sweep: copy_ of 128 MiB", 128 << 20)


def probe_select_big() -> None:
    # index_topk T=16 at 128K (32768 candidates), unsorted and sorted: the hist select with fewer,
    # wider programs (up to one 32-warp program a row, whose grid of 16 launches early) against
    # the default 4096 keys x 16 warps; each checked against the levels select, each twice
    T = 16
    q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
    want = indexer.index_topk(q, w, keys, cand, 512, select="levels")
    for _ in range(2):
        for sort in (False, True):
            for segment, warps in ((4096, 16), (8192, 32), (16384, 32), (32768, 32)):
                _select_variant(q, w, keys, cand, want, sort, segment, warps)
    copy_floor("select big: copy_ of 128 MiB", 128 << 20)


def probe_hist_tail() -> None:
    # the hist select's kernel alone: the workspace counts restored before each call (restore
    # alone timed beside it), and the final sort alone (topk of 1024 int64 in one program)
    fine, coarse, counts = indexer._hist_workspace(torch.device("cuda"))

    def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        torch.cuda.synchronize()
        bad = int((got != want).sum())
        sets = sum(len(set(a.tolist()) ^ set(b.tolist())) for a, b in zip(got, want))
        dirty = [int(ws.count_nonzero()) for ws in (fine, coarse, counts)]
        print(f"{label}: {bad} positions differ, {sets} in the sets, workspace nonzero {dirty}")

    for T in (1, 16):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        want = indexer.index_topk(q, w, keys, cand, 512, select="levels")
        check(f"hist T={T} index_topk", indexer.index_topk(q, w, keys, cand, 512), want)
        skey = indexer._scores(q, w, keys, cand, hist=(fine, coarse))
        saved_f, saved_c = fine[:T].clone(), coarse[:T].clone()
        out = torch.empty(T, 512, dtype=torch.int64, device="cuda")

        def restore() -> None:
            fine[:T].copy_(saved_f)  # noqa: B023
            coarse[:T].copy_(saved_c)  # noqa: B023

        indexer._hist_select(skey, out, 4096, 16)
        check(f"hist T={T} eager scores + select", out, want)
        us(f"hist tail T={T}: restore the counts", restore)
        for warps in (8, 16):
            us(
                f"hist tail T={T}: restore + select kernel, {warps} warps",
                lambda n=warps: (restore(), indexer._hist_select(skey, out, 4096, n)),  # noqa: B023
            )
            check(f"hist tail T={T} after the graphs ({warps} warps)", out, want)
        for early in (False, True):

            def scores_tail(e: bool = early) -> None:
                sk = indexer._scores(q, w, keys, cand, hist=(fine, coarse))  # noqa: B023
                indexer._hist_select(sk, out, 4096, 16, early=e)  # noqa: B023

            us(f"hist T={T}: scores + select kernel launched early={early}", scores_tail)
            check(f"hist T={T} after the graphs (early={early})", out, want)
    x = torch.randint(-(2**62), 2**62, (1024,), device="cuda")
    y = torch.empty(1024, dtype=torch.int64, device="cuda")
    for warps in (4, 8, 16):
        for topk in (False, True):
            us(
                f"topk 1024 -> 512 int64, one program, {warps} warps, sort={topk}",
                lambda n=warps, k=topk: _topk_probe[(1,)](x, y, 1024, 512, k, num_warps=n),
            )


def probe_score_programs() -> None:
    # index scores at T=16 / 64, 128K: score programs per SM (how many run at once and how long
    # each is), then index_topk with the best
    for T in (16, 64):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        nbytes = T * 32768 * 128 * 2
        for pps in (1, 2, 3, 4, 6, 8):
            for bn in (64, 128):
                cfg = indexer.ScoreConfig(block_n=bn, programs_per_sm=pps)
                us(
                    f"index scores T={T} block_n={bn} programs/SM={pps}",
                    lambda c=cfg: indexer._scores(q, w, keys, cand, c),  # noqa: B023
                    nbytes=nbytes,
                )
        for pps in (2, 4, 8):
            cfg = indexer.ScoreConfig(programs_per_sm=pps)
            us(
                f"index_topk T={T} programs/SM={pps}",
                lambda c=cfg: indexer.index_topk(q, w, keys, cand, 512, score_config=c),  # noqa: B023
            )


def probe_index_fp8() -> None:
    # index scores at T=16, 128K over FP8 indexer keys (half the bytes of bf16): tiles and programs
    # per SM against the bf16 default; then index_topk (docs/PERF.md, eleventh session: half the
    # bytes buy ~8%, the Triton loop waits out each tile's gathers)
    from dsv4.quant import quant_index_keys

    T = 16
    q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
    codes, scale = quant_index_keys(keys)
    nbytes = T * 32768 * 132
    us(
        "index scores T=16 bf16 default",
        lambda: indexer._scores(q, w, keys, cand),
        nbytes=2 * nbytes,
    )
    want = indexer._scores(q, w, codes, cand, key_scale=scale)
    for bn, warps, stages, pps in ((64, 4, 3, 2), (128, 4, 3, 2), (128, 8, 3, 2), (256, 8, 3, 2),
                                   (64, 4, 3, 4), (128, 4, 3, 4), (128, 8, 2, 2), (128, 4, 4, 2),
                                   (256, 8, 2, 1), (128, 8, 3, 1)):  # fmt: skip
        cfg = indexer.ScoreConfig(
            block_n=bn, num_warps=warps, num_stages=stages, programs_per_sm=pps
        )
        name = f"index scores T=16 fp8 block_n={bn} warps={warps} stages={stages} programs/SM={pps}"
        try:
            got = indexer._scores(q, w, codes, cand, cfg, key_scale=scale)
        except Exception as e:  # noqa: BLE001  (out of resources)
            print(f"{name}: {type(e).__name__}")
            continue
        same = bool(torch.equal(got, want))
        us(name, lambda c=cfg: indexer._scores(q, w, codes, cand, c, key_scale=scale),  # noqa: B023
           nbytes=nbytes, note=f" (same scores as the default tile: {same})")  # fmt: skip
    us("index_topk T=16 bf16", lambda: indexer.index_topk(q, w, keys, cand, 512))
    us("index_topk T=16 fp8 keys", lambda: indexer.index_topk(q, w, codes, cand, 512, scale))


def probe_select() -> None:
    # one select program on one row of 4096 int32 score keys: first level vs final, sort or not
    g = torch.Generator(device="cuda").manual_seed(3)
    for T in (1, 16):
        keys = torch.randint(
            -(2**30), 2**30, (T, 4096), device="cuda", generator=g, dtype=torch.int32
        )
        for final, sort in ((False, False), (True, False), (True, True)):
            out = torch.empty(T, 512, dtype=torch.int64, device="cuda")
            for warps in (1, 2, 4, 8, 16):
                us(
                    f"select T={T} 4096 keys final={final} sort={sort} warps={warps}",
                    lambda: indexer._index_select_kernel[(1, T)](  # noqa: B023
                        keys,
                        out,
                        4096,
                        4096,
                        512,
                        keys.stride(0),
                        out.stride(0),
                        PACKED=False,
                        FINAL=final,
                        SORT=sort,
                        BLOCK_L=4096,
                        BLOCK_K=512,
                        PDL=False,
                        num_warps=warps,  # noqa: B023
                    ),
                )


def probe_gate() -> None:
    # the router at Flash width (256 experts, D 4096, k 6): both kernels, then the route kernel
    # alone (its partials left from the last call)
    from dsv4.ops import gate

    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (1, 16, 64):
        x = torch.randn(T, 4096, device="cuda", generator=g).bfloat16()
        w = (torch.randn(256, 4096, device="cuda", generator=g) / 64).bfloat16()
        bias = torch.randn(256, device="cuda", generator=g) * 0.1
        us(f"moe_gate T={T}", lambda: gate.moe_gate(x, w, bias, 6, 2.5))  # noqa: B023
        us(f"moe_gate T={T} warm", lambda: gate.moe_gate(x, w, bias, 6, 2.5), cold=False)  # noqa: B023


def probe_select_small() -> None:
    # index_topk at 4K context (1024 candidates: one levels-select program per token) by the
    # select program's warps: its reductions cross warps through shared memory
    for T in (1, 16, 64):
        q, w, keys, cand = index_inputs(T, 64, 128, 1024, False, "cuda", True)
        for sw in (1, 2, 4, 8):
            us(
                f"index_topk T={T} C=1024 select warps={sw}",
                lambda n=sw: indexer.index_topk(q, w, keys, cand, 512, select_warps=n),  # noqa: B023
            )


@triton.jit
def _stream_rows_kernel(k_ptr, idx_ptr, out_ptr, C, stride_it, TILES: tl.constexpr,
                        BLOCK_N: tl.constexpr, D: tl.constexpr, PAGED: tl.constexpr,
                        STAGES: tl.constexpr):  # fmt: skip
    # read TILES * BLOCK_N key rows of token t (PAGED: through its candidate list, as the score
    # kernel does; else rows t*C.. contiguous) and sum them: the reads of the scores, no math
    pid_c = tl.program_id(0)
    t = tl.program_id(1)
    c0 = pid_c * TILES * BLOCK_N
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for i in tl.range(0, TILES, num_stages=STAGES):
        offs_n = c0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        if PAGED:
            rows = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs_n)
        else:
            rows = t.to(tl.int64) * C + offs_n
        acc += tl.load(k_ptr + rows[:, None] * D + tl.arange(0, D)[None, :]).to(tl.float32)
    tl.store(out_ptr + t * tl.num_programs(0) + pid_c, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _stream_pages_tma_kernel(desc, idx_ptr, out_ptr, stride_it, TILES: tl.constexpr,
                             BLOCK_N: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    # the score kernel's reads by TMA: each tile of BLOCK_N candidates is one page of contiguous
    # key rows, loaded as one [BLOCK_N, D] box from its first row
    pid_c = tl.program_id(0)
    t = tl.program_id(1)
    c0 = pid_c * TILES * BLOCK_N
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for i in tl.range(0, TILES, num_stages=STAGES):
        base = tl.load(idx_ptr + t.to(tl.int64) * stride_it + c0 + i * BLOCK_N)
        acc += desc.load([base.to(tl.int32), 0]).to(tl.float32)
    tl.store(out_ptr + t * tl.num_programs(0) + pid_c, tl.sum(tl.sum(acc, 1), 0))


def probe_index_floor() -> None:
    # the floor of the indexer's reads at 128K (32768 candidates a token): the key rows streamed
    # and summed with no math, contiguous or through the paged candidate list, in several tilings;
    # against copy_ and torch sum of the same bytes, and the score kernel itself
    from triton.tools.tensor_descriptor import TensorDescriptor

    for T in (16, 64):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        C = 32768
        nbytes = T * C * 128 * 2
        us(f"index T={T}: score kernel", lambda: indexer._scores(q, w, keys, cand), nbytes=nbytes)  # noqa: B023

        def stream(kernel, name, src, *args, bn, tiles, warps, stages, **kw) -> None:  # noqa: ANN001
            # one tiling of a streaming probe kernel over the token's candidate rows
            out = torch.empty(T * C // (bn * tiles), device="cuda")
            us(
                f"index T={T} {name}: BN {bn}, {tiles} tiles, {warps} warps, {stages} stages",
                lambda: kernel[(C // (bn * tiles), T)](
                    src, cand, out, *args, TILES=tiles, BLOCK_N=bn, D=128, STAGES=stages,  # noqa: B023
                    num_warps=warps, **kw,
                ),
                nbytes=nbytes,
            )  # fmt: skip

        for bn, tiles, warps, stages in ((64, 16, 4, 3), (64, 16, 4, 4), (64, 64, 4, 4),
                                         (64, 16, 8, 3), (128, 8, 8, 3), (128, 16, 8, 3),
                                         (128, 32, 8, 2), (64, 4, 4, 2), (32, 32, 4, 4)):  # fmt: skip
            tile = dict(bn=bn, tiles=tiles, warps=warps, stages=stages)
            for paged in (False, True):
                name = f"{'paged' if paged else 'contiguous'} rows summed"
                stream(_stream_rows_kernel, name, keys, C, cand.stride(0), PAGED=paged, **tile)
        for bn, tiles, warps, stages in ((64, 16, 4, 3), (64, 16, 4, 4), (64, 32, 4, 4),
                                         (64, 16, 8, 4), (64, 8, 4, 3)):  # fmt: skip
            desc = TensorDescriptor.from_tensor(keys, [bn, 128])
            stream(_stream_pages_tma_kernel, "paged rows by TMA summed", desc, cand.stride(0),
                   bn=bn, tiles=tiles, warps=warps, stages=stages)  # fmt: skip
        flat = keys[: T * C].clone()
        us(
            f"index T={T}: torch sum of the {nbytes >> 20} MiB of keys",
            lambda: flat.sum(),
            nbytes=nbytes,
        )  # noqa: B023
        copy_floor(f"index T={T}: torch copy_ of them", nbytes)


def probe_topk() -> None:
    # the whole op at the issue's shapes, select segment sizes and warps
    for T in (1, 16):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        us(
            f"index_topk T={T} C=32768 paged default",
            lambda: indexer.index_topk(q, w, keys, cand, 512),
        )  # noqa: B023, E501
        us(f"index_topk T={T} scores alone", lambda: indexer._scores(q, w, keys, cand))  # noqa: B023
        for seg, sw in ((2048, 1), (2048, 2), (2048, 8), (4096, 4), (4096, 8), (8192, 16)):
            try:
                us(
                    f"index_topk T={T} segment={seg} warps={sw}",
                    lambda: indexer.index_topk(q, w, keys, cand, 512, segment=seg, select_warps=sw),  # noqa: B023, E501
                )
            except Exception as e:  # noqa: BLE001  (a tile that does not fit)
                print(f"index_topk T={T} segment={seg} warps={sw}: {str(e)[:80]}")


def _moe_experts() -> torch.nn.ModuleList:
    # Flash's routed experts: 256 MXFP4 experts, D 4096, inter 2048
    from dsv4.bench.cases_moe import random_experts

    return random_experts(4096, 2048, 256, "cuda")


def _moe_tokens(T: int, experts: torch.nn.ModuleList) -> tuple:
    # T tokens routed to 6 random experts each: x, weights, idx and the routed experts' bytes
    from dsv4.bench.cases_moe import _expert_bytes

    E, k = len(experts), 6
    g = torch.Generator(device="cuda").manual_seed(T)
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(-1)[:, :k]
    weights = torch.rand(T, k, generator=g, device="cuda") / k
    x = torch.randn(T, 4096, generator=g, device="cuda").to(torch.bfloat16)
    return x, weights, idx, int(idx.unique().numel()) * _expert_bytes(experts[0])


def probe_moe() -> None:
    # routed experts at Flash sizes (256 MXFP4 experts, k=6) for T = 1, 16, 64: the kernels' own
    # decode of every weight (fp32, then x.dtype) against tl.dot_scaled on the packed codes,
    # autotuned and at fixed tiles, against the bytes of the routed experts
    from dsv4.ops import moe

    experts = _moe_experts()
    for T in (1, 16, 64):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = moe.moe_experts(x, weights, idx, experts, dot_scaled=False)
        variants = [("autotuned", None, False), ("autotuned dot_scaled", None, True)]
        for bn, bk, w, st in ((32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)):
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
            variants += [(f"{cfg}", cfg, False), (f"{cfg} dot_scaled", cfg, True)]
        for name, cfg, ds in variants:
            got = moe.moe_experts(x, weights, idx, experts, config=cfg, dot_scaled=ds)
            err = float((got - want).norm() / want.norm())
            us(
                f"moe T={T} {name}",
                lambda cfg=cfg, ds=ds: moe.moe_experts(  # noqa: B023
                    x,
                    weights,
                    idx,
                    experts,
                    config=cfg,
                    dot_scaled=ds,  # noqa: B023
                ),
                nbytes=nbytes,
                note=f" of expert bytes, rel diff {err:.1e}",
            )


def probe_moe_tiles() -> None:
    # the dot_scaled experts at T = 16, 64: the fixed tiles against leaner ones by the K-loop's
    # instruction count per weight (BN 128 x BK 64, 4 warps: 7.44 vs 7.98 for BN 64 x BK 128)
    from dsv4.ops import moe

    experts = _moe_experts()
    for T in (16, 64):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = moe.moe_experts(x, weights, idx, experts, dot_scaled=False)
        tiles = [(64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 5),
                 (128, 128, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4), (32, 128, 4, 4)]  # fmt: skip
        for _ in range(2):  # twice: the spread between repeats
            for bn, bk, w, st in tiles:
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
                got = moe.moe_experts(x, weights, idx, experts, config=cfg, dot_scaled=True)
                err = float((got - want).norm() / want.norm())
                us(
                    f"moe T={T} dot_scaled {cfg}",
                    lambda c=cfg: moe.moe_experts(
                        x, weights, idx, experts, config=c, dot_scaled=True
                    ),  # noqa: B023, E501
                    nbytes=nbytes,
                    note=f" of expert bytes, rel diff {err:.1e}",
                )


def probe_moe_gemv() -> None:
    # batch 1-2 (6-12 pairs): the GEMV form (codes decoded by inline PTX, products on the CUDA
    # cores) at several tiles and warp counts, with and without the next step's loads ahead of
    # the math
    from dsv4.ops import moe

    def run(cfg, ds, gv):  # noqa: ANN001, ANN202
        return moe.moe_experts(x, weights, idx, experts, config=cfg, dot_scaled=ds, gemv=gv)

    experts = _moe_experts()
    copy_floor("copy_ 128 MiB", 128 << 20)
    for T in (1,):  # from 2 tokens the sm90 experts are the default
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        variants = [("gemv default", None, False, True)]
        # (BLOCK_N, BLOCK_K, warps, prefetch, maxnreg): 16 x 1024 on 4 warps with prefetch takes
        # 255 registers (2 programs, 8 warps an SM); capped (maxnreg, ptxas -v on sm_90a): 16 x 1024
        # at 168 spills 40 B (3 programs), 8 x 1024 on 4 warps and 8 x 512 on 2 warps fit 128
        # with no spills (4 / 8 programs: 16 warps an SM)
        for _ in range(2):  # twice: the spread between repeats
            for bn, bk, nw, pf, mr in ((16, 1024, 4, True, None), (16, 1024, 4, True, 168),
                                       (8, 1024, 4, True, None), (8, 1024, 4, True, 128),
                                       (8, 512, 2, True, None), (8, 512, 2, True, 128),
                                       (8, 512, 2, True, 96), (16, 1024, 4, False, 96)):  # fmt: skip
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 3,
                       "PREFETCH": pf} | ({"maxnreg": mr} if mr else {})  # fmt: skip
                name = f"gemv {bn}x{bk} {nw} warps prefetch={pf} maxnreg={mr}"
                variants.append((name, cfg, False, True))
        for name, cfg, ds, gv in variants:
            got = run(cfg, ds, gv)
            err = float((got - want).norm() / want.norm())
            us(f"moe T={T} {name}", lambda a=(cfg, ds, gv): run(*a), nbytes=nbytes,  # noqa: B023
               note=f" of expert bytes, rel err vs ref {err:.1e}")  # fmt: skip


def probe_moe_sm90() -> None:
    # the Gluon sm_90 experts (codes decoded into the wgmma register operand) against tl.dot_scaled
    # and the GEMV form, T = 1..64, at the default tiles and a few others; GB/s on the routed
    # experts' bytes, error against the reference
    from dsv4.ops import moe_sm90

    experts = _moe_experts()
    copy_floor("copy_ 128 MiB", 128 << 20)
    default = dict(moe_sm90.CONFIG)
    tiles = [
        default,
        {**default, "maxnreg": (None, None)},
        {**default, "maxnreg": (128, 96)},
        {**default, "maxnreg": (96, 96)},
        {**default, "NUM_BUF": 3},
        {**default, "BLOCK_M": 16},
    ]
    kernel = moe_sm90._experts_kernel
    try:  # the previous kernel, when a run puts it beside this one (bench/moe_sm90_prev.py)
        import moe_sm90_prev  # noqa: PLC0415

        tiles.append({**default, "maxnreg": (None, None), "prev": moe_sm90_prev._experts_kernel})
    except ImportError:
        pass
    for T in (1, 2, 4, 8, 16, 32, 64):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        variants = [("dot_scaled", dict(dot_scaled=True, gemv=False), None)]
        if T * 6 <= 64:
            variants.append(("gemv", dict(gemv=True), None))
        variants += [(f"sm90 {'prev' if 'prev' in t else t}", dict(sm90=True), t) for t in tiles]
        for name, kw, tile in variants:
            moe_sm90.CONFIG = dict(tile or default)
            moe_sm90._experts_kernel = moe_sm90.CONFIG.pop("prev", kernel)
            _moe_variant(f"moe T={T} {name}", (x, weights, idx, experts), kw, want, nbytes)
    moe_sm90.CONFIG = default
    moe_sm90._experts_kernel = kernel


def _moe_variant(name: str, inputs: tuple, kw: dict, want: torch.Tensor, nbytes: int) -> None:
    # one expert variant: its error against the reference, then its time (a tile that does not
    # compile or fit is reported and skipped)
    from dsv4.ops import moe

    try:
        got = moe.moe_experts(*inputs, **kw)
        err = float((got - want).norm() / want.norm())
        us(name, lambda: moe.moe_experts(*inputs, **kw), nbytes=nbytes,
           note=f" of expert bytes, rel err vs ref {err:.1e}")  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(f"{name}: {type(e).__name__} {str(e)[:160]}", flush=True)


def probe_moe_prefill() -> None:
    # the routed experts at prefill-sized batches (T = 512..4096 tokens, k=6): the sm90 experts at
    # wider row-blocks (BLOCK_M pairs: each block reads its expert's weights once) against
    # tl.dot_scaled, error against the reference
    from dsv4.ops import moe_sm90

    experts = _moe_experts()
    default, block_m = dict(moe_sm90.CONFIG), moe_sm90.block_m
    for T in (512, 1024, 2048, 4096):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        variants = [("dot_scaled", dict(dot_scaled=True, gemv=False), None)]
        variants += [(f"sm90 BLOCK_M={bm}", dict(sm90=True), {**default, "BLOCK_M": bm})
                     for bm in (8, 16, 32, 64)]  # fmt: skip
        for name, kw, tile in variants:
            moe_sm90.CONFIG = dict(tile or default)
            moe_sm90.block_m = lambda pairs: moe_sm90.CONFIG["BLOCK_M"]  # noqa: ARG005
            _moe_variant(f"moe T={T} {name}", (x, weights, idx, experts), kw, want, nbytes)
            moe_sm90.block_m = block_m
    moe_sm90.CONFIG = default


def probe_moe_big() -> None:
    # the routed experts at prefill chunks past the sm90 kernels' default range (T = 2048, 4096
    # tokens: 12288 / 24576 pairs): tl.dot_scaled and the kernels' own decode at wider tiles
    # (BLOCK_M pairs a row-block), the sm90 kernels at wider tiles with no register cap; TFLOP/s
    # on the products (3 matrices of D x inter per pair)
    from dsv4.ops import moe_sm90

    experts = _moe_experts()
    default, block_m = dict(moe_sm90.CONFIG), moe_sm90.block_m
    triton_tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, dot_scaled)
        (64, 64, 128, 4, 3, True),  # the default
        (128, 64, 128, 4, 3, True),
        (64, 128, 128, 8, 3, True),
        (128, 128, 64, 8, 3, True),
        (128, 128, 128, 8, 3, True),
        (128, 128, 64, 8, 4, True),
        (128, 256, 64, 8, 3, True),
        (64, 128, 64, 4, 4, True),
        (128, 128, 64, 8, 3, False),
        (128, 128, 128, 8, 3, False),
    ]
    sm90_tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, warps)
        (bm, bn, bk, nb, bn // 16)
        for bm in (32, 64, 128) for bn in (64, 128) for bk in (128, 256) for nb in (2, 3)
    ]  # fmt: skip
    for T in (2048, 4096):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        flop = 2 * 3 * T * 6 * 4096 * 2048
        print(f"moe_big T={T}: {flop / 1e12:.2f} TFLOP of products", flush=True)
        for bm, bn, bk, w, st, ds in triton_tiles:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
            kw = dict(config=cfg, dot_scaled=ds, gemv=False, sm90=False)
            name = f"moe_big T={T} {'dot_scaled' if ds else 'own decode'} {cfg}"
            _moe_variant(name, (x, weights, idx, experts), kw, want, nbytes)
            if ROWS and ROWS[-1]["probe"] == name:
                print(f"    {flop / ROWS[-1]['us'] / 1e6:.0f} TFLOP/s", flush=True)
        for bm, bn, bk, nb, w in sm90_tiles:
            moe_sm90.CONFIG = {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm, "NUM_BUF": nb,
                               "num_warps": w, "maxnreg": (None, None)}  # fmt: skip
            moe_sm90.block_m = lambda pairs: moe_sm90.CONFIG["BLOCK_M"]  # noqa: ARG005
            name = f"moe_big T={T} sm90 {moe_sm90.CONFIG}"
            _moe_variant(name, (x, weights, idx, experts), dict(sm90=True), want, nbytes)
            if ROWS and ROWS[-1]["probe"] == name:
                print(f"    {flop / ROWS[-1]['us'] / 1e6:.0f} TFLOP/s", flush=True)
            moe_sm90.block_m = block_m
        moe_sm90.CONFIG = default


def probe_moe_ws() -> None:
    # the routed experts at prefill chunks (T = 2048, 4096 tokens, k=6): the warp-specialised
    # kernel (`moe_sm90.WS`, several of its tiles) against the WIDE tiles of the one-partition
    # kernel, interleaved twice (T = 2048 / 4096: row-blocks of 64 / 128 pairs); TFLOP/s on the
    # products (3 matrices of D x inter per pair)
    from dsv4.ops import moe_sm90

    experts = _moe_experts()
    ws = dict(moe_sm90.WS)
    variants = [("wide", False, ws)] + [
        (f"ws {v}", True, {**ws, **v})
        for v in ({}, {"BOTH_MAX_M": 0}, {"BOTH_MAX_M": 128}, {"NUM_BUF": 3})
    ]
    for T in (2048, 4096):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        flop = 2 * 3 * T * 6 * 4096 * 2048
        for rep in range(2):
            for name, on, tile in variants:
                moe_sm90.WARP_SPECIALIZED, moe_sm90.WS = on, tile
                label = f"moe_ws T={T} {name} ({rep})"
                _moe_variant(label, (x, weights, idx, experts), dict(sm90=True), want, nbytes)
                if ROWS and ROWS[-1]["probe"] == label:
                    print(f"    {flop / ROWS[-1]['us'] / 1e6:.0f} TFLOP/s", flush=True)
    moe_sm90.WARP_SPECIALIZED, moe_sm90.WS = True, ws
    # narrower row-blocks (T = 512 / 1024: 16 / 32 pairs) on the warp-specialised kernel too
    wide_min = moe_sm90.WIDE_MIN
    for T in (512, 1024):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        for rep in range(2):
            for name, least in (("default", wide_min), ("ws", 16)):
                moe_sm90.WIDE_MIN = least
                label = f"moe_ws T={T} {name} ({rep})"
                _moe_variant(label, (x, weights, idx, experts), dict(sm90=True), want, nbytes)
    moe_sm90.WIDE_MIN = wide_min


def probe_moe_decode() -> None:
    # the sm90 experts at their default tiles, this tree's kernel against the previous one
    # (bench/moe_sm90_prev.py, untracked: git show <commit>:dsv4/ops/moe_sm90.py), interleaved
    import moe_sm90_prev  # noqa: PLC0415

    from dsv4.ops import moe, moe_sm90

    experts = _moe_experts()
    kernel = moe_sm90._experts_kernel
    for T in (2, 8, 16, 64):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        for rep in range(2):
            for name, k in (("prev", moe_sm90_prev._experts_kernel), ("this", kernel)):
                moe_sm90._experts_kernel = k
                got = moe.moe_experts(x, weights, idx, experts, sm90=True)
                err = float((got - want).norm() / want.norm())
                us(f"moe T={T} sm90 {name} ({rep})",
                   lambda: moe.moe_experts(x, weights, idx, experts, sm90=True),  # noqa: B023
                   nbytes=nbytes, note=f" of expert bytes, rel err vs ref {err:.1e}")  # fmt: skip
    moe_sm90._experts_kernel = kernel


def probe_linear() -> None:
    # FP8 projections at decode batches: the tensor-core form against the GEMV form (tile rows x
    # K splits x scale blocks a step; default: the launcher's pick), GB/s on the weight bytes,
    # beside a copy of the same bytes
    from dsv4.bench.cases_linear import FLASH, _fp8_weight
    from dsv4.ops import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K, G in FLASH:
        w, s = _fp8_weight(N, K, "cuda", g)
        copy_floor(f"copy_ of {name}'s bytes", 2 * N * K)
        for T in (1, 2):
            x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16)
            for gemv in (False, True):
                form = "gemv" if gemv else "dot"
                run = lambda t=None, gv=gemv: linear._grouped(x, w, s, t, gv)  # noqa: B023, E731
                us(f"linear {name} T={T} {form} default", run, nbytes=N * K)
            if T > 1:  # the GEMV tiles are swept at one row only
                continue
            for bn, step in ((16, 1), (32, 1), (64, 1), (16, 2), (32, 2), (64, 2), (16, 4),
                             (32, 4), (8, 4), (8, 8)):  # fmt: skip
                for sp in (1, 2, 4, 8):
                    if (N // G) // bn * G * sp > 4096 or bn * step > 128:
                        continue
                    us(f"linear {name} T={T} gemv bn={bn} splits={sp} step={step}",
                       lambda t=(bn, sp, step): run(t, True), nbytes=N * K)  # fmt: skip


def probe_linear_sm90() -> None:
    # FP8 projections at decode batches: the Gluon sm_90 kernel against the Triton tensor-core
    # form (and the GEMV form at one row), GB/s on the weight bytes, beside a copy of them
    from dsv4.bench.cases_linear import FLASH, _fp8_weight
    from dsv4.ops import linear, linear_sm90

    g = torch.Generator(device="cuda").manual_seed(0)
    default = dict(linear_sm90.CONFIG)
    tiles = [default] + [
        {**default, "BLOCK_N": bn, "NUM_BUF": nb, "NUM_BUF_WIDE": nb}
        for bn, nb in ((64, 2), (64, 4), (64, 6), (128, 3), (128, 4))
    ]  # fmt: skip
    for name, N, K, G in FLASH:
        w, s = _fp8_weight(N, K, "cuda", g)
        copy_floor(f"copy_ of {name}'s bytes", 2 * N * K)
        for T in (1, 2, 8, 16, 32, 64):
            x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16)
            want = linear._grouped(x, w, s, gemv=False, sm90=False).float()
            forms = [("dot", dict(gemv=False, sm90=False), None)]
            forms += [
                (f"sm90 {t['BLOCK_N']}x{t['NUM_BUF']}/{t['NUM_BUF_WIDE']}", dict(sm90=True), t)
                for t in tiles
            ]
            if T == 1:
                forms.append(("gemv", dict(gemv=True, sm90=False), None))
            for form, kw, tile in forms:
                linear_sm90.CONFIG = dict(tile or default)
                got = linear._grouped(x, w, s, **kw).float()
                err = float((got - want).norm() / want.norm())
                us(f"linear {name} T={T} {form}", lambda kw=kw: linear._grouped(x, w, s, **kw),  # noqa: B023
                   nbytes=N * K, note=f" of weight bytes, rel diff vs dot {err:.1e}")  # fmt: skip
    linear_sm90.CONFIG = default


def probe_rows() -> None:
    # verify steps of speculative decoding and prefill chunks: 64-4096 rows. The FP8 projections
    # (the reference: its dequantization + cuBLAS; `linear.dequant` + cuBLAS; the Triton
    # tensor-core form; the Gluon sm_90 kernel in 64-row tiles) and the routed experts
    # (tl.dot_scaled against the sm_90 experts), GB/s on the weight bytes
    from dsv4.bench.cases_linear import FLASH, _fp8_weight
    from dsv4.ops import linear, linear_sm90, moe

    def dequantized(x, w, s):  # noqa: ANN001, ANN202
        G, K = x.shape[1], x.shape[2]
        return torch.einsum("tgk,grk->tgr", x, linear.dequant(w, s, x.dtype).view(G, -1, K))

    limits = linear.MAX_ROWS, linear_sm90.MAX_ROWS
    linear.MAX_ROWS = linear_sm90.MAX_ROWS = 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K, G in FLASH:
        w, s = _fp8_weight(N, K, "cuda", g)
        copy_floor(f"copy_ of {name}'s bytes", 2 * N * K)
        us(f"dequant {name}", lambda: linear.dequant(w, s, torch.bfloat16), nbytes=3 * N * K,  # noqa: B023
           note=" (1 B read + 2 B written an element)")  # fmt: skip
        for T in (64, 128, 192, 256, 512, 1024, 2048, 4096):
            x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16)
            want = ref.grouped_linear(x, w, "fp8", s).float()
            forms = {
                "reference": lambda x=x: ref.grouped_linear(x, w, "fp8", s),  # noqa: B023
                "dequant": lambda x=x: dequantized(x, w, s),  # noqa: B023
                "sm90": lambda x=x: linear._grouped(x, w, s, sm90=True),  # noqa: B023
            }
            if T <= 1024:
                forms["dot"] = lambda x=x: linear._grouped(x, w, s, gemv=False, sm90=False)  # noqa: B023
            for form, fn in forms.items():
                err = float((fn().float() - want).norm() / want.norm())
                us(f"linear {name} T={T} {form}", fn, nbytes=N * K,
                   note=f" of weight bytes, rel diff vs reference {err:.1e}")  # fmt: skip
    linear.MAX_ROWS, linear_sm90.MAX_ROWS = limits
    experts = _moe_experts()
    for T in (64, 96, 128, 192, 256, 384, 512, 1024):
        x, weights, idx, nbytes = _moe_tokens(T, experts)
        want = ref.moe_experts(x, weights, idx, experts)
        for name, kw in (
            ("dot_scaled", dict(dot_scaled=True, gemv=False)),
            ("sm90", dict(sm90=True)),
        ):
            got = moe.moe_experts(x, weights, idx, experts, **kw)
            err = float((got - want).norm() / want.norm())
            us(f"moe T={T} {name}", lambda kw=kw: moe.moe_experts(x, weights, idx, experts, **kw),  # noqa: B023
               nbytes=nbytes, note=f" of expert bytes, rel err vs ref {err:.1e}")  # fmt: skip


@contextlib.contextmanager
def _pdl(on: bool):  # noqa: ANN202
    # programmatic dependent launch on / off in the ops that use it (bench-only switch)
    mods = (mhc, sparse_attn, indexer)
    saved = [m.pdl for m in mods]
    for m in mods:
        m.pdl = (lambda d: d.type == "cuda") if on else (lambda d: False)  # noqa: ARG005
    try:
        yield
    finally:
        for m, f in zip(mods, saved):
            m.pdl = f


def probe_pdl() -> None:
    # the dependent second (and third) kernels launched early and waiting in griddepcontrol.wait,
    # against plain stream order, same inputs, side by side
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, sc, base = hc_pre_params(g)
    attn = AttnDecode(g)
    cases = []
    for T in (1, 16, 64):
        x = torch.randn(T, 4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        cases.append((f"hc_pre T={T}", lambda x=x: mhc.hc_pre(x, fn, sc, base, 1e-6, 1e-6, 20)))
    for T in (1, 64):
        args = attn.tokens(T)
        cases.append((f"sparse_attn T={T} K=640", lambda a=args: sparse_attn.sparse_attn(*a, 0.04)))
    for T in (1, 16):
        args = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        cases.append((f"index_topk T={T} 128K paged", lambda a=args: indexer.index_topk(*a, 512)))
    for name, f in cases:
        for on in (False, True, False, True):  # twice each, interleaved: the run-to-run spread
            with _pdl(on):
                us(f"{name} pdl={'on' if on else 'off'}", f)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    # each lane of a one-warp program asks the TMA unit to bring CHUNK bytes into L2
    # (cp.async.bulk.prefetch.L2: no registers, no shared memory, nothing waits on it)
    offs = (tl.program_id(0) * 32 + tl.arange(0, 32)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32) // 16 * 16
    if EVICT_LAST:  # kept in L2 ahead of lines read once (the weight streams of other kernels)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; "
            "mov.u32 $0, 0; }",
            "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
            "mov.u32 $0, 0; }",
            "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


def l2_prefetch(t: torch.Tensor, chunk: int = 32 << 10, evict_last: bool = False) -> None:
    n = t.numel() * t.element_size()
    grid = (triton.cdiv(n, 32 * chunk),)
    _l2_prefetch_kernel[grid](
        t.view(torch.uint8).view(-1), n, CHUNK=chunk, EVICT_LAST=evict_last, num_warps=1
    )


@triton.jit
def _busy_kernel(p, NS: tl.constexpr):
    # one program that waits NS nanoseconds on the global timer: a stand-in for the latency-bound
    # kernels that run between two projections at batch 1 (HBM idle)
    t0 = globaltimer()
    t = t0
    while t - t0 < NS:
        t = globaltimer()
    tl.store(p, (t - t0).to(tl.int32))


def probe_l2_prefetch() -> None:
    # can a side stream fill L2 with a projection's weights while latency-bound kernels run, and
    # how fast is the projection then? (batch 1-16: HBM is idle most of a decode step)
    from dsv4.bench.cases_linear import FLASH, _fp8_weight
    from dsv4.ops import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def busy(ns: int) -> None:
        _busy_kernel[(1,)](flag, NS=ns)

    def fork(fn) -> None:  # noqa: ANN001
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            fn()

    def join() -> None:
        torch.cuda.current_stream().wait_stream(side)

    us("busy 20 us", lambda: busy(20000))
    for name, N, K, G in FLASH:
        if N * K < 16 << 20:
            continue
        w, s = _fp8_weight(N, K, "cuda", g)
        copy_floor(f"copy_ of {name}'s bytes", 2 * N * K)
        for ev in (False, True):
            us(
                f"l2_prefetch {name} 32 MB evict_last={ev}",
                lambda ev=ev: l2_prefetch(w, evict_last=ev),
                nbytes=N * K,
            )
        for T in (1, 16):
            x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16, generator=g)
            want = linear._grouped(x, w, s).float()

            def proj() -> torch.Tensor:
                return linear._grouped(x, w, s)  # noqa: B023

            def pre_proj(ev: bool) -> None:
                l2_prefetch(w, evict_last=ev)
                l2_prefetch(s, evict_last=ev)
                proj()

            def overlap(ev: bool) -> torch.Tensor:
                fork(lambda: (l2_prefetch(w, evict_last=ev), l2_prefetch(s, evict_last=ev)))
                busy(20000)
                join()
                return proj()

            def overlap_tail(ev: bool) -> torch.Tensor:  # prefetch and projection concurrent
                fork(lambda: (l2_prefetch(w, evict_last=ev), l2_prefetch(s, evict_last=ev)))
                out = proj()
                join()
                return out

            err = float((overlap(False).float() - want).norm() / want.norm())
            t0 = us(f"{name} T={T} cold", proj, nbytes=N * K)
            for ev in (False, True):
                us(
                    f"{name} T={T} prefetch then projection, one stream, ev={ev}",
                    lambda ev=ev: pre_proj(ev),
                )
            tb = us(f"{name} T={T} busy 20 us then projection", lambda: (busy(20000), proj()))
            for ev in (False, True):
                t1 = us(
                    f"{name} T={T} busy 20 us | side prefetch, then projection, ev={ev}",
                    lambda ev=ev: overlap(ev),
                    note=f" err {err:.1e}",
                )
                print(
                    f"    projection after busy: {tb - 20:.2f} -> {t1 - 20:.2f} us (cold {t0:.2f})"
                )
                us(
                    f"{name} T={T} prefetch beside the projection, ev={ev}",
                    lambda ev=ev: overlap_tail(ev),
                )

    # the routed experts at batch 1 (80 MB: more than half of L2): a prefetch of the 6 picked
    # experts beside the kernels, and ahead of them after a 20 us wait
    from dsv4.ops import moe

    experts = _moe_experts()
    x, weights, idx, nbytes = _moe_tokens(1, experts)
    picked = [experts[e] for e in idx.flatten().tolist()]
    tensors = [t for e in picked for m in (e.w1, e.w3, e.w2) for t in (m.weight, m.scale)]

    def experts_run() -> torch.Tensor:
        return moe.moe_experts(x, weights, idx, experts)

    def prefetch_all() -> None:
        for t in tensors:
            l2_prefetch(t)

    def beside() -> torch.Tensor:
        fork(prefetch_all)
        out = experts_run()
        join()
        return out

    def ahead() -> torch.Tensor:
        fork(prefetch_all)
        busy(20000)
        join()
        return experts_run()

    us("moe T=1 cold", experts_run, nbytes=nbytes)
    us("moe T=1 prefetch beside", beside, nbytes=nbytes)
    us("moe T=1 busy 20 us then experts", lambda: (busy(20000), experts_run()))
    us("moe T=1 busy 20 us | side prefetch, then experts", ahead)


@triton.jit
def _read_sum_kernel(ptr, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                     STAGES: tl.constexpr):  # fmt: skip
    # read STEPS * BLOCK contiguous int32 words (program p: the p-th such span) and sum them: a
    # weight stream with no decode and no math
    base = tl.program_id(0).to(tl.int64) * STEPS * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(0, STEPS, num_stages=STAGES):
        acc += tl.load(ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def probe_read_floor() -> None:
    # how fast can one kernel read a batch-1 weight stream (32 MB: wq_b / wo_a / wo_b; 80 MB: six
    # routed experts), cold and with the bytes in L2, against the projections and experts that read
    # them: is the GEMV form bound by the reads, or by its own work?
    from dsv4.bench.cases_linear import FLASH, _fp8_weight
    from dsv4.ops import linear, moe

    copy_floor("copy_ 128 MiB", 128 << 20)
    for mb in (32, 80):
        words = torch.ones(mb << 18, dtype=torch.int32, device="cuda")
        for block, steps, warps, stages in ((1024, 8, 4, 3), (2048, 8, 4, 3), (4096, 4, 8, 3),
                                            (4096, 8, 8, 3), (2048, 16, 4, 4), (4096, 16, 8, 4),
                                            (8192, 4, 8, 2), (1024, 32, 4, 4)):  # fmt: skip
            n = words.numel() // (block * steps)
            out = torch.empty(n, dtype=torch.int32, device="cuda")

            def run(src=words, out=out, n=n, b=block, s=steps, w=warps, st=stages) -> None:  # noqa: ANN001
                _read_sum_kernel[(n,)](src, out, STEPS=s, BLOCK=b, STAGES=st, num_warps=w)

            for mode, kw in MODES:
                us(f"read {mb} MB: {n} programs x {steps} x {block} words, {warps} warps, "
                   f"{stages} stages, {mode}", run, nbytes=mb << 20, **kw)  # fmt: skip
        del words
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K, G in FLASH:
        if N * K < 32 << 20:
            continue
        w, s = _fp8_weight(N, K, "cuda", g)
        x = torch.randn(1, G, K, device="cuda", dtype=torch.bfloat16)
        for mode, kw in MODES:
            us(f"linear {name} T=1 default, {mode}", lambda: linear._grouped(x, w, s),  # noqa: B023
               nbytes=N * K, **kw)  # fmt: skip
    experts = _moe_experts()
    x, weights, idx, nbytes = _moe_tokens(1, experts)
    for mode, kw in MODES:
        us(f"moe T=1 default, {mode}", lambda: moe.moe_experts(x, weights, idx, experts),
           nbytes=nbytes, **kw)  # fmt: skip
    # the issue's targets, L2 cleared by a memset (do_bench's way) and by a read
    attn = AttnDecode(g)
    for T in (1, 64):
        args = attn.tokens(T)
        for mode, kw in MODES[:2]:
            us(f"sparse_attn T={T} K=640, {mode}", lambda a=args: sparse_attn.sparse_attn(*a, 0.04),
               **kw)  # fmt: skip
    args = index_inputs(16, 64, 128, 32768, False, "cuda", True)
    for mode, kw in MODES[:2]:
        us(f"index_topk T=16 128K paged, {mode}", lambda a=args: indexer.index_topk(*a, 512), **kw)


def _indexer_variant(name: str, drop: tuple[str, ...], subs: tuple[tuple[str, str], ...] = ()):  # noqa: ANN202
    # dsv4/ops/indexer.py with the given source lines replaced by `pass` (or by subs), imported as
    # a module of its own (Triton compiles kernels from their file's source)
    import importlib.util
    import pathlib

    src = pathlib.Path(indexer.__file__).read_text()
    for line, by in [(d, "pass") for d in drop] + list(subs):
        assert line in src, f"not in indexer.py: {line}"
        src = src.replace(line, by)
    path = pathlib.Path(__file__).parent / f"_indexer_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"_indexer_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe_count_cost() -> None:
    # what the hist select's counting costs the score kernel at 128K: scores alone, with both
    # histograms, without the fine bins' global atomics, without the coarse tl.histogram; and the
    # coarse width (16 / 64 / 256 bins: the score kernel's tl.histogram against the select's scan)
    fine_line = 'tl.atomic_add(fine, 1, mask=vis, sem="relaxed")'
    coarse_line = "coarse += tl.histogram((u >> COARSE_SHIFT).to(tl.int32), COARSE_BINS, mask=vis)"
    width = "COARSE_BINS = tl.constexpr(64)"
    variants = {
        "both": indexer,
        "coarse only": _indexer_variant("nofine", (fine_line,)),
        "fine only": _indexer_variant("nocoarse", (coarse_line,)),
        "both, 16 coarse bins": _indexer_variant(
            "c16", (), ((width, "COARSE_BINS = tl.constexpr(16)"),)
        ),
        "both, 256 coarse bins": _indexer_variant(
            "c256", (), ((width, "COARSE_BINS = tl.constexpr(256)"),)
        ),
    }
    for T in (1, 16):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        nbytes = T * 32768 * 128 * 2
        us(f"count T={T}: scores alone", lambda: indexer._scores(q, w, keys, cand), nbytes=nbytes)  # noqa: B023
        want = indexer.index_topk(q, w, keys, cand, 512, select="levels").sort(-1).values
        for label, mod in variants.items():
            fine, coarse, counts = mod._hist_workspace(torch.device("cuda"))
            us(
                f"count T={T}: scores + counts, {label}",
                lambda m=mod, f=fine, c=coarse: m._scores(q, w, keys, cand, hist=(f, c)),  # noqa: B023
                nbytes=nbytes,
            )
            for ws in (fine, coarse, counts):
                ws.zero_()
            if label in ("coarse only", "fine only"):
                continue
            got = mod.index_topk(q, w, keys, cand, 512, sort=False)
            print(f"  {label}: the same set as levels: {bool((got.sort(-1).values == want).all())}")
            us(
                f"count T={T}: index_topk unsorted, {label}",
                lambda m=mod: m.index_topk(q, w, keys, cand, 512, sort=False),
                nbytes=nbytes,
            )  # noqa: B023


def probe_tail_sweep() -> None:
    # the hist select after the scores at T=16 / 8, 128K, unsorted (the model's form): keys per
    # select program, warps, and launching it early (PDL), all against the levels select's set
    fine, coarse, _ = indexer._hist_workspace(torch.device("cuda"))
    for T in (16, 8):
        q, w, keys, cand = index_inputs(T, 64, 128, 32768, False, "cuda", True)
        want = indexer.index_topk(q, w, keys, cand, 512, select="levels").sort(-1).values
        out = torch.empty(T, 512, dtype=torch.int64, device="cuda")
        us(
            f"tail T={T}: index_topk unsorted (default)",
            lambda: indexer.index_topk(q, w, keys, cand, 512, sort=False),
        )  # noqa: B023
        for seg in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                for early in (False, True):

                    def run(s=seg, n=warps, e=early) -> None:
                        sk = indexer._scores(q, w, keys, cand, hist=(fine, coarse))  # noqa: B023
                        indexer._hist_select(sk, out, s, n, early=e, sort=False)  # noqa: B023

                    run()
                    same = bool((out.sort(-1).values == want).all())
                    us(f"tail T={T}: segment {seg}, {warps} warps, early {early}, same {same}", run)


def probe_step_indexer() -> None:
    # the indexer's inputs of a real bench step (Flash width, random weights, batch 16 at 128K,
    # the state as `bench step` fills it): captured from the model's call, then index_topk on them
    # (unsorted, as the model) with 64 coarse bins (now) and 256 (before), against the bench ops
    # case of the same shape; with the scores' spread (fine bins in use, the threshold bin's count)
    from dsv4.bench import step as bstep
    from dsv4.bench.weights import fill_state_
    from dsv4.state import Batch, DecodeState

    a = bstep.parse_args(["--preset", "flash", "--ops", "triton", "--layers", "sliding,csa,hca",
                          "--batch", "16", "--context", "131072", "--prefill", "0"])  # fmt: skip
    bench = bstep.Bench(a)
    batch, context = 16, 131072
    state = DecodeState(bench.args, batch, context + 1, bench.dtype, bench.device)
    fill_state_(state, 0)
    ids = torch.randint(0, bench.args.vocab_size, (batch,), device="cuda")
    captured = []
    for layer in bench.model.layers:
        ops = getattr(getattr(getattr(layer, "attn", None), "indexer", None), "ops", None)
        if ops is None:
            continue
        inner = ops.index_topk

        def grab(*args, inner=inner, **kw):  # noqa: ANN002, ANN003, ANN202
            captured.append((tuple(t.clone() if torch.is_tensor(t) else t for t in args), kw))
            return inner(*args, **kw)

        ops.index_topk = grab
    with torch.no_grad():
        b = Batch.build(list(range(batch)), [context] * batch, [1] * batch, state)
        b.prepare(bench.args)
        bench.model(ids, b, state)
    for layer in bench.model.layers:
        ops = getattr(getattr(getattr(layer, "attn", None), "indexer", None), "ops", None)
        if ops is not None:
            ops.index_topk = indexer.index_topk
    assert captured, "no indexer call captured"
    args, kw = captured[0]
    q, w, keys, cand = args[:4]
    print(f"step indexer inputs: q {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)}, "
          f"cand {tuple(cand.shape)} ({int((cand >= 0).sum(1).min())}..{int((cand >= 0).sum(1).max())} "
          f"visible), topk {args[4]}, key_scale {args[5] is not None}, scale {args[6]}, {kw}")  # fmt: skip
    skey = indexer._scores(q, w, keys, cand, weight_scale=args[6])
    u = (skey.to(torch.int64) + 2**31) >> 16
    vis = cand >= 0
    for t in (0, 15):
        ut = u[t][vis[t]]
        kth = ut.sort(descending=True).values[args[4] - 1]
        print(f"  token {t}: {int(ut.unique().numel())} fine bins in use, threshold bin holds "
              f"{int((ut == kth).sum())}, scores {float(skey[t][vis[t]].float().std()):.3g} (keys)")  # fmt: skip
    c256 = _indexer_variant(
        "c256", (), (("COARSE_BINS = tl.constexpr(64)", "COARSE_BINS = tl.constexpr(256)"),)
    )
    want = indexer.index_topk(*args, **kw).sort(-1).values
    for label, mod in (("64 coarse bins", indexer), ("256 coarse bins", c256)):
        got = mod.index_topk(*args, **kw).sort(-1).values
        print(f"  {label}: the same set: {bool((got == want).all())}")
        us(
            f"step inputs T=16: index_topk unsorted, {label}",
            lambda m=mod: m.index_topk(*args, **kw),
        )
    qb, wb, kb, cb = index_inputs(16, 64, 128, cand.shape[1], False, "cuda", True)
    for label, mod in (("64 coarse bins", indexer), ("256 coarse bins", c256)):
        us(f"bench inputs T=16 C={cand.shape[1]}: index_topk unsorted, {label}",
           lambda m=mod: m.index_topk(qb, wb, kb, cb, 512, sort=False))  # fmt: skip


MODES = (("cold", {}), ("cold, clean L2", {"clean": True}), ("warm", {"cold": False}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--only", default="floors,mhc,attn,indexer,select")
    ns = p.parse_args()
    parts = {"floors": floors, "mhc": probe_mhc, "attn": probe_attn, "indexer": probe_indexer,
             "select": probe_select, "select_small": probe_select_small, "gate": probe_gate, "topk": probe_topk, "phases": probe_phases,
             "combine": probe_combine, "linear": probe_linear, "rows": probe_rows, "pdl": probe_pdl,
             "mhc_splits": probe_mhc_splits, "mhc_norm": probe_mhc_norm, "prep": probe_prep, "bound": probe_bound, "post_pre": probe_post_pre, "sinkhorn": probe_sinkhorn,
             "attn_tiles": probe_attn_tiles, "attn_sm90": probe_attn_sm90, "attn_fixup": probe_attn_fixup, "attn_fp8_fixup": probe_attn_fp8_fixup, "gather": probe_gather, "attn_tlb": probe_attn_tlb, "score_programs": probe_score_programs, "index_floor": probe_index_floor, "tma_gather": probe_tma_gather, "tma_swizzle": probe_tma_swizzle, "bulk_gather": probe_bulk_gather, "moe": probe_moe, "hist_tail": probe_hist_tail, "select_sweep": probe_select_sweep, "select_big": probe_select_big, "moe_tiles": probe_moe_tiles, "moe_gemv": probe_moe_gemv, "moe_sm90": probe_moe_sm90, "moe_decode": probe_moe_decode, "moe_prefill": probe_moe_prefill, "moe_big": probe_moe_big, "moe_ws": probe_moe_ws, "linear_sm90": probe_linear_sm90, "attn_fp8": probe_attn_fp8, "index_fp8": probe_index_fp8, "small_shared": probe_small_shared, "l2_prefetch": probe_l2_prefetch, "read_floor": probe_read_floor, "count_cost": probe_count_cost, "tail_sweep": probe_tail_sweep, "step_indexer": probe_step_indexer, "gather_runs": probe_gather_runs}  # fmt: skip
    for name in ns.only.split(","):
        parts[name]()
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
