"""Exact dequantizers and matching quantizers for the DeepSeek-V4 checkpoint byte formats."""

from __future__ import annotations

import functools

import torch

FP8_BLOCK = 128  # FP8 weights: one UE8M0 scale per 128x128 tile
MXFP4_BLOCK = 32  # MXFP4 experts: one UE8M0 scale per 32 elements of a row
NVFP4_BLOCK = 16  # NVFP4 experts: one E4M3 scale per 16 elements of a row

E4M3_MAX = 448.0
KV_AMAX_FLOOR = 1e-4  # the reference's act_quant floor on a block's amax (weights, KV, keys)
E2M1_MAX = 6.0

# e2m1 nibble code -> value; bit 3 is the sign, code 8 is -0.0
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# byte -> (value of low nibble, value of high nibble): fp32 [256, 2], low nibble = even element
_PAIR_VALUES = torch.stack(
    [E2M1_VALUES[torch.arange(256) & 0x0F], E2M1_VALUES[torch.arange(256) >> 4]], dim=-1
)


@functools.cache
def _pair_values(device: torch.device) -> torch.Tensor:
    # one copy per device: a host->device copy per call would also sync the stream every time
    return _PAIR_VALUES.to(device)


# midpoints between magnitude codes k and k+1, and whether a tie goes up (k+1 even)
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

_FP4_PACKED_DTYPES = (torch.int8, torch.uint8)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_float_2d(w: torch.Tensor, what: str) -> None:
    _check(w.dim() == 2, f"{what} must be 2-D [out, in], got shape {tuple(w.shape)}")
    _check(
        w.is_floating_point() and w.element_size() >= 2,
        f"{what} must be a bf16/fp16/fp32/fp64 tensor, got dtype {w.dtype}",
    )
    _check(bool(torch.isfinite(w).all()), f"{what} of shape {tuple(w.shape)} has inf/nan values")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (host code: `triton.cdiv` is far slower)."""
    return -(-a // b)


def _exp2i(e: torch.Tensor) -> torch.Tensor:
    # int exponent -> fp32 2^e built from bits (exact, incl. subnormals; 0 below 2^-149)
    e = e.to(torch.int32).clamp(-150, 127)
    bits = torch.where(e >= -126, (e + 127) << 23, 1 << (e + 149).clamp_(min=0))
    return torch.where(e < -149, 0, bits).view(torch.float32)


def _pow2_exponent_at_least(x: torch.Tensor, limit: float) -> torch.Tensor:
    # smallest int32 e with x <= limit * 2^e, exactly (frexp, no log2). x / limit (normal) can't
    # round onto a power of two from above: the gap is >= ulp(x) / limit > half an ulp there
    m, e = torch.frexp(x / limit)  # x/limit = m * 2^e, m in [0.5, 1)
    return e - (m == 0.5).to(torch.int32)  # exact power of two: ceil(log2) is e-1


def _e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    # int exponent in [-127, 127] -> float8_e8m0fnu with S = e + 127
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    # fp32 values already divided by their scale -> uint8 codes; |y| clamped to 6,
    # round to nearest, ties to the even code (= round-half-even on the e2m1 grid)
    mag = y.abs().clamp_(max=E2M1_MAX)
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (mag >= mid) if tie_up else (mag > mid)
    # sign bit only for non-zero codes: values that round to zero are encoded as +0 (code 0)
    code += ((y < 0) & (code != 0)).to(torch.uint8) << 3
    return code


def _e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    # uint8/int8 [out, in/2] -> fp32 [out, in], low nibble first
    p = packed.view(torch.uint8).long()
    return _pair_values(packed.device)[p].flatten(-2)


def _tile_mul(x: torch.Tensor, s: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    # x fp32 [R, C] times s fp32 [ceil(R/br), ceil(C/bc)] broadcast over br x bc tiles
    r, c = x.shape
    if r % br == 0 and c % bc == 0:
        return (x.view(r // br, br, c // bc, bc) * s[:, None, :, None]).view(r, c)
    return x * s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def _tile_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    # max over br x bc tiles of a non-negative [R, C] tensor, edge tiles zero-padded
    r, c = x.shape
    pr, pc = cdiv(r, br) * br - r, cdiv(c, bc) * bc - c
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.view(x.shape[0] // br, br, x.shape[1] // bc, bc).amax(dim=(1, 3))


def _e4m3_tiles(x: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 [R, C] -> (e4m3 codes, int32 exponents e per br x bc tile): the smallest 2^e with
    # max(amax, 1e-4) <= 448 * 2^e, then e4m3(clamp(x * 2^-e)) (exact scaling, round to nearest even)
    amax = _tile_amax(x.abs(), br, bc).clamp_(min=KV_AMAX_FLOOR)
    e = _pow2_exponent_at_least(amax, E4M3_MAX)
    q = _tile_mul(x, _exp2i(-e), br, bc).clamp_(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), e


def _check_fp4_packed(packed: torch.Tensor, block: int, fmt: str) -> int:
    # returns the logical in-dimension
    _check(
        packed.dtype in _FP4_PACKED_DTYPES,
        f"{fmt} packed weight dtype {packed.dtype} is not int8/uint8 (two e2m1 per byte)",
    )
    _check(
        packed.dim() == 2,
        f"{fmt} packed weight must be 2-D [out, in/2], got shape {tuple(packed.shape)}",
    )
    inp = packed.shape[1] * 2
    _check(
        inp % block == 0,
        f"{fmt} packed weight {tuple(packed.shape)}: in={inp} is not divisible by {block}",
    )
    return inp


# ---------------------------------------------------------------------------------------------
# scales and nibbles
# ---------------------------------------------------------------------------------------------


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> fp32, exactly 2^(S-127) (S=0: fp32 subnormal 2^-127); S=255 -> nan."""
    _check(
        scale.dtype == torch.float8_e8m0fnu,
        f"e8m0 scale dtype {scale.dtype} is not torch.float8_e8m0fnu",
    )
    s = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(s == 0, 0x00400000, s << 23)  # fp32 exponent field = S for S >= 1
    bits = torch.where(s == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def fp8_scale_shape(out: int, inp: int) -> tuple[int, int]:
    """Shape of the UE8M0 scale of an FP8 [out, in] weight."""
    return cdiv(out, FP8_BLOCK), cdiv(inp, FP8_BLOCK)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [..., in] (0..15) -> uint8 [..., in/2], element 2k in the low nibble."""
    _check(codes.dtype == torch.uint8, f"fp4 codes dtype {codes.dtype} is not torch.uint8")
    _check(
        codes.dim() >= 1 and codes.shape[-1] % 2 == 0,
        f"fp4 codes shape {tuple(codes.shape)} needs an even last dimension",
    )
    _check(bool((codes < 16).all()), f"fp4 codes of shape {tuple(codes.shape)} exceed 15")
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., in/2] -> uint8 e2m1 codes [..., in], low nibble first."""
    _check(packed.dtype in _FP4_PACKED_DTYPES, f"fp4 packed dtype {packed.dtype} is not int8/uint8")
    p = packed.view(torch.uint8)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# FP8: e4m3 [out, in], UE8M0 scale per 128x128 tile
# ---------------------------------------------------------------------------------------------


def quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], e8m0 [ceil(out/128), ceil(in/128)]), UE8M0 scales."""
    _check_float_2d(w, "fp8 weight")
    q, e = _e4m3_tiles(w.float(), FP8_BLOCK, FP8_BLOCK)
    return q, _e8m0_from_exponent(e)


def dequant_fp8(
    wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e4m3 [out, in] with e8m0 tile scales -> dtype [out, in] (exact in fp32)."""
    _check(
        wq.dtype == torch.float8_e4m3fn,
        f"fp8 weight dtype {wq.dtype} (shape {tuple(wq.shape)}) is not torch.float8_e4m3fn"
        + (" (looks like an FP4-packed tensor)" if wq.dtype in _FP4_PACKED_DTYPES else ""),
    )
    _check(wq.dim() == 2, f"fp8 weight must be 2-D [out, in], got shape {tuple(wq.shape)}")
    _check(
        scale.dtype == torch.float8_e8m0fnu,
        f"fp8 scale dtype {scale.dtype} is not torch.float8_e8m0fnu",
    )
    exp = fp8_scale_shape(*wq.shape)
    _check(
        tuple(scale.shape) == exp,
        f"fp8 scale shape {tuple(scale.shape)} does not match "
        f"weight {tuple(wq.shape)} (expected {exp})",
    )
    # e4m3 * 2^k is exact in fp32
    w = _tile_mul(wq.float(), e8m0_to_float(scale), FP8_BLOCK, FP8_BLOCK)
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------
# MXFP4: e2m1 packed [out, in/2], UE8M0 scale per 32 elements of a row
# ---------------------------------------------------------------------------------------------


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 packed [out, in/2], e8m0 [out, in/32]), UE8M0 block scales."""
    _check_float_2d(w, "mxfp4 weight")
    out, inp = w.shape
    _check(
        inp % MXFP4_BLOCK == 0,
        f"mxfp4 weight {tuple(w.shape)}: in={inp} is not divisible by {MXFP4_BLOCK}",
    )
    wb = w.float().view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    # clamp so the exponent stays >= -126 (S >= 1); all-zero blocks get scale 2^-126
    amax = wb.abs().amax(dim=-1).clamp_(min=E2M1_MAX * 2.0**-126)
    e = _pow2_exponent_at_least(amax, E2M1_MAX)  # smallest 2^e with amax <= 6 * 2^e
    y = wb / _exp2i(e)[..., None]  # exact (power of two)
    codes = _e2m1_codes(y).view(out, inp)
    return pack_fp4(codes).view(torch.int8), _e8m0_from_exponent(e)


def dequant_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """int8/uint8 packed [out, in/2] with e8m0 [out, in/32] -> dtype [out, in] (exact in fp32)."""
    inp = _check_fp4_packed(packed, MXFP4_BLOCK, "mxfp4")
    out = packed.shape[0]
    _check(
        scale.dtype == torch.float8_e8m0fnu,
        f"mxfp4 scale dtype {scale.dtype} is not torch.float8_e8m0fnu",
    )
    exp = (out, inp // MXFP4_BLOCK)
    _check(
        tuple(scale.shape) == exp,
        f"mxfp4 scale shape {tuple(scale.shape)} does not match "
        f"packed weight {tuple(packed.shape)} (expected {exp})",
    )
    v = _e2m1_decode(packed).view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    return (v * e8m0_to_float(scale)[..., None]).view(out, inp).to(dtype)


# ---------------------------------------------------------------------------------------------
# NVFP4 (ModelOpt): e2m1 packed [out, in/2], e4m3 scale per 16, fp32 global scale
# ---------------------------------------------------------------------------------------------


def quant_nvfp4(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (uint8 packed, e4m3 scale [out, in/16], fp32 scale_2 [], input_scale [])."""
    _check_float_2d(w, "nvfp4 weight")
    out, inp = w.shape
    _check(
        inp % NVFP4_BLOCK == 0,
        f"nvfp4 weight {tuple(w.shape)}: in={inp} is not divisible by {NVFP4_BLOCK}",
    )
    wb = w.float().view(out, inp // NVFP4_BLOCK, NVFP4_BLOCK)
    ws2 = wb.abs().amax() / (E4M3_MAX * E2M1_MAX)
    ws2 = torch.where(ws2 > 0, ws2, torch.ones_like(ws2))  # all-zero (or underflowing) weight
    # block scale may round (RNE) below the exact ratio: codes above 6 are then clamped
    bs = (wb.abs().amax(dim=-1) / (E2M1_MAX * ws2)).clamp_(max=E4M3_MAX)
    bs = bs.to(torch.float8_e4m3fn)
    unit = bs.float() * ws2  # fp32 [out, in/16]
    zero = unit == 0  # zero block, or block scale underflowed e4m3: encode as zeros
    y = wb / torch.where(zero, torch.ones_like(unit), unit)[..., None]
    codes = _e2m1_codes(y).masked_fill_(zero[..., None], 0).view(out, inp)
    # activations are not quantized: input_scale is a placeholder 1.0
    input_scale = torch.tensor(1.0, dtype=torch.float32, device=w.device)
    return pack_fp4(codes), bs, ws2.reshape(()), input_scale


def dequant_nvfp4(
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8/int8 packed [out, in/2], e4m3 [out, in/16], fp32 scalar -> dtype [out, in]."""
    inp = _check_fp4_packed(packed, NVFP4_BLOCK, "nvfp4")
    out = packed.shape[0]
    _check(
        weight_scale.dtype == torch.float8_e4m3fn,
        f"nvfp4 weight_scale dtype {weight_scale.dtype} is not torch.float8_e4m3fn",
    )
    exp = (out, inp // NVFP4_BLOCK)
    _check(
        tuple(weight_scale.shape) == exp,
        f"nvfp4 weight_scale shape {tuple(weight_scale.shape)} does not match packed weight "
        f"{tuple(packed.shape)} (expected {exp})",
    )
    _check(
        weight_scale_2.dtype == torch.float32,
        f"nvfp4 weight_scale_2 dtype {weight_scale_2.dtype} is not torch.float32",
    )
    _check(
        weight_scale_2.numel() == 1,
        f"nvfp4 weight_scale_2 shape {tuple(weight_scale_2.shape)} is not a scalar",
    )
    v = _e2m1_decode(packed).view(out, inp // NVFP4_BLOCK, NVFP4_BLOCK)
    # (e2m1 * e4m3) is exact; the single rounding is the multiply by the fp32 global scale
    w = (v * weight_scale.float()[..., None]) * weight_scale_2.reshape(()).to(packed.device)
    return w.view(out, inp).to(dtype)


# ---------------------------------------------------------------------------------------------
# lossless MXFP4 -> FP8 (DeepSeek convert.py cast_e2m1fn_to_e4m3fn)
# ---------------------------------------------------------------------------------------------


def mxfp4_to_fp8(
    packed: torch.Tensor, scale: torch.Tensor, *, strict: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (packed, e8m0 [out, in/32]) -> (e4m3 [out, in], e8m0 128x128 tile scale), lossless."""
    inp = _check_fp4_packed(packed, MXFP4_BLOCK, "mxfp4")
    out = packed.shape[0]
    _check(
        scale.dtype == torch.float8_e8m0fnu,
        f"mxfp4 scale dtype {scale.dtype} is not torch.float8_e8m0fnu",
    )
    exp = (out, inp // MXFP4_BLOCK)
    _check(
        tuple(scale.shape) == exp,
        f"mxfp4 scale shape {tuple(scale.shape)} does not match "
        f"packed weight {tuple(packed.shape)} (expected {exp})",
    )
    s = scale.view(torch.uint8).to(torch.int32)  # biased exponents [out, in/32]
    _check(bool((s != 255).all()), f"mxfp4 scale {tuple(scale.shape)} holds nan (S=255)")
    per_tile = FP8_BLOCK // MXFP4_BLOCK  # 4 scale columns per 128-wide tile
    # tile scale t = max block scale / 2^6 (6 * 2^6 = 384 <= 448); S_t floored at 0 (2^-127)
    st = (_tile_amax(s, FP8_BLOCK, per_tile) - 6).clamp_(min=0)  # [ceil(out/128), ceil(in/128)]
    st_full = st.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(per_tile, 1)[:, : exp[1]]
    # value * 2^(S - S_t), with S - S_t <= 6: exact in fp32
    v = _e2m1_decode(packed).view(out, exp[1], MXFP4_BLOCK)
    y = (v * _exp2i(s - st_full)[..., None]).view(out, inp)
    q = y.to(torch.float8_e4m3fn)
    if strict:
        # lossless unless a block scale sits > ~14 binades below its tile max (e4m3 underflow)
        bad = q.float() != y
        if bool(bad.any()):
            i, j = (int(k) for k in bad.nonzero()[0])
            raise ValueError(
                f"mxfp4 {tuple(packed.shape)} -> fp8 is lossy at element ({i}, {j}): block scale "
                f"S={int(s[i, j // MXFP4_BLOCK])} is too far below its 128x128 tile max "
                f"S={int(st[i // FP8_BLOCK, j // FP8_BLOCK]) + 6}; pass strict=False to accept"
            )
    return q, st.to(torch.uint8).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------
# FP8 decode-state entries (FlashMLA "MODEL1" / vLLM fp8_ds_mla, spec 9.4): one K=V row of
# head_dim channels as [nope e4m3 | rope bf16 | one UE8M0 exponent per 64 nope channels | pad to 8]
# (Flash: 448 + 128 + 7 + 1 = 584 B). The nope part is the reference's own FP8 simulation (spec
# 3.3: block 64, s = 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 of x / s), so decoding is lossless
# with respect to it; the rope channels stay bf16.
# ---------------------------------------------------------------------------------------------

KV_SCALE_BLOCK = 64  # nope channels per UE8M0 exponent
KV_QUANT_ROWS = 1 << 16  # quant_kv_entries works through this many rows at a time


def kv_entry_layout(head_dim: int, rope_dim: int) -> tuple[int, int, int]:
    """(nope channels, scale bytes, bytes per entry) of an FP8 state entry."""
    nope = head_dim - rope_dim
    _check(
        0 < nope and rope_dim >= 0 and rope_dim % 2 == 0,
        f"fp8 kv entry: head_dim={head_dim}, rope_dim={rope_dim} leaves no nope channels",
    )
    n_scales = cdiv(nope, KV_SCALE_BLOCK)
    return nope, n_scales, 8 * cdiv(nope + 2 * rope_dim + n_scales, 8)


def quant_kv_entries(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[n, head_dim] float -> uint8 [n, entry bytes] (`kv_entry_layout`). The nope channels are
    quantized from x as given (cast it to the activation dtype first), the rope ones cast to bf16."""
    _check(
        x.dim() == 2 and x.is_floating_point(),
        f"kv rows must be 2-D float, got {x.dtype} {tuple(x.shape)}",
    )
    n, d = x.shape
    nope, n_scales, nbytes = kv_entry_layout(d, rope_dim)
    out = torch.zeros(n, nbytes, dtype=torch.uint8, device=x.device)
    for i in range(0, n, KV_QUANT_ROWS):  # fp32 temporaries of a slab of rows at a time
        xf, o = x[i : i + KV_QUANT_ROWS].float(), out[i : i + KV_QUANT_ROWS]
        y, e = _e4m3_tiles(xf[:, :nope], 1, KV_SCALE_BLOCK)  # e: [rows, n_scales]
        o[:, :nope] = y.view(torch.uint8)
        o[:, nope : nope + 2 * rope_dim] = xf[:, nope:].to(torch.bfloat16).view(torch.uint8)
        o[:, nope + 2 * rope_dim : nope + 2 * rope_dim + n_scales] = (e + 127).to(torch.uint8)
    return out


def dequant_kv_entries(e: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """uint8 [..., entry bytes] -> fp32 [..., head_dim], exactly (e4m3 * 2^k and bf16 are fp32)."""
    nope, n_scales, nbytes = kv_entry_layout(head_dim, rope_dim)
    _check(
        e.dtype == torch.uint8 and e.shape[-1] == nbytes,
        f"fp8 kv entries must be uint8 [..., {nbytes}] for head_dim={head_dim}, "
        f"rope_dim={rope_dim}; got {e.dtype} {tuple(e.shape)}",
    )
    lead = e.shape[:-1]
    e = e.reshape(-1, nbytes)
    codes = e[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    s = e[:, nope + 2 * rope_dim : nope + 2 * rope_dim + n_scales].to(torch.int32) - 127
    rope = e[:, nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    out = torch.cat([_tile_mul(codes, _exp2i(s), 1, KV_SCALE_BLOCK), rope], dim=1)
    return out.view(*lead, head_dim)


# ---------------------------------------------------------------------------------------------
# FP8 indexer keys (`--kv-cache-dtype fp8`): vLLM's 132-byte form, d e4m3 codes and one fp32
# scale per key, kept as two tensors (codes [n, d] uint8, scales [n] fp32) so that code rows stay
# 16-byte aligned. The scale is the reference's act_quant rounding over the whole key (a power of
# two, s = 2^ceil(log2(max(amax, 1e-4) / 448))). The reference itself simulates FP4 on these keys
# (spec 5.4) and HF nothing, so unlike the main entries this form is an approximation, as in vLLM.
# ---------------------------------------------------------------------------------------------


def index_key_bytes(d: int) -> int:
    """Bytes of one FP8 indexer key of d channels: d codes and one fp32 scale (Flash: 132)."""
    return d + 4


def quant_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] float -> (uint8 e4m3 codes [n, d], fp32 power-of-two scales [n]). x is quantized as
    given (cast it to the activation dtype first)."""
    _check(
        x.dim() == 2 and x.is_floating_point(),
        f"indexer keys must be 2-D float, got {x.dtype} {tuple(x.shape)}",
    )
    n, d = x.shape
    codes = torch.empty(n, d, dtype=torch.uint8, device=x.device)
    scale = torch.empty(n, dtype=torch.float32, device=x.device)
    for i in range(0, n, KV_QUANT_ROWS):  # fp32 temporaries of a slab of rows at a time
        y, e = _e4m3_tiles(x[i : i + KV_QUANT_ROWS].float(), 1, d)  # e: [rows, 1]
        codes[i : i + KV_QUANT_ROWS] = y.view(torch.uint8)
        scale[i : i + KV_QUANT_ROWS] = _exp2i(e[:, 0])
    return codes, scale


def dequant_index_keys(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(uint8 codes [..., d], fp32 scales [...]) -> fp32 [..., d], exactly."""
    _check(
        codes.dtype == torch.uint8 and scale.dtype == torch.float32,
        f"fp8 indexer keys must be uint8 codes and fp32 scales; got {codes.dtype}, {scale.dtype}",
    )
    _check(
        tuple(scale.shape) == tuple(codes.shape[:-1]),
        f"fp8 indexer keys: scales {tuple(scale.shape)} do not match codes {tuple(codes.shape)}",
    )
    return codes.contiguous().view(torch.float8_e4m3fn).float() * scale[..., None]
