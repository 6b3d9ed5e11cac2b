"""FP8 state entries inside Triton kernels: quantize a tile of K=V rows into entries, and gather
entries back into a tile of values. The byte format and its torch reference are in `dsv4.quant`
(`kv_entry_layout`, `quant_kv_entries`, `dequant_kv_entries`):

  [nope e4m3 codes | rope bf16 | one UE8M0 exponent per 64 nope channels | pad to 8 bytes]

Both directions use integer and exact fp32 arithmetic only (no fp8 conversion instructions), so
the kernels give the torch reference's bytes and values bit for bit, on the GPU and in the
interpreter alike. Used by `rope.norm_rope` (the decode ring store), `rope.compress_store` (the
compressed entries) and `sparse_attn` (the gathers). The FP8 indexer keys (`dsv4.quant.
quant_index_keys`: e4m3 codes, one power-of-two scale per key) are written by `compress_store`
(`store_index_keys`) and read by `indexer` (`decode_codes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4 import quant

E4M3_MAX = tl.constexpr(quant.E4M3_MAX)
AMAX_FLOOR = tl.constexpr(quant.KV_AMAX_FLOOR)
SCALE_BLOCK = tl.constexpr(quant.KV_SCALE_BLOCK)


@triton.jit
def _e4m3_encode(y):
    # fp32 with |y| <= 448 -> uint8 e4m3 codes, round to nearest even (torch's float8_e4m3fn cast)
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7  # -0.0 keeps its sign, as torch's cast does
    a = tl.abs(y)
    # below 2^-6: multiples of 2^-9; a * 512 < 8 is rounded to an integer by adding 2^23
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    ab = a.to(tl.int32, bitcast=True)
    r = ab + 0x7FFFF + ((ab >> 20) & 1)  # round the fp32 mantissa to 3 bits, ties to even
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # exponent bias 127 -> 7
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _e4m3_decode(code):
    # uint8 e4m3 codes -> fp32, exactly
    c = code.to(tl.int32)
    mag = c & 0x7F
    normal = ((mag + 960) << 20).to(tl.float32, bitcast=True)  # exponent + 120, mantissa as is
    v = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2^-9
    return tl.where(c >= 128, -v, v)


@triton.jit
def _bf16_bits(y):
    # fp32 -> bf16 bits (int16), round to nearest even (the interpreter's own cast truncates)
    b = y.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def round_bf16(y):
    # fp32 -> fp32 rounded to bf16 (nearest even), the same on the GPU and in the interpreter
    return (_bf16_bits(y).to(tl.int32) << 16).to(tl.float32, bitcast=True)


def rne_bf16(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """`cast_rne`'s RNE_BF16 for a kernel on t's device writing `dtype` (default t.dtype): the
    interpreter (CPU) casting to bf16."""
    return not t.is_cuda and (dtype or t.dtype) == torch.bfloat16


@triton.jit
def cast_rne(v, ty: tl.constexpr, RNE_BF16: tl.constexpr):
    # fp32 -> ty rounded to nearest even. The interpreter's fp32 -> bf16 cast does not round to
    # nearest, so there (RNE_BF16) the rounding is done on the bits first
    if RNE_BF16:
        v = round_bf16(v)
    return v.to(ty)


@triton.jit
def exp2i(e):
    # int32 e (-126 <= e <= 127) -> fp32 2^e, exactly
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_exponent(amax):
    # smallest e with max(amax, 1e-4) <= 448 * 2^e (= ceil(log2(amax / 448)), division-free: with
    # amax = m * 2^E, e = E - 8 + (m > 1.75))
    ab = tl.maximum(amax, AMAX_FLOOR).to(tl.int32, bitcast=True)
    return ((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def store_entries(
    dst_ptr, row_off, y, row_ok, d, nope, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    # y: [BR, BD] fp32 rows of d channels (already rounded to the activation dtype) -> FP8 entries
    # at dst_ptr (uint8) + row_off [BR] (int64 bytes), rows where row_ok
    SB: tl.constexpr = SCALE_BLOCK if BLOCK_D >= SCALE_BLOCK else BLOCK_D  # <= one scale block
    NB: tl.constexpr = BLOCK_D // SB
    cols = tl.arange(0, BLOCK_D)
    is_nope = cols < nope
    a = tl.where(is_nope[None, :], tl.abs(y), 0.0)
    e = _scale_exponent(tl.max(tl.reshape(a, (BLOCK_R, NB, SB)), axis=2))  # [BR, NB]
    inv = exp2i(-e)
    inv = tl.reshape(tl.broadcast_to(inv[:, :, None], (BLOCK_R, NB, SB)), (BLOCK_R, BLOCK_D))
    q = tl.minimum(tl.maximum(y * inv, -E4M3_MAX), E4M3_MAX)
    base = dst_ptr + row_off
    tl.store(
        base[:, None] + cols[None, :], _e4m3_encode(q), mask=row_ok[:, None] & is_nope[None, :]
    )
    rope_at = (base + nope).to(tl.pointer_type(tl.int16))
    is_rope = (cols >= nope) & (cols < d)
    rope_mask = row_ok[:, None] & is_rope[None, :]
    tl.store(rope_at[:, None] + (cols - nope)[None, :], _bf16_bits(y), mask=rope_mask)
    blocks = tl.arange(0, NB)
    scale_at = base + (2 * d - nope)  # after nope codes and 2 * (d - nope) rope bytes
    tl.store(
        scale_at[:, None] + blocks[None, :],
        (e + 127).to(tl.uint8),
        mask=row_ok[:, None] & (blocks * SCALE_BLOCK < nope)[None, :],
    )


@triton.jit
def load_entries(rows, valid, c0, d, nope, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 DECODE: tl.constexpr = 0):  # fmt: skip
    # rows: [BN] uint8 pointers to entries (valid: gathered, else zeros) -> fp32 [BN, BC] values
    # of channels c0 .. c0 + BC - 1 (c0 a multiple of BC, BC a power of two), exactly.
    # DECODE 0: integer decode (any target, the interpreter too); 1: the GPU's e4m3 conversion
    # (H200, T=64 decode attention: 80.0 vs 87.5 us; converting into bf16 with the scale added to
    # the exponent bits was slower, 83.6)
    SB: tl.constexpr = SCALE_BLOCK if BLOCK_C >= SCALE_BLOCK else BLOCK_C
    NB: tl.constexpr = BLOCK_C // SB
    cols = c0 + tl.arange(0, BLOCK_C)
    is_nope = cols < nope
    is_rope = (cols >= nope) & (cols < d)
    codes = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None] & is_nope[None, :], other=0)
    rope_at = (rows + nope).to(tl.pointer_type(tl.int16))
    rope_mask = valid[:, None] & is_rope[None, :]
    rope = tl.load(rope_at[:, None] + (cols - nope)[None, :], mask=rope_mask, other=0)  # bf16 bits
    blk = (c0 + tl.arange(0, NB) * SB) // SCALE_BLOCK  # [NB] the scale of each SB columns
    s = tl.load(
        rows[:, None] + (2 * d - nope) + blk[None, :],
        mask=valid[:, None] & (blk * SCALE_BLOCK < nope)[None, :],
        other=127,
    ).to(tl.int32)  # S: the block's scale is 2^(S - 127), S >= 105
    v = decode_codes(codes, DECODE)
    scale = exp2i(s - 127)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, NB, SB)) * scale[:, :, None], (BLOCK_N, BLOCK_C))
    out = tl.where(is_nope[None, :], v, (rope.to(tl.int32) << 16).to(tl.float32, bitcast=True))
    return out


# ---- FP8 indexer keys (`dsv4.quant.quant_index_keys`): d e4m3 codes and one fp32 scale per key


@triton.jit
def store_index_keys(codes_ptr, scale_ptr, y, d, BLOCK_D: tl.constexpr):
    # y: [1, BD] fp32 key of d channels (already rounded to the activation dtype) -> its codes at
    # codes_ptr (the row's first code) and its scale (2^e, fp32) at scale_ptr
    cols = tl.arange(0, BLOCK_D)
    e = _scale_exponent(tl.max(tl.where((cols < d)[None, :], tl.abs(y), 0.0), axis=1))  # [1]
    q = tl.minimum(tl.maximum(y * exp2i(-e)[:, None], -E4M3_MAX), E4M3_MAX)
    tl.store(codes_ptr + cols[None, :], _e4m3_encode(q), mask=(cols < d)[None, :])
    tl.store(scale_ptr + tl.zeros([1], tl.int32), exp2i(e))


def decode_mode(device: torch.device) -> int:
    """The DECODE of `load_entries` / `decode_codes` for data on `device`: the GPU's e4m3
    conversion (1) on a GPU, else the integer decode (0: the interpreter has no fp8 conversions)."""
    return 1 if device.type == "cuda" else 0


@triton.jit
def decode_codes(codes, DECODE: tl.constexpr = 0):
    # uint8 e4m3 codes -> fp32, exactly (DECODE as `load_entries`)
    if DECODE == 1:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _e4m3_decode(codes)
