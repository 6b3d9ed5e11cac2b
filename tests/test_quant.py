"""Tests for dsv4.quant: exact round trips, error bounds, independent numpy decoders, bad inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dsv4.quant import (
    E2M1_VALUES,
    FP8_BLOCK,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequant_fp8,
    dequant_mxfp4,
    dequant_nvfp4,
    e8m0_to_float,
    fp8_scale_shape,
    mxfp4_to_fp8,
    pack_fp4,
    quant_fp8,
    quant_mxfp4,
    quant_nvfp4,
    unpack_fp4,
)

E2M1_PY = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# ---------------------------------------------------------------------------------------------
# independent numpy decoders (bit manipulation, no torch fp8 casts)
# ---------------------------------------------------------------------------------------------


def np_e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    # bias 7; exponent field 0 = subnormal 2^-6 * m/8
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return (sign * mag).astype(np.float32)


def np_e8m0(s: np.ndarray) -> np.ndarray:
    return (2.0 ** (s.astype(np.float64) - 127)).astype(np.float32)  # 2^-127 is an fp32 subnormal


def np_nibbles(b: np.ndarray) -> np.ndarray:
    # [out, in/2] bytes -> fp32 [out, in], low nibble = even element
    b = b.astype(np.uint8)
    lut = np.array(E2M1_PY, dtype=np.float32)
    out = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.float32)
    out[:, 0::2] = lut[b & 0x0F]
    out[:, 1::2] = lut[b >> 4]
    return out


def expand(s: np.ndarray, br: int, bc: int, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return a.astype(np.float32).view(np.uint32)


def u8(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.uint8).numpy()


def rand_e4m3_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    r = rng.integers(0, 254, size=shape)  # 254 values: all bytes but the nans 0x7F, 0xFF
    return (r + (r >= 0x7F)).astype(np.uint8)


def t_e4m3(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn)


def t_e8m0(s: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(s.astype(np.uint8)).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------
# scales / nibbles
# ---------------------------------------------------------------------------------------------


def test_e8m0_to_float_all_codes():
    s = np.arange(256, dtype=np.uint8)
    got = e8m0_to_float(t_e8m0(s))
    assert got.dtype == torch.float32
    assert np.isnan(got[255].item())
    np.testing.assert_array_equal(bits(got[:255]), bits(np_e8m0(s[:255])))
    assert got[0].item() == 2.0**-127 and got[127].item() == 1.0 and got[254].item() == 2.0**127


def test_e2m1_values_table():
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    np.testing.assert_array_equal(bits(E2M1_VALUES), bits(np.array(E2M1_PY)))


def test_fp8_scale_shape():
    assert fp8_scale_shape(200, 300) == (2, 3)
    assert fp8_scale_shape(128, 256) == (1, 2)
    assert fp8_scale_shape(1, 129) == (1, 2)


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)
    rng = np.random.default_rng(0)
    c = torch.from_numpy(rng.integers(0, 16, size=(5, 64), dtype=np.uint8))
    assert torch.equal(unpack_fp4(pack_fp4(c)), c)


def test_mxfp4_nibble_order_0x21():
    packed = torch.zeros(1, MXFP4_BLOCK // 2, dtype=torch.int8)
    packed[0, 0] = 0x21
    w = dequant_mxfp4(packed, t_e8m0(np.array([[128]])))  # scale 2
    assert w[0, :2].tolist() == [1.0, 2.0]  # low nibble (0.5) first, then high (1.0)
    assert not w[0, 2:].any()


def test_nvfp4_nibble_order_0x21():
    packed = torch.zeros(1, NVFP4_BLOCK // 2, dtype=torch.uint8)
    packed[0, 0] = 0x21
    ws = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    w = dequant_nvfp4(packed, ws, torch.tensor(0.25))
    assert w[0, :2].tolist() == [0.25, 0.5]
    assert not w[0, 2:].any()


# ---------------------------------------------------------------------------------------------
# exact round trips from representable values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(200, 300), (256, 128), (1, 1), (129, 5)])
def test_fp8_roundtrip_exact(shape):
    rng = np.random.default_rng(1)
    q = rand_e4m3_bytes(rng, shape)
    ts = fp8_scale_shape(*shape)
    s = rng.integers(127 - 10, 127 + 11, size=ts).astype(np.uint8)
    # one +-448 per tile so the quantizer must pick back the same power-of-two scale
    for i in range(ts[0]):
        for j in range(ts[1]):
            q[i * FP8_BLOCK, j * FP8_BLOCK] = 0x7E | (rng.integers(0, 2) << 7)
    w = np_e4m3(q) * expand(np_e8m0(s), FP8_BLOCK, FP8_BLOCK, shape)
    wq, sc = quant_fp8(torch.from_numpy(w))
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == shape
    assert sc.dtype == torch.float8_e8m0fnu and sc.shape == ts
    np.testing.assert_array_equal(u8(sc), s)
    np.testing.assert_array_equal(u8(wq), q)
    np.testing.assert_array_equal(bits(dequant_fp8(wq, sc)), bits(w))


@pytest.mark.parametrize("shape", [(64, 256), (3, 32)])
def test_mxfp4_roundtrip_exact(shape):
    rng = np.random.default_rng(2)
    out, inp = shape
    codes = rng.integers(0, 15, size=shape)
    codes = np.where(codes >= 8, codes + 1, codes).astype(np.uint8)  # no -0 (encoded as +0)
    nb = inp // MXFP4_BLOCK
    codes.reshape(out, nb, MXFP4_BLOCK)[:, :, 0] = 7 | (rng.integers(0, 2, size=(out, nb)) << 3)
    s = rng.integers(100, 150, size=(out, nb)).astype(np.uint8)
    s[0, 0] = 1  # smallest scale the quantizer emits (2^-126, subnormal products)
    s[-1, -1] = 252  # 6 * 2^125 still finite
    w = np_nibbles(pack_fp4(torch.from_numpy(codes)).numpy()) * expand(np_e8m0(s), 1, 32, shape)
    packed, sc = quant_mxfp4(torch.from_numpy(w))
    assert packed.dtype == torch.int8 and packed.shape == (out, inp // 2)
    assert sc.dtype == torch.float8_e8m0fnu and sc.shape == (out, nb)
    np.testing.assert_array_equal(u8(sc), s)
    np.testing.assert_array_equal(unpack_fp4(packed).numpy(), codes)
    np.testing.assert_array_equal(bits(dequant_mxfp4(packed, sc)), bits(w))


def test_mxfp4_roundtrip_values_without_max_code():
    # blocks whose max code is < 6 get a smaller scale but still dequantize to the same values
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 7, size=(16, 64)).astype(np.uint8)  # magnitudes up to 4
    s = rng.integers(110, 140, size=(16, 2)).astype(np.uint8)
    w = np_nibbles(pack_fp4(torch.from_numpy(codes)).numpy()) * expand(np_e8m0(s), 1, 32, (16, 64))
    np.testing.assert_array_equal(bits(dequant_mxfp4(*quant_mxfp4(torch.from_numpy(w)))), bits(w))


@pytest.mark.parametrize("shape", [(32, 128), (3, 16)])
def test_nvfp4_roundtrip_exact(shape):
    rng = np.random.default_rng(4)
    out, inp = shape
    nb = inp // NVFP4_BLOCK
    codes = rng.integers(0, 15, size=shape)
    codes = np.where(codes >= 8, codes + 1, codes).astype(np.uint8)
    codes.reshape(out, nb, NVFP4_BLOCK)[:, :, 3] = 7 | (rng.integers(0, 2, size=(out, nb)) << 3)
    ws = rng.integers(1, 0x7F, size=(out, nb)).astype(np.uint8)  # positive e4m3, subnormals too
    ws[0, 0] = 0x7E  # 448: the global amax is 6 * 448 * ws2
    ws2 = np.float32(2.0**-12)
    w = (
        np_nibbles(pack_fp4(torch.from_numpy(codes)).numpy())
        * expand(np_e4m3(ws), 1, NVFP4_BLOCK, shape)
    ) * ws2
    packed, sc, sc2, isc = quant_nvfp4(torch.from_numpy(w))
    assert packed.dtype == torch.uint8 and packed.shape == (out, inp // 2)
    assert sc.dtype == torch.float8_e4m3fn and sc.shape == (out, nb)
    assert sc2.dtype == torch.float32 and sc2.shape == () and sc2.item() == ws2
    assert isc.dtype == torch.float32 and isc.shape == () and isc.item() == 1.0
    np.testing.assert_array_equal(u8(sc), ws)
    np.testing.assert_array_equal(unpack_fp4(packed).numpy(), codes)
    np.testing.assert_array_equal(bits(dequant_nvfp4(packed, sc, sc2)), bits(w))


# ---------------------------------------------------------------------------------------------
# rounding rules and error bounds on gaussian weights
# ---------------------------------------------------------------------------------------------


def test_e2m1_rounding_nearest_ties_to_even_code():
    rng = np.random.default_rng(5)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = np.concatenate([mids, -mids, rng.uniform(-6, 6, size=4000), [0.0, -0.1, -0.25, 6, -6]])
    y = y[: (len(y) // 31) * 31].reshape(-1, 31).astype(np.float32)
    w = np.concatenate([np.full((y.shape[0], 1), 6.0, np.float32), y], axis=1) * 0.125
    packed, sc = quant_mxfp4(torch.from_numpy(w))
    assert (u8(sc) == 127 - 3).all()  # amax 6 * 2^-3 -> scale 2^-3
    got = unpack_fp4(packed).numpy()[:, 1:]
    # brute force: nearest grid magnitude, ties to the even code, sign only if non-zero
    grid = np.array(E2M1_PY[:8])
    mag = np.minimum(np.abs(y), 6.0)[..., None]
    dist = np.abs(mag - grid)
    parity = np.where(dist == dist.min(-1, keepdims=True), np.arange(8) % 2, 2)
    code = np.argmin(parity, axis=-1)
    code = np.where((y < 0) & (code > 0), code + 8, code)
    np.testing.assert_array_equal(got, code)


def test_scale_is_smallest_power_of_two_at_boundaries():
    up = float(np.nextafter(np.float32(448), np.float32(1e9)))
    for amax, s_exp in [(448.0, 127), (up, 128), (224.0, 126), (1e-6, 127 - 22)]:
        _, sc = quant_fp8(torch.tensor([[amax, 1.0e-7]]))
        assert u8(sc).tolist() == [[s_exp]], amax  # 1e-6 hits the amax >= 1e-4 clamp
    up = float(np.nextafter(np.float32(6), np.float32(1e9)))
    for amax, s_exp in [(6.0, 127), (up, 128), (3.0, 126), (0.0, 1)]:
        w = torch.zeros(1, MXFP4_BLOCK)
        w[0, 7] = -amax
        _, sc = quant_mxfp4(w)
        assert u8(sc).tolist() == [[s_exp]], amax


def test_fp8_gaussian_error_bound():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((200, 300)) * np.exp(rng.standard_normal((200, 1)) * 3)
    w = torch.from_numpy(w.astype(np.float32))
    wq, sc = quant_fp8(w)
    s = torch.from_numpy(expand(e8m0_to_float(sc).numpy(), 128, 128, (200, 300)))
    err = (dequant_fp8(wq, sc) - w).abs()
    # e4m3 has 3 mantissa bits: half-ulp <= 2^-4 |x| for normals, 2^-10 * scale for subnormals
    assert (err <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)).all()
    # scale is the smallest power of two with amax <= 448 * scale
    amax = torch.from_numpy(expand(np.abs(w.numpy()), 1, 1, (200, 300)))
    amax_t = torch.nn.functional.pad(amax, (0, 84, 0, 56)).view(2, 128, 3, 128).amax((1, 3))
    st = e8m0_to_float(sc)
    assert (amax_t <= 448 * st).all() and (amax_t > 224 * st).all()
    assert (
        err <= amax_t.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2.0**-4
    ).all()


def test_mxfp4_gaussian_error_bound():
    rng = np.random.default_rng(7)
    w = torch.from_numpy((rng.standard_normal((64, 512)) * 0.02).astype(np.float32))
    packed, sc = quant_mxfp4(w)
    s = e8m0_to_float(sc).repeat_interleave(MXFP4_BLOCK, 1)
    err = (dequant_mxfp4(packed, sc) - w).abs()
    # half the e2m1 grid gap: 0.25 below 2, 0.5 in [2, 4], 1 in [4, 6] (units of the scale)
    assert (err <= torch.maximum(s / 4, w.abs() / 4)).all()
    amax = w.abs().view(64, -1, MXFP4_BLOCK).amax(-1)
    st = e8m0_to_float(sc)
    assert (amax <= 6 * st).all() and (amax > 3 * st).all()
    assert (err.view(64, -1, MXFP4_BLOCK).amax(-1) <= amax / 3).all()


def test_nvfp4_gaussian_error_bound():
    rng = np.random.default_rng(8)
    w = torch.from_numpy((rng.standard_normal((64, 512)) * 0.02).astype(np.float32))
    packed, sc, sc2, _ = quant_nvfp4(w)
    assert sc2.item() == np.float32(w.abs().max().item()) / np.float32(448 * 6)
    unit = (sc.float() * sc2).repeat_interleave(NVFP4_BLOCK, 1)
    y = (w / unit).abs()
    err = (dequant_nvfp4(packed, sc, sc2) - w).abs()
    # grid half-gap as for mxfp4; |y| may exceed 6 by the e4m3 rounding of the block scale
    # (<= 6 * 2^-4 / (1 - 2^-4) = 0.4), which |y|/4 >= 1.5 covers; 1e-6 for fp32 rounding
    assert (y <= 6 * (1 + 2.0**-4) / (1 - 2.0**-4)).all()
    assert (err <= unit * torch.maximum(torch.full_like(y, 0.25), y / 4) * (1 + 1e-6)).all()
    rel = ((dequant_nvfp4(packed, sc, sc2) - w).norm() / w.norm()).item()
    assert rel < 0.15


# ---------------------------------------------------------------------------------------------
# independent numpy dequantization, bit for bit, on random bytes
# ---------------------------------------------------------------------------------------------


def test_dequant_fp8_matches_numpy():
    rng = np.random.default_rng(9)
    shape = (200, 300)
    q = rand_e4m3_bytes(rng, shape)
    s = rng.integers(0, 255, size=fp8_scale_shape(*shape)).astype(np.uint8)
    ref = np_e4m3(q) * expand(np_e8m0(s), 128, 128, shape)
    got = dequant_fp8(t_e4m3(q), t_e8m0(s))
    assert got.dtype == torch.float32 and got.shape == shape
    np.testing.assert_array_equal(bits(got), bits(ref))
    bf = dequant_fp8(t_e4m3(q), t_e8m0(s), dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, got.to(torch.bfloat16))


def test_dequant_mxfp4_matches_numpy():
    rng = np.random.default_rng(10)
    b = rng.integers(-128, 128, size=(64, 128)).astype(np.int8)
    s = rng.integers(0, 255, size=(64, 256 // 32)).astype(np.uint8)
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows to inf, in torch too
        ref = np_nibbles(b.view(np.uint8)) * expand(np_e8m0(s), 1, 32, (64, 256))
    got = dequant_mxfp4(torch.from_numpy(b), t_e8m0(s))
    np.testing.assert_array_equal(bits(got), bits(ref))
    got_u8 = dequant_mxfp4(torch.from_numpy(b.view(np.uint8)), t_e8m0(s))
    np.testing.assert_array_equal(bits(got_u8), bits(ref))


def test_dequant_nvfp4_matches_numpy():
    rng = np.random.default_rng(11)
    b = rng.integers(0, 256, size=(64, 128)).astype(np.uint8)
    ws = rand_e4m3_bytes(rng, (64, 256 // 16))
    ws2 = np.float32(3.7e-4)
    ref = (np_nibbles(b) * expand(np_e4m3(ws), 1, 16, (64, 256))) * ws2
    got = dequant_nvfp4(torch.from_numpy(b), t_e4m3(ws), torch.tensor(ws2))
    np.testing.assert_array_equal(bits(got), bits(ref))


# ---------------------------------------------------------------------------------------------
# lossless MXFP4 -> FP8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,lo,hi", [((256, 512), 120, 135), ((200, 96), 0, 7)])
def test_mxfp4_to_fp8_lossless(shape, lo, hi):
    rng = np.random.default_rng(12)
    b = rng.integers(-128, 128, size=(shape[0], shape[1] // 2)).astype(np.int8)
    s = rng.integers(lo, hi, size=(shape[0], shape[1] // 32)).astype(np.uint8)
    packed, sc = torch.from_numpy(b), t_e8m0(s)
    q, t = mxfp4_to_fp8(packed, sc)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert t.dtype == torch.float8_e8m0fnu and t.shape == fp8_scale_shape(*shape)
    # tile scale = max block scale / 2^6 (floored at S = 0)
    tmax = np.pad(s, ((0, -shape[0] % 128), (0, -(shape[1] // 32) % 4)))
    tmax = tmax.reshape(t.shape[0], 128, t.shape[1], 4).max(axis=(1, 3)).astype(np.int64)
    np.testing.assert_array_equal(u8(t), np.maximum(tmax - 6, 0))
    np.testing.assert_array_equal(bits(dequant_fp8(q, t)), bits(dequant_mxfp4(packed, sc)))


def test_mxfp4_to_fp8_spread_limit():
    # spread of 14 binades within a tile is still exact; 15 loses the 0.5 code
    packed = torch.full((128, 64), 0x31, dtype=torch.int8)  # codes 1 (0.5) and 3 (1.5)
    s = np.full((128, 4), 140, np.uint8)
    s[5, 2] = 140 - 14
    q, t = mxfp4_to_fp8(packed, t_e8m0(s))
    assert torch.equal(dequant_fp8(q, t), dequant_mxfp4(packed, t_e8m0(s)))
    s[5, 2] = 140 - 15
    with pytest.raises(ValueError, match="lossy"):
        mxfp4_to_fp8(packed, t_e8m0(s))
    q, t = mxfp4_to_fp8(packed, t_e8m0(s), strict=False)  # reference behaviour: rounds
    assert q.shape == (128, 128)


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def raises(fn, *args, match: str, **kw):
    with pytest.raises(ValueError, match=re.escape(match)):
        fn(*args, **kw)


def test_fp4_packed_presented_as_fp8():
    packed, sc = quant_mxfp4(torch.randn(256, 256))
    raises(dequant_fp8, packed, t_e8m0(np.full((2, 1), 127)), match="torch.int8")
    raises(dequant_fp8, packed, sc, match="torch.int8")


def test_bad_fp8_inputs():
    wq, sc = quant_fp8(torch.randn(200, 300))
    raises(dequant_fp8, wq, t_e8m0(np.full((2, 2), 127)), match="(2, 2)")
    raises(dequant_fp8, wq, t_e8m0(np.full((2, 2), 127)), match="(200, 300)")
    raises(dequant_fp8, wq, sc.float(), match="torch.float32")
    raises(dequant_fp8, wq[0], sc, match="(300,)")
    raises(quant_fp8, torch.randn(4, 4, 4), match="(4, 4, 4)")
    raises(quant_fp8, torch.tensor([[1.0, float("nan")]]), match="(1, 2)")
    raises(quant_fp8, torch.ones(4, 4, dtype=torch.int32), match="torch.int32")


def test_bad_mxfp4_inputs():
    raises(quant_mxfp4, torch.randn(4, 48), match="48")
    raises(
        dequant_mxfp4,
        torch.zeros(4, 24, dtype=torch.int8),
        t_e8m0(np.full((4, 1), 127)),
        match="48",
    )
    packed, sc = quant_mxfp4(torch.randn(4, 64))
    raises(dequant_mxfp4, packed, sc[:, :1], match="(4, 1)")
    raises(dequant_mxfp4, packed, sc.float().to(torch.float8_e4m3fn), match="float8_e4m3fn")
    raises(dequant_mxfp4, packed.float(), sc, match="torch.float32")
    raises(mxfp4_to_fp8, packed, sc.view(torch.uint8), match="torch.uint8")
    raises(pack_fp4, torch.full((1, 2), 16, dtype=torch.uint8), match="(1, 2)")
    raises(pack_fp4, torch.zeros(1, 3, dtype=torch.uint8), match="(1, 3)")


def test_bad_nvfp4_inputs():
    raises(quant_nvfp4, torch.randn(4, 24), match="24")
    packed, sc, sc2, _ = quant_nvfp4(torch.randn(4, 64))
    raises(
        dequant_nvfp4,
        packed,
        sc.view(torch.uint8).view(torch.float8_e8m0fnu),
        sc2,
        match="float8_e8m0fnu",
    )
    raises(dequant_nvfp4, packed, sc[:, :2], sc2, match="(4, 2)")
    raises(dequant_nvfp4, packed, sc, sc2.bfloat16(), match="torch.bfloat16")
    raises(dequant_nvfp4, packed, sc, torch.ones(2), match="(2,)")
    raises(dequant_nvfp4, packed.view(torch.float8_e4m3fn), sc, sc2, match="float8_e4m3fn")


def test_zero_weights():
    z = torch.zeros(130, 64)
    assert not dequant_fp8(*quant_fp8(z)).any()
    assert not dequant_mxfp4(*quant_mxfp4(z)).any()
    packed, sc, sc2, _ = quant_nvfp4(z)
    assert sc2.item() == 1.0 and not dequant_nvfp4(packed, sc, sc2).any()
