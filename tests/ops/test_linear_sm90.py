"""The Gluon FP8 projection kernel for sm_90 (`dsv4.ops.linear_sm90`): on the CPU, the decode's
inline PTX run by a small interpreter against the e4m3 codes times their block scale; on an sm_90
GPU, every weight read back bit for bit and the kernel against the fp32 products at Flash shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4 import quant
from dsv4.ops import linear, linear_sm90, ref

from .ptx import bf16_bits_to_float, run_ptx
from .test_linear import _fp8, _rel

# ---------------------------------------------------------------------------------------------
# CPU: the decode's PTX
# ---------------------------------------------------------------------------------------------


def _decoded(pairs: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    # the kernel's decode of 16-bit code pairs (column k low byte) at UE8M0 scale s -> the two
    # weights as float64 (low, high half), from the PTX interpreter: up to SCALE_MAX one multiply
    # by 2^(s - 7), above it the second form with the rest 2^(s - s_in) (as the kernel picks)
    s_in = min(s, linear_sm90.SCALE_MAX)

    def exp2(e: int) -> np.ndarray:
        return np.full(pairs.shape, ((e + 127) << 7) | ((e + 127) << 23), dtype=np.uint32)

    # the operands as the kernel binds them (pack=2: each int32 operand is two registers)
    f, f2 = exp2(s_in - 7), exp2(s - s_in)
    regs = {"$1": pairs.astype(np.uint32), "$2": f, "$3": f, "$4": f2, "$5": f2}
    out = run_ptx(linear_sm90._decode_asm(two=s != s_in), regs)["$0"]
    return bf16_bits_to_float(out & 0xFFFF), bf16_bits_to_float(out >> 16)


def _want(codes: np.ndarray, s: int) -> np.ndarray:
    # the reference's dequantized bf16 weight: e4m3 code times 2^(s - 127), rounded to bf16
    v = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double()
    return (v * 2.0 ** (s - 127)).float().bfloat16().double().numpy()


# every pair of non-NaN codes (the e4m3fn NaNs 0x7F / 0xFF excluded)
_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint32)
_PAIRS = (_CODES[:, None] | (_CODES[None, ::-1] << 8)).reshape(-1)


@pytest.mark.parametrize(
    "s", [0, 1, 2, 3, 60, 115, 127, linear_sm90.SCALE_MAX, linear_sm90.SCALE_MAX + 1, 200, 254]
)
def test_decode_ptx_is_the_dequantized_weight(s: int) -> None:
    # every code pair at small scales (bf16 subnormals, rounded), the usual ones, and above
    # SCALE_MAX (up to inf): the reference's bf16 weight bit for bit
    lo, hi = _decoded(_PAIRS, s)
    assert np.array_equal(lo, _want(_PAIRS & 0xFF, s))
    assert np.array_equal(hi, _want(_PAIRS >> 8, s))


def test_one_multiply_ends_at_scale_max() -> None:
    # above SCALE_MAX the one-multiply form fails (its factor is no bf16): the kernel takes the
    # second form there
    s = linear_sm90.SCALE_MAX + 1
    f = ((s - 7 + 127) << 7) | ((s - 7 + 127) << 23)
    fs = np.full(_PAIRS.shape, f, dtype=np.uint32)
    regs = {"$1": _PAIRS, "$2": fs, "$3": fs}
    out = run_ptx(linear_sm90._decode_asm(), regs)["$0"]
    assert not np.array_equal(bf16_bits_to_float(out & 0xFFFF), _want(_PAIRS & 0xFF, s))


def test_not_on_cpu() -> None:
    # the default never picks it off an sm_90 GPU; asking for it there is an error naming why
    wq, s = _fp8(128, 256)
    x = torch.randn(4, 1, 256).to(torch.bfloat16)
    assert not linear_sm90.supported(x, wq, 1)
    with pytest.raises(AssertionError, match="sm90 linear"):
        linear._grouped(x, wq, s, sm90=True)


# ---------------------------------------------------------------------------------------------
# GPU (sm_90)
# ---------------------------------------------------------------------------------------------


def _needs_sm90() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
def test_gpu_every_weight_read_back() -> None:
    # one-hot rows of x read columns of W back: each output is one weight times its block scale,
    # which must be the reference's bf16 weight bit for bit, for every code and scales 0..246
    # (both decode forms)
    _needs_sm90()
    N, K = 256, 512
    g = torch.Generator().manual_seed(3)
    codes = torch.from_numpy(_CODES.astype(np.uint8))[
        torch.randint(0, len(_CODES), (N, K), generator=g)
    ]
    codes[:2] = torch.from_numpy(_CODES.astype(np.uint8)).repeat(K // len(_CODES) + 1)[:K]
    # scales 0..246, above SCALE_MAX the second form (from 247 the largest codes overflow bf16,
    # and the one-hot sums' 0 * inf are NaN on both sides)
    scale = torch.randint(0, 247, (N // 128, K // 128), generator=g, dtype=torch.uint8)
    scale[0, :4] = torch.tensor([0, 3, linear_sm90.SCALE_MAX, 246])
    scale[1, :4] = torch.tensor([2, 60, 127, 135])
    # W as the reference's bf16 dequantization makes it (on the CPU: exact, subnormals kept)
    want = quant.dequant_fp8(codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    want = want.bfloat16().float()
    wq = codes.view(torch.float8_e4m3fn).cuda()
    s = scale.view(torch.float8_e8m0fnu).cuda()
    got = torch.empty(N, K)
    for k0 in range(0, K, 64):
        x = torch.zeros(64, 1, K, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(64), 0, k0 + torch.arange(64)] = 1.0
        got[:, k0 : k0 + 64] = linear._grouped(x, wq, s, sm90=True)[:, 0].float().T.cpu()
    bad = []
    for rb in range(N // 128):
        for kb in range(K // 128):
            blk = (slice(rb * 128, rb * 128 + 128), slice(kb * 128, kb * 128 + 128))
            diff = got[blk] != want[blk]
            if diff.any():  # (row block, column block, scale, weights off, largest |weight| off)
                bad.append((rb, kb, int(scale[rb, kb]), int(diff.sum()),
                            float(want[blk][diff].abs().max())))  # fmt: skip
    assert not bad, f"blocks not read back: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 3, 8, 9, 16, 33, 64, 130, 256])
@pytest.mark.parametrize(
    "N,K,G", [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (4096, 8192, 1), (8192, 4096, 8)]
)
def test_gpu_flash_shapes(T: int, N: int, K: int, G: int) -> None:
    # wq_a, wq_b, wkv, wo_b and the grouped wo_a (split-K on the narrow ones), against the fp32
    # products: the bf16 outputs sit within bf16 rounding of them
    _needs_sm90()
    wq, s = _fp8(N, K, device="cuda", seed=T)
    x = torch.randn(T, G, K, device="cuda").to(torch.bfloat16)
    y = linear._grouped(x, wq, s, sm90=True)
    R = N // G
    exact = torch.stack(
        [ref.linear(x[:, gi].float(), wq[gi * R : (gi + 1) * R], "fp8", s[gi * R // 128 : (gi + 1) * R // 128]) for gi in range(G)],
        dim=1,
    )  # fmt: skip
    assert y.shape == (T, G, R) and y.dtype == torch.bfloat16
    assert _rel(y, exact) < 5e-3
    # each output: the bf16 rounding of the fp32 sum (half an ulp, 2^-9 relative) plus the fp32
    # summation order's error, bounded by a small multiple of the sum of |x_k w_k|
    w_abs = (wq.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    mag = torch.stack(
        [ref.linear(x[:, gi].float().abs(), w_abs[gi * R : (gi + 1) * R], "fp8", s[gi * R // 128 : (gi + 1) * R // 128]) for gi in range(G)],
        dim=1,
    )  # fmt: skip
    assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + mag * 2**-16).all()


@pytest.mark.gpu
def test_gpu_dispatch_and_repeats() -> None:
    # weights from MIN_WEIGHT_BYTES take the kernel by default at 1..MAX_ROWS rows, smaller ones the
    # Triton forms up to 64 rows and the kernel past them; split launches back to back (a
    # 4096-row weight: 64 row tiles, K split) reset their counts
    _needs_sm90()
    seen = []
    kernel = linear_sm90._fp8_linear_kernel

    class Spy:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            seen.append(grid)
            return kernel[grid]

    wq, s = _fp8(4096, 4096, device="cuda", seed=6)
    assert wq.numel() == linear_sm90.MIN_WEIGHT_BYTES
    small, s_small = _fp8(1024, 4096, device="cuda", seed=7)
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    linear_sm90._fp8_linear_kernel = Spy()
    try:
        first = linear.linear(x, wq, "fp8", s)
        assert len(seen) == 1 and seen[0][2] > 1  # K split
        linear.linear(x[:1], wq, "fp8", s)
        assert len(seen) == 2
        linear.linear(x, small, "fp8", s_small)
        assert len(seen) == 2
        wide = torch.randn(130, 4096, device="cuda").to(torch.bfloat16)  # a verify step's rows
        got = linear.linear(wide, wq, "fp8", s)
        assert _rel(got, ref.linear(wide.float(), wq, "fp8", s)) < 5e-3
        assert len(seen) == 3 and seen[2][1] == 3  # three 64-row tiles
        # past one tile (the Triton form's MAX_ROWS) the small weights too, up to its MAX_ROWS
        got = linear.linear(wide, small, "fp8", s_small)
        assert _rel(got, ref.linear(wide.float(), small, "fp8", s_small)) < 5e-3
        assert linear.MAX_ROWS < 130 and len(seen) == 4
        most = torch.randn(linear_sm90.MAX_ROWS, 4096, device="cuda").bfloat16()
        linear.linear(most, wq, "fp8", s)
        assert len(seen) == 5
        linear.linear(torch.cat([most, most[:1]]), wq, "fp8", s)
        assert len(seen) == 5  # past its MAX_ROWS: dequant + cuBLAS
        outs = [linear.linear(x, wq, "fp8", s) for _ in range(100)]
    finally:
        linear_sm90._fp8_linear_kernel = kernel
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs)
    assert int(linear._tile_counters(x.device).abs().sum()) == 0
    assert _rel(first, ref.linear(x.float(), wq, "fp8", s)) < 5e-3
