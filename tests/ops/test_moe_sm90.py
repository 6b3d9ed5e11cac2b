"""The Gluon experts kernels for sm_90 (`dsv4.ops.moe_sm90`): on the CPU, the column permutations
and the decode's inline PTX run by a small interpreter against the reference dequantization; on
an sm_90 GPU, the kernels against `dsv4.ops.ref.moe_experts` and the weights read back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4 import quant
from dsv4.ops import moe, moe_sm90, ref

from .ptx import bf16_bits_to_float, run_ptx
from .test_moe import _experts, _rel, _routing

# ---------------------------------------------------------------------------------------------
# CPU: the column order and the decode's PTX
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_k", [64, 256])
def test_permuted_columns(block_k: int) -> None:
    # permute_columns moves column c to permuted_column(c); code plane i of word w meets column
    # 8w + i at i * block_k / 8 + w
    K = 3 * block_k
    x = torch.arange(2 * K, dtype=torch.float32).view(2, K)
    xp = moe_sm90.permute_columns(x, block_k)
    c = torch.arange(K)
    assert torch.equal(xp[:, moe_sm90.permuted_column(c, block_k)], x)
    w, i = 5, 3
    assert xp[0, block_k + i * (block_k // 8) + w] == x[0, block_k + 8 * w + i]


def test_decode_ptx_is_the_reference_dequantization() -> None:
    # every pair of codes at every plane, every scale group of a step, over the scales the kernel
    # takes: code plane i of words (w, w+1) times 2^(S - 64) must be the MXFP4 weight times 2^-63,
    # bit for bit
    rng = np.random.default_rng(0)
    n = 4096
    words = rng.integers(0, 2**32, size=(n, 2), dtype=np.uint64).astype(np.uint32)
    words[:256, 0] = np.arange(256, dtype=np.uint32) * 0x11111111 & 0xFFFFFFFF  # repeated nibbles
    words[:256, 1] = (np.arange(256, dtype=np.uint32) * 0x01234567) & 0xFFFFFFFF
    # a row's 8 scale bytes of the step (groups 0-7) and the group of this word pair
    scales = rng.integers(moe_sm90.SCALE_MIN, moe_sm90.SCALE_MAX + 1, size=(n, 8), dtype=np.uint8)
    scales[0, :2] = moe_sm90.SCALE_MIN, moe_sm90.SCALE_MAX
    group = rng.integers(0, 8, size=n).astype(np.uint32)
    group[:16] = np.arange(16) % 8
    biased = scales.view(np.uint32) + np.uint32(0x3F3F3F3F)  # [n, 2]: + 63 per byte (the kernel)
    env = run_ptx(
        moe_sm90._decode_asm(),
        {"$8": words[:, 0], "$9": words[:, 1], "$10": biased[:, 0], "$12": biased[:, 1],
         "$14": group * np.uint32(0x1111)},
    )  # fmt: skip
    # the reference: the packed bytes of both words as one row each, dequantized by quant
    packed = torch.from_numpy(words.view(np.uint8).reshape(n, 2, 4).copy()).view(torch.int8)
    s = scales[np.arange(n), group]
    scale = torch.from_numpy(s.copy()).view(torch.float8_e8m0fnu)
    for word in range(2):
        w = quant.dequant_mxfp4(packed[:, word].repeat(1, 4), scale[:, None]).double()  # [n, 32]
        for i in range(8):
            half = (env[f"${i}"] >> (16 * word)) & 0xFFFF
            got = torch.from_numpy(bf16_bits_to_float(half))
            want = w[:, i] * 2.0**-63
            assert torch.equal(got, want), f"plane {i}, word {word}: {got[:4]} vs {want[:4]}"


def test_scales_in_range_notices_writes() -> None:
    # the check is cached per expert set and redone after an in-place write to the scales (the
    # version counters of the first / last expert's scales), as after a checkpoint load
    experts = _experts(64, 32, 3, seed=1)
    assert moe_sm90.scales_in_range(experts)
    last = experts[-1].w2.scale.view(torch.uint8)
    keep = int(last[0, 0])
    last[0, 0] = moe_sm90.SCALE_MAX + 1
    assert not moe_sm90.scales_in_range(experts)
    last[0, 0] = moe_sm90.SCALE_MIN - 1
    assert not moe_sm90.scales_in_range(experts)
    last[0, 0] = keep
    assert moe_sm90.scales_in_range(experts)


def test_not_on_cpu() -> None:
    # not by default on the CPU, and asked for there a clear error rather than a launch
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    assert not moe_sm90.supported(x, 512, 256, 16)
    experts = _experts(512, 256, 3, seed=2)
    weights, idx = _routing(2, 2, 3, False)
    with pytest.raises(AssertionError, match="sm_90 GPU"):
        moe.moe_experts(x, weights, idx, experts, sm90=True)


# ---------------------------------------------------------------------------------------------
# GPU (sm_90)
# ---------------------------------------------------------------------------------------------


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")


@pytest.mark.gpu
@needs_sm90
def test_gpu_down_reads_every_weight_back() -> None:
    # h = one-hot rows: each pair's output is one column of W2 (times 1), exact in bf16, for
    # random codes and scales spanning [SCALE_MIN, SCALE_MAX] (the 0.5 code is a bf16 subnormal
    # before its scale)
    D, I, E = 512, 256, 3  # noqa: E741
    experts = _experts(D, I, E, seed=5, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for ex in experts:
        ex.w2.weight.copy_(torch.randint(-128, 128, ex.w2.weight.shape, generator=g, device="cuda",
                                         dtype=torch.int8))  # fmt: skip
        s = torch.randint(moe_sm90.SCALE_MIN, moe_sm90.SCALE_MAX + 1, ex.w2.scale.shape,
                          generator=g, device="cuda", dtype=torch.int32)  # fmt: skip
        s[0, :2] = torch.tensor([moe_sm90.SCALE_MIN, moe_sm90.SCALE_MAX])
        ex.w2.scale.view(torch.uint8).copy_(s.to(torch.uint8))
    table = moe.expert_table(experts)
    P = I  # pair p: expert p % E, one-hot at column p
    idx = (torch.arange(P, device="cuda") % E)[:, None]
    rows, blk = moe.align_rows(idx, E, moe_sm90.block_m(idx.numel()))
    h = torch.eye(I, device="cuda", dtype=torch.bfloat16)
    out = moe_sm90.down(
        moe_sm90.permute_columns(h, moe_sm90.CONFIG["BLOCK_K"]), rows, blk, table, D
    )
    for e, ex in enumerate(experts):
        w = quant.dequant_mxfp4(ex.w2.weight, ex.w2.scale).float()  # [D, I]
        cols = torch.arange(e, P, E, device="cuda")
        got = out[cols].float()
        want = w[:, cols].t()
        assert torch.equal(got, want), f"expert {e}: {(got - want).abs().max()}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("skew", [False, True])
def test_gpu_ragged_and_skewed(skew: bool) -> None:
    # experts with more pairs than one row-block (skew), padding rows, unused experts, the limit
    D, I, E, k, T = 512, 256, 9, 3, 40  # noqa: E741
    experts = _experts(D, I, E, seed=3, device="cuda")
    weights, idx = _routing(T, k, E, skew, seed=T)
    x = (torch.randn(T, D, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    x, weights, idx = x.cuda(), weights.cuda(), idx.cuda()
    y = moe.moe_experts(x, weights, idx, experts, sm90=True)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < 1e-2, _rel(y, want)


@pytest.mark.gpu
@needs_sm90
def test_gpu_dispatch_and_out_of_range_scales() -> None:
    # by default the sm90 kernels run where they apply; one scale outside [SCALE_MIN, SCALE_MAX]
    # sends the expert set to the Triton kernels (same results)
    D, I, E, k, T = 512, 256, 4, 2, 30  # noqa: E741
    experts = _experts(D, I, E, seed=7, device="cuda")
    weights, idx = _routing(T, k, E, False, seed=2)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    weights, idx = weights.cuda(), idx.cuda()
    assert moe_sm90.scales_in_range(experts)
    y = moe.moe_experts(x, weights, idx, experts)
    assert torch.equal(y, moe.moe_experts(x, weights, idx, experts, sm90=True))
    # written in place (as a checkpoint load would): noticed without clearing the cache
    experts[-1].w2.scale.view(torch.uint8)[0, 0] = moe_sm90.SCALE_MAX + 1
    assert not moe_sm90.scales_in_range(experts)
    y = moe.moe_experts(x, weights, idx, experts)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < 1e-2, _rel(y, want)


def test_row_blocks_by_pair_count() -> None:
    # CONFIG's blocks at decode batches, wider ones for prefill chunks, up to MAX_PAIRS
    assert moe_sm90.block_m(moe_sm90.MIN_PAIRS) == moe_sm90.CONFIG["BLOCK_M"] == 8
    assert moe_sm90.block_m(2048) == 8 and moe_sm90.block_m(2049) == 16
    assert moe_sm90.block_m(3072) == 16 and moe_sm90.block_m(3073) == 32
    assert moe_sm90.block_m(6144) == 32 and moe_sm90.block_m(6145) == 64
    assert moe_sm90.block_m(16384) == 64 and moe_sm90.block_m(16385) == 128
    assert moe_sm90.block_m(moe_sm90.MAX_PAIRS) == 128 >= moe_sm90.WIDE_MIN


@pytest.mark.gpu
@needs_sm90
def test_gpu_verify_step_pairs_take_the_kernel(monkeypatch) -> None:  # noqa: ANN001
    # verify steps of speculative decoding (batch 64 with 1-3 drafts, k=6: 768-1536 pairs) and
    # prefill chunks up to MAX_PAIRS take the sm90 kernels by default, in row-blocks of 8, 16, 32,
    # 64 and 128 pairs (the last two on WIDE tiles), and match the reference; past MAX_PAIRS the
    # Triton kernels
    D, I, E, k = 512, 256, 16, 6  # noqa: E741
    experts = _experts(D, I, E, seed=5, device="cuda")
    calls = []
    kernel = moe_sm90.experts
    monkeypatch.setattr(moe_sm90, "experts", lambda *a: calls.append(a) or kernel(*a))
    sizes = (128, 3072 // k, 6144 // k, 16384 // k, moe_sm90.MAX_PAIRS // k)
    for T in sizes:
        weights, idx = _routing(T, k, E, False, seed=T)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
        y = moe.moe_experts(x, weights.cuda(), idx.cuda(), experts)
        want = ref.moe_experts(x, weights.cuda(), idx.cuda(), experts)
        assert _rel(y, want) < 1e-2, (T, _rel(y, want))
    widths = [a[2].numel() // a[3].numel() for a in calls]  # rows / blocks
    assert widths == [8, 16, 32, 64, 128]
    T = moe_sm90.MAX_PAIRS // k + 1
    weights, idx = _routing(T, k, E, False, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
    moe.moe_experts(x, weights.cuda(), idx.cuda(), experts)
    assert len(calls) == len(sizes)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("T", [1100, 2800])  # row-blocks of 64 and of 128 pairs
def test_gpu_warp_specialized_over_many_steps(T: int, monkeypatch) -> None:  # noqa: ANN001
    # the warp-specialised kernel (WIDE row-blocks) over 8-16 steps of 4 buffers, so its
    # barriers' phases wrap several times: against the reference; against the one-partition
    # kernel's WIDE tiles (BLOCK_K 256) at its own default tiles (BLOCK_K 128: another summation
    # order) and, at BLOCK_K 256 on 2 buffers, bit for bit
    D, I, E, k = 2048, 1024, 16, 6  # noqa: E741
    experts = _experts(D, I, E, seed=11, device="cuda")
    weights, idx = _routing(T, k, E, False, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
    weights, idx = weights.cuda(), idx.cuda()
    bm = moe_sm90.block_m(T * k)
    assert bm >= moe_sm90.WIDE_MIN and "LOAD_WARPS" in moe_sm90._tiles(bm, I)
    y = moe.moe_experts(x, weights, idx, experts, sm90=True)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < 1e-2, _rel(y, want)
    monkeypatch.setattr(moe_sm90, "WARP_SPECIALIZED", False)
    wide = moe.moe_experts(x, weights, idx, experts, sm90=True)
    assert _rel(y, wide) < 5e-3, _rel(y, wide)
    monkeypatch.setattr(moe_sm90, "WARP_SPECIALIZED", True)
    monkeypatch.setattr(moe_sm90, "WS", {**moe_sm90.WS, "BLOCK_K": 256, "NUM_BUF": 2,
                                         "BOTH_MAX_M": 0})  # fmt: skip
    assert torch.equal(moe.moe_experts(x, weights, idx, experts, sm90=True), wide)
